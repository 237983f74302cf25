"""Plain data for what the neuron device did: events, traces, Chrome-trace export, summaries.

This layer imports no other layer of torchneuron_lab, and neither torch nor pandas at import time
(pandas is imported by :func:`to_dataframe` only when called).

- :mod:`.events` -- :class:`KernelEvent`, :class:`Trace`, recorder-column conversion, DataFrames.
- :mod:`.chrome_trace` -- Chrome Trace Event Format export and validation.
- :mod:`.summary` -- pure summaries (time per engine, top kernels, syncs, transfers, new signatures,
  idle gaps per lane).
"""

from __future__ import annotations

from torchneuron_lab.tracing.chrome_trace import (
    chrome_trace_problems,
    to_chrome_trace,
    validate_chrome_trace,
    write_chrome_trace,
)
from torchneuron_lab.tracing.events import (
    COLUMNS,
    DIRECTIONS,
    ENGINES,
    KINDS,
    KernelEvent,
    StackFrame,
    Trace,
    device_name,
    events_from_columns,
    events_to_columns,
    parse_device,
    to_dataframe,
)
from torchneuron_lab.tracing.summary import (
    idle_gaps,
    lane_utilization,
    new_signatures,
    summarize,
    sync_events,
    time_by_engine,
    top_kernels,
    transfers,
)

__all__ = [
    "COLUMNS",
    "DIRECTIONS",
    "ENGINES",
    "KINDS",
    "KernelEvent",
    "StackFrame",
    "Trace",
    "chrome_trace_problems",
    "device_name",
    "events_from_columns",
    "events_to_columns",
    "idle_gaps",
    "lane_utilization",
    "new_signatures",
    "parse_device",
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
