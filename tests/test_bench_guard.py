"""The benchmarks' CPU baseline guard (benchmarks/_common.py): this process's CPU probe, paired with a fresh
process's, must catch a process whose CPU kernels the device slowed, and pass one it did not.

The class it guards: libgomp throttles the spin of every OpenMP pool once a process's pools outnumber its
CPUs, so an idle pool left by another thread (the device worker's, before the worker learned to drop it)
slowed the in-process CPU baselines 2-4x and flattered neuron. Each case runs in a fresh interpreter pinned
to 2 CPUs with 2 threads (the pools against CPUs are the same on any CI machine)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = f"""
import json, os, statistics, sys, threading, time
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
import torch
torch.set_num_threads(2)
import _common
"""


def _run(body: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_guard_fails_a_process_whose_cpu_side_is_slowed() -> None:
    # The guard was built for an idle OpenMP pool left by the device worker, whose slowdown is the machine's:
    # 2.0-2.2x on the AMD 2-vCPU machines, but 1.08-1.27x on an Intel one (2026-12-06: three fresh processes
    # read 1.24, 1.22, 1.08 against the bar of 1.25), so that case cannot fail the guard reliably everywhere.
    # Here another thread of this process spins while this process probes (a busy device-side thread during
    # the CPU baseline): a slowdown on any machine, which the guard's pairing with a fresh process must catch.
    out = _run("""
        probe = _common.cpu_probe
        def slowed():
            stop = threading.Event()
            def spin():
                while not stop.is_set():
                    pass
            t = threading.Thread(target=spin)
            t.start()
            try:
                return probe()
            finally:
                stop.set()
                t.join()
        _common.cpu_probe = slowed  # this process's probes only: the reference child imports its own
        print(json.dumps({"pairs": _common.cpu_guard_probes()}))
    """)
    pairs = out["pairs"]
    assert len(pairs) == _guard_pairs()
    ratio = sorted(a / b for a, b in pairs)[len(pairs) // 2]
    assert ratio > _common_bar(), pairs


def _common_bar() -> float:
    """CPU_GUARD_BAR of benchmarks/_common.py (read, not imported: importing it configures torch's threads)."""
    m = re.search(r"^CPU_GUARD_BAR = ([0-9.]+)$", (ROOT / "benchmarks" / "_common.py").read_text(), re.MULTILINE)
    assert m is not None
    return float(m.group(1))


def test_the_guard_passes_a_process_whose_device_went_idle_and_leaves_no_child() -> None:
    out = _run("""
        import torchneuron_lab
        x = torch.randn(256, 256, device="neuron")
        for _ in range(100):
            x = (x @ x).tanh()
        torch.neuron.synchronize()
        time.sleep(0.1)
        pairs = _common.cpu_guard_probes()
        kids = [p for p in os.listdir("/proc") if p.isdigit()
                and open(f"/proc/{p}/stat").read().split(") ")[-1].split()[1] == str(os.getpid())]
        print(json.dumps({"pairs": pairs, "children": kids}))
    """)
    pairs = out["pairs"]
    assert len(pairs) == _guard_pairs() and all(a > 0 and b > 0 for a, b in pairs)
    ratio = sorted(a / b for a, b in pairs)[len(pairs) // 2]
    assert ratio <= 1.25  # measured 1.00-1.04x
    assert out["children"] == []  # the reference process was reaped


def _guard_pairs() -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _common
    finally:
        sys.path.pop(0)
    return _common.GUARD_PAIRS


def test_a_reference_process_that_dies_fails_the_guard_without_losing_the_report() -> None:
    out = _run("""
        import argparse
        import torchneuron_lab
        _common._REFERENCE_CHILD = "import sys; sys.exit(3)"   # the fresh interpreter dies at once
        (torch.ones(3, device="neuron") + 1).cpu()
        rep = _common.Report("t", argparse.Namespace(json=None, quick=True, strict=False))
        rep.compare("x", "x", _common.Side.of([2.0]), _common.Side.of([1.0]), 1, bar=1.0)
        rep.cpu_guard()
        print(json.dumps({"limits": [{k: str(v) for k, v in r.items()} for r in rep.limits],
                          "failed": rep.failed_bars()}))
    """)
    (row,) = out["limits"]
    assert row["key"] == "guard.cpu_baseline" and row["pass"] == "False" and row["value"] == "inf", row
    assert "exited (status 3)" in row["error"], row
    assert out["failed"] == ["guard.cpu_baseline"]  # the ratio bar above passed and is still reported


def test_blocks_count_page_faults_and_retain_keeps_freed_memory() -> None:
    """CPU eager code whose large temporaries glibc maps and unmaps pays a minor fault per 4 KiB page of each
    (the neuron allocator caches its blocks): the harness counts faults per iteration of every block, and
    ``--malloc retain`` (a diagnostic: glibc keeps freed memory) makes them go away below its 32 MiB cap."""
    out = _run("""
        import torchneuron_lab  # interleave() settles the device between blocks
        def faults(mib):
            loop = _common.make_loop("torch.empty(n).fill_(1.0)", {"n": mib << 18}, sync="pass")
            return _common.interleave({"x": loop}, 4, 3)["x"].faults
        mapped = faults(48)  # above glibc's mmap threshold cap (32 MiB): mapped, touched, unmapped each time
        mode0 = _common._malloc_mode
        _common.retain_freed_memory()
        kept = faults(24)
        print(json.dumps({"mapped": mapped, "kept": kept, "modes": [mode0, _common._malloc_mode]}))
    """)
    pages = (48 << 20) // 4096
    assert len(out["mapped"]) == 3 and min(out["mapped"]) >= 0.9 * pages, out
    # the last block: the first two may still grow the heap (CI once saw [6144, 1536, 0])
    assert len(out["kept"]) == 3 and out["kept"][-1] <= 50 and max(out["kept"]) < 0.6 * pages, out
    assert out["modes"] == ["default", "retain"]
