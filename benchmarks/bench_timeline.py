"""Kernel-timeline scale: 1,000,000 synthetic kernel events -> interactive widget, time and payload.

Issue 5's bar: a profile of 1,000,000 kernel events becomes an interactive widget in <= 3 s with a
bounded payload. Measured here, on synthetic events shaped like a training loop on 2 devices (bursts
of short eager kernels with idle gaps, 1% long matmuls, compiled-subgraph kernels, DMA, a host sync
every 1,000 events):

- ``figure_build``: ``timeline_figure(events)`` (columns + level-of-detail + traces), best of N;
- ``widget_build``: ``TimelineWidget(trace)`` (figure + vectorised summary + Plotly FigureWidget);
- ``zoom_refine``: the relayout callback for a zoom to 1% of the span (LOD recomputed for the window);
- ``payload``: bytes of the figure's JSON (what goes to the browser), and the boxes drawn;
- ``async_*``: the same for the asynchronous device's trace (every kernel with its host launch span:
  host lane of launches, launch -> kernel links, queue-depth panel), and its ratio to the synchronous one.

Generating the events is not timed. ``--quick`` uses 100,000 events and one repeat.

    python benchmarks/bench_timeline.py [--quick] [--events N] [--json out.json] [--strict]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("TORCHNEURON_LAB_REGISTER", "0")  # plain data only: no device needed

from torchneuron_lab.tracing import KernelEvent, Trace

BAR_S = 3.0
ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")
NAMES = ("aten::add.Tensor", "aten::mul.Tensor", "aten::relu", "aten::sum.dim_IntList", "aten::copy_")


def synthetic_events(n: int, seed: int = 0) -> list[KernelEvent]:
    rng = np.random.default_rng(seed)
    dur = rng.integers(300, 4_000, n)
    long = rng.random(n) < 0.01
    dur[long] = rng.integers(200_000, 2_000_000, int(long.sum()))
    gap = rng.integers(50, 1_500, n)
    gap[rng.random(n) < 0.002] += 5_000_000  # idle stretches between steps
    start = np.cumsum(gap) + np.cumsum(np.where(long, dur // 4, 0))
    eng = rng.integers(0, 5, n)
    eng[long] = 0
    dev = rng.integers(0, 2, n)
    sub = np.where(rng.random(n) < 0.2, rng.integers(0, 6, n), -1)
    events = []
    for i in range(n):
        s, e = int(start[i]), int(start[i] + dur[i])
        if i % 1000 == 999:
            events.append(KernelEvent(i, "sync", "sync: item()", int(dev[i]), "host", s, s + 2_000))
            continue
        engine = ENGINES[eng[i]]
        if engine == "dma":
            events.append(KernelEvent(i, "dma", "dma: host→device", int(dev[i]), "dma", s, e, 65536, 65536,
                                      direction="h2d", est_ns=100.0, source="cell [3], line 4"))
        else:
            name = "aten::mm" if long[i] else NAMES[i % len(NAMES)]
            events.append(KernelEvent(i, "kernel", name, int(dev[i]), engine, s, e, 262144, 131072, 1 << 20,
                                      bool(i % 997 == 0), "[256, 256]", "float32", "", int(sub[i]), 0, (),
                                      50.0, "cell [3], line 5"))
    return events


def _best(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="100,000 events, one repeat (CI smoke run)")
    p.add_argument("--events", type=int, default=None, help="number of events (default 1,000,000)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--json", metavar="PATH", help="also write the results to this JSON file")
    p.add_argument("--strict", action="store_true", help="exit 1 when the bar fails")
    args = p.parse_args()
    n = args.events or (100_000 if args.quick else 1_000_000)
    repeats = args.repeats or (1 if args.quick else 3)

    from torchneuron_lab.widgets import figures as F
    from torchneuron_lab.widgets.timeline import TimelineWidget

    t = time.perf_counter()
    events = synthetic_events(n)
    trace = Trace(events, profile="trn2")
    gen_s = time.perf_counter() - t
    print(f"generated {n:,} events in {gen_s:.2f} s (not timed)")

    TimelineWidget(Trace(events[:1000]))  # warm-up: imports, anywidget, plotly validators
    fig_s, fig = _best(lambda: F.timeline_figure(trace), repeats)
    widget_s, widget = _best(lambda: TimelineWidget(trace), repeats)
    payload = len(fig.to_json())
    meta = fig.layout.meta
    span_us = (max(e.end_ns for e in events[-1000:]) - events[0].start_ns) / 1e3
    t = time.perf_counter()
    widget.figure.layout.xaxis.range = [span_us * 0.50, span_us * 0.51]
    zoom_s = time.perf_counter() - t
    zmeta = widget.figure.layout.meta

    # the asynchronous device's trace: the same kernels, each with its host launch span (issue 12):
    # a host lane of launches, launch -> kernel links, the queue-depth panel
    t = time.perf_counter()
    async_events = []
    for e in events:
        if e.kind in ("kernel", "dma"):
            a = copy.copy(e)
            a.__dict__.update(host_start_ns=e.start_ns - 3_000, host_end_ns=e.start_ns - 1_000,
                              correlation=e.seq + 1, stream=1 if e.kind == "dma" else 0)
            async_events.append(a)
        else:
            async_events.append(e)
    async_trace = Trace(async_events, profile="trn2")
    print(f"made the asynchronous copy in {time.perf_counter() - t:.2f} s (not timed)")
    async_s, async_widget = _best(lambda: TimelineWidget(async_trace), repeats)
    async_meta = async_widget.figure.layout.meta
    async_payload = len(async_widget.figure.to_json())
    t = time.perf_counter()
    async_widget.figure.layout.xaxis.range = [span_us * 0.50, span_us * 0.51]
    async_zoom_s = time.perf_counter() - t

    ok = widget_s <= BAR_S and async_s <= BAR_S
    print(f"TIME timeline.figure_build_{n} = {fig_s:.3f} s")
    print(f"TIME timeline.widget_build_{n} = {widget_s:.3f} s  [bar <= {BAR_S:.2f} s: {'PASS' if ok else 'FAIL'}]")
    print(f"TIME timeline.zoom_refine_{n} = {zoom_s:.3f} s  (window 1% of the span: {zmeta['num_boxes']:,} boxes, "
          f"{zmeta['merged']:,} events merged)")
    print(f"PAYLOAD timeline.figure_json = {payload:,} bytes ({meta['num_boxes']:,} boxes for {meta['num_events']:,} "
          f"events, {meta['merged']:,} merged, renderer {meta['renderer']})")
    print(f"TIME timeline.async_widget_build_{n} = {async_s:.3f} s  [bar <= {BAR_S:.2f} s: "
          f"{'PASS' if async_s <= BAR_S else 'FAIL'}]  ({async_meta['launches']:,} launches, {async_meta['flows']} "
          f"links drawn, queue depth of {len(async_meta['queue_devices'])} devices)")
    print(f"TIME timeline.async_zoom_refine_{n} = {async_zoom_s:.3f} s")
    print(f"RATIO timeline.async/sync widget_build = {async_s / widget_s:.2f}x")
    print(f"PAYLOAD timeline.async_figure_json = {async_payload:,} bytes")
    results = {"events": n, "figure_build_s": fig_s, "widget_build_s": widget_s, "zoom_refine_s": zoom_s,
               "payload_bytes": payload, "boxes": meta["num_boxes"], "merged": meta["merged"],
               "async_widget_build_s": async_s, "async_zoom_refine_s": async_zoom_s,
               "async_payload_bytes": async_payload, "bar_s": BAR_S, "pass": ok}
    print("JSON " + json.dumps(results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 1 if (args.strict and not ok) else 0


if __name__ == "__main__":
    sys.exit(main())
