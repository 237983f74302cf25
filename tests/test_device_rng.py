"""Per-device random number generators of the emulated ``neuron`` device.

Each neuron device owns a generator (``torch.neuron.default_generators[i]``). Seeding it makes every
random op on that device reproducible, and its stream is independent of the CPU generator
(``torch.default_generator``): drawing CPU numbers in between, or reseeding the CPU generator only,
must not change what the device draws.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from _neuron_child import run_child

import torchneuron_lab  # noqa: F401  (registers the device)

N0 = torch.device("neuron", 0)


def _ones(*shape: int) -> torch.Tensor:
    return torch.ones(*shape, device="neuron")


RANDOM_OPS: dict[str, Callable[[], torch.Tensor]] = {
    "randn": lambda: torch.randn(64, device="neuron"),
    "rand": lambda: torch.rand(64, device="neuron"),
    "rand_like": lambda: torch.rand_like(_ones(64)),
    "randint": lambda: torch.randint(0, 1000, (64,), device="neuron"),
    "randperm": lambda: torch.randperm(64, device="neuron"),
    "normal_": lambda: torch.empty(64, device="neuron").normal_(2.0, 3.0),
    "normal_tensor": lambda: torch.normal(torch.zeros(64, device="neuron"), 1.0),
    "uniform_": lambda: torch.empty(64, device="neuron").uniform_(-1, 1),
    "exponential_": lambda: torch.empty(64, device="neuron").exponential_(),
    "bernoulli_p": lambda: torch.bernoulli(torch.full((256,), 0.3, device="neuron")),
    "bernoulli_": lambda: _ones(256).bernoulli_(0.5),
    "multinomial": lambda: torch.multinomial(_ones(64), 16),
    "poisson": lambda: torch.poisson(_ones(64) * 4),
    "dropout": lambda: F.dropout(_ones(1024), 0.5, training=True),
    "nn.Dropout": lambda: torch.nn.Dropout(0.3).train()(_ones(32, 32)),
    "dropout2d": lambda: F.dropout2d(_ones(2, 8, 4, 4), 0.5, training=True),
    "alpha_dropout": lambda: F.alpha_dropout(_ones(256), 0.5, training=True),
    "rrelu": lambda: torch.rrelu(-_ones(64), training=True),  # random slopes apply to x < 0
}


@pytest.mark.parametrize("op", list(RANDOM_OPS), ids=list(RANDOM_OPS))
def test_manual_seed_makes_op_reproducible(op: str) -> None:
    fn = RANDOM_OPS[op]
    torch.neuron.manual_seed(1234)
    first = fn()
    second_draw = fn()
    torch.neuron.manual_seed(1234)
    again = fn()
    assert first.device == N0
    assert torch.equal(first.cpu(), again.cpu())
    if op not in ("poisson",):  # poisson of constant rates can repeat by chance; the rest cannot
        assert not torch.equal(first.cpu(), second_draw.cpu()), "the generator did not advance"


@pytest.mark.parametrize("op", list(RANDOM_OPS), ids=list(RANDOM_OPS))
def test_device_stream_is_independent_of_the_cpu_generator(op: str) -> None:
    fn = RANDOM_OPS[op]
    torch.neuron.manual_seed(77)
    torch.default_generator.manual_seed(100)
    a = fn().cpu()
    torch.neuron.manual_seed(77)
    torch.default_generator.manual_seed(200)  # a different CPU state ...
    torch.rand(1000)  # ... advanced further
    b = fn().cpu()
    assert torch.equal(a, b), f"{op} on neuron drew from the CPU generator"


@pytest.mark.parametrize("op", list(RANDOM_OPS), ids=list(RANDOM_OPS))
def test_device_draws_do_not_advance_the_cpu_generator(op: str) -> None:
    cpu_state = torch.default_generator.get_state()
    RANDOM_OPS[op]()
    assert torch.equal(torch.default_generator.get_state(), cpu_state), (
        f"{op} on neuron used the CPU generator"
    )


def test_cpu_draws_do_not_advance_the_device_generator() -> None:
    torch.neuron.manual_seed(5)
    state = torch.neuron.get_rng_state()
    torch.randn(1000)
    torch.rand(10, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.neuron.get_rng_state(), state)


def test_same_seed_same_stream_as_the_cpu_engine() -> None:
    # documented design: a neuron generator drives the CPU engine (mt19937), so seeds line up
    torch.neuron.manual_seed(7)
    g = torch.Generator().manual_seed(7)
    assert torch.equal(torch.randn(16, device="neuron").cpu(), torch.randn(16, generator=g))


def test_get_set_rng_state_round_trip() -> None:
    torch.neuron.manual_seed(11)
    torch.randn(3, device="neuron")
    state = torch.neuron.get_rng_state()
    assert state.device.type == "cpu" and state.dtype == torch.uint8
    assert state.shape == torch.default_generator.get_state().shape
    x1 = torch.rand(8, device="neuron")
    assert not torch.equal(torch.neuron.get_rng_state(), state)
    torch.neuron.set_rng_state(state)
    assert torch.equal(torch.neuron.get_rng_state(), state)
    x2 = torch.rand(8, device="neuron")
    assert torch.equal(x1.cpu(), x2.cpu())


def test_rng_state_is_per_device() -> None:
    torch.neuron.manual_seed_all(9)
    s0, s1 = torch.neuron.get_rng_state_all()
    assert torch.equal(s0, s1)
    z0 = torch.randn(4, device="neuron:0")
    z1 = torch.randn(4, device="neuron:1")
    assert torch.equal(z0.cpu(), z1.cpu())  # same seed on both devices
    torch.randn(4, device="neuron:1")
    assert torch.equal(torch.neuron.get_rng_state(0), torch.neuron.get_rng_state("neuron:0"))
    assert not torch.equal(torch.neuron.get_rng_state(0), torch.neuron.get_rng_state(1))
    torch.neuron.set_rng_state_all([s0, s1])
    assert torch.equal(torch.randn(4, device="neuron:1").cpu(), z1.cpu())


def test_manual_seed_seeds_only_the_current_device() -> None:
    torch.neuron.manual_seed_all(1)
    torch.neuron.manual_seed(9)
    with torch.neuron.device(1):
        torch.neuron.manual_seed(10)
        assert torch.neuron.initial_seed() == 10
    gens = torch.neuron.default_generators
    assert [g.device for g in gens] == [torch.device("neuron", 0), torch.device("neuron", 1)]
    assert [g.initial_seed() for g in gens] == [9, 10]
    assert torch.neuron.initial_seed() == 9


def test_seed_picks_a_new_nondeterministic_seed() -> None:
    torch.neuron.manual_seed(11)
    torch.neuron.seed()
    first = torch.neuron.initial_seed()
    torch.neuron.seed()
    assert {first, torch.neuron.initial_seed()} != {11}
    assert first != torch.neuron.initial_seed()


def test_seed_all_gives_every_device_one_new_seed_and_default_generators_is_one_tuple() -> None:
    # as torch.cuda.seed_all: a random seed for device 0, the same for the others (each device got its own);
    # torch.neuron.default_generators was a new tuple of new objects at every read
    gens = torch.neuron.default_generators
    assert gens is torch.neuron.default_generators and gens[0] is torch.neuron.default_generators[0]
    torch.neuron.manual_seed_all(5)
    torch.neuron.seed_all()
    seeds = [g.initial_seed() for g in gens]
    assert seeds[0] != 5 and seeds == [seeds[0]] * len(gens)
    assert torch.equal(torch.rand(4, device="neuron:0").cpu(), torch.rand(4, device="neuron:1").cpu())


def test_torch_manual_seed_also_seeds_neuron() -> None:
    torch.manual_seed(2024)
    assert [g.initial_seed() for g in torch.neuron.default_generators] == [2024, 2024]
    a = torch.rand(5, device="neuron")
    b = torch.rand(5, device="neuron:1")
    torch.manual_seed(2024)
    assert torch.equal(torch.rand(5, device="neuron").cpu(), a.cpu())
    assert torch.equal(torch.rand(5, device="neuron:1").cpu(), b.cpu())


def test_explicit_neuron_generator() -> None:
    g = torch.Generator(device="neuron")
    assert g.device == N0
    g.manual_seed(3)
    assert g.initial_seed() == 3
    default_state = torch.neuron.get_rng_state()
    y1 = torch.randn(6, device="neuron", generator=g)
    g.manual_seed(3)
    y2 = torch.randn(6, device="neuron", generator=g)
    assert torch.equal(y1.cpu(), y2.cpu())
    assert torch.equal(torch.neuron.get_rng_state(), default_state)  # the default generator was not used
    state = g.get_state()
    y3 = torch.rand(6, device="neuron", generator=g)
    g.set_state(state)
    assert torch.equal(torch.rand(6, device="neuron", generator=g).cpu(), y3.cpu())
    g1 = torch.Generator(device="neuron:1")
    assert g1.device == torch.device("neuron", 1)
    g1.manual_seed(3)
    assert torch.equal(torch.randn(6, device="neuron:1", generator=g1).cpu(), y1.cpu())


def test_generator_device_type_is_checked() -> None:
    with pytest.raises(RuntimeError, match="Expected a 'neuron' device type for generator but found 'cpu'"):
        torch.randn(3, device="neuron", generator=torch.Generator())


def test_fork_rng_restores_the_device_state() -> None:
    torch.neuron.manual_seed(21)
    state = torch.neuron.get_rng_state()
    with torch.random.fork_rng(devices=[0], device_type="neuron"):
        torch.neuron.manual_seed(1)
        torch.randn(10, device="neuron")
    assert torch.equal(torch.neuron.get_rng_state(), state)


def test_native_dropout_draws_from_the_device_generator_whatever_the_cpu_seed() -> None:
    x = torch.ones(4096).to("neuron")
    masks = []
    for cpu_seed in (0, 1):
        torch.manual_seed(cpu_seed)
        torch.neuron.manual_seed(7)
        _, mask = torch.ops.aten.native_dropout(x, 0.5, True)
        masks.append(mask.cpu())
    assert torch.equal(masks[0], masks[1]) and 1000 < int(masks[0].sum()) < 3000


# Random draws across streams follow the launch order (CUDA reserves a launch's Philox offset when it is
# launched). The device's engine is advanced by a kernel when it runs, so a draw launched first on a busy
# stream and a second one on an idle stream drew in the order they ran: the second took the first numbers.
_STREAM_DRAWS: dict[str, Callable[[torch.Generator | None, torch.Tensor], torch.Tensor]] = {
    "uniform_(generator=g)": lambda g, t: t.uniform_(generator=g),
    "normal_(generator=g)": lambda g, t: t.normal_(generator=g),
    "uniform_() default generator": lambda g, t: t.uniform_(),
    "dropout (host path)": lambda g, t: t.copy_(F.dropout(torch.ones_like(t), 0.5)),
    "bernoulli_(0.5, generator=g)": lambda g, t: t.bernoulli_(0.5, generator=g),
    "randperm(generator=g)": lambda g, t: t.copy_(torch.randperm(t.numel(), device=t.device, generator=g)),
}


@pytest.mark.parametrize("second", list(_STREAM_DRAWS))
@pytest.mark.parametrize("first", ["uniform_(generator=g)", "uniform_() default generator"])
def test_random_draws_on_two_streams_follow_the_launch_order(first: str, second: str) -> None:
    def draws(device: str, busy: Callable[[], None], s1: object, s2: object,
              ctx: Callable[[object], object]) -> tuple[list[float], list[float]]:
        gen_dev = torch.device(device)
        uses_g = "generator=g" in first or "generator=g" in second
        g = torch.Generator(gen_dev).manual_seed(7) if uses_g else None
        torch.manual_seed(7)
        torch.neuron.manual_seed(7)
        a = torch.empty(4096, device=device)
        b = torch.empty(512, device=device)
        with ctx(s1):  # type: ignore[attr-defined]
            busy()
            _STREAM_DRAWS[first](g, a)
        with ctx(s2):  # type: ignore[attr-defined]
            _STREAM_DRAWS[second](g, b)
        if device != "cpu":
            torch.neuron.synchronize()  # b was written on s2
        return a.cpu().tolist(), b.cpu().tolist()

    import contextlib

    want = draws("cpu", lambda: None, None, None, lambda s: contextlib.nullcontext())
    s1, s2 = torch.neuron.Stream(), torch.neuron.Stream()
    s2.wait_stream(torch.neuron.current_stream())
    draws("neuron", lambda: None, s1, s2, torch.neuron.stream)  # a signature's first launch runs on the host
    got = draws("neuron", lambda: torch.neuron._sleep(150), s1, s2, torch.neuron.stream)
    assert got[0] == want[0]
    assert got[1] == want[1]


def test_graphsafe_state_is_shared_as_cudas() -> None:
    # NotImplementedError before: CUDA's graphsafe_get_state returns a generator pointing at the same state
    g = torch.Generator("neuron").manual_seed(3)
    shared = g.graphsafe_get_state()
    assert shared.device == torch.device("neuron", 0)
    other = torch.Generator("neuron").manual_seed(99)
    other.graphsafe_set_state(shared)
    a = torch.rand(4, device="neuron", generator=other)  # advances g's state too
    b = torch.rand(4, device="neuron", generator=g)
    ref = torch.Generator().manual_seed(3)
    assert a.cpu().tolist() == torch.rand(4, generator=ref).tolist()
    assert b.cpu().tolist() == torch.rand(4, generator=ref).tolist()
    clone = g.clone_state()  # a copy: drawing from it leaves g where it was
    c = torch.rand(4, device="neuron", generator=clone)
    assert torch.equal(c.cpu(), torch.rand(4, device="neuron", generator=g).cpu())
    torch.neuron._get_generator(torch.device("neuron", 1)).manual_seed(11)
    assert torch.neuron.default_generators[1].initial_seed() == 11
    with pytest.raises(RuntimeError, match="expected the state of a 'neuron' Generator"):
        g.graphsafe_set_state(torch.Generator())


def test_threads_seeding_and_reading_the_generator_while_others_launch_do_not_deadlock() -> None:
    # torch's Generator methods take the generator's mutex with the GIL held; the device's settle (waiting for
    # queued draws) released the GIL while holding that mutex, and another thread took the GIL and blocked on
    # the mutex: hung in 4 of 4 runs with 4 threads (and with checkpoint(preserve_rng_state=True) in 2)
    facts = run_child("""
        import json, threading, torch, torchneuron_lab
        from torch.utils.checkpoint import checkpoint

        def work(k, out):
            for i in range(120):
                x = torch.ones(100, device="neuron") + 1
                if i % 10 == 0:
                    (torch.neuron.get_rng_state, lambda: torch.neuron.manual_seed(i), torch.neuron.seed)[k % 3]()
            out[k] = x.sum().item()

        def train(k, out):
            torch.manual_seed(k)
            m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.1)).to("neuron")
            x = torch.randn(8, 16, device="neuron")
            for _ in range(30):
                checkpoint(m, x, use_reentrant=False).sum().backward()
            out[k] = bool(torch.isfinite(m[0].weight.grad).all())

        res = {}
        for target, n in ((work, 4), (train, 2)):
            out = {}
            ts = [threading.Thread(target=target, args=(k, out)) for k in range(n)]
            [t.start() for t in ts]
            [t.join(60) for t in ts]
            res[target.__name__] = [out.get(k) for k in range(n)]
        print(json.dumps(res))
    """, timeout=150)
    assert facts == {"work": [200.0] * 4, "train": [True, True]}
