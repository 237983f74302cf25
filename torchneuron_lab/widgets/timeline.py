"""Interactive widgets around the pure builders of :mod:`.figures`, and the static HTML export.

* :class:`TimelineWidget` -- summary bar (span, busy and idle time, compressed idle breaks), the kernel
  timeline as a Plotly ``FigureWidget`` with a range slider, a colour toggle, and a details panel filled
  when a kernel is clicked (its fields and its neighbours in the lane). Zooming re-runs the
  level-of-detail aggregation for the visible window; zooming out (double-click, Reset axes, the range
  slider) re-runs it for the whole trace.
* :class:`MemoryWidget` -- allocated/reserved over time, a slider for the moment, the segment/block map
  and the top live allocations at that moment.
* :class:`SubgraphWidget` -- compiled subgraphs (pick one: FX code highlighted, kernels, guards) and
  the graph breaks with their locations.
* :func:`save_html` -- a self-contained HTML file (plotly.js embedded, no CDN) that works offline.

Without a widget front-end (terminal IPython, nbconvert to text) each widget shows a text summary:
``repr()`` and ``_repr_pretty_`` give it, and it is the ``text/plain`` entry of the mimebundle. After
:func:`static_fallback` the mimebundle also carries a static copy (``text/html``: the same figures with
plotly.js inlined once per kernel, no CDN): a front-end that renders widgets shows the widget only, and a
notebook exported without widget state (nbconvert's HTML report) shows the static copy only -- one
display either way.
"""

from __future__ import annotations

import hashlib
import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import ipywidgets as W
import numpy as np
import plotly.graph_objects as go
import traitlets

from torchneuron_lab.tracing import KernelEvent, Trace
from torchneuron_lab.widgets import figures as F
from torchneuron_lab.widgets.figures import _CDN_TOPOJSON, save_html

__all__ = ["MemoryWidget", "SubgraphWidget", "TimelineWidget", "apply_traces", "save_html", "static_fallback"]

_TYPE_RANK = {"bar": 0, "scatter": 1, "scattergl": 2}
_SKIP = frozenset({"type", "uid"})
# Kept when a slot is emptied or reused: plotly.js autoranges the axes of a trace whose orientation changes
# (None, then 'h' again), which lost the timeline's fixed lane range at a zoom and reversed it at a double-click.
_KEEP = frozenset({"orientation"})


def apply_traces(widget: go.FigureWidget, traces: Sequence[Any], layout: Mapping[str, Any] | None = None,
                 force: Mapping[str, Any] | None = None) -> None:
    """Show ``traces`` (and the ``layout`` properties) in ``widget`` without ever leaving it empty.

    Replacing ``widget.data`` deletes every trace and adds the new ones in two front-end messages; a
    view that renders or redraws between them (a busy notebook, a cold ``torch.compile``) can show
    empty axes. Here the widget's traces are slots that are REUSED: the k-th new trace of a type is
    written into the k-th slot of that type, unused slots are emptied and hidden, and all of it --
    with the layout -- goes to the front end as ONE ``plotly_update``. Only when a type needs more
    slots than exist are empty, hidden slots added first (the old picture stays up meanwhile). No
    trace is ever deleted.

    ``force``: layout properties that travel in that same update even where the widget's Python side holds
    them already (see :func:`state_layout`), so the front end never draws the new traces under a layout
    that lacks them.
    """
    new = sorted(traces, key=lambda t: _TYPE_RANK.get(t.type, 3))
    slots: dict[str, list[Any]] = {}
    for tr in widget.data:
        slots.setdefault(tr.type, []).append(tr)
    grow = []
    for kind in dict.fromkeys(t.type for t in new):
        missing = sum(1 for t in new if t.type == kind) - len(slots.get(kind, []))
        grow += [type(next(t for t in new if t.type == kind))(visible=False) for _ in range(max(missing, 0))]
    if grow:
        widget.add_traces(grow)
        slots = {}
        for tr in widget.data:
            slots.setdefault(tr.type, []).append(tr)
    used: dict[str, int] = {}
    merge = bool(force) and isinstance(widget, _FigureWidget)  # its update message takes them (_send_update_msg)
    with widget.batch_update():
        for tr in new:
            k = used.get(tr.type, 0)
            used[tr.type] = k + 1
            slot = slots[tr.type][k]
            fresh = tr.to_plotly_json()
            for key in set(slot.to_plotly_json()) - set(fresh) - _SKIP - _KEEP:
                slot[key] = None
            for key, value in fresh.items():
                if key not in _SKIP:
                    slot[key] = value
            if "visible" not in fresh:
                slot.visible = True
        for kind, group in slots.items():
            for slot in group[used.get(kind, 0):]:
                for key in set(slot.to_plotly_json()) - _SKIP - _KEEP:
                    slot[key] = None
                slot.visible = False
        for key, value in {**(layout or {}), **(force or {})}.items():
            widget.layout[key] = value
        if merge:
            widget._forced_layout = dict(force or {})  # merged into the update this batch sends
    if force and (not merge or widget._forced_layout is not None):  # not sent in an update: send them alone
        if merge:
            widget._forced_layout = None
        state_layout(widget, force)


