"""The C++ core's build cache: a verified build loads without ninja, a damaged one is rebuilt, a killed
build never blocks an import, and a bad ``TORCHNEURON_LAB_*`` value never breaks ``import torch``.

Every case runs in a fresh interpreter with its own ``TORCHNEURON_LAB_BUILD_DIR`` holding a copy of this
process's verified build, so nothing here compiles (where a rebuild is the expected outcome, the child
replaces ``_build`` with a copy of the good library and records that it was asked to build).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests._neuron_child import ROOT, child_env
from torchneuron_lab.device import _backend


@pytest.fixture()
def cache(tmp_path: Path) -> Path:
    """A build root holding a copy of the verified build this process loaded."""
    _backend.lib()
    src = Path(str(_backend.build_info()["build_dir"]))
    dst = tmp_path / "cache" / src.name
    shutil.copytree(src, dst)
    return dst


def _child(code: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=child_env(env),
                          capture_output=True, text=True, timeout=timeout, check=False)


def _fake_tools(tmp: Path) -> dict[str, str]:
    """PATH where `ninja` records that it was called and fails (the compiler stays reachable)."""
    bindir = tmp / "bin"
    bindir.mkdir()
    marker = tmp / "ninja_called"
    ninja = bindir / "ninja"
    ninja.write_text(f"#!/bin/sh\necho called >> {marker}\nexit 1\n")
    ninja.chmod(0o755)
    return {"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}


_LOAD = """
import json, sys, torch
from torchneuron_lab.device import _backend
x = torch.ones(3, device="neuron") + 1
info = _backend.build_info()
print(json.dumps({"sum": float(x.sum().item()), "built": info["built"], "cached": info["cached"],
                  "action": info["action"], "build_dir": info["build_dir"]}))
"""


def test_verified_build_loads_without_asking_ninja(cache: Path, tmp_path: Path) -> None:
    env = {"TORCHNEURON_LAB_BUILD_DIR": str(cache.parent), **_fake_tools(tmp_path)}
    # a .ninja_log written by another ninja version must not matter
    (cache / ".ninja_log").write_text("# ninja log v7\n")
    proc = _child(_LOAD, env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == {"sum": 6.0, "built": False, "cached": True, "action": "loaded verified cached build",
                   "build_dir": str(cache)}
    assert not (tmp_path / "ninja_called").exists()
    assert "building" not in proc.stderr


_REBUILD_STUB = """
import json, shutil, sys
from pathlib import Path
from torchneuron_lab.device import _backend
calls = []
def fake_build(build_dir):
    calls.append(str(build_dir))
    _backend._clean(build_dir)
    shutil.copy(GOOD, build_dir / "torchneuron_lab_C.so")
    _backend._write_stamp(build_dir, 0.0)
