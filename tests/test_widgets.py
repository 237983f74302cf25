"""Figure builders and widgets, tested by data: traces, lanes, counts, hover fields, LOD, memory peaks.

Synthetic events pin exact numbers; recorded events and real snapshots from the emulated device check
that the builders read what the device actually produces.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import pytest
import torch

import torchneuron_lab  # noqa: F401  (registers the device)
from torchneuron_lab import tracing
from torchneuron_lab.compiler.registry import SubgraphRecord
from torchneuron_lab.device import recorder
from torchneuron_lab.tracing import KernelEvent, Trace
from torchneuron_lab.widgets import figures as F
from torchneuron_lab.widgets.timeline import MemoryWidget, SubgraphWidget, TimelineWidget, save_html

THIS_FILE = Path(__file__).name
HOVER_FIELDS = ("kind:", "lane:", "duration:", "shapes:", "dtypes:", "bytes:", "FLOPs:", "achieved bandwidth:",
                "source:", "subgraph:", "new signature:", "roofline estimate:", "estimate, not measured")


def ev(seq: int, name: str, device: int, engine: str, start: int, end: int, *, kind: str = "kernel",
       subgraph: int = -1, **kw: object) -> KernelEvent:
    defaults: dict[str, object] = {"bytes_read": 4096, "bytes_written": 2048, "flops": 8192, "shapes": "[32, 32]",
                                   "dtypes": "float32", "est_ns": 50.0, "source": f"cell [1], line {seq}"}
    defaults.update(kw)
    return KernelEvent(seq, kind, name, device, engine, start, end, subgraph=subgraph, **defaults)  # type: ignore[arg-type]


@pytest.fixture
def small() -> Trace:
    events = [
        ev(0, "dma: host→device", 0, "dma", 0, 1_000, kind="dma", direction="h2d", flops=0),
        ev(1, "aten::mm", 0, "tensor", 2_000, 12_000, new_signature=True),
        ev(2, "aten::add.Tensor", 0, "vector", 13_000, 14_000),
        ev(3, "aten::sum.dim_IntList", 1, "vector", 15_000, 16_000),
        ev(4, "fused_relu_add_0", 1, "vector", 20_000, 22_000, subgraph=3),
        ev(5, "fused_mm_1", 1, "tensor", 22_000, 30_000, subgraph=3),
        ev(6, "sync: item()", 0, "host", 31_000, 31_500, kind="sync", est_ns=None),
        ev(7, "compile: graph 3", 1, "host", 17_000, 19_000, kind="compile", est_ns=None),
        ev(8, "oom", 1, "host", 40_000, 40_000, kind="oom", est_ns=None),
        ev(9, "aten::relu", 0, "scalar", 33_000, 34_000),
    ]
    return Trace(events, profile="trn2")


def hover_points(fig: go.Figure) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for tr in fig.data:
        if (tr.meta or {}).get("role") in ("hover", "marker"):
            out.setdefault(tr.name, []).extend(tr.hovertext)
    return out


def synth(n: int, seed: int = 0, devices: int = 2) -> list[KernelEvent]:
    rng = np.random.default_rng(seed)
    engines = ("tensor", "vector", "scalar", "gpsimd", "dma")
    dur = rng.integers(100, 3_000, n)
    big = rng.random(n) < 0.01
    dur[big] *= 200
    start = np.cumsum(rng.integers(0, 4_000, n))
    eng = rng.integers(0, 5, n)
    dev = rng.integers(0, devices, n)
    return [
        KernelEvent(i, "dma" if eng[i] == 4 else "kernel", "aten::mul.Tensor", int(dev[i]), engines[eng[i]],
                    int(start[i]), int(start[i] + dur[i]))
        for i in range(n)
    ]


# ------------------------------------------------------------------------------------ timeline
def test_lanes_per_device_and_engine_with_host_last(small: Trace) -> None:
    assert F.lanes_of(small) == [
        "neuron:0 · tensor", "neuron:0 · vector", "neuron:0 · scalar", "neuron:0 · dma",
        "neuron:1 · tensor", "neuron:1 · vector", "host",
    ]
    fig = F.timeline_figure(small)
    assert list(fig.layout.yaxis.ticktext) == F.lanes_of(small)
    assert list(fig.layout.yaxis.tickvals) == list(range(7))
    assert fig.layout.meta["lanes"] == F.lanes_of(small)


def test_every_event_is_drawn_once_with_markers_for_syncs_compiles_ooms(small: Trace) -> None:
    fig = F.timeline_figure(small, pixels=100_000)  # no merging at this resolution
    pts = hover_points(fig)
    assert fig.layout.meta["merged"] == 0 and fig.layout.meta["num_boxes"] == 8  # all but sync and oom
    by_trace = {k: len(v) for k, v in pts.items()}
    assert by_trace == {"matmul": 1, "elementwise": 2, "reduction": 1, "dma": 1, "compile": 1,
                        "elementwise (compiled)": 1, "matmul (compiled)": 1,
                        "host sync": 1, "compile start": 1, "OOM": 1}
    # compiled kernels are drawn differently (dashed, diamonds)
    compiled = [t for t in fig.data if "(compiled)" in (t.name or "")]
    assert {t.line.dash for t in compiled if t.mode == "lines"} == {"dash"}
    assert {t.marker.symbol for t in compiled if t.mode == "markers"} == {"diamond"}
    # a box is a line from start to end (µs since the first event) on its lane
    mm = next(t for t in fig.data if t.name == "matmul" and t.mode == "lines")
    assert list(mm.x[:2]) == [2.0, 12.0] and list(mm.y[:2]) == [0.0, 0.0]
    # markers sit on their lanes: sync and OOM on the host lane
    host = F.lanes_of(small).index("host")
    assert [t.y[0] for t in fig.data if t.name in ("host sync", "OOM")] == [host, host]
    assert fig.layout.shapes[0].x0 == 40.0  # OOM line across the lanes
    assert fig.layout.meta["renderer"] == "svg"


def test_hover_has_every_field_and_labels_the_estimate(small: Trace) -> None:
    fig = F.timeline_figure(small, pixels=100_000)
    (mm,) = hover_points(fig)["matmul"]
    for field in HOVER_FIELDS:
        assert field in mm, field
    assert "<b>aten::mm</b>" in mm and "10.00 µs" in mm and "on trn2" in mm and "new signature: yes" in mm
    assert "achieved bandwidth: 614.40 MB/s" in mm  # 6144 bytes / 10 µs
    assert "source: cell [1], line 1" in mm
    (fused,) = hover_points(fig)["matmul (compiled)"]
    assert "subgraph: 3" in fused
    # customdata maps each marker back to the event
    tr = next(t for t in fig.data if t.name == "matmul" and t.mode == "markers")
    assert [list(map(int, row)) for row in tr.customdata] == [[1, 1]]


def test_color_by_subgraph_and_renderer(small: Trace) -> None:
    fig = F.timeline_figure(small, color_by="subgraph", pixels=100_000)
    names = {t.name for t in fig.data}
    assert {"subgraph 3", "eager", "dma"} <= names
    assert all(t.type == "scattergl" for t in F.timeline_figure(small, render="webgl").data)
    with pytest.raises(ValueError, match="color_by must be"):
        F.timeline_figure(small, color_by="engine")


def test_lod_counts_add_up_and_refine_on_zoom() -> None:
    events = synth(40_000)
    cols = F.EventColumns.build(events)
    lod = F.lod_aggregate(cols, pixels=800)
    assert lod.total == len(events)
    assert len(lod.singles) + int(lod.agg_count.sum()) == len(events)
    assert len(set(lod.singles.tolist())) == len(lod.singles)
    assert lod.num_boxes < len(events) / 10
    # per lane, too
    per_lane = np.bincount(cols.lane, minlength=len(cols.lanes))
    got = lod.counts_by_lane(cols.lane)
    assert [got.get(i, 0) for i in range(len(cols.lanes))] == per_lane.tolist()
    # events a pixel or longer are never merged
    long = np.nonzero((cols.end - cols.start) >= lod.pixel_ns)[0]
    assert set(long.tolist()) <= set(lod.singles.tolist())
    # zoom: a window holds exactly the events overlapping it, and fewer of them are merged
    t0, t1 = int(cols.start[1000]), int(cols.start[1400])
    zoom = F.lod_aggregate(cols, t0, t1, pixels=800)
    overlapping = int(((cols.end >= t0) & (cols.start <= t1)).sum())
    assert zoom.total == overlapping == len(zoom.singles) + int(zoom.agg_count.sum())
    assert int(zoom.agg_count.sum()) / zoom.total < int(lod.agg_count.sum()) / lod.total
    deep = F.lod_aggregate(cols, t0, t0 + 2_000_000, pixels=10_000)
    assert len(deep.agg_count) == 0  # deep enough: every kernel on its own


def test_lod_merges_only_sub_pixel_neighbours() -> None:
    evs = [ev(i, "aten::add", 0, "vector", i * 10, i * 10 + 5) for i in range(10)]
    evs.append(ev(10, "aten::mm", 0, "vector", 1_000, 2_000))
    lod = F.lod_aggregate(evs, 0, 2_000, pixels=100)  # 20 ns per pixel
    assert lod.singles.tolist() == [10]
    assert lod.agg_count.tolist() == [10] and lod.agg_start.tolist() == [0] and lod.agg_end.tolist() == [95]
    with pytest.raises(ValueError, match="pixels"):
        F.lod_aggregate(evs, pixels=0)


def test_max_boxes_bounds_the_payload() -> None:
    events = synth(60_000, seed=1)
    fig = F.timeline_figure(events, max_boxes=800)
    assert fig.layout.meta["num_boxes"] <= 800
    assert fig.layout.meta["num_events"] == 60_000
    merged = sum(int(t.hovertext[i].split("<b>")[1].split(" ")[0].replace(",", ""))
                 for t in fig.data if t.name == "merged (zoom in)" and t.mode == "markers"
                 for i in range(len(t.hovertext)))
    singles = sum(len(t.x) for t in fig.data if (t.meta or {}).get("role") == "hover" and t.name != "merged (zoom in)")
    assert merged + singles == 60_000
    assert len(fig.to_json()) < 2_000_000


def test_summary_matches_the_tracing_layer(small: Trace) -> None:
    s = F.timeline_summary(small)
    ref = tracing.time_by_engine(small)
    assert {k: (v["count"], v["total_ns"], v["busy_ns"]) for k, v in s["engines"].items()} == {
        k: (v["count"], v["total_ns"], v["busy_ns"]) for k, v in ref.items()}
    gaps = tracing.idle_gaps(small)
    assert s["idle_gaps"] == len(gaps) and s["idle_ns"] == sum(g["gap_ns"] for g in gaps)
    assert (s["syncs"], s["compiles"], s["ooms"], s["sync_wait_ns"]) == (1, 1, 1, 500)
    text = F.summary_text(s)
    assert "1 host syncs" in text and "tensor" in text


# ------------------------------------------------------------------------------------ recorded data
@pytest.fixture(scope="module")
def recorded() -> Trace:
    x = torch.randn(48, 48).to("neuron")
    with recorder.record(with_stack=True) as box:
        for _ in range(2):
            y = (x @ x).relu() + 1
            y.sum().item()
    return box[0]


def test_recorded_trace_builds_and_exports(recorded: Trace, tmp_path: Path) -> None:
    fig = F.timeline_figure(recorded, pixels=1_000_000)
    pts = hover_points(fig)
    assert sum(len(v) for v in pts.values()) == len(recorded)
    mm = pts["matmul"][0]
    assert f"{THIS_FILE}:" in mm and "[48, 48], [48, 48]" in mm and "on trn2 (estimate, not measured)" in mm
    assert "neuron:0 · tensor" in fig.layout.yaxis.ticktext and "host" in fig.layout.yaxis.ticktext
    trace = tracing.to_chrome_trace(recorded)
    tracing.validate_chrome_trace(trace)
    path = tracing.write_chrome_trace(tmp_path / "t.json", recorded)
    assert json.loads(path.read_text())["traceEvents"]


def test_save_html_is_offline(recorded: Trace, tmp_path: Path) -> None:
    path = save_html(F.timeline_figure(recorded), tmp_path / "timeline.html", title="timeline")
    text = path.read_text(encoding="utf-8")
    # (booleans first: pytest would otherwise print a 4 MB string on failure)
    cdn_refs, remote_scripts = text.count("cdn.plot.ly"), len(re.findall(r"<script[^>]+src=", text))
    assert (cdn_refs, remote_scripts) == (0, 0)
    assert len(text) > 3_000_000  # plotly.js is embedded
    found = ["Plotly.newPlot" in text, "aten::mm" in text, "<title>timeline</title>" in text]
    assert found == [True, True, True]


def test_timeline_widget(recorded: Trace) -> None:
    w = TimelineWidget(recorded)
    assert isinstance(w.figure, go.FigureWidget)
    assert w.figure.layout.xaxis.rangeslider.visible is True
    assert "syncs</b> 2" in w.summary_bar.value and "time per engine" in w.summary_bar.value
    mm = next(i for i, e in enumerate(w.events) if e.name == "aten::mm")
    shown = w.select(mm)
    assert shown["event"]["op"] == "aten::mm" and "roofline estimate" in shown["event"]
    assert [n["op"] for n in shown["neighbours"]] == ["aten::mm", "aten::mm"]
    assert "neighbours in the lane" in w.details.value
    # the colour toggle redraws by subgraph
    w.color_toggle.value = "subgraph"
    assert "eager" in {t.name for t in w.figure.data}
    # text fallback: full summary as text/plain and for IPython's pretty printer
    bundle = w._repr_mimebundle_()
    assert bundle["text/plain"] == repr(w) and "engine" in repr(w) and "2 host syncs" in repr(w)
    assert "application/vnd.jupyter.widget-view+json" in bundle


def test_timeline_widget_refines_on_zoom() -> None:
    w = TimelineWidget(Trace(synth(20_000, seed=2)), max_boxes=2000)
    before = w.figure.layout.meta
    assert before["merged"] > 0
    t0 = w.cols.t0
    lo, hi = (int(w.cols.start[100]) - t0) / 1e3, (int(w.cols.start[200]) - t0) / 1e3
    w.figure.layout.xaxis.range = [lo, hi]  # what a zoom in the browser sends
    after = w.figure.layout.meta
    assert w.window is not None and after["merged"] < before["merged"]
    assert list(w.figure.layout.xaxis.range) == [lo, hi]


# ------------------------------------------------------------------------------------ memory
def fake_snapshot() -> dict:
    frames = [{"filename": "/x/torch/nn/mod.py", "line": 3, "name": "f"}, {"filename": "nb.py", "line": 7, "name": "g"}]
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 4096, "time_us": 0, "frames": []},
        {"action": "alloc", "addr": 0, "size": 1024, "time_us": 1, "frames": frames},
        {"action": "alloc", "addr": 1024, "size": 2048, "time_us": 2, "frames": frames[1:]},
        {"action": "free_requested", "addr": 0, "size": 1024, "time_us": 3, "frames": []},
        {"action": "free_completed", "addr": 0, "size": 1024, "time_us": 3, "frames": []},
        {"action": "oom", "device_free": 10, "size": 1 << 30, "time_us": 4, "frames": []},
    ]
    blocks = [
        {"address": 0, "size": 1024, "requested_size": 0, "state": "inactive", "frames": []},
        {"address": 1024, "size": 2048, "requested_size": 2000, "state": "active_allocated", "frames": frames[1:]},
        {"address": 3072, "size": 1024, "requested_size": 0, "state": "inactive", "frames": []},
    ]
    seg = {"device": 0, "address": 0, "total_size": 4096, "allocated_size": 2048, "active_size": 2048,
           "requested_size": 2000, "stream": 0, "segment_type": "small", "segment_pool_id": (0, 0),
           "is_expandable": False, "frames": [], "blocks": blocks}
    return {"segments": [seg], "device_traces": [trace, []], "allocator_settings": {}}


def test_memory_timeline_and_figure_from_a_known_history() -> None:
    snap = fake_snapshot()
    tl = F.memory_timeline(snap)
    assert tl["allocated"] == [0, 1024, 3072, 3072, 2048, 2048]
    assert tl["reserved"] == [4096] * 6
    assert (tl["peak_allocated"], tl["peak_index"], tl["peak_reserved"]) == (3072, 2, 4096)
    assert tl["ooms"] == [{"time_us": 4, "index": 5, "allocated": 2048, "device_free": 10, "size": 1 << 30}]
    fig = F.memory_figure(snap)
    assert fig.layout.meta["devices"] == {"0": {"peak_allocated": 3072, "peak_reserved": 4096, "ooms": 1, "entries": 6}}
    peak = next(t for t in fig.data if t.name == "neuron:0 peak")
    assert peak.y[0] * 2**20 == 3072
    assert any(t.name == "neuron:0 OOM" for t in fig.data)


def test_segment_map_at_a_moment_and_top_allocations() -> None:
    snap = fake_snapshot()
    now = F.segment_map_figure(snap)
    assert now.layout.meta == {"segments": 1, "blocks": 1, "allocated_bytes": 2048, "reserved_bytes": 4096}
    blocks = next(t for t in now.data if t.name == "allocated block")
    assert "size: 2.00 KiB" in blocks.hovertext[0] and "nb.py:7 in g" in blocks.hovertext[0]
    at2 = F.segment_map_figure(snap, at_index=2)  # both blocks live
    assert at2.layout.meta["blocks"] == 2 and at2.layout.meta["allocated_bytes"] == 3072
    top = F.top_allocations(snap, at_index=2)
    assert [(r["size"], r["source"]) for r in top] == [(2048, "nb.py:7 in g"), (1024, "nb.py:7 in g")]
    assert F.segment_map_figure(snap, at_index=-1 + 1).layout.meta["blocks"] == 0  # after segment_alloc only


def test_memory_figure_peak_equals_the_devices_peak() -> None:
    mem = torch.neuron.memory
    torch.neuron.synchronize()
    mem._record_memory_history("all")
    try:
        mem.reset_peak_memory_stats(0)
        a = torch.empty(3 << 20, dtype=torch.uint8, device="neuron")
        b = torch.empty(5 << 20, dtype=torch.uint8, device="neuron")
        del a
        c = torch.empty(1 << 20, dtype=torch.uint8, device="neuron")
        snap = mem._snapshot()
        peak = mem.max_memory_allocated(0)
    finally:
        mem._record_memory_history(None)
    tl = F.memory_timeline(snap, 0)
    assert tl["peak_allocated"] == peak
    assert F.memory_figure(snap).layout.meta["devices"]["0"]["peak_allocated"] == peak
    assert tl["allocated"][-1] == mem.memory_allocated(0)
    seg = F.segment_map_figure(snap, device=0)
    text = " ".join(h for t in seg.data if t.name == "allocated block" for h in t.hovertext)
    assert f"{THIS_FILE}:" in text
    w = MemoryWidget(snap)
    w.slider.value = tl["peak_index"]
    assert w.segments.layout.meta["allocated_bytes"] >= 8 << 20
    assert "peak allocated" in repr(w) and "text/plain" in w._repr_mimebundle_()
    del b, c


# ------------------------------------------------------------------------------------ compiler views
def test_subgraph_and_graph_break_views() -> None:
    rec = SubgraphRecord(id=1, name="forward of f (compile 0/0)", kind="forward", compile_id="0/0", graph_key=1,
                         function="f", fx_code="def forward(self, x):\n    return x + 1\n",
                         op_counts={"aten.add.Tensor": 1}, guards=["x.shape == (4,)"],
                         compile_ms={"dynamo": 1.5, "aot_autograd": 2.0, "lowering": None},
                         kernels=[{"name": "fused_add_0", "aten_ops": ["aten.add.Tensor"], "kind": "fused"}],
                         source=[{"filename": "nb.py", "line": 3, "name": "f", "code": "x + 1", "location": "cell [2], line 3"}],
                         calls=4)
    rows = F.subgraph_rows([rec])
    assert rows == [{"id": 1, "name": "forward of f (compile 0/0)", "kind": "forward", "compile_id": "0/0", "ops": 1,
                     "kernels": 1, "fallbacks": 0, "compile_ms": 3.5, "calls": 4, "guards": 1,
                     "location": "cell [2], line 3"}]
    breaks = [{"reason": "print() call", "filename": "nb.py", "line": 9, "location": "cell [2], line 9",
               "function": "f", "count": 2, "hints": ["remove print"], "explanation": ""}]
    assert F.graph_break_rows(breaks)[0]["location"] == "cell [2], line 9"
    assert F.subgraph_table_figure([rec]).layout.meta["rows"] == 1
    assert list(F.graph_breaks_figure(breaks).data[0].cells.values[0]) == ["print() call"]
    w = SubgraphWidget([rec], breaks)
    assert "def" in w.detail.value and "<span" in w.detail.value and "fused_add_0" in w.detail.value
    assert "graph break at cell [2], line 9: print() call" in repr(w)


def test_timeline_benchmark_quick_run(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_timeline.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=root, check=False)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^TIME timeline\.widget_build_100000 = \d+\.\d{3} s  \[bar <= 3\.00 s: (PASS|FAIL)\]$",
                     proc.stdout, re.MULTILINE), proc.stdout
    assert re.search(r"^PAYLOAD timeline\.figure_json = [\d,]+ bytes", proc.stdout, re.MULTILINE), proc.stdout
    res = json.loads(out.read_text())
    assert res["events"] == 100_000 and res["boxes"] <= 6000