def state_layout(widget: go.FigureWidget, props: Mapping[str, Any]) -> None:
    """Send layout ``props`` to the browser even if the widget's Python side holds them already.

    plotly's Python side drops unchanged values from what it sends; after a zoom the browser's own report
    has already set ``xaxis.range`` there, so a redraw's update carried ``xaxis.autorange: false`` without
    the range it was drawn for, leaving the browser's axis to whatever it held (the browser test once read
    x = [0, 1] after a drag-zoom). ``_send_relayout_msg`` is the widget's own Python -> browser message (a
    private name; without it, nothing is sent beyond what plotly sends anyway). A redraw passes these
    properties to :func:`apply_traces` as ``force`` instead: a separate message right after the update
    still left a moment with the update applied and the range not (the browser test read x = [0, 1]
    there once more, in 1 run of about 10).
    """
    send = getattr(widget, "_send_relayout_msg", None)
    if callable(send):
        send(dict(props))


#: The front-end module of :class:`_FigureWidget`: a small anywidget ESM that imports plotly's widget module
#: (``_plotly_esm``, about 5 MB) once per page, shared by every figure model. anywidget (0.11) gives a model's
#: ESM 2 s to load and initialise and drops every later kernel message to a model that missed that deadline;
#: plotly's own ESM, imported anew per model, takes about 4 s here (mostly one long main-thread task, during
#: which no other model can load either). So a model waits for plotly's module at most ``WAIT_MS`` -- well inside
#: the deadline -- and if it is not there yet, the model counts as initialised and the kernel's messages that
#: reach it meanwhile are replayed, in order, to plotly's model code once the module is in.
_FIGURE_ESM = """
const WAIT_MS = 1000;
const shared = (globalThis.__torchneuronLabPlotly ??= new Map());

function importShared(model) {
  const id = model.get("_plotly_esm_id");
  if (!shared.has(id)) {
    const url = URL.createObjectURL(new Blob([model.get("_plotly_esm")], { type: "application/javascript" }));
    const loaded = import(url).finally(() => URL.revokeObjectURL(url));
    loaded.catch(() => shared.delete(id));  // a later model tries again
    shared.set(id, loaded);
  }
  return shared.get(id);
}

export default () => {
  let proxy = null;
  let ready = null;  // plotly's widget definition for this model, initialised
  return {
    initialize({ model }) {
      const callbacks = new Map();  // event -> the callbacks plotly's code registered
      const held = new Map();  // message name -> value, while an early message is replayed
      proxy = {
        get: (name) => (held.has(name) ? held.get(name) : model.get(name)),
        set: (name, value) => model.set(name, value),
        on: (event, callback) => {
          if (!callbacks.has(event)) callbacks.set(event, []);
          callbacks.get(event).push(callback);
          model.on(event, callback);
        },
        off: (...args) => model.off(...args),
        send: (...args) => model.send(...args),
        save_changes: () => model.save_changes(),
        get widget_manager() { return model.widget_manager; },
      };
      const early = [];
      let listening = false;  // plotly's code handles the messages itself
      for (const name of model.get("_plotly_messages")) {
        model.on(`change:${name}`, () => {
          const value = model.get(name);
          if (!listening && value !== null && value !== undefined) early.push([name, value]);
        });
      }
      ready = importShared(model).then(async (mod) => {
        const widget = typeof mod.default === "function" ? await mod.default() : mod.default;
        const done = widget.initialize?.({ model: proxy });
        listening = true;
        for (const [name, value] of early.splice(0)) {
          held.set(name, value);
          try {
            for (const callback of callbacks.get(`change:${name}`) ?? []) callback();
          } finally {
            held.delete(name);
          }
        }
        await done;
        return widget;
      });
      return Promise.race([ready.then(() => undefined), new Promise((done) => setTimeout(done, WAIT_MS))]);
    },
    async render({ el }) {
      const widget = await ready;
      return widget.render?.({ model: proxy, el });
    },
  };
};
"""

