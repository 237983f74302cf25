"""Tests for torchneuron_lab.tracing (events, Chrome trace, summaries) and device profiles.

Everything is driven by a synthetic recorder column dict, so exact numbers can be asserted.
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from torchneuron_lab.device.profiles import (
    DEFAULT_PROFILE_NAME,
    PROFILES,
    annotate_estimates,
    default_profile,
    estimate_ns,
    get_profile,
    list_profiles,
)
from torchneuron_lab.tracing import (
    KernelEvent,
    StackFrame,
    Trace,
    chrome_trace_problems,
    events_from_columns,
    events_to_columns,
    idle_gaps,
    lane_utilization,
    new_signatures,
    summarize,
    sync_events,
    time_by_engine,
    to_chrome_trace,
    to_dataframe,
    top_kernels,
    transfers,
    validate_chrome_trace,
    write_chrome_trace,
)

BASE = 1_000_000_000  # steady-clock origin of the synthetic recording
GiB = 1024**3
FRAME = {"filename": "<ipython-input-3>", "line": 2, "name": "<module>"}

# seq, kind, name, device, engine, start, end, read, written, flops, new_sig, shapes, dtypes, direction
ROWS: list[tuple[Any, ...]] = [
    (0, "kernel", "aten::mm", 0, "tensor", 1000, 3000, 2048, 1024, 1_000_000, True,
     "[16, 16], [16, 16]", "float32, float32", ""),
    (1, "dma", "aten::_copy_from", 0, "dma", 0, 500, 4096, 4096, 0, False, "[32, 32]", "float32", "h2d"),
    (2, "kernel", "aten::add.Tensor", 0, "vector", 3500, 4000, 2048, 1024, 256, True,
     "[16, 16], [16, 16]", "float32, float32", ""),
    (3, "kernel", "aten::mm", 0, "tensor", 5000, 6000, 2048, 1024, 1_000_000, False,
     "[16, 16], [16, 16]", "float32, float32", ""),
    (4, "sync", "aten::item", 0, "host", 6000, 6400, 4, 0, 0, False, "[]", "float32", ""),
    (5, "dma", "aten::_copy_from", 0, "dma", 6100, 6300, 4, 4, 0, False, "[]", "float32", "d2h"),
    (6, "kernel", "aten::relu", 0, "vector", 3800, 4200, 1024, 1024, 0, False, "[16, 16]", "float32", ""),
    (7, "kernel", "aten::mm", 1, "tensor", 2000, 2500, 2048, 1024, 1_000_000, True,
     "[16, 16], [16, 16]", "bfloat16, bfloat16", ""),
    (8, "marker", "step", 1, "host", 7000, 7000, 0, 0, 0, False, "", "", ""),
]


def make_columns() -> dict[str, list[Any]]:
    """The recorder's column dict (notes/api.md) for ROWS, times offset by BASE."""
    names = ["seq", "kind", "name", "device", "engine", "start_ns", "end_ns", "bytes_read", "bytes_written",
             "flops", "new_signature", "shapes", "dtypes", "direction"]
    cols: dict[str, list[Any]] = {n: [] for n in names}
    for row in ROWS:
        for col, v in zip(names, row):
            cols[col].append(v + BASE if col in ("start_ns", "end_ns") else v)
    count = len(ROWS)
    cols["subgraph"] = [-1] * count
    cols["thread"] = [7] * count
    cols["stack"] = [[FRAME] if seq == 0 else [] for seq in range(count)]
    return cols


@pytest.fixture
def events() -> list[KernelEvent]:
    evs = events_from_columns(make_columns())
    # the extension layer fills `source` for the sync; emulate it
    return [dataclasses.replace(e, source="cell [3], line 2") if e.seq == 4 else e for e in evs]


@pytest.fixture
def trace(events: list[KernelEvent]) -> Trace:
    return Trace(events, profile="trn2", dropped=3, metadata={"cell": 3})


# --------------------------------------------------------------------------------------------------
# layering
# --------------------------------------------------------------------------------------------------
def test_tracing_imports_no_torch_pandas_numpy_and_no_other_layer() -> None:
    code = (
        "import sys, torchneuron_lab.tracing\n"
        "bad = [m for m in ('torch', 'pandas', 'numpy', 'plotly', 'IPython') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    # TORCHNEURON_LAB_REGISTER=0: import the package without registering the device (which needs torch)
    env = {**os.environ, "TORCHNEURON_LAB_REGISTER": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1], env=env)
    tracing_dir = Path(__file__).resolve().parents[1] / "torchneuron_lab" / "tracing"
    for py in tracing_dir.glob("*.py"):
        for node in ast.walk(ast.parse(py.read_text())):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            for m in mods:
                if m.startswith("torchneuron_lab"):
                    assert m.startswith("torchneuron_lab.tracing"), f"{py.name} imports {m}"


# --------------------------------------------------------------------------------------------------
# events
# --------------------------------------------------------------------------------------------------
def test_events_from_columns_fields(events: list[KernelEvent]) -> None:
    assert len(events) == 9
    mm = events[0]
    assert (mm.seq, mm.kind, mm.name, mm.device, mm.engine) == (0, "kernel", "aten::mm", 0, "tensor")
    assert (mm.start_ns, mm.end_ns, mm.dur_ns) == (BASE + 1000, BASE + 3000, 2000)
    assert (mm.bytes_read, mm.bytes_written, mm.bytes_total, mm.flops) == (2048, 1024, 3072, 1_000_000)
    assert mm.new_signature is True and mm.subgraph == -1 and not mm.is_compiled and mm.thread == 7
    assert mm.shape_list == [(16, 16), (16, 16)]
    assert mm.dtype_list == ["float32", "float32"]
    assert mm.stack == (StackFrame("<ipython-input-3>", 2, "<module>"),)
    assert mm.location == "<ipython-input-3>:2 in <module>"
    assert mm.device_name == "neuron:0" and events[7].device_name == "neuron:1"
    assert mm.est_ns is None and mm.source is None
    assert events[4].shape_list == [()] and events[8].shape_list == []
    assert events[4].location == "cell [3], line 2"  # source wins over stack
    assert events[1].direction == "h2d"


def test_events_columns_round_trip() -> None:
    cols = make_columns()
    back = events_to_columns(events_from_columns(cols))
    for name, values in cols.items():
        assert back[name] == values, name
    assert back["est_ns"] == [None] * 9 and back["source"] == [None] * 9


def test_events_from_columns_optional_columns_and_defaults() -> None:
    cols: dict[str, list[Any]] = {"kind": ["kernel"], "name": ["aten::neg"], "device": [0], "engine": ["vector"],
            "start_ns": [10], "end_ns": [25], "est_ns": [12.5], "source": ["cell [1], line 1"],
            "future_column": ["ignored"]}
    (ev,) = events_from_columns(cols)
    assert ev.seq == 0 and ev.flops == 0 and ev.subgraph == -1 and ev.stack == ()
    assert ev.est_ns == 12.5 and ev.source == "cell [1], line 1"
    assert events_from_columns({c: [] for c in ("kind", "name", "device", "engine", "start_ns", "end_ns")}) == []


