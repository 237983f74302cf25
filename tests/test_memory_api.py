"""Pure-Python tests of ``torchneuron_lab.device.memory`` against a fake ``_C`` module.

The fake stands in for the compiled extension (contract: notes/api.md). It returns nested stats
dicts and a snapshot produced by a tiny allocator model, so the snapshot's trace and final state
are consistent the way the real caching allocator's are.
"""

from __future__ import annotations

import base64
import copy
import importlib
import inspect
import json
import pickle
import pickletools
import re
import sys
import types
from typing import Any

import pytest
import torch

try:
    importlib.import_module("torchneuron_lab.device._backend")
except ImportError:  # the compiled backend is not written yet: a stub keeps memory.py importable
    _stub = types.ModuleType("torchneuron_lab.device._backend")

    def _no_backend() -> Any:
        raise RuntimeError("the neuron _C extension is not available in these tests")

    _stub.lib = _no_backend  # type: ignore[attr-defined]
    sys.modules["torchneuron_lab.device._backend"] = _stub

from torch.cuda import _memory_viz

from torchneuron_lab.device import memory

KiB, MiB = 1024, 1024 * 1024
POOLS = ("all", "large_pool", "small_pool")
METRICS = ("current", "peak", "allocated", "freed")
CORE_STATS = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
COUNTERS = (
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
    "max_split_size",
)


def nested_stats(scale: int) -> dict[str, Any]:
    """Nested stats shaped like ``C.memory_stats(d)``; every value is distinct and derived from ``scale``."""
    stats: dict[str, Any] = {}
    for i, name in enumerate(CORE_STATS):
        unit = MiB if name.endswith("_bytes") else 1
        stats[name] = {
            pool: {metric: scale * unit * (100 * i + 10 * p + m + 1) for m, metric in enumerate(METRICS)}
            for p, pool in enumerate(POOLS)
        }
    for i, name in enumerate(COUNTERS):
        stats[name] = scale * (i + 1)
    for name in ("oversize_allocations", "oversize_segments"):
        stats[name] = {metric: scale * (m + 7) for m, metric in enumerate(METRICS)}
    return stats


# --------------------------------------------------------------------------- a consistent fake snapshot


def frames(*names: str) -> list[dict[str, Any]]:
    """Frames innermost first, as torch.cuda records them."""
    return [
        {"filename": f"/home/user/{n.split('.')[0]}.py", "line": 10 + i, "name": n}
        for i, n in enumerate(names)
    ]


