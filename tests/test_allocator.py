"""The caching allocator of the emulated neuron HBM, checked by exact statistic deltas.

Sizes follow CUDA's caching allocator: requests round up to 512 bytes; requests <= 1 MiB come from
the small pool (2 MiB segments); larger requests below 10 MiB from 20 MiB large-pool segments; from
10 MiB on, a segment of the request rounded up to 2 MiB. Freed blocks stay cached (reserved) until
``empty_cache``.

Tests that need a device with nothing allocated use the ``dev`` fixture, which frees what earlier
tests left behind and fails loudly if a neuron tensor is still alive somewhere.
"""

from __future__ import annotations

import gc
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.cuda import _memory_viz

import torchneuron_lab
from tests._neuron_child import run_child
from torchneuron_lab.device import memory as neuron_memory
from torchneuron_lab.device._backend import lib

KiB, MiB = 1024, 1024 * 1024
THIS_FILE = Path(__file__).name


def _stats(d: int) -> dict[str, int]:
    return dict(torch.neuron.memory_stats(d))


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def _bytes(n: int, d: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, device=f"neuron:{d}")


@pytest.fixture
def dev() -> Iterator[int]:
    """A neuron device with no live blocks and no cached segments; history recording off."""
    torch.neuron.memory._record_memory_history(enabled=None)
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):  # a failed test's frames
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()
    torch.neuron.empty_cache()
    d = 1
    live = [(b["size"], b["frames"][:2]) for s in torch.neuron.memory_snapshot(d) for b in s["blocks"]]
    assert torch.neuron.memory_reserved(d) == 0, f"neuron:{d} still holds live blocks: {live}"
    torch.neuron.reset_peak_memory_stats(d)
    torch.neuron.reset_accumulated_memory_stats(d)
    yield d
    torch.neuron.memory._record_memory_history(enabled=None)


# --------------------------------------------------------------------------- small pool


def test_small_allocation_rounds_to_512_and_reserves_a_2mib_segment(dev: int) -> None:
    before = _stats(dev)
    t = _bytes(1000, dev)
    assert _delta(before, _stats(dev)) == {
        "allocation.all.current": 1, "allocation.all.peak": 1, "allocation.all.allocated": 1,
        "allocation.small_pool.current": 1, "allocation.small_pool.peak": 1, "allocation.small_pool.allocated": 1,
        "active.all.current": 1, "active.all.peak": 1, "active.all.allocated": 1,
        "active.small_pool.current": 1, "active.small_pool.peak": 1, "active.small_pool.allocated": 1,
        "segment.all.current": 1, "segment.all.peak": 1, "segment.all.allocated": 1,
        "segment.small_pool.current": 1, "segment.small_pool.peak": 1, "segment.small_pool.allocated": 1,
        "allocated_bytes.all.current": 1024, "allocated_bytes.all.peak": 1024, "allocated_bytes.all.allocated": 1024,
        "allocated_bytes.small_pool.current": 1024, "allocated_bytes.small_pool.peak": 1024,
        "allocated_bytes.small_pool.allocated": 1024,
        "active_bytes.all.current": 1024, "active_bytes.all.peak": 1024, "active_bytes.all.allocated": 1024,
        "active_bytes.small_pool.current": 1024, "active_bytes.small_pool.peak": 1024,
        "active_bytes.small_pool.allocated": 1024,
        "requested_bytes.all.current": 1000, "requested_bytes.all.peak": 1000, "requested_bytes.all.allocated": 1000,
        "requested_bytes.small_pool.current": 1000, "requested_bytes.small_pool.peak": 1000,
        "requested_bytes.small_pool.allocated": 1000,
        "reserved_bytes.all.current": 2 * MiB, "reserved_bytes.all.peak": 2 * MiB,
        "reserved_bytes.all.allocated": 2 * MiB,
        "reserved_bytes.small_pool.current": 2 * MiB, "reserved_bytes.small_pool.peak": 2 * MiB,
        "reserved_bytes.small_pool.allocated": 2 * MiB,
        # the rest of the segment is a cached, split-off block
        "inactive_split.all.current": 1, "inactive_split.all.peak": 1, "inactive_split.all.allocated": 1,
        "inactive_split.small_pool.current": 1, "inactive_split.small_pool.peak": 1,
        "inactive_split.small_pool.allocated": 1,
        "inactive_split_bytes.all.current": 2 * MiB - 1024, "inactive_split_bytes.all.peak": 2 * MiB - 1024,
        "inactive_split_bytes.all.allocated": 2 * MiB - 1024,
        "inactive_split_bytes.small_pool.current": 2 * MiB - 1024,
        "inactive_split_bytes.small_pool.peak": 2 * MiB - 1024,
        "inactive_split_bytes.small_pool.allocated": 2 * MiB - 1024,
        "num_device_alloc": 1,
    }  # fmt: skip
    assert torch.neuron.memory_allocated(dev) == 1024
    assert torch.neuron.memory_reserved(dev) == 2 * MiB
    assert t.untyped_storage().nbytes() == 1000


