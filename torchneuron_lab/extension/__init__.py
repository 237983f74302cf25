"""IPython extension: ``%load_ext torchneuron_lab`` registers the magics and the notebook cell mapping.

- :mod:`.magics` -- the ``Magics`` class (argument parsing and display only).
- :mod:`.helpers` -- the work behind each magic, shell state in, result object out.
- :mod:`.results` -- result objects (plain data, ``__str__``, ``_repr_html_``).
- :mod:`.cells` -- ``(filename, line)`` -> ``"cell [n], line k"``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_ipython_extension", "unload_ipython_extension"]

# shell id -> (magics instance, watch); what load added, so that unload can remove exactly that
_loaded: dict[int, tuple[Any, Any]] = {}


def load_ipython_extension(ip: Any) -> None:
    """Register the device, the magics and the cell mapping; print one status line. Idempotent."""
    from .. import register_device
    from . import cells, helpers
    from .magics import NeuronMagics

    register_device()
    if id(ip) in _loaded:
        return
    from ..compiler import capture

    capture.install()
    mapper = cells.install(ip)
    watch = helpers.Watch(ip)
    magics = NeuronMagics(ip, mapper, watch)
    ip.register_magics(magics)
    _loaded[id(ip)] = (magics, watch)
    print(helpers.status_line())


def unload_ipython_extension(ip: Any) -> None:
    """Remove the magics, the ambient-mode hooks and the cell mapping that load added."""
    from . import cells
    from .magics import set_watch

    entry = _loaded.pop(id(ip), None)
    if entry is None:
        return
    magics, watch = entry
    if watch.active:  # %reload_ext is an unload and a load: the new extension starts with the watch off
        print("neuron_watch was on: it is off now that the extension is unloaded (%reload_ext included); "
              "%neuron_watch on turns it on again")
    set_watch(ip, watch, False)
    mm = ip.magics_manager
    for kind, names in magics.magics.items():
        for name in names:
            mm.magics[kind].pop(name, None)
    mm.registry.pop(type(magics).__name__, None)
    cells.uninstall()
