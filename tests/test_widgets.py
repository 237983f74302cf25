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
from torchneuron_lab.tracing.summary import activity
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
    # compiled kernels are drawn differently (hatched, outlined)
    compiled = [t for t in fig.data if "(compiled)" in (t.name or "")]
    assert {t.marker.pattern.shape for t in compiled} == {"/"}
    assert {t.marker.pattern.shape for t in fig.data if t.type == "bar" and "(compiled)" not in t.name} == {None}
    # a box is a bar from start to end (µs since the first event) on its lane: hover and click anywhere on it
    mm = next(t for t in fig.data if t.name == "matmul")
    assert mm.type == "bar" and mm.orientation == "h"
    assert (list(mm.base), list(mm.x), list(mm.y)) == ([2.0], [10.0], [0.0])
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
    tr = next(t for t in fig.data if t.name == "matmul")
    assert [list(map(int, row)) for row in tr.customdata] == [[1, 1]]
    assert "start: 2.00 µs after the first event" in mm


def test_color_by_subgraph_and_renderer(small: Trace) -> None:
    fig = F.timeline_figure(small, color_by="subgraph", pixels=100_000)
    names = {t.name for t in fig.data}
    assert {"subgraph 3", "eager", "dma"} <= names
    webgl = F.timeline_figure(small, render="webgl")
    assert {t.type for t in webgl.data if (t.meta or {}).get("role") == "marker"} == {"scattergl"}
    assert {t.type for t in webgl.data if (t.meta or {}).get("role") == "hover"} == {"bar"}
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
                 for t in fig.data if t.name == "merged (zoom in)"
                 for i in range(len(t.hovertext)))
    singles = sum(len(t.x) for t in fig.data if (t.meta or {}).get("role") == "hover" and t.name != "merged (zoom in)")
    assert merged + singles == 60_000
    assert len(fig.to_json()) < 2_000_000


def test_summary_matches_the_tracing_layer(small: Trace) -> None:
    s = F.timeline_summary(small)
    ref = tracing.time_by_engine(small)
    assert {k: (v["count"], v["total_ns"], v["busy_ns"]) for k, v in s["engines"].items()} == {
        k: (v["count"], v["total_ns"], v["busy_ns"]) for k, v in ref.items()}
    act = activity(small)
    assert (s["span_ns"], s["busy_ns"], s["idle_ns"], s["idle_gaps"]) == (
        act["span_ns"], act["busy_ns"], act["idle_ns"], len(act["gaps"]))
    # busy: [0,1) [2,12) [13,14) [15,16) [17,19) [20,30) [33,34) µs = 26 µs of the 40 µs span (the OOM
    # at 40 µs ends it); idle: the 7 stretches between, 14 µs
    assert (s["span_ns"], s["busy_ns"], s["idle_ns"], s["idle_gaps"]) == (40_000, 26_000, 14_000, 7)
    # per lane: as tracing.idle_gaps defines it
    gaps = tracing.idle_gaps(small)
    assert sum(v["gaps"] for v in s["lanes"].values()) == len(gaps)
    assert sum(v["idle_ns"] for v in s["lanes"].values()) == sum(g["gap_ns"] for g in gaps)
    assert (s["syncs"], s["compiles"], s["ooms"], s["sync_wait_ns"]) == (1, 1, 1, 500)
    text = F.summary_text(s)
    assert "1 host syncs" in text and "tensor" in text and "every lane idle 14.00 µs in 7 stretches" in text


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
    # one hover point per event; a sync has two, its wait bar and its marker (asynchronous device)
    syncs = sum(e.kind == "sync" for e in recorded.events)
    assert syncs == 2 and len(pts["host sync"]) == syncs
    assert sum(len(v) for k, v in pts.items() if k != "host sync") == len(recorded)
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
    # the summary bar says what only the figure shows; time per engine, syncs etc. are the tables' job
    bar = w.summary_bar.value
    assert f"{len(recorded):,} events over" in bar and "every lane idle" in bar
    assert "time per engine" not in bar and "compiles" not in bar
    # the verdict is the figure's own (host/device/sync-bound); syncs are named only inside it
    assert sum(v in bar for v in ("host-bound", "device-bound", "sync-bound")) == 1
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


def warmup_then_loop(delay_ns: int = 200_000_000, kernels: int = 50) -> list[KernelEvent]:
    """One kernel, a long idle stretch (the first-kernel delay, or think-time), then a busy loop of
    ``kernels`` 1.5 µs kernels every 2 µs on two lanes."""
    evs = [ev(0, "aten::mm", 0, "tensor", 0, 1_000)]
    for i in range(1, kernels + 1):
        s = 1_000 + delay_ns + (i - 1) * 2_000
        evs.append(ev(i, "aten::add", 0, "vector" if i % 2 else "scalar", s, s + 1_500))
    return evs


