"""Asynchronous execution on the emulated neuron device (issue 12), side by side in one run.

Bars:
  1. launch: 100 matmuls 1024x1024 are enqueued in < 10% of the time they take to run (host launch time
     vs launch-to-synchronize time);
  2. training steps (MLP 784-512-512-10 AdamW, TransformerEncoderLayer d128 AdamW, GPT-2 small config
     2 layers AdamW), asynchronous neuron vs CPU eager: <= 1.0x (the host's Python overlaps the device's
     kernels); also reported with TORCHNEURON_LAB_LAUNCH_BLOCKING semantics (every kernel waited for);
  3. per-op cost of a chain of small ops (64x64 adds, synchronised at the end) vs CPU: reported, <= 1.5x;
  4. an event-timed ``elapsed_time`` of a kernel agrees with the recorder's duration within 5%.

    python benchmarks/bench_async.py [--quick] [--json out.json] [--threads N] [--strict]
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _common import Report, base_parser, calibrate, interleave, make_loop, setup
from torch import nn

LAUNCH_BAR = 0.10
TRAIN_BAR = 1.0
CHAIN_BAR = 1.5
EVENT_BAR = 0.05


def launch_case(rep: Report, quick: bool) -> None:
    n = 20 if quick else 100
    x = torch.randn(1024, 1024, device="neuron")
    (x @ x).sum().item()  # warm: allocator, kernel
    hosts, totals = [], []
    for _ in range(2 if quick else 5):
        torch.neuron.synchronize()
        t0 = time.perf_counter()
        ys = [x @ x for _ in range(n)]
        t1 = time.perf_counter()
        torch.neuron.synchronize()
        t2 = time.perf_counter()
        hosts.append(t1 - t0)
        totals.append(t2 - t0)
        del ys
    host, total = statistics.median(hosts), statistics.median(totals)
    ratio = host / total
    rep.extra["launch"] = {"matmuls": n, "host_s": host, "device_s": total, "ratio": ratio, "bar": LAUNCH_BAR,
                           "pass": ratio < LAUNCH_BAR}
    print(f"launch: {n} x matmul 1024^2 enqueued in {1e3 * host:.1f} ms, run in {1e3 * total:.1f} ms "
          f"-> host/device {ratio:.4f}x (bar < {LAUNCH_BAR}) {'PASS' if ratio < LAUNCH_BAR else 'FAIL'}")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def encoder() -> nn.Module:
    return nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, dropout=0.0, batch_first=True)


def gpt2() -> nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=1000, n_positions=128, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def env_for(kind: str, device: str, model: nn.Module) -> dict[str, object]:
    gen = torch.Generator().manual_seed(1)
    m = copy.deepcopy(model).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
    if kind == "mlp":
        x, y = torch.randn(64, 784, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    elif kind == "encoder":
        x, y = torch.randn(16, 64, 128, generator=gen), torch.randn(16, 64, 128, generator=gen)
    else:
        x = torch.randint(0, 1000, (8, 64), generator=gen)
        y = x
    return {"model": m, "opt": opt, "x": x.to(device), "y": y.to(device), "F": F}


STEPS = {
    "mlp": "opt.zero_grad(set_to_none=True)\nloss = F.cross_entropy(model(x), y)\nloss.backward()\nopt.step()",
    "encoder": "opt.zero_grad(set_to_none=True)\nloss = F.mse_loss(model(x), y)\nloss.backward()\nopt.step()",
    "gpt2": "opt.zero_grad(set_to_none=True)\nloss = model(x, labels=y).loss\nloss.backward()\nopt.step()",
}
LABELS = {
    "mlp": "MLP 784-512-512-10 b64, AdamW",
    "encoder": "TransformerEncoderLayer d128 h4 16x64, AdamW",
    "gpt2": "GPT-2 config (2 layers, d128) 8x64, AdamW",
}


def _toggled(inner: Callable[[int], float], on: Callable[[], None], off: Callable[[], None]) -> Callable[[int], float]:
    """``inner`` timed with a device setting switched by ``on`` for the block and back by ``off`` after it."""

    def loop(n: int) -> float:
        on()
        try:
            return inner(n)
        finally:
            off()

    return loop


def training_cases(rep: Report, quick: bool, rounds: int, target_s: float) -> None:
    from torchneuron_lab.device._backend import lib

    C = lib()
    rows = []
    for kind, factory in (("mlp", mlp), ("encoder", encoder), ("gpt2", gpt2)):
        torch.manual_seed(0)
        model = factory()
        envs = {dev: env_for(kind, dev, model) for dev in ("cpu", "neuron", "neuron_blocking")
                if dev != "neuron_blocking"}
        envs["neuron_blocking"] = env_for(kind, "neuron", model)
        loops = {dev: make_loop(STEPS[kind], env) for dev, env in envs.items()}
        loops["neuron_blocking"] = _toggled(loops["neuron_blocking"], lambda: C.set_launch_blocking(True),
                                            lambda: C.set_launch_blocking(False))
        throttle_mode = C.spin_throttle_stats()["mode"]
        loops["neuron_unthrottled"] = _toggled(make_loop(STEPS[kind], env_for(kind, "neuron", model)),
                                               lambda: C.set_spin_throttle("off"),
                                               lambda m=throttle_mode: C.set_spin_throttle(m))
        loops["neuron_unspread"] = _toggled(make_loop(STEPS[kind], env_for(kind, "neuron", model)),
                                            lambda: C.set_pool_spread(False), lambda: C.set_pool_spread(True))
        calibrate(loops["neuron"], target_s)
        n = calibrate(loops["cpu"], target_s)
        sides = interleave(loops, n, rounds)
        row = rep.compare(f"train.{kind}", LABELS[kind], sides["cpu"], sides["neuron"], n, bar=TRAIN_BAR)
        row_b = rep.compare(f"train.{kind}.launch_blocking", LABELS[kind] + " [launch blocking]", sides["cpu"],
                            sides["neuron_blocking"], n, bar=None, cand_name="neuron_blocking")
        row_u = rep.compare(f"train.{kind}.spin_throttle_off", LABELS[kind] + " [spin throttle off]", sides["cpu"],
                            sides["neuron_unthrottled"], n, bar=None, cand_name="neuron_unthrottled")
        row_s = rep.compare(f"train.{kind}.pool_spread_off", LABELS[kind] + " [pool spread off]", sides["cpu"],
                            sides["neuron_unspread"], n, bar=None, cand_name="neuron_unspread")
        rows += [row, row_b, row_u, row_s]
    rep.print_compare_table([r for r in rows if r["cand"] == "neuron"], unit="ms")
    print()
    print("with launch blocking (every kernel waited for, as TORCHNEURON_LAB_LAUNCH_BLOCKING=1):")
    for r in rows:
        if r["cand"] == "neuron_blocking":
            print(f"  {r['label']:<60} {r['ratio']:.3f}x of CPU")
    print("with the spin throttle off (TORCHNEURON_LAB_SPIN_THROTTLE=off; device/csrc/README.md, 'The spin throttle'):")
    for r in rows:
        if r["cand"] == "neuron_unthrottled":
            print(f"  {r['label']:<60} {r['ratio']:.3f}x of CPU")
    print("with a new pool's helpers left where libgomp put them (TORCHNEURON_LAB_SPREAD_POOL=off; device/csrc/"
          "README.md, 'OpenMP pools'):")
    for r in rows:
        if r["cand"] == "neuron_unspread":
            print(f"  {r['label']:<60} {r['ratio']:.3f}x of CPU")


def chain_case(rep: Report, rounds: int, target_s: float) -> None:
    stmt = "y = a + b\ny = y + b\ny = y + b\ny = y + b\ny = y + b\ny = y + b\ny = y + b\ny = y + b"
    envs = {dev: {"a": torch.randn(64, 64).to(dev), "b": torch.randn(64, 64).to(dev)} for dev in ("cpu", "neuron")}
    loops = {dev: make_loop(stmt, env) for dev, env in envs.items()}
    calibrate(loops["neuron"], target_s)
    n = calibrate(loops["cpu"], target_s)
    sides = interleave(loops, n, rounds)
    row = rep.compare("chain.add64", "8 chained 64x64 adds (sync at end of block)", sides["cpu"], sides["neuron"],
                      n, bar=CHAIN_BAR)
    per_op_cpu = row["cpu"]["median_ns"] / 8 / 1e3
    per_op_neuron = row["neuron"]["median_ns"] / 8 / 1e3
    print(f"per op: cpu {per_op_cpu:.2f} us, neuron {per_op_neuron:.2f} us -> {row['ratio']:.3f}x "
          f"(bar <= {CHAIN_BAR}) {'PASS' if row['pass'] else 'FAIL'}")


def event_case(rep: Report, quick: bool) -> None:
    from torchneuron_lab.device import recorder

    x = torch.randn(1024, 1024, device="neuron")
    (x @ x).sum().item()
    diffs = []
    for _ in range(3 if quick else 10):
        start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
        recorder.clear()
        recorder.start(100)
        start.record()
        y = x @ x
        end.record()
        end.synchronize()
        recorder.stop()
        (mm,) = [e for e in recorder.read().events if e.name == "aten::mm"]
        ev_ms, rec_ms = start.elapsed_time(end), mm.dur_ns / 1e6
        diffs.append(abs(ev_ms - rec_ms) / rec_ms)
        del y
    worst, med = max(diffs), statistics.median(diffs)
    rep.extra["event_vs_recorder"] = {"median_rel_diff": med, "max_rel_diff": worst, "bar": EVENT_BAR,
                                      "pass": med <= EVENT_BAR}
    print(f"event elapsed_time vs recorder duration (matmul 1024^2): median |diff| {100 * med:.2f}%, "
          f"max {100 * worst:.2f}% (bar <= {100 * EVENT_BAR:.0f}%) {'PASS' if med <= EVENT_BAR else 'FAIL'}")


def main() -> int:
    ap = base_parser(__doc__.splitlines()[0])
    args = ap.parse_args()
    setup(args)
    quick = args.quick
    rounds = args.rounds or (3 if quick else 11)
    target_s = 0.01 if quick else 0.2
    rep = Report("bench_async", args)
    rep.header("asynchronous neuron device vs CPU eager")
    launch_case(rep, quick)
    print()
    training_cases(rep, quick, rounds, target_s)
    print()
    chain_case(rep, rounds, target_s)
    print()
    event_case(rep, quick)
    print()
    launch, event = rep.extra["launch"], rep.extra["event_vs_recorder"]
    rep.limit("launch.matmul1024.host_over_device", "host launch time / device time, 100 matmuls 1024^2",
              launch["ratio"], "x", LAUNCH_BAR)
    rep.limit("event.elapsed_vs_recorder", "|event elapsed_time - recorder duration| / duration",
              event["median_rel_diff"], "x", EVENT_BAR)
    rep.print_limit_lines(rep.limits)
    rep.print_ratio_lines(rep.ratios)
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