def test_free_keeps_the_segment_cached(dev: int) -> None:
    t = _bytes(1000, dev)
    before = _stats(dev)
    del t
    delta = _delta(before, _stats(dev))
    assert delta == {
        "allocation.all.current": -1, "allocation.all.freed": 1,
        "allocation.small_pool.current": -1, "allocation.small_pool.freed": 1,
        "active.all.current": -1, "active.all.freed": 1,
        "active.small_pool.current": -1, "active.small_pool.freed": 1,
        "allocated_bytes.all.current": -1024, "allocated_bytes.all.freed": 1024,
        "allocated_bytes.small_pool.current": -1024, "allocated_bytes.small_pool.freed": 1024,
        "active_bytes.all.current": -1024, "active_bytes.all.freed": 1024,
        "active_bytes.small_pool.current": -1024, "active_bytes.small_pool.freed": 1024,
        "requested_bytes.all.current": -1000, "requested_bytes.all.freed": 1000,
        "requested_bytes.small_pool.current": -1000, "requested_bytes.small_pool.freed": 1000,
        # the freed block merges with the split-off rest: no split block is left
        "inactive_split.all.current": -1, "inactive_split.all.freed": 1,
        "inactive_split.small_pool.current": -1, "inactive_split.small_pool.freed": 1,
        "inactive_split_bytes.all.current": -(2 * MiB - 1024), "inactive_split_bytes.all.freed": 2 * MiB - 1024,
        "inactive_split_bytes.small_pool.current": -(2 * MiB - 1024),
        "inactive_split_bytes.small_pool.freed": 2 * MiB - 1024,
    }  # fmt: skip
    assert torch.neuron.memory_allocated(dev) == 0
    assert torch.neuron.memory_reserved(dev) == 2 * MiB  # cached, not returned


def test_cached_block_is_reused(dev: int) -> None:
    t = _bytes(1000, dev)
    ptr = t.data_ptr()
    del t
    before = _stats(dev)
    u = _bytes(700, dev)  # also rounds to 1024
    assert u.data_ptr() == ptr
    delta = _delta(before, _stats(dev))
    assert "num_device_alloc" not in delta and "segment.all.current" not in delta
    assert delta["allocated_bytes.all.current"] == 1024
    assert delta["requested_bytes.all.current"] == 700
    assert torch.neuron.memory_reserved(dev) == 2 * MiB


def test_blocks_are_carved_from_one_segment_in_address_order(dev: int) -> None:
    a = _bytes(1000, dev)
    b = _bytes(512, dev)
    c = _bytes(1, dev)
    assert b.data_ptr() == a.data_ptr() + 1024
    assert c.data_ptr() == b.data_ptr() + 512
    stats = _stats(dev)
    assert stats["segment.small_pool.current"] == 1
    assert stats["allocated_bytes.small_pool.current"] == 1024 + 512 + 512
    assert stats["requested_bytes.small_pool.current"] == 1000 + 512 + 1
    (seg,) = torch.neuron.memory_snapshot(dev)
    assert seg["segment_type"] == "small" and seg["total_size"] == 2 * MiB
    assert [(blk["state"], blk["size"]) for blk in seg["blocks"]] == [
        ("active_allocated", 1024),
        ("active_allocated", 512),
        ("active_allocated", 512),
        ("inactive", 2 * MiB - 2048),
    ]
    del b  # a hole between a and c: an inactive split block
    stats = _stats(dev)
    assert stats["inactive_split.small_pool.current"] == 2
    assert stats["inactive_split_bytes.small_pool.current"] == 512 + 2 * MiB - 2048
    d = _bytes(300, dev)  # best fit: the 512-byte hole
    assert d.data_ptr() == a.data_ptr() + 1024
    assert a.numel() + c.numel() + d.numel() == 1301