def test_long_idle_stretch_is_collapsed_into_a_marked_break() -> None:
    evs = warmup_then_loop()
    ax = F.time_axis(evs)
    # busy 1 µs + 99.5 µs; the 200 ms stretch is >= 1 ms and >= 25% of that: collapsed
    assert ax.breaks == [(1_000, 200_001_000)]
    active_us = (evs[-1].end_ns - evs[0].start_ns - 200_000_000) / 1e3
    assert ax.end_x == pytest.approx(active_us * (1 + F.BREAK_WIDTH))  # the view is the activity
    # measured time <-> axis: slope 1 outside the break, round trip exact
    t = np.asarray([0, 500, 1_000, 200_001_000, 200_050_000, 200_100_500])
    assert ax.t(ax.x(t)).tolist() == t.tolist()
    assert ax.x([200_051_000])[0] - ax.x([200_001_000])[0] == pytest.approx(50.0)
    fig = F.timeline_figure(evs)
    assert fig.layout.meta["breaks"] == [[1_000, 200_001_000]]
    (band,) = [sh for sh in fig.layout.shapes if sh.type == "rect"]
    assert (band.x0, band.x1) == pytest.approx((1.0, 1.0 + F.BREAK_WIDTH * active_us))
    assert [a.text for a in fig.layout.annotations] == ["idle 200.00 ms"]
    assert "1 idle stretch compressed" in fig.layout.xaxis.title.text
    # ticks give measured time, never inside the break, and increase
    vals, texts = list(fig.layout.xaxis.tickvals), list(fig.layout.xaxis.ticktext)
    assert texts[0] == "0.00 ms" and texts[-1] == "200.10 ms" and vals == sorted(vals)
    assert not any(band.x0 < v < band.x1 for v in vals)
    # every bar sits where its event is on the compressed axis, the loop right after the break
    bars = [t for t in fig.data if t.type == "bar"]
    starts = sorted(float(b) for t in bars for b in t.base)
    assert starts[0] == 0.0 and starts[1] == pytest.approx(band.x1)


def test_short_or_regular_gaps_stay_to_scale() -> None:
    loop = [ev(i, "aten::add", 0, "vector", i * 400_000, i * 400_000 + 100_000) for i in range(10)]  # 0.3 ms gaps
    assert F.time_axis(loop).breaks == []
    # 1.5 ms idle in a trace with 20 ms of activity: under 25% of the active time, kept to scale
    busy = [ev(0, "aten::mm", 0, "tensor", 0, 10_000_000), ev(1, "aten::mm", 0, "tensor", 11_500_000, 21_500_000)]
    assert F.time_axis(busy).breaks == []
    fig = F.timeline_figure(busy)
    assert fig.layout.xaxis.tickmode is None and fig.layout.meta["breaks"] == []
    # think-time between cells: two bursts 10 s apart, both breaks collapsed
    cells = warmup_then_loop(5_000_000_000) + [ev(99, "aten::relu", 0, "vector", 15_000_000_000, 15_000_002_000)]
    assert [b[1] - b[0] for b in F.time_axis(cells).breaks] == [5_000_000_000, 15_000_000_000 - 5_000_100_500]


def test_summary_idle_never_exceeds_the_span() -> None:
    # two lanes idling at different times: per-lane idle adds up to more than the span, the union's never
    evs = [ev(0, "aten::mm", 0, "tensor", 0, 100_000), ev(1, "aten::mm", 0, "tensor", 190_000, 200_000),
           ev(2, "aten::add", 0, "vector", 10_000, 20_000), ev(3, "aten::add", 0, "vector", 180_000, 190_000)]
    s = F.timeline_summary(evs)
    assert sum(v["idle_ns"] for v in s["lanes"].values()) == 90_000 + 160_000 > s["span_ns"] == 200_000
    assert (s["busy_ns"], s["idle_ns"], s["idle_gaps"]) == (120_000, 80_000, 1)
    assert s["busy_ns"] + s["idle_ns"] == s["span_ns"]
    for seed in range(3):
        events = synth(3_000, seed=seed)
        s = F.timeline_summary(events)
        act = activity(events)
        assert (s["busy_ns"], s["idle_ns"], s["idle_gaps"]) == (act["busy_ns"], act["idle_ns"], len(act["gaps"]))
        assert 0 <= s["idle_ns"] <= s["span_ns"] and s["busy_ns"] + s["idle_ns"] == s["span_ns"]
    w = TimelineWidget(Trace(evs))
    assert "some lane busy 120.00 µs · every lane idle 80.00 µs (40%)" in w.summary_bar.value


