"""By hand: do the evaluation's artifacts render in the Prefect UI? (a real server, a real browser)

    .venv/bin/python tests/ui_check.py [--out DIR] [--keep]

1. starts `prefect server start` on a free port (its own PREFECT_HOME and SQLite; the UI is
   told where its API is with PREFECT_UI_API_URL, or it shows an empty page);
2. runs the evaluate-checkpoint flow for real on three tiny checkpoints of one job (steps 10,
   20, 30; different weights, so the scores move), which publishes the per-checkpoint table
   and the job's trend artifact (score vs step per dataset: an inline base64 PNG, then a table);
3. opens the trend artifact's page and the artifacts list in headless Chromium (Debian's
   `chromium`), saves screenshots, and dumps the rendered DOM;
4. checks the DOM: the chart is an <img> with a data:image/png source inside the rendered
   markdown, and the table shows every step. Look at the screenshots too: a broken image
   icon passes a DOM check.

Prints the screenshot paths and, last, one JSON object. Needs `apt-get install chromium`.
Not part of `make test` (a browser and ~2 minutes); run it after changing how results publish.
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "runs" / "ui-check"), help="screenshots and DOM dumps")
    parser.add_argument("--keep", action="store_true", help="leave the server's home folder")
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
        from prefect import get_client

        from evalsuite.fixtures import make_tiny_checkpoint
        from flows.evaluate import evaluate_checkpoint

        root = work / "ui-demo-job" / "checkpoints"
        suite = work / "suite.yaml"
        suite.write_text(SUITE.replace("TASKS", str(REPO / "configs" / "eval" / "tasks" / "example-task.yaml")))
        for seed, step in enumerate((10, 20, 30)):
            ckpt = make_tiny_checkpoint(root / f"step-{step:08d}", seed=seed)
            shutil.rmtree(ckpt / "data")
            evaluate_checkpoint(str(ckpt), suite=str(suite), output_dir=str(work / f"out-{step}"),
                                preload_root=str(work / "shm"))
        with get_client(sync_client=True) as client:
            artifact = client.read_latest_artifacts()
            trend = next(a for a in artifact if a.key == "eval-trend-ui-demo-job-uicheck")
        page = f"http://127.0.0.1:{port}/artifacts/artifact/{trend.latest_id or trend.id}"
        shots = {"trend": out / "eval-trend-artifact.png", "list": out / "artifacts-list.png"}
        _chromium(page, shots["trend"])
        _chromium(f"http://127.0.0.1:{port}/artifacts", shots["list"])
        dom = _chromium(page, dump_dom=True)
        (out / "eval-trend-artifact.html").write_text(dom)
        images = re.findall(r'<img[^>]*src="(data:image/png;base64,[^"]{40})', dom)
        steps_shown = all(re.search(rf"<td[^>]*>\s*{s}\s*</td>", dom) for s in (10, 20, 30))
        for name, path in shots.items():
            print(f"screenshot ({name}): {path} ({path.stat().st_size if path.exists() else 0} bytes)")
        print(f"artifact page: {page}")
        verdict = {"chart_img_data_uri": len(images) > 0, "table_steps_shown": bool(steps_shown),
                   "screenshot": str(shots["trend"])}
        print(json.dumps(verdict))
        return 0 if verdict["chart_img_data_uri"] and verdict["table_steps_shown"] else 1
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