def test_events_from_columns_errors() -> None:
    cols = make_columns()
    del cols["engine"]
    with pytest.raises(ValueError, match="missing: engine"):
        events_from_columns(cols)
    cols = make_columns()
    cols["flops"] = cols["flops"][:-1]
    with pytest.raises(ValueError, match="different lengths"):
        events_from_columns(cols)
    with pytest.raises(TypeError):
        events_from_columns([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="before start_ns"):
        KernelEvent(seq=5, kind="kernel", name="x", device=0, engine="vector", start_ns=10, end_ns=9)


def test_to_dataframe(events: list[KernelEvent]) -> None:
    pytest.importorskip("pandas")
    df = to_dataframe(events)
    assert len(df) == 9
    assert list(df.columns[:8]) == ["seq", "kind", "name", "device", "engine", "start_ns", "end_ns", "dur_ns"]
    assert df["dur_ns"].tolist() == [2000, 500, 500, 1000, 400, 200, 400, 500, 0]
    assert df.loc[0, "bytes_total"] == 3072
    assert df.loc[4, "location"] == "cell [3], line 2"
    assert df.groupby("engine")["dur_ns"].sum().to_dict() == {
        "dma": 700, "host": 400, "tensor": 3500, "vector": 900
    }
    assert len(to_dataframe([]).columns) == len(df.columns)


def test_trace_container_and_filters(trace: Trace) -> None:
    assert len(trace) == 9 and trace[0].name == "aten::mm"
    assert (trace.start_ns, trace.end_ns, trace.span_ns) == (BASE, BASE + 7000, 7000)
    assert trace.devices == [0, 1]
    assert trace.engines == ["tensor", "vector", "dma", "host"]
    assert trace.info() == {"profile": "trn2", "dropped": 3, "num_events": 9, "cell": 3}

    assert [e.seq for e in trace.by_kind("kernel")] == [0, 2, 3, 6, 7]
    assert [e.seq for e in trace.kernels()] == [0, 2, 3, 6, 7]
    assert [e.seq for e in trace.transfers()] == [1, 5]
    assert [e.seq for e in trace.syncs()] == [4]
    assert [e.seq for e in trace.by_device("neuron:1")] == [7, 8]
    assert [e.seq for e in trace.by_device(1)] == [7, 8]
    assert [e.seq for e in trace.by_engine(["tensor", "vector"])] == [0, 2, 3, 6, 7]
    assert [e.seq for e in trace.filter(kind="kernel", device=0, engine="tensor")] == [0, 3]
    assert [e.seq for e in trace.filter(name="aten::mm")] == [0, 3, 7]
    # half-open window [3000, 5000): mm ending at 3000 and mm starting at 5000 are out
    assert [e.seq for e in trace.window(BASE + 3000, BASE + 5000)] == [2, 6]
    assert [e.seq for e in trace.window(BASE + 7000, None)] == [8]  # instant marker at the bound
    assert [e.seq for e in trace.window(None, BASE + 500)] == [1]
    sub = trace.by_kind("dma")
    assert sub.profile == "trn2" and sub.dropped == 3 and sub.metadata == {"cell": 3}
    assert len(Trace.from_columns(make_columns(), profile="trn1", dropped=1)) == 9


def test_trace_filter_errors(trace: Trace) -> None:
    with pytest.raises(ValueError, match="unknown kind 'kernal'"):
        trace.by_kind("kernal")
    with pytest.raises(ValueError, match="unknown engine"):
        trace.by_engine("tensorr")
    with pytest.raises(ValueError, match="neuron:N"):
        trace.by_device("cuda:0")
    with pytest.raises(ValueError, match="before it starts"):
        trace.window(10, 5)
    with pytest.raises(ValueError, match="empty"):
        trace.by_kind([])


# --------------------------------------------------------------------------------------------------
# chrome trace
# --------------------------------------------------------------------------------------------------
def test_chrome_trace_structure(trace: Trace) -> None:
    ct = to_chrome_trace(trace)
    validate_chrome_trace(ct)
    assert ct["displayTimeUnit"] == "ns"
    other = ct["otherData"]
    assert other["profile"] == "trn2" and other["dropped"] == 3 and other["t0_ns"] == BASE and other["cell"] == 3

    evs = ct["traceEvents"]
    meta = [e for e in evs if e["ph"] == "M"]
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert procs == {0: "neuron:0", 1: "neuron:1"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert threads == {(0, 1): "tensor", (0, 2): "vector", (0, 5): "dma", (0, 6): "host",
                       (1, 1): "tensor", (1, 6): "host"}

    complete = [e for e in evs if e["ph"] == "X"]
    instants = [e for e in evs if e["ph"] == "i"]
    assert len(complete) == 7 and len(instants) == 2
    mm = next(e for e in complete if e["args"]["seq"] == 0)
    assert (mm["name"], mm["pid"], mm["tid"], mm["ts"], mm["dur"]) == ("aten::mm", 0, 1, 1.0, 2.0)
    assert mm["cat"] == "kernel,new_signature"
    assert mm["args"]["shapes"] == "[16, 16], [16, 16]"
    assert mm["args"]["bytes_read"] == 2048 and mm["args"]["flops"] == 1_000_000
    assert mm["args"]["source"] == "<ipython-input-3>:2 in <module>"
    assert "estimate_us" not in mm["args"]
    h2d = next(e for e in complete if e["args"]["seq"] == 1)
    assert (h2d["tid"], h2d["ts"], h2d["dur"], h2d["args"]["direction"]) == (5, 0.0, 0.5, "h2d")
    sync = next(e for e in instants if e["args"]["seq"] == 4)
    assert (sync["name"], sync["s"], sync["ts"], sync["tid"]) == ("aten::item", "t", 6.0, 6)
    assert sync["args"]["wait_us"] == 0.4 and sync["args"]["source"] == "cell [3], line 2"
    # events are in time order after the metadata
    ts = [e["ts"] for e in evs if e["ph"] != "M"]
    assert ts == sorted(ts)


def test_chrome_trace_absolute_times_estimates_and_oom(events: list[KernelEvent]) -> None:
    annotated = annotate_estimates(events, "trn2")
    oom = KernelEvent(seq=9, kind="oom", name="OutOfMemoryError", device=0, engine="host",
                      start_ns=BASE + 8000, end_ns=BASE + 8000)
    ct = to_chrome_trace([*annotated, oom], {"profile": "trn2"}, relative=False)
    validate_chrome_trace(ct)
    mm = next(e for e in ct["traceEvents"] if e["ph"] == "X" and e["args"]["seq"] == 0)
    assert mm["ts"] == (BASE + 1000) / 1000
    assert annotated[0].est_ns is not None
    assert mm["args"]["estimate_us"] == pytest.approx(annotated[0].est_ns / 1000, rel=1e-12)
    assert "ESTIMATE" in mm["args"]["estimate_note"] and "trn2" in mm["args"]["estimate_note"]
    oom_ev = next(e for e in ct["traceEvents"] if e.get("cat") == "oom")
    assert (oom_ev["ph"], oom_ev["s"]) == ("i", "p")


def test_chrome_trace_empty_is_valid() -> None:
    ct = to_chrome_trace([])
    validate_chrome_trace(ct)
    assert ct["traceEvents"] == []


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda t: t.pop("traceEvents"), "missing key 'traceEvents'"),
        (lambda t: t.__setitem__("traceEvents", {}), "must be a list"),
        (lambda t: t.__setitem__("displayTimeUnit", "us"), "displayTimeUnit"),
        (lambda t: _first(t, "X").__setitem__("dur", -1.0), "'dur' must be >= 0"),
        (lambda t: _first(t, "X").pop("dur"), "needs a finite number 'dur'"),
        (lambda t: _first(t, "X").__setitem__("ts", float("nan")), "'ts' must be a finite number"),
        (lambda t: _first(t, "X").__setitem__("ts", "0"), "'ts' must be a finite number"),
        (lambda t: _first(t, "X").__setitem__("ph", "Q"), "'ph' must be one of"),
        (lambda t: _first(t, "X").__setitem__("pid", None), "'pid' must be"),
        (lambda t: _first(t, "X").pop("tid"), "'tid' must be"),
        (lambda t: _first(t, "X").__setitem__("name", 3), "'name' must be a string"),
        (lambda t: _first(t, "X").__setitem__("args", [1]), "'args' must be an object"),
        (lambda t: _first(t, "i").__setitem__("s", "x"), "instant scope"),
        (lambda t: _first(t, "M").__setitem__("name", "proc_name"), "metadata event name"),
        (lambda t: _first(t, "M").__setitem__("args", {}), "needs args.name"),
        (lambda t: _first(t, "X")["args"].__setitem__("obj", object()), "not JSON-serialisable"),
    ],
)
def test_validate_chrome_trace_rejects_invalid(trace: Trace, mutate: Any, message: str) -> None:
    ct = to_chrome_trace(trace)
    mutate(ct)
    with pytest.raises(ValueError, match="invalid Chrome trace") as info:
        validate_chrome_trace(ct)
    assert message in str(info.value)