def test_zero_byte_tensors_allocate_nothing(dev: int) -> None:
    before = _stats(dev)
    t = torch.empty(0, device=f"neuron:{dev}")
    assert _delta(before, _stats(dev)) == {}
    assert t.numel() == 0


# --------------------------------------------------------------------------- large pool


def test_large_allocation_reserves_a_20mib_large_pool_segment(dev: int) -> None:
    before = _stats(dev)
    t = _bytes(3 * MiB, dev)
    delta = _delta(before, _stats(dev))
    assert delta["allocated_bytes.large_pool.current"] == 3 * MiB
    assert delta["reserved_bytes.large_pool.current"] == 20 * MiB
    assert delta["segment.large_pool.current"] == 1
    assert "segment.small_pool.current" not in delta
    assert delta["inactive_split_bytes.large_pool.current"] == 17 * MiB
    assert torch.neuron.memory_reserved(dev) == 20 * MiB
    u = _bytes(5 * MiB, dev)  # fits in the same segment
    assert u.data_ptr() == t.data_ptr() + 3 * MiB
    assert torch.neuron.memory_reserved(dev) == 20 * MiB
    assert _stats(dev)["num_device_alloc"] - before["num_device_alloc"] == 1


def test_just_over_1mib_goes_to_the_large_pool(dev: int) -> None:
    small = _bytes(1 * MiB, dev)
    large = _bytes(1 * MiB + 1, dev)
    stats = _stats(dev)
    assert stats["allocated_bytes.small_pool.current"] == 1 * MiB
    assert stats["allocated_bytes.large_pool.current"] == 1 * MiB + 512
    assert stats["reserved_bytes.small_pool.current"] == 2 * MiB
    assert stats["reserved_bytes.large_pool.current"] == 20 * MiB
    assert small.numel() + large.numel() == 2 * MiB + 1


def test_over_10mib_gets_its_own_segment_rounded_to_2mib(dev: int) -> None:
    before = _stats(dev)
    t = _bytes(11 * MiB + 1, dev)
    delta = _delta(before, _stats(dev))
    # the 1 MiB - 512 B left over is not worth a split (large pool splits only > 1 MiB remainders)
    assert delta["allocated_bytes.large_pool.current"] == 12 * MiB
    assert delta["requested_bytes.large_pool.current"] == 11 * MiB + 1
    assert delta["reserved_bytes.large_pool.current"] == 12 * MiB
    assert delta["segment.large_pool.current"] == 1
    (seg,) = torch.neuron.memory_snapshot(dev)
    assert seg["total_size"] == 12 * MiB
    assert seg["address"] == t.data_ptr()
    assert [(b["size"], b["requested_size"]) for b in seg["blocks"]] == [(12 * MiB, 11 * MiB + 1)]
    del t
    u = _bytes(10 * MiB, dev)  # the cached 12 MiB block serves a 10 MiB request: still one segment
    assert torch.neuron.memory_reserved(dev) == 12 * MiB
    assert u.numel() == 10 * MiB


# --------------------------------------------------------------------------- peaks and resets


def test_peaks_and_reset_peak_memory_stats(dev: int) -> None:
    a = _bytes(4 * KiB, dev)
    b = _bytes(4 * KiB, dev)
    c = _bytes(8 * KiB, dev)
    del b, c
    assert torch.neuron.memory_allocated(dev) == 4 * KiB
    assert torch.neuron.max_memory_allocated(dev) == 16 * KiB
    assert _stats(dev)["allocation.all.peak"] == 3
    assert torch.neuron.max_memory_reserved(dev) == 2 * MiB
    torch.neuron.reset_peak_memory_stats(dev)
    stats = _stats(dev)
    assert torch.neuron.max_memory_allocated(dev) == 4 * KiB
    assert stats["allocation.all.peak"] == 1
    peaks = {k: v for k, v in stats.items() if k.endswith(".peak")}
    assert all(v == stats[k[: -len("peak")] + "current"] for k, v in peaks.items())
    d = _bytes(1 * KiB, dev)
    assert torch.neuron.max_memory_allocated(dev) == 5 * KiB
    assert a.numel() + d.numel() == 5 * KiB


