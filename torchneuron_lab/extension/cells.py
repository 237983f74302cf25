"""Notebook locations: ``(filename, line)`` of code IPython compiled -> ``"cell [n], line k"``.

IPython's compiler (``shell.compile``) gives every cell a filename (``<ipython-input-5-...>`` in the
terminal, ``/tmp/ipykernel_.../....py`` in a kernel) and remembers its execution count in
``shell.compile._filename_map``. :class:`CellMapper` reads that map; the extension installs it as the
recorder's source mapper and the compiler's location mapper while it is loaded.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["CellMapper", "current_cell", "install", "uninstall"]


def current_cell(shell: Any) -> int:
    """The execution count (the ``In [n]`` label) of the cell that is running now.

    IPython 8 increments ``shell.execution_count`` after a cell runs, IPython 9 before, so that counter
    cannot say which cell is running. The running cell's code object can: it was compiled under a
    filename that IPython's compiler maps to the cell's number. The innermost such frame on the stack is
    the running cell. Outside any cell (a magic called from plain Python), the counter IPython will give
    the next cell is returned.
    """
    fmap = getattr(getattr(shell, "compile", None), "_filename_map", None)
    if isinstance(fmap, dict):
        frame = sys._getframe(1)
        while frame is not None:
            n = fmap.get(frame.f_code.co_filename)
            if isinstance(n, int):
                return n
            frame = frame.f_back  # type: ignore[assignment]
    return int(getattr(shell, "execution_count", 0) or 0)


class CellMapper:
    """Callable ``(filename, line) -> "cell [n], line k"`` (None for files that are not cells)."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell

    def cell_number(self, filename: str) -> int | None:
        fmap = getattr(getattr(self.shell, "compile", None), "_filename_map", None)
        if not isinstance(fmap, dict):
            return None
        number = fmap.get(filename)
        return number if isinstance(number, int) else None

    def __call__(self, filename: str, line: int) -> str | None:
        n = self.cell_number(filename)
        if n is None:
            return None
        return f"cell [{n}], line {line}"


def install(shell: Any) -> CellMapper:
    """Make the recorder and the compiler name notebook cells; returns the mapper installed."""
    from ..compiler import capture
    from ..device import recorder

    mapper = CellMapper(shell)
    recorder.set_source_mapper(mapper)
    capture.set_location_mapper(mapper)
    return mapper


def uninstall() -> None:
    """Remove the mappers :func:`install` set."""
    from ..compiler import capture
    from ..device import recorder

    recorder.set_source_mapper(None)
    capture.set_location_mapper(None)
