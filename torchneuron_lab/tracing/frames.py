"""Which stack frames are the user's: the innermost frame outside torch, the lab, IPython and code they
generate is the line a location names (launch sites, sources, memory owners, tracebacks)."""

from __future__ import annotations

import os

_INTERNAL = [
    os.sep + "torch" + os.sep,
    os.sep + "torchneuron_lab" + os.sep,
    "<frozen ",
    os.sep + "IPython" + os.sep,
    os.sep + "ipykernel" + os.sep,
    os.sep + "contextlib.py",
]


def is_internal(filename: str) -> bool:
    """Whether a frame's file belongs to torch, the lab, IPython, or code they generated (Inductor's
    compiled graphs, once :func:`add_internal_path` named their directory)."""
    return any(tag in filename for tag in _INTERNAL)


def add_internal_path(path: str) -> bool:
    """Marks files under directory ``path`` as internal; returns False if it already was."""
    if path in _INTERNAL:
        return False
    _INTERNAL.append(path)
    return True