def test_reset_max_memory_allocated_warns_like_cuda(dev: int) -> None:
    with pytest.warns(FutureWarning, match="reset_peak_memory_stats"):
        torch.neuron.reset_max_memory_allocated(dev)


def test_reset_accumulated_memory_stats(dev: int) -> None:
    a = _bytes(1000, dev)
    b = _bytes(2000, dev)
    del b
    stats = _stats(dev)
    assert stats["allocation.all.allocated"] == 2 and stats["allocation.all.freed"] == 1
    assert stats["allocated_bytes.all.allocated"] == 1024 + 2048
    assert stats["allocated_bytes.all.freed"] == 2048
    torch.neuron.reset_accumulated_memory_stats(dev)
    stats = _stats(dev)
    accumulated = {k: v for k, v in stats.items() if k.endswith((".allocated", ".freed"))}
    assert set(accumulated.values()) == {0}
    assert stats["num_ooms"] == 0 and stats["num_alloc_retries"] == 0
    assert stats["allocated_bytes.all.current"] == 1024  # current values untouched
    assert stats["reserved_bytes.all.current"] == 2 * MiB
    del a
    stats = _stats(dev)
    assert stats["allocated_bytes.all.freed"] == 1024 and stats["allocated_bytes.all.allocated"] == 0


# --------------------------------------------------------------------------- empty_cache and mem_get_info


def test_empty_cache_returns_everything_when_nothing_is_live(dev: int) -> None:
    a = _bytes(1000, dev)
    b = _bytes(3 * MiB, dev)
    c = _bytes(18 * MiB, dev)  # more than the 17 MiB left in b's segment: a segment of its own
    assert torch.neuron.memory_reserved(dev) == 2 * MiB + 20 * MiB + 18 * MiB
    del a, b, c
    assert torch.neuron.memory_reserved(dev) == 40 * MiB
    before = _stats(dev)
    torch.neuron.empty_cache()
    after = _stats(dev)
    assert after["reserved_bytes.all.current"] == 0
    assert after["segment.all.current"] == 0
    assert after["num_device_free"] - before["num_device_free"] == 3
    assert after["reserved_bytes.all.freed"] - before["reserved_bytes.all.freed"] == 40 * MiB
    assert torch.neuron.memory_snapshot(dev) == []
    assert torch.neuron.mem_get_info(dev) == (torch.neuron.mem_get_info(dev)[1],) * 2


def test_empty_cache_keeps_segments_with_live_blocks(dev: int) -> None:
    keep = _bytes(1000, dev)
    gone = _bytes(3 * MiB, dev)
    del gone
    torch.neuron.empty_cache()
    stats = _stats(dev)
    assert stats["reserved_bytes.all.current"] == 2 * MiB
    assert stats["reserved_bytes.large_pool.current"] == 0
    assert stats["allocated_bytes.all.current"] == 1024
    assert keep.data_ptr() != 0


def test_mem_get_info_is_capacity_minus_reserved(dev: int) -> None:
    capacity = lib().capacity(dev)
    assert capacity == torchneuron_lab.device.current_config()["hbm_bytes"]
    assert torch.neuron.mem_get_info(dev) == (capacity, capacity)
    t = _bytes(3 * MiB, dev)
    assert torch.neuron.mem_get_info(dev) == (capacity - 20 * MiB, capacity)
    del t
    assert torch.neuron.mem_get_info(dev) == (capacity - 20 * MiB, capacity)  # cached still counts as used
    torch.neuron.empty_cache()
    assert torch.neuron.mem_get_info(dev) == (capacity, capacity)


def test_devices_have_separate_allocators(dev: int) -> None:
    other = 1 - dev
    before_other = _stats(other)
    t = _bytes(5000, dev)
    assert _stats(other) == before_other
    assert torch.neuron.memory_allocated(dev) == 5120
    assert t.device.index == dev


