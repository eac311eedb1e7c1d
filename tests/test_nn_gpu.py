"""GPU-only tests of the adoption paths: safeops.nn modules, patched() and Hugging Face models on CUDA.

CPU CI runs the same paths on the reference and under Triton's interpreter (tests/test_nn.py,
test_patched.py, test_replace.py, test_transformers.py); here the compiled Triton attention kernels run them:

- safeops.nn.MultiheadAttention (need_weights=False, the fused kernel) against torch's in float64, fp32 and
  bf16 inputs, with a fully padded sample (zeros, finite gradients);
- patched() SDPA on CUDA against the stock SDPA (fp32 / bf16, GQA, causal);
- a tiny random Llama (GQA) and Gemma-2 (sliding window + softcap) in bf16 and fp32 on CUDA with
  attn_implementation="safeops" against "sdpa" / "eager", logits and gradients, left padding, one training
  step; a Llama-shaped model at a realistic sequence length (2048) for memory and finiteness.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from strategies import seeds

import safeops
from safeops import nn as snn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = "cuda"


def _tol(dtype):
    return {torch.float32: (2e-3, 2e-4), torch.bfloat16: (3e-2, 3e-2)}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(seed=seeds())
def test_mha_on_cuda_matches_torch_float64(dtype, seed):
    e, heads, n, length = 128, 4, 3, 200
    safe = snn.MultiheadAttention(e, heads, batch_first=True).to(CUDA, dtype)
    stock = torch.nn.MultiheadAttention(e, heads, batch_first=True).double().to(CUDA)
    stock.load_state_dict(safe.state_dict())  # the same (rounded) weights, evaluated in float64
    x = seed.randn(n, length, e).to(CUDA, dtype)
    kpm = torch.zeros(n, length, dtype=torch.bool, device=CUDA)
    kpm[1, 150:] = True
    kpm[2] = True  # fully padded sample
    xs = x.clone().requires_grad_()
    out, _ = safe(xs, xs, xs, key_padding_mask=kpm, need_weights=False)
    x64 = x.double()
    ref, _ = stock(x64, x64, x64, key_padding_mask=kpm, need_weights=True)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out[:2].double(), ref[:2], rtol=rtol, atol=atol)
    bias = safe.out_proj.bias.float().expand(length, e)
    torch.testing.assert_close(out[2].float(), bias, rtol=0, atol=1e-6)
    out.float().square().sum().backward()
    assert xs.grad.isfinite().all() and all(p.grad.isfinite().all() for p in safe.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["plain", "causal", "gqa"])
@given(seed=seeds())
def test_patched_sdpa_on_cuda(case, dtype, seed):
    hkv = 2 if case == "gqa" else 8
    q = seed.randn(2, 8, 256, 64).to(CUDA, dtype)
    k, v = (seed.randn(2, hkv, 256, 64).to(CUDA, dtype) for _ in range(2))
    kw = {"is_causal": case == "causal", "enable_gqa": case == "gqa"}
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)
    with safeops.patched():
        out = F.scaled_dot_product_attention(q, k, v, **kw)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)


def _hf():
    return pytest.importorskip("transformers")


def _tiny(family, dtype, seed):
    hf = _hf()
    import safeops.transformers  # noqa: F401

    common = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    if family == "llama":
        cfg, cls = hf.LlamaConfig(**common), hf.LlamaForCausalLM
    else:
        cfg = hf.Gemma2Config(head_dim=32, sliding_window=64, attn_logit_softcapping=50.0, **common)
        cls = hf.Gemma2ForCausalLM
    torch.manual_seed(seed.value)
    return cls(cfg).to(CUDA, dtype)


def _run(model, impl, ids, mask):
    model.set_attn_implementation(impl)
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    logits[keep].float().square().mean().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _errors(logits, grads, ref_logits, ref_grads, keep):
    scale = ref_logits[keep].float().abs().max()
    logit_err = ((logits[keep].float() - ref_logits[keep].float()).abs().max() / scale).item()
    grad_err = {n: ((g - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30)).item()
                for n, g in grads.items()}
    return logit_err, grad_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
@given(seed=seeds())
def test_hf_tiny_model_on_cuda(family, dtype, seed):
    """safeops against the stock attention in the same dtype, both measured against fp32 eager.

    fp32: safeops must agree with fp32 eager closely. bf16: safeops' error against the fp32 model must not
    exceed the stock implementation's (sdpa for Llama; eager for Gemma-2, since sdpa has no softcap) by more
    than a small margin.
    """
    model32 = _tiny(family, torch.float32, seed)
    ids = torch.randint(0, 256, (2, 200), device=CUDA)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0  # left padding
    keep = mask.bool()
    ref_logits, ref_grads = _run(model32, "eager", ids, mask)
    model = model32 if dtype == torch.float32 else copy.deepcopy(model32).to(dtype)
    logits, grads = _run(model, "safeops", ids, mask)
    assert logits.isfinite().all() and all(g.isfinite().all() for g in grads.values())
    logit_err, grad_err = _errors(logits, grads, ref_logits, ref_grads, keep)
    if dtype == torch.float32:
        assert logit_err < 1e-4, logit_err
        assert max(grad_err.values()) < 1e-3, grad_err
        return
    stock_logits, stock_grads = _run(model, "sdpa" if family == "llama" else "eager", ids, mask)
    stock_logit_err, stock_grad_err = _errors(stock_logits, stock_grads, ref_logits, ref_grads, keep)
    if not all(math.isfinite(e) for e in (stock_logit_err, *stock_grad_err.values())):
        # The stock kernel gave NaN (padded rows leaking through P @ V): nothing to compare against.
        assert logit_err < 3e-2, logit_err
        return
    assert logit_err <= 1.25 * stock_logit_err + 1e-3, (logit_err, stock_logit_err)
    for name, err in grad_err.items():
        assert err <= 1.25 * stock_grad_err[name] + 1e-3, (name, err, stock_grad_err[name])


@given(seed=seeds())
def test_hf_training_step_long_sequence_bf16(seed):
    model = _tiny("llama", torch.bfloat16, seed)
    model.set_attn_implementation("safeops")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 2048), device=CUDA)
    mask = torch.ones_like(ids)
    mask[0, :500] = 0
    labels = ids.masked_fill(mask == 0, -100)
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        opt.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        assert out.loss.isfinite() and out.logits.isfinite().all()
        opt.step()
    assert all(p.isfinite().all() for p in model.parameters())


@given(seed=seeds())
def test_hf_training_step_in_a_cuda_graph(seed):
    """A tiny Llama's training step with attn_implementation="safeops", captured in one CUDA graph (torch's
    whole-network capture, as bench/model.py --cuda-graph times it): each replay gives the eager step's loss
    and gradients bit for bit, on new token ids each time. So the transformers path (mask function, GQA,
    the attention ops, autograd) neither synchronizes nor allocates outside the graph's pool."""
    model = _tiny("llama", torch.bfloat16, seed)
    model.set_attn_implementation("safeops")
    model.train()
    ids = torch.randint(0, 256, (2, 300), device=CUDA)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()
    params = [p for p in model.parameters() if p.grad is not None]
    assert params
    for replay in range(2):
        ids.copy_(torch.randint(0, 256, ids.shape, device=CUDA))
        graph.replay()
        torch.cuda.synchronize()
        got_loss, got = loss.clone(), [p.grad.clone() for p in params]
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        want_loss = step()  # eager, same weights and ids
        assert torch.equal(got_loss, want_loss), f"loss, replay {replay}"
        for i, p in enumerate(params):
            assert torch.equal(got[i], p.grad), f"gradient {i}, replay {replay}"
        for p, g in zip(params, saved, strict=True):
            p.grad = g  # the graph's own gradient tensors back in place for the next replay