def _first(ct: dict[str, Any], ph: str) -> dict[str, Any]:
    return next(e for e in ct["traceEvents"] if e["ph"] == ph)


def test_validate_chrome_trace_other_containers() -> None:
    assert chrome_trace_problems([{"ph": "X", "name": "a", "pid": 0, "tid": 0, "ts": 0, "dur": 1}]) == []
    assert chrome_trace_problems("trace") == ["a trace must be an object or a list of events, got str"]
    # process-scoped instants and process metadata need no tid
    assert chrome_trace_problems({"traceEvents": [
        {"ph": "i", "s": "p", "name": "oom", "pid": 0, "ts": 1},
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "neuron:0"}},
    ]}) == []


def test_write_chrome_trace(tmp_path: Path, trace: Trace) -> None:
    p = write_chrome_trace(tmp_path / "trace.json", trace)
    loaded = json.loads(p.read_text())
    validate_chrome_trace(loaded)
    assert loaded == json.loads(json.dumps(to_chrome_trace(trace)))
    pz = write_chrome_trace(tmp_path / "trace.json.gz", trace.events, {"profile": "trn1"})
    with gzip.open(pz, "rt") as fh:
        loaded_gz = json.load(fh)
    validate_chrome_trace(loaded_gz)
    assert loaded_gz["otherData"]["profile"] == "trn1"