def test_op_outputs_are_allocated_on_the_inputs_device(dev: int) -> None:
    x = torch.ones(1000, device=f"neuron:{dev}")  # 4000 -> 4096
    before = _stats(dev)
    y = x * 2  # output: another 4096-byte block
    assert torch.neuron.memory_allocated(dev) - before["allocated_bytes.all.current"] == 4096
    del y
    assert torch.neuron.memory_allocated(dev) == before["allocated_bytes.all.current"]
    assert x.sum().item() == 1000.0


# --------------------------------------------------------------------------- stats keys and summary

POOL_STATS = (
    "allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes", "active_bytes",
    "inactive_split_bytes", "requested_bytes",
)  # fmt: skip
COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
            "max_split_size")  # fmt: skip


def expected_stat_keys() -> set[str]:
    """torch.cuda.memory_stats key names (notes/snapshot_format.md section 3)."""
    keys = {f"{s}.{p}.{m}" for s in POOL_STATS for p in ("all", "large_pool", "small_pool")
            for m in ("allocated", "current", "freed", "peak")}  # fmt: skip
    keys |= set(COUNTERS)
    keys |= {f"{s}.{m}" for s in ("oversize_allocations", "oversize_segments")
             for m in ("allocated", "current", "freed", "peak")}  # fmt: skip
    return keys


def test_memory_stats_keys_are_torch_cudas() -> None:
    torch.empty(1, device="neuron")  # the device's allocator exists
    stats = torch.neuron.memory_stats(0)
    assert len(expected_stat_keys()) == 122
    assert set(stats) == expected_stat_keys()
    assert list(stats) == sorted(stats)
    assert all(type(v) is int for v in stats.values())
    assert stats["max_split_size"] == -1
    torch.neuron.empty_cache()  # CUDA's synchronize_and_free_events: one sync of all streams
    assert torch.neuron.memory_stats(0)["num_sync_all_streams"] == stats["num_sync_all_streams"] + 1


def test_nested_stats_have_cudas_shape() -> None:
    nested = torch.neuron.memory_stats_as_nested_dict(0)
    for s in POOL_STATS:
        assert set(nested[s]) == {"all", "large_pool", "small_pool"}
        for pool in nested[s].values():
            assert set(pool) == {"current", "peak", "allocated", "freed"}
    flat = torch.neuron.memory_stats(0)
    assert nested["allocated_bytes"]["all"]["current"] == flat["allocated_bytes.all.current"]


def test_memory_summary_shows_the_stats(dev: int) -> None:
    t = _bytes(3 * MiB, dev)
    text = torch.neuron.memory_summary(dev)
    assert f"PyTorch neuron memory summary, device ID {dev}" in text
    assert "Neuron OOMs: 0" in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.count("|") >= 5}
    assert rows["Allocated memory"].split("|")[2].strip() == "3072 KiB"
    assert rows["Reserved memory"].split("|")[2].strip() == "20480 KiB"
    abbreviated = torch.neuron.memory_summary(dev, abbreviated=True)
    assert "from large pool" not in abbreviated and "from large pool" in text
    assert t.numel() == 3 * MiB


# --------------------------------------------------------------------------- untouched devices


def test_reading_stats_does_not_initialise_a_device() -> None:
    facts = run_child(
        """
        import json
        import torch, torchneuron_lab
        C = torchneuron_lab.device._backend.lib()
        stats = torch.neuron.memory_stats(1)
        out = {
            "nonzero": {k: v for k, v in stats.items() if v != 0 and k != "max_split_size"},
            "n_keys": len(stats),
            "allocated": torch.neuron.memory_allocated(1),
            "reserved": torch.neuron.max_memory_reserved("neuron:1"),
            "info": list(torch.neuron.mem_get_info(1)),
            "summary_ok": "device ID 1" in torch.neuron.memory_summary(1),
            "segments": torch.neuron.memory_snapshot(),
        }
        torch.neuron.reset_peak_memory_stats(1)
        torch.neuron.reset_accumulated_memory_stats(1)
        torch.neuron.empty_cache()
        torch.neuron.synchronize(1)
        torch.neuron.get_rng_state(1)
        out["initialized"] = torch.neuron.is_initialized()
        out["started"] = C.runtime_started()
        out["configure_still_allowed"] = torchneuron_lab.device.configure(num_devices=3)["num_devices"]
        print(json.dumps(out))
        """
    )
    assert facts["nonzero"] == {}
    assert facts["n_keys"] == 122
    assert facts["allocated"] == 0 and facts["reserved"] == 0
    assert facts["info"][0] == facts["info"][1] > 0
    assert facts["summary_ok"] is True
    assert facts["segments"] == []
    assert facts["initialized"] is False
    assert facts["started"] is False
    assert facts["configure_still_allowed"] == 3


