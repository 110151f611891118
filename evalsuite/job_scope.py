"""What an evaluation that came through Prefect's API may name: one job's own files.

A run of the on-commit or catch-up deployment takes its parameters (and the catch-up its list
of jobs, a Prefect Variable) from whoever can create flow runs or write Variables. Such a run
names a job, and its files come from that job's record in the cluster orchestrator's state
database (`EvalScope`):

- the job: `job_spec`'s `job` must be the id of a job the orchestrator knows, and the spec used
  is the one recorded for it (what `forgeflow submit` committed), never the content given.
  Without a job spec, the job whose checkpoint prefix holds the checkpoint.
- the checkpoint: inside that job's checkpoint prefix, or a folder in its run directory (an
  exported model); symlinks resolved, no `..` or empty segments in an object-store key.
- `output_dir`: inside the job's run directory (default `<run_dir>/eval/step-N-SUITE/`).
- `suite`: a suite name of this checkout (`configs/eval/NAME.yaml`) or a comma list of dataset
  names, never a path: a suite file names folders to read (task files, data) and to write (the
  preload root).
- `preload_root`, `history_path`: not parameters of such a run (the suite's preload root, the
  state directory's history).
- `slurm_cluster_file`: the inventory file of a cluster registered with the orchestrator.

Anything else is one `EvalScopeError` naming the parameter and what it may be. A direct Python
call of the flow (tests, `make demo`, `python flows/evaluate.py`) is not checked: its caller
already runs code as forgeflow. The fine-tuning flow confines its API-created runs to one job's
run directory the same way (`job_holding`, `within`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoint.manifest import CheckpointRef
from evalsuite.errors import EvalConfigError


class EvalScopeError(EvalConfigError):
    """A parameter of an API-created evaluation names something outside its job."""


@dataclass(frozen=True)
class EvalScope:
    """One orchestrator job as an evaluation may touch it."""

    job_id: int
    spec: Any                # training.config.JobSpec: the recorded one
    run_dir: Path            # resolved
    checkpoint_root: str     # a resolved local path, or an object-store URL

    def holds_checkpoint(self, url: str) -> bool:
        return _inside(url, self.checkpoint_root, None) or _inside(url, str(self.run_dir), None)


def _is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def _local(url: str, base: Path | None) -> Path:
    path = Path(url.removeprefix("file://")).expanduser()
    return (base / path if base is not None and not path.is_absolute() else path).resolve()


def _inside(url: str, root: str, base: Path | None) -> bool:
    """Whether `url` names `root` or something under it (local: symlinks resolved; object
    store: same bucket and prefix, and no '.', '..' or empty key segment after it)."""
    if _is_remote(url) or _is_remote(root):
        if not (_is_remote(url) and _is_remote(root)):
            return False
        url, root = url.rstrip("/"), root.rstrip("/")
        if url == root:
            return True
        if not url.startswith(root + "/"):
            return False
        return all(part not in ("", ".", "..") for part in url[len(root) + 1:].split("/"))
    return _local(url, base).is_relative_to(_local(root, base))


def checkpoint_url_of(checkpoint: CheckpointRef | dict | str) -> str:
    """The URL a checkpoint parameter names, before anything is read from it."""
    if isinstance(checkpoint, CheckpointRef):
        return checkpoint.step_url
    if isinstance(checkpoint, dict):
        try:
            return CheckpointRef.from_dict(checkpoint).step_url
        except (TypeError, ValueError) as e:
            raise EvalScopeError(f"checkpoint: {e}") from None
    if not isinstance(checkpoint, str) or not checkpoint:
        raise EvalScopeError(f"checkpoint must be a checkpoint reference or a URL, got {checkpoint!r}")
    return checkpoint


def _job_row(engine, job_id: int):
    import sqlalchemy as sa

    from infra.statedb import read_transaction
    from infra.statedb.schema import jobs

    with read_transaction(engine) as conn:
        return conn.execute(sa.select(jobs.c.id, jobs.c.name, jobs.c.spec, jobs.c.runner)
                            .where(jobs.c.id == job_id)).first()


def _scope(row) -> EvalScope:
    from scheduler.orchestrator.job_logs import run_dir
    from training.config import ConfigError, parse_job_spec

    job = {"id": row.id, "name": row.name, "spec": row.spec, "runner": row.runner}
    try:
        spec = parse_job_spec(row.spec, source=f"the recorded spec of job {row.id}")
    except ConfigError as e:
        raise EvalScopeError(f"job {row.id} ({row.name}) has no valid recorded spec ({e}); it cannot be evaluated "
                             "through the API") from None
    folder = run_dir(job)
    cwd = (row.runner or {}).get("cwd")
    root = spec.checkpoint.url
    if not _is_remote(root):
        root = str(_local(root, Path(cwd) if cwd else Path.cwd()))
    return EvalScope(row.id, spec, folder.resolve(), root)


def recorded_job(engine, job_spec: Any | None, checkpoint: CheckpointRef | dict | str) -> EvalScope:
    """The job an API-created evaluation is for: the one `job_spec` names by its id, else the one
    whose checkpoint prefix holds `checkpoint`; its recorded spec and folders."""
    url = checkpoint_url_of(checkpoint)
    scope = job_named(engine, job_spec) if job_spec is not None else _owner_of_checkpoint(engine, url)
    if not scope.holds_checkpoint(url):
        raise EvalScopeError(f"checkpoint {url} is outside job {scope.job_id}'s checkpoints "
                             f"({scope.checkpoint_root}) and run directory ({scope.run_dir}); an evaluation through "
                             "the API reads only its job's own checkpoints")
    return scope


def job_holding(engine, path: str | Path) -> EvalScope | None:
    """The job whose run directory holds the local file `path` (symlinks resolved:
    `scheduler.orchestrator.job_logs.owning_job`), with its recorded spec and folders; None for a
    file of no job. What a fine-tuning run through the API is confined to (flows/finetune.py)."""
    from scheduler.orchestrator.job_logs import owning_job

    job_id = owning_job(engine, Path(str(path).removeprefix("file://")))
    return None if job_id is None else _scope(_job_row(engine, job_id))


def job_storing(engine, url: str) -> EvalScope | None:
    """The job whose checkpoint prefix holds the object-store `url` (its recorded spec and
    folders), or None: what a diagnosis through the API may fetch from S3 (flows/diagnose.py)."""
    try:
        return _owner_of_checkpoint(engine, url)
    except EvalScopeError:
        return None


def within(url: str, root: str) -> bool:
    """Whether `url` (a local path, file:// or object-store URL) names `root` or something under it
    (symlinks resolved; no '.', '..' or empty key segment in an object-store key)."""
    return _inside(url, root, None)


def job_named(engine, job_spec: Any) -> EvalScope:
    """The job whose id `job_spec` (content: a JobSpec, its dict or JSON) carries, with its
    recorded spec; the rest of the content given is not used."""
    job_id = _job_id(job_spec)
    row = _job_row(engine, job_id)
    if row is None:
        raise EvalScopeError(f"job_spec names job {job_id}, which the cluster orchestrator does not know; "
                             "evaluate a job's checkpoints with its committed spec (the checkpoint event's)")
    scope = _scope(row)
    name = job_spec.get("name") if isinstance(job_spec, dict) else getattr(job_spec, "name", None)
    if isinstance(job_spec, str):
        import json

        name = json.loads(job_spec).get("name")
    if name not in (None, scope.spec.name):
        raise EvalScopeError(f"job_spec names job {job_id} as {name!r}, but job {job_id} is "
                             f"{scope.spec.name!r}; give the job's committed spec")
    return scope


def _job_id(job_spec: Any) -> int:
    if isinstance(job_spec, str) and not job_spec.lstrip().startswith("{"):
        raise EvalScopeError("job_spec must be the job's spec as content (the checkpoint event's), not a file path: "
                             "an evaluation through the API reads no file it is pointed at")
    if isinstance(job_spec, str):
        import json

        try:
            job_spec = json.loads(job_spec)
        except ValueError as e:
            raise EvalScopeError(f"job_spec is not a JSON object: {e}") from None
    job = job_spec.get("job") if isinstance(job_spec, dict) else getattr(job_spec, "job", None)
    if not re.fullmatch(r"\d{1,18}", str(job)):
        raise EvalScopeError(f"job_spec belongs to no orchestrator job (its job is {job!r}); evaluate through the API "
                             "only checkpoints of jobs queued with `forgeflow submit`")
    return int(job)


def _owner_of_checkpoint(engine, url: str) -> EvalScope:
    import sqlalchemy as sa

    from infra.statedb import read_transaction
    from infra.statedb.schema import jobs

    with read_transaction(engine) as conn:
        rows = conn.execute(sa.select(jobs.c.id, jobs.c.name, jobs.c.spec, jobs.c.runner)
                            .where(jobs.c.spec.is_not(None)).order_by(jobs.c.id.desc())).all()
    for row in rows:
        try:
            scope = _scope(row)
        except EvalScopeError:
            continue
        if _inside(url, scope.checkpoint_root, None):
            return scope
    raise EvalScopeError(f"checkpoint {url} is in no job's checkpoints; an evaluation through the API evaluates "
                         "a job's own checkpoints (give its job_spec, as the checkpoint event does)")


def check_output_dir(scope: EvalScope, output_dir: str | None) -> None:
    if output_dir is not None and not _local(output_dir, None).is_relative_to(scope.run_dir):
        raise EvalScopeError(f"output_dir {output_dir} is outside job {scope.job_id}'s run directory ({scope.run_dir}); "
                             "leave it unset (<run_dir>/eval/step-N-SUITE) or name a folder in the run directory")


def check_suite(suite: str) -> None:
    from evalsuite.suite import SUITES_DIR

    if not isinstance(suite, str) or not suite:
        raise EvalScopeError(f"suite must be a suite name, got {suite!r}")
    if (SUITES_DIR / f"{suite}.yaml").is_file() and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", suite) \
            and not Path(suite).exists():
        return
    if ("/" in suite or "\\" in suite or suite.endswith((".yaml", ".yml")) or suite.startswith((".", "~"))
            or Path(suite).exists()):   # load_suite would read a file of that name in the working directory
        raise EvalScopeError(f"suite {suite!r} is a path; an evaluation through the API takes a suite name of "
                             f"this checkout ({', '.join(sorted(p.stem for p in SUITES_DIR.glob('*.yaml')))}) "
                             "or a comma list of dataset names")


def check_not_given(**parameters: Any) -> None:
    for name, value in parameters.items():
        if value is not None:
            raise EvalScopeError(f"{name} is not a parameter of an evaluation through the API (it comes from the "
                                 "suite and the state directory); leave it unset")


def check_cluster_file(engine, path: str | None, parameter: str = "slurm_cluster_file") -> None:
    if path is None:
        return
    import sqlalchemy as sa

    from infra.statedb import read_transaction
    from infra.statedb.schema import clusters

    with read_transaction(engine) as conn:
        sources = [s for (s,) in conn.execute(sa.select(clusters.c.source)) if s]
    if not any(_local(path, None) == _local(s, None) for s in sources):
        raise EvalScopeError(f"{parameter} {path} is not the inventory of a cluster registered with the "
                             "orchestrator; give a registered cluster's file (forgeflow cluster register FILE)")
