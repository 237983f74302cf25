"""Synthetic traces of the asynchronous device (issue 12's recorder schema), built from columns.

Each builder returns the recorder's column dict (``events_from_columns`` input) of a region whose
host/device/sync classification and every number of it are known by construction; times are offsets
from ``BASE`` ns. Used by tests/test_tracing.py, tests/test_widgets.py, tests/test_extension.py and the
real-browser test.
"""

from __future__ import annotations

from typing import Any

BASE = 5_000_000_000
THREAD = 7


class _Cols:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def kernel(self, name: str, start: int, end: int, *, launch: tuple[int, int] | None, stream: int = 0,
               engine: str = "tensor", device: int = 0, source: str | None = None, kind: str = "kernel") -> None:
        hs, he = (BASE + launch[0], BASE + launch[1]) if launch else (0, 0)
        self.rows.append({"kind": kind, "name": name, "device": device, "engine": engine, "start_ns": BASE + start,
                          "end_ns": BASE + end, "stream": stream, "host_start_ns": hs, "host_end_ns": he,
                          "correlation": len(self.rows) + 1 if launch else 0, "source": source,
                          "direction": "h2d" if kind == "dma" else ""})

    def sync(self, name: str, start: int, end: int, *, source: str | None, stream: int = -1,
             device: int = 0) -> None:
        self.rows.append({"kind": "sync", "name": name, "device": device, "engine": "host", "start_ns": BASE + start,
                          "end_ns": BASE + end, "stream": stream, "host_start_ns": 0, "host_end_ns": 0,
                          "correlation": 0, "source": source, "direction": ""})

    def columns(self) -> dict[str, list[Any]]:
        keys = list(self.rows[0])
        cols = {k: [r[k] for r in self.rows] for k in keys}
        cols["seq"] = list(range(len(self.rows)))
        cols["thread"] = [THREAD] * len(self.rows)
        return cols


def host_bound() -> dict[str, list[Any]]:
    """4 launches of 90 ns each, back to back; each kernel (10 ns) runs right after its launch ends.
    Span 400 ns, device busy 40 ns, idle 360 ns (90%), all of it while the host was launching."""
    c = _Cols()
    for i in range(4):
        c.kernel("aten::add.Tensor", i * 100 + 90, i * 100 + 100, launch=(i * 100, i * 100 + 90), engine="scalar",
                 source=f"cell [3], line {i + 1}")
    return c.columns()


def device_bound() -> dict[str, list[Any]]:
    """4 launches of 10 ns queue 4 kernels of 100 ns (back to back from 10 ns), then
    ``torch.neuron.synchronize()`` waits 40..410. Queue non-empty 10..410: 400 of 410 ns."""
    c = _Cols()
    for i in range(4):
        c.kernel("aten::mm", 10 + 100 * i, 110 + 100 * i, launch=(10 * i, 10 * i + 10), source="cell [2], line 2")
    c.sync("torch.neuron.synchronize", 40, 410, source="cell [2], line 3")
    return c.columns()


def sync_bound() -> dict[str, list[Any]]:
    """3 steps of 200 ns: launch (10 ns), a 100 ns kernel, the host waits for it (``item()`` on line 3,
    the last step ``.cpu()`` on line 5), then 90 ns of host work. Span 510 ns, waits 300 ns at 3 syncs."""
    c = _Cols()
    for i in range(3):
        t = 200 * i
        c.kernel("aten::sum", t + 10, t + 110, launch=(t, t + 10), engine="vector", source="cell [4], line 2")
        if i < 2:
            c.sync("aten::_local_scalar_dense", t + 10, t + 110, source="cell [4], line 3", stream=0)
        else:
            c.sync("copy d2h", t + 10, t + 110, source="cell [4], line 5", stream=0)
    return c.columns()


def two_streams() -> dict[str, list[Any]]:
    """Two streams overlapping on neuron:0 (a matmul on stream 0, a copy-in on stream 1), a kernel on
    neuron:1, and an ``item()`` wait."""
    c = _Cols()
    c.kernel("aten::mm", 100, 900, launch=(0, 50), source="cell [5], line 1")
    c.kernel("aten::copy_", 200, 700, launch=(60, 100), stream=1, engine="dma", kind="dma", source="cell [5], line 2")
    c.kernel("aten::relu", 900, 1000, launch=(110, 150), engine="scalar", source="cell [5], line 3")
    c.kernel("aten::mm", 300, 600, launch=(160, 200), device=1, source="cell [5], line 4")
    c.sync("aten::_local_scalar_dense", 210, 1000, source="cell [5], line 5", stream=0)
    return c.columns()


def training_loop(steps: int = 6) -> dict[str, list[Any]]:
    """A training-like loop for pictures and the browser test: per step the host launches 6 ops (8 µs
    each); the kernels run on stream 0 (tensor/vector/scalar engines), a prefetch copy on stream 1, and
    the step ends with ``loss.item()`` (the host waits for the queue to drain), then 20 µs of Python."""
    c = _Cols()
    us = 1_000
    t = 0
    ops = (("aten::mm", "tensor", 30), ("aten::add.Tensor", "scalar", 6), ("aten::relu", "scalar", 5),
           ("aten::mm", "tensor", 28), ("aten::_log_softmax", "vector", 12), ("aten::nll_loss_forward", "vector", 9))
    for step in range(steps):
        dev_free = t
        for j, (name, engine, dur) in enumerate(ops):
            launch = (t, t + 8 * us)
            start = max(launch[1], dev_free)
            c.kernel(name, start, start + dur * us, launch=launch, engine=engine,
                     source=f"cell [6], line {3 + j}")
            dev_free = start + dur * us
            t = launch[1]
        copy_start = t + 2 * us
        c.kernel("aten::copy_", copy_start + 4 * us, copy_start + 34 * us, launch=(t, copy_start), stream=1,
                 engine="dma", kind="dma", source="cell [6], line 9")
        t = copy_start
        c.sync("aten::_local_scalar_dense", t, max(dev_free, t + us), source="cell [6], line 10", stream=0)
        t = max(dev_free, t + us) + 20 * us
        del step
    return c.columns()