# --------------------------------------------------------------------------- OOM

OOM_SCRIPT = """
import json
import torch, torchneuron_lab
from torch.cuda import _memory_viz
from torchneuron_lab.device import memory as M
C = torchneuron_lab.device._backend.lib()
MiB = 1 << 20
out = {"capacity": C.capacity(0), "config": torchneuron_lab.device.current_config()["hbm_bytes"]}
torch.neuron.memory._record_memory_history()
keep = []
def fill():
    while True:
        keep.append(torch.empty(5 * MiB, dtype=torch.uint8, device="neuron"))
try:
    fill()
except torch.OutOfMemoryError as e:
    out["error_type"] = type(e).__name__
    out["is_runtime_error"] = isinstance(e, RuntimeError)
    out["message"] = str(e)
out["n_before_oom"] = len(keep)
s = torch.neuron.memory_stats()
out["after_oom"] = {k: s[k] for k in ("num_ooms", "num_alloc_retries", "allocated_bytes.all.current",
                                      "reserved_bytes.all.current", "allocation.all.current", "segment.all.current")}
oom = C.last_oom(0)
out["last_oom"] = {k: oom[k] for k in ("requested", "allocated", "reserved", "capacity", "largest_free_block")}
out["last_oom_frames"] = [f["name"] for f in oom["frames"]]
out["last_oom_message_same"] = oom["message"] == out["message"]
out["last_oom_other_device"] = C.last_oom(1)
snap = torch.neuron.memory._snapshot()
out["oom_entries"] = [
    {k: e[k] for k in ("size", "device_free") if k in e} | {"has_addr": "addr" in e}
    for e in snap["device_traces"][0] if e["action"] == "oom"
]
out["problems_after_oom"] = M._snapshot_problems(snap)
out["trace_text_ok"] = "OutOfMemoryError" in _memory_viz.trace(snap)
keep.clear()
s = torch.neuron.memory_stats()
out["after_free"] = {"allocated": s["allocated_bytes.all.current"], "reserved": s["reserved_bytes.all.current"]}
big = torch.empty(30 * MiB, dtype=torch.uint8, device="neuron")  # needs the cached segments released
big.fill_(7)
s = torch.neuron.memory_stats()
out["after_big"] = {"allocated": s["allocated_bytes.all.current"], "reserved": s["reserved_bytes.all.current"],
                    "num_alloc_retries": s["num_alloc_retries"], "num_ooms": s["num_ooms"],
                    "ends": [big[0].item(), big[-1].item()]}
a = torch.ones(8 * MiB, device="neuron")   # 32 MiB: 30 + 32 = 62 <= 64
try:
    b = a * 2                               # the kernel's output needs 32 MiB more
except torch.OutOfMemoryError as e:
    out["kernel_oom"] = str(e)
out["kernel_oom_num_ooms"] = torch.neuron.memory_stats()["num_ooms"]
out["usable_after_kernel_oom"] = (a[:4] + 1).sum().item()
out["problems_end"] = M._snapshot_problems(torch.neuron.memory._snapshot())
torch.neuron.reset_accumulated_memory_stats()
out["num_ooms_after_reset"] = torch.neuron.memory_stats()["num_ooms"]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def oom_facts() -> dict[str, object]:
    return run_child(OOM_SCRIPT, env={"TORCHNEURON_LAB_HBM_BYTES": str(64 * MiB)})


def test_hbm_env_sets_the_capacity(oom_facts: dict) -> None:
    assert oom_facts["capacity"] == oom_facts["config"] == 64 * MiB


def test_oom_raises_torch_out_of_memory_error_at_capacity(oom_facts: dict) -> None:
    assert oom_facts["error_type"] == "OutOfMemoryError"
    assert oom_facts["is_runtime_error"] is True
    # 5 MiB blocks, four per 20 MiB segment; three segments fit in 64 MiB, the fourth does not
    assert oom_facts["n_before_oom"] == 12


def test_oom_message_gives_requested_allocated_free_capacity_and_a_hint(oom_facts: dict) -> None:
    msg = oom_facts["message"]
    assert "Tried to allocate 5.00 MiB" in msg
    assert "needs a new 20.00 MiB segment" in msg
    assert "neuron:0 has a total capacity of 64.00 MiB of which 4.00 MiB is free" in msg
    assert "60.00 MiB is allocated by PyTorch" in msg
    assert "0 bytes is reserved by PyTorch but unallocated" in msg
    assert "torch.neuron.empty_cache()" in msg
    assert "TORCHNEURON_LAB_HBM_BYTES" in msg


def test_oom_stats_are_consistent(oom_facts: dict) -> None:
    assert oom_facts["after_oom"] == {
        "num_ooms": 1,
        "num_alloc_retries": 1,
        "allocated_bytes.all.current": 60 * MiB,
        "reserved_bytes.all.current": 60 * MiB,
        "allocation.all.current": 12,
        "segment.all.current": 3,
    }


def test_last_oom_records_the_state(oom_facts: dict) -> None:
    assert oom_facts["last_oom"] == {
        "requested": 5 * MiB,
        "allocated": 60 * MiB,
        "reserved": 60 * MiB,
        "capacity": 64 * MiB,
        "largest_free_block": 0,
    }
    assert oom_facts["last_oom_message_same"] is True
    assert oom_facts["last_oom_frames"][0] == "fill"  # innermost first, recorded with history on
    assert oom_facts["last_oom_other_device"] is None


def test_oom_history_entry_has_cudas_fields(oom_facts: dict) -> None:
    assert oom_facts["oom_entries"] == [{"size": 5 * MiB, "device_free": 4 * MiB, "has_addr": False}]
    assert oom_facts["problems_after_oom"] == []
    assert oom_facts["trace_text_ok"] is True


def test_allocator_is_usable_after_oom(oom_facts: dict) -> None:
    assert oom_facts["after_free"] == {"allocated": 0, "reserved": 60 * MiB}
    assert oom_facts["after_big"] == {
        "allocated": 30 * MiB,
        "reserved": 30 * MiB,  # the three cached 20 MiB segments were released to make room
        "num_alloc_retries": 2,
        "num_ooms": 1,
        "ends": [7, 7],
    }
    assert oom_facts["problems_end"] == []


def test_oom_inside_a_kernel_keeps_its_type(oom_facts: dict) -> None:
    assert "Tried to allocate 32.00 MiB" in oom_facts["kernel_oom"]
    assert oom_facts["kernel_oom_num_ooms"] == 2
    assert oom_facts["usable_after_kernel_oom"] == 8.0
    assert oom_facts["num_ooms_after_reset"] == 0


# --------------------------------------------------------------------------- memory history and snapshots


def _alloc_and_free_for_history(d: int) -> tuple[torch.Tensor, int]:
    keep = _bytes(3000, d)
    gone = _bytes(5000, d)
    gone_ptr = gone.data_ptr()
    del gone
    return keep, gone_ptr


def _frame_hits(frames: list[dict], function: str) -> bool:
    return any(f["filename"].endswith(THIS_FILE) and f["name"] == function for f in frames)


def test_record_memory_history_snapshot(dev: int, tmp_path: Path) -> None:
    torch.neuron.memory._record_memory_history(max_entries=1000)
    keep, gone_ptr = _alloc_and_free_for_history(dev)
    snap = torch.neuron.memory._snapshot()
    torch.neuron.memory._record_memory_history(enabled=None)

    assert set(snap) >= {"segments", "device_traces", "allocator_settings"}
    assert len(snap["device_traces"]) == torch.neuron.device_count()
    segs = [s for s in snap["segments"] if s["device"] == dev]
    assert len(segs) == 1
    (seg,) = segs
    assert seg["segment_type"] == "small" and seg["total_size"] == 2 * MiB
    assert seg["allocated_size"] == 3072 and seg["requested_size"] == 3000
    live = [b for b in seg["blocks"] if b["state"] == "active_allocated"]
    assert [(b["address"], b["size"], b["requested_size"]) for b in live] == [(keep.data_ptr(), 3072, 3000)]
    assert _frame_hits(live[0]["frames"], "_alloc_and_free_for_history")
    # innermost first: the helper that called torch.empty, then its caller
    assert [f["name"] for f in live[0]["frames"][:3]] == [
        "_bytes", "_alloc_and_free_for_history", "test_record_memory_history_snapshot",
    ]  # fmt: skip

    trace = snap["device_traces"][dev]
    actions = [(e["action"], e["size"]) for e in trace]
    assert actions == [
        ("segment_alloc", 2 * MiB),
        ("alloc", 3072),
        ("alloc", 5120),
        ("free_requested", 5120),
        ("free_completed", 5120),
    ]
    assert trace[1]["addr"] == keep.data_ptr()
    assert trace[2]["addr"] == trace[4]["addr"] == gone_ptr
    for e in trace:
        assert _frame_hits(e["frames"], "_alloc_and_free_for_history"), e
        assert _frame_hits(e["frames"], "test_record_memory_history_snapshot"), e
        assert isinstance(e["time_us"], int) and e["stream"] == 0
    assert [e["time_us"] for e in trace] == sorted(e["time_us"] for e in trace)

    assert neuron_memory._snapshot_problems(snap) == []

    seg_html = _memory_viz.segment_plot(snap)
    trace_html = _memory_viz.trace_plot(snap)
    assert isinstance(seg_html, str) and isinstance(trace_html, str)
    assert "<html" in seg_html.lower() or "<script" in seg_html.lower()
    assert len(trace_html) > 1000
    summary = _memory_viz.segsum(snap)
    assert "total_reserved" in summary

    path = tmp_path / "snap.pickle"
    torch.neuron.memory._dump_snapshot(str(path))
    raw = path.read_bytes()
    assert raw[:2] == b"\x80\x04"  # pickle protocol 4: what MemoryViz.js reads
    dumped = pickle.loads(raw)
    assert set(dumped) == set(snap)
    assert [s["address"] for s in dumped["segments"]] == [
        s["address"] for s in torch.neuron.memory._snapshot()["segments"]
    ]


def test_history_off_records_no_trace(dev: int) -> None:
    t = _bytes(1000, dev)
    snap = torch.neuron.memory._snapshot()
    assert snap["device_traces"][dev] == []
    (seg,) = [s for s in snap["segments"] if s["device"] == dev]
    assert seg["blocks"][0]["frames"] == []  # no context recorded
    assert t.numel() == 1000


def test_history_ring_buffer_keeps_the_last_entries(dev: int) -> None:
    torch.neuron.memory._record_memory_history(max_entries=4)
    for _ in range(10):
        _bytes(100, dev)
    snap = torch.neuron.memory._snapshot()
    torch.neuron.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][dev]
    assert len(trace) == 4
    # 1 segment_alloc + 10 x (alloc, free_requested, free_completed): the last four survive
    assert [e["action"] for e in trace] == ["free_completed", "alloc", "free_requested", "free_completed"]
    assert trace[1]["size"] == 512


def test_history_with_empty_cache_stays_consistent(dev: int) -> None:
    torch.neuron.memory._record_memory_history()
    a = _bytes(3 * MiB, dev)
    b = _bytes(100, dev)
    del a
    torch.neuron.empty_cache()
    c = _bytes(12 * MiB, dev)
    snap = torch.neuron.memory._snapshot()
    torch.neuron.memory._record_memory_history(enabled=None)
    actions = [e["action"] for e in snap["device_traces"][dev]]
    assert actions.count("segment_alloc") == 3
    assert actions.count("segment_free") == 1
    assert neuron_memory._snapshot_problems(snap) == []
    _memory_viz.trace_plot(snap)
    assert b.numel() + c.numel() == 100 + 12 * MiB


def test_memory_snapshot_filters_by_device(dev: int) -> None:
    t = _bytes(1000, dev)
    mine = torch.neuron.memory_snapshot(dev)
    assert [s["device"] for s in mine] == [dev]
    assert all(s["device"] in (0, 1) for s in torch.neuron.memory_snapshot())
    assert mine[0]["blocks"][0]["address"] == t.data_ptr()