def test_write_chrome_trace_in_chunks_is_the_same_json(tmp_path: Path, trace: Trace,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import torchneuron_lab.tracing.chrome_trace as ct

    whole = json.dumps(to_chrome_trace(trace), allow_nan=False, separators=(",", ":"))
    n_events = len(to_chrome_trace(trace)["traceEvents"])
    for chunk in (1, 2, 3, n_events - 1, n_events, n_events + 5):
        monkeypatch.setattr(ct, "_CHUNK_EVENTS", chunk)
        p = write_chrome_trace(tmp_path / f"t{chunk}.json", trace)
        assert p.read_text() == whole  # byte for byte what one json.dumps makes
    empty = write_chrome_trace(tmp_path / "empty.json", [])
    validate_chrome_trace(json.loads(empty.read_text()))
    assert sorted(os.listdir(tmp_path)) == sorted([f"t{c}.json" for c in (1, 2, 3, n_events - 1, n_events,
                                                                            n_events + 5)] + ["empty.json"])


def test_write_chrome_trace_through_a_symlink_with_the_umask_and_the_gzip_name(
        tmp_path: Path, trace: Trace, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchneuron_lab.tracing.chrome_trace as ct

    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_chrome_trace(link, trace)
    assert link.is_symlink() and json.loads(real.read_text())["traceEvents"]  # written through the link
    new = write_chrome_trace(tmp_path / "new.json", trace)
    umask = os.umask(0o022)
    os.umask(umask)
    assert new.stat().st_mode & 0o777 == 0o666 & ~umask  # not the temporary file's 0600
    gz = write_chrome_trace(tmp_path / "t.json.gz", trace)
    raw = gz.read_bytes()
    assert raw[3] & 0x08 and raw[10:].split(b"\0", 1)[0] == b"t.json"  # FNAME: the target's name
    monkeypatch.setattr(ct, "to_chrome_trace", lambda *a, **k: {"traceEvents": [{"ph": "Q", "name": "x"}]})
    with pytest.raises(ValueError) as info:
        write_chrome_trace(tmp_path / "bad.json", trace)
    assert "invalid Chrome trace" in str(info.value) and "not JSON-serialisable" not in str(info.value)
    assert not (tmp_path / "bad.json").exists()


def test_write_chrome_trace_that_fails_leaves_the_old_file(tmp_path: Path, trace: Trace) -> None:
    target = tmp_path / "trace.json"
    target.write_text("old")
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        write_chrome_trace(target, trace, {"bad": float("nan")})
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["trace.json"]  # no temporary file left


# --------------------------------------------------------------------------------------------------
# summaries
# --------------------------------------------------------------------------------------------------
def test_time_by_engine(events: list[KernelEvent]) -> None:
    got = time_by_engine(events)
    assert list(got) == ["tensor", "vector", "dma"]
    assert got["tensor"] == {"count": 3, "total_ns": 3500, "busy_ns": 3500, "share": 3500 / 5100}
    # add [3500,4000) and relu [3800,4200) overlap: busy counts the union once
    assert got["vector"] == {"count": 2, "total_ns": 900, "busy_ns": 700, "share": 900 / 5100}
    assert got["dma"] == {"count": 2, "total_ns": 700, "busy_ns": 700, "share": 700 / 5100}
    assert time_by_engine(events, device=1) == {
        "tensor": {"count": 1, "total_ns": 500, "busy_ns": 500, "share": 1.0}
    }
    assert time_by_engine(events, kinds=None)["host"] == {
        "count": 2, "total_ns": 400, "busy_ns": 400, "share": 400 / 5500
    }
    assert time_by_engine([]) == {}


def test_top_kernels(events: list[KernelEvent]) -> None:
    rows = top_kernels(events, 2)
    assert [r["name"] for r in rows] == ["aten::mm", "aten::add.Tensor"]
    mm = rows[0]
    assert mm["engine"] == "tensor"
    assert (mm["count"], mm["total_ns"], mm["min_ns"], mm["max_ns"]) == (3, 3500, 500, 2000)
    assert mm["mean_ns"] == pytest.approx(3500 / 3)
    assert mm["share"] == pytest.approx(3500 / 4400)
    assert (mm["bytes_read"], mm["bytes_written"], mm["bytes"], mm["flops"]) == (6144, 3072, 9216, 3_000_000)
    assert mm["achieved_bytes_per_s"] == pytest.approx(9216 / 3.5e-6)
    assert mm["achieved_flops_per_s"] == pytest.approx(3_000_000 / 3.5e-6)
    assert mm["new_signatures"] == 2
    assert mm["est_total_ns"] is None
    assert [r["name"] for r in top_kernels(events, None, by="count")] == [
        "aten::mm", "aten::add.Tensor", "aten::relu"
    ]
    assert top_kernels(events, 0) == []
    relu = top_kernels(events, None)[-1]
    assert relu["name"] == "aten::relu" and relu["achieved_flops_per_s"] == 0.0
    with pytest.raises(ValueError, match="cannot sort kernels by 'speed'"):
        top_kernels(events, by="speed")
    with pytest.raises(ValueError, match="k must be"):
        top_kernels(events, -1)


def test_top_kernels_estimate_total(events: list[KernelEvent]) -> None:
    annotated = annotate_estimates(events, "trn2")
    mm = top_kernels(annotated, 1)[0]
    expected = sum(e.est_ns for e in annotated if e.name == "aten::mm")  # type: ignore[misc]
    assert mm["est_total_ns"] == pytest.approx(expected)


def test_sync_events(events: list[KernelEvent]) -> None:
    assert sync_events(events) == [
        {"seq": 4, "name": "aten::item", "device": 0, "stream": 0, "start_ns": BASE + 6000, "end_ns": BASE + 6400,
         "wait_ns": 400, "source": "cell [3], line 2", "location": "cell [3], line 2"}
    ]


def test_transfers(events: list[KernelEvent]) -> None:
    got = transfers(events)
    assert got == {
        "h2d": {"count": 1, "bytes": 4096, "total_ns": 500, "bytes_per_s": 4096 / 500e-9},
        "d2h": {"count": 1, "bytes": 4, "total_ns": 200, "bytes_per_s": 4 / 200e-9},
        "d2d": {"count": 0, "bytes": 0, "total_ns": 0, "bytes_per_s": None},
    }
    odd = KernelEvent(seq=0, kind="dma", name="copy", device=0, engine="dma", start_ns=0, end_ns=10,
                      bytes_read=8, bytes_written=8)
    assert transfers([odd])["unknown"] == {"count": 1, "bytes": 8, "total_ns": 10, "bytes_per_s": 8 / 10e-9}


def test_new_signatures(events: list[KernelEvent]) -> None:
    rows = new_signatures(events)
    assert [(r["seq"], r["name"], r["device"]) for r in rows] == [
        (0, "aten::mm", 0), (2, "aten::add.Tensor", 0), (7, "aten::mm", 1)
    ]
    assert rows[2]["dtypes"] == "bfloat16, bfloat16" and rows[0]["location"] == "<ipython-input-3>:2 in <module>"


def test_idle_gaps(events: list[KernelEvent]) -> None:
    assert idle_gaps(events) == [
        {"device": 0, "engine": "tensor", "start_ns": BASE + 3000, "end_ns": BASE + 5000, "gap_ns": 2000,
         "after": "aten::mm", "before": "aten::mm"},
        {"device": 0, "engine": "dma", "start_ns": BASE + 500, "end_ns": BASE + 6100, "gap_ns": 5600,
         "after": "aten::_copy_from", "before": "aten::_copy_from"},
    ]
    assert [g["gap_ns"] for g in idle_gaps(events, min_gap_ns=3000)] == [5600]
    with pytest.raises(ValueError):
        idle_gaps(events, min_gap_ns=-1)


def test_idle_gaps_names_the_event_that_ends_last() -> None:
    def k(seq: int, name: str, s: int, e: int) -> KernelEvent:
        return KernelEvent(seq=seq, kind="kernel", name=name, device=0, engine="vector", start_ns=s, end_ns=e)

    evs = [k(0, "long", 0, 100), k(1, "short", 10, 20), k(2, "next", 150, 160)]
    assert idle_gaps(evs) == [{"device": 0, "engine": "vector", "start_ns": 100, "end_ns": 150, "gap_ns": 50,
                               "after": "long", "before": "next"}]


def test_lane_utilization(events: list[KernelEvent]) -> None:
    rows = lane_utilization(events)
    assert [(r["device"], r["engine"], r["count"], r["busy_ns"], r["span_ns"], r["idle_ns"]) for r in rows] == [
        (0, "tensor", 2, 3000, 5000, 2000),
        (0, "vector", 2, 700, 700, 0),
        (0, "dma", 2, 700, 6300, 5600),
        (1, "tensor", 1, 500, 500, 0),
    ]
    assert [r["utilization"] for r in rows] == [0.6, 1.0, pytest.approx(700 / 6300), 1.0]


def test_activity_is_the_union_of_lanes_and_adds_up_to_the_span(events: list[KernelEvent]) -> None:
    from torchneuron_lab.tracing.summary import activity

    got = activity(events)
    # busy union: [0,500) [1000,3000) [3500,4200) [5000,6000) [6100,6300); the span ends at the marker (7000)
    assert got["gaps"] == [
        {"start_ns": BASE + s, "end_ns": BASE + e, "gap_ns": e - s}
        for s, e in ((500, 1000), (3000, 3500), (4200, 5000), (6000, 6100), (6300, 7000))
    ]
    assert (got["span_ns"], got["busy_ns"], got["idle_ns"]) == (7000, 4400, 2600)
    assert got["busy_ns"] + got["idle_ns"] == got["span_ns"]
    assert sum(g["gap_ns"] for g in got["gaps"]) == got["idle_ns"]
    # per-lane idle adds up to more than the union's: the two definitions differ, and only the union's
    # idle time can be set beside the span
    per_lane = sum(g["gap_ns"] for g in idle_gaps(events))
    assert per_lane == 7600 > got["span_ns"] > got["idle_ns"]
    assert activity([]) == {"span_ns": 0, "busy_ns": 0, "idle_ns": 0, "unrecorded_ns": 0, "gaps": []}


def test_summarize_is_json_serialisable(trace: Trace) -> None:
    s = summarize(trace, k=1)
    assert s["num_events"] == 9 and s["span_ns"] == 7000
    assert (s["activity"]["busy_ns"], s["activity"]["idle_ns"]) == (4400, 2600)
    assert [r["name"] for r in s["top_kernels"]] == ["aten::mm"]
    json.dumps(s, allow_nan=False)
    assert summarize([])["num_events"] == 0


# --------------------------------------------------------------------------------------------------
# device profiles and the roofline estimate
# --------------------------------------------------------------------------------------------------
def test_profiles_registry() -> None:
    assert list_profiles() == ["trn1", "trn2", "trn3"]
    assert DEFAULT_PROFILE_NAME == "trn2"
    assert get_profile() is default_profile() is PROFILES["trn2"]
    assert get_profile(" TRN3 ") is PROFILES["trn3"]
    assert get_profile(PROFILES["trn1"]) is PROFILES["trn1"]
    with pytest.raises(ValueError, match="unknown device profile 'trn4'; known profiles: trn1, trn2, trn3"):
        get_profile("trn4")
    with pytest.raises(TypeError):
        get_profile(2)  # type: ignore[arg-type]


def test_default_profile_is_one_trn2_logical_core() -> None:
    p = default_profile()
    assert (p.chip, p.neuron_core, p.physical_cores_per_logical, p.logical_cores_per_chip) == (
        "Trainium2", "NeuronCore-v3", 2, 4
    )
    assert p.hbm_bytes == 24 * GiB == 96 * GiB // p.logical_cores_per_chip
    assert p.hbm_bandwidth_bytes_per_s == pytest.approx(2.9e12 / 4)
    assert p.tensor_bf16_flops == pytest.approx(2 * 79e12)
    assert p.dma_bandwidth_bytes_per_s == pytest.approx(3.5e12 / 4)


@pytest.mark.parametrize("name", ["trn1", "trn2", "trn3"])
def test_profiles_are_documented(name: str) -> None:
    p = get_profile(name)
    assert p.sources and all("awsdocs-neuron" in s for s in p.sources)
    assert "DERIVED" in p.notes and "GPSIMD" in p.notes
    assert p.tensor_bf16_flops > p.tensor_fp32_flops > p.scalar_flops > p.gpsimd_flops > 0
    json.dumps(p.as_dict())
    # chip HBM = per-logical-core HBM x logical cores
    assert p.hbm_bytes * p.logical_cores_per_chip == {"trn1": 32, "trn2": 96, "trn3": 144}[name] * GiB


def test_estimate_ns_roofline_numbers() -> None:
    # compute-bound: 1 ms of work at each peak
    assert estimate_ns("trn2", "tensor", 158e9, 0, "bfloat16") == pytest.approx(1e6)
    assert estimate_ns("trn2", "tensor", 158e9, 0, "bf16") == pytest.approx(1e6)
    assert estimate_ns("trn2", "tensor", 45.25e9, 0) == pytest.approx(1e6)  # float32 default
    assert estimate_ns("trn2", "vector", 2e9, 0) == pytest.approx(1e6)
    assert estimate_ns("trn2", "scalar", 2.4e9, 0) == pytest.approx(1e6)
    assert estimate_ns("trn2", "gpsimd", 307.2e6, 0) == pytest.approx(1e6)
    assert estimate_ns("trn1", "tensor", 92e9, 0, "float16") == pytest.approx(1e6)
    assert estimate_ns("trn3", "tensor", 40e9, 0, "float32") == pytest.approx(1e6)
    # memory-bound: 725 MB at 725 GB/s
    assert estimate_ns(None, "vector", 1, 725e6) == pytest.approx(1e6)
    # the max of both: 1 ms compute vs 2 ms memory
    assert estimate_ns("trn2", "tensor", 158e9, 1.45e9, "bfloat16") == pytest.approx(2e6)
    # dma: bytes / DMA bandwidth, flops ignored
    assert estimate_ns("trn2", "dma", 10**12, 875e6) == pytest.approx(1e6)
    assert estimate_ns("trn1", "dma", 0, 500e6) == pytest.approx(1e6)
    assert estimate_ns("trn2", "vector", 0, 0) == 0.0


def test_estimate_ns_accepts_torch_dtypes() -> None:
    torch = pytest.importorskip("torch")
    assert estimate_ns("trn2", "tensor", 158e9, 0, torch.bfloat16) == pytest.approx(1e6)
    assert estimate_ns("trn2", "tensor", 45.25e9, 0, torch.float32) == pytest.approx(1e6)
    assert estimate_ns("trn2", "tensor", 45.25e9, 0, torch.int64) == pytest.approx(1e6)  # fp32 rate


def test_estimate_ns_errors() -> None:
    with pytest.raises(ValueError, match="unknown engine 'host'; expected one of tensor, vector"):
        estimate_ns("trn2", "host", 1, 1)
    with pytest.raises(ValueError, match="flops must be >= 0"):
        estimate_ns("trn2", "tensor", -1, 0)
    with pytest.raises(ValueError, match="bytes_moved must be >= 0"):
        estimate_ns("trn2", "tensor", 0, -1)
    with pytest.raises(ValueError, match="unknown device profile"):
        estimate_ns("h100", "tensor", 1, 1)


def test_annotate_estimates(events: list[KernelEvent]) -> None:
    p = get_profile("trn2")
    out = annotate_estimates(events)
    assert len(out) == len(events) and events[0].est_ns is None  # inputs untouched
    mm_fp32 = max(1e6 / p.tensor_fp32_flops, 3072 / p.hbm_bandwidth_bytes_per_s) * 1e9
    assert out[0].est_ns == pytest.approx(mm_fp32)
    assert out[0].est_ns == pytest.approx(1e6 / 45.25e12 * 1e9)
    mm_bf16 = max(1e6 / p.tensor_bf16_flops, 3072 / p.hbm_bandwidth_bytes_per_s) * 1e9
    assert out[7].est_ns == pytest.approx(mm_bf16)
    assert out[1].est_ns == pytest.approx(4096 / p.dma_bandwidth_bytes_per_s * 1e9)  # max(read, written)
    assert out[6].est_ns == pytest.approx(2048 / p.hbm_bandwidth_bytes_per_s * 1e9)  # relu: memory-bound
    assert out[4].est_ns is None and out[8].est_ns is None  # sync, marker
    assert all(math.isfinite(e.est_ns) for e in out if e.est_ns is not None)


# --------------------------------------------------------------------------------------------------
# the asynchronous device (issue 12): launch spans, streams, syncs, classification
# --------------------------------------------------------------------------------------------------
import _async_traces as A

from torchneuron_lab.tracing import (
    ASYNC_COLUMNS,
    RecordedColumns,
    activity,
    classify_region,
    host_waits,
    queue_depth,
)


def test_async_columns_read_round_trip_and_default() -> None:
    cols = A.two_streams()
    evs = events_from_columns(cols)
    copy = evs[1]
    assert (copy.stream, copy.host_start_ns, copy.host_end_ns, copy.correlation) == (1, A.BASE + 60, A.BASE + 100, 2)
    assert copy.launch_delay_ns == 100 and copy.has_launch
    sync = evs[4]
    assert (sync.kind, sync.stream, sync.host_end_ns, sync.has_launch, sync.launch_delay_ns) == ("sync", 0, 0, False, None)
    back = events_to_columns(evs)
    for name in ASYNC_COLUMNS:
        assert back[name] == cols[name], name
    assert events_from_columns(back) == evs
    # a recorder without the columns (synchronous build): every event reads the defaults
    legacy = {k: v for k, v in cols.items() if k not in ASYNC_COLUMNS}
    assert [(e.stream, e.host_start_ns, e.host_end_ns, e.correlation) for e in events_from_columns(legacy)] == [
        (0, 0, 0, 0)] * 5
    assert to_dataframe(evs)[list(ASYNC_COLUMNS)].values.tolist()[1] == [1, A.BASE + 60, A.BASE + 100, 2]
    with pytest.raises(ValueError, match="host_end_ns .* is before host_start_ns"):
        KernelEvent(seq=3, kind="kernel", name="k", device=0, engine="tensor", start_ns=0, end_ns=1,
                    host_start_ns=10, host_end_ns=5)


def _raw(n: int, **optional: Any) -> dict[str, Any]:
    import numpy as np

    raw: dict[str, Any] = {"n": n, "strings": ["aten::mm"], "kinds": ("kernel", "dma", "sync", "marker"),
                           "engines": ("tensor", "vector", "scalar", "gpsimd", "dma", "host"),
                           "directions": ("", "h2d", "d2h", "d2d"), "dropped": 0}
    for name, dt in RecordedColumns._NUMERIC:
        raw[name] = np.zeros(n, dtype=dt).tobytes()
    raw["stack"] = np.full(n, -1, dtype="<i4").tobytes()
    raw["end_ns"] = np.arange(n, dtype="<i8").tobytes()
    raw.update(optional)
    return raw


def test_recorded_columns_read_optional_columns_of_any_int_width_or_none() -> None:
    import numpy as np

    absent = RecordedColumns.from_raw(_raw(3))
    assert [(e.stream, e.host_end_ns, e.correlation) for e in absent.events()] == [(0, 0, 0)] * 3
    assert absent.column("host_end_ns").tolist() == [0, 0, 0]
    given = RecordedColumns.from_raw(_raw(
        3, stream=np.array([0, 2, -1], dtype="<i2").tobytes(), host_start_ns=np.array([1, 2, 3], "<i8").tobytes(),
        host_end_ns=[4, 5, 6], correlation=np.array([7, 8, 9], dtype="<i4").tobytes()))
    assert [(e.stream, e.host_start_ns, e.host_end_ns, e.correlation) for e in given.events()] == [
        (0, 1, 4, 7), (2, 2, 5, 8), (-1, 3, 6, 9)]
    with pytest.raises(ValueError, match="'stream': 5 bytes for 3 events is not a packed int column"):
        RecordedColumns.from_raw(_raw(3, stream=b"\0" * 5))
    with pytest.raises(KeyError, match="no column 'nope'"):
        absent.column("nope")
    evs = events_from_columns(A.two_streams())
    assert RecordedColumns.from_events(evs).events() == evs


def test_classify_host_bound() -> None:
    got = classify_region(events_from_columns(A.host_bound()))
    assert got["class"] == "host-bound"
    assert (got["span_ns"], got["device_busy_ns"], got["device_idle_ns"], got["launch_ns"],
            got["idle_while_launching_ns"], got["queue_busy_ns"], got["sync_count"]) == (400, 40, 360, 360, 360, 40, 0)
    assert got["idle_while_launching_fraction"] == 0.9 and got["device_idle_fraction"] == 0.9
    assert got["headline"] == ("host-bound: the device was idle 90% of the 400 ns span (90% of the span while "
                               "the host was launching kernels, the rest while it ran other code)")


def test_classify_device_bound() -> None:
    got = classify_region(events_from_columns(A.device_bound()))
    assert got["class"] == "device-bound"
    assert (got["span_ns"], got["device_busy_ns"], got["queue_busy_ns"], got["sync_count"], got["sync_wait_ns"]) == (
        410, 400, 400, 1, 370)
    assert got["queue_busy_fraction"] == 400 / 410
    assert got["headline"] == "device-bound: the device queue held work 98% of the 410 ns span (device busy 98%)"
    assert queue_depth(events_from_columns(A.device_bound())) == {0: {
        "t_ns": [A.BASE + t for t in (10, 20, 30, 40, 110, 210, 310, 410)], "depth": [1, 2, 3, 4, 3, 2, 1, 0]}}


def test_classify_sync_bound_names_the_lines_that_waited() -> None:
    evs = events_from_columns(A.sync_bound())
    got = classify_region(evs)
    assert got["class"] == "sync-bound"
    assert (got["span_ns"], got["sync_count"], got["sync_wait_ns"], got["queue_busy_ns"]) == (510, 3, 300, 300)
    assert got["sync_wait_fraction"] == 300 / 510
    assert got["top_sync_lines"] == [
        {"location": "cell [4], line 3", "count": 2, "wait_ns": 200, "names": ["aten::_local_scalar_dense"]},
        {"location": "cell [4], line 5", "count": 1, "wait_ns": 100, "names": ["copy d2h"]},
    ]
    assert got["headline"] == ("sync-bound: the host waited 300 ns at 3 syncs (59% of the 510 ns span); "
                               "most at cell [4], line 3 (200 ns in 2)")
    assert host_waits(evs, top=1) == {"count": 3, "wait_ns": 300, "by_location": got["top_sync_lines"][:1]}


def test_classify_synchronous_trace_and_no_work() -> None:
    legacy = {k: v for k, v in A.host_bound().items() if k not in ASYNC_COLUMNS}
    got = classify_region(events_from_columns(legacy))
    # without launch spans the span is the kernels' own: 90..400, busy 40 of 310
    assert (got["class"], got["span_ns"], got["device_busy_ns"], got["launches_known"]) == ("host-bound", 310, 40, False)
    assert got["headline"] == ("host-bound: the device was idle 87% of the 310 ns span (launch times not "
                               "recorded: synchronous trace)")
    assert classify_region([])["class"] == "no device work"
    only_sync = [e for e in events_from_columns(A.sync_bound()) if e.kind == "sync"]
    assert classify_region(only_sync)["headline"] == "no device work: no kernel or transfer ran"


def _columnar(evs: list[KernelEvent]) -> Trace:
    return Trace.from_recorded(RecordedColumns.from_events(evs))


@pytest.mark.parametrize("build", [A.host_bound, A.device_bound, A.sync_bound, A.two_streams])
def test_summarize_on_columns_equals_summarize_on_events(build: Any) -> None:
    evs = events_from_columns(build())
    t = _columnar(evs)
    got = summarize(t, k=None)
    assert "events" not in t.__dict__ or not isinstance(t.__dict__["events"], list)  # no events were built
    assert got == summarize(evs, k=None)
    assert got["bound"] == classify_region(evs)


def test_summarize_on_columns_equals_events_on_a_mixed_trace(events: list[KernelEvent]) -> None:
    import random

    annotated = annotate_estimates(events, "trn2")
    assert summarize(_columnar(annotated), k=2) == summarize(annotated, k=2)
    assert summarize(_columnar([]), k=None) == summarize([], k=None)
    rng = random.Random(3)
    evs = []
    for i in range(2000):
        kind = rng.choice(["kernel", "kernel", "dma", "sync", "compile", "marker"])
        s, d = rng.randint(0, 10**6), rng.randint(0, 5000)
        hs = max(0, s - rng.randint(0, 1000)) if kind in ("kernel", "dma") and rng.random() < 0.7 else 0
        evs.append(KernelEvent(
            seq=i, kind=kind, name=rng.choice(["aten::mm", "aten::add", "copy", "x"]), device=rng.choice([0, 1, -1]),
            engine={"kernel": rng.choice(["tensor", "vector", "odd"]), "dma": "dma"}.get(kind, "host"),
            start_ns=s, end_ns=s + d, bytes_read=rng.randint(0, 99), bytes_written=rng.randint(0, 99),
            flops=rng.randint(0, 9), new_signature=rng.random() < 0.05,
            direction=rng.choice(["", "h2d", "d2h"]) if kind == "dma" else "", stream=rng.randint(-1, 2),
            host_start_ns=hs, host_end_ns=hs + rng.randint(0, 500) if hs else 0,
            stack=(StackFrame("f.py", rng.randint(1, 3), "g"),) if rng.random() < 0.5 else (),
            source=rng.choice([None, "cell [1], line 2"]), est_ns=None if rng.random() < 0.01 else rng.random() * 100))
    assert summarize(_columnar(evs), k=None) == summarize(evs, k=None)
    assert activity(evs) == summarize(_columnar(evs))["activity"]


def test_chrome_trace_async_host_and_device_tracks_with_flows() -> None:
    from torchneuron_lab.tracing.chrome_trace import HOST_PID

    cols = {"seq": [0, 1], "kind": ["kernel", "sync"], "name": ["aten::mm", "aten::_local_scalar_dense"],
            "device": [0, 0], "engine": ["tensor", "host"], "start_ns": [A.BASE + 1000, A.BASE + 500],
            "end_ns": [A.BASE + 3000, A.BASE + 3200], "thread": [7, 7], "stream": [1, -1],
            "host_start_ns": [A.BASE, 0], "host_end_ns": [A.BASE + 400, 0], "correlation": [5, 0],
            "source": [None, "cell [2], line 4"]}
    ct = to_chrome_trace(events_from_columns(cols))
    validate_chrome_trace(ct)
    assert ct["otherData"]["t0_ns"] == A.BASE
    common = {"bytes_read": 0, "bytes_written": 0, "new_signature": False, "thread": 7, "device": "neuron:0"}
    assert ct["traceEvents"] == [
        {"ph": "M", "name": "process_name", "pid": HOST_PID, "args": {"name": "host"}},
        {"ph": "M", "name": "process_sort_index", "pid": HOST_PID, "args": {"sort_index": -1}},
        {"ph": "M", "name": "thread_name", "pid": HOST_PID, "tid": 7, "args": {"name": "host thread 7"}},
        {"ph": "M", "name": "thread_sort_index", "pid": HOST_PID, "tid": 7, "args": {"sort_index": 0}},
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "neuron:0"}},
        {"ph": "M", "name": "process_sort_index", "pid": 0, "args": {"sort_index": 0}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 101, "args": {"name": "tensor · stream 1"}},
        {"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": 101, "args": {"sort_index": 101}},
        {"name": "aten::mm", "cat": "launch", "ph": "X", "pid": HOST_PID, "tid": 7, "ts": 0.0, "dur": 0.4,
         "args": {"seq": 0, "correlation": 5, "device": "neuron:0", "stream": 1}},
        {"name": "launch", "cat": "launch", "ph": "s", "id": 5, "bp": "e", "pid": HOST_PID, "tid": 7, "ts": 0.2},
        {"name": "aten::_local_scalar_dense", "cat": "sync", "ph": "X", "pid": HOST_PID, "tid": 7, "ts": 0.5,
         "dur": 2.7, "args": {"seq": 1, "kind": "sync", **common, "source": "cell [2], line 4", "stream": -1,
                              "wait_us": 2.7}},
        {"name": "aten::mm", "cat": "kernel", "ph": "X", "pid": 0, "tid": 101, "ts": 1.0, "dur": 2.0,
         "args": {"seq": 0, "kind": "kernel", **common, "stream": 1, "correlation": 5, "queued_us": 0.6}},
        {"name": "launch", "cat": "launch", "ph": "f", "id": 5, "bp": "e", "pid": 0, "tid": 101, "ts": 2.0},
    ]
    # every launch of a bigger trace has exactly one flow start and end, inside its two slices
    big = to_chrome_trace(events_from_columns(A.two_streams()))
    validate_chrome_trace(big)
    starts = {e["id"]: e for e in big["traceEvents"] if e["ph"] == "s"}
    ends = {e["id"]: e for e in big["traceEvents"] if e["ph"] == "f"}
    assert sorted(starts) == sorted(ends) == [1, 2, 3, 4]
    assert {(e["pid"], e["tid"]) for e in ends.values()} == {(0, 1), (0, 105), (0, 3), (1, 1)}
    for fid, f in ends.items():
        kernel = next(e for e in big["traceEvents"] if e["ph"] == "X" and e["args"].get("correlation") == fid
                      and e.get("cat") != "launch")
        launch = next(e for e in big["traceEvents"] if e.get("cat") == "launch" and e["ph"] == "X"
                      and e["args"]["correlation"] == fid)
        assert kernel["ts"] < f["ts"] < kernel["ts"] + kernel["dur"]
        assert launch["ts"] < starts[fid]["ts"] < launch["ts"] + launch["dur"]


