"""The ``torchneuron-lab`` command line, run as a subprocess: info, profile, demo, bad arguments."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchneuron_lab.tracing import validate_chrome_trace

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "torchneuron_lab.cli", *args], check=False, cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


SCRIPT = """\
import sys
import torch

print("script args", sys.argv[1:])
x = torch.randn(64, 64, device="neuron")
for _ in range(3):
    y = (x @ x).relu().sum()
print("positive", y.item() > 0)
"""

FAILING = """\
import torch


def boom():
    raise ValueError("the script went wrong")


torch.ones(3, device="neuron") + 1
boom()
"""


def test_info(tmp_path: Path) -> None:
    r = cli("info", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "device: neuron (emulated NeuronCore" in r.stdout
    assert "HBM per device" in r.stdout and "C++ core" in r.stdout


def test_profile_script(tmp_path: Path) -> None:
    (tmp_path / "work.py").write_text(SCRIPT)
    r = cli("profile", "work.py", "a", "b", "--trace", "t.json", "-o", "r.html", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "script args ['a', 'b']" in r.stdout and "positive True" in r.stdout
    assert re.search(r"neuron_profile: \d+ kernels, \d+ transfers, 1 host syncs", r.stdout), r.stdout
    assert "top kernels" in r.stdout and "aten::mm" in r.stdout
    assert "work.py:8" in r.stdout  # the host sync's location in the script
    assert "Chrome trace written to t.json" in r.stdout
    obj = json.loads((tmp_path / "t.json").read_text())
    validate_chrome_trace(obj)
    assert any(e.get("name") == "aten::mm" for e in obj["traceEvents"])
    html = (tmp_path / "r.html").read_text()
    assert "Plotly.newPlot" in html and "cdn.plot.ly" not in html


def test_profile_script_args_after_double_dash(tmp_path: Path) -> None:
    (tmp_path / "work.py").write_text(SCRIPT)
    r = cli("profile", "work.py", "--", "--flag", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "script args ['--flag', '1']" in r.stdout


def test_profile_failing_script(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text(FAILING)
    r = cli("profile", "bad.py", cwd=tmp_path)
    assert r.returncode != 0
    assert "Traceback (most recent call last)" in r.stderr
    assert 'File "bad.py", line 9, in <module>' in r.stderr and "in boom" in r.stderr
    assert "ValueError: the script went wrong" in r.stderr
    assert "torchneuron_lab" not in r.stderr  # the lab's own frames are not shown
    assert "raised ValueError" in r.stdout  # the partial profile is still printed


def test_profile_script_exit_code(tmp_path: Path) -> None:
    (tmp_path / "exit3.py").write_text("import sys\nsys.exit(3)\n")
    assert cli("profile", "exit3.py", cwd=tmp_path).returncode == 3
    (tmp_path / "exit0.py").write_text("import sys\nsys.exit(0)\n")
    assert cli("profile", "exit0.py", cwd=tmp_path).returncode == 0


@pytest.mark.parametrize("args", [(), ("bogus",), ("profile",), ("profile", "x.py", "--bogus"),
                                  ("profile", "missing.py"), ("demo", "--steps", "x")])
def test_bad_arguments_print_usage_and_exit_2(tmp_path: Path, args: tuple[str, ...]) -> None:
    r = cli(*args, cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "usage:" in r.stderr or "error:" in r.stderr


@pytest.mark.slow
def test_demo_writes_offline_html_report(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    r = cli("demo", "-o", str(out), "--steps", "2", cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    m = re.search(r"wrote the HTML report (\S+\.html)", r.stdout)
    assert m, r.stdout
    report = Path(m.group(1))
    assert report.is_file() and report.parent == out
    html = report.read_text()
    assert "plotly" in html.lower() and "Plotly.newPlot" in html
    assert "cdn.plot.ly" not in html
    assert not re.search(r"<script[^>]*src=[\"']https?://", html)  # nothing loaded from a CDN
    assert "placement total neuron:0" in html and "neuron_profile:" in html
    for name in ("trace.json", "quickstart_trace.json"):
        validate_chrome_trace(json.loads((out / name).read_text()))
    assert (out / "memory_snapshot.pickle").is_file() and (out / "summary.json").is_file()