def test_bars_cover_their_events_and_the_extent_covers_the_trace(small: Trace) -> None:
    fig = F.timeline_figure(small, pixels=100_000)
    cols = F.EventColumns.build(small)
    for tr in fig.data:
        if tr.type != "bar":
            continue
        for (seq, i), base, width in zip(tr.customdata, tr.base, tr.x):
            e = cols.events[int(i)]
            assert e.seq == int(seq)
            assert (base, base + width) == pytest.approx(((e.start_ns - cols.t0) / 1e3, (e.end_ns - cols.t0) / 1e3))
    (extent,) = [t for t in fig.data if (t.meta or {}).get("role") == "extent"]
    assert list(extent.x) == [0.0, 40.0] and extent.hoverinfo == "skip" and extent.showlegend is False


def test_zoom_out_returns_to_the_full_view_and_re_aggregates() -> None:
    w = TimelineWidget(Trace(synth(20_000, seed=3)), max_boxes=2000)
    full = dict(w.figure.layout.meta)
    end = w.axis.end_x
    # drag-zoom as the browser reports it
    w.figure.plotly_relayout({"xaxis.range[0]": end * 0.40, "xaxis.range[1]": end * 0.41})
    zoomed = dict(w.figure.layout.meta)
    assert w.window is not None and zoomed["merged"] < full["merged"] and zoomed["num_events"] == full["num_events"]
    extent = [t for t in w.figure.data if (t.meta or {}).get("role") == "extent"]
    assert [list(t.x) for t in extent] == [[0.0, end]]  # autorange still sees the whole trace
    # double-click / Reset axes / Autoscale: autorange
    w.figure.plotly_relayout({"xaxis.autorange": True})
    assert w.window is None and dict(w.figure.layout.meta) == full
    # zoom again, then the range slider pulled out to the whole trace (plotly pads a little)
    w.figure.plotly_relayout({"xaxis.range[0]": end * 0.1, "xaxis.range[1]": end * 0.2})
    assert w.window is not None and w.figure.layout.xaxis.autorange is False
    w.figure.plotly_relayout({"xaxis.range": [-end * 0.01, end * 1.01]})
    assert w.window is None and dict(w.figure.layout.meta) == full
    # and double-click works a second time
    w.figure.plotly_relayout({"xaxis.range[0]": end * 0.5, "xaxis.range[1]": end * 0.6})
    w.figure.plotly_relayout({"xaxis.autorange": True})
    assert w.window is None and dict(w.figure.layout.meta) == full


def test_zoom_on_a_compressed_axis_maps_back_to_measured_time() -> None:
    evs = warmup_then_loop()
    w = TimelineWidget(Trace(evs))
    x0, x1 = (float(v) for v in w.axis.x([200_011_000, 200_031_000]))
    w.figure.plotly_relayout({"xaxis.range[0]": x0, "xaxis.range[1]": x1})
    assert w.window == (200_011_000, 200_031_000)
    # ticks recomputed for the window (20 µs: a 2 µs step), in measured time
    assert list(w.figure.layout.xaxis.ticktext) == [f"200.0{v} ms" for v in range(12, 31, 2)]


def test_static_fallback_one_display_live_or_exported(recorded: Trace) -> None:
    """With static_fallback() a widget's display data holds the widget view AND a static copy: a live
    front-end renders the widget, an export without widget state (nbconvert) the static copy -- never both."""
    nbformat = pytest.importorskip("nbformat")
    nbconvert = pytest.importorskip("nbconvert")
    from torchneuron_lab.widgets import timeline as T

    saved = dict(T._STATIC)
    try:
        T._STATIC.update(enabled=False, plotlyjs_sent=False)
        assert "text/html" not in TimelineWidget(recorded)._repr_mimebundle_()  # off by default
        T.static_fallback()
        first = TimelineWidget(recorded)._repr_mimebundle_()
        second = MemoryWidget(fake_snapshot())._repr_mimebundle_()
        third = SubgraphWidget([], [{"reason": "print() call", "location": "cell [2], line 9"}])._repr_mimebundle_()
    finally:
        T._STATIC.update(saved)
    for bundle in (first, second, third):
        assert {"application/vnd.jupyter.widget-view+json", "text/plain", "text/html"} <= set(bundle)
    # plotly.js inlined once per kernel (the first static copy), never from a CDN
    assert first["text/html"].count("Plotly.newPlot") == 1 and len(first["text/html"]) > 3_000_000
    assert second["text/html"].count("Plotly.newPlot") == 2 and len(second["text/html"]) < 500_000
    assert "cdn.plot.ly" not in first["text/html"] + second["text/html"]
    assert "every lane idle" in first["text/html"] and "aten::mm" in first["text/html"]
    assert "print() call" in third["text/html"]
    # an exported notebook without widget state shows each figure once, as the static copy
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("w", outputs=[nbformat.v4.new_output("display_data", data=b)])
                for b in (first, second)]
    body, _ = nbconvert.HTMLExporter().from_notebook_node(nb)
    assert body.count("Plotly.newPlot(") == 3  # timeline; memory history and block map
    assert "application/vnd.jupyter.widget-view+json" not in body


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


