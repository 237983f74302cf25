"""Python view of the C++ kernel recorder: start/stop/clear/read, and a ``record()`` context.

Events come back as a :class:`torchneuron_lab.tracing.Trace` of plain dataclasses, each kernel and DMA
carrying an *estimated* trn time (roofline over the device profile's published figures) in ``est_ns``,
and, when stacks were recorded, the innermost user frame as ``source``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from ..tracing import Trace, events_from_columns
from ._backend import lib

__all__ = ["clear", "dropped", "is_recording", "read", "record", "start", "stop", "set_source_mapper"]

DEFAULT_CAPACITY = 1 << 20
_INTERNAL = (
    os.sep + "torch" + os.sep,
    os.sep + "torchneuron_lab" + os.sep,
    "<frozen ",
    os.sep + "IPython" + os.sep,
    os.sep + "ipykernel" + os.sep,
    os.sep + "contextlib.py",
)
# The extension layer installs a mapper that turns (filename, line) into 'cell [n], line k'.
_source_mapper: Callable[[str, int], str | None] | None = None


def set_source_mapper(fn: Callable[[str, int], str | None] | None) -> None:
    """Install (or remove) the function that names a frame's location, e.g. a notebook cell."""
    global _source_mapper
    _source_mapper = fn


def start(capacity: int = DEFAULT_CAPACITY, *, record_shapes: bool = True, with_stack: bool = False) -> None:
    """Start recording device events into a ring buffer of ``capacity`` events (oldest dropped)."""
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    lib().recorder_start(capacity, bool(record_shapes), bool(with_stack))


def stop() -> None:
    lib().recorder_stop()


def clear() -> None:
    lib().recorder_clear()


def is_recording() -> bool:
    return bool(lib().recorder_enabled())


def dropped() -> int:
    """Events overwritten because the ring buffer was full since the last clear()."""
    return int(lib().recorder_dropped())


def _user_frame(stack: list[dict[str, Any]]) -> dict[str, Any] | None:
    for fr in reversed(stack):  # the C++ side returns frames innermost last
        fn = str(fr.get("filename", ""))
        if not any(tag in fn for tag in _INTERNAL):
            return fr
    return None


def read(*, profile: Any = None) -> Trace:
    """Copy the recorded events (oldest first) into a :class:`Trace` with estimates and sources."""
    from . import profile as current_profile
    from .profiles import annotate_estimates

    cols = lib().recorder_read()
    stacks = cols.get("stack") or []
    sources: list[str | None] = []
    for st in stacks:
        fr = _user_frame(st)
        if fr is None:
            sources.append(None)
            continue
        mapped = _source_mapper(fr["filename"], int(fr["line"])) if _source_mapper else None
        sources.append(mapped or f"{fr['filename']}:{fr['line']} in {fr['name']}")
    cols["source"] = sources
    events = events_from_columns(cols)
    prof = profile if profile is not None else current_profile()
    events = annotate_estimates(events, prof)
    return Trace(events=list(events), profile=prof.name, dropped=dropped())


@contextlib.contextmanager
def record(
    capacity: int = DEFAULT_CAPACITY, *, record_shapes: bool = True, with_stack: bool = False
) -> Iterator[list[Trace]]:
    """Record the block; afterwards ``box[0]`` holds the :class:`Trace`.

    >>> with record() as box:
    ...     y = x @ x
    >>> trace = box[0]
    """
    box: list[Trace] = []
    clear()
    start(capacity, record_shapes=record_shapes, with_stack=with_stack)
    try:
        yield box
    finally:
        stop()
        box.append(read())
        clear()
