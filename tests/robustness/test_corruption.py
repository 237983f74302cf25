"""Issue 10, "Silent corruption and wrong semantics".

Classes closed:
- every size entering the allocator is validated (a request beyond the device capacity is an out-of-memory
  error before any rounding can overflow; a negative byte count never becomes a size_t);
- aliasing between arguments survives the move to host kernels: arguments sharing a neuron storage get
  CPU aliases sharing one storage, so every internal/partial overlap check ATen does on CPU holds;
- non-strided layouts (sparse, sparse compressed, quantized) raise one NotImplementedError naming the
  limitation at the boundary: the op that would make one on neuron (a composite kernel such as _to_copy
  outranks the backend fallback, so layouts.cpp registers the error for SparseCsrPrivateUse1 directly);
- deterministic mode fills uninitialised memory (NaN / integer max) like CPU and CUDA.
"""

from __future__ import annotations

from tests._neuron_child import run_child

ALLOCATOR_SIZES = """
C = torchneuron_lab.device._backend.lib()
before = torch.neuron.memory_stats()
def storage_resize(n):
    s = torch.UntypedStorage(16, device="neuron")
    s.resize_(n)
    return s.nbytes()
facts = {
    "storage_minus_1": outcome(lambda: storage_resize(-1)),
    "storage_2**62": outcome(lambda: storage_resize(2**62)),
    "empty_2**62_bytes": outcome(lambda: torch.empty(2**60, dtype=torch.float32, device="neuron").numel()),
    "storage_ok": outcome(lambda: storage_resize(1000)),
}
# later independent tensors never share an address, and the stats are back where they started
live = [torch.full((n,), float(i), device="neuron") for i, n in enumerate([1, 7, 128, 1000, 70000, 300000])]
ptrs = sorted((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in live)
facts["overlapping_blocks"] = sum(1 for (a, n), (b, _) in zip(ptrs, ptrs[1:]) if a + n > b)
facts["values_intact"] = [t.unique().tolist() for t in live]
del live
after = torch.neuron.memory_stats()
facts["allocated_delta"] = after["allocated_bytes.all.current"] - before["allocated_bytes.all.current"]
facts["requested_delta"] = after["requested_bytes.all.current"] - before["requested_bytes.all.current"]
facts["num_ooms"] = after["num_ooms"]
emit(facts)
"""


def test_sizes_are_validated_where_they_enter_the_allocator() -> None:
    facts = run_child(ALLOCATOR_SIZES, env={"TORCHNEURON_LAB_HBM_BYTES": str(256 << 20)}, outcomes=True)
    assert facts["storage_minus_1"] == {
        "error": "RuntimeError",
        "message": "Storage.resize_: the new size must be a non-negative number of bytes, got -1",
    }
    assert facts["storage_2**62"]["error"] == "OutOfMemoryError"
    assert facts["storage_2**62"]["message"].startswith(
        "Neuron out of memory. Tried to allocate 4194304.00 TiB"
    )
    assert facts["empty_2**62_bytes"]["error"] == "OutOfMemoryError"
    assert facts["storage_ok"] == {"value": 1000}
    assert facts["num_ooms"] == 2
    assert facts["overlapping_blocks"] == 0
    assert facts["values_intact"] == [[0.0], [1.0], [2.0], [3.0], [4.0], [5.0]]
    assert facts["allocated_delta"] == 0 and facts["requested_delta"] == 0


