"""The IPython extension through a real InteractiveShell: load/unload, every magic's result by its data,
bad input, notebook cell locations, ambient mode, and one notebook run through a Jupyter kernel."""

from __future__ import annotations

import os
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
    with capture_output():
        ip.run_line_magic("neuron_watch", "on")
        ip.run_line_magic("reload_ext", "torchneuron_lab")
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
    assert r.error_before_exec is None
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


def test_mimebundles_have_html_and_plain_text(ip: Any) -> None:
    res = ip.run_cell_magic("neuron_profile", "-q -o", "qh = qa - qb")
    for obj in (res, magic(ip, "neuron_placement -q -o qa"), magic(ip, "neuron_memory -q -o"),
                magic(ip, "neuron_subgraphs -q -o")):
        assert ip.display_formatter.formatters["text/plain"](obj) == str(obj)
        assert obj._repr_html_().startswith("<")


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
    assert list(tmp_path.iterdir()) == []
