"""torch.save / torch.load of neuron tensors and modules, and ``torch.autocast("neuron")``.

Autocast uses ATen's own policy lists (``ATen/autocast_mode.h``, the ones CUDA uses):
``AT_FORALL_LOWER_PRECISION_FP`` (mm, addmm, bmm, matmul, linear, conv*, ...) run in the autocast
dtype; ``AT_FORALL_FP32`` (exp, log, layer_norm, mse_loss, ...) and ``AT_FORALL_FP32_SET_OPT_DTYPE``
(sum, prod, softmax, log_softmax, cumsum, ...) produce float32; ``AT_FORALL_PROMOTE`` (addcmul,
cat-like promotions) take the widest input type; everything else keeps its input dtype.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import torchneuron_lab  # noqa: F401  (registers the device)

N0 = torch.device("neuron", 0)
N1 = torch.device("neuron", 1)


def _roundtrip(obj: Any, **load_kwargs: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, **load_kwargs)


# --------------------------------------------------------------------------- serialization


def test_save_load_keeps_device_dtype_values_and_view_sharing(tmp_path: Path) -> None:
    x = torch.arange(6.0, device="neuron:1")
    payload = {"x": x, "tail": x[2:], "a": torch.ones(2, 3, dtype=torch.float64, device="neuron:0")}
    path = tmp_path / "t.pt"
    torch.save(payload, path)
    loaded = torch.load(path)
    assert loaded["x"].device == N1 and loaded["tail"].device == N1 and loaded["a"].device == N0
    assert loaded["a"].dtype == torch.float64 and loaded["a"].shape == (2, 3)
    assert loaded["x"].cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert loaded["tail"].storage_offset() == 2
    assert loaded["tail"].untyped_storage().data_ptr() == loaded["x"].untyped_storage().data_ptr()
    assert loaded["x"].data_ptr() != x.data_ptr()  # a fresh device buffer
    loaded["x"][3] = -1.0
    assert loaded["tail"][1].item() == -1.0


@pytest.mark.parametrize(
    ("map_location", "expected"),
    [
        ("neuron:1", {"x": N1, "a": N1}),
        ("cpu", {"x": torch.device("cpu"), "a": torch.device("cpu")}),
        ("neuron", {"x": N0, "a": N0}),
        (torch.device("neuron", 0), {"x": N0, "a": N0}),
        ({"neuron:1": "neuron:0"}, {"x": N0, "a": N0}),
        ({"neuron:0": "cpu"}, {"x": N1, "a": torch.device("cpu")}),
    ],
    ids=["neuron:1", "cpu", "neuron", "torch.device", "dict_1_to_0", "dict_0_to_cpu"],
)
def test_map_location(map_location: Any, expected: dict[str, torch.device]) -> None:
    src = {"x": torch.arange(4.0, device="neuron:1"), "a": torch.full((2,), 3.0, device="neuron:0")}
    loaded = _roundtrip(src, map_location=map_location)
    assert {k: v.device for k, v in loaded.items()} == expected
    assert loaded["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert loaded["a"].tolist() == [3.0, 3.0]


def test_module_state_dict_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)).to(
        "neuron"
    )
    model(torch.randn(5, 4, device="neuron"))  # updates the BatchNorm running stats
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    cpu_sd = {k: v.cpu() for k, v in model.state_dict().items()}

    on_device = torch.load(path, weights_only=True)
    assert sorted(on_device) == sorted(cpu_sd)
    assert all(v.device == N0 for v in on_device.values())
    for k, v in on_device.items():
        assert torch.equal(v.cpu(), cpu_sd[k]), k
    assert on_device["1.num_batches_tracked"].item() == 1

    on_1 = torch.load(path, map_location="neuron:1", weights_only=True)
    clone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)).to(
        "neuron:1"
    )
    result = clone.load_state_dict(on_1)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert clone[0].weight.device == N1
    x = torch.randn(3, 4)
    model.eval()
    clone.eval()
    torch.testing.assert_close(clone(x.to("neuron:1")).cpu(), model(x.to("neuron")).cpu(), rtol=0, atol=0)

    on_cpu = torch.load(path, map_location="cpu", weights_only=True)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    cpu_model.load_state_dict(on_cpu)
    cpu_model.eval()
    torch.testing.assert_close(cpu_model(x), model(x.to("neuron")).cpu(), rtol=1e-6, atol=1e-6)


def test_load_state_dict_copies_cpu_weights_into_device_params() -> None:
    model = torch.nn.Linear(3, 3).to("neuron")
    ptr = model.weight.data_ptr()
    sd = {"weight": torch.eye(3), "bias": torch.zeros(3)}
    model.load_state_dict(sd)
    assert model.weight.device == N0 and model.weight.data_ptr() == ptr  # copied in place
    assert torch.equal(model.weight.detach().cpu(), torch.eye(3))


def test_save_of_a_neuron_tensor_records_its_location() -> None:
    import zipfile

    buf = io.BytesIO()
    torch.save(torch.ones(2, device="neuron:1"), buf)
    buf.seek(0)
    with zipfile.ZipFile(buf) as zf:
        data_pkl = next(n for n in zf.namelist() if n.endswith("data.pkl"))
        raw = zf.read(data_pkl)
    assert b"neuron:1" in raw


# --------------------------------------------------------------------------- autocast


@pytest.fixture
def mats() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 4, generator=g).to("neuron"), torch.randn(4, 4, generator=g).to("neuron")


LOWER = {
    "mm": lambda a, b: a @ b,
    "matmul": torch.matmul,
    "linear": lambda a, b: F.linear(a, b),
    "linear_bias": lambda a, b: F.linear(a, b, b[0]),
    "addmm": lambda a, b: torch.addmm(a, a, b),
    "bmm": lambda a, b: torch.bmm(a[None], b[None]),
    "baddbmm": lambda a, b: torch.baddbmm(a[None], a[None], b[None]),
    "mv": lambda a, b: torch.mv(a, b[0]),
    "conv2d": lambda a, b: F.conv2d(a[None, None], b[None, None, :3, :3]),
    "einsum": lambda a, b: torch.einsum("ij,jk->ik", a, b),
}
FLOAT32 = {
    "sum": lambda y: y.sum(),
    "sum_dim": lambda y: y.sum(dim=1),
    "softmax": lambda y: torch.softmax(y, -1),
    "F.softmax": lambda y: F.softmax(y, dim=-1),
    "log_softmax": lambda y: y.log_softmax(-1),
    "cumsum": lambda y: y.cumsum(0),
    "prod": lambda y: y.prod(),
    "exp": torch.exp,
    "log1p": lambda y: torch.log1p(y.abs()),
    "layer_norm": lambda y: F.layer_norm(y, (4,)),
    "mse_loss": lambda y: F.mse_loss(y, torch.zeros_like(y)),
}
KEEP = {
    "relu": torch.relu,
    "add": lambda y: y + y,
    "mul": lambda y: y * 2,
    "transpose": lambda y: y.t(),
    "max": lambda y: y.max(),
}


@pytest.mark.parametrize("op", list(LOWER), ids=list(LOWER))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_runs_matmul_family_in_lower_precision(
    op: str, dtype: torch.dtype, mats: tuple[torch.Tensor, torch.Tensor]
) -> None:
    a, b = mats
    with torch.autocast("neuron", dtype=dtype):
        y = LOWER[op](a, b)
    assert y.device.type == "neuron"
    assert y.dtype == dtype
    expected = LOWER[op](a.cpu().to(dtype), b.cpu().to(dtype))
    torch.testing.assert_close(y.cpu(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("op", list(FLOAT32), ids=list(FLOAT32))
def test_autocast_keeps_reductions_and_fp32_ops_in_float32(
    op: str, mats: tuple[torch.Tensor, torch.Tensor]
) -> None:
    a, b = mats
    with torch.autocast("neuron", dtype=torch.bfloat16):
        y = a @ b
        assert y.dtype == torch.bfloat16
        out = FLOAT32[op](y)  # even from a bfloat16 input
        out_from_fp32 = FLOAT32[op](a)
    assert out.dtype == torch.float32
    assert out_from_fp32.dtype == torch.float32


@pytest.mark.parametrize("op", list(KEEP), ids=list(KEEP))
def test_autocast_leaves_other_ops_in_their_input_dtype(
    op: str, mats: tuple[torch.Tensor, torch.Tensor]
) -> None:
    a, b = mats
    with torch.autocast("neuron", dtype=torch.bfloat16):
        y = a @ b
        assert KEEP[op](y).dtype == torch.bfloat16
        assert KEEP[op](a).dtype == torch.float32


def test_autocast_promote_ops_take_the_widest_type(mats: tuple[torch.Tensor, torch.Tensor]) -> None:
    a, b = mats
    with torch.autocast("neuron", dtype=torch.bfloat16):
        y = a @ b
        assert torch.addcmul(a, y, y).dtype == torch.float32
        assert torch.cat([y, a]).dtype == torch.float32


def test_autocast_state_enable_disable_and_nesting(mats: tuple[torch.Tensor, torch.Tensor]) -> None:
    a, b = mats
    assert torch.is_autocast_enabled("neuron") is False
    with torch.autocast("neuron", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled("neuron") is True
        assert torch.get_autocast_dtype("neuron") == torch.bfloat16
        with torch.autocast("neuron", enabled=False):
            assert (a @ b).dtype == torch.float32
        assert (a @ b).dtype == torch.bfloat16
    assert torch.is_autocast_enabled("neuron") is False
    assert (a @ b).dtype == torch.float32


def test_autocast_is_per_device_type(mats: tuple[torch.Tensor, torch.Tensor]) -> None:
    a, b = mats
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ b).dtype == torch.float32  # CPU autocast does not touch neuron tensors
    with torch.autocast("neuron", dtype=torch.bfloat16):
        assert (a.cpu() @ b.cpu()).dtype == torch.float32  # and neuron autocast does not touch CPU ones


def test_autocast_module_forward_backward_keeps_fp32_params() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3).to("neuron")
    x = torch.randn(5, 4, device="neuron")
    with torch.autocast("neuron", dtype=torch.bfloat16):
        out = lin(x)
        loss = out.float().pow(2).mean()
    assert out.dtype == torch.bfloat16
    assert loss.dtype == torch.float32
    loss.backward()
    assert lin.weight.dtype == torch.float32
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.float32
    assert lin.weight.grad.device == N0
    # same computation on the CPU under CPU autocast gives the same numbers
    lin_cpu = torch.nn.Linear(4, 3)
    lin_cpu.load_state_dict({k: v.cpu() for k, v in lin.state_dict().items()})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_cpu = lin_cpu(x.cpu())
    torch.testing.assert_close(out.cpu(), out_cpu, rtol=0, atol=0)


def _encoder() -> torch.nn.Module:
    torch.manual_seed(0)
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2,
                                      enable_nested_tensor=False)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), enc).eval().to("neuron")


def test_under_neuron_autocast_attention_modules_leave_their_fast_path_as_on_cuda() -> None:
    # torch.is_autocast_enabled() (no device) read only CUDA's flag: under torch.autocast("neuron") MHA and the
    # encoder took their fused fast path, which failed on the Linear's half output ("expected m1 and m2 to have
    # the same dtype") or ran in float32. CUDA's modules see autocast and take the slow path.
    model = _encoder()
    x = torch.randn(2, 5, 4, device="neuron")
    with torch.inference_mode(), torch.autocast("neuron", dtype=torch.float16):
        assert torch.is_autocast_enabled() and not torch.is_autocast_enabled("cpu")
        out = model(x)
        mha = model[1].layers[0].self_attn
        h = model[0](x)
        att = mha(h, h, h, need_weights=False)[0]
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.inference_mode(), torch.autocast("neuron", dtype=torch.float16):
            slow = model(x)
            slow_att = mha(h, h, h, need_weights=False)[0]
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert att.dtype == torch.float16 and out.dtype == torch.float32  # the encoder ends in layer_norm (fp32 on CUDA)
    assert torch.equal(out.cpu(), slow.cpu()) and torch.equal(att.cpu(), slow_att.cpu())
    assert not torch.is_autocast_enabled()


def test_cpu_autocast_does_not_reach_a_neuron_kernel_run_on_the_host() -> None:
    # the host path ran the CPU kernel with the caller's autocast state: MHA's fused fast path on neuron came out
    # bfloat16 under torch.autocast("cpu") (CUDA tensors never see CPU autocast)
    # (a plan's first launch runs on the host: shapes no other test uses, the autocast call first)
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        ref = mha(x, x, x)[0]
        mha.to("neuron")
        xn = x.to("neuron")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = mha(xn, xn, xn)[0]
    assert got.dtype == torch.float32 and torch.equal(got.cpu(), ref)


def test_data_parallel_replicas_run_under_the_callers_neuron_autocast() -> None:
    # parallel_apply carries torch.is_autocast_enabled() into the replicas' threads: it read False under neuron
    # autocast, and the replicas ran in float32
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.lin(x), torch.tensor([torch.is_autocast_enabled("neuron")], device=x.device)

    dp = torch.nn.DataParallel(M().to("neuron:0"), device_ids=[0, 1])
    with torch.autocast("neuron", dtype=torch.float16):
        y, flags = dp(torch.randn(4, 4, device="neuron:0"))
    assert y.dtype == torch.float16 and flags.tolist() == [True, True]


def test_compiled_attention_under_neuron_autocast_folds_the_autocast_flag() -> None:
    # Dynamo folds torch.is_autocast_enabled(); with the device's wrapper in its place the builtin it calls was not
    # in Dynamo's table: "torch.* op returned non-Tensor" for any compiled MHA
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval().to("neuron")
    x = torch.randn(2, 4, 8, device="neuron")
    f = torch.compile(lambda t: mha(t, t, t, need_weights=False)[0], backend="neuron", fullgraph=True)
    with torch.no_grad():
        with torch.autocast("neuron", dtype=torch.float16):
            half = f(x)
        full = f(x)  # autocast off again: recompiled
    assert (half.dtype, full.dtype) == (torch.float16, torch.float32)