OVERLAP = """
def cases(dev):
    a8 = lambda: torch.arange(8, device=dev)
    m = lambda: torch.arange(9.0, device=dev).reshape(3, 3)
    def out_shifted():
        a = a8(); torch.add(a[:-1], 1, out=a[1:]); return a
    def expand_inplace():
        e = torch.zeros(1, device=dev).expand(4); e.add_(1); return e
    def index_put_self():
        a = a8(); a[a[:4]] = a[4:]; return a
    def disjoint_halves():
        a = a8(); a[:4].copy_(a[4:]); return a
    def same_view():
        a = a8(); a.copy_(a); return a
    def strided_disjoint():
        a = a8(); a[::2].add_(a[1::2]); return a
    def mul_out_alias():
        a = m(); torch.mul(a, a, out=a); return a
    def cat_out_alias():
        a = a8(); torch.cat([a[:2], a[2:4]], out=a[4:]); return a
    return {
        "copy_shifted": lambda: (lambda a: a[1:].copy_(a[:-1]))(a8()),
        "add_transpose": lambda: (lambda a: a.add_(a.t()))(m()),
        "out_shifted": out_shifted,
        "expand_inplace": expand_inplace,
        "index_put_self": index_put_self,
        "disjoint_halves": disjoint_halves,
        "same_view": same_view,
        "strided_disjoint": strided_disjoint,
        "mul_out_alias": mul_out_alias,
        "cat_out_alias": cat_out_alias,
    }
cpu, neuron = cases("cpu"), cases("neuron")
emit({k: {"cpu": outcome(cpu[k]), "neuron": outcome(neuron[k])} for k in cpu})
"""


def test_every_overlap_check_of_cpu_holds_on_neuron() -> None:
    facts = run_child(OVERLAP, outcomes=True)
    overlap = (
        "unsupported operation: some elements of the input tensor and the written-to tensor refer to a single "
        "memory location. Please clone() the tensor before performing the operation."
    )
    assert facts["copy_shifted"]["neuron"] == {"error": "RuntimeError", "message": overlap}
    assert facts["add_transpose"]["neuron"]["error"] == "RuntimeError"
    assert facts["add_transpose"]["neuron"]["message"].startswith(overlap)
    assert facts["disjoint_halves"]["neuron"] == {"value": [4, 5, 6, 7, 4, 5, 6, 7]}
    for name, pair in facts.items():
        if name.startswith("_"):
            continue
        cpu, neuron = pair["cpu"], pair["neuron"]
        if "error" in cpu:  # same exception; neuron's text adds where it ran
            assert neuron["error"] == cpu["error"] and neuron["message"].startswith(cpu["message"]), name
        else:
            assert neuron == cpu, name


