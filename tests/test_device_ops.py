"""Execution on the emulated ``neuron`` device: storage, views, in-place/out=, device checks, dtypes,
host round trips, data-dependent ops, conv2d autograd, cross-device copies, factories and errors.

Device kernels are ATen's CPU kernels run on device memory, so results are compared with CPU results
exactly (or to float rounding where a reduction order could differ).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import torchneuron_lab  # noqa: F401  (registers the device)

N0 = torch.device("neuron", 0)
N1 = torch.device("neuron", 1)
MISMATCH = r"Expected all tensors to be on the same device, but found at least two devices"


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# --------------------------------------------------------------------------- storage


def test_tensors_have_real_distinct_device_storage() -> None:
    a = torch.empty(100, device="neuron")
    b = torch.empty(100, device="neuron")
    assert a.data_ptr() != 0 and b.data_ptr() != 0
    assert a.data_ptr() != b.data_ptr()
    # both blocks are 512-byte granules of the caching allocator: they cannot overlap
    assert abs(a.data_ptr() - b.data_ptr()) >= 512
    assert a.data_ptr() % 512 == 0
    st = a.untyped_storage()
    assert st.device == N0
    assert st.nbytes() == 400
    assert a.storage_offset() == 0 and a.stride() == (1,)
    assert a.is_neuron and not a.is_cpu
    assert type(a) is torch.Tensor


def test_storage_bytes_are_the_tensor_values() -> None:
    x = torch.tensor([1.0, 2.0, 3.0], device="neuron")
    raw = x.untyped_storage().cpu()
    assert raw.device.type == "cpu"
    assert torch.frombuffer(bytearray(bytes(raw)), dtype=torch.float32).tolist() == [1.0, 2.0, 3.0]


def test_new_storage_on_device_one() -> None:
    y = torch.zeros(8, device="neuron:1")
    assert y.untyped_storage().device == N1
    assert y.get_device() == 1


# --------------------------------------------------------------------------- views share storage


def test_slice_fill_writes_through_to_base() -> None:
    x = torch.zeros(5, device="neuron")
    view = x[1:3]
    assert same_storage(view, x)
    assert view.storage_offset() == 1
    view.fill_(7)
    assert x.cpu().tolist() == [0.0, 7.0, 7.0, 0.0, 0.0]


def test_transpose_view_shares_storage_and_writes_through() -> None:
    x = torch.arange(12.0, device="neuron").reshape(3, 4)
    t = x.t()
    assert same_storage(t, x)
    assert t.stride() == (1, 4) and not t.is_contiguous()
    t[1, 2] = -1.0  # x[2, 1]
    assert x[2, 1].item() == -1.0
    assert t.contiguous().cpu().tolist() == x.cpu().t().tolist()


def test_view_and_reshape_alias_when_possible() -> None:
    x = torch.arange(12.0, device="neuron")
    v = x.view(3, 4)
    r = x.reshape(4, 3)
    assert same_storage(v, x) and same_storage(r, x)
    assert v.data_ptr() == x.data_ptr() == r.data_ptr()
    v[0, 0] = 100.0
    assert x[0].item() == 100.0 and r[0, 0].item() == 100.0
    # reshape of a non-contiguous view must copy: new storage, same values
    c = v.t().reshape(12)
    assert not same_storage(c, x)
    assert c.cpu().tolist() == v.cpu().t().reshape(12).tolist()


def test_expand_has_zero_strides_over_one_storage() -> None:
    row = torch.tensor([[1.0, 2.0, 3.0]], device="neuron")
    e = row.expand(4, 3)
    assert e.stride() == (0, 1)
    assert same_storage(e, row)
    assert e.sum().item() == 24.0
    row.mul_(2)
    assert e.cpu().tolist() == [[2.0, 4.0, 6.0]] * 4


def test_as_strided_view_writes_into_the_base() -> None:
    a = torch.zeros(6, device="neuron")
    s = a.as_strided((2, 2), (1, 2), 1)
    assert same_storage(s, a)
    assert s.storage_offset() == 1
    s.fill_(5.0)
    assert a.cpu().tolist() == [0.0, 5.0, 5.0, 5.0, 5.0, 0.0]


def test_unfold_is_a_view() -> None:
    x = torch.arange(10.0, device="neuron")
    u = x.unfold(0, 4, 2)
    assert u.shape == (4, 4) and u.stride() == (2, 1)
    assert same_storage(u, x)
    assert u.cpu().tolist() == torch.arange(10.0).unfold(0, 4, 2).tolist()
    x[2] = 42.0
    assert u[0, 2].item() == 42.0 and u[1, 0].item() == 42.0


@pytest.mark.parametrize(
    "make_view",
    [
        lambda t: t.diagonal(),
        lambda t: t.select(1, 2),
        lambda t: t.narrow(0, 1, 2),
        lambda t: t.unsqueeze(0).squeeze(0),
        lambda t: t.permute(1, 0),
        lambda t: t.view(torch.int32),
        lambda t: t.chunk(2, dim=1)[1],
        lambda t: t.unbind(0)[2],
    ],
    ids=["diagonal", "select", "narrow", "unsqueeze_squeeze", "permute", "view_dtype", "chunk", "unbind"],
)
def test_view_ops_share_storage_and_match_cpu(make_view: Any) -> None:
    base_cpu = torch.arange(16.0).reshape(4, 4)
    base = base_cpu.to("neuron")
    view = make_view(base)
    assert same_storage(view, base)
    expected = make_view(base_cpu)
    assert view.shape == expected.shape
    assert view.stride() == expected.stride()
    assert view.storage_offset() == expected.storage_offset()
    assert torch.equal(view.cpu(), expected)


# --------------------------------------------------------------------------- in-place and out=


def test_inplace_returns_self_and_keeps_storage() -> None:
    x = torch.ones(4, device="neuron")
    ptr = x.data_ptr()
    r = x.add_(2).mul_(3)
    assert r is x
    assert x.data_ptr() == ptr
    assert x.cpu().tolist() == [9.0] * 4
    x.clamp_(max=5.0)
    assert x.cpu().tolist() == [5.0] * 4


def test_out_of_the_right_shape_is_written_in_place() -> None:
    a = torch.arange(6.0, device="neuron").reshape(2, 3)
    out = torch.empty(2, 3, device="neuron")
    ptr = out.data_ptr()
    r = torch.add(a, 1, out=out)
    assert r is out
    assert out.data_ptr() == ptr
    assert out.cpu().tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]


def test_empty_out_is_resized_silently() -> None:
    a = torch.arange(6.0, device="neuron").reshape(2, 3)
    out = torch.empty(0, device="neuron")
    r = torch.mm(a, a.t(), out=out)
    assert r is out
    assert out.shape == (2, 2) and out.device == N0
    assert out.cpu().tolist() == [[5.0, 14.0], [14.0, 50.0]]


def test_wrong_shape_out_is_resized_with_torchs_warning() -> None:
    a = torch.ones(2, 2, device="neuron")
    out = torch.empty(1, device="neuron")
    with pytest.warns(UserWarning, match="An output with one or more elements was resized"):
        r = torch.add(a, 1, out=out)
    assert r is out
    assert out.shape == (2, 2)
    assert out.cpu().tolist() == [[2.0, 2.0], [2.0, 2.0]]
    assert out.untyped_storage().nbytes() >= 16
    assert out.untyped_storage().device == N0


def test_out_growing_past_its_storage_gets_a_bigger_device_block() -> None:
    out = torch.empty(0, device="neuron")
    big = torch.ones(1000, device="neuron")
    torch.mul(big, 3, out=out)
    assert out.untyped_storage().nbytes() == 4000
    assert out.sum().item() == 3000.0


def test_multi_output_out_variant() -> None:
    x = torch.tensor([[3.0, 1.0, 2.0], [0.0, 5.0, 4.0]], device="neuron")
    values = torch.empty(0, device="neuron")
    indices = torch.empty(0, dtype=torch.long, device="neuron")
    rv, ri = torch.max(x, dim=1, out=(values, indices))
    assert rv is values and ri is indices
    assert values.cpu().tolist() == [3.0, 5.0]
    assert indices.cpu().tolist() == [0, 1]


def test_out_on_the_cpu_is_a_device_mismatch() -> None:
    x = torch.ones(3, device="neuron")
    with pytest.raises(
        RuntimeError, match=MISMATCH + r", neuron:0 and cpu!.*argument out in method aten::add\.out"
    ):
        torch.add(x, x, out=torch.empty(3))


# --------------------------------------------------------------------------- device mismatches


def test_neuron_plus_cpu_tensor_raises_cudas_error() -> None:
    x = torch.randn(4, 4, device="neuron")
    with pytest.raises(
        RuntimeError, match=MISMATCH + r", neuron:0 and cpu! \(when checking argument for argument other"
    ):
        x + torch.randn(4, 4)


def test_neuron0_plus_neuron1_raises_cudas_error() -> None:
    a = torch.randn(3, device="neuron:0")
    b = torch.randn(3, device="neuron:1")
    with pytest.raises(RuntimeError, match=MISMATCH + r", neuron:0 and neuron:1!.*aten::add\.Tensor"):
        a + b
    with pytest.raises(RuntimeError, match=MISMATCH + r", neuron:1 and neuron:0!"):
        b * a


def test_mismatch_in_a_tensor_list_and_in_matmul() -> None:
    a = torch.ones(3, device="neuron")
    with pytest.raises(RuntimeError, match=MISMATCH + r", neuron:0 and cpu!.*aten::cat"):
        torch.cat([a, torch.ones(3)])
    with pytest.raises(RuntimeError, match=MISMATCH):
        torch.mm(torch.ones(2, 2, device="neuron"), torch.ones(2, 2))
    with pytest.raises(RuntimeError, match=MISMATCH + r", neuron:0 and neuron:1!"):
        torch.stack([a, torch.ones(3, device="neuron:1")])


def test_cpu_zero_dim_tensors_are_accepted_as_scalars() -> None:
    x = torch.tensor([1.0, 2.0, 3.0], device="neuron")
    r = x + torch.tensor(2.0)
    assert r.device == N0
    assert r.cpu().tolist() == [3.0, 4.0, 5.0]
    assert (x * torch.tensor(2)).cpu().tolist() == [2.0, 4.0, 6.0]
    w = torch.where(x > 1.5, x, torch.tensor(0.0))
    assert w.device == N0 and w.cpu().tolist() == [0.0, 2.0, 3.0]
    x.add_(torch.tensor(1.0))
    assert x.cpu().tolist() == [2.0, 3.0, 4.0]


def test_cpu_index_tensors_are_accepted_like_cuda() -> None:
    x = torch.arange(5.0, device="neuron")
    assert x[torch.tensor([0, 4])].cpu().tolist() == [0.0, 4.0]
    assert x[torch.tensor([True, False, True, False, False])].cpu().tolist() == [0.0, 2.0]
    x[torch.tensor([1])] = 9.0
    assert x.cpu().tolist() == [0.0, 9.0, 2.0, 3.0, 4.0]


# --------------------------------------------------------------------------- dtypes and host round trips


@pytest.mark.parametrize(
    "dtype",
    [torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool,
     torch.complex64],
)  # fmt: skip
def test_dtype_conversion_matches_cpu(dtype: torch.dtype) -> None:
    src = torch.tensor([-2.7, -1.0, 0.0, 0.4, 1.5, 3.0, 200.25])
    got = src.to("neuron").to(dtype)
    assert got.device == N0 and got.dtype == dtype
    assert torch.equal(got.cpu(), src.to(dtype))


def test_to_round_trips_and_no_op_moves() -> None:
    src = torch.randn(3, 5, dtype=torch.float64)
    n = src.to("neuron")
    assert n.device == N0 and n.dtype == torch.float64
    assert n.to("neuron") is n
    assert n.to(N0) is n
    assert torch.equal(n.cpu(), src)
    assert torch.equal(n.to("cpu"), src)
    n32 = src.to("neuron:1", torch.float32)
    assert n32.device == N1 and n32.dtype == torch.float32
    assert torch.equal(n32.cpu(), src.float())
    like = torch.zeros(2, dtype=torch.int16, device="neuron:1")
    moved = src.to(like)
    assert moved.device == N1 and moved.dtype == torch.int16
    back = n.cpu()
    back[0, 0] = 1234.0  # a host copy, not an alias
    assert n[0, 0].item() == src[0, 0].item()


def test_non_contiguous_to_host_and_back() -> None:
    src = torch.arange(24.0).reshape(2, 3, 4)
    n = src.to("neuron").permute(2, 0, 1)
    assert torch.equal(n.cpu(), src.permute(2, 0, 1))
    assert torch.equal(src.permute(2, 0, 1).to("neuron").cpu(), src.permute(2, 0, 1))


def test_item_and_tolist_types() -> None:
    f = torch.tensor([1.5, 2.5], device="neuron")
    i = torch.tensor([[1, 2], [3, 4]], device="neuron")
    b = torch.tensor([True], device="neuron")
    assert f[1].item() == 2.5 and type(f[1].item()) is float
    assert i[1, 0].item() == 3 and type(i[1, 0].item()) is int
    assert b.item() is True
    assert i.tolist() == [[1, 2], [3, 4]]
    assert f.tolist() == [1.5, 2.5]
    assert int(i.sum()) == 10 and float(f.mean()) == 2.0
    assert torch.tensor(7, device="neuron").tolist() == 7


def test_numpy_requires_cpu_like_cuda() -> None:
    with pytest.raises(TypeError, match="can't convert neuron:0 device type tensor to numpy"):
        torch.ones(2, device="neuron").numpy()


# --------------------------------------------------------------------------- data-dependent shapes


def test_nonzero_and_masked_select() -> None:
    x = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, -3.0]], device="neuron")
    nz = torch.nonzero(x)
    assert nz.device == N0 and nz.dtype == torch.int64
    assert nz.cpu().tolist() == [[0, 1], [1, 0], [1, 2]]
    ms = torch.masked_select(x, x > 0)
    assert ms.device == N0 and ms.cpu().tolist() == [1.5, 2.0]
    assert x[x < 0].cpu().tolist() == [-3.0]
    u, counts = torch.unique(torch.tensor([3, 1, 3, 2, 1, 3], device="neuron"), return_counts=True)
    assert u.cpu().tolist() == [1, 2, 3] and counts.cpu().tolist() == [2, 1, 3]


def test_sort_topk_and_index_ops_match_cpu() -> None:
    g = torch.Generator().manual_seed(0)
    src = torch.randn(5, 7, generator=g)
    n = src.to("neuron")
    for fn in (
        lambda t: torch.sort(t, dim=1).values,
        lambda t: torch.sort(t, dim=1).indices,
        lambda t: torch.topk(t, 3).values,
        lambda t: t.index_select(1, torch.tensor([6, 0, 3], device=t.device)),
        lambda t: t.gather(1, torch.tensor([[0, 1]] * 5, device=t.device)),
        lambda t: torch.zeros(5, 7, device=t.device).scatter_add(
            1, torch.tensor([[0, 0]] * 5, device=t.device), t
        ),
        lambda t: t.cumsum(0),
        lambda t: t.softmax(-1),
    ):
        assert torch.equal(fn(n).cpu(), fn(src))


# --------------------------------------------------------------------------- autograd: conv2d vs CPU


def test_conv2d_forward_and_backward_match_cpu() -> None:
    g = torch.Generator().manual_seed(0)
    inp = torch.randn(2, 3, 9, 9, generator=g)
    weight = torch.randn(4, 3, 3, 3, generator=g)
    bias = torch.randn(4, generator=g)

    def run(device: str) -> tuple[torch.Tensor, ...]:
        x = inp.to(device, copy=True).requires_grad_()
        w = weight.to(device, copy=True).requires_grad_()
        b = bias.to(device, copy=True).requires_grad_()
        y = F.conv2d(x, w, b, stride=2, padding=1)
        y.square().sum().backward()
        assert x.grad is not None and w.grad is not None and b.grad is not None
        assert y.device.type == x.grad.device.type == w.grad.device.type == device.split(":")[0]
        return y.detach().cpu(), x.grad.cpu(), w.grad.cpu(), b.grad.cpu()

    cpu, neuron = run("cpu"), run("neuron")
    assert cpu[0].shape == neuron[0].shape == (2, 4, 5, 5)
    for c, n in zip(cpu, neuron):
        torch.testing.assert_close(n, c, rtol=1e-6, atol=1e-6)


def test_linear_autograd_grads_live_on_the_device() -> None:
    lin = torch.nn.Linear(4, 3).to("neuron:1")
    x = torch.randn(5, 4, device="neuron:1")
    lin(x).sum().backward()
    assert lin.weight.grad is not None and lin.bias.grad is not None
    assert lin.weight.grad.device == N1
    assert torch.equal(lin.bias.grad.cpu(), torch.full((3,), 5.0))
    assert torch.allclose(lin.weight.grad.cpu(), x.cpu().sum(0).expand(3, 4))


# --------------------------------------------------------------------------- cross-device copies


def test_copy_neuron0_to_neuron1_is_a_separate_buffer() -> None:
    x = torch.arange(6.0, device="neuron:0")
    before1 = torch.neuron.memory_allocated(1)
    y = x.to("neuron:1")
    assert y.device == N1
    assert torch.neuron.memory_allocated(1) == before1 + 512
    assert not same_storage(x, y)
    assert y.cpu().tolist() == x.cpu().tolist()
    y.add_(1)
    assert x.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    z = torch.empty(6, device="neuron:1")
    r = z.copy_(x)
    assert r is z and z.device == N1
    assert z.cpu().tolist() == x.cpu().tolist()
    back = y.to("neuron:0")
    assert back.device == N0 and back.cpu().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_copy_between_devices_of_a_non_contiguous_view() -> None:
    x = torch.arange(12.0, device="neuron:0").reshape(3, 4)
    y = x.t().to("neuron:1")
    assert y.device == N1 and y.shape == (4, 3)
    assert torch.equal(y.cpu(), torch.arange(12.0).reshape(3, 4).t())


# --------------------------------------------------------------------------- factories on neuron:1


@pytest.mark.parametrize(
    "factory",
    [
        lambda d: torch.empty(3, 2, device=d),
        lambda d: torch.zeros(3, 2, device=d),
        lambda d: torch.ones(3, 2, device=d),
        lambda d: torch.full((3, 2), 7.0, device=d),
        lambda d: torch.arange(6, device=d),
        lambda d: torch.linspace(0, 1, 6, device=d),
        lambda d: torch.eye(3, device=d),
        lambda d: torch.randn(3, 2, device=d),
        lambda d: torch.rand(3, 2, device=d),
        lambda d: torch.randint(0, 10, (3, 2), device=d),
        lambda d: torch.randperm(6, device=d),
        lambda d: torch.tensor([[1.0, 2.0]], device=d),
        lambda d: torch.empty_strided((2, 3), (1, 2), device=d),
        lambda d: torch.zeros_like(torch.empty(2), device=d),
        lambda d: torch.tril_indices(3, 3, device=d),
    ],
    ids=[
        "empty", "zeros", "ones", "full", "arange", "linspace", "eye", "randn", "rand", "randint", "randperm",
        "tensor", "empty_strided", "zeros_like", "tril_indices",
    ],
)  # fmt: skip
def test_factory_on_neuron1(factory: Any) -> None:
    before0 = torch.neuron.memory_allocated(0)
    before1 = torch.neuron.memory_allocated(1)
    t = factory("neuron:1")
    assert t.device == N1
    assert t.untyped_storage().device == N1
    assert torch.neuron.memory_allocated(1) > before1
    assert torch.neuron.memory_allocated(0) == before0
    assert torch.neuron.current_device() == 0


def test_factory_values_match_cpu() -> None:
    assert torch.equal(torch.arange(2, 11, 3, device="neuron:1").cpu(), torch.arange(2, 11, 3))
    assert torch.equal(torch.linspace(-1, 1, 5, device="neuron:1").cpu(), torch.linspace(-1, 1, 5))
    assert torch.equal(torch.eye(2, 3, device="neuron:1").cpu(), torch.eye(2, 3))
    assert torch.equal(torch.full((2,), 7, device="neuron").cpu(), torch.full((2,), 7))
    assert torch.full((2,), 7, device="neuron").dtype == torch.int64


# --------------------------------------------------------------------------- C++ errors become Python errors


def test_mm_shape_mismatch_is_a_runtime_error_naming_the_op() -> None:
    a = torch.randn(2, 3, device="neuron")
    b = torch.randn(4, 5, device="neuron")
    with pytest.raises(RuntimeError) as info:
        torch.mm(a, b)
    msg = str(info.value)
    assert "mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)" in msg
    assert re.search(r"aten::mm on neuron:0", msg), msg


def test_index_errors_keep_their_python_type() -> None:
    x = torch.ones(3, device="neuron")
    # found by the host kernel when it runs: raised at the next synchronisation point (asynchronous
    # execution, issue 12), with its own type, the op and the launching line
    torch.index_select(x, 0, torch.tensor([1], device="neuron"))  # the first launch of a signature: on the host
    out = torch.index_select(x, 0, torch.tensor([5], device="neuron"))
    with pytest.raises(IndexError, match=r"(?s)aten::index_select launched at .*test_device_ops.py:\d+ .*"
                       r"index out of range in self.*aten::index_select on neuron:0"):
        out.cpu()
    with pytest.raises(IndexError, match=r"index 4 is out of bounds for dimension 0 with size 3"):
        x[torch.tensor([4])].cpu()
    with pytest.raises(RuntimeError, match=r"shape '\[5\]' is invalid for input of size 3"):
        x.view(5)


def test_device_still_works_after_errors() -> None:
    x = torch.ones(3, device="neuron")
    for _ in range(3):
        with pytest.raises(RuntimeError):
            torch.mm(torch.ones(2, 3, device="neuron"), torch.ones(2, 3, device="neuron"))
    assert (x + 1).sum().item() == 6.0
