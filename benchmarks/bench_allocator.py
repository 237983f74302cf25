"""Caching-allocator costs on the emulated neuron device, measured side by side with CPU.

Issue 2 asks for alloc+free of a cached block reported in ns per pair. Measured here:

- ``x = torch.empty(1024, device="neuron"); del x`` vs ``x = torch.empty(1024); del x`` (the pair the
  issue names: a 4 KiB small-pool block that the caching allocator hands back every time), plus the same
  with a ``torch.device`` object on both sides, a 4 MiB large-pool block, and ``torch.UntypedStorage``
  (no tensor wrapper: the closest Python gets to the raw allocator);
- that the neuron side really hit the cache: no device (segment) allocation during the timed blocks;
- the cost of reading the allocator statistics (``torch.neuron.memory_stats()`` and friends).

    python benchmarks/bench_allocator.py [--quick] [--json out.json] [--threads N] [--strict]
"""

from __future__ import annotations

import sys

import torch
from _common import Report, base_parser, calibrate, interleave, make_loop, setup

# key, label, cpu statement, neuron statement (names: cpu_dev, dev)
PAIRS = [
    (
        "alloc_free.empty_1024",
        'torch.empty(1024[, device="neuron"]); del  (4 KiB)',
        "x = torch.empty(1024)\ndel x",
        'x = torch.empty(1024, device="neuron")\ndel x',
    ),
    (
        "alloc_free.empty_1024_devobj",
        "torch.empty(1024, device=<torch.device>); del",
        "x = torch.empty(1024, device=cpu_dev)\ndel x",
        "x = torch.empty(1024, device=dev)\ndel x",
    ),
    (
        "alloc_free.empty_4MiB",
        "torch.empty(1 << 20, device=<torch.device>); del (4 MiB)",
        "x = torch.empty(1048576, device=cpu_dev)\ndel x",
        "x = torch.empty(1048576, device=dev)\ndel x",
    ),
    (
        "alloc_free.storage_4KiB",
        "torch.UntypedStorage(4096, device=<torch.device>); del",
        "s = torch.UntypedStorage(4096, device=cpu_dev)\ndel s",
        "s = torch.UntypedStorage(4096, device=dev)\ndel s",
    ),
]

# key, label, statement
STATS_READS = [
    (
        "stats.memory_stats",
        "torch.neuron.memory_stats()  (flat dict, cuda key names)",
        "torch.neuron.memory_stats()",
    ),
    (
        "stats.memory_stats_nested",
        "torch.neuron.memory_stats_as_nested_dict()",
        "torch.neuron.memory_stats_as_nested_dict()",
    ),
    ("stats.memory_allocated", "torch.neuron.memory_allocated()", "torch.neuron.memory_allocated()"),
    ("stats.memory_reserved", "torch.neuron.memory_reserved()", "torch.neuron.memory_reserved()"),
    ("stats.C_memory_stats", "lib().memory_stats(0)  (C++ core, nested dict)", "_C.memory_stats(0)"),
]


def _device_allocs(C: object) -> int:
    return int(C.memory_stats(0)["num_device_alloc"])  # type: ignore[attr-defined]


def main() -> int:
    ap = base_parser(__doc__.splitlines()[0])
    args = ap.parse_args()
    setup(args)
    from torchneuron_lab.device._backend import lib

    C = lib()
    quick = args.quick
    rounds = args.rounds or (3 if quick else 31)
    target_s = 0.002 if quick else 0.03

    rep = Report("bench_allocator", args)
    rep.header("caching allocator: alloc+free of a cached block, neuron vs CPU")

    env = {"dev": torch.device("neuron", 0), "cpu_dev": torch.device("cpu")}
    # Prime the cache: one block of each size exists (and is freed) before anything is timed.
    for stmt in [p[3] for p in PAIRS]:
        make_loop(stmt, env)(2)

    allocs: dict[str, int] = {}
    for key, label, cpu_stmt, dev_stmt in PAIRS:
        loops = {"cpu": make_loop(cpu_stmt, env), "neuron": make_loop(dev_stmt, env)}
        calibrate(loops["neuron"], target_s)
        n = calibrate(loops["cpu"], target_s)
        before = _device_allocs(C)
        sides = interleave(loops, n, rounds)
        allocs[key] = _device_allocs(C) - before
        row = rep.compare(key, label, sides["cpu"], sides["neuron"], n)
        row["neuron_device_allocs_during_timing"] = allocs[key]
        row["neuron_pairs_timed"] = n * (rounds + 1)  # + the warm-up block
    torch.neuron.empty_cache()

    print("ns per alloc+free pair")
    rep.print_compare_table(rep.rows, unit="ns")
    print(
        "neuron device (segment) allocations during the timed blocks (0 = every pair reused a cached block):"
    )
    for r in rep.ratios:
        k = r["key"]
        verdict = "cached" if allocs[k] == 0 else "NOT CACHED: new segments while timing"
        print(f"  {k:<30} {allocs[k]:>8} device allocs / {r['neuron_pairs_timed']:>8} pairs  -> {verdict}")
    rep.extra["device_allocs_during_timing"] = allocs
    print()

    # ---- reading the statistics: a single side, ns per call
    stats_env = {"_C": C}
    stat_rows = []
    for key, label, stmt in STATS_READS:
        loop = make_loop(stmt, stats_env, sync="")
        n = calibrate(loop, target_s)
        side = interleave({"x": loop}, n, rounds)["x"]
        stat_rows.append(rep.single(key, label, side, n))
    w = max(len(r["label"]) for r in stat_rows)
    print("reading the allocator statistics (ns per call)")
    hdr = f"{'call':<{w}}  {'median':>10} {'min':>10}  {'iters x rounds':>14}"
    print(hdr)
    print("-" * len(hdr))
    for r in stat_rows:
        v = r["value"]
        print(
            f"{r['label']:<{w}}  {v['median_ns']:>7.0f} ns {v['min_ns']:>7.0f} ns  {r['iters_per_block']:>7} x {r['rounds']}"
        )
    print()

    for r in rep.ratios:
        print(
            f"PAIR {r['key']} neuron = {r['neuron']['median_ns']:.0f} ns/pair, cpu = {r['cpu']['median_ns']:.0f} ns/pair"
        )
    for r in stat_rows:
        print(f"CALL {r['key']} = {r['value']['median_ns']:.0f} ns/call")
    rep.print_ratio_lines(rep.ratios)
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
