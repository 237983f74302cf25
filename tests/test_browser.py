"""The timeline widget in a real browser: JupyterLab + headless Debian Chromium driven by Playwright.

Starts ``jupyter lab`` on 127.0.0.1 with a random token in a temporary notebook directory, copies the
bundled notebook ``notebooks/timeline_demo.ipynb`` there, opens it in headless Chromium
(``/usr/bin/chromium``: no browser download, never ``playwright install``), runs all cells from the
Run menu, waits for the Plotly timeline to render, checks the plot and the lane labels in the DOM,
clicks a kernel and checks the details panel, and saves a screenshot to ``test-artifacts/``.

Outside CI the test skips when Chromium or Playwright is missing; with ``CI=true`` it fails instead.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "timeline_demo.ipynb"
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
IN_CI = os.environ.get("CI", "").lower() == "true"


def _need(ok: bool, why: str) -> None:
    if ok:
        return
    if IN_CI:
        pytest.fail(f"browser test cannot run in CI: {why}")
    pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_server(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"jupyter lab did not answer {url} within {timeout}s:\n{log.read_text()[-3000:]}")


def _accept_kernel_dialog(page: Any) -> None:
    """Should JupyterLab still ask which kernel to start, take the preselected one (python3)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    dialog = page.locator(".jp-Dialog", has_text="Select Kernel")
    try:
        dialog.wait_for(timeout=3_000)
    except PlaywrightTimeoutError:
        return
    dialog.locator(".jp-Dialog-button.jp-mod-accept").click()


def test_timeline_widget_in_jupyterlab(tmp_path: Path) -> None:
    _need(os.path.exists(CHROMIUM), f"{CHROMIUM} is missing (apt-get install -y chromium)")
    try:
        from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
        from playwright.sync_api import sync_playwright
    except ModuleNotFoundError:
        _need(False, "the playwright package is missing (pip install playwright)")
        raise

    workdir = tmp_path / "nb"
    workdir.mkdir()
    shutil.copy(NOTEBOOK, workdir / "demo.ipynb")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ)
    for var, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                     ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"), ("JUPYTERLAB_SETTINGS_DIR", "settings")):
        env[var] = str(tmp_path / sub)
    # start the notebook's kernel (python3, from its metadata) without the kernel picker; no news toast
    settings = tmp_path / "settings" / "@jupyterlab"
    (settings / "notebook-extension").mkdir(parents=True)
    (settings / "notebook-extension" / "tracker.jupyterlab-settings").write_text('{"autoStartDefaultKernel": true}')
    (settings / "apputils-extension").mkdir(parents=True)
    (settings / "apputils-extension" / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    log = tmp_path / "jupyter.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--allow-root", "--no-browser", "--ip=127.0.0.1",
           f"--port={port}", f"--ServerApp.token={token}", f"--notebook-dir={workdir}",
           "--ServerApp.port_retries=0", "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "browser_timeline.png"
    with open(log, "wb") as log_fh:
        proc = subprocess.Popen(cmd, stdout=log_fh, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_for_server(f"{base}/api/status?token={token}", proc, log)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True, timeout=60_000)
            try:
                page = browser.new_page(viewport={"width": 1600, "height": 1000})
                page.set_default_timeout(60_000)
                page.goto(f"{base}/lab/tree/demo.ipynb?token={token}", timeout=90_000)
                page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
                # kernel up (python3 from the notebook's metadata: no kernel picker)
                page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
                _accept_kernel_dialog(page)
                page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
                page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
                _accept_kernel_dialog(page)
                try:
                    page.wait_for_selector(".js-plotly-plot .main-svg", timeout=180_000)
                    page.wait_for_selector(".js-plotly-plot .ytick text", timeout=60_000)
                except PlaywrightTimeoutError:
                    page.screenshot(path=str(ARTIFACTS / "browser_timeline_failed.png"), full_page=True)
                    raise
                page.wait_for_timeout(1500)  # let the first paint settle

                plot = page.locator(".js-plotly-plot").first
                assert plot.locator("svg.main-svg").count() >= 1
                lanes = page.locator(".js-plotly-plot .ytick text").all_text_contents()
                assert "neuron:0 · tensor" in lanes, lanes
                assert "host" in lanes, lanes
                summary = page.locator(".tnl-summary").inner_text()
                assert "events over" in summary and "syncs" in summary, summary

                # click a kernel: the middle of an 'aten::mm'-carrying hover marker in the main plot area
                drag = page.locator(".js-plotly-plot .nsewdrag").first.bounding_box()
                assert drag is not None
                points = page.locator(".js-plotly-plot .cartesianlayer .scatterlayer path.point")
                target = None
                for i in range(points.count()):
                    box = points.nth(i).bounding_box()
                    if box is None:
                        continue
                    cx, cy = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
                    if drag["x"] < cx < drag["x"] + drag["width"] and drag["y"] < cy < drag["y"] + drag["height"]:
                        target = (cx, cy)
                        break
                assert target is not None, "no kernel marker inside the plot area"
                details = page.locator(".tnl-details").first
                for _ in range(3):
                    page.mouse.move(target[0] - 3, target[1])
                    page.mouse.move(*target)
                    page.wait_for_timeout(300)
                    page.mouse.click(*target)
                    try:
                        page.wait_for_function(
                            "() => (document.querySelector('.tnl-details')?.innerText || '').includes('neighbours')",
                            timeout=10_000,
                        )
                        break
                    except PlaywrightTimeoutError:
                        continue  # the click fell between points or before the comm was up: retry
                text = details.inner_text()
                page.screenshot(path=str(shot), full_page=True)
                assert "neighbours in the lane" in text, text
                assert "duration" in text and "source" in text, text
            finally:
                browser.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    assert shot.exists() and shot.stat().st_size > 10_000
