"""A stop request is not a failure: the pretrain flow reads a graceful stop as 'stopped'.

The sigterm drill delivers SIGTERM to rank 1 after step 5 (as a preemption would); both
ranks stop after the same step, commit its checkpoint through the async engine and exit
EXIT_STOPPED. The flow must end without a diagnosis or a restart, say which checkpoint the
next run resumes from, and alert a warning, not an error. The job is handed over as content
(the validated spec), with no YAML file left on disk."""

from __future__ import annotations

from checkpoint.manifest import committed_checkpoints
from flows.pretrain import pretrain
from infra import runfiles
from training.config import load_job_spec


def test_a_stopped_job_is_neither_diagnosed_nor_restarted(prefect_api, make_job, slack):
    job = make_job("stop-request")
    spec = load_job_spec(job)
    # The spec travels as content: the flow and its ranks need no YAML file of the submitter's.
    job.unlink()
    result = pretrain(spec.model_dump(mode="json"), drill_faults=["sigterm@5:1"], backoff_s=0.5)
    # what the ranks read: the spec as this job (its id filled in; the paths here are fixed)
    assert load_job_spec(runfiles.attempt_spec_path(spec.resolved_run_dir, 0)) == spec.for_job(result.job_id)
    stop = runfiles.read_stop_marker(spec.resolved_run_dir)
    assert not result.finished and result.attempts == 1 and result.failures == []
    assert stop is not None and stop.step == 6 and stop.signal == "SIGTERM"
    assert "stopped by request (SIGTERM); stopped after step 6 with checkpoint 6 committed" in result.stopped_because
    assert result.cancelled and result.final_step == 6
    assert 6 in [c.step for c in committed_checkpoints(spec.checkpoint)]
    stopped = [t for t in slack.texts() if "stopped by request" in t]
    assert len(stopped) == 1 and "[WARNING]" in stopped[0]  # a warning, not an error
