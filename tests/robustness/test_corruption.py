"""Issue 10, "Silent corruption and wrong semantics".

Classes closed:
- every size entering the allocator is validated (a request beyond the device capacity is an out-of-memory
  error before any rounding can overflow; a negative byte count never becomes a size_t);
- aliasing between arguments survives the move to host kernels: arguments sharing a neuron storage get
  CPU aliases sharing one storage, so every internal/partial overlap check ATen does on CPU holds;
- non-strided layouts (sparse, sparse compressed, quantized) raise one NotImplementedError naming the
  limitation at the first op that would create or use them on neuron;
- deterministic mode fills uninitialised memory (NaN / integer max) like CPU and CUDA.
"""

from __future__ import annotations

from tests.robustness._child import run

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
    facts = run(ALLOCATOR_SIZES, env={"TORCHNEURON_LAB_HBM_BYTES": str(256 << 20)})
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
    facts = run(OVERLAP)
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
q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
facts = {
    "coo_to": outcome(lambda: torch.eye(3).to_sparse().to("neuron")),
    "coo_factory": outcome(lambda: torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,), device="neuron")),
    "empty_sparse": outcome(lambda: torch.empty(3, layout=torch.sparse_coo, device="neuron")),
    "csr_use": outcome(lambda: torch.eye(3).to_sparse_csr().to("neuron").to_dense()),
    "quantized_to": outcome(lambda: q.to("neuron")),
    "quantize_on_neuron": outcome(lambda: torch.quantize_per_tensor(torch.ones(3, device="neuron"), 0.1, 0, torch.qint8)),
    "to_sparse_on_neuron": outcome(lambda: torch.eye(3, device="neuron").to_sparse()),
    "dense_still_fine": outcome(lambda: torch.eye(2, device="neuron") * 2),
}
emit(facts)
"""


def test_non_strided_layouts_raise_one_clear_error() -> None:
    facts = run(LAYOUTS)
    head = "neuron tensors must be dense and strided (torch.strided, not quantized): "
    expected_what = {
        "coo_to": "sparse",
        "coo_factory": "sparse",
        "empty_sparse": "sparse",
        "csr_use": "sparse compressed (CSR/CSC/BSR/BSC)",
        "quantized_to": "quantized",
        "quantize_on_neuron": "quantized",
        "to_sparse_on_neuron": "Sparse",
    }
    for name, what in expected_what.items():
        assert facts[name]["error"] == "NotImplementedError", (name, facts[name])
        message = facts[name]["message"]
        assert (
            message.startswith(head)
            and f"would make a {what} tensor on the emulated neuron device" in message
        )
    assert "aten::quantize_per_tensor" in facts["quantize_on_neuron"]["message"]
    assert facts["dense_still_fine"] == {"value": [[2.0, 0.0], [0.0, 2.0]]}


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
    facts = run(DETERMINISTIC)
    assert facts["off"] == [7.0] and facts["fill_off"] == [7.0]
    assert facts["float"] is True and facts["complex_nan"] is True and facts["empty_like"] is True
    assert facts["int32"] == [2**31 - 1] * 3
    assert facts["int64_strided"] == [2**63 - 1] * 2
    assert facts["bool"] == [True, True]
    assert facts["resize_growth"] == [[0.0, 0.0], True]
