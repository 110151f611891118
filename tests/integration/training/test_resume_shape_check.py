"""A real worker resumes only onto a checkpoint of its own model shape.

The worker (`python -m training.train`, a world of one, on the shared tiny prepared data)
stores the job spec's model config with every checkpoint. Resuming with a spec whose model
has another shape is refused before training: one line on stderr naming each field (the
checkpoint's value and the spec's) and the fix, exit 2, the checkpoint left as it was.
Changing what no tensor shape depends on (learning rate, steps) resumes as before.
"""

from __future__ import annotations

from infra import runfiles
from tests.integration.training.test_worker import committed, explain, run_dir, worker, write_spec


def test_a_resume_onto_another_shape_is_refused_naming_the_fields(tiny_job_dict, tiny_prepared, tmp_path):
    first = write_spec(tiny_job_dict, tmp_path, "shaped", training={"steps": 2}, checkpoint={"interval": 2})
    proc = worker(first)
    assert proc.returncode == 0, explain(proc)
    ckpt = run_dir(first) / "ckpt"
    assert committed(ckpt) == [2]

    # The same job folder, a wider model: refused before any step, nothing set aside.
    wider = write_spec(tiny_job_dict, tmp_path, "shaped", training={"steps": 4}, checkpoint={"interval": 2},
                       model={"hidden_size": 128, "ffn_hidden_size": 256})
    refused = worker(wider)
    assert refused.returncode == 2, explain(refused)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in refused.stderr, explain(refused)
    assert errors[0].startswith(f"error: {ckpt}/step-00000002: unable to load the checkpoint: its model has "
                                "another shape than the job spec's: model.hidden_size: checkpoint 64, spec 128; "
                                "model.ffn_hidden_size: checkpoint 128, spec 256. "), errors[0]
    assert "point checkpoint.url at a folder of its own" in errors[0]
    assert committed(ckpt) == [2]
    log = runfiles.log_path(run_dir(wider), 0).read_text()
    assert "event=resumed" not in log and " step=3 " not in log

    # Another learning rate and more steps: the same shapes, so it resumes and trains on.
    longer = write_spec(tiny_job_dict, tmp_path, "shaped", training={"steps": 4, "lr": 5.0e-4},
                        checkpoint={"interval": 2})
    resumed = worker(longer)
    assert resumed.returncode == 0, explain(resumed)
    assert "event=resumed step=2" in runfiles.log_path(run_dir(longer), 0).read_text()
    assert committed(ckpt) == [2, 4]
