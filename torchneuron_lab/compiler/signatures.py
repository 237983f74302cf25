"""Eager op-signature cache per device: the dynamic-shape problem of Trainium's eager mode.

On Trainium's eager path each new (op, shapes, dtypes) signature compiles a NEFF; a loop whose shapes
change every iteration compiles every iteration. The emulated device counts signatures exactly as
they first run; :func:`mark` / :func:`new_since` show which appeared in between.
"""

from __future__ import annotations

from ..device._backend import lib

__all__ = ["clear", "count", "mark", "new_since", "signatures"]


def _devices(device: int | None) -> list[int]:
    n = int(lib().device_count())
    if device is None:
        return list(range(n))
    if not isinstance(device, int) or not 0 <= device < n:
        raise ValueError(f"device must be an int in [0, {n - 1}] or None, got {device!r}")
    return [device]


def count(device: int | None = None) -> int:
    """Distinct eager op signatures that have run (on one device, or all when None)."""
    return sum(int(lib().signature_count(d)) for d in _devices(device))


def signatures(device: int | None = None) -> list[str]:
    """The signatures in first-run order, e.g. ``'aten::add.Tensor(float32[8, 8], float32[8, 8])'``."""
    out: list[str] = []
    for d in _devices(device):
        out.extend(lib().signatures(d))
    return out


def mark() -> dict[int, int]:
    """A position to compare against later: signature count per device."""
    return {d: int(lib().signature_count(d)) for d in _devices(None)}


def new_since(mark_: dict[int, int]) -> dict[int, list[str]]:
    """Signatures first seen after ``mark_``, per device (devices with none are omitted)."""
    out: dict[int, list[str]] = {}
    for d in _devices(None):
        sigs = list(lib().signatures(d))
        new = sigs[mark_.get(d, 0):]
        if new:
            out[d] = new
    return out


def clear() -> None:
    """Forget every signature (the next run of each op counts as new again)."""
    lib().clear_signatures()
