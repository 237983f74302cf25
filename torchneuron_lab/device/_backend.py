"""Builds (once, cached) and loads the emulated NeuronCore's C++ core.

The core is compiled against the installed torch with ``torch.utils.cpp_extension`` and ninja the
first time it is needed. The cache key covers the sources, the torch and Python versions, the compiler
(resolved path, size, mtime) and the flags, so upgrading torch or the compiler, or editing a source,
gives a new build directory.

Invariants (issue 9/10):

* A complete build writes ``build.json`` *after* the library is linked: its size and SHA-256. A library
  whose stamp matches is imported directly, without asking ninja (pip's ninja and Debian's ninja read
  each other's ``.ninja_log`` as stale and would rebuild silently). A library without a matching stamp
  (a build killed while linking, a full disk, a truncated file that would die with SIGBUS when mapped)
  is never imported: the directory is cleaned and rebuilt.
* Builds of one key are serialised by an ``flock`` on ``build-<key>.lock`` next to the directory. The
  kernel releases it when the holder dies, so a killed build never blocks anyone; a waiter prints what
  it waits for (the holder's pid) and gives up with ``RuntimeError`` after
  ``TORCHNEURON_LAB_BUILD_TIMEOUT`` seconds (default 900).
* A real build always prints its one line to stderr; :func:`build_info` says truthfully whether this
  process built the core or loaded a verified cached build.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["lib", "is_loaded", "build_info"]

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("runtime.cpp", "kernels.cpp", "pyframes.cpp")
_EXTRA_CFLAGS = ["-O2", "-fvisibility=hidden", "-Wno-unused-parameter", "-DUSE_KINETO"]
_NAME = "torchneuron_lab_C"
_STAMP = "build.json"
_lock = threading.Lock()
_lib: ModuleType | None = None
_info: dict[str, object] = {}


def _cache_root() -> Path:
    env = os.environ.get("TORCHNEURON_LAB_BUILD_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchneuron_lab"


def _compiler() -> str | None:
    """The C++ compiler cpp_extension will run, resolved (None when there is none)."""
    for cand in (os.environ.get("CXX"), "c++", "g++"):
        if cand:
            path = shutil.which(cand)
            if path:
                return os.path.realpath(path)
    return None


def _compiler_identity() -> str:
    cxx = _compiler()
    if cxx is None:
        return "no-compiler"
    st = os.stat(cxx)
    return f"{cxx}:{st.st_size}:{int(st.st_mtime)}"


def _source_hash() -> str:
    import torch

    h = hashlib.sha256()
    h.update(torch.__version__.encode())
    h.update(" ".join(_EXTRA_CFLAGS).encode())
    h.update(sys.version.encode())
    h.update(_compiler_identity().encode())
    for p in sorted(_CSRC.iterdir()):
        if p.suffix in (".cpp", ".h"):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _check_compiler() -> None:
    if _compiler() is None:
        cxx = os.environ.get("CXX", "c++")
        raise RuntimeError(
            "torchneuron_lab needs a C++ compiler to build its emulated neuron device, and none was found "
            f"(looked for {cxx!r} and 'g++' on PATH). Install one (Debian/Ubuntu: apt-get install g++) "
            "or set CXX."
        )


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _verified(build_dir: Path) -> bool:
    """Whether ``build_dir`` holds a complete build: the library matches the stamp written after linking."""
    so, stamp = build_dir / f"{_NAME}.so", build_dir / _STAMP
    try:
        meta = json.loads(stamp.read_text())
        return (so.stat().st_size == int(meta["size"]) and _file_sha256(so) == meta["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _write_stamp(build_dir: Path, seconds: float) -> None:
    so = build_dir / f"{_NAME}.so"
    meta = {"size": so.stat().st_size, "sha256": _file_sha256(so), "seconds": round(seconds, 3),
            "torch": __import__("torch").__version__, "compiler": _compiler_identity(),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    tmp = build_dir / f"{_STAMP}.tmp"
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, build_dir / _STAMP)  # atomic: the stamp exists only for a whole library


def _import_library(build_dir: Path) -> ModuleType:
    path = build_dir / f"{_NAME}.so"
    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:  # pragma: no cover - importlib always finds an .so spec
        raise RuntimeError(f"torchneuron_lab: cannot import the C++ core from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _BuildLock:
    """An exclusive ``flock`` on ``path``, released by the kernel if the holder dies; bounded wait."""

    def __init__(self, path: Path, timeout: float) -> None:
        self.path, self.timeout = path, timeout
        self.fd: int | None = None

    def __enter__(self) -> _BuildLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        t0, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
            waited = time.monotonic() - t0
            if waited > self.timeout:
                holder = self._holder(fd)
                os.close(fd)
                raise RuntimeError(
                    f"torchneuron_lab: gave up after {waited:.0f} s waiting for {holder} to finish building "
                    f"the C++ core (lock {self.path}). If no build is running, delete that file; "
                    "TORCHNEURON_LAB_BUILD_TIMEOUT sets the wait."
                )
            if not told and waited > 2.0:
                told = True
                print(f"torchneuron_lab: waiting for {self._holder(fd)} to finish building the C++ core "
                      f"(lock {self.path}; gives up after {self.timeout:.0f} s)", file=sys.stderr, flush=True)
            time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            pid = os.pread(fd, 32, 0).decode().strip()
        except OSError:
            pid = ""
        return f"process {pid}" if pid.isdigit() else "another process"

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the flock
            self.fd = None


def _clean(build_dir: Path) -> None:
    """Remove an incomplete or damaged build (and a stale cpp_extension baton left by a killed build)."""
    if build_dir.exists():
        for p in build_dir.iterdir():
            if p.is_file() or p.is_symlink():
                p.unlink()
            else:
                shutil.rmtree(p, ignore_errors=True)


def _build(build_dir: Path) -> None:
    import torch
    from torch.utils import cpp_extension

    _check_compiler()
    _clean(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    print(f"torchneuron_lab: building the emulated NeuronCore C++ core against torch {torch.__version__} "
          f"in {build_dir} (about a minute on 2 cores, once per torch/compiler/source version) ...",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        cpp_extension.load(
            name=_NAME,
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
    _write_stamp(build_dir, seconds)
    print(f"torchneuron_lab: C++ core built in {seconds:.1f} s", file=sys.stderr, flush=True)


def _native_functions_yaml() -> str:
    """torch's native_functions.yaml (shipped in torchgen): which ops CUDA registers with a device check."""
    spec = importlib.util.find_spec("torchgen")
    if spec is None or not spec.submodule_search_locations:
        return ""
    for loc in spec.submodule_search_locations:
        path = Path(loc) / "packaged" / "ATen" / "native" / "native_functions.yaml"
        if path.is_file():
            return str(path)
    return ""


