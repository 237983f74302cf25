"""Subprocess helpers for the robustness suite: every risky call runs in a fresh interpreter with a
timeout, so a crash (SIGSEGV, abort) or a hang is a failed test, never a lost test run."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

from tests._neuron_child import ROOT, child_env

# Prepended to every child script: ``outcome(fn)`` runs fn and reports its value or its exception.
PRELUDE = """
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


def run(code: str, env: dict[str, str] | None = None, timeout: float = 180) -> dict[str, Any]:
    """Run PRELUDE + ``code``; the child must exit 0 (no crash) and print one JSON line last."""
    script = PRELUDE + textwrap.dedent(code)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", script],
            check=False,
            cwd=ROOT,
            env=child_env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"child hung (no exit within {timeout} s)") from e
    assert proc.returncode == 0, (
        f"child crashed or failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"child printed nothing; stderr:\n{proc.stderr}"
    facts: dict[str, Any] = json.loads(lines[-1])
    facts["_stderr_bytes"] = len(proc.stderr)
    return facts