_PLOTLY_ESM = str(go.FigureWidget._esm)


class _FigureWidget(go.FigureWidget):
    """A Plotly ``FigureWidget`` whose model opens with the figure in it and initialises within anywidget's
    deadline.

    Two front-end races left a figure drawn empty (no traces, axes [-1, 6] x [-1, 4], no lane labels) or deaf
    to the kernel (a zoom's level of detail, the colour toggle, the launch arrow never drawn):

    * ipywidgets opens a widget's comm at the end of ``Widget.__init__``; plotly's ``FigureWidget`` sets
      ``_widget_data`` and ``_widget_layout`` only after that, so ``comm_open`` carried an EMPTY figure and
      the figure followed in two ``update`` messages. Here the comm opens after the constructor: the figure
      travels in ``comm_open``, which the front end holds before any view renders.
    * anywidget (0.11) applies a model's messages only after its ESM has loaded and initialised, and drops
      them all for good when that took more than 2 s; plotly's ESM is a 5 MB bundle imported again for
      every model (about 4 s on a 2-core machine; under load one model in four missed the deadline). Here
      the model's ESM is :data:`_FIGURE_ESM`, which loads in milliseconds, imports plotly's bundle once per
      page and waits for it at most 1 s; and the next model is opened only after this one initialised.
    """

    _esm = _FIGURE_ESM
    _plotly_esm = traitlets.Unicode(_PLOTLY_ESM).tag(sync=True)
    _plotly_esm_id = traitlets.Unicode(hashlib.sha256(_PLOTLY_ESM.encode()).hexdigest()[:16]).tag(sync=True)
    _plotly_messages = traitlets.List(traitlets.Unicode(), default_value=sorted(
        name for name in go.FigureWidget.class_trait_names(sync=True) if name.startswith("_py2js_"))).tag(sync=True)
    _open_deferred = False
    _forced_layout: dict[str, Any] | None = None  # see apply_traces(force=...)

    def _send_update_msg(self, restyle_data: Any, relayout_data: Any, trace_indexes: Any = None,
                         source_view_id: Any = None) -> None:
        forced, self._forced_layout = self._forced_layout, None
        if forced:
            relayout_data = {**(relayout_data or {}), **forced}
        super()._send_update_msg(restyle_data, relayout_data, trace_indexes, source_view_id)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._open_deferred = True
        try:
            super().__init__(*args, **kwargs)
        finally:
            self._open_deferred = False
        self.open()
        # One update right behind comm_open: JupyterLab handles a kernel's messages one at a time and this one
        # waits until the model has initialised, so the next figure's model is created only then -- not during
        # the long task of plotly's module import, when its own small ESM could not load within the deadline.
        self.send_state("_last_trace_edit_id")

    def open(self) -> None:
        if not self._open_deferred:
            super().open()


_WRAP = "white-space:normal;overflow-wrap:anywhere;vertical-align:top"
_WRAP_WORDS = "white-space:normal;overflow-wrap:break-word;vertical-align:top"


def _table(rows: Sequence[Mapping[str, Any]] | Mapping[str, Any], cls: str = "",
           widths: Sequence[str] | None = None) -> str:
    """An HTML table of ``rows`` (a mapping: one field per row). Cells wrap instead of overflowing, so
    a narrow panel never clips a value. ``widths`` (a list of rows: one CSS width per column) fixes the
    columns, and then a word longer than its column breaks anywhere (a kernel name in the details panel);
    without, a column is as wide as its longest word (short values such as ids never break)."""
    if isinstance(rows, Mapping):
        body = "".join(
            f"<tr><th style='text-align:left;padding-right:8px;width:38%;{_WRAP}'>{html.escape(str(k))}</th>"
            f"<td style='text-align:left;{_WRAP}'>{html.escape(str(v))}</td></tr>" for k, v in rows.items()
        )
        return f"<table class='{cls}' style='width:100%;table-layout:fixed'>{body}</table>"
    if not rows:
        return "<i>none</i>"
    keys = list(rows[0])
    wrap = _WRAP if widths else _WRAP_WORDS
    head = "".join(f"<th style='text-align:left;padding-right:8px;{_WRAP if widths else 'white-space:nowrap'}'>"
                   f"{html.escape(k)}</th>" for k in keys)
    body = "".join(
        "<tr>" + "".join(f"<td style='text-align:left;padding-right:8px;{wrap}'>{html.escape(str(r[k]))}</td>"
                         for k in keys)
        + "</tr>" for r in rows
    )
    if widths:
        cols = "".join(f"<col style='width:{w}'>" for w in widths)
        return f"<table class='{cls}' style='width:100%;table-layout:fixed'><colgroup>{cols}</colgroup>" \
               f"<tr>{head}</tr>{body}</table>"
    return f"<table class='{cls}'><tr>{head}</tr>{body}</table>"


