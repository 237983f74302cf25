"""Result objects the magics return (``-o``) and display: plain data, ``__str__`` and ``_repr_html_``.

Each object holds what it shows as plain data (lists of dicts, ints, strings) so that a notebook can
compute with it; the two renderings are built from that data only.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "GraphBreaksResult",
    "MemoryResult",
    "PlacementResult",
    "ProfileResult",
    "SubgraphsResult",
    "WatchLine",
    "fmt_bytes",
    "fmt_ns",
]


# --------------------------------------------------------------------------- formatting helpers


def fmt_bytes(n: float | None) -> str:
    """``1536 -> '1.50 KiB'`` (exact bytes below 1 KiB)."""
    if n is None:
        return "-"
    n = int(n)
    if abs(n) < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1024:
            return f"{value:.2f} {unit}"
    return f"{value:.2f} PiB"


def fmt_ns(ns: float | None) -> str:
    if ns is None:
        return "-"
    if ns < 10:
        return f"{ns:.2f} ns"
    if ns < 1_000:
        return f"{ns:.0f} ns"
    if ns < 1_000_000:
        return f"{ns / 1e3:.1f} us"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e9:.3f} s"


# control characters of a name or a path (a newline in a function's name, a tab in a file name) escaped where a
# report shows them: a table cell or a location stays on its line
_CONTROL = {c: f"\\x{c:02x}" for c in range(32)} | {10: "\\n", 13: "\\r", 9: "\\t", 127: "\\x7f"}


def _one_line(text: str) -> str:
    return text.translate(_CONTROL)


def _text_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], indent: str = "  ") -> list[str]:
    cells = [[_one_line(str(c)) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in cells:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    out = [indent + "  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    out.append(indent + "  ".join("-" * w for w in widths))
    out += [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return out


def _html_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    head = "".join(f"<th style='text-align:left'>{html.escape(str(h))}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td style='text-align:left'>{html.escape(str(c))}</td>" for c in r) + "</tr>"
        for r in rows
    )
    return f"<table class='torchneuron-lab'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _html_section(title: str, inner: str) -> str:
    return f"<h4 style='margin:0.4em 0'>{html.escape(title)}</h4>{inner}"


def _html_list(items: Iterable[str], css: str = "") -> str:
    lis = "".join(f"<li>{html.escape(i)}</li>" for i in items)
    return f"<ul style='{css}'>{lis}</ul>" if lis else ""


def _pre(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


class _Rich:
    """``text/plain`` is ``__str__`` (IPython's pretty printer), ``text/html`` is ``_repr_html_``."""

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


# --------------------------------------------------------------------------- %neuron_placement


@dataclass(repr=False)
class PlacementResult(_Rich):
    """Where the notebook's tensors, modules and optimizer states live.

    Attributes:
        rows: one dict per entry: ``name``, ``kind`` (tensor/parameter/buffer/module/optimizer/
            optimizer_state), ``device``, ``dtype``, ``shape``, ``bytes`` (the tensor's own bytes),
            ``requires_grad``, ``storage`` (``'view of x'``, ``'shares storage with x'`` or ``''``).
        totals: device -> bytes of distinct storages there (views and shared storage counted once).
        warnings: flagged problems, one sentence each.
    """

    rows: list[dict[str, Any]] = field(default_factory=list)
    totals: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    _HEAD = ("name", "kind", "device", "dtype", "shape", "bytes", "grad", "storage")

    def _cells(self) -> list[list[Any]]:
        return [
            [r["name"], r["kind"], r["device"], r["dtype"], r["shape"], fmt_bytes(r["bytes"]),
             "yes" if r["requires_grad"] else "", r["storage"]]
            for r in self.rows
        ]

    def total(self, device: str) -> int:
        """Bytes on ``device`` (e.g. ``'neuron:0'``, ``'cpu'``); 0 when nothing is there."""
        return self.totals.get(device, 0)

    def __str__(self) -> str:
        if not self.rows:
            return "neuron_placement: no tensors, modules or optimizers in the namespace"
        lines = ["neuron_placement:", *_text_table(self._HEAD, self._cells())]
        lines.append("  totals: " + ", ".join(f"{d} {fmt_bytes(b)}" for d, b in self.totals.items()))
        lines += [f"  ! {w}" for w in self.warnings]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        if not self.rows:
            return "<p>neuron_placement: no tensors, modules or optimizers in the namespace</p>"
        totals = _html_table(("device", "bytes"), [(d, fmt_bytes(b)) for d, b in self.totals.items()])
        warn = _html_list(self.warnings, "color:#b35900")
        return _html_table(self._HEAD, self._cells()) + _html_section("Per-device totals", totals) + warn


# --------------------------------------------------------------------------- %neuron_graph_breaks


@dataclass(repr=False)
class GraphBreaksResult(_Rich):
    """What compiling a statement with the neuron backend produced.

    Attributes:
        statement: the code compiled.
        graphs: one dict per compiled graph: ``id``, ``kind``, ``name``, ``ops``, ``kernels``, ``fallbacks``.
        breaks: one dict per graph break: ``reason``, ``location`` ('cell [n], line k'), ``explanation``,
            ``hints``, ``count``, ``function``.
        recompiles: one dict per recompile: ``function``, ``location``, ``failures``.
        output: the statement's value.
        dynamo_log: what Dynamo/Inductor would have printed meanwhile (e.g. its "Graph break" warnings);
            captured, not printed, since the tables say the same.
    """

    statement: str
    graphs: list[dict[str, Any]] = field(default_factory=list)
    breaks: list[dict[str, Any]] = field(default_factory=list)
    recompiles: list[dict[str, Any]] = field(default_factory=list)
    output: Any = None
    dynamo_log: str = ""

    @property
    def graph_count(self) -> int:
        return len({g["graph_key"] for g in self.graphs})

    @property
    def break_count(self) -> int:
        return sum(b["count"] for b in self.breaks)

    def ops_per_graph(self) -> dict[int, int]:
        return {g["id"]: g["ops"] for g in self.graphs}

    def _headline(self) -> str:
        return (f"neuron_graph_breaks: {self.graph_count} graph(s), {self.break_count} graph break(s), "
                f"{len(self.recompiles)} recompile(s)")

    def __str__(self) -> str:
        lines = [self._headline()]
        for g in self.graphs:
            fb = f", fallbacks: {', '.join(g['fallbacks'])}" if g["fallbacks"] else ""
            lines.append(f"  graph #{g['id']} [{g['kind']}] {g['name']}: {g['ops']} ops, {g['kernels']} kernels{fb}")
        for b in self.breaks:
            times = f" (x{b['count']})" if b["count"] > 1 else ""
            lines.append(f"  break at {b['location']}: {b['reason']}{times}")
            for h in b["hints"][:2]:
                lines.append(f"    hint: {h}")
        for r in self.recompiles:
            lines.append(f"  recompile of {r['function']} at {r['location']}: {'; '.join(r['failures'])}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        parts = [f"<p><b>{html.escape(self._headline())}</b></p>"]
        if self.graphs:
            parts.append(_html_section("Graphs", _html_table(
                ("id", "kind", "name", "ops", "kernels", "fallbacks"),
                [(g["id"], g["kind"], g["name"], g["ops"], g["kernels"], ", ".join(g["fallbacks"]))
                 for g in self.graphs])))
        if self.breaks:
            parts.append(_html_section("Graph breaks", _html_table(
                ("location", "reason", "count", "hint"),
                [(b["location"], b["reason"], b["count"], b["hints"][0] if b["hints"] else "")
                 for b in self.breaks])))
        if self.recompiles:
            parts.append(_html_section("Recompiles", _html_table(
                ("function", "location", "failed guards"),
                [(r["function"], r["location"], "; ".join(r["failures"])) for r in self.recompiles])))
        return "".join(parts)


# --------------------------------------------------------------------------- %neuron_subgraphs


@dataclass(repr=False)
class SubgraphsResult(_Rich):
    """The subgraph registry: every record (``records``), or one record in detail (``detail``).

    Attributes:
        records: summary dicts: ``id``, ``kind``, ``name``, ``ops``, ``kernels``, ``calls``,
            ``compile_ms`` (total), ``fallbacks``.
        detail: for one graph, the registry record as a dict (``SubgraphRecord.as_dict()``).
        show_code, show_kernels: whether the renderings include FX code / the kernel list.
        cleared: records removed by ``--clear`` (None when not cleared).
    """

    records: list[dict[str, Any]] = field(default_factory=list)
    detail: dict[str, Any] | None = None
    show_code: bool = False
    show_kernels: bool = False
    cleared: int | None = None

    _HEAD = ("id", "kind", "name", "ops", "kernels", "calls", "compile", "fallbacks")

    def widget(self) -> Any:
        """A :class:`~torchneuron_lab.widgets.SubgraphWidget`: the one graph in detail, or every listed
        graph (full registry records) with the graph breaks recorded so far."""
        from ..widgets.timeline import SubgraphWidget

        if self.detail is not None:
            return SubgraphWidget([self.detail])
        from ..compiler import capture, registry

        recs = {r.id: r for r in registry.records()}
        return SubgraphWidget([recs[r["id"]].as_dict() for r in self.records if r["id"] in recs],
                              [b.as_dict() if hasattr(b, "as_dict") else b for b in capture.graph_breaks()],
                              [r.as_dict() for r in capture.recompiles()])

    def _cells(self) -> list[list[Any]]:
        return [[r["id"], r["kind"], r["name"], r["ops"], r["kernels"], r["calls"],
                 f"{r['compile_ms']:.1f} ms", ", ".join(r["fallbacks"])] for r in self.records]

    def _detail_lines(self) -> list[str]:
        d = self.detail or {}
        ms = ", ".join(f"{k} {v:.1f} ms" for k, v in d.get("compile_ms", {}).items() if v is not None)
        lines = [
            f"graph #{d['id']} [{d['kind']}] {d['name']}",
            (f"  compile id {d['compile_id']}, device neuron:{d['device']}, calls {d['calls']}, "
            f"cache hits {d['cache_hits']}"),
            f"  compile time: {ms or '-'}",
            "  inputs: " + "; ".join(
                f"{i.get('dtype', '')}{list(i['shape']) if 'shape' in i else i}" for i in d.get("inputs", [])),
            "  ops: " + ", ".join(f"{k} x{v}" for k, v in d.get("op_counts", {}).items()),
        ]
        if d.get("fallbacks"):
            lines.append("  fallbacks: " + ", ".join(d["fallbacks"]))
        if d.get("guards"):
            lines.append("  guards:")
            lines += [f"    {g}" for g in d["guards"]]
        if self.show_kernels:
            lines.append("  kernels:")
            lines += [f"    {k['name']} [{k.get('kind', '')}]: {', '.join(k.get('aten_ops', []))}"
                      for k in d.get("kernels", [])]
        if self.show_code:
            lines.append("  FX code:")
            lines += ["    " + ln for ln in d.get("fx_code", "").splitlines()]
        return lines

    def __str__(self) -> str:
        if self.detail is not None:
            return "\n".join(self._detail_lines())
        head = "neuron_subgraphs: " + (f"cleared {self.cleared} record(s)" if self.cleared is not None
                                       else f"{len(self.records)} compiled graph(s)")
        if not self.records:
            return head
        return "\n".join([head, *_text_table(self._HEAD, self._cells())])

    def _repr_html_(self) -> str:
        if self.detail is not None:
            return _pre("\n".join(self._detail_lines()))
        head = (f"cleared {self.cleared} record(s)" if self.cleared is not None
                else f"{len(self.records)} compiled graph(s)")
        table = _html_table(self._HEAD, self._cells()) if self.records else ""
        return f"<p><b>neuron_subgraphs</b>: {html.escape(head)}</p>{table}"


# --------------------------------------------------------------------------- %neuron_memory


@dataclass(repr=False)
class MemoryResult(_Rich):
    """Allocator state of one device.

    Attributes:
        device: device index.
        stats: ``torch.neuron.memory_stats(device)`` (flat, torch.cuda-named keys).
        capacity: HBM bytes of the device.
        top_allocations: live allocations grouped by the source line that made them:
            ``location``, ``count``, ``bytes`` (largest first; location 'unknown' without history).
        segments: ``[{"address", "total_size", "allocated_size", "segment_type", "blocks": [...]}]``
            when ``--segments`` was given, else [].
        fragmentation: external fragmentation of the cached free blocks, ``1 - largest / total free``
            (0.0 when the free bytes form one piece; see ``tracing.oom.external_fragmentation``).
        largest_free_block: largest inactive block in a reserved segment.
        history: last allocator trace entries (``--history``), else [].
        last_oom: the state at the moment of the last out-of-memory error on this device, or None.
        notes: what was done on request (peak reset, snapshot written).
    """

    device: int
    stats: dict[str, Any]
    capacity: int
    top_allocations: list[dict[str, Any]] = field(default_factory=list)
    segments: list[dict[str, Any]] = field(default_factory=list)
    fragmentation: float = 0.0
    largest_free_block: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    last_oom: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    snapshot: dict[str, Any] | None = None

    @property
    def has_history(self) -> bool:
        """Whether the snapshot holds allocator history (``device_traces``) for this device."""
        traces = (self.snapshot or {}).get("device_traces") or []
        return self.device < len(traces) and bool(traces[self.device])

    def widget(self) -> Any:
        """A :class:`~torchneuron_lab.widgets.MemoryWidget` over the snapshot, or None without history."""
        if not self.has_history:
            return None
        from ..widgets.timeline import MemoryWidget

        return MemoryWidget(self.snapshot or {}, device=self.device)

    def stat(self, key: str) -> int:
        return int(self.stats.get(key, 0))

    @property
    def allocated(self) -> int:
        return self.stat("allocated_bytes.all.current")

    @property
    def reserved(self) -> int:
        return self.stat("reserved_bytes.all.current")

    def _stat_rows(self) -> list[list[str]]:
        rows = []
        for key, label in (("allocated_bytes", "allocated"), ("reserved_bytes", "reserved"),
                           ("active_bytes", "active"), ("requested_bytes", "requested")):
            rows.append([label, fmt_bytes(self.stat(f"{key}.all.current")), fmt_bytes(self.stat(f"{key}.all.peak"))])
        rows.append(["allocations", str(self.stat("allocation.all.current")), str(self.stat("allocation.all.peak"))])
        rows.append(["segments", str(self.stat("segment.all.current")), str(self.stat("segment.all.peak"))])
        return rows

    @property
    def oom_diagnosis(self) -> Any:
        """Why the last OOM on this device happened (:class:`~torchneuron_lab.tracing.oom.OomDiagnosis`),
        or None when there was none."""
        o = self.last_oom
        if o is None:
            return None
        from ..tracing.oom import diagnose_oom

        extra = {}
        if "largest_other_pool" in o:  # an allocator that tells the blocks apart (2026-12-05 on)
            extra = {"limit": int(o["limit"]), "largest_other_stream": int(o["largest_other_stream"]),
                     "largest_other_pool": int(o["largest_other_pool"])}
        return diagnose_oom(int(o["requested"]), int(o["allocated"]), int(o["reserved"]), int(o["capacity"]),
                            int(o["largest_free_block"]), **extra)

    def _oom_lines(self) -> list[str]:
        o = self.last_oom
        if o is None:
            return []
        d = self.oom_diagnosis
        lines = [
            (f"last OOM on neuron:{self.device}: requested {fmt_bytes(o['requested'])} with "
            f"{fmt_bytes(o['allocated'])} allocated, {fmt_bytes(o['reserved'])} reserved of "
            f"{fmt_bytes(o['capacity'])}; largest cached free block {fmt_bytes(o['largest_free_block'])}"),
            f"  cause ({d.cause}): {d.explanation}",
            f"  fix: {d.advice}",
        ]
        for fr in o.get("frames", [])[:3]:
            lines.append(_one_line(f"    at {fr.get('location') or fr.get('filename')}:{fr.get('line', '')}"))
        return lines

    def _headline(self) -> str:
        return (f"neuron_memory neuron:{self.device}: {fmt_bytes(self.allocated)} allocated, "
                f"{fmt_bytes(self.reserved)} reserved of {fmt_bytes(self.capacity)}; "
                f"fragmentation {self.fragmentation:.0%}, largest free block {fmt_bytes(self.largest_free_block)}, "
                f"OOMs {self.stat('num_ooms')}")

    def __str__(self) -> str:
        lines = [self._headline(), *_text_table(("stat", "current", "peak"), self._stat_rows())]
        if self.top_allocations:
            lines.append("  top live allocations:")
            lines += _text_table(("location", "count", "bytes"),
                                 [(a["location"], a["count"], fmt_bytes(a["bytes"])) for a in self.top_allocations],
                                 indent="    ")
        for s in self.segments:
            blocks = " ".join(f"[{b['state'][0]}{fmt_bytes(b['size'])}]" for b in s["blocks"])
            lines.append(f"  segment {s['address']:#x} {s['segment_type']} {fmt_bytes(s['total_size'])}: {blocks}")
        for h in self.history:
            lines.append(f"  {h['action']:<14} {fmt_bytes(h.get('size', 0)):>10}  {_one_line(str(h.get('location', '')))}")
        lines += ["  " + ln for ln in self._oom_lines()]
        lines += [f"  {n}" for n in self.notes]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        parts = [f"<p><b>{html.escape(self._headline())}</b></p>",
                 _html_table(("stat", "current", "peak"), self._stat_rows())]
        if self.top_allocations:
            parts.append(_html_section("Top live allocations", _html_table(
                ("location", "count", "bytes"),
                [(a["location"], a["count"], fmt_bytes(a["bytes"])) for a in self.top_allocations])))
        if self.segments:
            parts.append(_html_section("Segments", _html_table(
                ("address", "pool", "size", "allocated", "blocks"),
                [(f"{s['address']:#x}", s["segment_type"], fmt_bytes(s["total_size"]),
                  fmt_bytes(s["allocated_size"]),
                  " ".join(f"{b['state']}:{fmt_bytes(b['size'])}" for b in s["blocks"])) for s in self.segments])))
        if self.history:
            parts.append(_html_section("Recent allocator events", _html_table(
                ("action", "size", "location"),
                [(h["action"], fmt_bytes(h.get("size", 0)), h.get("location", "")) for h in self.history])))
        oom = self._oom_lines()
        if oom:
            parts.append(f"<p style='color:#b00'>{html.escape(oom[0])}</p>")
        parts.append(_html_list(self.notes))
        return "".join(parts)


# --------------------------------------------------------------------------- %%neuron_profile


def _wait_line(row: dict[str, Any]) -> str:
    """'cell [4], line 3 (200 ns, 2 syncs)' for a :func:`~torchneuron_lab.tracing.host_waits` row."""
    n = row["count"]
    return f"{row['location']} ({fmt_ns(row['wait_ns'])}{f', {n} syncs' if n > 1 else ''})"


@dataclass(repr=False)
class ProfileResult(_Rich):
    """What one ``%%neuron_profile`` cell did on the device.

    Attributes:
        trace: the recorded :class:`~torchneuron_lab.tracing.Trace` (plain events).
        summary: :func:`torchneuron_lab.tracing.summarize` of the events.
        top: how many kernels the renderings list.
        memory: per device ``{"before", "after", "peak"}`` allocated bytes (peak since the cell started
            with ``--memory``, else since the last peak reset).
        new_subgraphs: ids of graphs compiled during the cell.
        graph_breaks: graph breaks recorded during the cell (dicts).
        error: the cell's exception as ``'TypeError: ...'``, or None.
        exported: path of the Chrome trace written with ``--export``, or None.
        plan_checks: first launches of new op signatures the emulator checked on the host during the cell.
        plan_check_wait_ns: the host's time waiting for the stream in those checks: the emulator's own cost,
            not a sync of the program (no event; not in the host waits above), shown apart.
    """

    trace: Any
    summary: dict[str, Any]
    top: int = 10
    memory: dict[int, dict[str, int]] = field(default_factory=dict)
    new_subgraphs: list[int] = field(default_factory=list)
    graph_breaks: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    exported: str | None = None
    memory_snapshot: dict[str, Any] | None = None
    plan_checks: int = 0
    plan_check_wait_ns: int = 0
    _widgets: dict[str, Any] = field(default_factory=dict, init=False, compare=False)

    def timeline_figure(self, **kwargs: Any) -> Any:
        """The kernel timeline as a plain ``plotly.graph_objects.Figure``
        (:func:`torchneuron_lab.widgets.figures.timeline_figure`; keyword arguments are passed on)."""
        from ..widgets import figures

        return figures.timeline_figure(self.trace, **kwargs)

    def widget(self) -> Any:
        """The interactive :class:`~torchneuron_lab.widgets.TimelineWidget` (summary bar, timeline,
        details panel); built once, the same object on each call."""
        if "timeline" not in self._widgets:
            from ..widgets.timeline import TimelineWidget

            self._widgets["timeline"] = TimelineWidget(self.trace)
        return self._widgets["timeline"]

    @property
    def memory_device(self) -> int:
        """The device whose allocator history the memory widget maps (the first one with history)."""
        for d, t in enumerate((self.memory_snapshot or {}).get("device_traces") or []):
            if t:
                return d
        return 0

    def memory_widget(self) -> Any:
        """A :class:`~torchneuron_lab.widgets.MemoryWidget` over the cell's allocator history
        (``--memory``), or None without it; built once."""
        if self.memory_snapshot is None:
            return None
        if "memory" not in self._widgets:
            from ..widgets.timeline import MemoryWidget

            self._widgets["memory"] = MemoryWidget(self.memory_snapshot, device=self.memory_device)
        return self._widgets["memory"]

    @property
    def events(self) -> list[Any]:
        return list(self.trace.events)

    def count(self, kind: str = "kernel") -> int:
        return sum(1 for e in self.trace.events if e.kind == kind)

    def to_dataframe(self) -> Any:
        return self.trace.to_dataframe()

    def to_chrome_trace(self) -> dict[str, Any]:
        result: dict[str, Any] = self.trace.to_chrome_trace()
        return result

    def export(self, path: str) -> str:
        """Write the events as Chrome-trace JSON (Perfetto / chrome://tracing); returns the path."""
        from ..tracing import write_chrome_trace

        self.exported = str(write_chrome_trace(path, self.trace, {"cell_error": self.error}))
        return self.exported

    def _headline(self) -> str:
        s = self.summary
        state = f" (cell raised {self.error})" if self.error else ""
        return (f"neuron_profile: {self.count('kernel')} kernels, {self.count('dma')} transfers, "
                f"{self.count('sync')} host syncs, {len(s['new_signatures'])} new signatures, "
                f"span {fmt_ns(s['span_ns'])}{state}")

    def _engine_rows(self) -> list[list[Any]]:
        return [[eng, v["count"], fmt_ns(v["total_ns"]), f"{v['share']:.0%}"]
                for eng, v in self.summary["time_by_engine"].items()]

    def _top_rows(self) -> list[list[Any]]:
        return [[r["name"], r["engine"], r["count"], fmt_ns(r["total_ns"]), f"{r['share']:.0%}",
                 fmt_ns(r["est_total_ns"]) if r["est_total_ns"] is not None else "-"]
                for r in self.summary["top_kernels"][: self.top]]

    def _sync_rows(self) -> list[list[Any]]:
        return [[r["name"], f"neuron:{r['device']}", fmt_ns(r["wait_ns"]), r["location"] or ""]
                for r in self.summary["sync_events"]]

    def _bound_line(self) -> str | None:
        bound = self.summary.get("bound")
        return None if not bound else str(bound["headline"])

    @property
    def host_wait_ns(self) -> int:
        """Time the host waited at syncs during the cell."""
        return int(self.summary.get("host_waits", {}).get("wait_ns", 0))

    def _wait_rows(self) -> list[list[Any]]:
        return [[r["location"], r["count"], fmt_ns(r["wait_ns"]), ", ".join(r["names"])]
                for r in self.summary.get("host_waits", {}).get("by_location", [])]

    def _wait_title(self) -> str:
        w = self.summary.get("host_waits", {})
        return f"host waited {fmt_ns(w.get('wait_ns', 0))} at {w.get('count', 0)} syncs, by line"

    def _dma_rows(self) -> list[list[Any]]:
        return [[d, v["count"], fmt_bytes(v["bytes"])] for d, v in self.summary["transfers"].items() if v["count"]]

    def _extra_lines(self) -> list[str]:
        lines = []
        for r in self.summary["new_signatures"][: self.top]:
            sig = "; ".join(x for x in (r["shapes"], r["dtypes"]) if x)
            lines.append(_one_line(f"new signature {r['name']}({sig}) at {r['location'] or '?'}"))
        for d, m in self.memory.items():
            lines.append(f"neuron:{d} memory {fmt_bytes(m['before'])} -> {fmt_bytes(m['after'])}, "
                         f"peak {fmt_bytes(m['peak'])}")
        if self.new_subgraphs:
            lines.append("compiled graphs: " + ", ".join(f"#{i}" for i in self.new_subgraphs))
        for b in self.graph_breaks:
            lines.append(f"graph break at {_one_line(str(b['location']))}: {b['reason']}")
        if self.plan_check_wait_ns >= _PLAN_CHECK_SHOWN_NS:
            lines.append(_plan_check_text(self.plan_checks, self.plan_check_wait_ns))
        if self.trace.dropped:
            lines.append(f"{self.trace.dropped} events dropped (ring buffer full): the trace is incomplete")
        if self.exported:
            lines.append(f"Chrome trace written to {self.exported}")
        return lines

    def __str__(self) -> str:
        lines = [self._headline()]
        if self._bound_line():
            lines.append(f"  {_one_line(self._bound_line() or '')}")  # it may name a location
        if self.summary["time_by_engine"]:
            lines += _text_table(("engine", "count", "time", "share"), self._engine_rows())
        if self.summary["top_kernels"]:
            lines.append("  top kernels (est = trn ESTIMATE):")
            lines += _text_table(("kernel", "engine", "count", "time", "share", "est"), self._top_rows(), "    ")
        if self._wait_rows():
            lines.append(f"  {self._wait_title()}:")
            lines += _text_table(("line", "syncs", "waited", "cause"), self._wait_rows(), "    ")
        if self._sync_rows():
            lines.append("  host syncs:")
            lines += _text_table(("op", "device", "wait", "where"), self._sync_rows(), "    ")
        if self._dma_rows():
            lines.append("  transfers:")
            lines += _text_table(("direction", "count", "bytes"), self._dma_rows(), "    ")
        lines += ["  " + ln for ln in self._extra_lines()]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        parts = [f"<p><b>{html.escape(self._headline())}</b></p>"]
        if self._bound_line():
            parts.append(f"<p class='tnl-bound'>{html.escape(str(self._bound_line()))}</p>")
        if self.summary["time_by_engine"]:
            parts.append(_html_section("Time by engine",
                                       _html_table(("engine", "count", "time", "share"), self._engine_rows())))
        if self.summary["top_kernels"]:
            parts.append(_html_section("Top kernels (est = trn ESTIMATE)", _html_table(
                ("kernel", "engine", "count", "time", "share", "est"), self._top_rows())))
        if self._wait_rows():
            parts.append(_html_section(self._wait_title()[0].upper() + self._wait_title()[1:], _html_table(
                ("line", "syncs", "waited", "cause"), self._wait_rows())))
        if self._sync_rows():
            parts.append(_html_section("Host syncs", _html_table(("op", "device", "wait", "where"),
                                                                 self._sync_rows())))
        if self._dma_rows():
            parts.append(_html_section("Transfers", _html_table(("direction", "count", "bytes"), self._dma_rows())))
        parts.append(_html_list(self._extra_lines()))
        return "".join(parts)


# The emulator's plan checks are shown when they cost the host this much (a check of an idle stream is free).
_PLAN_CHECK_SHOWN_NS = 100_000


def _plan_check_text(n: int, ns: int) -> str:
    return (f"the emulator also held the host {fmt_ns(ns)} at {n} first launch{'es' * (n != 1)} of new op "
            f"signatures (each checks its plan on the host after the queue drains; the emulator's cost, "
            f"not a sync of the program; once per signature)")


# --------------------------------------------------------------------------- %neuron_watch


@dataclass(repr=False)
class WatchLine(_Rich):
    """What one cell did, for ambient mode: counts and memory per device."""

    cell: int | None
    kernels: int = 0
    transfers: int = 0
    syncs: int = 0
    new_signatures: int = 0
    graph_breaks: int = 0
    memory: dict[int, tuple[int, int]] = field(default_factory=dict)  # device -> (current, peak)
    memory_changed: bool = False
    host_wait_ns: int = 0  # time the host waited at the syncs
    wait_lines: list[dict[str, Any]] = field(default_factory=list)  # host_waits()' rows: the lines that waited
    plan_checks: int = 0  # first launches the emulator checked on the host (ProfileResult.plan_checks)
    plan_check_wait_ns: int = 0  # the host's time waiting in them

    @property
    def eventful(self) -> bool:
        return bool(self.kernels or self.transfers or self.syncs or self.new_signatures or self.graph_breaks
                    or self.memory_changed)

    def __str__(self) -> str:
        parts = [f"{self.kernels} kernels"]
        if self.transfers:
            parts.append(f"{self.transfers} transfers")
        if self.new_signatures:
            parts.append(f"{self.new_signatures} new signatures")
        if self.syncs:
            parts.append(f"{self.syncs} host syncs")
            if self.host_wait_ns:
                parts.append(f"host waited {fmt_ns(self.host_wait_ns)}"
                             + (" at " + "; ".join(_wait_line(r) for r in self.wait_lines) if self.wait_lines else ""))
        if self.graph_breaks:
            parts.append(f"{self.graph_breaks} graph breaks")
        if self.plan_check_wait_ns >= _PLAN_CHECK_SHOWN_NS:
            n = self.plan_checks
            parts.append(f"emulator first-launch checks held the host {fmt_ns(self.plan_check_wait_ns)} "
                         f"({n} new signature{'s' * (n != 1)}; not program syncs)")
        mem = ", ".join(f"neuron:{d} {fmt_bytes(c)} (peak {fmt_bytes(p)})" for d, (c, p) in self.memory.items())
        where = f"[neuron] cell [{self.cell}]: " if self.cell is not None else "[neuron] "
        return where + ", ".join(parts) + (f" | {mem}" if mem else "")
