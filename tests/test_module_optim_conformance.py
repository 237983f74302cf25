"""ModuleInfo and OptimizerInfo conformance of the neuron device (slow), and the sweep driver (fast).

The sweeps are tests/conformance/module_sweep.py and tests/conformance/optim_sweep.py; run them by hand
with ``python -m tests.conformance.module_sweep --device neuron`` (report in reports/modules_neuron.md)
and ``python -m tests.conformance.optim_sweep --device neuron``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conformance import module_sweep, optim_sweep


def _stem(tmp_path: Path, name: str) -> Path:
    base = os.environ.get("TORCHNEURON_LAB_REPORT_DIR")
    return (Path(base) if base else tmp_path) / name


def _check(report: dict, md: Path) -> None:
    print(report["summary_line"], f"(wall {report['wall_time_s']:.0f} s; report {md})")
    s = report["summary"]
    crashes = [f"{r['id']}: {r['message'][:300]}" for r in report["results"] if r["status"] == "crash"]
    assert s["crash"] == 0, "crashing entries:\n" + "\n".join(crashes)
    failing = [f"{r['id']} [{r['status']}]: {r['message'][:200]}" for r in report["results"]
               if r["status"] in ("fail", "error")]
    assert s["pass_rate"] is not None and s["pass_rate"] >= 99.0, report["summary_line"] + "\n" + "\n".join(failing)
    assert s["pass"] >= 50  # the sweep really ran


@pytest.mark.slow
def test_module_db_conformance_neuron(tmp_path):
    ids = list(module_sweep.module_infos())
    report = module_sweep.run_sweep("tests.conformance.module_sweep", ids, "neuron", label="modules")
    _, md = module_sweep.write_report(report, _stem(tmp_path, "modules_neuron"))
    assert len(report["results"]) == len(ids)
    _check(report, md)


@pytest.mark.slow
def test_optim_db_conformance_neuron(tmp_path):
    ids = list(optim_sweep.entries())
    report = module_sweep.run_sweep("tests.conformance.optim_sweep", ids, "neuron", label="optimizers")
    _, md = module_sweep.write_report(report, _stem(tmp_path, "optimizers_neuron"))
    assert len(report["results"]) == len(ids)
    assert any(r["id"].endswith(".fused") and r["status"] == "pass" for r in report["results"])
    assert any(r["id"].endswith(".foreach") and r["status"] == "pass" for r in report["results"])
    _check(report, md)


def test_driver_counts_a_crash_and_continues(tmp_path, monkeypatch):
    ids = ["nn_Linear", "nn_ReLU", "nn_Tanh"]
    monkeypatch.setenv("TORCHNEURON_LAB_SWEEP_ABORT_IN", "nn_ReLU")
    report = module_sweep.run_sweep("tests.conformance.module_sweep", ids, "cpu", workers=1, nchunks=1,
                                    label="modules")
    by_id = {r["id"]: r for r in report["results"]}
    assert [r["id"] for r in report["results"]] == ids
    assert by_id["nn_ReLU"]["status"] == "crash"
    assert "return code -6" in by_id["nn_ReLU"]["message"]
    assert by_id["nn_Linear"]["status"] == "pass" and by_id["nn_Tanh"]["status"] == "pass"
    assert by_id["nn_Linear"]["passed"] == by_id["nn_Linear"]["total"] > 0
    assert report["child_processes"] == 2  # a new child went on after the crash
    assert (report["summary"]["pass"], report["summary"]["crash"]) == (2, 1)
    _json_path, md_path = module_sweep.write_report(report, tmp_path / "modules_cpu")
    assert "| `nn_ReLU` | crash | 0/0 |" in md_path.read_text()


def test_optim_entries_cover_impls():
    ids = list(optim_sweep.entries())
    assert any(i.startswith("AdamW[") and i.endswith(".fused") for i in ids)
    assert any(i.startswith("SGD[") and i.endswith(".foreach") for i in ids)
    assert any(i.startswith("LBFGS[") for i in ids)
    res = optim_sweep.run_optim_entry(next(i for i in ids if i.startswith("Adam[")), "cpu")
    assert res == {"status": "pass", "passed": 1, "total": 1, "message": ""}
