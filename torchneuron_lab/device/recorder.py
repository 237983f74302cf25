"""Python view of the C++ kernel recorder: start/stop/clear/read, and a ``record()`` context.

Events come back as a :class:`torchneuron_lab.tracing.Trace` of plain dataclasses, each kernel and DMA
carrying an *estimated* trn time (roofline over the device profile's published figures) in ``est_ns``,
and, when stacks were recorded, the innermost user frame as ``source``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..tracing import StackFrame, Trace
from ..tracing import frames as _frames
from ..tracing.events import RecordedColumns
from ..tracing.frames import is_internal
from ._backend import lib

__all__ = [
    "bytes_per_event",
    "clear",
    "dropped",
    "is_recording",
    "read",
    "record",
    "set_source_mapper",
    "start",
    "stop",
]

DEFAULT_CAPACITY = 1 << 20


def add_internal_path(path: str) -> None:
    """Frames under ``path`` (e.g. Inductor's cache directory, where compiled graphs' code lives) are not
    the user's: launch sites, sources and owners skip them (here and in the C++ runtime's error text)."""
    path = os.path.join(os.path.abspath(path), "")
    if _frames.add_internal_path(path):
        lib().add_internal_path(path)


# The extension layer installs a mapper that turns (filename, line) into 'cell [n], line k'.
_source_mapper: Callable[[str, int], str | None] | None = None


def set_source_mapper(fn: Callable[[str, int], str | None] | None) -> None:
    """Install (or remove) the function that names a frame's location, e.g. a notebook cell: recorded events'
    sources and the launch site an asynchronous error names."""
    global _source_mapper
    _source_mapper = fn
    lib().set_site_mapper(fn)


def _check_capacity(capacity: Any, keep_first: Any) -> None:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    if isinstance(keep_first, bool) or not isinstance(keep_first, int) or not 0 <= keep_first <= capacity:
        raise ValueError(f"keep_first must be an int between 0 and capacity ({capacity}), got {keep_first!r}")


def start(
    capacity: int = DEFAULT_CAPACITY, *, record_shapes: bool = True, with_stack: bool = False, keep_first: int = 0
) -> None:
    """Start recording device events into a buffer of ``capacity`` events.

    The first ``keep_first`` events are kept; the rest of the buffer is a ring of the newest events
    (older ones are dropped and counted, see :func:`dropped` and :func:`dropped_window`). Memory is
    taken as events arrive (about :func:`bytes_per_event` each, stacks interned once per distinct
    call path), never up front.

    Raises:
        ValueError: ``capacity`` is not a positive int, ``keep_first`` is outside ``[0, capacity]``, or
            ``capacity`` events would not fit in half the memory available now (the message gives the
            allowed range).
    """
    _check_capacity(capacity, keep_first)
    warm_meta_kernels()
    lib().recorder_start(capacity, bool(record_shapes), bool(with_stack), keep_first)


_META_MODULES = ("torch._dynamo", "torch._refs", "torch._refs.nn.functional", "torch._prims",
                 "torch._meta_registrations")


def warm_meta_kernels() -> None:
    """Import what the first launch of many ops would import (once per process, ~1 s on 2 cores).

    A launch computes its outputs' metadata with the op's Meta kernel; for many ops that kernel is a Python
    reference (``torch._refs``) whose decorator imports ``torch._dynamo`` on first use. Done inside a
    recording, that import is a ~1 s gap after the first kernel of the first profiled cell (issue 9: the
    timeline must show the work, not the emulator's start-up), so recording pays it before it starts.
    """
    import importlib
    import sys

    for name in _META_MODULES:
        if name not in sys.modules:
            importlib.import_module(name)


def stop() -> None:
    """Stop recording once the queued kernels have run and recorded their events. A Ctrl-C in that wait drops
    the kernels still queued by this thread (as any host wait does) and raises KeyboardInterrupt, with the
    recorder stopped."""
    try:
        lib().drain()  # kernels still queued record their events first
    finally:
        lib().recorder_stop()


def clear() -> None:
    try:
        lib().drain()
    finally:
        lib().recorder_clear()


def is_recording() -> bool:
    return bool(lib().recorder_enabled())


def dropped() -> int:
    """Events dropped because the buffer was full since the last clear()."""
    return int(lib().recorder_dropped())


def bytes_per_event() -> int:
    """Memory one recorded event takes in the recorder's buffer."""
    return int(lib().recorder_slot_bytes())


def _user_frame(stack: Sequence[StackFrame]) -> StackFrame | None:
    for fr in reversed(stack):  # innermost last
        if not is_internal(fr.filename):
            return fr
    return None


def _source_of(stack: Sequence[StackFrame]) -> str | None:
    fr = _user_frame(stack)
    if fr is None:
        return None
    mapped = _source_mapper(fr.filename, fr.line) if _source_mapper else None
    return mapped or f"{fr.filename}:{fr.line} in {fr.name}"


def _estimates(cols: RecordedColumns, prof: Any) -> Any:
    """Roofline ESTIMATES per event, the rules of :func:`profiles.annotate_estimates` applied to whole
    columns: the roofline is linear in FLOPs and bytes, so ``estimate_ns`` itself gives the ns per FLOP
    and per byte of each (engine, dtype) and the columns are combined with them. NaN: no estimate."""
    import numpy as np

    from .profiles import COMPUTE_ENGINES, estimate_ns

    a = cols.arrays
    est = np.full(cols.n, np.nan)
    if cols.n == 0:
        return est
    engines, kinds = list(cols.engines), list(cols.kinds)
    eng, kind = a["engine"], a["kind"]
    dma_engine = engines.index("dma") if "dma" in engines else -1
    is_dma = (kind == kinds.index("dma")) | (eng == dma_engine)
    if is_dma.any():
        per_byte = estimate_ns(prof, "dma", 0, 1)
        est[is_dma] = np.maximum(a["bytes_read"][is_dma], a["bytes_written"][is_dma]) * per_byte
    compute = ~is_dma & (kind == kinds.index("kernel")) & np.isin(
        eng, [i for i, e in enumerate(engines) if e in COMPUTE_ENGINES])
    if compute.any():
        # first dtype of each distinct dtypes string ('' -> float32, as annotate_estimates does)
        dt_ids = a["dtypes"][compute]
        uniq, inverse = np.unique(dt_ids, return_inverse=True)
        table = [*cols.strings, ""]
        first = [next((d.strip() for d in table[i].split(",") if d.strip()), "float32") for i in uniq.tolist()]
        eng_c = eng[compute]
        flops = a["flops"][compute].astype(np.float64)
        nbytes = (a["bytes_read"][compute] + a["bytes_written"][compute]).astype(np.float64)
        out = np.empty(flops.shape[0])
        for e in np.unique(eng_c).tolist():
            for j, dtype in enumerate(first):
                sel = (eng_c == e) & (inverse == j)
                if not sel.any():
                    continue
                per_flop = estimate_ns(prof, engines[e], 1, 0, dtype)
                per_byte = estimate_ns(prof, engines[e], 0, 1, dtype)
                out[sel] = np.maximum(flops[sel] * per_flop, nbytes[sel] * per_byte)
        est[compute] = out
    return est


def read(*, profile: Any = None) -> Trace:
    """The recorded events (oldest first) as a :class:`Trace` with estimates and sources.

    Reading copies the recorder's packed columns and symbolizes each distinct stack once; the
    :class:`~torchneuron_lab.tracing.KernelEvent` objects are built when ``trace.events`` is first used.
    ``trace.metadata`` says what was dropped (``dropped_window_ns``: first start and last end of the
    dropped events).
    """
    from . import profile as current_profile

    raw = lib().recorder_read_columns()
    cols = RecordedColumns.from_raw(raw)
    frames = [tuple(StackFrame(f, int(ln), n) for f, ln, n in st) for st in raw["stacks"]]
    cols.stack_frames = frames
    used = set(cols.arrays["stack"].tolist()) if frames else set()
    cols.stack_sources = [_source_of(st) if i in used else None for i, st in enumerate(frames)]
    prof = profile if profile is not None else current_profile()
    if not hasattr(prof, "name"):
        from .profiles import get_profile

        prof = get_profile(prof)
    cols.arrays["est_ns"] = _estimates(cols, prof)
    n_dropped = int(raw["dropped"])
    metadata: dict[str, Any] = {}
    if n_dropped:
        metadata["dropped_window_ns"] = [int(raw["dropped_first_ns"]), int(raw["dropped_last_ns"])]
    return Trace.from_recorded(cols, profile=prof.name, dropped=n_dropped, metadata=metadata)


@contextlib.contextmanager
def record(
    capacity: int = DEFAULT_CAPACITY, *, record_shapes: bool = True, with_stack: bool = False, keep_first: int = 0
) -> Iterator[list[Trace]]:
    """Record the block; afterwards ``box[0]`` holds the :class:`Trace`.

    >>> with record() as box:
    ...     y = x @ x
    >>> trace = box[0]
    """
    box: list[Trace] = []
    _check_capacity(capacity, keep_first)
    clear()
    start(capacity, record_shapes=record_shapes, with_stack=with_stack, keep_first=keep_first)
    try:
        yield box
    finally:
        stop()
        box.append(read())
        clear()
