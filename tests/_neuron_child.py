"""Run a short script in a fresh interpreter that imports this checkout (shared by the device tests).

Used where a test needs state that only exists before the device's first use: configuration,
environment overrides, a small HBM for OOM, an untouched device. The child prints one JSON line of
facts and the test asserts on that data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The parent's environment without torchneuron_lab settings, importing this checkout first."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("TORCHNEURON_LAB_")}
    full.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT), full.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full.update(env or {})
    return full


def run_child(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> dict[str, Any]:
    """Run ``code`` (dedented) with ``python -c``; return its last stdout line parsed as JSON."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        cwd=ROOT,
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"child failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"child printed nothing; stderr:\n{proc.stderr}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result
