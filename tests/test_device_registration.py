"""Registration of the emulated ``neuron`` device: idempotence, ``torch.neuron``, the device guard,
configuration and the ``torch.backends`` autoload entry point.

Tests that need a fresh interpreter (configuration before first use, environment overrides, a
re-import, autoload) run a short script in a subprocess that prints one JSON line of facts; the
assertions are made here on that data.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import subprocess
import sys
from typing import Any

import pytest
import torch

import torchneuron_lab
import torchneuron_lab.device as neuron_device
from tests._neuron_child import ROOT, child_env, run_child

# --------------------------------------------------------------------------- idempotent registration


def test_register_twice_changes_nothing() -> None:
    module_before = torch.neuron
    is_neuron_before = torch.Tensor.is_neuron
    neuron_method_before = torch.Tensor.neuron
    torchneuron_lab.register_device()
    torchneuron_lab.register_device()
    neuron_device.register()
    assert neuron_device.is_registered() is True
    assert torch._C._get_privateuse1_backend_name() == "neuron"
    assert torch.neuron is module_before
    assert torch.Tensor.is_neuron is is_neuron_before
    assert torch.Tensor.neuron is neuron_method_before
    assert torch.get_device_module("neuron") is torch.neuron
    assert torch.empty(3, device="neuron").device == torch.device("neuron", torch.neuron.current_device())


def test_import_again_returns_the_same_module() -> None:
    import importlib

    again = importlib.import_module("torchneuron_lab")
    assert again is torchneuron_lab
    assert again.__version__ == "0.1.0"
    assert sorted(again.__all__) == sorted(
        ["__version__", "load_ipython_extension", "register_device", "unload_ipython_extension"]
    )


def test_reimport_after_purging_modules_keeps_one_device() -> None:
    facts = run_child(
        """
        import json, sys
        import torch, torchneuron_lab
        first_module = torch.neuron
        a = torch.ones(4, device="neuron")
        for name in [n for n in sys.modules if n.startswith("torchneuron_lab")]:
            del sys.modules[name]
        import torchneuron_lab as again
        again.register_device()
        b = torch.ones(4, device="neuron")
        print(json.dumps({
            "fresh_module": again is not torchneuron_lab,
            "registered": again.device.is_registered(),
            "same_device_module": torch.neuron is first_module,
            "backend_name": torch._C._get_privateuse1_backend_name(),
            "sum": (a + b).sum().item(),
            "allocated": torch.neuron.memory_allocated(0),
            "new_lib_allocated": again.device._backend.lib().memory_stats(0)["allocated_bytes"]["all"]["current"],
        }))
        """
    )
    assert facts == {
        "fresh_module": True,
        "registered": True,
        "same_device_module": True,
        "backend_name": "neuron",
        "sum": 8.0,
        "allocated": 1024,  # a and b: 16 bytes each, rounded to 512
        "new_lib_allocated": 1024,  # the re-imported package sees the same allocator
    }


# --------------------------------------------------------------------------- torch.neuron mirrors torch.cuda

CUDA_NAMES = (
    "is_available", "is_initialized", "device_count", "current_device", "set_device", "device", "device_of",
    "synchronize", "get_device_name", "get_device_properties", "is_bf16_supported",
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved", "memory_stats",
    "memory_stats_as_nested_dict", "memory_summary", "reset_peak_memory_stats", "reset_accumulated_memory_stats",
    "reset_max_memory_allocated", "empty_cache", "mem_get_info", "memory_snapshot", "manual_seed",
    "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state", "set_rng_state", "get_rng_state_all",
    "set_rng_state_all", "default_generators", "memory",
)  # fmt: skip


@pytest.mark.parametrize("name", CUDA_NAMES)
def test_torch_neuron_has_the_torch_cuda_name(name: str) -> None:
    assert hasattr(torch.cuda, name), f"test list is wrong: torch.cuda has no {name}"
    assert hasattr(torch.neuron, name), f"torch.neuron lacks torch.cuda's {name!r}"


@pytest.mark.parametrize("name", ["_record_memory_history", "_snapshot", "_dump_snapshot", "memory_stats"])
def test_torch_neuron_memory_submodule_mirrors_torch_cuda_memory(name: str) -> None:
    assert getattr(torch.neuron.memory, name) is getattr(torch.neuron, name)
    assert hasattr(torch.cuda.memory, name)


@pytest.mark.parametrize(
    "name",
    [
        "memory_stats", "memory_stats_as_nested_dict", "memory_summary", "memory_allocated", "max_memory_allocated",
        "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats", "reset_accumulated_memory_stats",
        "empty_cache", "mem_get_info", "synchronize", "set_device", "manual_seed", "manual_seed_all",
        "get_rng_state", "set_rng_state", "_record_memory_history",
    ],
)  # fmt: skip
def test_parameter_names_match_torch_cuda(name: str) -> None:
    cuda_fn = getattr(torch.cuda, name, None) or getattr(torch.cuda.memory, name)
    expected = list(inspect.signature(cuda_fn).parameters)
    assert list(inspect.signature(getattr(torch.neuron, name)).parameters) == expected


def test_rng_state_defaults_name_the_neuron_device() -> None:
    assert inspect.signature(torch.neuron.get_rng_state).parameters["device"].default == "neuron"


def test_is_available_and_device_properties() -> None:
    assert torch.neuron.is_available() is True
    props = torch.neuron.get_device_properties(1)
    assert props["index"] == 1
    assert props["total_memory"] == neuron_device.current_config()["hbm_bytes"]
    assert props["emulated"] is True
    assert props["profile"] == neuron_device.current_config()["profile"]
    # float32 too: torch.autocast("neuron", dtype=torch.float32) runs (casts nothing), as CUDA's autocast
    assert torch.neuron.get_amp_supported_dtype() == [torch.bfloat16, torch.float16, torch.float32]


# --------------------------------------------------------------------------- torch.accelerator


def test_torch_accelerator_is_neuron() -> None:
    assert torch.accelerator.is_available() is True
    assert torch.accelerator.current_accelerator() == torch.device("neuron")
    assert torch.accelerator.device_count() == torch.neuron.device_count() == 2


def test_torch_accelerator_set_device_index_moves_new_tensors() -> None:
    assert torch.accelerator.current_device_index() == 0
    torch.accelerator.set_device_index(1)
    try:
        assert torch.neuron.current_device() == 1
        assert torch.empty(2, device="neuron").device == torch.device("neuron", 1)
    finally:
        torch.accelerator.set_device_index(0)
    assert torch.empty(2, device="neuron").device == torch.device("neuron", 0)


# --------------------------------------------------------------------------- tensor / module methods


def test_tensor_neuron_and_is_neuron() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    y = x.neuron()
    assert y.device == torch.device("neuron", 0)
    assert y.is_neuron is True and x.is_neuron is False
    assert y.shape == (2, 3) and y.dtype == torch.float32
    assert y.cpu().tolist() == x.tolist()
    z = x.neuron(1)
    assert z.device == torch.device("neuron", 1)
    assert z.untyped_storage().device == torch.device("neuron", 1)
    assert y.neuron() is y  # already there: no copy, like x.cuda()


def test_module_neuron_moves_parameters_and_buffers() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    weight = model[0].weight.detach().clone()
    returned = model.neuron(1)
    assert returned is model
    devices = {t.device for t in [*model.parameters(), *model.buffers()]}
    assert devices == {torch.device("neuron", 1)}
    assert torch.equal(model[0].weight.cpu(), weight)
    assert model[1].num_batches_tracked.device == torch.device("neuron", 1)


def test_storage_neuron_method() -> None:
    s = torch.UntypedStorage(8).neuron()
    assert s.device == torch.device("neuron", 0)
    assert s.is_neuron is True
    assert s.nbytes() == 8


# --------------------------------------------------------------------------- device guard


def test_device_count_current_and_set_device() -> None:
    assert torch.neuron.device_count() == 2
    assert torch.neuron.current_device() == 0
    torch.neuron.set_device(1)
    try:
        assert torch.neuron.current_device() == 1
        assert torch.empty(2, device="neuron").device == torch.device("neuron", 1)
        assert torch.randn(2, device="neuron").device == torch.device("neuron", 1)
        assert torch.tensor([1.0]).to("neuron").device == torch.device("neuron", 1)
    finally:
        torch.neuron.set_device("neuron:0")
    assert torch.neuron.current_device() == 0
    assert torch.empty(2, device="neuron").device == torch.device("neuron", 0)


@pytest.mark.parametrize("spec", [1, "neuron:1", torch.device("neuron", 1)])
def test_device_context_changes_where_new_tensors_go(spec: Any) -> None:
    with torch.neuron.device(spec):
        assert torch.neuron.current_device() == 1
        assert torch.empty(2, device="neuron").device == torch.device("neuron", 1)
        assert torch.zeros(2, device="neuron").device == torch.device("neuron", 1)
    assert torch.neuron.current_device() == 0
    assert torch.empty(2, device="neuron").device == torch.device("neuron", 0)


def test_device_context_nests_and_restores_on_exception() -> None:
    with torch.neuron.device(1):
        with pytest.raises(KeyError), torch.neuron.device(0):
            assert torch.empty(1, device="neuron").device.index == 0
            raise KeyError("boom")
        assert torch.neuron.current_device() == 1
        assert torch.empty(1, device="neuron").device.index == 1
    assert torch.neuron.current_device() == 0


def test_device_of_follows_the_tensor() -> None:
    x1 = torch.empty(1, device="neuron:1")
    with torch.neuron.device_of(x1):
        assert torch.neuron.current_device() == 1
    with torch.neuron.device_of(torch.empty(1)):  # CPU tensor: no change
        assert torch.neuron.current_device() == 0
    assert torch.neuron.current_device() == 0


def test_ops_follow_their_inputs_not_the_current_device() -> None:
    x1 = torch.ones(3, device="neuron:1")
    assert torch.neuron.current_device() == 0
    assert (x1 * 2).device == torch.device("neuron", 1)
    assert torch.zeros_like(x1).device == torch.device("neuron", 1)
    assert x1.new_zeros(2).device == torch.device("neuron", 1)
    assert torch.neuron.current_device() == 0


def test_invalid_device_indices_say_how_many_there_are() -> None:
    with pytest.raises(ValueError, match=r"index 5 is out of range; valid indices are 0\.\.1"):
        torch.neuron.set_device(5)
    with pytest.raises(  # RuntimeError, as CUDA raises for an invalid device ordinal (issue 11)
        RuntimeError, match=r"invalid neuron device index 5: there are 2 emulated neuron devices"
    ):
        torch.empty(2, device="neuron:5")
    with pytest.raises(RuntimeError, match=r"invalid neuron device index 7"):
        torch.ones(2).to("neuron:7")
    with pytest.raises(ValueError, match=r"Expected a neuron device, got 'cuda:0'"):
        torch.neuron.set_device("cuda:0")
    assert torch.neuron.current_device() == 0


# --------------------------------------------------------------------------- configuration


def test_configure_with_the_same_values_after_use_is_accepted() -> None:
    torch.empty(1, device="neuron")
    cfg = neuron_device.current_config()
    assert neuron_device.configure(**cfg) == cfg


def test_configure_after_first_use_raises_a_clear_error_in_process() -> None:
    torch.empty(1, device="neuron")
    before = neuron_device.current_config()
    with pytest.raises(
        RuntimeError, match=r"already in use.*configure\(\) must be called before the first neuron"
    ):
        neuron_device.configure(num_devices=before["num_devices"] + 1)
    assert neuron_device.current_config() == before
    assert torch.neuron.device_count() == before["num_devices"]


@pytest.mark.parametrize("bad", [{"num_devices": 0}, {"num_devices": 65}, {"hbm_bytes": 1000}])
def test_configure_rejects_out_of_range_values(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="num_devices must be an int in|hbm_bytes must be an int in"):
        neuron_device.configure(**bad)


def test_env_override_then_configure_before_and_after_first_use() -> None:
    facts = run_child(
        """
        import json
        import torch, torchneuron_lab
        from torchneuron_lab import device as dev
        out = {
            "env_count": torch.neuron.device_count(),
            "accel_count": torch.accelerator.device_count(),
            "env_config": dev.current_config()["num_devices"],
            "started_at_import": torch.neuron.is_initialized(),
        }
        dev.configure(num_devices=4, hbm_bytes=256 << 20)   # before first use: allowed
        out["configured_count"] = torch.neuron.device_count()
        out["capacity"] = torch.neuron.mem_get_info(3)[1]
        out["last_device"] = str(torch.empty(1, device="neuron:3").device)
        out["started"] = torch.neuron.is_initialized()
        try:
            dev.configure(num_devices=2)
            out["error"] = None
        except RuntimeError as e:
            out["error"] = str(e)
        out["same_again"] = dev.configure(num_devices=4, hbm_bytes=256 << 20)["num_devices"]
        out["count_after"] = torch.neuron.device_count()
        print(json.dumps(out))
        """,
        env={"TORCHNEURON_LAB_NUM_DEVICES": "3"},
    )
    assert facts["env_count"] == 3
    assert facts["accel_count"] == 3
    assert facts["env_config"] == 3
    assert facts["started_at_import"] is False
    assert facts["configured_count"] == 4
    assert facts["capacity"] == 256 << 20
    assert facts["last_device"] == "neuron:3"
    assert facts["started"] is True
    assert facts["error"] is not None
    assert "already in use (4 devices of 268435456 bytes)" in facts["error"]
    assert "configure() must be called before the first neuron tensor is created" in facts["error"]
    assert facts["same_again"] == 4
    assert facts["count_after"] == 4


def test_bad_env_value_names_the_variable() -> None:
    env = child_env({"TORCHNEURON_LAB_NUM_DEVICES": "two", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    proc = subprocess.run(
        [sys.executable, "-c", "import torchneuron_lab"],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "ValueError: TORCHNEURON_LAB_NUM_DEVICES='two' is not an integer" in proc.stderr


# --------------------------------------------------------------------------- autoload entry point


def _entry_point() -> importlib.metadata.EntryPoint | None:
    for ep in importlib.metadata.entry_points(group="torch.backends"):
        if ep.name == "torchneuron_lab":
            return ep
    return None


def test_torch_backends_entry_point_is_declared() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points."torch.backends"]' in text
    assert 'torchneuron_lab = "torchneuron_lab:_autoload"' in text


def test_import_torch_alone_makes_neuron_available() -> None:
    ep = _entry_point()
    if ep is None:
        pytest.skip("torchneuron-lab is not pip-installed (pip install -e .): no torch.backends entry point")
    assert ep.value == "torchneuron_lab:_autoload"
    facts = run_child(
        """
        import json, sys
        import torch
        x = torch.randn(2, device='neuron')
        print(json.dumps({
            "device": str(x.device),
            "imported": "torchneuron_lab" in sys.modules,
            "accelerator": str(torch.accelerator.current_accelerator()),
            "has_module": hasattr(torch, "neuron"),
        }))
        """
    )
    assert facts == {"device": "neuron:0", "imported": True, "accelerator": "neuron", "has_module": True}


def test_device_properties_are_an_object_with_cudas_attributes() -> None:
    # a dict: props.total_memory / props.major / props.multi_processor_count raised AttributeError
    p = torch.neuron.get_device_properties(1)
    assert (p.major, p.minor) == torch.neuron.get_device_capability(1)
    assert p.total_memory == torch.neuron.mem_get_info(1)[1]
    assert p.name == torch.neuron.get_device_name(1) and p.index == 1
    assert p.multi_processor_count == torch.get_num_threads() and p.is_integrated is False
    assert p["total_memory"] == p.total_memory  # the dict form of earlier versions
    assert repr(p).startswith("_NeuronDeviceProperties(name='Emulated NeuronCore")


def test_device_queries_validate_and_negative_indices_do_nothing_as_cudas() -> None:
    # get_device_name(5) and get_device_name("cpu") answered; set_device(-1) raised
    with pytest.raises(RuntimeError, match="Invalid device"):
        torch.neuron.get_device_name(5)
    with pytest.raises(ValueError, match="Expected a neuron device"):
        torch.neuron.get_device_name("cpu")
    before = torch.neuron.current_device()
    torch.neuron.set_device(-1)
    with torch.neuron.device(-1):
        assert torch.neuron.current_device() == before
    assert torch.neuron.current_device() == before


def test_torch_neuron_memory_is_importable_as_a_module() -> None:
    # `from torch.cuda.memory import _record_memory_history` is the form torch's memory docs use
    import importlib

    mod = importlib.import_module("torch.neuron.memory")
    assert mod is torch.neuron.memory
    from torch.neuron.memory import _record_memory_history  # noqa: F401
