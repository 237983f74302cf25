"""Builds (once, cached) and loads the emulated NeuronCore's C++ core.

The core is compiled against the installed torch with ``torch.utils.cpp_extension`` and ninja the
first time it is needed; later imports reuse the cached build. The cache key covers the sources, the
torch version and the compiler flags, so upgrading torch or editing a source triggers a rebuild.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

__all__ = ["lib", "is_loaded", "build_info"]

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("runtime.cpp", "kernels.cpp")
_EXTRA_CFLAGS = ["-O2", "-fvisibility=hidden", "-Wno-unused-parameter", "-DUSE_KINETO"]
_lock = threading.Lock()
_lib: ModuleType | None = None
_info: dict[str, object] = {}


def _cache_root() -> Path:
    env = os.environ.get("TORCHNEURON_LAB_BUILD_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchneuron_lab"


def _source_hash() -> str:
    import torch

    h = hashlib.sha256()
    h.update(torch.__version__.encode())
    h.update(" ".join(_EXTRA_CFLAGS).encode())
    h.update(sys.version.encode())
    for p in sorted(_CSRC.iterdir()):
        if p.suffix in (".cpp", ".h"):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _check_compiler() -> None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        raise RuntimeError(
            "torchneuron_lab needs a C++ compiler to build its emulated neuron device, and none was found "
            f"(looked for {cxx!r} and 'g++' on PATH). Install one (Debian/Ubuntu: apt-get install g++) "
            "or set CXX."
        )


def lib() -> ModuleType:
    """Return the loaded C++ core, building it on first use."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        import torch
        from torch.utils import cpp_extension

        key = _source_hash()
        build_dir = _cache_root() / f"build-{key}"
        cached = (build_dir / "torchneuron_lab_C.so").exists()
        if not cached:
            _check_compiler()
            print(
                f"torchneuron_lab: building the emulated NeuronCore C++ core against torch "
                f"{__import__('torch').__version__} in {build_dir} (first use only) ...",
                file=sys.stderr,
                flush=True,
            )
        build_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            _lib = cpp_extension.load(
                name="torchneuron_lab_C",
                sources=[str(_CSRC / s) for s in _SOURCES],
                extra_cflags=_EXTRA_CFLAGS,
                extra_include_paths=[str(Path(torch.__file__).parent / "include" / "kineto")],
                build_directory=str(build_dir),
                verbose=os.environ.get("TORCHNEURON_LAB_VERBOSE_BUILD") == "1",
            )
        except Exception as e:  # a compiler error: keep its text, say what failed
            raise RuntimeError(
                f"torchneuron_lab: building the C++ core in {build_dir} failed: {e}. "
                "Set TORCHNEURON_LAB_VERBOSE_BUILD=1 for the compiler output."
            ) from e
        seconds = time.perf_counter() - t0
        _info.update(build_dir=str(build_dir), cached=cached, seconds=seconds, key=key)
        if not cached:
            print(f"torchneuron_lab: C++ core built in {seconds:.1f} s", file=sys.stderr, flush=True)
        return _lib


def is_loaded() -> bool:
    return _lib is not None


def build_info() -> dict[str, object]:
    """Where the core was built, whether it came from the cache, and how long loading/building took."""
    return dict(_info)