_backend._build = fake_build
import torch
import torchneuron_lab
torchneuron_lab.register_device()
x = torch.ones(2, device="neuron") * 3
print(json.dumps({"calls": calls, "built": _backend.build_info()["built"], "sum": float(x.sum().item())}))
"""


@pytest.mark.parametrize("damage", ["truncated", "no_stamp", "wrong_hash"])
def test_damaged_build_is_rebuilt_not_mapped(cache: Path, tmp_path: Path, damage: str) -> None:
    good = tmp_path / "good.so"
    so = cache / "torchneuron_lab_C.so"
    shutil.copy(so, good)
    if damage == "truncated":  # a build killed while linking / a full disk: mapping it would be SIGBUS
        with open(so, "r+b") as f:
            f.truncate(so.stat().st_size // 3)
    elif damage == "no_stamp":
        (cache / "build.json").unlink()
    else:
        meta = json.loads((cache / "build.json").read_text())
        meta["sha256"] = "0" * 64
        (cache / "build.json").write_text(json.dumps(meta))
    (cache / "lock").write_text("")  # cpp_extension's baton left by a killed build
    proc = _child(f"GOOD = {str(good)!r}\n" + _REBUILD_STUB, {"TORCHNEURON_LAB_BUILD_DIR": str(cache.parent),
                  "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "TORCHNEURON_LAB_REGISTER": "0"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == {"calls": [str(cache)], "built": True, "sum": 6.0}
    assert not (cache / "lock").exists()


def test_killed_builder_does_not_block_and_live_builder_is_waited_for_with_a_bound(cache: Path) -> None:
    env = {"TORCHNEURON_LAB_BUILD_DIR": str(cache.parent), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    (cache / "build.json").unlink()  # so that the import must take the build lock
    lock = cache.parent / f"{cache.name}.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, os, sys, time
            fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, str(os.getpid()).encode())
            print("locked", flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        # a live holder: the waiter says whom it waits for and gives up after the bound
        t0 = time.monotonic()
        proc = _child("import torchneuron_lab", {**env, "TORCHNEURON_LAB_BUILD_TIMEOUT": "3"}, timeout=60)
        waited = time.monotonic() - t0
        assert proc.returncode == 1 and waited < 30
        assert f"waiting for process {holder.pid}" in proc.stderr
        assert f"gave up after 3 s waiting for process {holder.pid}" in proc.stderr
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    # the holder was killed mid-"build": its lock is gone with it
    good = cache.parent.parent / "good.so"
    shutil.copy(cache / "torchneuron_lab_C.so", good)
    proc = _child(f"GOOD = {str(good)!r}\n" + _REBUILD_STUB, {**env, "TORCHNEURON_LAB_REGISTER": "0"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["calls"] == [str(cache)]


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("TORCHNEURON_LAB_NUM_DEVICES", "0", "TORCHNEURON_LAB_NUM_DEVICES must be an int in [1, 64], got 0"),
        ("TORCHNEURON_LAB_NUM_DEVICES", "two", "TORCHNEURON_LAB_NUM_DEVICES='two' is not an integer"),
        ("TORCHNEURON_LAB_PROFILE", "bogus", "TORCHNEURON_LAB_PROFILE: "),
        ("TORCHNEURON_LAB_HBM_BYTES", "lots", "TORCHNEURON_LAB_HBM_BYTES='lots' is not a size"),
        # beyond what the C++ core takes (a signed 64-bit size): it failed there with a TypeError
        ("TORCHNEURON_LAB_HBM_BYTES", "1e99", "TORCHNEURON_LAB_HBM_BYTES must be an int in [1 MiB, 4 EiB]"),
        # runtime switches the C++ core would have read as their default (launch blocking: asynchronous)
        ("TORCHNEURON_LAB_LAUNCH_BLOCKING", "true", "TORCHNEURON_LAB_LAUNCH_BLOCKING='true': must be one of 0, 1"),
        ("TORCHNEURON_LAB_SPIN_THROTTLE", "sometimes",
         "TORCHNEURON_LAB_SPIN_THROTTLE='sometimes': must be one of auto, on, off, 0, 1"),
        ("TORCHNEURON_LAB_QUEUE_GRAPHS", "no", "TORCHNEURON_LAB_QUEUE_GRAPHS='no': must be one of 0, 1"),
        ("TORCHNEURON_LAB_SYNC_TIMEOUT", "inf", "TORCHNEURON_LAB_SYNC_TIMEOUT='inf': must be a positive, finite"),
        ("TORCHNEURON_LAB_SYNC_TIMEOUT", "soon", "TORCHNEURON_LAB_SYNC_TIMEOUT='soon': must be a positive, finite"),
        ("TORCHNEURON_LAB_BUILD_TIMEOUT", "inf", "TORCHNEURON_LAB_BUILD_TIMEOUT='inf': must be a positive, finite"),
        ("TORCHNEURON_LAB_VERBOSE_BUILD", "yes", "TORCHNEURON_LAB_VERBOSE_BUILD='yes': must be one of 0, 1"),
    ],
)
def test_bad_environment_keeps_torch_importable(var: str, value: str, message: str) -> None:
    code = """
    import json, warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch
    cpu = float((torch.ones(2) + 1).sum())
    try:
        import torchneuron_lab
        err = None
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    print(json.dumps({"cpu": cpu, "warnings": [str(w.message) for w in caught
                                                if "torchneuron_lab" in str(w.message)],
                      "err": err, "neuron": hasattr(torch, "neuron")}))
    """
    proc = _child(code, {var: value})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["cpu"] == 4.0 and not out["neuron"]
    assert len(out["warnings"]) == 1 and message in out["warnings"][0]
    assert out["err"] is not None and out["err"].startswith("ValueError: ") and message in out["err"]


def test_an_unusable_build_cache_names_itself_and_the_variable(tmp_path: Path) -> None:
    # a raw FileExistsError/NotADirectoryError from pathlib named neither the cache nor how to move it
    (tmp_path / "a-file").write_text("")
    code = """
    import json, torch
    try:
        import torchneuron_lab
        err = None
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    print(json.dumps({"err": err, "cpu": float((torch.ones(2) + 1).sum())}))
    """
    proc = _child(code, {"TORCHNEURON_LAB_BUILD_DIR": str(tmp_path / "a-file" / "cache")})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["cpu"] == 4.0
    assert out["err"].startswith(f"RuntimeError: torchneuron_lab: the C++ core's build cache {tmp_path / 'a-file' / 'cache'}"
                                 " cannot be used"), out
    assert "set TORCHNEURON_LAB_BUILD_DIR (or XDG_CACHE_HOME) to a writable directory" in out["err"]
