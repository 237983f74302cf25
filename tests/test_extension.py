"""The IPython extension through a real InteractiveShell: load/unload, every magic's result by its data,
bad input, notebook cell locations, ambient mode, and one notebook run through a Jupyter kernel."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("IPython")

import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

import torchneuron_lab
from torchneuron_lab.device import recorder
from torchneuron_lab.extension.results import fmt_ns

MAGICS = ("neuron_placement", "neuron_graph_breaks", "neuron_subgraphs", "neuron_memory", "neuron_watch")


@pytest.fixture(scope="module")
def ip() -> Iterator[Any]:
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    with capture_output():
        shell.run_line_magic("load_ext", "torchneuron_lab")
    shell.run_cell("import torch")
    yield shell
    with capture_output():
        shell.run_line_magic("unload_ext", "torchneuron_lab")
    # leave no device memory behind for later test modules (they assert exact allocator deltas)
    import gc

    import torch

    keep = {"__name__", "__builtins__", "__builtin__"}
    # (dunder names stay: Dynamo keeps `__builtins_dict___N` there and removes it itself at exit)
    for name in [n for n in shell.user_ns if n not in keep and not n.startswith(("_i", "__"))]:
        shell.user_ns.pop(name, None)
    for name in ("_", "__", "___", "_neuron_profile", "last_type", "last_value", "last_traceback", "last_exc"):
        shell.user_ns.pop(name, None)
    shell.history_manager.output_hist.clear()
    shell.displayhook.flush()
    gc.collect()
    torch.neuron.empty_cache()


def run(ip: Any, code: str) -> Any:
    """Run a cell with history (so it gets an execution count); fail on an unexpected error."""
    result = ip.run_cell(code, store_history=True)
    assert result.error_before_exec is None and result.error_in_exec is None, result
    return result


def magic(ip: Any, line: str) -> Any:
    name, _, rest = line.partition(" ")
    return ip.run_line_magic(name, rest)


# --------------------------------------------------------------------------- load / unload


def test_load_status_line_unload_and_reload(ip: Any) -> None:
    from torchneuron_lab.compiler import capture

    mm = ip.magics_manager
    assert all(m in mm.magics["line"] for m in MAGICS)
    assert "neuron_profile" in mm.magics["cell"] and "neuron_graph_breaks" in mm.magics["cell"]
    with capture_output() as cap:
        ip.run_line_magic("unload_ext", "torchneuron_lab")
    assert not any(m in mm.magics["line"] for m in MAGICS) and "neuron_profile" not in mm.magics["cell"]
    assert recorder._source_mapper is None and capture._mapper is None
    with capture_output() as cap:
        ip.run_line_magic("load_ext", "torchneuron_lab")
        ip.run_line_magic("load_ext", "torchneuron_lab")  # twice: a no-op
        torchneuron_lab.load_ipython_extension(ip)  # directly, again: still one set of magics
    lines = [ln for ln in cap.stdout.splitlines() if ln.startswith("torchneuron_lab:")]
    assert len(lines) == 1
    n = torch.neuron.device_count()
    hbm = torchneuron_lab.device.current_config()["hbm_bytes"]
    assert f"{n} neuron device(s)" in lines[0] and f"torch {torch.__version__}" in lines[0]
    assert f"{hbm / 2**30:.2f} GiB HBM each" in lines[0]
    assert f"profile {torchneuron_lab.device.current_config()['profile']}" in lines[0]
    with capture_output() as cap:
        ip.run_line_magic("neuron_watch", "on")
        ip.run_line_magic("reload_ext", "torchneuron_lab")
    # the reload turned the watch off: said, not silent
    assert "neuron_watch was on: it is off now that the extension is unloaded" in cap.stdout
    assert all(m in mm.magics["line"] for m in MAGICS)
    assert recorder._source_mapper is not None
    hooks = [cb for cb in ip.events.callbacks["post_run_cell"] if "Watch" in repr(getattr(cb, "__self__", ""))]
    assert hooks == []  # reload removed the ambient hooks that load added
    assert not recorder.is_recording()


def test_help_comes_from_magic_arguments(ip: Any) -> None:
    doc = ip.magics_manager.magics["line"]["neuron_memory"].__doc__
    assert "--segments" in doc and "--snapshot FILE" in doc and "-q, --quiet" in doc


# --------------------------------------------------------------------------- %neuron_placement


def test_placement_totals_views_and_modules(ip: Any) -> None:
    run(ip, "import torch\n"
            "pa = torch.ones(4, 4, device='neuron')\n"
            "pv = pa[0]\n"
            "pm = torch.nn.Linear(4, 4).to('neuron')\n"
            "pc = torch.zeros(3, dtype=torch.float64)")
    res = magic(ip, "neuron_placement -q -o pa pv pm pc")
    assert res.totals == {"cpu": 24, "neuron:0": 64 + 80}  # the view adds nothing
    rows = {r["name"]: r for r in res.rows}
    assert rows["pa"]["bytes"] == 64 and rows["pa"]["shape"] == (4, 4) and rows["pa"]["dtype"] == "float32"
    assert rows["pv"]["storage"] == "view of pa"
    assert rows["pm"]["kind"] == "module" and rows["pm"]["bytes"] == 80 and rows["pm"]["requires_grad"]
    assert res.warnings == []
    full = magic(ip, "neuron_placement -q -o --all pm")
    assert [r["name"] for r in full.rows] == ["pm.weight", "pm.bias", "pm"]


def test_placement_flags_split_modules_stray_optimizer_state_and_large_cpu_tensors(ip: Any) -> None:
    run(ip, "fs = torch.nn.Sequential(torch.nn.Linear(2, 2).to('neuron:0'), torch.nn.Linear(2, 2).to('neuron:1'))\n"
            "fm = torch.nn.Linear(4, 4)\n"
            "fo = torch.optim.Adam(fm.parameters())\n"
            "fm(torch.ones(1, 4)).sum().backward(); fo.step()\n"
            "fm.to('neuron')\n"
            "fbig = torch.zeros(1 << 18)")
    res = magic(ip, "neuron_placement -q -o fs fm fo fbig")
    text = "\n".join(res.warnings)
    assert "module fs is split across devices: neuron:0, neuron:1" in text
    assert "optimizer fo keeps state on cpu for parameters on neuron:0" in text
    assert "large CPU tensor fbig (1.00 MiB)" in text


def test_placement_counts_a_sparse_tensors_members(ip: Any) -> None:
    # a sparse tensor has no storage of its own (untyped_storage() raises): the magic raised on one
    run(ip, "sp = torch.sparse_coo_tensor([[0, 999]], [1.0, 2.0], (1000,), device='neuron')\n"
            "sc = torch.eye(3).to_sparse_csr()")
    res = magic(ip, "neuron_placement -q -o sp sc")
    rows = {r["name"]: r for r in res.rows}
    assert (rows["sp"]["device"], rows["sp"]["shape"], rows["sp"]["bytes"]) == ("neuron:0", (1000,), 2 * 8 + 2 * 4)
    assert rows["sp"]["storage"] == "sparse_coo, nnz 2"
    assert (rows["sc"]["device"], rows["sc"]["bytes"], rows["sc"]["storage"]) == ("cpu", 4 * 8 + 3 * 8 + 3 * 4,
                                                                                  "sparse_csr, nnz 3")
    # totals count storages, as for dense views: the CSR members' storages (to_sparse_csr makes them larger)
    sc = ip.user_ns["sc"]
    held = {m.untyped_storage().data_ptr(): m.untyped_storage().nbytes()
            for m in (sc.crow_indices(), sc.col_indices(), sc.values())}
    assert res.totals == {"cpu": sum(held.values()), "neuron:0": 24}


def test_placement_bad_input(ip: Any) -> None:
    with pytest.raises(UsageError, match="not defined in the namespace: no_such_name"):
        magic(ip, "neuron_placement no_such_name")
    with pytest.raises(UsageError, match="neuron_placement \\["):
        magic(ip, "neuron_placement --bogus")


# --------------------------------------------------------------------------- graph breaks / subgraphs


def test_graph_breaks_line_and_cell_locations(ip: Any) -> None:
    r = run(ip, "gx = torch.ones(4, 4, device='neuron')\n"
                "def gf(t):\n"
                "    u = t + 1\n"
                "    torch._dynamo.graph_break()\n"
                "    return u * 2")
    n = r.execution_count
    res = magic(ip, "neuron_graph_breaks -q -o gf(gx)")
    assert res.graph_count == 2 and res.break_count >= 1
    assert {b["location"] for b in res.breaks} == {f"cell [{n}], line 4"}
    assert "graph_break" in res.breaks[0]["reason"] and res.breaks[0]["hints"]
    assert sorted(res.ops_per_graph().values()) == [1, 1]
    assert torch.equal(res.output.cpu(), torch.full((4, 4), 4.0))
    page = res._repr_html_()  # every result renders as HTML (it did not once: a profile-only attribute)
    assert page.startswith("<p><b>") and f"cell [{n}], line 4" in page

    r = ip.run_cell("%%neuron_graph_breaks -q\ngy = gx - 1\ntorch._dynamo.graph_break()\ngz = gy * 3",
                    store_history=True)
    assert r.error_in_exec is None
    assert torch.equal(ip.user_ns["gz"].cpu(), torch.zeros(4, 4))  # assignments land in the namespace
    res2 = ip.run_cell_magic("neuron_graph_breaks", "-q -o", "gw = gx * 5\ntorch._dynamo.graph_break()\ngw + 1")
    assert res2.graph_count == 2
    assert [b["location"] for b in res2.breaks] == [f"cell [{ip.execution_count}], line 3"]

    subs = magic(ip, "neuron_subgraphs -q -o")
    ids = [g["id"] for g in res.graphs]
    assert set(ids) <= {s["id"] for s in subs.records}
    one = magic(ip, f"neuron_subgraphs -q -o {ids[0]} --code --kernels")
    assert one.detail["id"] == ids[0] and "aten.add" in one.detail["fx_code"]
    assert "FX code:" in str(one) and "kernels:" in str(one)


def test_graph_breaks_and_subgraphs_bad_input(ip: Any) -> None:
    with pytest.raises(UsageError, match="give a statement"):
        magic(ip, "neuron_graph_breaks")
    with pytest.raises(UsageError, match="cannot parse"):
        magic(ip, "neuron_graph_breaks f(")
    with pytest.raises(UsageError, match="no compiled subgraph with id 99999"):
        magic(ip, "neuron_subgraphs 99999")
    with pytest.raises(UsageError, match="invalid int value"):
        magic(ip, "neuron_subgraphs abc")
    # an unknown option carries the usage line as every other magic's errors do; a statement that starts with
    # a minus is a statement (both were "unknown option in ..." without the usage line)
    for line in ("--bogus f(x)", "-x 1", "-q --bogus f(x)"):
        with pytest.raises(UsageError, match=r"unknown option '-[-a-z]+' in [\s\S]*%neuron_graph_breaks \[-q\]"):
            magic(ip, f"neuron_graph_breaks {line}")
    run(ip, "gneg = torch.ones(3, device='neuron')\ndef gf_neg(t):\n    return t + 1")
    with capture_output():
        res = magic(ip, "neuron_graph_breaks -o -gf_neg(gneg).sum()")
    assert res.output.item() == -6.0 and res.graphs


# --------------------------------------------------------------------------- %neuron_memory


def test_memory_delta_segments_and_oom(ip: Any) -> None:
    before = magic(ip, "neuron_memory -q -o")
    run(ip, "mt = torch.empty(1 << 20, dtype=torch.uint8, device='neuron')")
    after = magic(ip, "neuron_memory -q -o --segments")
    assert after.allocated - before.allocated == 1 << 20
    assert after.stat("allocation.all.current") - before.stat("allocation.all.current") == 1
    assert any(b["state"] == "active_allocated" and b["size"] == 1 << 20
               for s in after.segments for b in s["blocks"])
    assert after.capacity == torch.neuron.get_device_properties(0)["total_memory"]
    run(ip, "try:\n    torch.empty(10**13, dtype=torch.uint8, device='neuron')\n"
            "except torch.OutOfMemoryError:\n    pass")
    oom = magic(ip, "neuron_memory -q -o")
    assert oom.last_oom is not None and oom.last_oom["requested"] == 10**13
    assert "last OOM on neuron:0: requested" in str(oom) and "larger than the device's whole capacity" in str(oom)
    run(ip, "del mt")
    assert magic(ip, "neuron_memory -q -o").allocated == before.allocated


def test_memory_history_names_cells_and_bad_input(ip: Any, tmp_path: Path) -> None:
    magic(ip, "neuron_memory -q --history")
    try:
        r = run(ip, "mh = torch.empty(3 << 20, dtype=torch.uint8, device='neuron')")
        res = magic(ip, f"neuron_memory -q -o --snapshot {tmp_path / 'snap.pickle'}")
        top = res.top_allocations[0]
        assert top["location"] == f"cell [{r.execution_count}], line 1" and top["bytes"] == 3 << 20
        assert (tmp_path / "snap.pickle").stat().st_size > 0
    finally:
        torch.neuron.memory._record_memory_history(None)
        from torchneuron_lab.extension import helpers

        helpers._HISTORY[0] = False
        run(ip, "del mh")
    with pytest.raises(UsageError, match="--device must be in"):
        magic(ip, "neuron_memory --device 99")
    with pytest.raises(UsageError, match="cannot write the snapshot"):
        magic(ip, f"neuron_memory -q --snapshot {tmp_path / 'missing' / 'x.pickle'}")


# --------------------------------------------------------------------------- %%neuron_profile


def test_profile_counts_sources_and_namespace(ip: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run(ip, "qa = torch.ones(8, 8, device='neuron')\nqb = torch.ones(8, 8, device='neuron')")
    with capture_output() as cap:
        r = run(ip, "%%neuron_profile\nqc = qa + qb\nqd = (qc * 2).sum()\nqd.item()")
    prof = ip.user_ns["_neuron_profile"]
    assert prof.count("kernel") == 3 and prof.count("sync") == 1 and prof.count("dma") == 1
    n = r.execution_count
    assert [e.source for e in prof.trace.kernels()] == [f"cell [{n}], line 2", f"cell [{n}], line 3",
                                                         f"cell [{n}], line 3"]
    assert prof.summary["sync_events"][0]["location"] == f"cell [{n}], line 4"
    shown = [o.data.get("text/plain", "") for o in cap.outputs]
    assert shown[0] == "256.0"  # the cell's last value is still displayed, then the profile
    assert shown[1].startswith("neuron_profile: 3 kernels, 1 transfers, 1 host syncs")
    assert list(tmp_path.iterdir()) == []  # nothing written unless asked
    assert not recorder.is_recording()
    df = prof.to_dataframe()
    assert len(df) == len(prof.events)


def test_profile_export_and_error_keep_state_consistent(ip: Any, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    res = ip.run_cell_magic("neuron_profile", f"-q -o --export {out}", "qe = qa @ qb")
    assert res.exported == str(out) and out.stat().st_size > 0
    import json

    assert sum(1 for ev in json.loads(out.read_text())["traceEvents"] if ev.get("ph") == "X") >= 1
    with capture_output() as cap:
        r = ip.run_cell("%%neuron_profile -q\nqf = qa * 3\nraise ValueError('boom in the cell')",
                        store_history=True)
    assert r.error_before_exec is None and isinstance(r.error_in_exec, ValueError) and r.success is False
    assert "ValueError" in cap.stdout + cap.stderr and "boom in the cell" in cap.stdout + cap.stderr
    assert "torchneuron_lab/extension" not in cap.stdout + cap.stderr
    prof = ip.user_ns["_neuron_profile"]
    assert prof.error == "ValueError: boom in the cell" and prof.count("kernel") == 1
    assert not recorder.is_recording()
    again = ip.run_cell_magic("neuron_profile", "-q -o", "qg = qa + 1")
    assert again.count("kernel") == 1
    with pytest.raises(UsageError, match="--top must be >= 0"):
        ip.run_cell_magic("neuron_profile", "--top -1", "pass")
    with pytest.raises(UsageError, match="cannot export"):
        ip.run_cell_magic("neuron_profile", f"-q --export {tmp_path / 'no' / 'dir.json'}", "pass")


def test_profiles_do_not_nest_and_a_recording_in_progress_is_not_wiped(ip: Any) -> None:
    # the inner profile cleared and stopped the recorder: the outer cell reported 0 kernels
    run(ip, "qn = torch.ones(64, 64, device='neuron')")
    with capture_output() as cap:
        r = ip.run_cell("%%neuron_profile -q\nqn1 = qn @ qn\n"
                        "get_ipython().run_cell_magic('neuron_profile', '-q', 'qn2 = qn + 1')\nqn3 = qn * 2\n",
                        store_history=True)
    assert isinstance(r.error_in_exec, UsageError) and "profiles do not nest" in str(r.error_in_exec)
    assert "profiles do not nest" in cap.stdout + cap.stderr
    outer = ip.user_ns["_neuron_profile"]
    assert [e.name for e in outer.events if e.kind == "kernel"] == ["aten::mm"]  # ran until the inner call
    assert not recorder.is_recording()
    recorder.start()
    try:
        with pytest.raises(UsageError, match="already recording"):
            ip.run_cell_magic("neuron_profile", "-q", "qn4 = qn + 1")
        assert recorder.is_recording()  # the user's recording goes on
    finally:
        recorder.stop()
        recorder.clear()
    again = ip.run_cell_magic("neuron_profile", "-q -o", "qn5 = qn + 1")
    assert again.count("kernel") == 1


def test_a_syntax_error_fails_the_profiled_cell(ip: Any) -> None:
    # as IPython's %%time: the cell fails (error_in_exec), so "Run all" stops there
    for body in ("x = (\n", "x = 1 +\ny = 2\n"):
        with capture_output() as cap:
            r = ip.run_cell("%%neuron_profile -q\n" + body, store_history=True)
        assert isinstance(r.error_in_exec, SyntaxError) and r.success is False
        assert "SyntaxError" in cap.stdout + cap.stderr
        assert "compilerop" not in cap.stdout + cap.stderr


def test_graph_breaks_shows_only_the_users_frames_when_the_statement_raises(ip: Any) -> None:
    with capture_output() as cap:
        r = ip.run_cell("%neuron_graph_breaks undefined_name_xyz(3)", store_history=True)
    assert isinstance(r.error_in_exec, NameError)
    out = cap.stdout + cap.stderr
    assert "undefined_name_xyz" in out
    assert "torchneuron_lab/" not in out and "eval_frame.py" not in out


def test_the_emulators_first_launch_checks_are_reported_apart_from_syncs(ip: Any) -> None:
    # a new op signature's first launch waits for the queue on the host (the emulator checks its plan): that
    # wait was in no report, so %neuron_watch said the host waited 210 ns for a cell that took 83 ms
    from torchneuron_lab.device._backend import lib

    run(ip, "qp = torch.randn(256, 256, device='neuron'); qp2 = torch.rand(37, 41, device='neuron')\n"
            "qp = qp @ qp / 256\nqp.sum().item()")  # the loop's signatures are known: no check in it
    checks0 = lib().plan_check_waits()
    # special.ndtri: a Meta kernel (queued once its plan is checked), not run elsewhere in the tests
    # torch.neuron._sleep keeps the stream busy for a set time: 20 queued 256x256 matmuls were not enough on a
    # machine whose host enqueued them more slowly than its device ran them (the check then found an idle queue)
    body = ("torch.neuron._sleep(200)\nfor _ in range(20):\n    qp = qp @ qp / 256\n"
            "qpv = torch.special.ndtri(qp2)[0, 0].item()")
    res = ip.run_cell_magic("neuron_profile", "-q -o", body)
    checks1 = lib().plan_check_waits()
    assert res.plan_checks == checks1[0] - checks0[0] >= 1
    assert res.plan_check_wait_ns == checks1[1] - checks0[1] >= 50_000_000  # a 200 ms kernel queued before it
    assert "the emulator also held the host" in str(res) and "not a sync of the program" in str(res)
    assert res.host_wait_ns < res.plan_check_wait_ns  # the queue was drained by the check, not by .item()
    with capture_output() as cap:
        magic(ip, "neuron_watch on")
        run(ip, "torch.neuron._sleep(200)\nfor _ in range(20):\n    qp = qp @ qp / 256\n"
                "qpv = torch.special.i0e(qp2)[0, 0].item()")
        magic(ip, "neuron_watch off")
    assert "emulator first-launch checks held the host" in cap.stdout
    again = ip.run_cell_magic("neuron_profile", "-q -o", "qpv = torch.special.i0e(qp2)[0, 0].item()")
    assert again.plan_checks == 0 and "emulator also held" not in str(again)  # once per signature


def test_mimebundles_have_html_and_plain_text(ip: Any) -> None:
    res = ip.run_cell_magic("neuron_profile", "-q -o", "qh = qa - qb")
    for obj in (res, magic(ip, "neuron_placement -q -o qa"), magic(ip, "neuron_memory -q -o"),
                magic(ip, "neuron_subgraphs -q -o")):
        assert ip.display_formatter.formatters["text/plain"](obj) == str(obj)
        assert obj._repr_html_().startswith("<")


# --------------------------------------------------------------------------- widgets from the magics

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def _bundles(cap: Any) -> list[dict[str, Any]]:
    return [dict(o.data) for o in cap.outputs]


def test_profile_widget_by_data(ip: Any) -> None:
    pytest.importorskip("anywidget")
    import plotly.graph_objects as go

    from torchneuron_lab.extension.magics import widget_front_end
    from torchneuron_lab.widgets import TimelineWidget
    from torchneuron_lab.widgets.figures import lane_label

    assert not widget_front_end(ip)  # a plain InteractiveShell: the widget only when asked
    run(ip, "qa = torch.ones(8, 8, device='neuron')\nqb = torch.ones(8, 8, device='neuron')")
    with capture_output() as cap:
        ip.run_cell("%%neuron_profile\nwq = qa + qb", store_history=True)
    assert not any(WIDGET_MIME in b for b in _bundles(cap))
    with capture_output() as cap:
        r = run(ip, "%%neuron_profile -o --widget\nwr = qa + qb\n(wr * 2).sum().item()")
    bundles = _bundles(cap)
    assert bundles[0]["text/plain"] == "256.0"  # the cell's value, then the timeline, then the tables
    assert WIDGET_MIME in bundles[1] and bundles[1]["text/plain"].startswith("TimelineWidget: ")
    assert bundles[2]["text/plain"].startswith("neuron_profile: 3 kernels")
    prof = ip.user_ns["_neuron_profile"]
    assert r.result is None or r.result is prof
    w = prof.widget()
    assert isinstance(w, TimelineWidget) and w is prof.widget()  # the displayed one, built once
    assert isinstance(w.figure, go.FigureWidget)
    meta = w.figure.layout.meta
    assert meta["num_events"] == len(prof.events) == 5  # 3 kernels, 1 transfer, 1 host sync
    assert lane_label(0, "vector") in meta["lanes"] and "host" in meta["lanes"]
    assert w.summary["syncs"] == prof.count("sync") == 1
    # the bar says what the tables below do not (span, busy, idle), without repeating them
    assert "5 events over" in w.summary_bar.value and "every lane idle" in w.summary_bar.value
    assert "time per engine" not in w.summary_bar.value
    fig = prof.timeline_figure()
    assert type(fig) is go.Figure and fig.layout.meta["lanes"] == meta["lanes"]
    assert fig.layout.meta["num_events"] == 5
    assert prof.memory_widget() is None  # no --memory


def test_profile_memory_widget_peak_and_history_restored(ip: Any) -> None:
    pytest.importorskip("anywidget")
    from torchneuron_lab.widgets import MemoryWidget

    mem = torch.neuron.memory
    assert mem._history_state()["enabled"] is None
    with capture_output() as cap:
        run(ip, "%%neuron_profile --widget --memory\n"
                "mw = torch.zeros(1 << 20, dtype=torch.uint8, device='neuron')\n"
                "del mw")
    bundles = _bundles(cap)
    assert [WIDGET_MIME in b for b in bundles] == [True, False, True]  # timeline, tables, memory
    assert bundles[2]["text/plain"].startswith("MemoryWidget:")
    prof = ip.user_ns["_neuron_profile"]
    mw = prof.memory_widget()
    assert isinstance(mw, MemoryWidget)
    peak = mw.timeline["peak_allocated"]
    assert peak == torch.neuron.max_memory_allocated(0) == prof.memory[0]["peak"]
    assert peak - prof.memory[0]["before"] == 1 << 20
    assert mw.timeline["actions"].count("alloc") >= 1 and "free_completed" in mw.timeline["actions"]
    assert mem._history_state()["enabled"] is None  # restored: off again, as before the cell
    assert not any(mem._snapshot()["device_traces"])

    # history already on: it stays on, and the widget holds the cell's entries only
    mem._record_memory_history("all", context="all")
    try:
        run(ip, "mx = torch.empty(4096, dtype=torch.uint8, device='neuron')\ndel mx")
        res = ip.run_cell_magic("neuron_profile", "-q -o --memory",
                                "my = torch.empty(2 << 20, dtype=torch.uint8, device='neuron')\ndel my")
        assert mem._history_state()["enabled"] == "all"
        entries = res.memory_snapshot["device_traces"][0]
        assert [e["size"] for e in entries if e["action"] == "alloc"] == [2 << 20]
        assert res.memory_widget().timeline["peak_allocated"] - res.memory[0]["before"] == 2 << 20
    finally:
        mem._record_memory_history(None)


def test_memory_and_subgraph_widgets(ip: Any) -> None:
    pytest.importorskip("anywidget")
    from torchneuron_lab.widgets import MemoryWidget, SubgraphWidget

    with capture_output() as cap:
        magic(ip, "neuron_memory --widget")  # no history: the tables only
    assert len(cap.outputs) == 1 and WIDGET_MIME not in cap.outputs[0].data
    mem = torch.neuron.memory
    mem._record_memory_history("all", context="all")
    try:
        run(ip, "mz = torch.empty(1 << 16, dtype=torch.uint8, device='neuron')")
        with capture_output() as cap:
            res = magic(ip, "neuron_memory -o --widget")
        bundles = _bundles(cap)
        assert len(bundles) == 2 and WIDGET_MIME not in bundles[0] and WIDGET_MIME in bundles[1]
        assert res.has_history and isinstance(res.widget(), MemoryWidget)
        assert res.widget().timeline["allocated"][-1] == res.allocated
        with capture_output() as cap:
            magic(ip, "neuron_memory --no-widget")
        assert len(cap.outputs) == 1
    finally:
        mem._record_memory_history(None)
        run(ip, "del mz")
    run(ip, "sgx = torch.ones(4, device='neuron')\n@torch.compile(backend='neuron')\ndef sgf(t):\n"
            "    return t * 3 + 1\nsgf(sgx)")
    gid = magic(ip, "neuron_subgraphs -q -o").records[-1]["id"]
    with capture_output() as cap:
        one = magic(ip, f"neuron_subgraphs -o --widget {gid}")
    bundles = _bundles(cap)
    assert WIDGET_MIME in bundles[-1] and bundles[-1]["text/plain"].startswith("SubgraphWidget:")
    sw = one.widget()
    assert isinstance(sw, SubgraphWidget) and [r["id"] for r in sw.rows] == [gid]
    assert "aten" in sw.detail.value or "mul" in sw.detail.value
    with capture_output() as cap:
        lst = magic(ip, "neuron_subgraphs -o --widget")  # the list: every graph plus the graph breaks
    bundles = _bundles(cap)
    assert WIDGET_MIME in bundles[-1] and bundles[-1]["text/plain"].startswith("SubgraphWidget:")
    assert [r["id"] for r in lst.widget().rows] == [r["id"] for r in lst.records]


def test_widget_flags_bad_input(ip: Any) -> None:
    with pytest.raises(UsageError, match="exclude each other"):
        ip.run_cell_magic("neuron_profile", "--widget --no-widget", "pass")
    with pytest.raises(UsageError, match="unrecognized arguments: --widgets"):
        ip.run_cell_magic("neuron_profile", "--widgets", "pass")
    with pytest.raises(UsageError, match="exclude each other"):
        magic(ip, "neuron_memory --widget --no-widget")
    assert not recorder.is_recording()
    assert torch.neuron.memory._history_state()["enabled"] is None


# --------------------------------------------------------------------------- %neuron_watch


def test_watch_prints_one_line_only_when_something_happened(ip: Any) -> None:
    run(ip, "wa = torch.ones(4, device='neuron')")
    with capture_output() as cap:
        ip.run_line_magic("neuron_watch", "on")
    assert cap.stdout.strip() == "neuron_watch on"
    try:
        with capture_output() as cap:
            r = run(ip, "wb = wa * 2\nwb.sum().item()")
        lines = [ln for ln in cap.stdout.splitlines() if ln.startswith("[neuron]")]
        assert len(lines) == 1
        assert lines[0].startswith(f"[neuron] cell [{r.execution_count}]: 2 kernels")
        assert "1 host syncs" in lines[0] and "neuron:0" in lines[0]
        with capture_output() as cap:
            run(ip, "plain = 1 + 1")
        assert cap.stdout == ""
    finally:
        with capture_output() as cap:
            ip.run_line_magic("neuron_watch", "off")
    assert not recorder.is_recording()
    with capture_output() as cap:
        run(ip, "wc = wa * 3")
    assert cap.stdout == ""
    with pytest.raises(UsageError, match="invalid choice"):
        magic(ip, "neuron_watch maybe")


def test_watch_counts_the_kernels_of_a_profiled_cell(ip: Any) -> None:
    run(ip, "pw = torch.ones(8, device='neuron')")
    with capture_output():
        ip.run_line_magic("neuron_watch", "on")
    try:
        with capture_output() as cap:
            r = run(ip, "pw1 = pw + 1\n"
                        "get_ipython().run_cell_magic('neuron_profile', '-q', 'pw2 = pw1 * 2\\npw3 = pw2 - 1')\n"
                        "pw4 = pw3 / 2\n")
        lines = [ln for ln in cap.stdout.splitlines() if ln.startswith("[neuron]")]
        # 1 kernel before the profile, 2 inside, 1 after
        assert lines == [ln for ln in lines if ln.startswith(f"[neuron] cell [{r.execution_count}]: 4 kernels")]
        assert len(lines) == 1
        with capture_output() as cap:
            r = ip.run_cell("%%neuron_profile -q\npw5 = pw * 5\npw5.sum().item()", store_history=True)
        lines = [ln for ln in cap.stdout.splitlines() if ln.startswith("[neuron]")]
        assert len(lines) == 1 and lines[0].startswith(f"[neuron] cell [{r.execution_count}]: 2 kernels")
        assert "1 host syncs" in lines[0]
    finally:
        with capture_output():
            ip.run_line_magic("neuron_watch", "off")
    assert not recorder.is_recording()


def test_watch_reports_the_host_wait_and_the_lines_that_waited(ip: Any) -> None:
    run(ip, "ww = torch.ones(64, 64, device='neuron')")
    with capture_output():
        ip.run_line_magic("neuron_watch", "on")
    try:
        with capture_output() as cap:
            r = run(ip, "wx = ww @ ww\nwx.sum().item()\nwy = wx + 1\nwy.cpu()\nwx.sum().item()")
    finally:
        with capture_output():
            ip.run_line_magic("neuron_watch", "off")
    watch = ip.magics_manager.registry["NeuronMagics"].watch
    line = watch.last
    n = r.execution_count
    assert line.cell == n and line.syncs == 3
    # the sync events of the cell, grouped by the line that waited (item() on lines 2 and 5, .cpu() on 4)
    assert sorted((w["location"], w["count"]) for w in line.wait_lines) == [
        (f"cell [{n}], line 2", 1), (f"cell [{n}], line 4", 1), (f"cell [{n}], line 5", 1)]
    assert line.host_wait_ns == sum(w["wait_ns"] for w in line.wait_lines)
    printed = [ln for ln in cap.stdout.splitlines() if ln.startswith("[neuron]")]
    assert printed == [str(line)]
    if line.host_wait_ns:
        assert f"host waited {fmt_ns(line.host_wait_ns)} at cell [{n}], line" in printed[0]


def test_watch_line_and_profile_result_render_waits_from_a_synthetic_async_trace() -> None:
    from _async_traces import sync_bound

    from torchneuron_lab.extension.results import ProfileResult, WatchLine
    from torchneuron_lab.tracing import Trace, events_from_columns, host_waits, summarize

    trace = Trace(events_from_columns(sync_bound()))
    waits = host_waits(trace, top=3)
    line = WatchLine(cell=4, kernels=3, syncs=3, host_wait_ns=waits["wait_ns"], wait_lines=waits["by_location"])
    assert str(line) == ("[neuron] cell [4]: 3 kernels, 3 host syncs, host waited 300 ns at cell [4], line 3 "
                         "(200 ns, 2 syncs); cell [4], line 5 (100 ns)")
    res = ProfileResult(trace=trace, summary=summarize(trace, k=None))
    assert res.host_wait_ns == 300
    text = str(res).splitlines()
    assert text[1] == ("  sync-bound: the host waited 300 ns at 3 syncs (59% of the 510 ns span); most at "
                       "cell [4], line 3 (200 ns in 2)")
    i = text.index("  host waited 300 ns at 3 syncs, by line:")
    assert [ln.split() for ln in text[i + 3:i + 5]] == [
        ["cell", "[4],", "line", "3", "2", "200", "ns", "aten::_local_scalar_dense"],
        ["cell", "[4],", "line", "5", "1", "100", "ns", "copy", "d2h"]]
    page = res._repr_html_()
    assert "<p class='tnl-bound'>sync-bound: the host waited 300 ns" in page
    assert "Host waited 300 ns at 3 syncs, by line" in page
    assert "<td style='text-align:left'>cell [4], line 5</td><td style='text-align:left'>1</td>" in page
    assert res._headline().endswith("span 510 ns")  # from the first launch to the last end


def test_profile_summary_has_host_waits_and_classification(ip: Any) -> None:
    run(ip, "pz = torch.ones(32, 32, device='neuron')")
    res = ip.run_cell_magic("neuron_profile", "-q -o", "pz2 = pz @ pz\npz2.sum().item()")
    s = res.summary
    assert s["host_waits"]["count"] == 1 == res.count("sync")
    assert s["host_waits"]["by_location"][0]["location"].endswith("line 3")  # body lines follow the magic line
    assert s["host_waits"]["wait_ns"] == sum(e.dur_ns for e in res.trace.syncs())
    assert s["bound"]["class"] in ("host-bound", "device-bound", "sync-bound")
    from torchneuron_lab.tracing import classify_region

    assert s["bound"] == classify_region(res.trace.events)


def test_failing_profiled_cell_fails_the_cell_with_the_users_frames_only(ip: Any) -> None:
    run(ip, "pf = torch.ones(4, device='neuron')\ndef pf_fail(t):\n    raise KeyError('deep in user code')")
    with capture_output() as cap:
        r = ip.run_cell("%%neuron_profile -q\npf2 = pf * 2\npf_fail(pf2)", store_history=True)
    assert r.success is False and isinstance(r.error_in_exec, KeyError)
    shown = cap.stdout + cap.stderr
    assert "deep in user code" in shown and "pf_fail(pf2)" in shown and "raise KeyError" in shown
    assert "torchneuron_lab" not in shown
    prof = ip.user_ns["_neuron_profile"]
    assert prof.error == "KeyError: 'deep in user code'" and prof.count("kernel") == 1
    assert not recorder.is_recording()


def test_bad_export_path_is_refused_before_the_cell_runs(ip: Any, tmp_path: Path) -> None:
    ip.user_ns.pop("pe_ran", None)
    for target, why in ((tmp_path / "missing" / "t.json", "does not exist"), (tmp_path, "is a directory")):
        with capture_output() as cap:
            r = ip.run_cell(f"%%neuron_profile -q -T {target}\npe_ran = 1\nraise ValueError('user error')",
                            store_history=True)
        assert isinstance(r.error_in_exec, UsageError) and why in str(r.error_in_exec)
        assert "pe_ran" not in ip.user_ns and "user error" not in cap.stdout + cap.stderr


@pytest.mark.parametrize("line", ["neuron_memory '", 'neuron_placement "abc', "neuron_subgraphs --code '"])
def test_unbalanced_quotes_are_usage_errors(ip: Any, line: str) -> None:
    with pytest.raises(UsageError, match="cannot parse the arguments"):
        magic(ip, line)


@pytest.mark.parametrize("stmt", ["return 1", "yield 2", "x = (", "await f()"])
def test_graph_breaks_rejects_statements_python_rejects(ip: Any, stmt: str) -> None:
    with pytest.raises(UsageError, match="cannot parse the statement"):
        magic(ip, f"neuron_graph_breaks {stmt}")


_SETUP_TEARDOWN = [("recorder", "start"), ("recorder", "stop"), ("recorder", "read"), ("recorder", "clear"),
                   ("mem", "_record_memory_history"), ("mem", "_snapshot"), ("mem", "reset_peak_memory_stats")]


@pytest.mark.parametrize(("module", "name"), _SETUP_TEARDOWN)
def test_ctrl_c_during_profile_setup_or_teardown_restores_the_lab_state(ip: Any, module: str, name: str,
                                                                          monkeypatch: Any) -> None:
    """A SIGINT that lands while %%neuron_profile turns recording on or off: the allocator history and
    the recorder end as they were before the cell, and the cell reports KeyboardInterrupt."""
    import signal

    from torchneuron_lab.device import memory as mem

    target = recorder if module == "recorder" else mem
    real = getattr(target, name)
    fired: list[int] = []

    def interrupted(*a: Any, **k: Any) -> Any:
        if not fired:
            fired.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **k)

    before = mem._history_state()
    monkeypatch.setattr(target, name, interrupted)
    with capture_output():
        r = ip.run_cell("%%neuron_profile -q --memory\npk = torch.ones(4, device='neuron') + 1", store_history=True)
    monkeypatch.undo()
    assert fired == [1]
    assert isinstance(r.error_in_exec, KeyboardInterrupt), r
    assert mem._history_state() == before
    assert not recorder.is_recording()


def test_backward_kernels_and_new_signatures_are_located_with_their_shapes(ip: Any) -> None:
    run(ip, "bw = torch.randn(16, 8, device='neuron', requires_grad=True)\nbl = torch.nn.Linear(8, 4).to('neuron')")
    r = ip.run_cell("%%neuron_profile -q\nout = bl(bw).relu().sum()\nout.backward()", store_history=True)
    assert r.error_in_exec is None
    prof = ip.user_ns["_neuron_profile"]
    n = r.execution_count
    locs = [e.location for e in prof.events if e.kind == "kernel"]
    assert None not in locs, locs
    bwd = [loc for loc in locs if loc.endswith("(backward)")]
    # line 1 of the cell is the magic line: the forward is line 2, backward() line 3
    assert len(bwd) == 4 and set(bwd) == {f"cell [{n}], line 3 (backward)"}
    assert {loc for loc in locs if loc not in bwd} == {f"cell [{n}], line 2", f"cell [{n}], line 3"}
    sigs = prof.summary["new_signatures"]
    assert sigs and all(r["shapes"] and r["dtypes"] for r in sigs)  # without --record-shapes
    assert (f"new signature aten::addmm([4], [16, 8], [8, 4]; float32, float32, float32) at cell [{n}], line 2"
            in str(prof))


def test_backward_kernels_that_run_after_backward_returned_keep_its_line(ip: Any) -> None:
    # Asynchronous execution: behind a 200 ms device sleep, backward()'s kernels run after the call returned.
    # They belong to the call that launched them (attributed by launch time, not by when they ran).
    run(ip, "bz = torch.randn(16, 8, device='neuron', requires_grad=True)\nbzl = torch.nn.Linear(8, 4).to('neuron')\n"
            "bzo = bzl(bz).relu().sum()\nbzo.backward(retain_graph=True)\nbzo.backward(retain_graph=True)")
    r = ip.run_cell("%%neuron_profile -q\ntorch.neuron._sleep(200)\nbzo.backward(retain_graph=True)",
                    store_history=True)
    assert r.error_in_exec is None
    n = r.execution_count
    prof = ip.user_ns["_neuron_profile"]
    kernels = [(e.name, e.location) for e in prof.events if e.kind == "kernel"]
    assert kernels[:2] == [("neuron::_sleep", f"cell [{n}], line 2"), ("aten::fill_.Scalar", f"cell [{n}], line 3")]
    bwd = kernels[2:]  # the engine's, on its device thread: threshold_backward, mm x2, sum, grad accumulation
    assert len(bwd) >= 4 and {loc for _, loc in bwd} == {f"cell [{n}], line 3 (backward)"}, kernels


def test_dynamo_printed_warnings_are_captured_not_repeated(ip: Any, capfd: Any) -> None:
    """Dynamo's own graph-break warning block is not printed above the lab's table that says the same."""
    run(ip, "dq = torch.ones(4, device='neuron')\ndef dqf(t):\n    s = (t * 2).sum().item()\n    return t + s")
    capfd.readouterr()
    with capture_output() as cap:
        res = magic(ip, "neuron_graph_breaks -q -o dqf(dq)")
    printed = capfd.readouterr()
    assert res.break_count >= 1
    shown = printed.out + printed.err + cap.stdout + cap.stderr
    assert "Graph break" not in shown and "graph break" not in shown.lower(), shown[-2000:]
    # a profiled cell with --compile: same rule
    run(ip, "def dqg(t):\n    s = (t * 5).sum().item()\n    return t - s\ndqc = torch.compile(dqg, backend='neuron')")
    with capture_output() as cap:
        r = ip.run_cell("%%neuron_profile -q --compile\ndqc(dq * 3)", store_history=True)
    printed = capfd.readouterr()
    assert r.error_in_exec is None
    assert ip.user_ns["_neuron_profile"].graph_breaks
    assert "graph break" not in (printed.out + printed.err + cap.stdout + cap.stderr).lower()


# --------------------------------------------------------------------------- a real Jupyter kernel


@pytest.mark.slow  # a kernel start takes 7-40 s on this 2-core machine
def test_notebook_through_a_jupyter_kernel(tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    cells = [
        "%load_ext torchneuron_lab",
        "import torch\nx = torch.ones(16, 16, device='neuron')",
        "%neuron_placement x",
        "%%neuron_profile\ny = x @ x\ny.sum().item()",
        "%neuron_memory",
        "%%neuron_profile --memory\nz = torch.zeros(1 << 22, dtype=torch.uint8, device='neuron')\ndel z",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.km = client.kernel_manager_class(kernel_name="python3")
    client.km.extra_env = env  # type: ignore[attr-defined]
    client.execute(env=env)
    outs = [c.outputs for c in nb.cells]
    assert "neuron device(s)" in "".join(o.get("text", "") for o in outs[0])
    for i in (2, 3, 4):
        bundles = [o["data"] for o in outs[i] if o["output_type"] == "display_data"]
        assert bundles and "text/html" in bundles[-1] and "text/plain" in bundles[-1], outs[i]
    assert "neuron_profile: 1 kernels" in outs[3][-1]["data"]["text/plain"] or any(
        "neuron_profile:" in o.get("data", {}).get("text/plain", "") for o in outs[3])
    # a real kernel has a widget front-end: the timeline widget comes before the tables
    views = [o["data"] for o in outs[3] if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(views) == 1 and views[0]["text/plain"].startswith("TimelineWidget: ")
    assert views[0]["application/vnd.jupyter.widget-view+json"]["model_id"]
    assert not any(o["output_type"] == "error" for c in outs for o in c), outs
    mem_views = [o["data"] for o in outs[5] if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert [v["text/plain"].split(":")[0] for v in mem_views] == ["TimelineWidget", "MemoryWidget"], outs[5]
    assert "peak allocated 4.00 MiB" in mem_views[1]["text/plain"]
    assert list(tmp_path.iterdir()) == []


def test_text_reports_keep_a_name_with_control_characters_on_one_line() -> None:
    # a function's name or a file name may hold a newline or a tab (code built at run time, any Linux path):
    # the plain-text report escapes them where it shows a location, so a table row stays one row
    from torchneuron_lab.extension.helpers import profile_cell

    def launch() -> None:
        (torch.ones(7, 3, device="neuron") * 3).sum().item()
        time.sleep(0.02)  # the host's own time, then 30 ms on the device and a wait for it at the next line:
        torch.neuron._sleep(30)  # a sync-bound region (about 60% waiting), whose verdict names that line
        torch.neuron.synchronize()

    launch.__code__ = launch.__code__.replace(co_name="odd\nname\there", co_filename="/tmp/dir\twith tab.py")
    res, _, error = profile_cell(launch, record_shapes=True, memory_peak=False, top=10)
    assert error is None
    text = str(res)
    sig = [ln for ln in text.splitlines() if "new signature aten::mul.Tensor([7, 3]" in ln]
    assert len(sig) == 1, text
    assert "/tmp/dir\\twith tab.py:" in sig[0] and sig[0].endswith(" in odd\\nname\\there"), sig
    assert "\there" not in text and "name\n" not in text
    (bound,) = [ln for ln in text.splitlines() if "sync-bound" in ln]
    assert "most at /tmp/dir\\twith tab.py:" in bound and " in odd\\nname\\there (" in bound, bound
    for line in text.splitlines():  # no raw tab left in any line
        assert "\t" not in line


def test_a_failing_memory_snapshot_keeps_the_profile_and_the_cells_own_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # the snapshot is taken in a finally: its exception replaced the cell's and lost the whole profile
    from torchneuron_lab.device import memory as mem
    from torchneuron_lab.extension.helpers import profile_cell

    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("symbolizer refused a frame")

    monkeypatch.setattr(mem, "_snapshot", broken)

    def cell() -> None:
        (torch.ones(5, device="neuron") * 2).sum().item()
        raise ValueError("the cell's own error")

    with pytest.warns(RuntimeWarning, match="memory snapshot failed .RuntimeError: symbolizer refused a frame"):
        res, _, error = profile_cell(cell, record_shapes=False, memory_peak=True, top=10)
    assert isinstance(error, ValueError) and str(error) == "the cell's own error"
    assert res.memory_snapshot is None
    assert sum(1 for e in res.trace.events if e.name == "aten::mul.Tensor") == 1


def test_ctrl_c_while_the_watch_waits_for_the_cells_kernels_fails_the_cell(ip: Any) -> None:
    """The watch waits for a cell's queued kernels at its end. A Ctrl-C there drops the kernels not yet run (as
    in any host wait); the drain swallowed the interrupt, and the cell reported success with results never
    computed. Now the cell fails with KeyboardInterrupt, the recorder is left stopped, and the next cell runs."""
    import signal
    import threading

    run(ip, "wk = torch.ones(256, device='neuron')")
    with capture_output() as cap:
        magic(ip, "neuron_watch on")
        timer = threading.Timer(0.4, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        # the cell returns at once; its kernels wait 1.5 s behind the sleep, and the watch waits for them
        r = ip.run_cell("torch.neuron._sleep(1500)\nwouts = [wk + i for i in range(50)]", store_history=True)
        timer.join()
        after = ip.run_cell("wnext = (wk * 2).sum().item()", store_history=True)
        magic(ip, "neuron_watch off")
    assert isinstance(r.error_in_exec, KeyboardInterrupt), r
    assert r.success is False
    assert "the kernels not yet run were dropped" in cap.stderr
    assert after.error_in_exec is None and ip.user_ns["wnext"] == 512.0
    assert not recorder.is_recording()