def test_validate_chrome_trace_flows() -> None:
    base = {"name": "launch", "cat": "launch", "pid": 0, "tid": 1, "ts": 1.0}
    assert chrome_trace_problems([{**base, "ph": "f", "id": 3, "bp": "e"}]) == [
        "traceEvents[0]: flow end without a flow start of the same cat, name and id 3"]
    assert chrome_trace_problems([{**base, "ph": "s"}]) == [
        "traceEvents[0]: flow event needs an int or string 'id', got None"]
    assert chrome_trace_problems([{**base, "ph": "s", "id": 1, "bp": "x"}]) == [
        "traceEvents[0]: flow binding point 'bp' must be 'e', got 'x'"]
    assert chrome_trace_problems([{**base, "ph": "s", "id": 1}, {**base, "ph": "f", "id": 1, "bp": "e"}]) == []


def _queued_around_a_dropped_stretch() -> tuple[Trace, tuple[int, int]]:
    """5 launches of 10 ns queue 5 kernels of 100 ns; the recorder then dropped events for 1 ms; 5 more
    the same way. What was recorded is device-bound (the queue held work ~98% of it)."""
    c = A._Cols()
    for part, t in enumerate((0, 1_000_600)):
        for i in range(5):
            c.kernel("aten::mm", t + 10 + 100 * i, t + 110 + 100 * i, launch=(t + 10 * i, t + 10 * i + 10),
                     source=f"cell [2], line {part + 2}")
    window = (A.BASE + 600, A.BASE + 1_000_600)
    return Trace.from_columns(c.columns(), dropped=12_345, metadata={"dropped_window_ns": list(window)}), window


