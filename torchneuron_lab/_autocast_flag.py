"""``torch.is_autocast_enabled()`` without a device: whether the *accelerator's* autocast is on.

torch's own Python reads the no-argument form as "GPU autocast is on": ``nn.MultiheadAttention`` and
``nn.TransformerEncoder[Layer]`` leave their fused inference fast path for it (whose kernels do not autocast),
and ``nn.DataParallel``'s ``parallel_apply`` carries it into the replicas' threads. Both take neuron as a
supported device, but the no-argument form answers for CUDA only, so under ``torch.autocast("neuron")`` the
fast path ran in float32 (or failed on a half input: ``expected m1 and m2 to have the same dtype``) and
DataParallel's replicas ran without autocast. Installed when the device is registered, the no-argument form
answers for CUDA or neuron; with a device it is torch's.
"""

from __future__ import annotations

from typing import Any

_MARK = "_torchneuron_lab_autocast_flag"


def install() -> None:
    """Wrap ``torch.is_autocast_enabled`` once (idempotent)."""
    import torch

    original = torch.is_autocast_enabled
    if getattr(original, _MARK, False):
        return

    def is_autocast_enabled(*args: Any, **kwargs: Any) -> bool:
        if args or kwargs:
            return bool(original(*args, **kwargs))
        return bool(original()) or bool(original("neuron"))

    setattr(is_autocast_enabled, _MARK, True)
    is_autocast_enabled.__doc__ = original.__doc__
    is_autocast_enabled.__wrapped__ = original  # type: ignore[attr-defined]
    torch.is_autocast_enabled = is_autocast_enabled

    from ._inductor_redirect import after_import

    def fold_in_dynamo(dynamo: Any) -> None:
        # Dynamo folds torch.is_autocast_enabled() to a constant (guarded by its global autocast state). Its
        # table is built at import from the name: once this wrapper is in place, the wrapper (a Python function
        # it inlines) is there, and the builtin the wrapper calls is not, so compiled nn code failed with
        # "torch.* op returned non-Tensor". The builtin joins the table.
        from torch._dynamo.variables import torch as variables

        variables.constant_fold_functions.setdefault(original, None)  # type: ignore[attr-defined]  # a dict at run time

    after_import("torch._dynamo", fold_in_dynamo)