LAYOUTS = """
import io
q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
crow, col, vals = torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.tensor([1.0, 2.0])
blocks = torch.ones(2, 1, 1)

def made(fn):  # what the call returned, if it returned (no neuron op can use a sparse compressed tensor)
    return lambda: (lambda t: f"{t.layout} on {t.device}")(fn())

def saved(t):
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    return buf

def unsafe_in_inference_mode(op, **layout):  # no autograd keys: the key BackendSelect computes decides
    with torch.inference_mode():
        return op(crow.to("neuron"), col.to("neuron"), vals.to("neuron"), [2, 2], device="neuron", **layout)

class WithCsrBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("adjacency", torch.eye(3).to_sparse_csr())

facts = {
    # sparse compressed: moving a CPU tensor to neuron
    "csr_to": outcome(made(lambda: torch.eye(3).to_sparse_csr().to("neuron"))),
    "csc_to": outcome(made(lambda: torch.eye(3).to_sparse_csc().to("neuron"))),
    "bsr_to": outcome(made(lambda: torch.eye(4).to_sparse_bsr((2, 2)).to("neuron"))),
    "bsc_to": outcome(made(lambda: torch.eye(4).to_sparse_bsc((2, 2)).to("neuron"))),
    "csr_to_dtype_copy": outcome(made(lambda: torch.eye(3).to_sparse_csr().to("neuron:1", torch.float64, copy=True))),
    "csr_dot_neuron": outcome(made(lambda: torch.eye(3).to_sparse_csr().neuron())),
    "module_to": outcome(made(lambda: WithCsrBuffer().to("neuron").adjacency)),
    "load_map_location": outcome(made(lambda: torch.load(saved(torch.eye(3).to_sparse_csr()), map_location="neuron"))),
    # sparse compressed: factories
    "csr_factory": outcome(made(lambda: torch.sparse_csr_tensor(crow, col, vals, (2, 2), device="neuron"))),
    "csc_factory": outcome(made(lambda: torch.sparse_csc_tensor(crow, col, vals, (2, 2), device="neuron"))),
    "bsr_factory": outcome(made(lambda: torch.sparse_bsr_tensor(crow, col, blocks, (2, 2), device="neuron"))),
    "compressed_factory_no_size": outcome(made(lambda: torch.sparse_compressed_tensor(
        crow, col, vals, layout=torch.sparse_csr, device="neuron"))),
    "csr_factory_neuron_members": outcome(made(lambda: torch.sparse_csr_tensor(
        crow.to("neuron"), col.to("neuron"), vals.to("neuron"), (2, 2)))),
    "ops_csr_tensor_neuron_members": outcome(made(lambda: torch.ops.aten.sparse_csr_tensor.crow_col_value_size(
        crow.to("neuron"), col.to("neuron"), vals.to("neuron"), [2, 2], device="neuron"))),
    "ops_unsafe_compressed_inference": outcome(made(lambda: unsafe_in_inference_mode(
        torch.ops.aten._sparse_compressed_tensor_unsafe, layout=torch.sparse_csr))),
    "ops_unsafe_csr_inference": outcome(made(lambda: unsafe_in_inference_mode(torch.ops.aten._sparse_csr_tensor_unsafe))),
    "empty_csr": outcome(made(lambda: torch.empty(2, 2, layout=torch.sparse_csr, device="neuron"))),
    "zeros_bsc": outcome(made(lambda: torch.zeros(2, 2, layout=torch.sparse_bsc, device="neuron"))),
    # sparse compressed: converting a neuron tensor
    "to_sparse_csr_on_neuron": outcome(made(lambda: torch.eye(3, device="neuron").to_sparse_csr())),
    "to_sparse_csc_layout_on_neuron": outcome(made(lambda: torch.eye(3, device="neuron").to_sparse(layout=torch.sparse_csc))),
    "to_sparse_bsr_on_neuron": outcome(made(lambda: torch.eye(4, device="neuron").to_sparse_bsr((2, 2)))),
    # the one path left open: empty_like dispatches on the CPU tensor alone; the first op raises
    "empty_like_csr": outcome(made(lambda: torch.empty_like(torch.eye(3).to_sparse_csr(), device="neuron"))),
    "empty_like_csr_then_use": outcome(lambda: torch.empty_like(torch.eye(3).to_sparse_csr(), device="neuron").to_dense()),
    # sparse COO: supported (made on neuron, its dense form CPU's)
    "coo_to": outcome(made(lambda: torch.eye(3).to_sparse().to("neuron"))),
    "coo_factory": outcome(made(lambda: torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,), device="neuron"))),
    "empty_coo": outcome(made(lambda: torch.empty(3, layout=torch.sparse_coo, device="neuron"))),
    "to_sparse_on_neuron": outcome(made(lambda: torch.eye(3, device="neuron").to_sparse())),
    "coo_dense_values": outcome(lambda: [torch.eye(3, device="neuron").to_sparse().to_dense().tolist(),
                                         torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,), device="neuron").to_dense().tolist()]),
    # quantized
    "quantized_to": outcome(made(lambda: q.to("neuron"))),
    "quantize_on_neuron": outcome(made(lambda: torch.quantize_per_tensor(torch.ones(3, device="neuron"), 0.1, 0, torch.qint8))),
    # what works stays working: dense neuron, and sparse compressed on the CPU
    "dense_still_fine": outcome(lambda: torch.eye(2, device="neuron") * 2),
    "dense_factories_fine": outcome(lambda: [torch.zeros(2, device="neuron").tolist(),
                                            torch.empty_like(torch.eye(2), device="neuron").shape[0]]),
    "cpu_csr_still_fine": outcome(lambda: torch.eye(3).to_sparse_csr() @ torch.arange(3.0)),
}
emit(facts)
"""

UNSUPPORTED = (
    "neuron tensors must be dense and strided (torch.strided, not quantized): {op} would make a {what} tensor on "
    "the emulated neuron device, which has no kernels for it. Keep it on the CPU, or convert it first (.to_dense() "
    "for sparse layouts, .dequantize() for quantized tensors, .to_padded_tensor() or .unbind() for nested "
    "tensors), then move it to neuron."
)
COMPRESSED = "sparse compressed (CSR/CSC/BSR/BSC)"