def test_a_dropped_stretch_is_neither_idle_nor_in_the_verdict() -> None:
    # a bounded recording (keep_first + ring) drops the events between its two ends; the summaries counted that
    # stretch as idle (98% "idle", host-bound, while ~19,000 kernels ran there) and the axis labelled it "idle"
    from torchneuron_lab.widgets import figures as F

    trace, window = _queued_around_a_dropped_stretch()
    s = summarize(trace)
    act, bound = s["activity"], s["bound"]
    assert act["span_ns"] == 1_001_100 and act["busy_ns"] == 1000  # first kernel start to last end
    assert act["unrecorded_ns"] == 1_000_000  # the window, all inside the span
    assert act["busy_ns"] + act["idle_ns"] + act["unrecorded_ns"] == act["span_ns"]
    assert act["idle_ns"] == 100 and sum(g["gap_ns"] for g in act["gaps"]) == 100  # 510..600, 1_000_600..610
    assert all(g["end_ns"] <= window[0] or g["start_ns"] >= window[1] for g in act["gaps"])
    assert bound["class"] == "device-bound", bound["headline"]
    assert bound["span_ns"] == 1_001_110  # the verdict's span starts at the first launch
    assert bound["unrecorded_ns"] == 1_000_000 and bound["device_idle_ns"] == 110
    assert "1.11 µs recorded (1.00 ms of the 1.00 ms span is not: the recorder dropped events there)" in \
        bound["headline"], bound["headline"]
    # the same events without the window: the old verdict (the stretch as idle)
    plain = summarize(Trace(list(trace.events)))
    assert plain["bound"]["class"] == "host-bound" and plain["activity"]["unrecorded_ns"] == 0
    # the timeline: its summary and verdict agree, and the collapsed stretch says what it is
    ts = F.timeline_summary(trace)
    assert ts["unrecorded_ns"] == 1_000_000 and ts["busy_ns"] + ts["idle_ns"] + ts["unrecorded_ns"] == ts["span_ns"]
    assert ts["bound"]["class"] == "device-bound"
    labels = [a.text for a in F.timeline_figure(trace).layout.annotations]
    assert labels == ["not recorded 1.00 ms (events dropped)"], labels


