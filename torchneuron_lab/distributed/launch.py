"""Launching the ranks of a torch.distributed program from a notebook (``%%neuron_ranks``) or from Python.

Each rank is a fresh interpreter on this machine, in its own session (so that it and what it starts can be
killed as one), with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` as torchrun
sets them; the process group is made before the code runs (``init_process_group`` with a ``file://``
rendezvous in a new temporary folder) and destroyed after it, and ``rank``, ``world_size`` and ``dist`` are
defined. Every launch has one deadline for all ranks; at the deadline, at a Ctrl-C in the waiting notebook,
or as soon as one rank fails, every rank still running is killed: no process is left behind.
"""

from __future__ import annotations

import html
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RankOutput", "RanksResult", "run_ranks"]

_PRELUDE = """\
import os as _os
import torch
import torchneuron_lab  # noqa: F401  (registers the neuron device)
import torch.distributed as dist
rank, world_size = int(_os.environ["RANK"]), int(_os.environ["WORLD_SIZE"])
dist.init_process_group({backend!r}, init_method="file://" + _os.environ["TNL_RENDEZVOUS"], rank=rank,
                        world_size=world_size)
try:
    exec(compile({code!r}, {filename!r}, "exec"), globals())
finally:
    if dist.is_initialized():
        dist.destroy_process_group()
"""


@dataclass
class RankOutput:
    """What one rank printed and how it ended (``returncode`` None: killed at the deadline or interrupt)."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float


@dataclass
class RanksResult:
    """The ranks of one launch, by rank; ``ok`` when every rank exited 0."""

    world_size: int
    ranks: list[RankOutput] = field(default_factory=list)
    timed_out: bool = False
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return not self.timed_out and not self.interrupted and all(r.returncode == 0 for r in self.ranks)

    def failure(self) -> str | None:
        """Why the launch failed, in one line (None when it did not)."""
        if self.interrupted:
            return "interrupted (Ctrl-C): every rank was killed"
        if self.timed_out:
            late = [r.rank for r in self.ranks if r.returncode is None]
            return f"rank(s) {late} did not finish in time: every rank still running was killed"
        bad = [r for r in self.ranks if r.returncode != 0]
        if bad:
            return "; ".join(f"rank {r.rank} " + ("was killed" if r.returncode is None else
                                                  f"exited with {r.returncode}") + _last_error(r.stderr)
                             for r in sorted(bad, key=lambda r: (r.seconds, r.rank)))
        return None

    def _head(self, r: RankOutput) -> str:
        end = "killed" if r.returncode is None else f"exit {r.returncode}"
        return f"rank {r.rank} ({end}, {r.seconds:.1f} s)"

    def __str__(self) -> str:
        parts = []
        for r in self.ranks:
            parts.append(f"-- {self._head(r)} --")
            if r.stdout:
                parts.append(r.stdout.rstrip("\n"))
            if r.stderr.strip():
                parts.append(r.stderr.rstrip("\n"))
        why = self.failure()
        if why:
            parts.append(f"neuron_ranks: {why}")
        return "\n".join(parts)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        rows = []
        for r in self.ranks:
            err = (f"<pre style='color:#b00;margin:0'>{html.escape(r.stderr.rstrip())}</pre>"
                   if r.stderr.strip() else "")
            rows.append(f"<div><b>{html.escape(self._head(r))}</b><pre style='margin:0'>"
                        f"{html.escape(r.stdout.rstrip())}</pre>{err}</div>")
        why = self.failure()
        tail = f"<div style='color:#b00'><b>{html.escape(why)}</b></div>" if why else ""
        return "<div style='font-family:monospace;font-size:12px'>" + "".join(rows) + tail + "</div>"


def _last_error(stderr: str) -> str:
    """``: <the last line of a traceback>`` (without torch's ``[rankN]:`` prefix), or ``""``."""
    for line in reversed(stderr.splitlines()):
        text = line.split("]: ", 1)[1] if line.startswith("[rank") and "]: " in line else line
        text = text.strip()
        if text and not text.startswith(("Kernels run asynchronously", "File ", "^")):
            return ": " + (text if len(text) <= 160 else text[:157] + "...")
    return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill(proc: subprocess.Popen[str]) -> None:
    """Kill the rank and what it started. Its own session may not exist yet (interrupted right after the fork,
    before the child's setsid): the process itself is killed too."""
    for kill in (os.killpg, os.kill):
        try:
            kill(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_ranks(code: str, world_size: int = 2, *, timeout: float = 300, backend: str = "neuron",
              filename: str = "<ranks>", env: dict[str, str] | None = None) -> RanksResult:
    """Run ``code`` (dedented) as ``world_size`` ranks of one process group on this machine.

    Returns when every rank has ended (or was killed); never leaves a rank running. A ``KeyboardInterrupt``
    while waiting kills every rank and is raised again. ``filename`` names the code in tracebacks.

    Raises:
        ValueError: ``world_size`` < 1 or ``timeout`` <= 0.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    result = RanksResult(world_size)
    with tempfile.TemporaryDirectory(prefix="tnl-ranks-") as tmp:
        script = Path(tmp) / "rank.py"
        script.write_text(_PRELUDE.format(backend=backend, code=textwrap.dedent(code), filename=filename))
        base = {**os.environ, **(env or {}), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(_free_port()), "TNL_RENDEZVOUS": str(Path(tmp) / "rendezvous"),
                "PYTHONUNBUFFERED": "1"}
        procs: list[subprocess.Popen[str]] = []
        logs = []
        ended: list[float | None] = [None] * world_size
        t0 = time.monotonic()
        try:
            for rank in range(world_size):
                out = open(Path(tmp) / f"out{rank}", "w+")  # noqa: SIM115 - closed below
                err = open(Path(tmp) / f"err{rank}", "w+")  # noqa: SIM115
                logs.append((out, err))
                procs.append(subprocess.Popen(
                    [sys.executable, str(script)], env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=out, stderr=err, stdin=subprocess.DEVNULL, text=True, start_new_session=True))
            deadline = t0 + timeout
            while any(e is None for e in ended):
                for i, p in enumerate(procs):
                    if ended[i] is None and p.poll() is not None:
                        ended[i] = time.monotonic() - t0
                if any(p.returncode not in (None, 0) for p in procs):  # one failed: the others would wait
                    time.sleep(0.5)  # (a moment to print what they know)
                    break
                if time.monotonic() > deadline:
                    result.timed_out = True
                    break
                time.sleep(0.02)
        except KeyboardInterrupt:
            result.interrupted = True
            for p in procs:
                _kill(p)
            raise
        finally:
            for p in procs:
                if p.poll() is None:
                    _kill(p)
                p.wait()
                _kill(p)  # what it started
            now = time.monotonic() - t0
            for i, (p, (out, err)) in enumerate(zip(procs, logs)):
                out.seek(0)
                err.seek(0)
                killed = p.returncode is not None and p.returncode < 0 and (result.timed_out or result.interrupted
                                                                             or ended[i] is None)
                end = ended[i]
                result.ranks.append(RankOutput(i, None if killed else p.returncode, out.read(), err.read(),
                                               now if end is None else end))
                out.close()
                err.close()
    return result