class AllocatorModel:
    """Records allocator actions into ``device_traces`` and derives the final ``segments``."""

    def __init__(self, num_devices: int) -> None:
        self.traces: list[list[dict[str, Any]]] = [[] for _ in range(num_devices)]
        self.segments: dict[tuple[int, int], dict[str, Any]] = {}
        self.blocks: dict[tuple[int, int], dict[str, Any]] = {}
        self.time_us = 1_700_000_000_000_000

    def _event(self, device: int, action: str, size: int, stack: list[dict[str, Any]], **extra: int) -> None:
        self.time_us += 7
        entry = {"action": action, "size": size, "stream": 0, "frames": stack, "time_us": self.time_us}
        entry.update(extra)
        self.traces[device].append(entry)

    def segment_alloc(self, device: int, addr: int, size: int, stack: list[dict[str, Any]]) -> None:
        self.segments[(device, addr)] = {"size": size, "frames": stack}
        self._event(device, "segment_alloc", size, stack, addr=addr)

    def segment_free(self, device: int, addr: int) -> None:
        seg = self.segments.pop((device, addr))
        self._event(device, "segment_free", seg["size"], seg["frames"], addr=addr)

    def alloc(self, device: int, addr: int, size: int, requested: int, stack: list[dict[str, Any]]) -> None:
        self.blocks[(device, addr)] = {
            "size": size,
            "requested": requested,
            "frames": stack,
            "pending": False,
        }
        self._event(device, "alloc", size, stack, addr=addr)

    def free_requested(self, device: int, addr: int) -> None:
        block = self.blocks[(device, addr)]
        block["pending"] = True
        self._event(device, "free_requested", block["size"], block["frames"], addr=addr)

    def free_completed(self, device: int, addr: int) -> None:
        block = self.blocks.pop((device, addr))
        self._event(device, "free_completed", block["size"], block["frames"], addr=addr)

    def oom(self, device: int, size: int, device_free: int) -> None:
        self._event(device, "oom", size, frames("model.forward"), device_free=device_free)

    def snapshot(self) -> dict[str, Any]:
        segments = []
        for (device, seg_addr), seg in sorted(self.segments.items()):
            blocks: list[dict[str, Any]] = []
            cursor = seg_addr
            inside = sorted(
                (addr, b)
                for (d, addr), b in self.blocks.items()
                if d == device and seg_addr <= addr < seg_addr + seg["size"]
            )
            for addr, b in inside + [(seg_addr + seg["size"], None)]:
                if addr > cursor:
                    blocks.append(
                        {
                            "address": cursor,
                            "size": addr - cursor,
                            "requested_size": 0,
                            "state": "inactive",
                            "frames": [],
                        }
                    )
                if b is not None:
                    state = "active_pending_free" if b["pending"] else "active_allocated"
                    blocks.append(
                        {
                            "address": addr,
                            "size": b["size"],
                            "requested_size": b["requested"],
                            "state": state,
                            "frames": b["frames"],
                        }
                    )
                    cursor = addr + b["size"]
            allocated = [b for b in blocks if b["state"] == "active_allocated"]
            segments.append(
                {
                    "device": device,
                    "address": seg_addr,
                    "total_size": seg["size"],
                    "allocated_size": sum(b["size"] for b in allocated),
                    "active_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
                    "requested_size": sum(b["requested_size"] for b in allocated),
                    "stream": 0,
                    "segment_type": "large" if seg["size"] > MiB else "small",
                    "segment_pool_id": (0, 0),
                    "is_expandable": False,
                    "frames": seg["frames"],
                    "blocks": blocks,
                }
            )
        return {
            "segments": segments,
            "device_traces": copy.deepcopy(self.traces),
            "allocator_settings": {"max_split_size": -1, "expandable_segments": False},
        }


BASE0, BASE1 = 0x7F00_0000_0000, 0x7E00_0000_0000


