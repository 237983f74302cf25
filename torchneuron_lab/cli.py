"""``torchneuron-lab``: command-line entry point.

- ``torchneuron-lab info``  devices, profile, capacity, build status of the C++ core, versions.
- ``torchneuron-lab demo``  the main job on the embedded emulated device: trains a small model on
  ``neuron`` with the kernel recorder on, prints the allocator state and a kernel summary, and
  writes a Chrome/Perfetto trace and the memory snapshot to a directory it prints.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def _info(_: argparse.Namespace) -> int:
    import torch

    import torchneuron_lab
    from torchneuron_lab.device import _backend, current_config, profile

    cfg = current_config()
    prof = profile()
    print(f"torchneuron_lab {torchneuron_lab.__version__}  torch {torch.__version__}  python {sys.version.split()[0]}")
    print(f"device: neuron (emulated NeuronCore, kernels on host CPU), {cfg['num_devices']} devices")
    print(f"HBM per device: {cfg['hbm_bytes'] / 2**30:.2f} GiB  profile: {prof.name}")
    info = _backend.build_info()
    print(f"C++ core: {'cached build' if info.get('cached') else 'built now'} in {info.get('build_dir')} "
          f"({float(info.get('seconds', 0.0)):.1f} s)")
    print(f"torch.accelerator: {torch.accelerator.current_accelerator()}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    import torch

    import torchneuron_lab  # noqa: F401  (registers the device)
    from torchneuron_lab.device import recorder
    from torchneuron_lab.tracing import summarize, write_chrome_trace

    out = Path(args.output) if args.output else Path(tempfile.mkdtemp(prefix="torchneuron_lab_demo_"))
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512), torch.nn.Linear(512, 10)
    ).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(64, 256).to("neuron")
    y = torch.randint(0, 10, (64,)).to("neuron")
    torch.neuron.memory._record_memory_history(max_entries=100000)
    t0 = time.perf_counter()
    with recorder.record(with_stack=True) as box:
        for step in range(args.steps):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            print(f"step {step}: loss {loss.item():.4f}")
    wall = time.perf_counter() - t0
    trace = box[0]
    summary = summarize(trace.events, k=8)
    print(f"\n{len(trace.events)} device events in {wall:.2f} s ({trace.dropped} dropped)")
    print("time by engine (measured on the host; est = roofline ESTIMATE for " + str(trace.profile) + "):")
    for eng, row in summary["time_by_engine"].items():
        print(f"  {eng:7s} {row['count']:6d} events  {row['total_ns'] / 1e6:9.3f} ms")
    print("top kernels:")
    for row in summary["top_kernels"]:
        print(f"  {row['name']:40s} x{row['count']:<5d} {row['total_ns'] / 1e6:9.3f} ms")
    print(f"host syncs: {len(summary['sync_events'])}   new op signatures: {len(summary['new_signatures'])}")
    print()
    print(torch.neuron.memory_summary(abbreviated=True))
    trace_path = out / "trace.json"
    write_chrome_trace(trace_path, trace.events, {"profile": trace.profile})
    snap_path = out / "memory_snapshot.pickle"
    torch.neuron.memory._dump_snapshot(str(snap_path))
    torch.neuron.memory._record_memory_history(enabled=None)
    (out / "summary.json").write_text(json.dumps(summary, default=str, indent=1))
    print(f"wrote {trace_path} (open in Perfetto / chrome://tracing), {snap_path} (pytorch.org/memory_viz), "
          f"{out / 'summary.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchneuron-lab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="devices, profile, capacity, C++ core build status, versions")
    p_info.set_defaults(fn=_info)
    p_demo = sub.add_parser("demo", help="run the main job on the emulated device and write its trace")
    p_demo.add_argument("-o", "--output", help="directory for the trace and snapshot (default: a new temp dir)")
    p_demo.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p_demo.set_defaults(fn=_demo)
    args = parser.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    raise SystemExit(main())
