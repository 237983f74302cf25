"""The out-of-memory diagnosis is a pure function of the allocator state, right for each of its seven causes.

Each cause is checked twice: on hand-written figures (the pure function), and on the state a real
emulated device reaches in a fresh process with a small HBM (the figures the allocator records at the
error, read back through ``%neuron_memory``'s result object).
"""

from __future__ import annotations

import pytest

from tests._neuron_child import run_child
from torchneuron_lab.tracing.oom import diagnose_oom, external_fragmentation, round_request, segment_for

MiB = 1 << 20


def test_size_rules() -> None:
    assert [round_request(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert segment_for(1) == 2 * MiB and segment_for(MiB) == 2 * MiB
    assert segment_for(MiB + 1) == 20 * MiB and segment_for(9 * MiB) == 20 * MiB
    assert segment_for(10 * MiB) == 10 * MiB and segment_for(11 * MiB + 1) == 12 * MiB


def test_fragmentation_metric_is_about_pieces_not_emptiness() -> None:
    assert external_fragmentation([]) == 0.0
    assert external_fragmentation([2 * MiB - 80 * 1024]) == 0.0  # an almost empty segment: one piece
    assert external_fragmentation([MiB, MiB, 2 * MiB]) == 0.5


@pytest.mark.parametrize(
    ("figures", "cause"),
    [
        # requested, allocated, reserved, capacity, largest free block
        ((300 * MiB, 0, 0, 256 * MiB, 0), "request_exceeds_capacity"),
        ((MiB, 4 * MiB, 20 * MiB, 21 * MiB, 16 * MiB), "pool_policy"),
        ((9 * MiB, 6 * MiB, 20 * MiB, 30 * MiB, 8 * MiB), "fragmentation"),
        ((4 * MiB, 30 * MiB, 30 * MiB, 32 * MiB, 0), "device_full"),
        # with the figures the allocator records since 2026-12-05 (limit, other stream, other pool)
        ((8 * MiB, 44 * MiB, 56 * MiB, 64 * MiB, 8 * MiB, 64 * MiB, 8 * MiB, 0), "stream_ownership"),
        ((MiB, 4 * MiB, 20 * MiB, 21 * MiB, 16 * MiB, 21 * MiB, 0, 16 * MiB), "pool_policy"),
        ((16 * MiB, 20 * MiB, 20 * MiB, 64 * MiB, 0, 32 * MiB, 0, 0), "memory_fraction"),
        ((40 * MiB, 0, 0, 64 * MiB, 0, 32 * MiB, 0, 0), "memory_fraction"),
        ((2 * MiB, 60 * MiB, 60 * MiB, 64 * MiB, 0, 64 * MiB, 0, 0), "segment_size"),
        ((9 * MiB, 6 * MiB, 20 * MiB, 30 * MiB, 8 * MiB, 30 * MiB, 0, 0), "fragmentation"),
        ((4 * MiB, 30 * MiB, 30 * MiB, 32 * MiB, 0, 32 * MiB, 0, 0), "device_full"),
    ],
)
def test_pure_causes(figures: tuple[int, ...], cause: str) -> None:
    if len(figures) > 5:
        limit, other_stream, other_pool = figures[5:]
        d = diagnose_oom(*figures[:5], limit=limit, largest_other_stream=other_stream, largest_other_pool=other_pool)
    else:
        d = diagnose_oom(*figures)
    assert d.cause == cause
    assert d.advice and d.explanation and "Fix:" in str(d)


def test_full_device_is_not_called_full_when_request_is_larger_than_device() -> None:
    # the case: 204 of 256 MiB free, request larger than the device
    d = diagnose_oom(300 * MiB, 52 * MiB, 52 * MiB, 256 * MiB, 0)
    assert d.cause == "request_exceeds_capacity" and "256.00 MiB" in d.explanation


def test_bad_figures_raise() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        diagnose_oom(-1, 0, 0, MiB, 0)


_SCENARIOS = {
    "request_exceeds_capacity": (64, "keep = []\nbad = lambda: torch.empty(100 << 20, dtype=torch.uint8, device='neuron')"),
    "pool_policy": (21, "keep = [torch.empty(4 << 20, dtype=torch.uint8, device='neuron')]\n"
                        "bad = lambda: torch.empty(512 << 10, dtype=torch.uint8, device='neuron')"),
    "fragmentation": (30, "xs = [torch.empty(6 << 20, dtype=torch.uint8, device='neuron') for _ in range(3)]\n"
                          "keep = [xs[1]]\ndel xs\n"
                          "bad = lambda: torch.empty(9 << 20, dtype=torch.uint8, device='neuron')"),
    "device_full": (32, "keep = [torch.empty(30 << 20, dtype=torch.uint8, device='neuron')]\n"
                        "bad = lambda: torch.empty(4 << 20, dtype=torch.uint8, device='neuron')"),
    # called pool_policy: the free block was the large pool's, but another stream's
    "stream_ownership": (64, ("E = lambda n: torch.empty(n, dtype=torch.uint8, device='neuron')\n"
                              "s = torch.neuron.Stream()\n"
                              "with torch.neuron.stream(s):\n    a = E(8 << 20); b = E(8 << 20)\n"
                              "del a\nkeep = [b] + [E(12 << 20) for _ in range(3)]\ntorch.neuron.synchronize()\n"
                              "bad = lambda: E(8 << 20)")),
    # called fragmentation, "the largest free piece is 44 MiB and a 16 MiB block does not fit"
    "memory_fraction": (64, ("torch.neuron.set_per_process_memory_fraction(0.5)\n"
                             "keep = [torch.empty(20 << 20, dtype=torch.uint8, device='neuron')]\n"
                             "bad = lambda: torch.empty(16 << 20, dtype=torch.uint8, device='neuron')")),
    # called fragmentation with no cached free block at all
    "segment_size": (64, ("keep = [torch.empty(12 << 20, dtype=torch.uint8, device='neuron') for _ in range(5)]\n"
                          "bad = lambda: torch.empty(2 << 20, dtype=torch.uint8, device='neuron')")),
}


@pytest.mark.parametrize("cause", sorted(_SCENARIOS))
def test_real_allocator_states(cause: str) -> None:
    hbm_mib, setup = _SCENARIOS[cause]
    out = run_child(
        f"""
        import json, torch, torchneuron_lab
        from torchneuron_lab.extension import helpers
        {setup.replace(chr(10), chr(10) + '        ')}
        try:
            bad()
            raise SystemExit("no OOM")
        except torch.OutOfMemoryError as e:
            msg = str(e)
        res = helpers.memory(0, False, False, False, None, None)
        d = res.oom_diagnosis
        print(json.dumps({{"cause": d.cause, "text": str(res), "frag": res.fragmentation}}))
        """,
        env={"TORCHNEURON_LAB_HBM_BYTES": f"{hbm_mib}MiB"},
    )
    assert out["cause"] == cause, out["text"]
    assert f"cause ({cause})" in out["text"] and "fix:" in out["text"]
    if cause == "fragmentation":
        assert out["frag"] > 0.0
    else:
        assert "fragmentation" not in out["text"].split("cause (")[1].split(")")[0]