def realistic_snapshot() -> dict[str, Any]:
    m = AllocatorModel(num_devices=2)
    fwd, bwd, opt = (
        frames("model.forward", "train.step"),
        frames("model.backward", "train.step"),
        frames("optim.step"),
    )
    small, large = BASE0, BASE0 + 0x1000_0000
    m.segment_alloc(0, small, 2 * MiB, fwd)
    m.alloc(0, small, 512, 400, fwd)
    m.alloc(0, small + 512, 512 * KiB, 500_000, fwd)
    m.segment_alloc(0, large, 20 * MiB, bwd)
    m.alloc(0, large, 8 * MiB, 8 * MiB, bwd)
    m.alloc(0, large + 8 * MiB, 4 * MiB, 4 * MiB - 100, bwd)
    m.free_requested(0, small + 512)
    m.free_completed(0, small + 512)
    m.alloc(0, small + 512, 256 * KiB, 256 * KiB, opt)
    m.free_requested(0, large + 8 * MiB)  # freed while another stream still uses it: stays pending
    m.oom(0, size=64 * 1024 * MiB, device_free=3 * MiB)
    m.traces[0].append({"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "frames": [], "time_us": 1})
    m.segment_alloc(1, BASE1, 4 * MiB, fwd)
    m.alloc(1, BASE1, MiB, MiB, fwd)
    m.free_requested(1, BASE1)
    m.free_completed(1, BASE1)
    m.segment_free(1, BASE1)
    m.segment_alloc(1, BASE1 + 0x100_0000, 2 * MiB, opt)
    m.alloc(1, BASE1 + 0x100_0000, 2 * MiB, 2 * MiB - 1, opt)
    return m.snapshot()


# --------------------------------------------------------------------------- the fake _C


class FakeLib:
    """The memory part of the ``_C`` contract; anything else is an error, so is initialising a device."""

    def __init__(self, device_count: int = 2) -> None:
        self.count = device_count
        self.current = 0
        self.calls: list[tuple[Any, ...]] = []
        self.stats = {d: nested_stats(scale=d + 1) for d in range(device_count)}
        self.snap = realistic_snapshot()

    def device_count(self) -> int:
        self.calls.append(("device_count",))
        return self.count

    def current_device(self) -> int:
        self.calls.append(("current_device",))
        return self.current

    def memory_stats(self, d: int) -> dict[str, Any]:
        self.calls.append(("memory_stats", d))
        return copy.deepcopy(self.stats[d])

    def reset_peak_stats(self, d: int) -> None:
        self.calls.append(("reset_peak_stats", d))

    def reset_accumulated_stats(self, d: int) -> None:
        self.calls.append(("reset_accumulated_stats", d))

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache",))

    def in_bad_fork(self) -> bool:  # read, not recorded: a forked child's stats are empty (as torch.cuda's)
        return False

    def mem_get_info(self, d: int) -> tuple[int, int]:
        self.calls.append(("mem_get_info", d))
        return (10 * MiB * (d + 1), 96 * 1024 * MiB)

    def snapshot(self) -> dict[str, Any]:
        self.calls.append(("snapshot",))
        return copy.deepcopy(self.snap)

    def record_memory_history(self, enabled: bool, record_context: bool, max_entries: int) -> None:
        self.calls.append(("record_memory_history", enabled, record_context, max_entries))

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"memory.py called C.{name}, which is outside the memory contract")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeLib:
    lib = FakeLib()
    monkeypatch.setattr(memory, "_lib", lambda: lib)
    return lib


# --------------------------------------------------------------------------- statistics


def test_memory_stats_is_flat_sorted_and_exact(fake: FakeLib) -> None:
    stats = memory.memory_stats(1)
    assert list(stats) == sorted(stats)
    assert len(stats) == 9 * 3 * 4 + len(COUNTERS) + 2 * 4
    assert stats["allocated_bytes.all.current"] == 2 * MiB * 401
    assert stats["allocation.small_pool.freed"] == 2 * (0 + 20 + 3 + 1)
    assert stats["oversize_segments.peak"] == 2 * 8
    assert stats["num_device_free"] == 2 * 5
    assert memory.memory_stats_as_nested_dict(1) == nested_stats(scale=2)


def test_memory_stats_joins_tuple_keys_like_torch_cuda(fake: FakeLib) -> None:
    fake.stats[0]["reserved_bytes_by_private_pools"] = {(1, 2): {"all": {"current": 5}}}
    assert memory.memory_stats(0)["reserved_bytes_by_private_pools.1_2.all.current"] == 5


def test_getters_read_the_right_stat(fake: FakeLib) -> None:
    stats = fake.stats[1]["allocated_bytes"]["all"], fake.stats[1]["reserved_bytes"]["all"]
    assert memory.memory_allocated("neuron:1") == stats[0]["current"]
    assert memory.max_memory_allocated(1) == stats[0]["peak"]
    assert memory.memory_reserved(1) == stats[1]["current"]
    assert memory.max_memory_reserved("neuron:1") == stats[1]["peak"]


def test_getters_are_zero_for_an_untouched_device(fake: FakeLib) -> None:
    fake.stats[0] = {}
    assert memory.memory_allocated(0) == memory.max_memory_reserved(0) == 0
    assert memory.memory_stats(0) == {}


def test_none_and_bare_type_mean_the_current_device(fake: FakeLib) -> None:
    fake.current = 1
    expected = fake.stats[1]["allocated_bytes"]["all"]["current"]
    assert memory.memory_allocated() == memory.memory_allocated("neuron") == expected
    assert memory._device_index(None) == 1


def test_reading_stats_never_touches_anything_but_stats(fake: FakeLib) -> None:
    memory.memory_stats()
    memory.memory_summary(1)
    memory.max_memory_reserved("neuron:0")
    assert {call[0] for call in fake.calls} == {"memory_stats", "current_device", "device_count"}


def test_resets_empty_cache_and_mem_get_info_forward_the_index(fake: FakeLib) -> None:
    memory.reset_peak_memory_stats("neuron:1")
    memory.reset_accumulated_memory_stats(0)
    with pytest.warns(FutureWarning, match="resets /all/ peak"):
        memory.reset_max_memory_allocated(1)
    memory.empty_cache()
    assert memory.mem_get_info(1) == (20 * MiB, 96 * 1024 * MiB)
    mutating = [c for c in fake.calls if c[0] not in ("device_count", "current_device")]
    assert mutating == [
        ("reset_peak_stats", 1),
        ("reset_accumulated_stats", 0),
        ("reset_peak_stats", 1),
        ("empty_cache",),
        ("mem_get_info", 1),
    ]


# --------------------------------------------------------------------------- device validation

def memory_snapshot_of(device: Any) -> Any:
    return memory.memory_snapshot(device=device)


DEVICE_FUNCTIONS = [
    memory.memory_stats,
    memory.memory_stats_as_nested_dict,
    memory.memory_allocated,
    memory.max_memory_allocated,
    memory.memory_reserved,
    memory.max_memory_reserved,
    memory.reset_peak_memory_stats,
    memory.reset_accumulated_memory_stats,
    memory.mem_get_info,
    memory.memory_summary,
    memory_snapshot_of,
    memory._snapshot,
    memory.get_per_process_memory_fraction,
]


@pytest.mark.parametrize("fn", DEVICE_FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("neuron:5", r"'neuron:5'.*out of range.*0\.\.1 \(2 neuron devices\)"),
        (2, r"'neuron:2'.*out of range.*0\.\.1"),
        (-1, r"'neuron:-1'.*out of range"),
        ("cuda:0", r"'cuda:0'.*device type 'cuda'"),
        (torch.device("cpu"), r"device\(type='cpu'\).*device type 'cpu'"),
    ],
)
def test_bad_devices_raise_value_error_naming_value_and_range(
    fake: FakeLib, fn: Any, device: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        fn(device)
    assert not [c for c in fake.calls if c[0] not in ("device_count", "current_device")]


@pytest.mark.parametrize("device", [1.0, [0], object()])
def test_non_devices_raise_value_error_as_cuda(fake: FakeLib, device: Any) -> None:
    # torch.cuda's _get_device_index raises ValueError for an object that is not a device or an index
    with pytest.raises(ValueError, match=re.escape(repr(device))):
        memory.memory_allocated(device)


def test_a_bool_is_not_a_device_index(fake: FakeLib) -> None:
    with pytest.raises(TypeError, match="bool True"):
        memory.memory_allocated(True)


@pytest.mark.parametrize("text", ["neuron:x", "neuron:01", " neuron:1", "neuron:1 ", "neuron:-1"])
def test_device_strings_are_parsed_by_torch_device(fake: FakeLib, text: str) -> None:
    # as torch.cuda's functions: the string goes through torch.device, which rejects these
    with pytest.raises(RuntimeError, match="Invalid device string"):
        memory.memory_allocated(text)
    with pytest.raises(RuntimeError, match="Invalid device string"):
        torch.device(text)


def test_a_neuron_device_context_object_is_a_device(fake: FakeLib) -> None:
    # torch.cuda's functions accept a torch.cuda.device (its .idx)
    from torchneuron_lab.device.neuron_module import device as neuron_device
    from torchneuron_lab.device.neuron_module import device_of

    assert memory._device_index(neuron_device(1)) == 1
    assert memory._device_index(neuron_device(None)) == fake.current
    assert memory._device_index(device_of(torch.empty(0))) == fake.current  # a CPU tensor: no device change


def test_no_devices_says_so(fake: FakeLib) -> None:
    fake.count = 0
    with pytest.raises(ValueError, match="no neuron devices are available"):
        memory.memory_stats(0)


def test_neuron_torch_device_is_accepted_when_the_backend_is_named(fake: FakeLib) -> None:
    try:
        device = torch.device("neuron", 1)
    except RuntimeError:
        pytest.skip("privateuse1 is not renamed to 'neuron' in this process")
    assert memory._device_index(device) == 1
    assert memory._device_index(torch.device("neuron")) == 0


# --------------------------------------------------------------------------- summary


def test_summary_table_shape_and_values(fake: FakeLib) -> None:
    fake.stats[1]["allocated_bytes"]["all"].update(
        current=3 * MiB, peak=5 * MiB, allocated=7 * MiB, freed=4 * MiB
    )
    fake.stats[1]["allocated_bytes"]["large_pool"].update(
        current=3 * MiB, peak=4 * MiB, allocated=6 * MiB, freed=3 * MiB
    )
    fake.stats[1]["allocated_bytes"]["small_pool"].update(current=0, peak=MiB, allocated=MiB, freed=MiB)
    fake.stats[1]["num_ooms"], fake.stats[1]["num_alloc_retries"] = 3, 4
    text = memory.memory_summary("neuron:1")
    lines = text.splitlines()
    assert text.endswith("|\n")
    assert all(len(line) == 77 and line[0] == line[-1] == "|" for line in lines)
    assert len(lines) == 6 + 9 * 4 + 2 * 2 + 1
    assert "PyTorch neuron memory summary, device ID 1" in lines[1]
    assert re.search(r"Neuron OOMs: 3 +\| +device alloc retries: 4", lines[3])
    row = lines.index(next(line for line in lines if "Allocated memory" in line))
    cells = [c.strip() for c in lines[row].strip("|").split("|")]
    assert cells == ["Allocated memory", "3072 KiB", "5120 KiB", "7168 KiB", "4096 KiB"]
    cells = [c.strip() for c in lines[row + 2].strip("|").split("|")]
    assert cells == ["from small pool", "0 KiB", "1024 KiB", "1024 KiB", "1024 KiB"]
    for label in (
        "Active memory",
        "Requested memory",
        "Reserved memory",
        "Non-releasable memory",
        "Allocations",
        "Active allocs",
        "Reserved segments",
        "Non-releasable allocs",
        "Oversize allocations",
        "Oversize segments",
    ):
        assert sum(label in line for line in lines) == 1, label


def test_abbreviated_summary_has_only_all_pool_rows(fake: FakeLib) -> None:
    lines = memory.memory_summary(0, abbreviated=True).splitlines()
    assert len(lines) == 6 + 9 * 2 + 2 * 2 + 1
    assert not any("pool" in line for line in lines)


@pytest.mark.parametrize(
    ("value", "kind", "expected"),
    [
        (0, "bytes", "0 B"),
        (786_431, "bytes", "786431 B"),
        (786_432, "bytes", "768 KiB"),
        (96 * 1024**3, "bytes", "98304 MiB"),
        (768 * 1024**3, "bytes", "768 GiB"),
        (749_999, "count", "749999 "),
        (750_000, "count", "750 K"),
        (3_000_000_000, "count", "3000 M"),
    ],
)
def test_summary_cells_scale_units(value: int, kind: str, expected: str) -> None:
    assert memory._cell(value, value, kind) == expected


# --------------------------------------------------------------------------- history and snapshots


def test_record_memory_history_signature_matches_torch_cuda() -> None:
    ours = list(inspect.signature(memory._record_memory_history).parameters)
    theirs = list(inspect.signature(torch.cuda.memory._record_memory_history).parameters)
    assert ours == theirs


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, (True, True, sys.maxsize)),
        ({"enabled": "all", "max_entries": 1000}, (True, True, 1000)),
        ({"enabled": "state", "max_entries": 1000}, (True, True, 1)),
        ({"enabled": "all", "context": None}, (True, False, sys.maxsize)),
        ({"enabled": None}, (False, True, 1)),
        # a bool takes torch.cuda's older arguments: state only unless trace_alloc_max_entries > 1
        ({"enabled": True}, (True, True, 1)),
        ({"enabled": True, "trace_alloc_max_entries": 5}, (True, True, 5)),
        ({"enabled": True, "record_context": False}, (True, False, 1)),
        ({"enabled": True, "record_context": False, "trace_alloc_max_entries": 9,
          "trace_alloc_record_context": True}, (True, True, 9)),
        ({"enabled": False}, (False, True, 1)),
    ],
)
def test_record_memory_history_maps_to_c(
    fake: FakeLib, kwargs: dict[str, Any], expected: tuple[Any, ...]
) -> None:
    memory._record_memory_history(**kwargs)
    assert fake.calls[-1] == ("record_memory_history", *expected)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"enabled": "everything"}, ValueError, "'everything'"),
        ({"context": "some"}, ValueError, "'some'"),
        ({"stacks": "cpp"}, ValueError, "'cpp'"),
        ({"max_entries": 0}, ValueError, "positive int"),
        ({"device": "neuron:7"}, ValueError, "'neuron:7'"),
        ({"clear_history": True}, NotImplementedError, "clear_history"),
        ({"enabled": False, "clear_history": True}, NotImplementedError, "clear_history"),  # the older form too
        ({"enabled": True, "clear_history": True}, NotImplementedError, "clear_history"),
        ({"skip_actions": ["alloc"]}, NotImplementedError, "skip_actions"),
    ],
)
def test_record_memory_history_rejects_bad_options(
    fake: FakeLib, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        memory._record_memory_history(**kwargs)
    assert not [c for c in fake.calls if c[0] == "record_memory_history"]


def test_snapshot_and_memory_snapshot(fake: FakeLib) -> None:
    assert memory._snapshot() == fake.snap
    assert memory._snapshot("neuron:1") == fake.snap
    assert memory.memory_snapshot() == fake.snap["segments"]
    on_1 = memory.memory_snapshot(device=1)
    assert on_1 and all(seg["device"] == 1 for seg in on_1)
    assert len(on_1) + len(memory.memory_snapshot(device=0)) == len(fake.snap["segments"])
    # torch.cuda's signature: memory_snapshot(mempool_id=None, include_traces=True)
    assert list(inspect.signature(memory.memory_snapshot).parameters)[:2] == list(
        inspect.signature(torch.cuda.memory_snapshot).parameters)
    assert memory.memory_snapshot(1) == on_1  # a device in the first place: this API's older form
    with pytest.raises(TypeError, match="a memory pool id"):
        memory.memory_snapshot([0, 1])
    with pytest.raises(NotImplementedError, match="no private memory pools"):
        memory.memory_snapshot((0, 1))
    # as CUDA's: include_traces concerns the history, which the segments list does not hold
    assert memory.memory_snapshot(include_traces=False) == fake.snap["segments"]
    assert memory.memory_snapshot((0, 0)) == fake.snap["segments"]  # the default pool's id


# Opcodes the MemoryViz.js unpickler implements; anything else makes the viewer throw.
JS_PICKLE_OPCODES = {
    "PROTO", "FRAME", "MARK", "STOP", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "DICT", "LIST", "TUPLE",
    "TUPLE1", "TUPLE2", "TUPLE3", "SETITEM", "SETITEMS", "APPEND", "APPENDS", "BININT", "BININT1",
    "BININT2", "LONG1", "BINFLOAT", "NONE", "NEWTRUE", "NEWFALSE", "SHORT_BINUNICODE", "BINUNICODE",
    "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET", "MEMOIZE",
}  # fmt: skip


def test_dump_snapshot_pickles_what_the_viewer_can_read(fake: FakeLib, tmp_path: Any) -> None:
    path = tmp_path / "snap.pickle"
    memory._dump_snapshot(str(path))
    data = path.read_bytes()
    assert pickle.loads(data) == fake.snap
    ops = list(pickletools.genops(data))
    assert ops[0][0].name == "PROTO" and ops[0][1] == memory.SNAPSHOT_PICKLE_PROTOCOL == 4
    assert {op.name for op, _arg, _pos in ops} <= JS_PICKLE_OPCODES


def test_dump_snapshot_default_filename(
    fake: FakeLib, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    memory._dump_snapshot()
    assert pickle.loads((tmp_path / "dump_snapshot.pickle").read_bytes()) == fake.snap


# --------------------------------------------------------------------------- the format, through _memory_viz


def test_realistic_snapshot_is_consistent() -> None:
    assert memory._snapshot_problems(realistic_snapshot()) == []


def test_snapshot_problems_catches_what_breaks_the_viewer() -> None:
    snap = realistic_snapshot()
    snap["segments"][0]["blocks"][0]["size"] += 1
    assert any("blocks cover" in p for p in memory._snapshot_problems(snap))

    snap = realistic_snapshot()
    trace = snap["device_traces"][0]
    trace[0], trace[1] = trace[1], trace[0]  # alloc recorded before its segment exists
    assert any(
        "block 0x7f0000000000 lies outside every segment" in p for p in memory._snapshot_problems(snap)
    )

    snap = realistic_snapshot()
    snap["device_traces"][1] = [e for e in snap["device_traces"][1] if e["action"] != "segment_free"]
    assert memory._snapshot_problems(snap) == [
        "device_traces[1][3]: before this free_completed, block 0x7e0000000000 lies outside every segment"
    ]

    snap = realistic_snapshot()
    snap["device_traces"][1].insert(0, dict(snap["device_traces"][1][0], addr=BASE1 + 0x900_0000))
    assert memory._snapshot_problems(snap) == [
        "device_traces[1][0]: segment_alloc of 0x7e0009000000, which is not a segment at that point"
    ]

    snap = realistic_snapshot()
    snap["device_traces"].pop()
    assert any("no device_traces entry" in p for p in memory._snapshot_problems(snap))

    snap = realistic_snapshot()
    snap["segments"][0]["blocks"][1]["state"] = "active_awaiting_free"
    assert any("state 'active_awaiting_free'" in p for p in memory._snapshot_problems(snap))


def _embedded_snapshot(html: str) -> Any:
    files = json.loads(re.search(r"const local_files = (\[.*\])", html).group(1))  # type: ignore[union-attr]
    return pickle.loads(base64.b64decode(files[0]["base64"]))


def test_memory_viz_plots_accept_the_snapshot(fake: FakeLib) -> None:
    snap = memory._snapshot()
    segment_html = _memory_viz.segment_plot(snap)
    assert "Allocator State History" in segment_html
    assert _embedded_snapshot(segment_html) == fake.snap
    trace_html = _memory_viz.trace_plot(snap)
    assert "Active Memory Timeline" in trace_html and _embedded_snapshot(trace_html) == fake.snap
    assert "Active Cached Memory Timeline" in _memory_viz.trace_plot(snap, plot_segments=True)

    filtered = _embedded_snapshot(_memory_viz.trace_plot(copy.deepcopy(snap), filter_freed=True))
    # alloc/free_requested pairs and their free_completed go; live allocs, oom and snapshot stay
    assert [e["action"] for e in filtered["device_traces"][0]] == [
        "segment_alloc", "alloc", "segment_alloc", "alloc", "alloc", "oom", "snapshot",
    ]  # fmt: skip


def test_memory_viz_text_reports_accept_the_snapshot(
    fake: FakeLib, capsys: pytest.CaptureFixture[str]
) -> None:
    snap = memory._snapshot()
    summary = _memory_viz.segsum(snap)  # asserts the per-segment byte accounting itself
    assert "segments: 3" in summary
    assert "total_reserved: 24.0MiB" in summary

    trace = _memory_viz.trace(snap)
    assert "Device 0 ----" in trace and "Device 1 ----" in trace
    assert "raise OutOfMemoryError # 64.0GiB requested, 3.0MiB free" in trace

    flame = _memory_viz.segments(snap, format_flamegraph=lambda lines: lines)
    assert (
        f"stream_0;seg_{BASE0};active_allocated;train.py:11:train.step;model.py:10:model.forward 400" in flame
    )
    by_stream = _memory_viz.memory(snap, format_flamegraph=lambda lines: lines)
    total = sum(int(line.rsplit(" ", 1)[1]) for line in by_stream.splitlines())
    assert total == sum(seg["total_size"] for seg in snap["segments"])

    before = snap["segments"]
    after = [seg for seg in before if seg["device"] == 0]
    diff = _memory_viz.compare(before, after, format_flamegraph=lambda lines: lines)
    assert all(line.startswith("only_before;") for line in diff.splitlines())
    assert "only_after = []" in capsys.readouterr().out


def test_snapshot_with_a_frame_whose_file_name_is_not_utf8() -> None:
    # a script whose file name has undecodable bytes (any Linux path may): PyTorch's symbolizer refuses the whole
    # batch of stacks (torch.cuda's _snapshot raises); here only that frame's stack is replaced, by one saying why
    g: dict = {}
    exec(compile("import torch\ndef alloc():\n    return torch.empty(1024, device='neuron')\n",  # noqa: S102
                 "/tmp/bad\udcffname.py", "exec"), g)

    def alloc_here() -> torch.Tensor:
        return torch.empty(2048, device="neuron")

    N = torch.neuron
    N.memory._record_memory_history(max_entries=1000)
    try:
        bad, good = g["alloc"](), alloc_here()
        snap = N.memory._snapshot()
        assert N.memory_snapshot()  # the other readers of the same state
    finally:
        N.memory._record_memory_history(None)
    blocks = {b["address"]: b for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"}
    bad_frames = blocks[bad.data_ptr()]["frames"]
    assert [f["name"] for f in bad_frames] == ["?"] and "not valid UTF-8" in bad_frames[0]["filename"]
    good_frames = blocks[good.data_ptr()]["frames"]
    assert any(f["name"] == "alloc_here" and f["filename"] == __file__ for f in good_frames), good_frames
    del bad, good
