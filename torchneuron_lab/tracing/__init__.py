"""Plain data for what the neuron device did: events, traces, Chrome-trace export, summaries.

This layer imports no other layer of torchneuron_lab, and neither torch nor pandas at import time
(pandas is imported by :func:`to_dataframe` only when called).

- :mod:`.events` -- :class:`KernelEvent`, :class:`Trace`, recorder-column conversion, DataFrames.
- :mod:`.chrome_trace` -- Chrome Trace Event Format export and validation.
- :mod:`.summary` -- pure summaries (time per engine, top kernels, syncs, transfers, new signatures,
  idle gaps per lane, activity of the union of lanes, host waits by line, queue depth, and the
  host-/device-/sync-bound classification of a region); a trace read from the recorder is summarised
  on its numpy columns (:mod:`._columnar`).
"""

from __future__ import annotations

from torchneuron_lab.tracing.chrome_trace import (
    chrome_trace_problems,
    to_chrome_trace,
    validate_chrome_trace,
    write_chrome_trace,
)
from torchneuron_lab.tracing.events import (
    ASYNC_COLUMNS,
    COLUMNS,
    DIRECTIONS,
    ENGINES,
    KINDS,
    KernelEvent,
    RecordedColumns,
    StackFrame,
    Trace,
    device_name,
    events_from_columns,
    events_to_columns,
    parse_device,
    to_dataframe,
)
from torchneuron_lab.tracing.summary import (
    activity,
    classify_region,
    host_waits,
    idle_gaps,
    lane_utilization,
    new_signatures,
    queue_depth,
    summarize,
    sync_events,
    time_by_engine,
    top_kernels,
    transfers,
)

__all__ = [
    "ASYNC_COLUMNS",
    "COLUMNS",
    "DIRECTIONS",
    "ENGINES",
    "KINDS",
    "KernelEvent",
    "RecordedColumns",
    "StackFrame",
    "Trace",
    "activity",
    "chrome_trace_problems",
    "classify_region",
    "device_name",
    "events_from_columns",
    "events_to_columns",
    "host_waits",
    "idle_gaps",
    "lane_utilization",
    "new_signatures",
    "parse_device",
    "queue_depth",
    "summarize",
    "sync_events",
    "time_by_engine",
    "to_chrome_trace",
    "to_dataframe",
    "top_kernels",
    "transfers",
    "validate_chrome_trace",
    "write_chrome_trace",
]