@pytest.mark.parametrize("early_wait", [False, True])
def test_a_bounded_recording_summarised_from_its_columns_agrees_with_its_events(early_wait: bool) -> None:
    import torch

    from torchneuron_lab.device import recorder
    from torchneuron_lab.device._backend import lib

    # each add long enough on the device that the host runs ahead: the queue is deep, so the kept kernels'
    # launches happened while the dropped ones ran
    x = torch.ones(1 << 16, device="neuron")
    torch.neuron.synchronize()  # (no kernel launched before the recording runs inside it)
    t_before = lib().now_ns()
    with recorder.record(capacity=300, keep_first=50) as box:
        for i in range(3000):
            x.add_(1)
            if early_wait and i == 100:
                # A host wait that began before the first kernel and ended after the pinned head filled
                # (a full queue whose worker had not yet run): pushed late, so the ring drops it, and the
                # dropped window starts before every kept event (seen once in CI under load). The head is
                # full once the first 101 kernels have run.
                torch.neuron.synchronize()
                lib().recorder_push("sync", "sync: queue full", 0, "host", t_before, lib().now_ns(),
                                    0, 0, 0, -1, "")
        torch.neuron.synchronize()
    tr = box[0]
    assert tr.dropped > 0 and tr.columns is not None
    window = tuple(tr.metadata["dropped_window_ns"])
    fast = summarize(tr)  # from the recorder's columns
    slow = summarize(Trace(list(tr.events), dropped=tr.dropped, metadata=tr.metadata))
    assert fast["activity"] == slow["activity"] and fast["bound"] == slow["bound"]
    act = fast["activity"]
    lo = min(e.start_ns for e in tr.events)
    hi = max(e.end_ns for e in tr.events)
    assert (window[0] == t_before < lo) if early_wait else True
    assert act["unrecorded_ns"] == min(window[1], hi) - max(window[0], lo) > 0
    assert act["busy_ns"] + act["idle_ns"] + act["unrecorded_ns"] == act["span_ns"]
    # the verdict's span starts at the first launch on the host, before the first kernel on the device:
    # its share of the dropped window is clipped to that span, not to the activity's
    lo_bound = min([lo] + [e.host_start_ns for e in tr.events if e.host_end_ns > 0 and e.device >= 0])
    assert lo_bound < lo
    assert fast["bound"]["unrecorded_ns"] == min(window[1], hi) - max(window[0], lo_bound)
    assert fast["bound"]["span_ns"] == hi - lo_bound
    if early_wait:
        assert fast["bound"]["unrecorded_ns"] > act["unrecorded_ns"]
    # the timeline's verdict is the same one: three paths (columns, events, the timeline's arrays) agree
    from torchneuron_lab.widgets import figures as F

    assert F.timeline_summary(tr)["bound"] == fast["bound"]
    assert fast["bound"]["launches_known"] is True