def test_memory_views_refuse_a_device_the_snapshot_does_not_hold() -> None:
    snap = fake_snapshot()  # device_traces for neuron:0 and neuron:1
    assert F.memory_timeline(snap, 1)["allocated"] == []
    for bad in (2, 5, -1):
        for call in (lambda d=bad: F.memory_timeline(snap, d), lambda d=bad: F.segment_map_figure(snap, device=d),
                     lambda d=bad: F.top_allocations(snap, device=d), lambda d=bad: MemoryWidget(snap, device=d)):
            with pytest.raises(ValueError, match=rf"neuron:{bad} is not in this snapshot: it holds neuron:0 and neuron:1"):
                call()
    with pytest.raises(TypeError, match="device must be an int, not str"):
        MemoryWidget(snap, device="1")
    one = fake_snapshot()["device_traces"][0]  # one device's trace entries
    assert len(F.memory_timeline(one, 0)["allocated"]) == 6
    with pytest.raises(ValueError, match=r"neuron:1 is not in this snapshot: it holds neuron:0\b"):
        F.memory_timeline(one, 1)


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


# ------------------------------------------------------------------------------------ asynchronous device
def _async_trace(name: str) -> Trace:
    import _async_traces as A

    return Trace(tracing.events_from_columns(getattr(A, name)()))


def test_async_timeline_host_lane_stream_lanes_flows_queue_and_waits() -> None:
    import _async_traces as A

    t = _async_trace("two_streams")
    fig = F.timeline_figure(t, pixels=100_000)
    meta = fig.layout.meta
    assert meta["lanes"] == ["neuron:0 · tensor", "neuron:0 · scalar", "neuron:0 · s1 · dma", "neuron:1 · tensor",
                             "host"]
    assert (meta["async"], meta["launches"], meta["flows"], meta["queue_devices"]) == (True, 4, 4, [0, 1])
    assert meta["t0_ns"] == A.BASE  # the first launch, not the first kernel
    host = 4.0
    launch = next(tr for tr in fig.data if tr.name == "host launch")
    # launches [0,50] [60,100] [110,150] [160,200] ns on the host lane, µs since the first launch
    assert (list(launch.base), list(launch.y)) == ([0.0, 0.06, 0.11, 0.16], [host] * 4)
    assert [round(b + w, 6) for b, w in zip(launch.base, launch.x)] == [0.05, 0.1, 0.15, 0.2]
    assert "queued: 50 ns between launch and start" in launch.hovertext[0]
    assert "runs on: neuron:0 · s1 · dma" in launch.hovertext[1] and "source: cell [5], line 2" in launch.hovertext[1]
    flow = next(tr for tr in fig.data if (tr.meta or {}).get("role") == "flow")
    # from the end of each launch (host lane) to the start of its kernel (its lane)
    segs = [(flow.x[i], flow.y[i], flow.x[i + 1], flow.y[i + 1]) for i in range(0, len(flow.x), 3)]
    assert sorted(segs) == [(0.05, host, 0.1, 0.0), (0.1, host, 0.2, 2.0), (0.15, host, 0.9, 1.0),
                            (0.2, host, 0.3, 3.0)]
    wait = next(tr for tr in fig.data if tr.name == "host wait")
    assert (list(wait.base), list(wait.x), list(wait.y)) == ([0.21], [pytest.approx(0.79)], [host])
    assert "host waited: 790 ns" in wait.hovertext[0] and "source: cell [5], line 5" in wait.hovertext[0]
    assert "waited on: neuron:0 stream 0" in wait.hovertext[0]
    sync = next(tr for tr in fig.data if tr.name == "host sync")
    assert "host waited: 790 ns" in sync.hovertext[0]
    q0 = next(tr for tr in fig.data if (tr.meta or {}).get("role") == "queue" and tr.meta["device"] == 0)
    # neuron:0: +1 at 50 (mm queued), 100 (copy), 150 (relu); -1 at 700 (copy), 900 (mm), 1000 (relu)
    assert [round(v, 6) for v in q0.x] == [0.05, 0.1, 0.15, 0.7, 0.9, 1.0] and list(q0.y) == [1, 2, 3, 2, 1, 0]
    assert (q0.yaxis, q0.line.shape) == ("y2", "hv")
    assert fig.layout.yaxis2.domain[0] == 0.0 and fig.layout.yaxis.domain[0] > fig.layout.yaxis2.domain[1]
    # a synchronous trace draws none of it
    legacy = F.timeline_figure(_async_trace("two_streams").events[:0] + [
        dataclasses_replace(e) for e in t.events])
    assert legacy.layout.meta["async"] is False and legacy.layout.meta["flows"] == 0
    assert not [tr for tr in legacy.data if (tr.meta or {}).get("role") in ("flow", "queue", "launch")]


