"""Device profiles: published figures for one logical NeuronCore of trn1 / trn2 / trn3.

A :class:`DeviceProfile` describes *one logical NeuronCore* (the unit a ``neuron:N`` device stands for):
its HBM capacity and bandwidth, the peak throughput of each engine class and its DMA bandwidth. The
emulator uses ``hbm_bytes`` as the allocator's capacity; the lab uses the rest only for
:func:`estimate_ns`, a roofline ESTIMATE of how long a kernel would take on real hardware. Nothing here
is measured: every figure is either published by AWS (see ``sources``) or derived from published
figures, and ``notes`` says which is which.

Units: bytes, bytes per second, floating-point operations per second (FLOP/s), nanoseconds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # typing only: the device layer may import tracing, but profiles needs no runtime import
    from torchneuron_lab.tracing.events import KernelEvent

__all__ = [
    "COMPUTE_ENGINES",
    "DEFAULT_PROFILE_NAME",
    "ESTIMATE_ENGINES",
    "PROFILES",
    "DeviceProfile",
    "annotate_estimates",
    "default_profile",
    "estimate_ns",
    "get_profile",
    "list_profiles",
]

GiB = 1024**3
TERA = 1e12
GIGA = 1e9

#: Engine classes that compute (their estimate is a compute/HBM roofline).
COMPUTE_ENGINES: tuple[str, ...] = ("tensor", "vector", "scalar", "gpsimd")
#: Every engine class :func:`estimate_ns` accepts ('dma' is a bandwidth-only estimate).
ESTIMATE_ENGINES: tuple[str, ...] = (*COMPUTE_ENGINES, "dma")

# dtype spellings that run at the tensor engine's BF16/FP16/TF32 rate (FP8 is faster on hardware; we
# charge it the BF16 rate, which over-estimates its time rather than inventing a figure).
_REDUCED_PRECISION = frozenset(
    {
        "bfloat16", "bf16", "float16", "fp16", "half", "tf32", "tensorfloat32",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
        "fp8", "cfp8",
    }
)


@dataclass(frozen=True)
class DeviceProfile:
    """Published (or derived-from-published) figures for ONE logical NeuronCore.

    Attributes:
        name: short key used by :func:`get_profile` (``"trn2"``).
        chip: the chip's marketing name (``"Trainium2"``).
        neuron_core: the NeuronCore generation (``"NeuronCore-v3"``).
        physical_cores_per_logical: physical NeuronCores grouped into one logical core (LNC degree).
        logical_cores_per_chip: logical NeuronCores one chip exposes at that LNC degree.
        hbm_bytes: device memory (HBM) available to one logical core, in bytes.
        hbm_bandwidth_bytes_per_s: HBM bandwidth share of one logical core, bytes/s.
        tensor_bf16_flops: tensor engine dense BF16/FP16/TF32 peak, FLOP/s.
        tensor_fp32_flops: tensor engine dense FP32 peak, FLOP/s.
        vector_flops: vector engine FP32 peak, FLOP/s.
        scalar_flops: scalar engine FP32 peak, FLOP/s.
        gpsimd_flops: GPSIMD engine elementwise throughput, FLOP/s (one op per element per cycle).
        dma_bandwidth_bytes_per_s: DMA bandwidth share of one logical core, bytes/s.
        sources: URLs / document titles the figures come from.
        notes: which figures are published per core, which are derived (and how), which are assumed.
    """

    name: str
    chip: str
    neuron_core: str
    physical_cores_per_logical: int
    logical_cores_per_chip: int
    hbm_bytes: int
    hbm_bandwidth_bytes_per_s: float
    tensor_bf16_flops: float
    tensor_fp32_flops: float
    vector_flops: float
    scalar_flops: float
    gpsimd_flops: float
    dma_bandwidth_bytes_per_s: float
    sources: tuple[str, ...] = ()
    notes: str = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
                raise ValueError(f"DeviceProfile {self.name!r}: {f.name} must be > 0, got {value!r}")

    def peak_flops(self, engine: str, dtype: Any = "float32") -> float:
        """Peak FLOP/s of ``engine`` ('tensor', 'vector', 'scalar', 'gpsimd') for ``dtype``.

        Only the tensor engine distinguishes dtypes (BF16/FP16/TF32/FP8 vs everything else, which is
        charged the FP32 rate). Vector/scalar/gpsimd use their published FP32 figure for every dtype.
        """
        engine = _normalise_engine(engine)
        if engine == "tensor":
            return self.tensor_bf16_flops if _is_reduced_precision(dtype) else self.tensor_fp32_flops
        if engine == "vector":
            return self.vector_flops
        if engine == "scalar":
            return self.scalar_flops
        if engine == "gpsimd":
            return self.gpsimd_flops
        raise ValueError(f"engine {engine!r} has no FLOP rate; compute engines are {', '.join(COMPUTE_ENGINES)}")

    def as_dict(self) -> dict[str, Any]:
        """The profile as a plain dict (JSON-serialisable)."""
        d = dataclasses.asdict(self)
        d["sources"] = list(self.sources)
        return d


def _normalise_engine(engine: str) -> str:
    if not isinstance(engine, str):
        raise TypeError(f"engine must be a str, got {type(engine).__name__}")
    e = engine.strip().lower()
    if e not in ESTIMATE_ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ESTIMATE_ENGINES)}")
    return e


def _dtype_name(dtype: Any) -> str:
    """'torch.bfloat16' / torch.bfloat16 / 'BF16' -> 'bfloat16' style lower-case name."""
    return str(dtype).strip().lower().removeprefix("torch.")


def _is_reduced_precision(dtype: Any) -> bool:
    return _dtype_name(dtype) in _REDUCED_PRECISION


_NEURON_DOCS = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest"

_TRN1 = DeviceProfile(
    name="trn1",
    chip="Trainium",
    neuron_core="NeuronCore-v2",
    physical_cores_per_logical=1,
    logical_cores_per_chip=2,
    hbm_bytes=16 * GiB,
    hbm_bandwidth_bytes_per_s=820 * GIGA / 2,
    tensor_bf16_flops=92 * TERA,
    tensor_fp32_flops=23 * TERA,
    vector_flops=2.3 * TERA,
    scalar_flops=2.9 * TERA,
    gpsimd_flops=128 * 1.4 * GIGA,
    dma_bandwidth_bytes_per_s=1 * TERA / 2,
    sources=(
        ("AWS Neuron docs, 'Trainium Architecture': "
        f"{_NEURON_DOCS}/general/arch/neuron-hardware/trainium.html"),
        ("AWS Neuron docs, 'NeuronCore-v2 Architecture': "
        f"{_NEURON_DOCS}/general/arch/neuron-hardware/neuron-core-v2.html"),
        ("AWS Neuron docs, 'Trainium/Inferentia2 Architecture Guide for NKI': "
        f"{_NEURON_DOCS}/nki/arch/trainium_inferentia2_arch.html"),
    ),
    notes=(
        "One logical core = one physical NeuronCore-v2 (trn1 supports LNC=1 only); a Trainium chip has 2. "
        "Published per chip: 32 GiB HBM at 820 GB/s, 1 TB/s DMA, 190 BF16 / 47.5 FP32 TFLOPS. "
        "DERIVED (chip figure / 2 cores): hbm_bytes 16 GiB, HBM bandwidth 410 GB/s, DMA 500 GB/s. "
        "Published per core (NKI guide): tensor 92 BF16/FP16/TF32 TFLOPS and 23 FP32 TFLOPS; "
        "NeuronCore-v2 page: vector 2.3 and scalar 2.9 FP32 TFLOPS. "
        "GPSIMD: no FLOPS figure is published; DERIVED as the NKI guide's data-path width (128 elements/cycle) "
        "x frequency (1.4 GHz), ASSUMING one operation per element per cycle."
    ),
)

_TRN2 = DeviceProfile(
    name="trn2",
    chip="Trainium2",
    neuron_core="NeuronCore-v3",
    physical_cores_per_logical=2,
    logical_cores_per_chip=4,
    hbm_bytes=24 * GiB,
    hbm_bandwidth_bytes_per_s=2.9 * TERA / 4,
    tensor_bf16_flops=2 * 79 * TERA,
    tensor_fp32_flops=181 * TERA / 4,
    vector_flops=2 * 1.0 * TERA,
    scalar_flops=2 * 1.2 * TERA,
    gpsimd_flops=2 * 128 * 1.2 * GIGA,
    dma_bandwidth_bytes_per_s=3.5 * TERA / 4,
    sources=(
        ("AWS Neuron docs, 'Trainium2 Architecture': "
        f"{_NEURON_DOCS}/general/arch/neuron-hardware/trainium2.html"),
        ("AWS Neuron docs, 'NeuronCore-v3 Architecture': "
        f"{_NEURON_DOCS}/about-neuron/arch/neuron-hardware/neuron-core-v3.html"),
        ("AWS Neuron docs, 'Logical NeuronCore configuration': "
        f"{_NEURON_DOCS}/general/arch/neuron-features/logical-neuroncore-config.html"),
        ("AWS Neuron docs, 'Trainium2 Architecture Guide for NKI': "
        f"{_NEURON_DOCS}/nki/about/trainium2_arch.html"),
    ),
    notes=(
        "DEFAULT profile. One logical core at the default LNC=2 = two physical NeuronCore-v3; a Trainium2 "
        "chip has 8 physical cores, i.e. 4 logical cores. Published per chip: 96 GiB HBM at 2.9 TB/s "
        "(the NKI guide rounds it to 3 TB/s), 3.5 TB/s DMA, 667 BF16 / 181 FP32 TFLOPS. "
        "DERIVED (chip figure / 4 logical cores): hbm_bytes 24 GiB (matches the documented 24 GB HBM bank "
        "shared by two physical cores), HBM bandwidth 725 GB/s, DMA 875 GB/s, tensor FP32 45.25 TFLOPS. "
        "Published per physical core (NeuronCore-v3 page), x2 for LNC=2: tensor 79 BF16/FP16/TF32 TFLOPS "
        "-> 158, vector 1 FP32 TFLOPS -> 2, scalar 1.2 FP32 TFLOPS -> 2.4. "
        "GPSIMD: no FLOPS figure is published; DERIVED as 128 elements/cycle (8 x 512-bit processors) x "
        "1.2 GHz (NKI guide) x 2 physical cores, ASSUMING one operation per element per cycle."
    ),
)

_TRN3 = DeviceProfile(
    name="trn3",
    chip="Trainium3",
    neuron_core="NeuronCore-v4",
    physical_cores_per_logical=2,
    logical_cores_per_chip=4,
    hbm_bytes=36 * GiB,
    hbm_bandwidth_bytes_per_s=4.9 * TERA / 4,
    tensor_bf16_flops=2 * 79 * TERA,
    tensor_fp32_flops=2 * 20 * TERA,
    vector_flops=2 * 1.2 * TERA,
    scalar_flops=2 * 1.2 * TERA,
    gpsimd_flops=2 * 128 * 1.2 * GIGA,
    dma_bandwidth_bytes_per_s=4.9 * TERA / 4,
    sources=(
        ("AWS Neuron docs, 'Trainium3 Architecture': "
        "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.29.1/_sources/about-neuron/arch/neuron-hardware/trainium3.rst"),
        ("AWS Neuron docs, 'NeuronCore-v4 Architecture': "
        f"{_NEURON_DOCS}/about-neuron/arch/neuron-hardware/neuron-core-v4.html"),
        ("AWS Neuron docs, 'Trainium3 Architecture Guide for NKI': "
        f"{_NEURON_DOCS}/nki/about/trainium3_arch.html"),
        ("AWS Neuron docs, 'Logical NeuronCore configuration': "
        f"{_NEURON_DOCS}/general/arch/neuron-features/logical-neuroncore-config.html"),
    ),
    notes=(
        "ASSUMED LNC=2 as on trn2 (the LNC page says LNC applies to Trn2 and Trn3 but states the default "
        "for Trn2 only): one logical core = two physical NeuronCore-v4, 4 logical cores per chip. "
        "Published per chip: 144 GiB HBM at 4.9 TB/s (the NKI guide says 4.7 TB/s), 4.9 TB/s DMA, "
        "671 BF16 / 183 FP32 TFLOPS. DERIVED (chip figure / 4 logical cores): hbm_bytes 36 GiB, HBM "
        "bandwidth 1.225 TB/s, DMA 1.225 TB/s. Published per physical core (NeuronCore-v4 page), x2 for "
        "LNC=2: tensor 79 BF16/FP16/TF32 -> 158 and 20 FP32 -> 40 TFLOPS, vector 1.2 -> 2.4 and scalar "
        "1.2 -> 2.4 FP32 TFLOPS. GPSIMD: no FLOPS figure is published; DERIVED as 128 elements/cycle x "
        "1.2 GHz (NKI guide) x 2 physical cores, ASSUMING one operation per element per cycle."
    ),
)

#: All known profiles by name.
PROFILES: Mapping[str, DeviceProfile] = {p.name: p for p in (_TRN1, _TRN2, _TRN3)}
#: The profile the emulated device uses unless configured otherwise: one trn2 logical NeuronCore.
DEFAULT_PROFILE_NAME = "trn2"


def list_profiles() -> list[str]:
    """Names accepted by :func:`get_profile`, in generation order."""
    return list(PROFILES)


def get_profile(name: str | DeviceProfile | None = None) -> DeviceProfile:
    """Return the profile called ``name`` (case-insensitive); ``None`` gives the default (trn2).

    A :class:`DeviceProfile` passed in is returned unchanged, so callers can accept either.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if name is None:
        return PROFILES[DEFAULT_PROFILE_NAME]
    if isinstance(name, DeviceProfile):
        return name
    if not isinstance(name, str):
        raise TypeError(f"profile name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    try:
        return PROFILES[key]
    except KeyError:
        raise ValueError(
            f"unknown device profile {name!r}; known profiles: {', '.join(PROFILES)}"
        ) from None


def default_profile() -> DeviceProfile:
    """The default profile: one trn2 logical NeuronCore (LNC=2)."""
    return PROFILES[DEFAULT_PROFILE_NAME]


def estimate_ns(
    profile: DeviceProfile | str | None,
    engine: str,
    flops: float,
    bytes_moved: float,
    dtype: Any = "float32",
) -> float:
    """Roofline ESTIMATE, in nanoseconds, of a kernel's time on ``profile``. Not a measurement.

    For a compute engine ('tensor', 'vector', 'scalar', 'gpsimd')::

        max(flops / peak_flops(engine, dtype), bytes_moved / hbm_bandwidth)

    For 'dma': ``bytes_moved / dma_bandwidth`` (``flops`` is ignored). Host<->device copies on real
    hardware are bounded by the host link, which is slower than the on-device DMA figure, so for h2d/d2h
    this is a lower bound.

    The model ignores launch overhead, on-chip SRAM reuse, engine overlap and pipeline effects; it is
    the best case the published peaks allow, which is what a roofline is.

    Args:
        profile: a :class:`DeviceProfile`, a profile name, or ``None`` for the default (trn2).
        engine: engine class of the kernel.
        flops: floating-point operations the kernel performs (>= 0).
        bytes_moved: bytes read from plus written to HBM (for 'dma': bytes transferred), >= 0.
        dtype: compute dtype (str or ``torch.dtype``); only matters for the tensor engine.

    Raises:
        ValueError: unknown engine, or negative flops / bytes.
    """
    prof = get_profile(profile)
    eng = _normalise_engine(engine)
    if flops < 0:
        raise ValueError(f"flops must be >= 0, got {flops!r}")
    if bytes_moved < 0:
        raise ValueError(f"bytes_moved must be >= 0, got {bytes_moved!r}")
    if eng == "dma":
        return float(bytes_moved) / prof.dma_bandwidth_bytes_per_s * 1e9
    compute_s = float(flops) / prof.peak_flops(eng, dtype)
    memory_s = float(bytes_moved) / prof.hbm_bandwidth_bytes_per_s
    return max(compute_s, memory_s) * 1e9


def annotate_estimates(
    events: Iterable[KernelEvent], profile: DeviceProfile | str | None = None
) -> list[KernelEvent]:
    """Return copies of ``events`` with ``est_ns`` filled by :func:`estimate_ns` (ESTIMATES).

    Kernel events (eager ops and fused compiled kernels) on a compute engine are charged ``flops`` and ``bytes_read + bytes_written`` at the
    dtype of their first input; DMA events are charged ``max(bytes_read, bytes_written)`` (a copy reads
    and writes the same bytes once). Other events (syncs, markers, compile steps, host-side events) keep ``est_ns``
    as it was.
    """
    prof = get_profile(profile)
    out: list[KernelEvent] = []
    for ev in events:
        est: float | None = ev.est_ns
        if ev.kind == "dma" or ev.engine == "dma":
            est = estimate_ns(prof, "dma", 0, max(ev.bytes_read, ev.bytes_written))
        elif ev.kind == "kernel" and ev.engine in COMPUTE_ENGINES:
            dtypes = [d.strip() for d in ev.dtypes.split(",") if d.strip()]
            dtype = dtypes[0] if dtypes else "float32"
            est = estimate_ns(prof, ev.engine, ev.flops, ev.bytes_read + ev.bytes_written, dtype)
        out.append(ev if est == ev.est_ns else dataclasses.replace(ev, est_ns=est))
    return out
