"""Why an allocation failed: a pure function of the allocator's state at the out-of-memory error.

The emulated device's caching allocator follows CUDA's: requests are rounded to 512 bytes; requests of
at most 1 MiB are served from the *small pool* (2 MiB segments), larger ones from the *large pool*
(20 MiB segments for requests under 10 MiB, else the request rounded up to 2 MiB). A free block of one
pool never serves a request of the other, and a new segment needs ``capacity - reserved`` bytes of
never-reserved device memory. Before raising, the allocator has already returned every wholly free
cached segment to the device (as CUDA's does).

:func:`diagnose_oom` takes the figures the allocator records at the error (``requested``,
``allocated``, ``reserved``, ``capacity``, ``largest_free_block``) and returns one of four causes, each
with the advice that fixes it:

``request_exceeds_capacity``  the request alone is larger than the device;
``pool_policy``               a cached free block is large enough, but it belongs to the other pool;
``fragmentation``             enough bytes are free in total, but no free piece is large enough;
``device_full``               live tensors plus the request exceed the capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OomDiagnosis", "diagnose_oom", "external_fragmentation", "round_request", "segment_for"]

# The allocator's size rules (torchneuron_lab/device/csrc/allocator.cpp: kMinBlockSize, kSmallSize,
# kSmallBuffer, kLargeBuffer, kMinLargeAlloc, kRoundLarge), as torch.cuda's CUDACachingAllocator has them.
MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_request(n: int) -> int:
    """The block size a request of ``n`` bytes occupies (a multiple of 512 bytes)."""
    return MIN_BLOCK if n < MIN_BLOCK else MIN_BLOCK * ((n + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_for(n: int) -> int:
    """The size of the new segment a request of ``n`` bytes needs when no cached block fits."""
    size = round_request(n)
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


def external_fragmentation(free_blocks: list[int]) -> float:
    """Share of cached free bytes outside the largest free block: 0.0 when all free bytes form one piece
    (an almost empty segment is not fragmented), near 1.0 when they are scattered in small pieces."""
    total = sum(free_blocks)
    return 0.0 if total <= 0 else 1.0 - max(free_blocks) / total


@dataclass(frozen=True)
class OomDiagnosis:
    """``cause`` (one of the four names above), a one-line ``explanation`` and the ``advice`` that fixes it."""

    cause: str
    explanation: str
    advice: str

    def __str__(self) -> str:
        return f"{self.explanation}. Fix: {self.advice}"


def _fmt(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def diagnose_oom(requested: int, allocated: int, reserved: int, capacity: int,
                 largest_free_block: int) -> OomDiagnosis:
    """The cause of an out-of-memory error from the allocator's state at that moment (pure; see module doc)."""
    if min(requested, allocated, reserved, capacity, largest_free_block) < 0:
        raise ValueError("allocator figures must be >= 0, got "
                         f"{(requested, allocated, reserved, capacity, largest_free_block)}")
    size = round_request(requested)
    pool = "small" if size <= SMALL_SIZE else "large"
    other = "large" if pool == "small" else "small"
    never_reserved = max(capacity - reserved, 0)
    cached_free = max(reserved - allocated, 0)
    if requested > capacity:
        return OomDiagnosis(
            "request_exceeds_capacity",
            f"the request ({_fmt(requested)}) is larger than the device's whole capacity ({_fmt(capacity)})",
            "make the tensor smaller: a smaller batch or sequence length, a lower precision (bfloat16), or "
            "split the work (chunk the batch, shard the model across neuron devices)",
        )
    if largest_free_block >= size:
        return OomDiagnosis(
            "pool_policy",
            f"a cached free block of {_fmt(largest_free_block)} would hold the {_fmt(size)} request, but it "
            f"belongs to the {other} pool, and {pool}-pool requests are served only from {pool}-pool "
            f"segments; a new {_fmt(segment_for(requested))} segment needs more than the "
            f"{_fmt(never_reserved)} never reserved",
            f"free the tensors that keep the {other}-pool segment partly used and call "
            "torch.neuron.empty_cache() so its memory can be reserved again, or create this tensor before "
            "the large ones",
        )
    if never_reserved + cached_free >= size:
        return OomDiagnosis(
            "fragmentation",
            f"{_fmt(never_reserved + cached_free)} is free in total ({_fmt(cached_free)} cached in partly "
            f"used segments, {_fmt(never_reserved)} never reserved), but the largest free piece is "
            f"{_fmt(max(largest_free_block, never_reserved))} and a {_fmt(size)} block (new segment: "
            f"{_fmt(segment_for(requested))}) does not fit",
            "allocate long-lived large tensors first and temporaries after, reuse buffers (out=, in-place), or "
            "free the tensors pinning the partly used segments and call torch.neuron.empty_cache()",
        )
    return OomDiagnosis(
        "device_full",
        f"live tensors hold {_fmt(allocated)} of {_fmt(capacity)} and the request needs {_fmt(size)} more",
        "free what is no longer needed (del tensors, optimizer.zero_grad(set_to_none=True)), use a smaller "
        "batch, activation checkpointing (torch.utils.checkpoint) or a lower precision",
    )