def dataclasses_replace(e: KernelEvent) -> KernelEvent:
    import dataclasses

    return dataclasses.replace(e, host_start_ns=0, host_end_ns=0, correlation=0)


def test_queue_depth_steps_match_the_tracing_layer() -> None:
    for name in ("device_bound", "two_streams", "sync_bound", "host_bound"):
        t = _async_trace(name)
        mine = {d: {"t_ns": a.tolist(), "depth": b.tolist()} for d, (a, b) in
                F.queue_depth_steps(F.EventColumns.build(t)).items()}
        assert mine == tracing.queue_depth(t), name
        assert F.bound_of(F.EventColumns.build(t)) == tracing.classify_region(t), name


def test_async_widget_click_draws_the_flow_arrow_and_summary_names_the_bound() -> None:
    w = TimelineWidget(_async_trace("sync_bound"))
    assert "sync-bound: the host waited 300 ns at 3 syncs" in w.summary_bar.value
    k = next(i for i, e in enumerate(w.events) if e.kind == "kernel" and e.start_ns == w.cols.t0 + 210)
    shown = w.select(k)
    # the arrow runs from the end of the launch (210 ns, host lane) to the kernel's start (210 ns)
    host = float(w.cols.host_lane)
    arrow = shown["flow"]
    assert (arrow["ax"], arrow["ay"], arrow["x"], arrow["y"]) == (
        pytest.approx(0.21), host, pytest.approx(0.21), float(w.cols.lane[k]))
    assert [a.name for a in w.figure.layout.annotations] == ["flow"]
    assert shown["event"]["queued"] == "0 ns between launch and start"
    # a click on a sync keeps no arrow
    s = next(i for i, e in enumerate(w.events) if e.kind == "sync")
    assert w.select(s)["flow"] is None and list(w.figure.layout.annotations) == []


def test_widget_updates_never_delete_traces_and_zoom_is_one_update() -> None:
    """The class of the empty-axes bug: a redraw must never leave the front end with no traces (no
    deleteTraces message, ever), and a zoom with the same trace structure is a single update message."""
    w = TimelineWidget(Trace(synth(20_000, seed=5)), max_boxes=2000)
    sent: list[str] = []
    for name in ("_send_addTraces_msg", "_send_deleteTraces_msg", "_send_update_msg", "_send_relayout_msg",
                 "_send_restyle_msg"):
        orig = getattr(w.figure, name)

        def spy(*a: object, _n: str = name, _o: object = orig, **k: object) -> object:
            sent.append(_n)
            return _o(*a, **k)  # type: ignore[operator]
        setattr(w.figure, name, spy)
    visible_before = sum(1 for tr in w.figure.data if tr.visible is not False)
    end = w.axis.end_x
    w.figure.plotly_relayout({"xaxis.range[0]": end * 0.40, "xaxis.range[1]": end * 0.41})
    w.figure.plotly_relayout({"xaxis.autorange": True})
    w.color_toggle.value = "subgraph"
    w.color_toggle.value = "family"
    assert "_send_deleteTraces_msg" not in sent
    assert sent.count("_send_update_msg") >= 4
    assert sum(1 for tr in w.figure.data if tr.visible is not False) == visible_before
    # every event of the full view is drawn again after all that
    full = F.timeline_figure(w.cols, max_boxes=2000, pixels=w.pixels, rangeslider=True, width=w.width, axis=w.axis)
    drawn = {(tr.name, len(tr.x)) for tr in w.figure.data if tr.visible is not False and tr.x is not None}
    assert drawn == {(tr.name, len(tr.x)) for tr in full.data}
    # a zoom whose window has the same kinds of traces: one update message, nothing added
    sent.clear()
    w.figure.plotly_relayout({"xaxis.range[0]": end * 0.50, "xaxis.range[1]": end * 0.52})
    assert sent.count("_send_addTraces_msg") == 0 and "_send_deleteTraces_msg" not in sent
    assert sent.count("_send_update_msg") == 1  # traces, ticks and the zoomed range together
    assert w.figure.layout.xaxis.autorange is False and w.window is not None


