"""torch.distributed on neuron: a DistributedDataParallel training step on neuron (the ``neuron`` backend)
against the same step on CPU tensors (Gloo), side by side in the same two rank processes and one run.

Both ranks run in one process group made with ``init_process_group("neuron")``: its CPU tensors go to Gloo as
they are, its neuron tensors through the neuron backend (Gloo on host aliases, queued on the communication
stream), so the two sides share the processes, the rendezvous and the transport. Per round, each side runs one
block of steps (order alternating); a block starts after a barrier. Each rank uses ``--threads`` intra-op
threads (default 1: two ranks on two cores). Reported per model: median ms per step of each side (rank 0's
clock), the median of the per-round ratios neuron / CPU, and, from one recorded neuron step, how much of the
collectives' time overlapped kernels of the default stream (DDP launches bucket all-reduces during backward).
No bar (reported only).

    python benchmarks/bench_distributed.py [--quick] [--json out.json] [--threads N] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

RANK = textwrap.dedent(
    """
    import json, os, statistics, sys, time, warnings
    warnings.simplefilter("ignore")
    import torch, torchneuron_lab  # noqa: F401
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torchneuron_lab.device import recorder

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = json.loads(os.environ["BENCH_CFG"])
    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("neuron", init_method="file://" + os.environ["INIT_FILE"], rank=rank, world_size=world)

    def build(name, dev):
        torch.manual_seed(0)
        if name == "mlp":
            m = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                    torch.nn.ReLU(), torch.nn.Linear(512, 10))
            x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
            loss_fn = torch.nn.functional.cross_entropy
        else:
            m = torch.nn.TransformerEncoderLayer(128, 4, 512, batch_first=True, dropout=0.0)
            x, y = torch.randn(16, 64, 128), torch.randn(16, 64, 128)
            loss_fn = torch.nn.functional.mse_loss
        m = DDP(m.to(dev), bucket_cap_mb=1)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        x, y = x.to(dev), y.to(dev)
        def step():
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(m(x), y)
            loss.backward()
            opt.step()
            return loss
        return step

    def sync(dev):
        if dev == "neuron":
            torch.neuron.synchronize()

    def block(step, dev, n):
        dist.barrier()
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        sync(dev)
        return (time.perf_counter() - t0) / n

    out = {}
    for name in cfg["models"]:
        steps = {dev: build(name, dev) for dev in ("cpu", "neuron")}
        for dev in ("cpu", "neuron"):  # warm-up (first launches, buckets rebuilt after step 1)
            block(steps[dev], dev, 3)
        times = {"cpu": [], "neuron": []}
        for r in range(cfg["rounds"]):
            order = ("cpu", "neuron") if r % 2 == 0 else ("neuron", "cpu")
            for dev in order:
                times[dev].append(block(steps[dev], dev, cfg["steps"]))
        # one recorded neuron step: the collectives and what ran beside them
        dist.barrier()
        torch.neuron.synchronize()
        recorder.start(200000)
        steps["neuron"]()
        torch.neuron.synchronize()
        recorder.stop()
        evs = recorder.read().events
        coll = [(e.start_ns, e.end_ns) for e in evs if e.kind == "kernel" and e.name.startswith("collective:")]
        comp = [(e.start_ns, e.end_ns) for e in evs if e.kind == "kernel" and not e.name.startswith("collective:")]
        total = sum(b - a for a, b in coll)
        overlap = 0
        for a, b in coll:
            for c, d in comp:
                overlap += max(0, min(b, d) - max(a, c))
        out[name] = {"cpu": times["cpu"], "neuron": times["neuron"], "collectives": len(coll),
                     "collective_ns": total, "overlap_ns": min(overlap, total)}
    dist.destroy_process_group()
    print(json.dumps(out))
    """
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few, short blocks (CI smoke run; numbers are noisy)")
    p.add_argument("--json", metavar="PATH", help="also write the results to this JSON file")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (default 1)")
    p.add_argument("--rounds", type=int, default=None)
    args = p.parse_args()
    rounds = args.rounds or (2 if args.quick else 7)
    cfg = {"threads": args.threads, "rounds": rounds, "steps": 3 if args.quick else 20,
           "models": ["mlp"] if args.quick else ["mlp", "encoder"]}
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="tnl-bench-dist-") as tmp:
        script = Path(tmp) / "rank.py"
        script.write_text(RANK)
        env = {**os.environ, "WORLD_SIZE": "2", "INIT_FILE": str(Path(tmp) / "rdv"), "BENCH_CFG": json.dumps(cfg),
               "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True) for r in range(2)]
        deadline = time.monotonic() + 1800
        results = []
        try:
            for pr in procs:
                out, err = pr.communicate(timeout=max(1.0, deadline - time.monotonic()))
                if pr.returncode != 0:
                    print(err[-3000:], file=sys.stderr)
                    return 1
                results.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for pr in procs:
                if pr.poll() is None:
                    pr.kill()
                    pr.wait()
    r0 = results[0]
    print(f"bench_distributed: 2 ranks, DDP (bucket_cap_mb=1) + AdamW, {args.threads} thread(s) per rank, "
          f"{rounds} rounds x {cfg['steps']} steps per side")
    print(f"{'model':<10}{'cpu ms':>10}{'neuron ms':>11}{'RATIO':>9}{'collectives':>13}{'overlapped':>12}")
    report = {}
    for name, r in r0.items():
        ratio = statistics.median(n / c for n, c in zip(r["neuron"], r["cpu"]))
        ov = r["overlap_ns"] / r["collective_ns"] if r["collective_ns"] else 0.0
        report[name] = {"cpu_ms": statistics.median(r["cpu"]) * 1e3, "neuron_ms": statistics.median(r["neuron"]) * 1e3,
                        "ratio": ratio, "collectives_per_step": r["collectives"], "overlap": ov}
        print(f"{name:<10}{report[name]['cpu_ms']:>10.2f}{report[name]['neuron_ms']:>11.2f}{ratio:>8.3f}x"
              f"{r['collectives']:>13}{100 * ov:>11.0f}%")
        print(f"RATIO ddp.{name} neuron/cpu = {ratio:.3f}x  (reported only)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
