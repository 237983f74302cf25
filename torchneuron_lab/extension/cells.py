"""Notebook locations: ``(filename, line)`` of code IPython compiled -> ``"cell [n], line k"``.

IPython's compiler (``shell.compile``) gives every cell a filename (``<ipython-input-5-...>`` in the
terminal, ``/tmp/ipykernel_.../....py`` in a kernel) and remembers its execution count in
``shell.compile._filename_map``. :class:`CellMapper` reads that map; the extension installs it as the
recorder's source mapper and the compiler's location mapper while it is loaded.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CellMapper", "install", "uninstall"]


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
