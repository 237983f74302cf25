"""Why an allocation failed: a pure function of the allocator's state at the out-of-memory error.

The emulated device's caching allocator follows CUDA's: requests are rounded to 512 bytes; requests of
at most 1 MiB are served from the *small pool* (2 MiB segments), larger ones from the *large pool*
(20 MiB segments for requests under 10 MiB, else the request rounded up to 2 MiB). A free block of one
pool never serves a request of the other, and a new segment needs ``capacity - reserved`` bytes of
never-reserved device memory. Before raising, the allocator has already returned every wholly free
cached segment to the device (as CUDA's does).

:func:`diagnose_oom` takes the figures the allocator records at the error (``requested``,
``allocated``, ``reserved``, ``capacity``, ``largest_free_block``; and, from the allocator of 2026-12-05 on,
the per-process ``limit`` and the largest cached free block by why it could not serve the request) and
returns one of seven causes, each with the advice that fixes it:

``request_exceeds_capacity``  the request alone is larger than the device;
``memory_fraction``           the per-process limit (``set_per_process_memory_fraction``), not the device, is
                              what a new segment would exceed;
``stream_ownership``          a cached free block of the request's pool is large enough, but it belongs to
                              another stream (a block is reused only on its stream, as CUDA's);
``pool_policy``               a cached free block is large enough, but it belongs to the other pool;
``segment_size``              the request would fit in the memory not yet reserved, but the new segment it
                              needs (2 or 20 MiB) does not, and no cached block holds it;
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


def diagnose_oom(requested: int, allocated: int, reserved: int, capacity: int, largest_free_block: int, *,
                 limit: int | None = None, largest_other_stream: int = 0,
                 largest_other_pool: int | None = None) -> OomDiagnosis:
    """The cause of an out-of-memory error from the allocator's state at that moment (pure; see module doc).

    ``limit``: what this process may reserve (``capacity`` unless a memory fraction is set);
    ``largest_other_stream``: the largest cached free block of the request's pool that belongs to another
    stream; ``largest_other_pool``: the largest one of the other pool (``None``: figures from an allocator that
    did not tell them apart, when ``largest_free_block`` stands for it).
    """
    figures = (requested, allocated, reserved, capacity, largest_free_block, largest_other_stream)
    if min(figures) < 0 or (limit is not None and limit < 0) or (largest_other_pool or 0) < 0:
        raise ValueError(f"allocator figures must be >= 0, got {figures + (limit, largest_other_pool)}")
    size = round_request(requested)
    seg = segment_for(requested)
    pool = "small" if size <= SMALL_SIZE else "large"
    other = "large" if pool == "small" else "small"
    limit = capacity if limit is None else min(limit, capacity)
    never_reserved = max(capacity - reserved, 0)
    reservable = max(limit - reserved, 0)  # what this process may still reserve
    cached_free = max(reserved - allocated, 0)
    other_pool = largest_free_block if largest_other_pool is None else largest_other_pool
    fraction_advice = ("raise the limit (torch.neuron.set_per_process_memory_fraction) or free what is no "
                       "longer needed and call torch.neuron.empty_cache()")
    if requested > capacity:
        return OomDiagnosis(
            "request_exceeds_capacity",
            f"the request ({_fmt(requested)}) is larger than the device's whole capacity ({_fmt(capacity)})",
            "make the tensor smaller: a smaller batch or sequence length, a lower precision (bfloat16), or "
            "split the work (chunk the batch, shard the model across neuron devices)",
        )
    if requested > limit:
        return OomDiagnosis(
            "memory_fraction",
            f"the request ({_fmt(requested)}) is larger than what this process may reserve ({_fmt(limit)} of the "
            f"device's {_fmt(capacity)}: torch.neuron.set_per_process_memory_fraction)",
            fraction_advice,
        )
    if largest_other_stream >= size:
        return OomDiagnosis(
            "stream_ownership",
            f"a cached free block of {_fmt(largest_other_stream)} in the {pool} pool would hold the {_fmt(size)} "
            f"request, but it belongs to another stream (a freed block is reused only on the stream it was "
            f"allocated on, as CUDA's allocator does), and a new {_fmt(seg)} segment needs more than the "
            f"{_fmt(reservable)} that may still be reserved",
            "allocate on the stream that freed the memory, or synchronize and call torch.neuron.empty_cache() to "
            "return wholly free segments; Tensor.record_stream marks a tensor used on another stream",
        )
    if other_pool >= size:
        return OomDiagnosis(
            "pool_policy",
            f"a cached free block of {_fmt(other_pool)} would hold the {_fmt(size)} request, but it "
            f"belongs to the {other} pool, and {pool}-pool requests are served only from {pool}-pool "
            f"segments; a new {_fmt(seg)} segment needs more than the "
            f"{_fmt(reservable)} that may still be reserved",
            f"free the tensors that keep the {other}-pool segment partly used and call "
            "torch.neuron.empty_cache() so its memory can be reserved again, or create this tensor before "
            "the large ones",
        )
    if cached_free >= size:
        return OomDiagnosis(
            "fragmentation",
            f"{_fmt(cached_free)} is cached free in partly used segments, more than the {_fmt(size)} request, "
            f"but in pieces: the largest is {_fmt(largest_free_block)}, and a new {_fmt(seg)} segment needs more "
            f"than the {_fmt(reservable)} that may still be reserved",
            "allocate long-lived large tensors first and temporaries after, reuse buffers (out=, in-place), or "
            "free the tensors pinning the partly used segments and call torch.neuron.empty_cache()",
        )
    if reservable < seg <= never_reserved:
        return OomDiagnosis(
            "memory_fraction",
            f"a new {_fmt(seg)} segment for the {_fmt(size)} request would fit in the {_fmt(never_reserved)} of the "
            f"device never reserved, but this process may reserve only {_fmt(limit)} of {_fmt(capacity)} "
            f"(torch.neuron.set_per_process_memory_fraction) and has {_fmt(reserved)} reserved",
            fraction_advice,
        )
    if size <= reservable < seg:
        return OomDiagnosis(
            "segment_size",
            f"the {_fmt(size)} request would fit in the {_fmt(reservable)} that may still be reserved, but no cached "
            f"free block holds it and a {pool}-pool request needs a whole new {_fmt(seg)} segment",
            "free what is no longer needed and call torch.neuron.empty_cache() (cached segments are released "
            "only when wholly free), or allocate the long-lived tensors first so the segments fill up",
        )
    return OomDiagnosis(
        "device_full",
        f"live tensors hold {_fmt(allocated)} of {_fmt(capacity)} and the request needs {_fmt(size)} more",
        "free what is no longer needed (del tensors, optimizer.zero_grad(set_to_none=True)), use a smaller "
        "batch, activation checkpointing (torch.utils.checkpoint) or a lower precision",
    )
