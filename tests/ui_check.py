"""By hand: do forgeflow's artifacts render in the Prefect UI? (a real server, a real browser)

    .venv/bin/python tests/ui_check.py [--out DIR] [--keep] [--part eval|pretrain|all]

1. starts `prefect server start` on a free port (its own PREFECT_HOME and SQLite; the UI is
   told where its API is with PREFECT_UI_API_URL, or it shows an empty page);
2. eval: runs the evaluate-checkpoint flow for real on three tiny checkpoints of one job (steps
   10, 20, 30; different weights, so the scores move), which publishes the per-checkpoint table
   and the job's trend artifact (score vs step per dataset: an inline base64 PNG, then a table);
3. pretrain: runs the pretrain flow for real (torchrun on CPU) on a tiny job with two drills,
   an infrastructure error then a loss spike, which publishes the placement picture (nodes x
   GPUs) and the loss curve (attempts, the failures labelled, the rollback arrow);
4. opens each artifact's page and the artifacts list in headless Chromium (Debian's
   `chromium`), saves screenshots, and dumps the rendered DOM;
5. checks the DOM: each chart is an <img> with a data:image/png source inside the rendered
   markdown (and the trend table shows every step). Look at the screenshots too: a broken
   image icon passes a DOM check.

Prints the screenshot paths and, last, one JSON object. Needs `apt-get install chromium`.
Not part of `make test` (a browser and ~2-5 minutes); run it after changing how results publish.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUITE = """
name: uicheck
slots: 2
backend_options: {batch_size: 8, device: cpu}
datasets:
  - name: arith-em
    options: {limit: 6}
  - name: capitals-mc
    options: {limit: 6}
  - name: python-keywords-mc
    options: {limit: 6}
task_files: [TASKS]
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"prefect server exited:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"prefect server did not answer {url}/health in {timeout_s:.0f}s")


def _chromium(url: str, screenshot: Path | None = None, dump_dom: bool = False) -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if not exe:
        raise SystemExit("chromium not found: apt-get install -y chromium")
    args = [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--window-size=1600,1400", "--virtual-time-budget=20000"]
    args += [f"--screenshot={screenshot}"] if screenshot else []
    args += ["--dump-dom"] if dump_dom else []
    proc = subprocess.run(args + [url], capture_output=True, text=True, timeout=180)
    return proc.stdout


def _artifact_page(port: int, key: str) -> str:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        artifact = next(a for a in client.read_latest_artifacts() if a.key == key)
    return f"http://127.0.0.1:{port}/artifacts/artifact/{artifact.latest_id or artifact.id}"


def _shoot(page: str, shot: Path, dom_file: Path) -> str:
    """Screenshot and rendered DOM of one page; prints where the screenshot went."""
    _chromium(page, shot)
    dom = _chromium(page, dump_dom=True)
    dom_file.write_text(dom)
    print(f"screenshot: {shot} ({shot.stat().st_size if shot.exists() else 0} bytes) of {page}")
    return dom


def _inline_images(dom: str) -> list[str]:
    return re.findall(r'<img[^>]*src="(data:image/png;base64,[^"]{40})', dom)


def _check_eval(work: Path, out: Path, port: int) -> dict[str, object]:
    from testing.tiny_checkpoint import make_tiny_checkpoint
    from flows.evaluate import evaluate_checkpoint

    root = work / "ui-demo-job" / "checkpoints"
    suite = work / "suite.yaml"
    suite.write_text(SUITE.replace("TASKS", str(REPO / "configs" / "eval" / "tasks" / "example-task.yaml")))
    for seed, step in enumerate((10, 20, 30)):
        ckpt = make_tiny_checkpoint(root / f"step-{step:08d}", seed=seed)
        shutil.rmtree(ckpt / "data")
        evaluate_checkpoint(str(ckpt), suite=str(suite), output_dir=str(work / f"out-{step}"),
                            preload_root=str(work / "shm"))
    page = _artifact_page(port, "eval-trend-ui-demo-job-uicheck")
    dom = _shoot(page, out / "eval-trend-artifact.png", out / "eval-trend-artifact.html")
    _chromium(f"http://127.0.0.1:{port}/artifacts", out / "artifacts-list.png")
    print(f"screenshot: {out / 'artifacts-list.png'}")
    steps_shown = all(re.search(rf"<td[^>]*>\s*{s}\s*</td>", dom) for s in (10, 20, 30))
    return {"chart_img_data_uri": len(_inline_images(dom)) > 0, "table_steps_shown": bool(steps_shown),
            "screenshot": str(out / "eval-trend-artifact.png")}


# The tiny job of the flow tests (tests/integration/flows/conftest.py), shorter.
TINY_PRETRAIN = {
    "training": {"global_batch_size": 8, "micro_batch_size": 2, "steps": 30, "lr": 1.0e-3, "min_lr": 1.0e-4,
                 "warmup_steps": 2, "seed": 1234, "lr_decay_steps": 30},
    "checkpoint": {"interval": 8, "keep_last": 10, "async_save": True},
    "spike": {"window": 20, "min_history": 5, "patience": 3},
}


def _check_pretrain(work: Path, out: Path, port: int) -> dict[str, object]:
    from flows.pretrain import pretrain
    from tests.tiny_job import prepare_tiny_data, write_tiny_job

    job = write_tiny_job(TINY_PRETRAIN, prepare_tiny_data(work / "tiny-data"), work, "ui-pretrain")
    result = pretrain(str(job), drill_faults=["cuda_error@10", "loss_spike@18"], backoff_s=0.5,
                      hang_timeout_s=120, skip_batches=3)
    print(f"pretrain: finished={result.finished} attempts={result.attempts} "
          f"failures={[(f.root_cause, f.step) for f in result.failures]}")
    verdict: dict[str, object] = {"pretrain_finished": result.finished}
    for key, name in (("pretrain-loss-curve", "loss-curve"), ("pretrain-placement", "placement")):
        dom = _shoot(_artifact_page(port, key), out / f"pretrain-{name}-artifact.png",
                     out / f"pretrain-{name}-artifact.html")
        verdict[f"{name}_img_data_uri"] = len(_inline_images(dom)) > 0
        verdict[f"screenshot_{name}"] = str(out / f"pretrain-{name}-artifact.png")
    return verdict


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "runs" / "ui-check"), help="screenshots and DOM dumps")
    parser.add_argument("--keep", action="store_true", help="leave the server's home folder")
    parser.add_argument("--part", choices=("eval", "pretrain", "all"), default="all",
                        help="which flows' artifacts to check (default: both)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ui-check-"))
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PREFECT_HOME=str(work / "home"), PREFECT_API_URL=api, PREFECT_UI_API_URL=api,
               PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{work / 'prefect.db'}",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_LEVEL="WARNING",
               FORGEFLOW_STATE_DIR=str(work / "state"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    log = work / "server.log"
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                               "--port", str(port)], env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        _wait_healthy(api, server, log)
        os.environ.update(env)
        sys.path.insert(0, str(REPO))
        verdict: dict[str, object] = {}
        if args.part in ("eval", "all"):
            verdict.update(_check_eval(work, out, port))
        if args.part in ("pretrain", "all"):
            verdict.update(_check_pretrain(work, out, port))
        print(json.dumps(verdict))
        return 0 if all(v for k, v in verdict.items() if not k.startswith("screenshot")) else 1
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