def test_non_strided_layouts_raise_one_clear_error_at_the_boundary() -> None:
    """Each entry point that would make a sparse compressed or quantized tensor on neuron raises the same
    NotImplementedError itself, naming the op; nothing is returned that a later op would reject. Sparse COO
    tensors are supported: each entry point makes one."""
    facts = run_child(LAYOUTS, outcomes=True)
    expected = {
        "csr_to": ("aten::_to_copy", COMPRESSED),
        "csc_to": ("aten::_to_copy", COMPRESSED),
        "bsr_to": ("aten::_to_copy", COMPRESSED),
        "bsc_to": ("aten::_to_copy", COMPRESSED),
        "csr_to_dtype_copy": ("aten::_to_copy", COMPRESSED),
        "csr_dot_neuron": ("aten::_to_copy", COMPRESSED),
        "module_to": ("aten::_to_copy", COMPRESSED),
        "load_map_location": ("aten::sparse_compressed_tensor.comp_plain_value_size", COMPRESSED),
        "csr_factory": ("aten::sparse_compressed_tensor.comp_plain_value_size", COMPRESSED),
        "csc_factory": ("aten::sparse_compressed_tensor.comp_plain_value_size", COMPRESSED),
        "bsr_factory": ("aten::sparse_compressed_tensor.comp_plain_value_size", COMPRESSED),
        "compressed_factory_no_size": ("aten::sparse_compressed_tensor.comp_plain_value", COMPRESSED),
        "csr_factory_neuron_members": ("aten::sparse_compressed_tensor.comp_plain_value_size", COMPRESSED),
        "ops_csr_tensor_neuron_members": ("aten::sparse_csr_tensor.crow_col_value_size", COMPRESSED),
        "ops_unsafe_compressed_inference": ("aten::_sparse_compressed_tensor_unsafe", COMPRESSED),
        "ops_unsafe_csr_inference": ("aten::_sparse_csr_tensor_unsafe", COMPRESSED),
        "empty_csr": ("aten::empty.memory_format", COMPRESSED),
        "zeros_bsc": ("aten::zeros", COMPRESSED),
        "to_sparse_csr_on_neuron": ("aten::_to_sparse_csr", COMPRESSED),
        "to_sparse_csc_layout_on_neuron": ("aten::_to_sparse", COMPRESSED),
        "to_sparse_bsr_on_neuron": ("aten::_to_sparse_bsr", COMPRESSED),
        "empty_like_csr_then_use": ("aten::_to_dense", COMPRESSED),
        "quantized_to": ("aten::empty_quantized", "quantized"),
        "quantize_on_neuron": ("aten::quantize_per_tensor", "quantized"),
    }
    for name, (op, what) in expected.items():
        assert facts[name] == {"error": "NotImplementedError", "message": UNSUPPORTED.format(op=op, what=what)}, (
            name, facts[name])
    assert facts["empty_like_csr"] == {"value": "torch.sparse_csr on neuron:0"}  # README: stays open
    for name in ("coo_to", "coo_factory", "empty_coo", "to_sparse_on_neuron"):
        assert facts[name] == {"value": "torch.sparse_coo on neuron:0"}, (name, facts[name])
    assert facts["coo_dense_values"] == {"value": [[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], [1.0, 2.0, 0.0]]}
    assert facts["dense_still_fine"] == {"value": [[2.0, 0.0], [0.0, 2.0]]}
    assert facts["dense_factories_fine"] == {"value": [[0.0, 0.0], 2]}
    assert facts["cpu_csr_still_fine"] == {"value": [0.0, 1.0, 2.0]}