_STATIC: dict[str, bool] = {"enabled": False, "plotlyjs_sent": False}


def static_fallback(enabled: bool = True) -> None:
    """Make every widget displayed from now on also carry a static copy of itself (``text/html``).

    For notebooks that are exported to HTML (``torchneuron-lab demo``'s report, ``jupyter nbconvert``):
    there the widget cannot render and the static copy is shown instead; a live front-end shows only the
    widget. plotly.js (about 4.6 MB) is inlined in the first static copy of the kernel only, which is why
    this is off by default.
    """
    _STATIC["enabled"] = bool(enabled)


def _static_figure(fig: go.Figure) -> str:
    """``fig`` as an HTML fragment; plotly.js inlined the first time in this process (no CDN)."""
    first = not _STATIC["plotlyjs_sent"]
    text = fig.to_html(include_plotlyjs=first, full_html=False, config={"displaylogo": False})
    _STATIC["plotlyjs_sent"] = True
    return str(text.replace(_CDN_TOPOJSON, '"topojson/"'))


class _TextFallback:
    """The full text summary as ``text/plain`` (ipywidgets cuts its repr at 110 characters), shown
    by terminal IPython and nbconvert to text, next to the widget view for front-ends that have one;
    with :func:`static_fallback` also ``text/html`` (:meth:`static_html`)."""

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        data: dict[str, Any] = super()._repr_mimebundle_(**kwargs) or {}  # type: ignore[misc]
        data["text/plain"] = repr(self)
        if _STATIC["enabled"]:
            data["text/html"] = self.static_html()
        return data

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))

    def static_html(self) -> str:  # pragma: no cover - every widget overrides it
        raise NotImplementedError