def test_apply_traces_reuses_slots_and_hides_the_rest() -> None:
    from torchneuron_lab.widgets.timeline import apply_traces

    fw = go.FigureWidget([go.Bar(x=[1], y=[0], name="a"), go.Bar(x=[2], y=[1], name="b"),
                          go.Scatter(x=[0], y=[0], name="s")])
    uids = [t.uid for t in fw.data]
    apply_traces(fw, [go.Scatter(x=[5, 6], y=[1, 1], name="s2", mode="lines"), go.Bar(x=[3], y=[2], name="c"),
                      go.Scattergl(x=[1], y=[1], name="gl")], {"title.text": "T"})
    assert [t.uid for t in fw.data][:3] == uids and len(fw.data) == 4
    assert [(t.type, t.name, t.visible) for t in fw.data] == [
        ("bar", "c", True), ("bar", None, False), ("scatter", "s2", True), ("scattergl", "gl", True)]
    assert list(fw.data[2].x) == [5, 6] and fw.data[2].mode == "lines" and fw.layout.title.text == "T"


def test_memory_owners_are_notebook_cells_in_ipython_without_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    """Widgets used in a notebook without ``%load_ext torchneuron_lab``: an allocation's owner is its cell
    ('cell [n], line k'), mapped as the recorder maps kernels, not IPython's compiled-cell file path."""
    from IPython.testing.globalipapp import get_ipython

    monkeypatch.setattr(recorder, "_source_mapper", None)  # the extension is not loaded
    shell = get_ipython()
    mem = torch.neuron.memory
    mem._record_memory_history("all", context="all")
    try:
        r = shell.run_cell("import torch\nmem_owner = torch.empty(7 << 20, dtype=torch.uint8, device='neuron')",
                           store_history=True)
        assert r.error_in_exec is None
        snap = mem._snapshot()
    finally:
        mem._record_memory_history(None)
        shell.user_ns.pop("mem_owner", None)
    n = r.execution_count
    cell_file = next(f for f, k in shell.compile._filename_map.items() if k == n)
    owner = next(row for row in F.top_allocations(snap, 100, device=0) if row["size"] == 7 << 20)
    assert owner["source"] == f"cell [{n}], line 2"
    seg = F.segment_map_figure(snap, device=0)
    text = " ".join(h for t in seg.data if t.name == "allocated block" for h in t.hovertext)
    assert f"allocated at: cell [{n}], line 2" in text and cell_file not in text
    # a block allocated before history recording has no frames: said so, not guessed
    assert F._user_frame([]) == "unknown (allocated before allocator history was recorded with context)"
    # outside IPython (no shell) the same frames read as file:line
    monkeypatch.setattr("IPython.get_ipython", lambda: None)
    plain = next(row for row in F.top_allocations(snap, 100, device=0) if row["size"] == 7 << 20)
    assert plain["source"] == f"{cell_file}:2 in <module>"


def test_timeline_sources_are_notebook_cells_in_ipython_without_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    from IPython.testing.globalipapp import get_ipython

    monkeypatch.setattr(recorder, "_source_mapper", None)  # the extension is not loaded
    shell = get_ipython()
    shell.user_ns["recorder"] = recorder
    r = shell.run_cell("import torch\ntl_x = torch.ones(4, 4, device='neuron')\n"
                       "with recorder.record(with_stack=True) as tl_box:\n    tl_y = tl_x * 3\n", store_history=True)
    assert r.error_in_exec is None
    trace = shell.user_ns.pop("tl_box")[0]
    n = r.execution_count
    (mul,) = [e for e in trace.events if e.kind == "kernel"]
    assert mul.location is not None and not mul.location.startswith("cell [")  # what the recorder stored
    assert F.event_details(mul)["source"] == f"cell [{n}], line 4"
    w = TimelineWidget(trace)
    assert w.select(trace.events.index(mul))["event"]["source"] == f"cell [{n}], line 4"


