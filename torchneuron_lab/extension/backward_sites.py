"""Where backward kernels come from.

The autograd engine runs a neuron graph's backward on its own device thread, which has no Python
frames, so the recorder cannot give those kernels a source line. The line the user wrote is the
``loss.backward()`` / ``torch.autograd.grad(...)`` call that the host thread is blocked in meanwhile.
:class:`BackwardSites` records, while it is active, each such call's span (monotonic clock, the
recorder's clock) and its caller's location; :func:`attribute` gives every event without a location
that was launched inside a span (its host launch time; a kernel may run after the call returned) the
source ``"<call site> (backward)"``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["BackwardSites", "attribute"]


class BackwardSites:
    """Context manager: wraps ``torch.autograd.backward`` and ``torch.autograd.grad`` to record spans."""

    def __init__(self, mapper: Callable[[str, int], str | None] | None = None) -> None:
        self.mapper = mapper
        self.spans: list[tuple[int, int, str]] = []
        self._saved: dict[str, Any] = {}

    def _site(self) -> str:
        frame = sys._getframe(2)
        while frame is not None:
            fn = frame.f_code.co_filename
            if "/torch/" not in fn and "/torchneuron_lab/" not in fn:
                mapped = self.mapper(fn, frame.f_lineno) if self.mapper else None
                return mapped or f"{fn}:{frame.f_lineno}"
            frame = frame.f_back  # type: ignore[assignment]
        return "backward call"

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            site = self._site()
            t0 = time.monotonic_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.append((t0, time.monotonic_ns(), site))

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        wrapped.__name__ = getattr(fn, "__name__", "backward")
        wrapped.__doc__ = fn.__doc__
        return wrapped

    def __enter__(self) -> BackwardSites:
        import torch.autograd as ag

        for name in ("backward", "grad"):
            self._saved[name] = getattr(ag, name)
            setattr(ag, name, self._wrap(self._saved[name]))
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.autograd as ag

        for name, fn in self._saved.items():
            setattr(ag, name, fn)
        self._saved.clear()


def attribute(trace: Any, spans: list[tuple[int, int, str]]) -> int:
    """Give events without a location that started inside a backward span that span's call site
    (``"cell [3], line 7 (backward)"``); returns how many events were attributed."""
    if not spans:
        return 0
    cols = trace.columns if not isinstance(trace.__dict__.get("events"), list) else None
    if cols is None:  # events already built (or a trace made from events): replace those objects
        import dataclasses

        count, out = 0, []
        for e in trace.events:
            label = None
            if e.location is None:
                at = e.host_start_ns or e.start_ns  # when it was launched (the device ran it later)
                label = next((s for t0, t1, s in spans if t0 <= at <= t1), None)
            if label is not None:
                count += 1
                e = dataclasses.replace(e, source=f"{label} (backward)")
            out.append(e)
        trace.events = out
        return count
    import numpy as np

    a = cols.arrays
    stack = np.array(a["stack"], copy=True)
    sources = list(cols.stack_sources)
    frames = list(cols.stack_frames)
    n_stacks = len(frames)
    no_loc = np.array([not (0 <= i < n_stacks) or sources[i] is None and not frames[i]
                       for i in stack.tolist()], dtype=bool)
    # a kernel belongs to the backward call that *launched* it: it may run on the device after the call
    # returned (asynchronous execution); events without a host launch span (host-side ones) by their start
    start = np.asarray(a["start_ns"])
    if "host_start_ns" in a:
        host = np.asarray(a["host_start_ns"])
        start = np.where(host > 0, host, start)
    count = 0
    for t0, t1, site in spans:
        idx = no_loc & (start >= t0) & (start <= t1)
        if idx.any():
            frames.append(())
            sources.append(f"{site} (backward)")
            stack[idx] = len(frames) - 1
            no_loc &= ~idx
            count += int(idx.sum())
    cols.arrays = {**a, "stack": stack}
    cols.stack_frames, cols.stack_sources = frames, sources
    return count