class TimelineWidget(_TextFallback, W.VBox):  # type: ignore[misc]
    """The kernel timeline, interactive: what ``%%neuron_profile`` shows.

    Attributes:
        events: the events shown; ``summary`` the dict of :func:`.figures.timeline_summary`.
        figure: the Plotly ``FigureWidget``; ``details`` the side panel (``ipywidgets.HTML``);
        summary_bar: the summary ``ipywidgets.HTML``; ``color_toggle`` switches family/subgraph.
        axis: the :class:`.figures.TimeAxis` (collapsed idle breaks) of the events.
        window: the drawn window ``(t0, t1)`` in the events' ns, None for the whole trace.

    The summary bar says what the figure alone shows -- span, busy and idle time (union of lanes),
    the collapsed idle breaks, dropped events -- and nothing the magic's tables already list (time per
    engine, syncs, compiles, OOMs; those are in :func:`repr` for a terminal, and drawn as markers).
    """

    #: Width of the details panel (px); the figure's default width leaves room for it beside the plot.
    DETAILS_PX = 330

    def __init__(
        self,
        events: Trace | Iterable[KernelEvent],
        *,
        color_by: str = "family",
        profile: str | None = None,
        max_boxes: int = 6000,
        width: int = 780,
    ) -> None:
        if profile is None and isinstance(events, Trace):
            profile = events.profile
        self.profile = profile
        self.dropped = events.dropped if isinstance(events, Trace) else 0
        self.cols = F.EventColumns.build(events)
        self.events = self.cols.events
        self.max_boxes = max_boxes
        self.width = width
        self.pixels = max(100, width - 160)  # plot area: the figure less its margins
        self.color_by = color_by
        self.window: tuple[int, int] | None = None
        self.summary = F.timeline_summary(self.cols)
        self.axis = F.time_axis(self.cols)
        self.selected: dict[str, Any] | None = None
        fig = F.timeline_figure(self.cols, color_by=color_by, profile=profile, max_boxes=max_boxes,
                                pixels=self.pixels, rangeslider=True, width=width, axis=self.axis)
        self.figure = _FigureWidget(fig)
        self._hooked: set[str] = set()
        self._base_annotations = list(fig.layout.annotations)
        self.flow: dict[str, Any] | None = None
        self.figure.layout.on_change(self._on_relayout, "xaxis.range")
        self.figure.layout.on_change(self._on_autorange, "xaxis.autorange")
        self._hook_clicks()
        self.summary_bar = W.HTML(self._summary_html())
        self.summary_bar.add_class("tnl-summary")
        self.details = W.HTML("<i>Click a kernel to see its details and neighbours.</i>",
                              layout=W.Layout(width=f"{self.DETAILS_PX}px", min_width=f"{self.DETAILS_PX}px",
                                              overflow="hidden auto",
                                              max_height=f"{fig.layout.height}px"))
        self.details.add_class("tnl-details")
        self.color_toggle = W.ToggleButtons(options=[("op family", "family"), ("subgraph", "subgraph")],
                                            value=color_by, description="colour by")
        self.color_toggle.observe(self._on_color, names="value")
        super().__init__([self.summary_bar, self.color_toggle,
                          W.HBox([self.figure, self.details], layout=W.Layout(width="100%", flex_flow="row wrap"))])
        self.add_class("tnl-timeline")

    # -- text fallback -------------------------------------------------------------------------
    def __repr__(self) -> str:
        text = F.summary_text(self.summary)
        if self.dropped:
            text += f"\n(the recorder dropped {self.dropped} events: the trace is incomplete)"
        return f"TimelineWidget: {text}"

    def static_html(self) -> str:
        """The summary bar and the whole-trace figure as static HTML (what an exported notebook shows)."""
        fig = F.timeline_figure(self.cols, color_by=self.color_by, profile=self.profile, max_boxes=self.max_boxes,
                                pixels=self.pixels, rangeslider=True, width=self.width + self.DETAILS_PX,
                                axis=self.axis)
        return f"<div class='tnl-timeline-static'>{self._summary_html()}{_static_figure(fig)}</div>"

    # -- drawing -------------------------------------------------------------------------------
    def _summary_html(self) -> str:
        s = self.summary
        span = s["span_ns"]
        pct = f" ({100 * s['idle_ns'] / span:.0f}%)" if span else ""
        brk = ""
        if self.axis.breaks:
            total = sum(b - a for a, b in self.axis.breaks)
            brk = (f" · {len(self.axis.breaks)} idle stretch{'es' if len(self.axis.breaks) > 1 else ''} "
                   f"({F._fmt_ns(total)}) compressed on the axis (shaded)")
        drop = f" · <span style='color:#d62728'>{self.dropped} dropped</span>" if self.dropped else ""
        if s.get("unrecorded_ns"):
            drop = (f" · <span style='color:#d62728'>{F._fmt_ns(s['unrecorded_ns'])} not recorded "
                    f"({self.dropped} events dropped)</span>")
        bound = s.get("bound") or {}
        verdict = ""
        if bound.get("launches_known"):  # asynchronous trace: say what bounds the region
            verdict = f"<br><b class='tnl-bound'>{html.escape(str(bound['headline']))}</b>"
        return (
            f"<div style='font-family:sans-serif;font-size:13px'>{s['num_events']:,} "
            f"event{'' if s['num_events'] == 1 else 's'} over "
            f"{F._fmt_ns(span)} · some lane busy {F._fmt_ns(s['busy_ns'])} · every lane idle "
            f"{F._fmt_ns(s['idle_ns'])}{pct}{brk}{drop}{verdict}</div>"
        )

    def _hook_clicks(self) -> None:
        """Every trace slot reports clicks once; :meth:`_on_click` looks at what the slot holds now."""
        for tr in self.figure.data:
            if tr.uid not in self._hooked:
                self._hooked.add(tr.uid)
                tr.on_click(self._on_click)

    def redraw(self, window: tuple[int, int] | None = None, layout: Mapping[str, Any] | None = None) -> None:
        """Rebuild the traces for ``window`` (ns; None: everything) at the current colour mode; ``layout``
        properties go to the front end in the same single update, even those its Python side holds."""
        self.window = window
        layout = dict(layout or {})
        fig = F.timeline_figure(self.cols, color_by=self.color_by, profile=self.profile, max_boxes=self.max_boxes,
                                pixels=self.pixels, window=window, rangeslider=True, width=self.width,
                                axis=self.axis)
        update: dict[str, Any] = {"meta": fig.layout.meta, "shapes": fig.layout.shapes,
                                  "annotations": fig.layout.annotations}
        if self.axis.breaks:  # tick labels of a compressed axis are computed for the window
            update["xaxis.tickvals"] = fig.layout.xaxis.tickvals
            update["xaxis.ticktext"] = fig.layout.xaxis.ticktext
        self._base_annotations = list(fig.layout.annotations)
        self.flow = None
        if fig.layout.yaxis.range is not None:  # the lanes' fixed order and range, whatever plotly.js did
            layout = {**layout, "yaxis.range": list(fig.layout.yaxis.range), "yaxis.autorange": False}
        shown = self.figure.layout.xaxis.range
        if window is not None and "xaxis.range" not in layout and shown is not None:
            # a redraw of the zoomed window (a colour toggle) keeps it: adding trace slots made plotly.js
            # autorange the axis, which then showed the window's bars over the whole trace
            layout = {**layout, "xaxis.autorange": False, "xaxis.range": list(shown)}
        apply_traces(self.figure, list(fig.data), update, force=layout)
        self._hook_clicks()

    def _on_color(self, change: Mapping[str, Any]) -> None:
        self.color_by = change["new"]
        self.redraw(self.window)

    def _on_autorange(self, layout: Any, autorange: Any) -> None:
        """Double-click, "Reset axes", "Autoscale": back to the whole trace, aggregated for it."""
        if autorange is True and self.window is not None:
            self.redraw(None)

    def _on_relayout(self, layout: Any, xrange: Any) -> None:
        """A zoom, pan or range-slider move: redraw the window's level of detail (and ticks); a range
        that covers the whole trace is the full view again."""
        if xrange is None or len(xrange) != 2:
            return
        x0, x1 = sorted(float(v) for v in xrange)
        if x0 <= 0.0 and x1 >= self.axis.end_x:
            if self.window is not None:
                self.redraw(None)
            return
        lo, hi = (int(v) for v in self.axis.t(np.asarray([x0, x1])))
        window = (lo, hi)
        if window == self.window:
            return
        # (always redrawn: merged launches, the capped launch links and thinned markers of the whole view are
        #  refined for the window too, not only merged kernels)
        self.redraw(window, {"xaxis.autorange": False, "xaxis.range": [x0, x1]})

    # -- clicks --------------------------------------------------------------------------------
    def _on_click(self, trace: Any, points: Any, selector: Any = None) -> None:
        if not points.point_inds or (trace.meta or {}).get("role") not in ("hover", "marker", "launch"):
            return
        i = points.point_inds[0]
        if trace.customdata is None or i >= len(trace.customdata):
            return
        _seq, index = (int(v) for v in trace.customdata[i])
        self.select(index, text=trace.hovertext[i] if index < 0 else None)

    def _flow_arrow(self, index: int) -> dict[str, Any] | None:
        """The arrow from event ``index``'s host launch to its kernel, as a layout annotation (axis units),
        or None when its launch span is unknown."""
        e = self.events[index]
        if e.host_end_ns <= 0 or self.cols.host_lane < 0:
            return None
        x_from, x_to = (float(v) for v in self.axis.x(np.asarray([e.host_end_ns, e.start_ns])))
        return {"x": x_to, "y": float(self.cols.lane[index]), "ax": x_from, "ay": float(self.cols.host_lane),
                "xref": "x", "yref": "y", "axref": "x", "ayref": "y", "showarrow": True, "arrowhead": 3,
                "arrowsize": 1.2, "arrowwidth": 2, "arrowcolor": "#d62728", "text": "",
                "name": "flow", "hovertext": f"launched → {e.name}: queued {F._fmt_ns(max(e.start_ns - e.host_end_ns, 0))}"}

    def show_flow(self, index: int | None) -> dict[str, Any] | None:
        """Draw (or, with None, remove) the launch → kernel arrow of event ``index``; returns the arrow."""
        arrow = None if index is None else self._flow_arrow(index)
        notes = [*self._base_annotations, *([arrow] if arrow else [])]
        with self.figure.batch_update():
            self.figure.layout.annotations = notes
        self.flow = arrow
        return arrow

    def select(self, index: int, *, text: str | None = None) -> dict[str, Any]:
        """Fill the details panel for event ``index`` (a merged box ``-(j+1)`` shows ``text``, its hover
        text); return what it shows."""
        if index < 0:
            self.selected = {"merged box": -index, "text": text or ""}
            self.details.value = (
                "<div style='font-family:sans-serif;font-size:12px'>" + (text or "<b>merged kernels</b>")
                + "<br><i>zoom in to see the individual kernels</i></div>"
            )
            return self.selected
        e = self.events[index]
        d = F.event_details(e, self.profile, self.cols.t0)
        lane = self.cols.lane[index]
        same = np.nonzero(self.cols.lane == lane)[0]
        same = same[np.argsort(self.cols.start[same], kind="stable")]
        pos = int(np.nonzero(same == index)[0][0])
        neigh = []
        for j in range(max(0, pos - 2), min(len(same), pos + 3)):
            n = self.events[int(same[j])]
            neigh.append({"": "▶" if j == pos else "", "op": n.name,
                          "start (µs)": f"{(n.start_ns - self.cols.t0) / 1e3:.2f}", "duration": F._fmt_ns(n.dur_ns)})
        self.selected = {"event": d, "neighbours": neigh, "flow": self.show_flow(index)}
        self.details.value = (
            f"<div style='font-family:sans-serif;font-size:12px;white-space:normal;overflow-wrap:anywhere'>"
            f"<b>{html.escape(e.name)}</b>"
            + _table({k: v for k, v in d.items() if k != "op"}, "tnl-detail-fields")
            + "<b>neighbours in the lane</b>"
            + _table(neigh, "tnl-neighbours", widths=("8%", "46%", "23%", "23%")) + "</div>"
        )
        return self.selected