def test_a_zoom_redraw_states_its_range_in_the_update_that_draws_it() -> None:
    # The browser reports a zoom; the kernel redraws the window and must state the range it drew for in
    # what it sends back. plotly's Python side drops an unchanged value from its messages (the browser's
    # own report already set it), and the update then carried `xaxis.autorange: false` without a range:
    # the browser test read x = [0, 1] after a drag-zoom (issue 9). A separate relayout right behind the
    # update still left a moment with the new traces drawn and no range (read once more, 2026-12-05): the
    # range travels IN the update that carries the traces, the message the front end applies at once.
    w = TimelineWidget(Trace(synth(20_000, seed=3)), max_boxes=2000)
    end = w.axis.end_x
    sent: list[tuple[str, dict]] = []

    def spy(change: dict) -> None:  # what the kernel sends, less the echo of the browser's own report
        if change["new"] is not None and change["new"].get("source_view_id") != "browser":
            sent.append((change["name"], dict(change["new"])))
    w.figure.observe(spy, names=["_py2js_update", "_py2js_relayout", "_py2js_restyle"])
    # as plotly's front end reports a drag-zoom (its view id: the message is not applied to that view again)
    w.figure.plotly_relayout({"xaxis.range[0]": end * 0.40, "xaxis.range[1]": end * 0.41}, source_view_id="browser")
    assert w.window is not None
    assert [name for name, _ in sent] == ["_py2js_update"], sent  # one message: traces, ticks, range
    msg = sent[0][1]
    assert msg["style_data"], msg  # the window's traces ...
    assert msg["layout_data"]["xaxis.range"] == pytest.approx([end * 0.40, end * 0.41])  # ... under its range
    assert msg["layout_data"]["xaxis.autorange"] is False
    assert w.figure._forced_layout is None  # nothing left over for a later, unrelated update
    # the colour toggle's redraw keeps the window and states the range shown: when the new colouring needs more
    # trace slots, plotly.js autoranges on their addition, and the window's bars were then drawn over the
    # whole trace's axis (tenth hostile review)
    sent.clear()
    w.color_toggle.value = "subgraph"
    updates = [m for name, m in sent if name == "_py2js_update"]
    assert len(updates) == 1
    assert updates[0]["layout_data"]["xaxis.range"] == pytest.approx([end * 0.40, end * 0.41])
    assert updates[0]["layout_data"]["xaxis.autorange"] is False


def test_apply_traces_states_forced_layout_on_a_plain_figure_widget_too() -> None:
    # a plotly FigureWidget (not the lab's) has no merged update: the forced properties follow in a relayout
    from torchneuron_lab.widgets.timeline import apply_traces

    fw = go.FigureWidget([go.Bar(x=[1], y=[0])], layout={"xaxis": {"range": [2, 3]}})
    sent: list[dict] = []
    fw._send_relayout_msg = lambda layout_data, **k: sent.append(dict(layout_data))
    apply_traces(fw, [go.Bar(x=[5], y=[1])], force={"xaxis.range": [2, 3], "xaxis.autorange": False})
    assert sent and sent[-1] == {"xaxis.range": [2, 3], "xaxis.autorange": False}, sent


def _zoomable_widget() -> TimelineWidget:
    with recorder.record() as box:
        x = torch.randn(64, 64, device="neuron")
        for _ in range(30):
            x = (x @ x).relu() / 64
        x.sum().item()
    return TimelineWidget(box[0])


def test_a_zoom_and_a_double_click_keep_the_lanes_order_and_range(monkeypatch) -> None:
    # emptied bar slots were sent orientation None (then 'h' again), and plotly.js autoranges the axes of
    # a trace whose orientation changes: a zoom showed one lane stretched, a double-click the lanes reversed
    from torchneuron_lab.widgets import timeline as TL

    w = _zoomable_widget()
    y_range = tuple(w.figure.layout.yaxis.range)
    assert y_range[0] > y_range[1]  # reversed: the first lane on top
    sent: list[dict] = []
    real = TL._FigureWidget._send_update_msg

    def spy(self, restyle_data, relayout_data, trace_indexes=None, source_view_id=None):
        sent.append(dict(restyle_data or {}))
        return real(self, restyle_data, relayout_data, trace_indexes, source_view_id)

    monkeypatch.setattr(TL._FigureWidget, "_send_update_msg", spy)
    w.figure.layout.xaxis.range = [0.3 * w.axis.end_x, 0.45 * w.axis.end_x]  # what a drag-zoom reports
    assert w.window is not None
    w.figure.layout.xaxis.autorange = True  # a double-click
    assert w.window is None
    assert len(sent) >= 2
    for restyle in sent:
        assert None not in list(restyle.get("orientation", [])), restyle.get("orientation")
    assert tuple(w.figure.layout.yaxis.range) == y_range
    assert w.figure.layout.yaxis.autorange is False


def test_hover_text_shows_quotes_as_they_are_and_still_escapes_markup() -> None:
    t = 10**12
    fig = F.timeline_figure([
        KernelEvent(seq=0, kind="kernel", name='my_op("x")', device=0, engine="tensor", start_ns=t, end_ns=t + 1000),
        KernelEvent(seq=1, kind="kernel", name="<script>alert(1)</script>", device=0, engine="tensor",
                    start_ns=t + 2000, end_ns=t + 3000),
    ])
    hovers = [h for tr in fig.data if tr.type == "bar" for h in (tr.hovertext or ())]
    assert any('my_op("x")' in h for h in hovers)
    assert not any("&quot;" in h for h in hovers)
    assert any("&lt;script&gt;alert(1)&lt;/script&gt;" in h for h in hovers)
    assert not any("<script>" in h for h in hovers)


