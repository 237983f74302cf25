"""Eager per-op time on the emulated neuron device vs the same op on CPU, measured side by side.

Bars (issue 2): ``a + 1`` on 64x64 float32 <= 1.3x CPU, on 1024x1024 <= 1.1x CPU. Also reported
(no bar): mm 256x256, relu 1024x1024, sum 1024x1024, and what the kernel recorder adds per op on the
neuron ``a + 1`` 64x64 path (recording off vs on with shapes, vs on with Python stacks).

    python benchmarks/bench_eager_ops.py [--quick] [--json out.json] [--threads N] [--strict]
"""

from __future__ import annotations

import sys

import torch
from _common import Report, base_parser, calibrate, interleave, make_loop, setup

# key, label, shapes of the inputs, statement (inputs are named a, b), bar or None
CASES: list[tuple[str, str, list[tuple[int, ...]], str, float | None]] = [
    ("eager.add_64x64", "a + 1      64x64     f32", [(64, 64)], "a + 1", 1.3),
    ("eager.add_1024x1024", "a + 1      1024x1024 f32", [(1024, 1024)], "a + 1", 1.1),
    ("eager.mm_256x256", "a @ b (mm) 256x256   f32", [(256, 256), (256, 256)], "torch.mm(a, b)", None),
    ("eager.relu_1024x1024", "relu(a)    1024x1024 f32", [(1024, 1024)], "torch.relu(a)", None),
    ("eager.sum_1024x1024", "a.sum()    1024x1024 f32", [(1024, 1024)], "a.sum()", None),
]

RECORDER_CAPACITY = 1 << 17


def main() -> int:
    ap = base_parser(__doc__.splitlines()[0])
    args = ap.parse_args()
    setup(args)
    from torchneuron_lab.device._backend import lib

    C = lib()
    quick = args.quick
    rounds = args.rounds or (3 if quick else 31)
    target_s = 0.002 if quick else 0.03

    rep = Report("bench_eager_ops", args)
    rep.header("eager per-op time: neuron vs CPU (float32)")

    was_recording = bool(C.recorder_enabled())
    C.recorder_stop()

    # ---- neuron vs CPU per op
    unspread_rows: list[dict] = []
    for key, label, shapes, stmt, bar in CASES:
        cpu_in = [torch.randn(*s) for s in shapes]
        dev_in = [t.to("neuron") for t in cpu_in]
        names = ["a", "b"][: len(shapes)]
        loops = {
            "cpu": make_loop(stmt, dict(zip(names, cpu_in))),
            "neuron": make_loop(stmt, dict(zip(names, dev_in))),
        }
        unspread = make_loop(stmt, dict(zip(names, dev_in)))

        def unspread_loop(n: int, _inner=unspread) -> float:
            C.set_pool_spread(False)  # a new pool's helpers left where libgomp put them
            try:
                return _inner(n)
            finally:
                C.set_pool_spread(True)

        loops["neuron_unspread"] = unspread_loop
        calibrate(loops["neuron"], target_s)  # warm-up (first-signature work happens here)
        n = calibrate(loops["cpu"], target_s)
        before = int(C.memory_stats(0)["num_device_alloc"])
        sides = interleave(loops, n, rounds)
        row = rep.compare(key, label, sides["cpu"], sides["neuron"], n, bar=bar)
        row["neuron_device_allocs_during_timing"] = int(C.memory_stats(0)["num_device_alloc"]) - before
        unspread_rows.append(rep.compare(key + ".pool_spread_off", label + " [pool spread off]", sides["cpu"],
                                         sides["neuron_unspread"], n, bar=None, cand_name="neuron_unspread"))

    rep.print_compare_table([r for r in rep.rows if r.get("cand") == "neuron"], unit="us")
    print("with a new pool's helpers left where libgomp put them (TORCHNEURON_LAB_SPREAD_POOL=off; device/csrc/"
          "README.md, 'OpenMP pools'):")
    for r in unspread_rows:
        print(f"  {r['label']:<50} {r['ratio']:.3f}x of CPU (min/min {r['ratio_of_mins']:.3f}x)")
    print(
        "neuron device (segment) allocations during the timed blocks: "
        + ", ".join(
            f"{r['key'].split('.', 1)[1]} {r['neuron_device_allocs_during_timing']}" for r in rep.rows
            if r.get("cand") == "neuron"
        )
    )
    print()

    # ---- kernel recorder cost on the neuron `a + 1` 64x64 path
    a = torch.randn(64, 64).to("neuron")
    env = {"a": a, "_C": C, "_cap": RECORDER_CAPACITY}
    loops = {
        "off": make_loop("a + 1", env, setup="_C.recorder_stop()"),
        "shapes": make_loop(
            "a + 1",
            env,
            setup="_C.recorder_clear()\n_C.recorder_start(_cap, True, False)",
            teardown="_C.recorder_stop()\n_C.recorder_clear()",
        ),
        "stack": make_loop(
            "a + 1",
            env,
            setup="_C.recorder_clear()\n_C.recorder_start(_cap, True, True)",
            teardown="_C.recorder_stop()\n_C.recorder_clear()",
        ),
    }
    for k in ("shapes", "stack"):
        calibrate(loops[k], target_s, max_n=RECORDER_CAPACITY // 2)
    n = calibrate(loops["off"], target_s, max_n=RECORDER_CAPACITY // 2)
    sides = interleave(loops, n, rounds)

    # events per op and drops, from one short recorded block (untimed)
    C.recorder_clear()
    C.recorder_start(RECORDER_CAPACITY, True, False)
    for _ in range(100):
        a + 1
    torch.neuron.synchronize()
    C.recorder_stop()
    events = C.recorder_read()
    events_per_op = len(events["seq"]) / 100
    names = sorted(set(events["name"]))
    dropped = int(C.recorder_dropped())
    C.recorder_clear()
    if was_recording:
        C.recorder_start(RECORDER_CAPACITY, True, False)

    rec_shapes = rep.cost(
        "recorder.add_64x64.record_shapes",
        "recording on (record_shapes) vs off",
        sides["off"],
        sides["shapes"],
        n,
    )
    rec_stack = rep.cost(
        "recorder.add_64x64.with_stack",
        "recording on (record_shapes + with_stack) vs off",
        sides["off"],
        sides["stack"],
        n,
    )
    rep.extra["recorder"] = {"events_per_op": events_per_op, "event_names": names, "dropped": dropped}

    print("kernel recorder on the neuron `a + 1` 64x64 path (ns per op)")
    hdr = f"{'mode':<50} {'median':>10} {'min':>10} {'added/op':>10}"
    print(hdr)
    print("-" * len(hdr))
    print(f"{'recording off':<50} {sides['off'].median_ns:>7.0f} ns {sides['off'].min_ns:>7.0f} ns {'':>10}")
    for r in (rec_shapes, rec_stack):
        print(
            f"{r['label']:<50} {r['on']['median_ns']:>7.0f} ns {r['on']['min_ns']:>7.0f} ns"
            f" {r['added_ns_per_op']:>+7.0f} ns"
        )
    print(f"events per op recorded: {events_per_op:g} ({', '.join(names)}); dropped: {dropped}")
    print()

    rep.print_ratio_lines(rep.ratios)
    rep.print_cost_lines(rep.costs)
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
