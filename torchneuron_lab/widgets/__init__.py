"""Plotly figures and Jupyter widgets over the plain data of the other layers.

- :mod:`.figures` -- pure builders (events / snapshot / records -> ``plotly.graph_objects.Figure``),
  the level-of-detail aggregation and the vectorised timeline summary. Needs plotly and numpy.
- :mod:`.timeline` -- :class:`TimelineWidget`, :class:`MemoryWidget`, :class:`SubgraphWidget` (ipywidgets
  + Plotly ``FigureWidget``, which needs anywidget), :func:`save_html` (offline, self-contained) and
  :func:`static_fallback` (widgets also carry a static copy for notebooks exported to HTML).

Names are imported lazily so that ``import torchneuron_lab.widgets.figures`` does not load ipywidgets.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "MemoryWidget",
    "SubgraphWidget",
    "TimelineWidget",
    "graph_breaks_figure",
    "lod_aggregate",
    "memory_figure",
    "save_html",
    "segment_map_figure",
    "static_fallback",
    "subgraph_table_figure",
    "timeline_figure",
]

# plotly's FigureWidget (ipywidgets, anywidget, nbformat's schema validators: 1.5-2.5 s to import) is needed by
# the widgets only: the figures and save_html (what the CLI's report uses) come without it
_FIGURES = {"lod_aggregate", "memory_figure", "segment_map_figure", "subgraph_table_figure",
            "graph_breaks_figure", "timeline_figure", "save_html"}


def __getattr__(name: str) -> Any:
    if name in _FIGURES:
        from torchneuron_lab.widgets import figures

        return getattr(figures, name)
    if name in __all__:
        from torchneuron_lab.widgets import timeline

        return getattr(timeline, name)
    raise AttributeError(f"module 'torchneuron_lab.widgets' has no attribute {name!r}")