def test_stack_frames_hold_valid_unicode_whatever_the_file_system_held() -> None:
    # a file name with undecodable bytes (os.fsdecode) or any lone surrogate: printable, JSON-encodable text
    fr = StackFrame(os.fsdecode(b"/tmp/s\xffx.py"), 3, "f\ud800")
    assert (fr.filename, fr.name) == ("/tmp/s\\xffx.py", "f\\ud800")
    assert str(fr).encode("utf-8") == b"/tmp/s\\xffx.py:3 in f\\ud800"
    plain = StackFrame("/tmp/\u00e9t\u00e9.py", 1, "g")
    assert plain.filename == "/tmp/\u00e9t\u00e9.py"  # valid names are kept as they are


def test_per_lane_idle_time_leaves_out_a_dropped_stretch() -> None:
    # the union's summaries left the dropped stretch out; the per-lane ones (lane_utilization, idle_gaps and the
    # timeline's lanes) still counted it as one idle gap of 1 ms on a lane busy ~98% of what was recorded
    from torchneuron_lab.tracing import idle_gaps, lane_utilization
    from torchneuron_lab.tracing.summary import NOT_RECORDED
    from torchneuron_lab.widgets import figures as F

    trace, (w0, w1) = _queued_around_a_dropped_stretch()
    (kernel_lane,) = [r for r in lane_utilization(trace) if r["count"] == 10 and r["engine"] != "host"]
    assert kernel_lane["span_ns"] == 1_001_100 and kernel_lane["unrecorded_ns"] == 1_000_000
    assert (kernel_lane["busy_ns"], kernel_lane["idle_ns"]) == (1000, 100)
    assert kernel_lane["utilization"] == pytest.approx(1000 / 1100)
    gaps = [g for g in idle_gaps(trace) if g["engine"] == kernel_lane["engine"]]
    assert [(g["start_ns"] - A.BASE, g["end_ns"] - A.BASE, g["after"], g["before"]) for g in gaps] == [
        (510, 600, "aten::mm", NOT_RECORDED), (1_000_600, 1_000_610, NOT_RECORDED, "aten::mm")]
    assert all(g["end_ns"] <= w0 or g["start_ns"] >= w1 for g in idle_gaps(trace))
    assert idle_gaps(trace, min_gap_ns=50) == gaps[:1]
    # the summary from the recorder's columns and from the events agree
    fast = summarize(trace)
    slow = summarize(Trace(list(trace.events), dropped=trace.dropped, metadata=trace.metadata))
    assert fast["lane_utilization"] == slow["lane_utilization"] == lane_utilization(trace)
    assert fast["idle_gaps"] == slow["idle_gaps"] == idle_gaps(trace)
    # without the window: one gap of 1.0001 ms, as before
    plain = idle_gaps(list(trace.events))
    assert [g["gap_ns"] for g in plain if g["engine"] == kernel_lane["engine"]] == [1_000_100]
    # the timeline's per-lane numbers
    lanes = F.timeline_summary(trace)["lanes"]
    (row,) = [v for v in lanes.values() if v["count"] == 10 and v["busy_ns"] == 1000]
    assert (row["idle_ns"], row["gaps"]) == (100, 2)
