"""Issue 11, "Device plumbing a PrivateUse1 backend is expected to have" (torch.cuda / torch_openreg parity)."""

from __future__ import annotations

from tests._neuron_child import run_child, run_child_process

INIT = """
facts = {"before": torch.neuron.is_initialized()}
torch.neuron.init()
facts["after"] = torch.neuron.is_initialized()
facts["stats_untouched"] = torch.neuron.memory_allocated(0)
facts["capability"] = list(torch.neuron.get_device_capability())
facts["capability_1"] = list(torch.neuron.get_device_capability("neuron:1"))
emit(facts)
"""


def test_init_and_device_capability() -> None:
    facts = run_child(INIT, outcomes=True)
    assert facts["before"] is False and facts["after"] is True and facts["stats_untouched"] == 0
    assert facts["capability"] == [3, 0] and facts["capability_1"] == [3, 0]  # trn2: NeuronCore-v3
    assert run_child(INIT, env={"TORCHNEURON_LAB_PROFILE": "trn1"}, outcomes=True)["capability"] == [2, 0]


PINNED = """
x = torch.arange(6.0)
p = x.pin_memory()
pn = x.pin_memory("neuron")
facts = {
    "plain": x.is_pinned(),
    "pinned": [p.is_pinned(), pn.is_pinned(), p[2:].is_pinned(), p.device.type],
    "values": p.tolist(),
    "to_neuron": p.to("neuron", non_blocking=True).tolist(),
    "dataloader_pinned": [b.is_pinned() for b in torch.utils.data.DataLoader(torch.arange(4.0), batch_size=2, pin_memory=True)],
}
addr = p.data_ptr()
del p, pn
facts["freed_not_pinned"] = torch.empty(6).is_pinned()
emit(facts)
"""


def test_pin_memory_pins_host_memory_for_neuron() -> None:
    facts = run_child(PINNED, outcomes=True)
    assert facts["plain"] is False
    assert facts["pinned"] == [True, True, True, "cpu"]
    assert facts["values"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert facts["to_neuron"] == facts["values"]
    assert facts["dataloader_pinned"] == [True, True]
    assert facts["freed_not_pinned"] is False


METADATA_AND_SERIALIZATION = """
import io
x = torch.arange(4.0, device="neuron")
torch._C._set_tensor_metadata(x, {"neuron.layout_hint": True, "neuron.cast": False})
facts = {"meta": torch._C._get_tensor_metadata(x), "plain_meta": torch._C._get_tensor_metadata(torch.ones(1, device="neuron"))}
buf = io.BytesIO()
a = torch.arange(6.0, device="neuron:1")
torch.save({"x": x, "views": [a[:3], a[2:]], "a": a}, buf)
buf.seek(0)
d = torch.load(buf)
facts["meta_after_load"] = torch._C._get_tensor_metadata(d["x"])
facts["meta_after_detach"] = torch._C._get_tensor_metadata(x.detach())
v1, v2 = d["views"]
v1[2] = 100.0
facts["shared_after_load"] = [v2.tolist(), d["a"].tolist(),
    v1.untyped_storage().data_ptr() == v2.untyped_storage().data_ptr() == d["a"].untyped_storage().data_ptr(),
    str(v1.device)]
emit(facts)
"""


def test_backend_metadata_and_view_sharing_survive_save_and_load() -> None:
    facts = run_child(METADATA_AND_SERIALIZATION, outcomes=True)
    assert facts["meta"] == {"neuron.layout_hint": True, "neuron.cast": False}
    assert facts["plain_meta"] == {}
    assert facts["meta_after_load"] == facts["meta"]
    assert facts["meta_after_detach"] == facts["meta"]
    assert facts["shared_after_load"] == [
        [100.0, 3.0, 4.0, 5.0],
        [0.0, 1.0, 100.0, 3.0, 4.0, 5.0],
        True,
        "neuron:1",
    ]


GENERATORS = """
import copy
g = torch.Generator("neuron")
g.manual_seed(5)
facts = {"offset_fresh": g.get_offset()}
torch.rand(1000, device="neuron", generator=g)
facts["offset_after_1000_floats"] = g.get_offset()
tail = torch.rand(5, device="neuron", generator=g).tolist()
g.manual_seed(5)
g.set_offset(1000)
facts["replayed_from_offset"] = torch.rand(5, device="neuron", generator=g).tolist() == tail
h = copy.deepcopy(g)
facts["deepcopy"] = [type(h).__name__, str(h.device),
                     torch.randn(4, device="neuron", generator=g).tolist() == torch.randn(4, device="neuron", generator=h).tolist()]
facts["huge_offset"] = outcome(lambda: g.set_offset(2**60))
emit(facts)
"""


def test_generator_offsets_and_deepcopy() -> None:
    facts = run_child(GENERATORS, outcomes=True)
    assert facts["offset_fresh"] == 0
    assert facts["offset_after_1000_floats"] == 1000  # one 32-bit draw per float32
    assert facts["replayed_from_offset"] is True
    assert facts["deepcopy"] == ["Generator", "neuron:0", True]
    assert facts["huge_offset"]["error"] == "RuntimeError"
    assert "beyond the supported" in facts["huge_offset"]["message"]


INVALID_INDEX = """
facts = {
    "empty": outcome(lambda: torch.empty(2, device="neuron:5")),
    "to": outcome(lambda: torch.ones(2).to("neuron:7")),
    "set_device": outcome(lambda: torch.neuron.set_device(5)),
    "set_device_is_value_error_too": isinstance(__import__("torchneuron_lab.device.memory", fromlist=["x"]).InvalidDeviceIndexError("x"), ValueError),
}
emit(facts)
"""


def test_invalid_device_index_raises_runtime_error_like_cuda() -> None:
    facts = run_child(INVALID_INDEX, outcomes=True)
    msg = "invalid neuron device index 5: there are 2 emulated neuron devices (neuron:0 .. neuron:1)"
    assert facts["empty"] == {"error": "RuntimeError", "message": msg}
    assert facts["to"]["error"] == "RuntimeError" and facts["to"]["message"].startswith(
        "invalid neuron device index 7"
    )
    assert facts["set_device"]["error"] == "InvalidDeviceIndexError"
    assert facts["set_device_is_value_error_too"] is True


LEGACY_PROFILER = """
with torch.autograd.profiler.profile(use_device="neuron") as prof:
    x = torch.ones(128, 128, device="neuron")
    for _ in range(3):
        y = x @ x
rows = {e.key: e for e in prof.key_averages()}
emit({"mm_count": rows["aten::mm"].count,
      "mm_device_us_positive": rows["aten::mm"].device_time_total > 0,
      "all_non_negative": all(e.device_time_total >= 0 and e.cpu_time_total >= 0 and e.self_device_time_total >= 0
                              for e in rows.values())})
"""


def test_legacy_profiler_gives_positive_device_times_quietly() -> None:
    facts, stderr = run_child_process(LEGACY_PROFILER, outcomes=True)
    assert facts["mm_count"] == 3
    assert facts["mm_device_us_positive"] is True and facts["all_non_negative"] is True
    assert len(stderr) < 2000  # was 18 MB of C++ backtraces


def test_quantized_tensors_name_the_limitation() -> None:
    facts = run_child("""
q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
emit({"to": outcome(lambda: q.to("neuron")), "empty": outcome(lambda: torch._empty_affine_quantized((2,), dtype=torch.quint8, device="neuron"))})
""", outcomes=True)
    for name in ("to", "empty"):
        assert facts[name]["error"] == "NotImplementedError"
        assert "would make a quantized tensor on the emulated neuron device" in facts[name]["message"]
