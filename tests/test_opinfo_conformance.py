"""OpInfo conformance of the neuron device (slow), and tests of the sweep harness itself (fast).

The harness is tests/conformance/opinfo_sweep.py; run it by hand with
``python -m tests.conformance.opinfo_sweep --device neuron`` (report in reports/opinfo_neuron.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

_SWEEP_PATH = Path(__file__).resolve().parent / "conformance" / "opinfo_sweep.py"


def _load_sweep():
    name = "_torchneuron_lab_opinfo_sweep"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _SWEEP_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


sweep = _load_sweep()


def _report_stem(tmp_path: Path, device: str) -> Path:
    base = os.environ.get("TORCHNEURON_LAB_REPORT_DIR")
    directory = Path(base) if base else tmp_path
    return directory / f"opinfo_{device}"


def _by_op(report: dict) -> dict[str, dict]:
    return {rec["op"]: rec for rec in report["results"]}


@pytest.mark.slow
def test_opinfo_conformance_neuron(tmp_path):
    cfg = sweep.SweepConfig(device="neuron", workers=2, preload=["torchneuron_lab"])
    try:
        report = sweep.run_sweep(cfg)
    except sweep.PreflightError as exc:
        pytest.fail(f"neuron device not usable: {exc}")
    _, md_path = sweep.write_report(report, _report_stem(tmp_path, "neuron"))
    print(report["summary_line"], f"(wall {report['wall_time_s']:.0f} s; report {md_path})")
    summary = report["summary"]
    crashes = [f"{r['op']}: {r['message'][:300]}" for r in report["results"] if r["status"] == "crash"]
    assert summary["crash"] == 0, "crashing ops:\n" + "\n".join(crashes)
    failing = [f"{r['op']} [{r['status']}]: {r['message'][:200]}" for r in report["results"]
               if r["status"] in ("fail", "error")]
    assert summary["pass_rate"] is not None and summary["pass_rate"] >= 99.0, (
        report["summary_line"] + f"; report {md_path}\n" + "\n".join(failing[:40]))


def test_harness_cpu_vs_cpu(tmp_path):
    ops = ["add", "matmul", "nn.functional.conv2d"]
    cfg = sweep.SweepConfig(device="cpu", workers=1, only=ops, verbose=False)
    report = sweep.run_sweep(cfg)
    json_path, md_path = sweep.write_report(report, tmp_path / "opinfo_cpu")
    results = _by_op(report)
    assert sorted(results) == sorted(ops)
    for op in ops:
        rec = results[op]
        assert rec["status"] == "pass", rec
        assert 0 < rec["passed"] == rec["total"] <= sweep.DEFAULT_MAX_SAMPLES
    assert report["summary"]["pass_rate"] == 100.0
    assert report["summary_line"] == (
        "opinfo: 3 ops, 3 pass, 0 fail, 0 error, 0 crash, 0 skip; "
        "pass rate 100.0% of runnable (pass/(pass+fail+error+crash))")
    assert json.loads(json_path.read_text())["summary"]["pass"] == 3
    md = md_path.read_text()
    assert report["summary_line"] in md
    assert "| op | status | samples passed/total | message |" in md
    assert "| `matmul` | pass |" in md


_HOOK = '''
import os, time
import torch
from torch.testing._internal.opinfo.core import OpInfo, SampleInput

_calls = {"n": 0}


def _samples(op, device, dtype, requires_grad, **kwargs):
    yield SampleInput(torch.arange(6, dtype=dtype, device=device).reshape(2, 3))
    yield SampleInput(torch.ones(4, dtype=dtype, device=device))


def _flaky(x):  # 1st, 3rd, ... call (CPU) returns x, the next call (device) x + 1
    _calls["n"] += 1
    return x + (_calls["n"] % 2 == 0)


def _device_error(x):
    _calls["n"] += 1
    if _calls["n"] % 2 == 0:
        raise NotImplementedError("no kernel on this device")
    return x * 2


def _cpu_error(x):
    raise RuntimeError("cpu does not do this either")


def _fake(name, fn):
    return OpInfo(name, op=fn, dtypes=(torch.float32,), sample_inputs_func=_samples)


def hook(ops):
    keep = {op.name: op for op in ops if op.name in ("abs", "neg") and not op.variant_test_name}
    return [
        keep["abs"],
        _fake("fake_abort", lambda x: os.abort()),
        _fake("fake_hang", lambda x: time.sleep(3600)),
        _fake("fake_flaky", _flaky),
        _fake("fake_device_error", _device_error),
        _fake("fake_cpu_error", _cpu_error),
        keep["neg"],
    ]


def hook_abort_at_startup(ops):
    os.abort()


def hook_hang_at_startup(ops):
    time.sleep(3600)
'''


def test_driver_records_crash_timeout_and_continues(tmp_path):
    hook_file = tmp_path / "fake_ops_hook.py"
    hook_file.write_text(textwrap.dedent(_HOOK))
    cfg = sweep.SweepConfig(device="cpu", workers=1, nchunks=1, timeout_s=3.0,
                            ops_hook=f"{hook_file}:hook", workdir=str(tmp_path / "work"), verbose=False)
    report = sweep.run_sweep(cfg)
    results = _by_op(report)
    assert [r["op"] for r in report["results"]] == [
        "abs", "fake_abort", "fake_hang", "fake_flaky", "fake_device_error", "fake_cpu_error", "neg"]
    assert results["abs"]["status"] == "pass"
    assert results["fake_abort"]["status"] == "crash"
    assert "SIGABRT" in results["fake_abort"]["message"]
    assert "in the cpu run of sample 0 [T[2, 3], (), {}]" in results["fake_abort"]["message"]
    assert results["fake_hang"]["status"] == "error"
    assert results["fake_hang"]["message"].startswith("timeout")
    assert results["fake_flaky"]["status"] == "fail"
    assert results["fake_flaky"]["failed_samples"] == 2
    assert "sample 0" in results["fake_flaky"]["message"]
    assert results["fake_device_error"]["status"] == "error"
    assert "NotImplementedError: no kernel on this device" in results["fake_device_error"]["message"]
    assert results["fake_cpu_error"]["status"] == "skip"
    assert results["neg"]["status"] == "pass"  # the driver went on after the crash and the timeout
    assert report["config"]["child_processes"] == 3
    s = report["summary"]
    assert (s["pass"], s["fail"], s["error"], s["crash"], s["skip"]) == (2, 1, 2, 1, 1)
    assert report["summary_line"].endswith("pass rate 33.3% of runnable (pass/(pass+fail+error+crash))")


def test_driver_records_startup_crash_and_hang(tmp_path):
    hook_file = tmp_path / "fake_ops_hook.py"
    hook_file.write_text(textwrap.dedent(_HOOK))
    cfg = sweep.SweepConfig(device="cpu", workers=1, nchunks=1,
                            ops_hook=f"{hook_file}:hook_abort_at_startup", verbose=False)
    report = sweep.run_sweep(cfg)
    assert [(r["op"], r["status"]) for r in report["results"]] == [
        ("<chunk 0 attempt 0 startup>", "crash")]
    assert report["summary"]["crash"] == 1

    cfg = sweep.SweepConfig(device="cpu", workers=1, nchunks=1, startup_timeout_s=2.0,
                            ops_hook=f"{hook_file}:hook_hang_at_startup", verbose=False)
    report = sweep.run_sweep(cfg)
    assert [(r["op"], r["status"]) for r in report["results"]] == [
        ("<chunk 0 attempt 0 startup>", "error")]
    assert report["results"][0]["message"].startswith("timeout")


def test_compare_and_move_helpers():
    import torch

    base = torch.arange(20.0)
    view = base[2:12:2]
    moved = sweep.to_device([view, base, {"device": "cpu"}, ("cpu",)], "cpu")
    assert moved[0].stride() == view.stride() and moved[0].storage_offset() == view.storage_offset()
    assert moved[0].untyped_storage().data_ptr() == moved[1].untyped_storage().data_ptr()
    assert moved[1].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert moved[2:] == [{"device": "cpu"}, ("cpu",)]

    t = torch.tensor([1.0, float("nan")])
    assert sweep.compare((t, 3, 1.5), (t.clone(), 3, 1.5), "cpu", 1e-5, 1.3e-6, False) is None
    assert "out[0]" in sweep.compare((t,), (t + 1,), "cpu", 1e-5, 1.3e-6, False)
    assert sweep.compare((t,), (t + 1,), "cpu", 1e-5, 1.3e-6, True) is None
    assert "shape" in sweep.compare(t, t[:1], "cpu", 1e-5, 1.3e-6, True)
    assert "expected device type 'meta'" in sweep.compare(t, t, "meta", 1e-5, 1.3e-6, False)


def test_op_classification_rules():
    class Op:
        def __init__(self, name, variant="", nondet=False):
            self.name, self.variant_test_name, self.has_nondeterministic_output = name, variant, nondet

    assert sweep.op_id(Op("nn.functional.dropout")) == "nn.functional.dropout"
    assert sweep.op_id(Op("normal", "in_place")) == "normal.in_place"
    for name in ("rand_like", "randint", "nn.functional.dropout2d", "bernoulli", "multinomial", "normal",
                 "uniform", "exponential", "log_normal", "nn.functional.rrelu", "resize_"):
        assert sweep.is_shape_only(Op(name)), name
    assert sweep.is_shape_only(Op("empty_like", nondet=True))
    for name in ("nn.functional.normalize", "__rand__", "signal.windows.exponential", "add",
                 "native_dropout_backward"):
        assert not sweep.is_shape_only(Op(name)), name
    assert sweep.chunk_of(list(range(7)), 1, 3) == [1, 4]
    json_path, md_path = sweep.report_paths("/x/y/opinfo_neuron.md", "neuron")
    assert (str(json_path), str(md_path)) == ("/x/y/opinfo_neuron.json", "/x/y/opinfo_neuron.md")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "int64", "complex64", "bool"])
def test_opinfo_conformance_neuron_other_dtypes(tmp_path, monkeypatch, dtype):
    """Beyond the float32 bar: the same sweep on other dtypes (children read the dtype from the env)."""
    monkeypatch.setenv("TORCHNEURON_LAB_OPINFO_DTYPE", dtype)
    cfg = sweep.SweepConfig(device="neuron", workers=2, preload=["torchneuron_lab"])
    report = sweep.run_sweep(cfg)
    _, md_path = sweep.write_report(report, _report_stem(tmp_path, f"neuron_{dtype}"))
    print(dtype, report["summary_line"], f"(report {md_path})")
    summary = report["summary"]
    assert summary["crash"] == 0
    assert summary["pass"] >= 300  # the sweep really ran this dtype
    failing = [f"{r['op']} [{r['status']}]: {r['message'][:200]}" for r in report["results"]
               if r["status"] in ("fail", "error")]
    assert summary["pass_rate"] is not None and summary["pass_rate"] >= 99.0, "\n".join(failing[:40])
