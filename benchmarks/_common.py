"""Shared timing harness for the benchmark scripts in this folder.

Method (the same for every script):

- One process, one thread setting: ``torch.set_num_threads(N)`` is called once (``--threads``,
  default: torch's own default in this process) and applies to both sides.
- Each side of a comparison is a loop compiled from a statement string, so the statement is inlined
  in a ``for`` loop the way ``timeit`` does it (no per-iteration Python call of a lambda).
  Garbage collection is off inside a timed block and the block ends with a device synchronize.
- Warm-up: both sides run untimed first; the warm-up also calibrates the number of iterations per
  block so one block of the baseline lasts about ``target_s``. Both sides use the same count.
- Repeats: ``rounds`` rounds; each round times one block of every variant, and the order of the
  variants alternates (A B, B A, ...) so drift of the machine (frequency, other load) hits both.
- Reported: median and min of the per-block ns/iteration of each side; the ratio is the **median of
  the per-round ratios** (paired, so slow drift cancels) and, for reference, min/min. Each block also
  counts the process's minor page faults per iteration (``getrusage``): glibc gives large freed blocks
  back to the kernel, so CPU eager code can pay a fault per 4 KiB page of every large temporary, which the
  neuron device's caching allocator never does.
- ``--malloc retain`` (diagnostic; default ``default``) asks glibc to keep freed memory (``mallopt``:
  mmap threshold 32 MiB, trim threshold 1 GiB, top pad 64 MiB) before anything runs, so neither side
  pays those faults: what is left between the sides is their kernels and launches, not the allocator.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

_DEFAULT_THREADS = torch.get_num_threads()


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--quick", action="store_true", help="few, short repeats (CI smoke run; numbers are noisy)"
    )
    p.add_argument("--json", metavar="PATH", help="also write the results to this JSON file")
    p.add_argument(
        "--threads",
        type=int,
        default=_DEFAULT_THREADS,
        help=f"torch.set_num_threads for both sides (default: torch's default here, {_DEFAULT_THREADS})",
    )
    p.add_argument("--rounds", type=int, default=None, help="override the number of interleaved rounds")
    p.add_argument(
        "--strict", action="store_true", help="exit with status 1 when a bar fails (default: report only)"
    )
    p.add_argument(
        "--malloc",
        choices=("default", "retain"),
        default="default",
        help="retain: glibc keeps freed memory (no page faults for reused temporaries), a diagnostic",
    )
    return p


# glibc's mallopt parameters (malloc.h) and the values of ``--malloc retain``; glibc caps the mmap
# threshold at 32 MiB on 64-bit (HEAP_MAX_SIZE / 2), so larger blocks are still mapped per allocation.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
RETAIN_MALLOPT = {_M_MMAP_THRESHOLD: 32 << 20, _M_TRIM_THRESHOLD: 1 << 30, _M_TOP_PAD: 64 << 20}


_malloc_mode = "default"  # what this process's glibc was told (the guard's reference process is told the same)


def retain_freed_memory() -> None:
    """Make glibc keep freed memory in the process (``--malloc retain``); raises where that is not glibc."""
    global _malloc_mode
    libc = ctypes.CDLL(None)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):
        raise RuntimeError("--malloc retain needs glibc (mallopt)")
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    for param, value in RETAIN_MALLOPT.items():
        if mallopt(param, value) != 1:
            raise RuntimeError(f"glibc refused mallopt({param}, {value})")
    _malloc_mode = "retain"


def minor_faults() -> int:
    """Minor page faults of this process so far (every thread: the device worker's too)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def cpu_probe() -> float:
    """Median ns of a fixed multi-threaded CPU workload (matmul, relu, sum: parallel regions)."""
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    blocks = []
    for _ in range(9):
        t0 = time.perf_counter_ns()
        for _ in range(20):
            (a @ a).relu_().sum()
        blocks.append(time.perf_counter_ns() - t0)
    return float(sorted(blocks)[len(blocks) // 2]) / 20


CPU_GUARD_BAR = 1.25
_GUARD_ROW = ("guard.cpu_baseline", "CPU probe in this process / in a fresh process")
GUARD_PAIRS = 6
_GUARD_TIMEOUT_S = 120.0

#: The child of :func:`cpu_guard_probes`: a fresh interpreter that imports torch and this module, never the
#: lab, and probes on each line it reads.
_REFERENCE_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(int(sys.argv[2]))
import _common
if sys.argv[3] == "retain":
    _common.retain_freed_memory()
_common.cpu_probe()
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() != "probe":
        break
    print(_common.cpu_probe(), flush=True)
"""


def setup(args: argparse.Namespace) -> None:
    if args.malloc == "retain":
        retain_freed_memory()
    torch.set_num_threads(args.threads)
    import torchneuron_lab  # noqa: F401  (registers the neuron device; builds the C++ core on first use)

    torch.manual_seed(0)


def _read_line(proc: Any, deadline: float) -> str:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"the CPU reference process did not answer within {_GUARD_TIMEOUT_S:.0f} s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the CPU reference process exited (status {proc.wait(timeout=5)})")
    return line.strip()


def cpu_guard_probes(pairs: int = GUARD_PAIRS) -> list[tuple[float, float]]:
    """(this process, a fresh process) CPU probes, in pairs taken back to back (order alternating).

    The CPU baselines of these scripts run in the same process as the device, so a device that slows the
    process's CPU kernels (libgomp throttling every region once the device worker had an OpenMP pool: up to
    3.8x, undetected for weeks) would flatter neuron. The reference is a process that never loaded the
    lab, probed within ~50 ms of this one: this machine's speed drifts by up to 25% over seconds (the same
    probe read 182 us, then 232 us a second later in one process), which a before/after probe in
    one process could not tell from a slowed CPU side (it failed 4 runs of 14 that way).
    """
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.Popen(
        [sys.executable, "-c", _REFERENCE_CHILD, here, str(torch.get_num_threads()), _malloc_mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + _GUARD_TIMEOUT_S
    try:
        if _read_line(proc, deadline) != "ready":
            raise RuntimeError("the CPU reference process did not start")
        cpu_probe()  # warm, as the child did

        def reference() -> float:
            proc.stdin.write("probe\n")
            proc.stdin.flush()
            return float(_read_line(proc, deadline))

        out = []
        for i in range(pairs):
            time.sleep(SETTLE_S)  # the other side's idle OpenMP helpers stop spinning
            first = cpu_probe() if i % 2 == 0 else reference()
            time.sleep(SETTLE_S)
            second = reference() if i % 2 == 0 else cpu_probe()
            out.append((first, second) if i % 2 == 0 else (second, first))
        return out
    finally:
        proc.kill()
        proc.wait(timeout=10)


def sync_neuron() -> None:
    torch.neuron.synchronize()  # type: ignore[attr-defined]


SETTLE_S = 0.03


def settle(loop: Any, side: str = "") -> None:
    """Start a timed block as a notebook cell's loop would run: the device idle, then one untimed iteration.

    The device's worker keeps its OpenMP pool (and the spin throttle, device/csrc/queue.cpp) until it has
    been idle 20 ms; a CPU block timed right after a neuron block ran 19-26% slower (qwen2 zoo step) with
    the worker's pool still there (libgomp throttles every pool when pools outnumber the CPUs), which
    flattered neuron. So every block waits 30 ms with the device idle; then one iteration of the block's own
    loop, untimed, makes the pools its side uses (a neuron block no longer pays them either).

    A CPU block (``side`` starting with "cpu") first makes this thread's pool with its helpers placed, as the
    device's worker does with each new pool (device/csrc/README.md, "A new pool's helpers are placed once"):
    the neuron launches of the block before ended this thread's pool, and a pool made again by the CPU block's
    own first op started every region late in about half of the blocks (1.4x slower), which flattered neuron.
    """
    if torch.neuron.is_initialized():  # type: ignore[attr-defined]
        torch.neuron.synchronize()  # type: ignore[attr-defined]
    time.sleep(SETTLE_S)
    if side.startswith("cpu"):
        from torchneuron_lab.device._backend import lib

        lib().spread_thread_pool()
    loop(1)


# ---------------------------------------------------------------------------------------------------
# loops


def _indent(code: str, prefix: str) -> str:
    return (
        "\n".join(prefix + line for line in code.strip("\n").splitlines())
        if code.strip()
        else prefix + "pass"
    )


def make_loop(
    stmt: str, env: dict[str, Any], setup: str = "", teardown: str = "", sync: str = "_sync()"
) -> Any:
    """Compile a timed loop around ``stmt``; returns ``_loop(n) -> elapsed ns`` for ``n`` iterations.

    ``def _loop(_n): <setup>; t0; for _ in range(_n): <stmt>; <sync>; dt = now - t0; <teardown>``.
    ``stmt`` may span several lines. ``setup``/``teardown`` run untimed. ``env`` supplies the names.
    """
    src = (
        "def _loop(_n):\n"
        f"{_indent(setup, '    ')}\n"
        "    _t0 = _now()\n"
        "    for _ in range(_n):\n"
        f"{_indent(stmt, '        ')}\n"
        f"{_indent(sync, '    ')}\n"
        "    _dt = _now() - _t0\n"
        f"{_indent(teardown, '    ')}\n"
        "    return _dt\n"
    )
    g: dict[str, Any] = {"_now": time.perf_counter_ns, "_sync": sync_neuron, "torch": torch}
    g.update(env)
    exec(compile(src, f"<bench loop: {stmt.strip()[:40]}>", "exec"), g)  # noqa: S102 - our own loop template
    return g["_loop"]


def _timed(loop: Any, n: int) -> float:
    """ns per iteration of one block, with the garbage collector off (``_timed_faults`` also counts faults)."""
    return _timed_faults(loop, n)[0]


def _timed_faults(loop: Any, n: int) -> tuple[float, float]:
    """ns and minor page faults per iteration of one block, with the garbage collector off."""
    gc.collect()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        f0 = minor_faults()
        ns = loop(n)
        faults = minor_faults() - f0
    finally:
        if gc_was:
            gc.enable()
    return ns / n, faults / n


def calibrate(loop: Any, target_s: float, min_n: int = 1, max_n: int = 1_000_000) -> int:
    """Iterations so one block of ``loop`` lasts about ``target_s`` (also serves as a warm-up).

    Grows the block until it lasts a fifth of the target, then takes the fastest of three blocks at
    that size, so one hiccup of the machine does not shrink the blocks.
    """
    n = min_n
    while _timed(loop, n) * n < target_s * 1e9 * 0.2 and n < max_n:
        n = min(max_n, n * 4)
    per = min(_timed(loop, n) for _ in range(3))
    return max(min_n, min(max_n, int(target_s * 1e9 / max(per, 1.0))))


@dataclass
class Side:
    median_ns: float
    min_ns: float
    samples: list[float]
    faults: list[float] = field(default_factory=list)  # minor page faults per iteration, per block

    @classmethod
    def of(cls, samples: list[float], faults: list[float] | None = None) -> Side:
        return cls(statistics.median(samples), min(samples), samples, list(faults or []))

    @property
    def median_faults(self) -> float | None:
        return statistics.median(self.faults) if self.faults else None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"median_ns": self.median_ns, "min_ns": self.min_ns, "samples_ns": self.samples}
        if self.faults:
            doc["median_faults_per_iter"] = self.median_faults
            doc["faults_per_iter"] = self.faults
        return doc


def interleave(loops: dict[str, Any], n: int, rounds: int, warmup_blocks: int = 1) -> dict[str, Side]:
    """Time every loop ``rounds`` times, alternating the order each round. Returns per-variant sides."""
    names = list(loops)
    for _ in range(warmup_blocks):
        for k in names:
            settle(loops[k], k)
            _timed(loops[k], n)
    samples: dict[str, list[float]] = {k: [] for k in names}
    faults: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for k in order:
            settle(loops[k], k)
            ns, flt = _timed_faults(loops[k], n)
            samples[k].append(ns)
            faults[k].append(flt)
    return {k: Side.of(samples[k], faults[k]) for k in names}


def paired_ratio(cand: Side, base: Side) -> float:
    return statistics.median(c / b for c, b in zip(cand.samples, base.samples))


# ---------------------------------------------------------------------------------------------------
# reporting


@dataclass
class Report:
    script: str
    args: argparse.Namespace
    rows: list[dict[str, Any]] = field(default_factory=list)
    ratios: list[dict[str, Any]] = field(default_factory=list)
    costs: list[dict[str, Any]] = field(default_factory=list)
    limits: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    # -- collected results

    def compare(
        self,
        key: str,
        label: str,
        base: Side,
        cand: Side,
        n: int,
        bar: float | None = None,
        base_name: str = "cpu",
        cand_name: str = "neuron",
    ) -> dict[str, Any]:
        ratio = paired_ratio(cand, base)
        row = {
            "key": key,
            "label": label,
            "iters_per_block": n,
            "rounds": len(base.samples),
            base_name: base.to_json(),
            cand_name: cand.to_json(),
            "base": base_name,
            "cand": cand_name,
            "ratio": ratio,
            "ratio_of_mins": cand.min_ns / base.min_ns,
            "bar": bar,
            "pass": None if bar is None else ratio <= bar,
        }
        self.rows.append(row)
        self.ratios.append(row)
        return row

    def cost(self, key: str, label: str, off: Side, on: Side, n: int) -> dict[str, Any]:
        added = statistics.median(o - f for o, f in zip(on.samples, off.samples))
        row = {
            "key": key,
            "label": label,
            "iters_per_block": n,
            "rounds": len(off.samples),
            "off": off.to_json(),
            "on": on.to_json(),
            "added_ns_per_op": added,
            "added_pct": 100.0 * added / off.median_ns,
        }
        self.costs.append(row)
        return row

    def limit(self, key: str, label: str, value: float, unit: str, bar: float) -> dict[str, Any]:
        """An absolute bar (``value <= bar``, e.g. microseconds per event), counted with the ratio bars."""
        row = {"key": key, "label": label, "value": value, "unit": unit, "bar": bar, "pass": value <= bar}
        self.limits.append(row)
        return row

    def single(self, key: str, label: str, side: Side, n: int) -> dict[str, Any]:
        row = {
            "key": key,
            "label": label,
            "iters_per_block": n,
            "rounds": len(side.samples),
            "value": side.to_json(),
        }
        self.rows.append(row)
        return row

    # -- output

    def header(self, title: str) -> None:
        print(f"== {title}")
        print(
            f"   torch {torch.__version__} | python {platform.python_version()} | "
            f"threads {torch.get_num_threads()} (same for both sides) | cpus {os.cpu_count()} | "
            f"load avg {os.getloadavg()[0]:.2f} | "
            f"{'QUICK (smoke run, noisy)' if self.args.quick else 'full run'}"
        )
        if _malloc_mode == "retain":
            print("   malloc: retain (glibc keeps freed memory: mmap threshold 32 MiB, trim threshold 1 GiB)")
        print("   ratio = median over interleaved rounds of (candidate block / baseline block)")
        print()

    def print_compare_table(self, rows: list[dict[str, Any]], unit: str = "us") -> None:
        scale = {"ns": 1.0, "us": 1e3, "ms": 1e6}[unit]
        w = max([len(r["label"]) for r in rows] + [4])
        b0, c0 = rows[0]["base"], rows[0]["cand"]
        head = (
            f"{'case':<{w}}  {b0 + ' med':>11} {b0 + ' min':>11}  {c0 + ' med':>11} {c0 + ' min':>11}"
            f"  {'ratio':>7} {'min/min':>7}  {'iters x rounds':>14}"
        )
        print(head)
        print("-" * len(head))
        for r in rows:
            b, c = r[r["base"]], r[r["cand"]]
            print(
                f"{r['label']:<{w}}  {b['median_ns'] / scale:>8.2f} {unit} {b['min_ns'] / scale:>8.2f} {unit}"
                f"  {c['median_ns'] / scale:>8.2f} {unit} {c['min_ns'] / scale:>8.2f} {unit}"
                f"  {r['ratio']:>6.3f}x {r['ratio_of_mins']:>6.3f}x  {r['iters_per_block']:>7} x {r['rounds']:<5}"
            )
        print()

    def print_ratio_lines(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            line = f"RATIO {r['key']} {r['cand']}/{r['base']} = {r['ratio']:.3f}x"
            if r["bar"] is not None:
                line += f"  [bar <= {r['bar']:.2f}x: {'PASS' if r['pass'] else 'FAIL'}]"
            print(line)

    def print_cost_lines(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            print(
                f"COST {r['key']} = {r['added_ns_per_op']:+.0f} ns/op ({r['added_pct']:+.1f}%)"
                f"  [off {r['off']['median_ns']:.0f} ns, on {r['on']['median_ns']:.0f} ns]"
            )

    def print_limit_lines(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            print(
                f"LIMIT {r['key']} = {r['value']:.3f} {r['unit']}"
                f"  [bar <= {r['bar']:.2f} {r['unit']}: {'PASS' if r['pass'] else 'FAIL'}]"
            )

    def failed_bars(self) -> list[str]:
        return [r["key"] for r in self.ratios + self.limits if r["pass"] is False]

    def cpu_guard(self) -> None:
        """Bar this process's CPU speed (the device idle, as between a script's CPU blocks) against a fresh one."""
        if not torch.neuron.is_initialized():  # type: ignore[attr-defined]
            return
        sync_neuron()
        time.sleep(0.1)  # the device worker ends its idle OpenMP pool after 20 ms
        try:
            pairs = cpu_guard_probes()
        except (OSError, RuntimeError, TimeoutError, ValueError) as e:  # the results above still count
            print(f"CPU baseline guard: FAIL, the reference process failed: {e}")
            self.limit(*_GUARD_ROW, float("inf"), "x", CPU_GUARD_BAR)["error"] = str(e)
            return
        ratio = statistics.median(here / ref for here, ref in pairs)
        here = statistics.median(p[0] for p in pairs)
        ref = statistics.median(p[1] for p in pairs)
        print(f"CPU baseline guard: probe {here / 1e3:.1f} us in this process after the neuron runs, "
              f"{ref / 1e3:.1f} us in a fresh process, paired median {ratio:.3f}x (bar <= {CPU_GUARD_BAR}) "
              f"{'PASS' if ratio <= CPU_GUARD_BAR else 'FAIL: the device slows the CPU side'}")
        self.limit(*_GUARD_ROW, ratio, "x", CPU_GUARD_BAR)

    def finish(self) -> int:
        self.cpu_guard()
        failed = self.failed_bars()
        bars = [r for r in self.ratios + self.limits if r["bar"] is not None]
        if bars:
            print()
            print(
                f"BARS {len(bars) - len(failed)}/{len(bars)} pass"
                + (f" (failed: {', '.join(failed)})" if failed else "")
            )
        if self.args.json:
            doc = {
                "script": self.script,
                "torch": torch.__version__,
                "python": platform.python_version(),
                "threads": torch.get_num_threads(),
                "cpu_count": os.cpu_count(),
                "quick": bool(self.args.quick),
                "malloc": _malloc_mode,
                "unix_time": time.time(),
                "load_avg_1m_at_end": os.getloadavg()[0],
                "ratios": {r["key"]: r["ratio"] for r in self.ratios},
                "bars": {r["key"]: {"bar": r["bar"], "pass": r["pass"]} for r in bars},
                "costs_ns_per_op": {r["key"]: r["added_ns_per_op"] for r in self.costs},
                "limits": {r["key"]: r["value"] for r in self.limits},
                "rows": self.rows,
                "costs": self.costs,
                "limit_rows": self.limits,
                **self.extra,
            }
            path = os.path.abspath(self.args.json)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(doc, f, indent=2)
            print(f"wrote {path}")
        sys.stdout.flush()
        return 1 if (failed and self.args.strict) else 0
