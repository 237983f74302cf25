"""flex_attention on neuron tensors: torch refused every device outside CUDA/CPU/XPU/HPU/MPS (eager and compiled);
CUDA runs it forward and backward, eager and compiled (torchneuron_lab/_flex_attention.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torchneuron_lab  # noqa: F401  (registers the device)

fa = pytest.importorskip("torch.nn.attention.flex_attention")


def _rel_bias(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
    return score + (q - kv) * 0.01


def _soft_cap(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
    return 20.0 * torch.tanh(score / 20.0)


def _causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return q >= kv


def _window(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return (q >= kv) & (q - kv <= 32)


def _inputs(heads_kv: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 128, 16, generator=g)
    k = torch.randn(2, heads_kv, 128, 16, generator=g)
    v = torch.randn(2, heads_kv, 128, 16, generator=g)
    return q, k, v


CASES = [  # (score_mod, mask_mod, kv heads: 2 is GQA)
    (None, None, 4), (_rel_bias, _causal, 4), (_soft_cap, _window, 4), (_rel_bias, None, 2), (None, _causal, 2),
]


def _call(f: Any, q: Any, k: Any, v: Any, score_mod: Any, mask_mod: Any) -> torch.Tensor:
    bm = None if mask_mod is None else fa.create_block_mask(mask_mod, 1, 1, 128, 128, device=q.device.type)
    return f(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=k.size(1) != q.size(1))


@pytest.mark.parametrize("score_mod,mask_mod,kv_heads", CASES)
def test_eager_forward_and_backward_on_neuron_are_cpus_math(monkeypatch: pytest.MonkeyPatch, score_mod: Any,
                                                             mask_mod: Any, kv_heads: int) -> None:
    q, k, v = _inputs(kv_heads)
    qn, kn, vn = (t.to("neuron").requires_grad_() for t in (q, k, v))
    out = _call(fa.flex_attention, qn, kn, vn, score_mod, mask_mod)  # ValueError: only supported on CUDA, CPU...
    assert out.device.type == "neuron"
    out.square().sum().backward()
    # CPU refuses backward (a CPU limit torch keeps); the same math on the CPU, with its check lifted, is the reference
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        _call(fa.flex_attention, *(t.clone().requires_grad_() for t in (q, k, v)), score_mod, mask_mod)
    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _call(fa.flex_attention, qc, kc, vc, score_mod, mask_mod)
    ref.square().sum().backward()
    assert torch.equal(out.detach().cpu(), ref.detach())
    for got, want in ((qn.grad, qc.grad), (kn.grad, kc.grad), (vn.grad, vc.grad)):
        assert got is not None and want is not None and torch.equal(got.cpu(), want)


@pytest.mark.parametrize("backend", ["neuron", "inductor"])
def test_compiled_inference_is_inductor_cpus_and_compiled_training_matches_eager(backend: str) -> None:
    # compiled: "only supported on CUDA, CPU..." (Dynamo traces the check), then Inductor's CPU flex template
    # refused a graph that needs the logsumexp ("torch.compile on CPU only supports inference")
    from torchneuron_lab.compiler import registry

    torch._dynamo.reset()
    q, k, v = _inputs(2)
    n0 = len(registry.records())
    with torch.no_grad():
        got = _call(torch.compile(fa.flex_attention, backend=backend), *(t.to("neuron") for t in (q, k, v)),
                    _rel_bias, _causal)
        want = _call(torch.compile(fa.flex_attention, backend="inductor"), q, k, v, _rel_bias, _causal)
    assert got.device.type == "neuron" and torch.equal(got.cpu(), want)  # the same fused CPU template
    assert len(registry.records()) > n0

    torch._dynamo.reset()
    qn, kn, vn = (t.to("neuron").requires_grad_() for t in (q, k, v))
    out = _call(torch.compile(fa.flex_attention, backend=backend), qn, kn, vn, _rel_bias, _causal)
    out.square().sum().backward()
    qe, ke, ve = (t.to("neuron").requires_grad_() for t in (q, k, v))
    ref = _call(fa.flex_attention, qe, ke, ve, _rel_bias, _causal)
    ref.square().sum().backward()
    torch.testing.assert_close(out.detach().cpu(), ref.detach().cpu(), rtol=1e-5, atol=1e-5)
    for got_g, want_g in ((qn.grad, qe.grad), (kn.grad, ke.grad), (vn.grad, ve.grad)):
        assert got_g is not None and want_g is not None
        torch.testing.assert_close(got_g.cpu(), want_g.cpu(), rtol=1e-4, atol=1e-4)
    kinds = {r.kind for r in registry.records()[n0:]}
    assert {"forward", "backward"} <= kinds, kinds


def test_hugging_face_llama_trains_with_flex_attention_on_neuron(monkeypatch: pytest.MonkeyPatch) -> None:
    # attn_implementation="flex_attention": transformers compiles flex_attention with the default backend
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    results = {}
    state = None
    for impl, device in (("sdpa", "cpu"), ("flex_attention", "neuron")):
        cfg._attn_implementation = impl
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        if state is None:
            state = model.state_dict()
        model.load_state_dict(state)
        model.to(device)
        loss = model(input_ids=ids.to(device), labels=ids.to(device)).loss
        loss.backward()
        results[impl] = (loss.detach().cpu(), [p.grad.cpu() for p in model.parameters()])
        model.eval()
        results[impl + " tokens"] = model.generate(ids[:, :8].to(device), max_new_tokens=5, do_sample=False).tolist()
    assert results["flex_attention tokens"] == results["sdpa tokens"]
    torch.testing.assert_close(results["flex_attention"][0], results["sdpa"][0], rtol=1e-5, atol=1e-6)
    for got, want in zip(results["flex_attention"][1], results["sdpa"][1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