def test_a_single_kernel_of_zero_duration_is_drawn() -> None:
    t = 10**12
    fig = F.timeline_figure([KernelEvent(seq=0, kind="kernel", name="aten::add", device=0, engine="tensor",
                                         start_ns=t, end_ns=t)])
    widths = [float(v) for tr in fig.data if tr.type == "bar" for v in tr.x]
    assert len(widths) == 1 and widths[0] > 0


def test_the_details_panel_wraps_long_names() -> None:
    t = 10**12
    long_name = "aten::" + "x" * 3000
    events = [KernelEvent(seq=i, kind="kernel", name=long_name if i == 1 else f"aten::op{i}", device=0,
                          engine="vector", start_ns=t + 1000 * i, end_ns=t + 1000 * i + 500) for i in range(3)]
    w = TimelineWidget(events)
    w.select(0)  # a short name, with the long one among its neighbours
    html_text = w.details.value
    assert html_text.count("overflow-wrap:anywhere") >= 1 + 2 * 4  # the panel, and each neighbour's cells
    assert "break-word" not in html_text
    assert "table-layout:fixed'><colgroup>" in html_text  # the neighbours' columns have fixed widths


def test_list_tables_keep_short_values_on_one_line() -> None:
    # overflow-wrap:anywhere on every cell of an auto-layout table let each column shrink to one character:
    # the SubgraphWidget's ids and kinds were drawn one or two characters per line
    from torchneuron_lab.widgets.timeline import _table

    rows = [{"id": 100 + i, "kind": "inference", "name": "x" * (3000 if i == 0 else 5)} for i in range(3)]
    text = _table(rows)
    assert "anywhere" not in text and text.count("overflow-wrap:break-word") == 9
    assert "table-layout:fixed" not in text


def test_memory_widget_of_one_device_shows_that_device_only() -> None:
    mem = torch.neuron.memory
    d1 = torch.empty(12 << 20, dtype=torch.uint8, device="neuron:1")  # live on neuron:1, before history
    mem._record_memory_history("all", context="all")
    try:
        d0 = [torch.empty(8 << 20, dtype=torch.uint8, device="neuron:0") for _ in range(2)]
        snap = mem._snapshot()
    finally:
        mem._record_memory_history(None)
    w = MemoryWidget(snap, device=1)
    assert {tr.name.split()[0] for tr in w.history.data} <= {"neuron:1"}
    assert list(w.history.layout.meta["devices"]) == ["1"]
    assert "neuron:0" not in repr(w) and "neuron:0" not in w._summary_html()
    assert list(MemoryWidget(snap, device=0).history.layout.meta["devices"]) == ["0"]
    del d0, d1


def test_save_html_writes_every_widget_and_refuses_other_objects(tmp_path: Path) -> None:
    snap = torch.neuron.memory._snapshot()
    for name, widget in [("memory", MemoryWidget(snap)), ("subgraphs", SubgraphWidget([]))]:
        path = save_html(widget, tmp_path / f"{name}.html", title=f"{name} <report>")
        text = path.read_text()
        assert text.startswith("<!DOCTYPE html>")
        assert f"<title>{name} &lt;report&gt;</title>" in text
    assert "plotly" in (tmp_path / "memory.html").read_text()  # its figures, with plotly.js inlined
    assert "cdn.plot.ly" not in (tmp_path / "memory.html").read_text()
    with pytest.raises(TypeError, match="save_html takes"):
        save_html(object(), tmp_path / "x.html")
    assert not (tmp_path / "x.html").exists()


def test_subgraph_widget_shows_break_explanations_hints_and_recompiles() -> None:
    from torchneuron_lab.compiler import capture

    torch._dynamo.reset()
    msg = '<img src=x onerror="alert(1)"> the user' + "'s reason é漢字"

    def f(x):
        y = x.sin() * 2
        torch._dynamo.graph_break(msg=msg)
        return y.cos() + 1

    cf = torch.compile(f, backend="neuron")
    before = len(capture.recompiles())
    cf(torch.randn(8, 8, device="neuron"))
    cf(torch.randn(16, 8, device="neuron"))  # another shape: a recompile
    breaks = [b for b in capture.graph_breaks() if msg in (b.as_dict().get("explanation") or "")]
    recompiles = capture.recompiles()[before:]
    assert breaks and recompiles
    w = SubgraphWidget([], breaks, recompiles)
    assert "the user&#x27;s reason é漢字" in w._breaks_html  # the explanation, escaped
    assert "<img" not in w._breaks_html and "&lt;img src=x" in w._breaks_html
    assert "<b>recompiles</b>" in w._breaks_html
    assert recompiles[0].failures and html_escape(recompiles[0].failures[0]) in w._breaks_html
    assert "recompile of f" in repr(w)
    torch._dynamo.reset()


def html_escape(text: str) -> str:
    import html

    return html.escape(text)
