"""The ``torchneuron-lab`` command line, run as a subprocess: info, profile, demo, bad arguments."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchneuron_lab.tracing import validate_chrome_trace

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, cwd: Path, timeout: float = 300, json_engine: str | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``torchneuron-lab *args``; ``json_engine`` sets plotly's JSON encoder ("json" or "orjson")."""
    env = dict(os.environ, **(env or {}),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torchneuron_lab.cli"]
    if json_engine is not None:
        code = ("import runpy, sys, plotly.io as pio\n"
                "pio.json.config.default_engine = sys.argv.pop(1)\n"
                "runpy.run_module('torchneuron_lab.cli', run_name='__main__', alter_sys=True)")
        cmd = [sys.executable, "-c", code, json_engine]
    # undecodable bytes of a file name the output repeats are shown as U+FFFD
    return subprocess.run([*cmd, *args], check=False, cwd=cwd, env=env,
                          capture_output=True, encoding="utf-8", errors="replace", timeout=timeout)


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
    assert f"Chrome trace written to {tmp_path / 't.json'}" in r.stdout  # resolved when the command started
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


@pytest.mark.parametrize(("args", "script_args"), [
    # an option of ours between the script and "--": argparse gave the "--" back as unknown and the error
    # suggested `profile work.py -- -- --flag 1`
    (("work.py", "-k", "5", "--", "--flag", "1"), ["--flag", "1"]),
    (("-k", "5", "work.py", "--", "--flag", "1"), ["--flag", "1"]),
    (("work.py", "a", "--", "--flag", "-k", "3"), ["a", "--flag", "-k", "3"]),  # -k after "--" is the script's
    (("--", "work.py", "--flag"), ["--flag"]),  # "--" before the script: the script is the first after it
    (("work.py", "--", "a", "--", "b"), ["a", "--", "b"]),  # a later "--" is the script's too
])
def test_everything_after_double_dash_goes_to_the_script(tmp_path: Path, args: tuple[str, ...],
                                                         script_args: list[str]) -> None:
    (tmp_path / "work.py").write_text("import sys\nprint('script args', sys.argv[1:])\n")
    r = cli("profile", *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"script args {script_args!r}" in r.stdout.splitlines()


def test_double_dash_after_another_command_is_a_usage_error(tmp_path: Path) -> None:
    r = cli("info", "--", "x", cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert "error: unrecognized arguments: -- x" in r.stderr


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


def test_profile_script_with_a_syntax_error_prints_the_error_only(tmp_path: Path) -> None:
    (tmp_path / "syn.py").write_text("x = (\n")
    r = cli("profile", "syn.py", cwd=tmp_path)
    assert r.returncode == 1
    assert "SyntaxError" in r.stderr and "syn.py" in r.stderr
    assert "Traceback" not in r.stderr and "torchneuron_lab" not in r.stderr and "runpy" not in r.stderr


@pytest.mark.parametrize(("args", "message"), [
    (("profile",), "error: the following arguments are required: script\n"),
    (("profile", "missing.py"), "error: no such script: missing.py"),
    (("profile", "."), "error: . is a directory, not a Python script"),
])
def test_profile_script_argument_errors_say_what_is_wrong_with_usage(
        tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    r = cli(*args, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.startswith("usage: torchneuron-lab profile") and message in r.stderr


@pytest.mark.parametrize("args", [(), ("bogus",), ("profile",), ("profile", "x.py", "--bogus"),
                                  ("profile", "missing.py"), ("demo", "--steps", "x"), ("demo", "--steps", "-3"),
                                  ("demo", "--steps", "0")])
def test_bad_arguments_print_usage_and_exit_2(tmp_path: Path, args: tuple[str, ...]) -> None:
    r = cli(*args, cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "usage:" in r.stderr or "error:" in r.stderr


# How the command line is started: its console script (run by this interpreter, as its shebang does) and
# `python -m`, with an interpreter option that takes a value before the module.
_STARTS = {
    "console script": [sys.executable, str(Path(sys.executable).parent / "torchneuron-lab")],
    "python -m": [sys.executable, "-m", "torchneuron_lab.cli"],
    "python -X utf8 -m": [sys.executable, "-X", "utf8", "-m", "torchneuron_lab.cli"],
}


@pytest.mark.parametrize("start", sorted(_STARTS))
@pytest.mark.parametrize(("args", "code"), [(("--help",), 0), (("profile", "--help"), 0), (("profile",), 2),
                                            (("demo", "--steps", "0"), 2), (("bogus",), 2)])
def test_help_and_usage_errors_answer_without_building_the_core(tmp_path: Path, start: str,
                                                                args: tuple[str, ...], code: int) -> None:
    # They built the C++ core first: `torchneuron-lab --help` took 51 s on a fresh install. An empty build
    # cache shows it: nothing may be built (or the directory even made) before the arguments are parsed.
    cache = tmp_path / "cache"
    cmd = _STARTS[start]
    assert Path(cmd[1]).exists() or start != "console script", "the package's console script is not installed"
    env = dict(os.environ, TORCHNEURON_LAB_BUILD_DIR=str(cache),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([*cmd, *args], check=False, cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == code, (r.stdout, r.stderr)
    assert (r.stdout if code == 0 else r.stderr).startswith("usage: torchneuron-lab")
    assert "building" not in r.stderr and not cache.exists()


def test_a_device_that_cannot_register_is_one_line_and_exit_1(tmp_path: Path) -> None:
    # The command registers the device after parsing; a bad setting says so and exits 1, no traceback.
    r = cli("info", cwd=tmp_path, env={"TORCHNEURON_LAB_NUM_DEVICES": "0"})
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stdout == ""
    assert ("torchneuron-lab: the neuron device could not be registered: ValueError: "
            "TORCHNEURON_LAB_NUM_DEVICES must be an int in [1, 64], got 0") in r.stderr.splitlines()
    assert "Traceback" not in r.stderr


def test_a_script_that_imports_the_package_under_the_command_finds_the_device(tmp_path: Path) -> None:
    # The package is imported before the command registers; the profiled script's own import and its
    # neuron tensors must find the device registered.
    script = tmp_path / "s.py"
    script.write_text("import torchneuron_lab, torch\n"
                      "print('device', torch.ones(2, device='neuron').add(1).sum().item())\n")
    r = cli("profile", str(script), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "device 4.0" in r.stdout.splitlines()


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


def test_demo_negative_steps_says_why(tmp_path: Path) -> None:
    r = cli("demo", "--steps", "-3", cwd=tmp_path)
    assert r.returncode == 2
    assert "argument --steps: must be a positive int, got -3" in r.stderr


def test_script_options_before_double_dash_say_where_they_go(tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text("raise SystemExit('the script must not run')\n")
    r = cli("profile", "x.py", "--lr", "0.1", cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert "usage: torchneuron-lab profile" in r.stderr  # the profile command's usage, not the top level's
    assert ("unrecognized arguments: --lr 0.1. Arguments for the script go after '--', e.g. "
            "torchneuron-lab profile x.py -- --lr 0.1") in r.stderr


def test_profile_help_names_the_magic_once(tmp_path: Path) -> None:
    r = cli("profile", "--help", cwd=tmp_path)
    assert r.returncode == 0
    assert "%%neuron_profile" in r.stdout and "%%%%" not in r.stdout


@pytest.mark.parametrize("option", ["-o", "--trace"])
def test_unwritable_outputs_fail_before_the_script_runs(tmp_path: Path, option: str) -> None:
    (tmp_path / "x.py").write_text("print('SCRIPT RAN')\n")
    r = cli("profile", "x.py", option, "/nonexistent/dir/out.html", cwd=tmp_path)
    assert r.returncode == 2
    assert "SCRIPT RAN" not in r.stdout
    assert f"error: {'-o/--output' if option == '-o' else '--trace'} /nonexistent/dir/out.html: directory " \
           "/nonexistent/dir does not exist" in r.stderr
    r = cli("profile", "x.py", option, str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and "is a directory" in r.stderr and "SCRIPT RAN" not in r.stdout


@pytest.mark.parametrize("args", [
    ("-o", "same.out", "--trace", "same.out"),  # the report would replace the trace (both were "written")
    ("-o", "x.py"),  # the script itself
    ("--trace", "./x.py"),
    ("-o", "link.html"),  # a symlink to the script
    ("--trace", "-"),  # standard output carries the summary
])
def test_outputs_that_would_overwrite_each_other_or_the_script_fail_before_it_runs(
        tmp_path: Path, args: tuple[str, ...]) -> None:
    script = tmp_path / "x.py"
    script.write_text("print('SCRIPT RAN')\n")
    (tmp_path / "link.html").symlink_to(script)
    r = cli("profile", "x.py", *args, cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "SCRIPT RAN" not in r.stdout
    assert script.read_text() == "print('SCRIPT RAN')\n"
    assert not (tmp_path / "same.out").exists() and not (tmp_path / "-").exists()
    expected = {"same.out": "name the same file", "-": "standard output is not supported"}.get(args[-1],
                                                                                                "is the script being profiled")
    assert expected in r.stderr, r.stderr


def test_profile_report_gz_and_a_script_name_with_markup(tmp_path: Path) -> None:
    import gzip

    name = "a<b>c&d.py"
    (tmp_path / name).write_text("import torch\n(torch.ones(8, device='neuron') * 2).sum().item()\n")
    r = cli("profile", name, "-o", "r.html.gz", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = gzip.decompress((tmp_path / "r.html.gz").read_bytes()).decode()  # gzip, as --trace t.json.gz is
    assert "Plotly.newPlot" in text
    # the figure's title shows the name as text: plotly would draw <b> as bold (it reads a title's tags)
    titles = [t for t in re.findall(r'"title":\{"text":"([^"]*)"', text) if "kernel timeline" in t]
    assert titles == ["a&lt;b&gt;c&amp;d.py: kernel timeline"], titles
    assert "<title>torchneuron-lab profile a&lt;b&gt;c&amp;d.py</title>" in text


def test_write_atomically_leaves_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    from torchneuron_lab.tracing.chrome_trace import write_atomically
    from torchneuron_lab.widgets import save_html

    old = tmp_path / "report.html"
    old.write_text("the previous report")

    def half_then_fail(fh: object) -> None:
        fh.write(b"<html>half")  # type: ignore[attr-defined]
        raise KeyboardInterrupt  # Ctrl-C in the middle

    with pytest.raises(KeyboardInterrupt):
        write_atomically(old, half_then_fail)
    assert old.read_text() == "the previous report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]  # no temporary file left
    # save_html: a title UTF-8 cannot encode (a script file name that is not valid UTF-8) is written, not fatal
    import plotly.graph_objects as go

    save_html(go.Figure(), old, title="run of bad\udcffname.py")
    text = old.read_text(encoding="utf-8")
    assert "<title>run of bad\\xffname.py</title>" in text and "Plotly.newPlot" in text


@pytest.mark.parametrize("json_engine", ["json", "orjson"])
def test_save_html_writes_lone_surrogates_in_a_figure_as_escapes(tmp_path: Path, json_engine: str) -> None:
    # a name a user gave a trace from a file name that is not valid UTF-8: orjson refused the whole figure
    import numpy as np
    import plotly.graph_objects as go
    import plotly.io as pio

    from torchneuron_lab.widgets import save_html

    fig = go.Figure(go.Bar(x=[1, 2], y=[3, 4], name="run g\udcff.py", text=np.array(["a\ud800", "b"], dtype=object)))
    fig.update_layout(title="in h\udcfe.py")
    saved = pio.json.config.default_engine
    pio.json.config.default_engine = json_engine
    try:
        path = save_html(fig, tmp_path / "r.html")
    finally:
        pio.json.config.default_engine = saved
    text = path.read_text(encoding="utf-8")
    assert "Plotly.newPlot" in text and fig.data[0].name == "run g\udcff.py"  # the user's figure is untouched
    if json_engine == "orjson":  # escaped by the lab: the file's text names the bytes
        assert '"name":"run g\\\\xff.py"' in text and '"a\\\\ud800"' in text and "in h\\\\xfe.py" in text
    else:  # Python's encoder writes JSON escapes, which the browser reads as the same lone surrogates
        assert '"name":"run g\\udcff.py"' in text and '"a\\ud800"' in text


def test_outputs_resolve_where_the_command_started_even_if_the_script_chdirs(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "moves.py").write_text(
        f"import os, torch\nos.chdir({str(elsewhere)!r})\n(torch.ones(4, device='neuron') * 2).sum().item()\n")
    r = cli("profile", "moves.py", "-o", "r.html", "--trace", "t.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "r.html").is_file() and (tmp_path / "t.json").is_file()
    assert not (elsewhere / "r.html").exists() and not (elsewhere / "t.json").exists()
    names = {e.get("name") for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]}
    assert "aten::mul.Tensor" in names


LOOP = """\
import sys, time, torch
x = torch.randn(32, 32, device="neuron")
n = 0
while True:
    x = (x @ x).tanh()
    n += 1
    if n == 200:
        print("READY", flush=True)
"""


def _start_cli_until(cwd: Path, marker: str, *args: str) -> subprocess.Popen[str]:
    """``torchneuron-lab *args`` in its own session, once its standard output has printed ``marker``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "torchneuron_lab.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 240
    line = ""
    while marker not in line and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise AssertionError(proc.stderr.read() if proc.stderr else "")
    return proc


@pytest.mark.parametrize(("signame", "code"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_sigint_stops_the_script_writes_the_partial_profile_and_exits_130(tmp_path: Path, signame: str,
                                                                           code: int) -> None:
    # SIGTERM (timeout, CI, a job scheduler) wrote no partial profile and no message before
    import signal
    import time

    (tmp_path / "loop.py").write_text(LOOP)
    proc = _start_cli_until(tmp_path, "READY", "profile", "loop.py", "-o", "r.html", "--trace", "t.json")
    try:
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(getattr(signal, signame))
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, (out, err)
    # writing the partial profile (drain, read, summary, HTML with plotly.js, Chrome trace): 12-16 s on an
    # Intel 2-vCPU machine (2026-12-05), less on the AMD ones; a hang is caught at 45 s
    assert elapsed < 45, elapsed
    assert f"interrupted ({signame}): writing the partial profile" in err
    assert "cell raised KeyboardInterrupt" in out or "KeyboardInterrupt" in out, out
    obj = json.loads((tmp_path / "t.json").read_text())
    validate_chrome_trace(obj)
    assert sum(1 for e in obj["traceEvents"] if e.get("name") == "aten::mm") >= 200
    assert "Plotly.newPlot" in (tmp_path / "r.html").read_text()


@pytest.mark.parametrize("json_engine", ["json", "orjson"])
def test_profile_a_script_whose_file_name_is_not_utf8(tmp_path: Path, json_engine: str) -> None:
    # the memory snapshot the profile takes failed on the script's own frames (PyTorch's symbolizer cannot
    # encode the name): an internal traceback, exit 1, and no summary, trace or report. Then, with orjson
    # (plotly's JSON engine when it is installed), the report failed on the name's lone surrogate; a UTF-8
    # terminal (C.UTF-8: stdout strict) could not print the launch lines that name it.
    name = os.fsdecode(b"s\xffx.py")
    (tmp_path / name).write_text("import torch\nx = torch.ones(256, device='neuron')\nprint('ok', (x * 2).sum().item())\n")
    r = cli("profile", name, "-o", "r.html", "--trace", "t.json", cwd=tmp_path, json_engine=json_engine,
            env={"LC_ALL": "C.UTF-8", "PYTHONUTF8": "0", "PYTHONIOENCODING": ""})
    assert r.returncode == 0, r.stderr
    assert "ok 512.0" in r.stdout and "timeline figure written to" in r.stdout, r.stdout
    # the launch lines name the file as its bytes read: s\xffx.py
    assert "s\\xffx.py:3" in r.stdout, r.stdout
    validate_chrome_trace(json.loads((tmp_path / "t.json").read_text()))
    text = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "Plotly.newPlot" in text
    assert "s\\\\xffx.py: kernel timeline" in text  # the title, backslash escaped once more by JSON
    assert "<title>torchneuron-lab profile s\\xffx.py</title>" in text


def test_the_summary_and_outputs_survive_a_script_that_closes_stdout_and_an_ascii_stdout(tmp_path: Path) -> None:
    # a script closing sys.stdout crashed the CLI at its flush and lost the trace and report; an ASCII stdout
    # (PYTHONIOENCODING=ascii) failed printing the summary's arrows and lost the report
    (tmp_path / "closes.py").write_text("import sys, torch\n(torch.ones(4, device='neuron') * 2).sum().item()\n"
                                        "sys.stdout.close()\n")
    proc = cli("profile", "closes.py", "-o", "r.html", "--trace", "t.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "neuron_profile" in proc.stdout and "Plotly.newPlot" in (tmp_path / "r.html").read_text()
    validate_chrome_trace(json.loads((tmp_path / "t.json").read_text()))
    (tmp_path / "copies.py").write_text("import torch\n(torch.ones(4, device='neuron') * 2).cpu()\n")
    proc = cli("profile", "copies.py", "-o", "a.html", "--trace", "a.json", cwd=tmp_path,
               env={"PYTHONIOENCODING": "ascii"})
    assert proc.returncode == 0, proc.stderr
    assert "device\\u2192host" in proc.stdout and (tmp_path / "a.html").is_file()


def test_a_notebook_given_to_profile_and_a_demo_directory_that_is_a_file_fail_at_once(tmp_path: Path) -> None:
    (tmp_path / "nb.ipynb").write_text("{}")
    proc = cli("profile", "nb.ipynb", cwd=tmp_path)
    assert proc.returncode == 2 and "nb.ipynb is a Jupyter notebook: profile its cells with %%neuron_profile" in \
        proc.stderr, proc.stderr
    (tmp_path / "out").write_text("a file")
    t0 = time.monotonic()
    proc = cli("demo", "-o", "out", "--no-report", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "torchneuron-lab demo: error: -o/--output: " in proc.stderr and "exists and is not a directory" in \
        proc.stderr and "Traceback" not in proc.stderr
    assert "step 0" not in proc.stdout and time.monotonic() - t0 < 60  # refused before the training


def test_sigterm_while_demo_runs_the_notebook_says_it_was_interrupted(tmp_path: Path) -> None:
    # nbclient turned the interrupt into an AssertionError: exit 1, "the quickstart notebook failed: AssertionError: "
    import signal

    proc = _start_cli_until(tmp_path, "running the quickstart notebook", "demo", "-o", "d", "--steps", "1")
    try:
        time.sleep(3.0)  # the kernel is starting or running cells
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # nbclient takes the signal while it runs: which one it was is lost, the exit code is Ctrl-C's
    assert proc.returncode in (130, 143), (out, err)
    assert re.search(r"torchneuron-lab demo: interrupted \((SIGTERM|a signal)\) while running the quickstart "
                     "notebook", err), err
    assert (tmp_path / "d" / "trace.json").is_file() and not (tmp_path / "d" / "quickstart_report.html").exists()
