"""Training on the emulated neuron device matches CPU training step for step.

The device runs ATen's CPU kernels on device memory, so from an identical initialisation and data the
losses must agree to float rounding (1e-5 relative) at every step, for an MLP (SGD with momentum and
AdamW, ``foreach=False``), a ``torch.nn.TransformerEncoder`` built from a config, and (slow) small
Hugging Face models built from configs with random weights.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F

import torchneuron_lab  # noqa: F401  (registers the device)

REL = 1e-5
Batch = tuple[torch.Tensor, torch.Tensor]


def make_optimizer(name: str, params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, foreach=False)
    raise ValueError(name)


def train(
    model: torch.nn.Module,
    data: Sequence[Batch],
    device: str,
    optimizer: str,
    loss_fn: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[list[float], torch.nn.Module]:
    m = copy.deepcopy(model).to(device)
    opt = make_optimizer(optimizer, list(m.parameters()))
    losses = []
    for x, y in data:
        x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(m, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, m


def assert_losses_match(cpu: list[float], neuron: list[float]) -> None:
    assert len(cpu) == len(neuron) == 5
    rel = [abs(c - n) / max(abs(c), 1e-12) for c, n in zip(cpu, neuron)]
    assert max(rel) <= REL, f"per-step relative differences {rel}\ncpu    {cpu}\nneuron {neuron}"


def ce_loss(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(x), y)


# --------------------------------------------------------------------------- MLP


def make_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(20, 64),
        torch.nn.GELU(),
        torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 5),
    )


def mlp_data() -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 20, generator=g), torch.randint(0, 5, (32,), generator=g)) for _ in range(5)]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_mlp_losses_match_cpu_step_for_step(optimizer: str) -> None:
    model, data = make_mlp(), mlp_data()
    cpu_losses, cpu_model = train(model, data, "cpu", optimizer, ce_loss)
    neuron_losses, neuron_model = train(model, data, "neuron", optimizer, ce_loss)
    assert_losses_match(cpu_losses, neuron_losses)
    init = dict(model.named_parameters())
    for (name, p_cpu), p_neuron in zip(cpu_model.named_parameters(), neuron_model.parameters()):
        assert not torch.equal(p_cpu.detach(), init[name].detach()), f"{name} did not train"
        assert p_neuron.device == torch.device("neuron", 0), name
        torch.testing.assert_close(p_neuron.detach().cpu(), p_cpu.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_mlp_on_neuron1_matches_neuron0() -> None:
    model, data = make_mlp(), mlp_data()
    losses0, _ = train(model, data, "neuron:0", "adamw", ce_loss)
    losses1, m1 = train(model, data, "neuron:1", "adamw", ce_loss)
    assert losses0 == losses1
    assert {p.device for p in m1.parameters()} == {torch.device("neuron", 1)}


def test_optimizer_state_lives_on_the_device() -> None:
    model, data = make_mlp(), mlp_data()
    _, m = train(model, data[:1], "neuron", "adamw", ce_loss)
    opt = torch.optim.AdamW(m.parameters(), foreach=False)
    x, y = data[0]
    ce_loss(m, x.to("neuron"), y.to("neuron")).backward()
    opt.step()
    state = opt.state[next(iter(m.parameters()))]
    assert state["exp_avg"].device == torch.device("neuron", 0)
    assert state["exp_avg_sq"].device == torch.device("neuron", 0)


# --------------------------------------------------------------------------- module.to keeps parameters


def test_to_neuron_keeps_parameter_objects() -> None:
    # like .cuda(): an optimizer built before the move still drives the moved module
    model = torch.nn.Linear(4, 3)
    weight, bias = model.weight, model.bias
    model.to("neuron")
    assert model.weight is weight and model.bias is bias
    assert weight.device == torch.device("neuron", 0)


def test_optimizer_created_before_the_move_still_trains_the_model() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=False)
    model.to("neuron")
    before = model.weight.detach().cpu().clone()
    model(torch.ones(2, 4, device="neuron")).sum().backward()
    opt.step()
    assert not torch.equal(model.weight.detach().cpu(), before), "the optimizer updated stale CPU parameters"


def test_tied_weights_stay_tied_after_to_neuron() -> None:
    class TiedLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(20, 8)
            self.head = torch.nn.Linear(8, 20, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.emb(x)))

    torch.manual_seed(0)
    model = TiedLM()
    assert len(list(model.parameters())) == 1
    model.to("neuron")
    assert model.head.weight is model.emb.weight
    assert len(list(model.parameters())) == 1


def test_tied_weights_train_like_cpu() -> None:
    class TiedLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(20, 8)
            self.head = torch.nn.Linear(8, 20, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.emb(x))).flatten(0, 1)

    torch.manual_seed(0)
    model = TiedLM()
    g = torch.Generator().manual_seed(2)
    data = [
        (torch.randint(0, 20, (2, 6), generator=g), torch.randint(0, 20, (12,), generator=g))
        for _ in range(5)
    ]
    cpu_losses, _ = train(model, data, "cpu", "adamw", ce_loss)
    neuron_losses, _ = train(model, data, "neuron", "adamw", ce_loss)
    assert_losses_match(cpu_losses, neuron_losses)


# --------------------------------------------------------------------------- TransformerEncoder


class TinyEncoderLM(torch.nn.Module):
    def __init__(
        self, vocab: int = 50, d_model: int = 32, nhead: int = 4, ff: int = 64, layers: int = 2
    ) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Parameter(torch.randn(16, d_model) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(
            d_model, nhead, ff, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        )
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos[: x.shape[1]]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.head(self.encoder(h, mask=mask, is_causal=True)).flatten(0, 1)


def test_transformer_encoder_adamw_losses_match_cpu() -> None:
    torch.manual_seed(0)
    model = TinyEncoderLM()
    g = torch.Generator().manual_seed(3)
    data = [
        (torch.randint(0, 50, (4, 12), generator=g), torch.randint(0, 50, (48,), generator=g))
        for _ in range(5)
    ]
    cpu_losses, _ = train(model, data, "cpu", "adamw", ce_loss)
    neuron_losses, neuron_model = train(model, data, "neuron", "adamw", ce_loss)
    assert_losses_match(cpu_losses, neuron_losses)
    assert len(set(cpu_losses)) == 5
    assert all(p.grad is not None and p.grad.device.type == "neuron" for p in neuron_model.parameters())


def test_transformer_encoder_eval_fast_path_matches_cpu() -> None:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        expected = enc(x)
        got = copy.deepcopy(enc).to("neuron")(x.to("neuron"))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- Hugging Face models (slow)


def _hf_train(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], device: str) -> list[float]:
    m = copy.deepcopy(model).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        out = m(**{k: v.to(device) for k, v in batch.items()})
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    return losses


@pytest.mark.slow
def test_hf_gpt2_from_config_losses_match_cpu() -> None:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(4)
    batches = []
    for _ in range(5):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    assert_losses_match(_hf_train(model, batches, "cpu"), _hf_train(model, batches, "neuron"))


@pytest.mark.slow
def test_hf_bert_from_config_losses_match_cpu() -> None:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(5):
        ids = torch.randint(0, 128, (4, 12), generator=g)
        mask = torch.ones(4, 12, dtype=torch.long)
        mask[:, 9:] = 0
        batches.append(
            {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (4,), generator=g)}
        )
    assert_losses_match(_hf_train(model, batches, "cpu"), _hf_train(model, batches, "neuron"))