class MemoryWidget(_TextFallback, W.VBox):  # type: ignore[misc]
    """Allocator history and state: what ``%neuron_memory`` shows, read from a ``_snapshot()`` dict."""

    def __init__(self, snapshot: Mapping[str, Any], *, device: int = 0, top: int = 10) -> None:
        self.timeline = F.memory_timeline(snapshot, device)  # raises for a device the snapshot does not hold
        self.snapshot = snapshot
        self.device = device
        self.top = top
        n = len(self.timeline["time_us"])
        self.history = _FigureWidget(F.memory_figure(snapshot, devices=[device]))  # this device only
        self.slider = W.IntSlider(value=max(n - 1, 0), min=0, max=max(n - 1, 0), description="moment",
                                  continuous_update=False, layout=W.Layout(width="90%"))
        # the block map of the shown moment is the widget's first figure: no update message to draw it
        moment = self.slider.value if n else None
        self.segments = _FigureWidget(F.segment_map_figure(snapshot, device=device, at_index=moment))
        self.top_html = W.HTML()
        self.moment = W.HTML()
        self.slider.observe(lambda ch: self.show_moment(ch["new"]), names="value")
        self._show_moment_text(moment)
        super().__init__([W.HTML(self._summary_html()), self.history, self.slider, self.moment,
                          self.segments, self.top_html])
        self.add_class("tnl-memory")

    def static_html(self) -> str:
        """Summary, allocator history, block map and top allocations now, as static HTML."""
        seg = F.segment_map_figure(self.snapshot, device=self.device)
        rows = F.top_allocations(self.snapshot, self.top, device=self.device)
        top = "<b>top live allocations</b>" + _table(
            [{"size": F._fmt_bytes(r["size"]), "allocated at": r["source"]} for r in rows])
        return (f"<div class='tnl-memory-static'>{self._summary_html()}{_static_figure(go.Figure(self.history))}"
                f"{_static_figure(seg)}{top}</div>")

    def _summary_html(self) -> str:
        meta = self.history.layout.meta["devices"]
        parts = [f"<b>neuron:{d}</b> peak allocated {F._fmt_bytes(m['peak_allocated'])}, peak reserved "
                 f"{F._fmt_bytes(m['peak_reserved'])}, {m['ooms']} OOMs" for d, m in meta.items()]
        return "<div style='font-family:sans-serif;font-size:13px'>" + " · ".join(parts) + "</div>"

    def show_moment(self, index: int | None) -> None:
        """Show the block map and top allocations after action ``index`` of the history."""
        seg = F.segment_map_figure(self.snapshot, device=self.device, at_index=index)
        apply_traces(self.segments, list(seg.data), {"height": seg.layout.height, "meta": seg.layout.meta})
        self._show_moment_text(index)

    def _show_moment_text(self, index: int | None) -> None:
        """The moment line and the top live allocations after action ``index``."""
        tl = self.timeline
        if index is not None and tl["time_us"]:
            self.moment.value = (f"after action {index}: <b>{html.escape(tl['actions'][index])}</b>, "
                                 f"allocated {F._fmt_bytes(tl['allocated'][index])}, "
                                 f"reserved {F._fmt_bytes(tl['reserved'][index])}")
        rows = F.top_allocations(self.snapshot, self.top, device=self.device, at_index=index)
        self.top_html.value = "<b>top live allocations</b>" + _table(
            [{"size": F._fmt_bytes(r["size"]), "allocated at": r["source"]} for r in rows])

    def __repr__(self) -> str:
        meta = self.history.layout.meta["devices"]
        lines = [f"neuron:{d}: peak allocated {F._fmt_bytes(m['peak_allocated'])}, peak reserved "
                 f"{F._fmt_bytes(m['peak_reserved'])}, {m['ooms']} OOMs, {m['entries']} actions"
                 for d, m in meta.items()]
        for r in F.top_allocations(self.snapshot, 5, device=self.device):
            lines.append(f"  {F._fmt_bytes(r['size']):>12}  {r['source']}")
        return "MemoryWidget:\n" + "\n".join(lines)