DETERMINISTIC = """
import torch.utils.deterministic as det
def fresh():
    # a cached block that held 7s: without the fill, the new tensor shows them
    x = torch.full((64,), 7.0, device="neuron"); del x
    return torch.empty(64, device="neuron")
facts = {"off": fresh().unique().tolist()}
torch.use_deterministic_algorithms(True)
facts["float"] = fresh().isnan().all().item()
facts["int32"] = torch.empty(3, dtype=torch.int32, device="neuron").tolist()
facts["int64_strided"] = torch.empty_strided((2,), (2,), dtype=torch.int64, device="neuron").tolist()
facts["bool"] = torch.empty(2, dtype=torch.bool, device="neuron").tolist()
facts["complex_nan"] = torch.empty(2, dtype=torch.complex64, device="neuron").isnan().all().item()
facts["empty_like"] = torch.empty_like(torch.ones(2, device="neuron")).isnan().all().item()
r = torch.zeros(2, device="neuron"); r.resize_(4)
facts["resize_growth"] = [r[:2].tolist(), r[2:].isnan().all().item()]
det.fill_uninitialized_memory = False
facts["fill_off"] = fresh().unique().tolist()
emit(facts)
"""


def test_deterministic_mode_fills_uninitialised_memory_like_cpu() -> None:
    facts = run_child(DETERMINISTIC, outcomes=True)
    assert facts["off"] == [7.0] and facts["fill_off"] == [7.0]
    assert facts["float"] is True and facts["complex_nan"] is True and facts["empty_like"] is True
    assert facts["int32"] == [2**31 - 1] * 3
    assert facts["int64_strided"] == [2**63 - 1] * 2
    assert facts["bool"] == [True, True]
    assert facts["resize_growth"] == [[0.0, 0.0], True]


# --------------------------------------------------------------------------- found by a differential fuzzer

def _outcome(fn):  # the value or the exception (type, first line without the lab's suffix)
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e).split(" (while running")[0].splitlines()[0])
    return value


def _both(fn):
    return {dev: _outcome(lambda d=dev: fn(d)) for dev in ("cpu", "neuron")}


def test_an_argument_in_two_slots_is_one_tensor_as_on_cpu() -> None:
    # out= (or self of an in-place op) that is also an input was two CPU aliases: resizing the out did not
    # change the input (wrong sums, CPU's shape errors missing), and a strided view passed as self and src
    # escaped CPU's overlap check
    import torch

    def sum_out(d: str) -> object:
        t = torch.arange(1.0, 4.0, device=d)
        torch.sum(t, 0, out=t)
        return (tuple(t.shape), t.tolist())

    def sum_out_3d(d: str) -> object:
        t = torch.arange(12, dtype=torch.int32, device=d).reshape(2, 3, 2)
        torch.sum(t, 2, out=t)
        return t.tolist()

    def maximum_out(d: str) -> object:
        a = torch.tensor(2.0, device=d)
        torch.maximum(a, torch.ones(6, 1, device=d), out=a)
        return tuple(a.shape)

    def logical_xor_(d: str) -> object:
        a = torch.arange(1.0, 7.0, device=d).reshape(3, 2)
        a.logical_xor_(torch.ones(1, 3, 2, device=d))
        return tuple(a.shape)

    def scatter_add_self_view(d: str) -> object:
        x = torch.arange(1.0, 5.0, device=d)
        v = x[::2]
        v.scatter_add_(0, torch.tensor([0, 1], device=d), v)
        return x.tolist()

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "An output with one or more elements was resized"
        for fn in (sum_out, sum_out_3d, maximum_out, logical_xor_, scatter_add_self_view):
            got = _both(fn)
            assert got["neuron"] == got["cpu"], (fn.__name__, got)


def test_a_new_shape_of_a_trusted_structure_gets_cpus_layout_for_a_sized_out() -> None:
    # an empty out= sized like its transposed input on CPU, contiguous by the Meta kernel: the key matched
    # (the out's layout was not compared), its structure was trusted, and the fourth shape got Meta's strides
    import torch

    def layouts(d: str) -> list[tuple[int, ...]]:
        res = []
        for n in (2, 3, 4, 5, 6, 7):
            x = torch.arange(n * 3, dtype=torch.int32, device=d).reshape(n, 3).t()
            o = torch.empty(0, dtype=torch.int32, device=d)
            torch.neg(x, out=o)
            res.append(o.stride())
            t = torch.full((n, 1, 16), 5.0, device=d).unfold(0, 2, 1)
            res.append(torch.logical_or(t, torch.ones(n - 1, 1, 16, 2, device=d)).stride())
        return res

    assert layouts("neuron") == layouts("cpu")
