"""torchneuron_lab: an interactive eager-mode debugging lab for PyTorch on the ``neuron`` device.

``import torchneuron_lab`` registers the emulated ``neuron`` device with PyTorch (idempotent);
``%load_ext torchneuron_lab`` additionally registers the IPython magics. IPython and plotly are only
imported by the extension and widget layers.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "load_ipython_extension", "register_device", "unload_ipython_extension"]


def register_device() -> None:
    """Register the ``neuron`` device (builds the C++ core on first use). Safe to call repeatedly."""
    from . import _autocast_flag, _flex_attention, _inductor_redirect, _parallel_comm
    from .device import register

    register()
    _inductor_redirect.install()  # torch.compile(model) (backend="inductor") on neuron tensors
    _inductor_redirect.install_import_hooks()  # AOTInductor refuses neuron graphs; Dynamo's reset frees stacks
    _flex_attention.install()  # flex_attention's device check lets neuron through, as it does CUDA
    _parallel_comm.install()  # nn.DataParallel's torch._C._scatter/_gather/... for neuron tensors
    _autocast_flag.install()  # torch.is_autocast_enabled() answers for neuron's autocast too (nn's fast paths)


def _autoload() -> None:
    """``torch.backends`` entry point: ``import torch`` alone makes ``neuron`` available.

    A failure here (a bad ``TORCHNEURON_LAB_*`` value, no compiler, a broken build) must not make
    ``import torch`` itself fail: it is reported as a warning, and a later ``import torchneuron_lab``
    raises the full error (the package is dropped from ``sys.modules`` so that the import runs again).
    """
    try:
        register_device()
    except Exception as e:  # noqa: BLE001 - reported, and re-raised by an explicit import
        import sys
        import warnings

        sys.modules.pop(__name__, None)
        warnings.warn(
            f"torchneuron_lab: the neuron device could not be registered ({type(e).__name__}: {e}); "
            "torch works without it, `import torchneuron_lab` shows the error",
            RuntimeWarning,
            stacklevel=2,
        )


def _torch_is_importing() -> bool:
    """True while ``import torch`` is still executing (the ``torch.backends`` autoload calls us then)."""
    import sys

    torch = sys.modules.get("torch")
    return bool(getattr(getattr(torch, "__spec__", None), "_initializing", False))


def load_ipython_extension(ipython: Any) -> None:
    from .extension import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from .extension import unload_ipython_extension as _unload

    _unload(ipython)


def _command_line_starting() -> bool:
    """True while ``torchneuron-lab`` (or ``python -m torchneuron_lab.cli``) imports this package to start.

    The command registers the device itself once its arguments are parsed (``cli.main``), so ``--help`` and a
    usage error answer at once instead of building the C++ core first (about a minute on a fresh install).
    Only before torch is imported: a re-import after a failed registration (``_autoload``) raises its error.
    """
    import os
    import sys

    if "torch" in sys.modules:
        return False
    argv = list(getattr(sys, "orig_argv", None) or [])[1:]
    if argv and os.path.basename(argv[0]) == "torchneuron-lab":  # the console script, run by its interpreter
        return True
    takes_value = {"-X", "-W", "--check-hash-based-pycs"}  # interpreter options with a separate value
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-m":
            return i + 1 < len(argv) and argv[i + 1] == "torchneuron_lab.cli"
        if a.startswith("-m"):
            return a[2:] == "torchneuron_lab.cli"
        if a == "-c" or a == "-" or not a.startswith("-"):  # code, stdin or a script: not the command line
            return False
        i += 2 if a in takes_value else 1
    return False


# TORCHNEURON_LAB_REGISTER=0 imports the package without touching torch (e.g. to read saved traces).
# During torch's own import the entry point (_autoload) registers, so that its failures only warn.
if (__import__("os").environ.get("TORCHNEURON_LAB_REGISTER", "1") != "0" and not _torch_is_importing()
        and not _command_line_starting()):
    register_device()