def _highlight(code: str) -> str:
    try:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer
    except ModuleNotFoundError:  # pragma: no cover - pygments ships with IPython
        return f"<pre>{html.escape(code)}</pre>"
    return str(highlight(code, PythonLexer(), HtmlFormatter(noclasses=True)))


class SubgraphWidget(_TextFallback, W.VBox):  # type: ignore[misc]
    """Compiled subgraphs (pick one: FX code, kernels, guards) and graph breaks with reasons."""

    def __init__(self, records: Iterable[Any], breaks: Iterable[Any] = (), recompiles: Iterable[Any] = ()) -> None:
        self.records = [F._as_dict(r) for r in records]
        self.rows = F.subgraph_rows(self.records)
        self.breaks = F.graph_break_rows(breaks)
        self.recompiles = [F._as_dict(r) for r in recompiles]
        options = [(f"#{r['id']} {r['name']}", i) for i, r in enumerate(self.rows)]
        self.picker = W.Select(options=options, rows=min(8, max(2, len(options))), layout=W.Layout(width="100%"))
        self.detail = W.HTML()
        self.picker.observe(lambda ch: self.show(ch["new"]), names="value")
        if options:
            self.show(0)
        self._rows_html = "<b>compiled subgraphs</b>" + _table(self.rows)
        # Dynamo's explanation (a graph_break(msg=...)'s message among them) and hints, as %neuron_graph_breaks
        self._breaks_html = "<b>graph breaks</b>" + _table(
            [{"reason": r["reason"], "explanation": r["explanation"], "hints": "; ".join(map(str, r["hints"])),
              "location": r["location"], "function": r["function"], "count": r["count"]} for r in self.breaks])
        if self.recompiles:
            self._breaks_html += "<b>recompiles</b>" + _table(
                [{"function": r.get("function", ""), "location": r.get("location", ""),
                  "failed guards": "; ".join(map(str, r.get("failures") or [])) or r.get("message", "")}
                 for r in self.recompiles])
        super().__init__([W.HTML(self._rows_html), self.picker, self.detail, W.HTML(self._breaks_html)])
        self.add_class("tnl-subgraphs")

    def static_html(self) -> str:
        """The tables, the picked subgraph's code, kernels and guards, as static HTML."""
        return f"<div class='tnl-subgraphs-static'>{self._rows_html}{self.detail.value}{self._breaks_html}</div>"

    def show(self, i: int) -> None:
        rec = self.records[i]
        kernels = [{"name": k.get("name"), "kind": k.get("kind"), "aten ops": ", ".join(k.get("aten_ops", []))}
                   for k in rec.get("kernels", [])]
        self.detail.value = (
            f"<b>{html.escape(str(rec.get('name')))}</b>" + _highlight(rec.get("fx_code", ""))
            + "<b>kernels</b>" + _table(kernels)
            + f"<b>guards</b> ({len(rec.get('guards', []))})<pre style='max-height:14em;overflow:auto'>"
            + html.escape("\n".join(rec.get("guards", []))) + "</pre>"
        )

    def __repr__(self) -> str:
        lines = [f"#{r['id']} {r['name']}: {r['ops']} ops, {r['kernels']} kernels, {r['compile_ms']} ms compile, "
                 f"{r['calls']} calls" for r in self.rows]
        lines += [f"graph break at {b['location']}: {b['reason']}"
                  + (f" ({b['explanation']})" if b["explanation"] else "") for b in self.breaks]
        lines += [f"recompile of {r.get('function', '')} at {r.get('location', '')}: "
                  + "; ".join(map(str, r.get("failures") or [])) for r in self.recompiles]
        return "SubgraphWidget:\n" + ("\n".join(lines) or "(nothing compiled)")
