"""Run a short script in a fresh interpreter that imports this checkout: the one subprocess helper of the tests.

Used where a test needs state that only exists before the device's first use (configuration, environment
overrides, a small HBM for OOM, an untouched device) and wherever a call could crash or hang the interpreter
(the robustness suite): a crash (SIGSEGV, abort) or a hang is a failed test, never a lost test run. The child
prints one JSON line of facts last and the test asserts on that data.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Prepended with ``outcomes=True``: ``outcome(fn)`` runs fn and reports its value or the exception a user would
# see (type and first line); ``emit(facts)`` prints the JSON line.
OUTCOME_PRELUDE = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
import torchneuron_lab  # noqa: F401

def outcome(fn):
    try:
        value = fn()
    except Exception as e:  # the type and text a user would see
        return {"error": type(e).__name__, "message": str(e).splitlines()[0] if str(e) else ""}
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    return {"value": value}

def emit(facts):
    print(json.dumps(facts))
"""


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The parent's environment without torchneuron_lab settings, importing this checkout first."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("TORCHNEURON_LAB_")}
    full.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT), full.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full.update(env or {})
    return full


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # nothing left in it
        pass


def run_child_process(
    code: str, env: dict[str, str] | None = None, timeout: float = 180, *, outcomes: bool = False
) -> tuple[dict[str, Any], str]:
    """Run ``code`` (dedented; after OUTCOME_PRELUDE with ``outcomes``) with ``python -c``.

    The child must exit 0 within ``timeout`` seconds and print a JSON line last; returns that line parsed and
    the child's stderr. A hang, a crash (killed by a signal) or a failure raises AssertionError saying which.
    """
    script = (OUTCOME_PRELUDE if outcomes else "") + textwrap.dedent(code)
    # its own process group: on a hang, or once it exits, processes it started (a pool's workers) go with it
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=child_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        _kill_group(proc.pid)
        proc.communicate()
        raise AssertionError(f"child hung (no exit within {timeout} s)") from e
    _kill_group(proc.pid)
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if proc.returncode < 0:
        how = f"crashed ({signal.Signals(-proc.returncode).name})"
    else:
        how = f"failed (rc={proc.returncode})"
    assert proc.returncode == 0, f"child {how}:\n{proc.stdout}\n{proc.stderr}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"child printed nothing; stderr:\n{proc.stderr}"
    facts: dict[str, Any] = json.loads(lines[-1])
    return facts, proc.stderr


def run_child(
    code: str, env: dict[str, str] | None = None, timeout: float = 180, *, outcomes: bool = False
) -> dict[str, Any]:
    """``run_child_process`` without the stderr: the child's JSON facts."""
    return run_child_process(code, env, timeout, outcomes=outcomes)[0]


def run_ranks(
    code: str, world_size: int = 2, timeout: float = 240, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Run ``code`` (dedented) as the ``world_size`` ranks of a torch.distributed job on this machine.

    Each rank is a fresh interpreter in its own process group, with ``RANK``, ``WORLD_SIZE`` and
    ``INIT_FILE`` (a ``file://`` rendezvous in a new temporary directory) set. Every rank must exit 0 within
    ``timeout`` seconds (one deadline for all) and print a JSON line last; returns those lines parsed, by
    rank. A hang or a failure kills every rank's process group (no orphans) and raises AssertionError with
    each rank's output.
    """
    import tempfile
    import time

    script = textwrap.dedent(code)
    with tempfile.TemporaryDirectory(prefix="tnl-ranks-") as tmp:
        path = Path(tmp) / "rank.py"
        path.write_text(script)
        procs = []
        for rank in range(world_size):
            rank_env = {"RANK": str(rank), "WORLD_SIZE": str(world_size),
                        "INIT_FILE": str(Path(tmp) / "rendezvous"), **(env or {})}
            procs.append(subprocess.Popen(
                [sys.executable, str(path)], cwd=ROOT, env=child_env(rank_env), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, start_new_session=True))
        deadline = time.monotonic() + timeout
        outputs: list[tuple[int, str, str]] = []
        hung = False
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung = True
                _kill_group(p.pid)
                out, err = p.communicate()
            outputs.append((p.returncode, out, err))
        for p in procs:
            _kill_group(p.pid)
        report = "\n".join(f"--- rank {r} (rc={rc})\n{out}\n{err[-4000:]}" for r, (rc, out, err) in enumerate(outputs))
        assert not hung, f"a rank hung (no exit within {timeout} s):\n{report}"
        assert all(rc == 0 for rc, _, _ in outputs), f"a rank failed:\n{report}"
        facts = []
        for rc, out, err in outputs:
            lines = [line for line in out.splitlines() if line.strip()]
            assert lines, f"a rank printed nothing:\n{report}"
            facts.append(json.loads(lines[-1]))
        return facts