def lib() -> ModuleType:
    """Return the loaded C++ core, building it on first use."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        t0 = time.perf_counter()
        key = _source_hash()
        root = _cache_root()
        build_dir = root / f"build-{key}"
        built = False
        if not _verified(build_dir):
            from . import check_runtime_env

            check_runtime_env()  # (also reached with TORCHNEURON_LAB_REGISTER=0): a bounded wait
            timeout = float(os.environ.get("TORCHNEURON_LAB_BUILD_TIMEOUT") or "900")
            try:
                root.mkdir(parents=True, exist_ok=True)
                if not os.access(root, os.W_OK | os.X_OK):
                    raise PermissionError(f"{root} is not writable")
            except OSError as e:  # (a raw FileExistsError from pathlib named neither the cache nor the variable)
                raise RuntimeError(
                    f"torchneuron_lab: the C++ core's build cache {root} cannot be used ({e}); set "
                    "TORCHNEURON_LAB_BUILD_DIR (or XDG_CACHE_HOME) to a writable directory") from None
            with _BuildLock(root / f"build-{key}.lock", timeout):
                if not _verified(build_dir):  # nobody built it while we waited
                    _build(build_dir)
                    built = True
        module = sys.modules.get(_NAME) or _import_library(build_dir)  # (_source_hash imported torch)
        sys.modules.setdefault(_NAME, module)
        _lib = module
        seconds = time.perf_counter() - t0
        _info.update(build_dir=str(build_dir), cached=not built, built=built, seconds=seconds, key=key,
                     action="built" if built else "loaded verified cached build")
        return _lib


def is_loaded() -> bool:
    return _lib is not None


def build_info() -> dict[str, object]:
    """Where the core is, whether this process built it (``built``) or loaded a verified cached build
    (``cached``), and how long building or loading took (``seconds``)."""
    return dict(_info)
