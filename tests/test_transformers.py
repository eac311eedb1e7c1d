"""Hugging Face integration: attn_implementation="safeops" against the models' own "eager" attention.

Tiny models built from configs with random weights (no downloads). Logits and gradients are compared on
the positions that are not padding: a padded query attends to nothing, where safeops gives 0 and eager
averages the masked keys (both are ignored by any loss).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from strategies import seeds

import safeops

VOCAB, SEQ = 64, 9


def test_import_safeops_does_not_import_transformers():
    code = ("import sys, safeops, safeops.nn, safeops.replace, safeops.patching; "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(pathlib.Path(__file__).resolve().parents[1]))
    assert out.stdout.strip() == "False", out.stderr


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    import safeops.transformers  # noqa: F401  (registers "safeops")

    return transformers


def config_for(hf, family, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64)
    if family == "llama":
        cfg = hf.LlamaConfig(num_key_value_heads=2, **common)
        cls = hf.LlamaForCausalLM
    elif family == "mistral":
        cfg = hf.MistralConfig(num_key_value_heads=2, sliding_window=3, **common)
        cls = hf.MistralForCausalLM
    elif family == "gemma2":
        cfg = hf.Gemma2Config(num_key_value_heads=2, head_dim=8, sliding_window=3, attn_logit_softcapping=5.0,
                              final_logit_softcapping=None, **common)
        cls = hf.Gemma2ForCausalLM
    elif family == "gpt_oss":  # attention sinks (s_aux), sliding and full layers, GQA, a tiny MoE
        cfg = hf.GptOssConfig(num_key_value_heads=2, head_dim=8, sliding_window=3, num_local_experts=2,
                              num_experts_per_tok=1, rope_parameters={"rope_type": "default",
                                                                      "rope_theta": 10000.0}, **common)
        cls = hf.GptOssForCausalLM
    elif family == "gpt2":
        cfg = hf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        cls = hf.GPT2LMHeadModel
    elif family == "bert":
        cfg = hf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=64)
        cls = hf.BertForMaskedLM
    else:
        raise ValueError(family)
    for name, value in overrides.items():
        setattr(cfg, name, value)
    return cls, cfg


def build(hf, family, seed, **overrides):
    cls, cfg = config_for(hf, family, **overrides)
    torch.manual_seed(seed.value)
    return cls(cfg)


def batch(seed, padding):
    ids = seed.randint(0, VOCAB, 2, SEQ)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    if padding == "left":
        mask[1, :4] = 0
    elif padding == "right":
        mask[1, -3:] = 0
    return ids, mask


def logits_and_grads(model, impl, ids, mask):
    model.set_attn_implementation(impl)
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    (logits[keep].square().mean()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


FAMILIES = ["llama", "mistral", "gemma2", "gpt_oss", "gpt2", "bert"]


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("family", FAMILIES)
@given(seed=seeds())
def test_logits_and_gradients_match_eager(family, padding, hf, seed, reference_backend):
    if family == "bert" and int(hf.__version__.split(".")[0]) < 5:
        pytest.skip("BERT goes through AttentionInterface only from transformers 5")
    model = build(hf, family, seed).eval()
    ids, mask = batch(seed, "right" if (family == "bert" and padding != "none") else padding)
    logits_ref, grads_ref = logits_and_grads(model, "eager", ids, mask)
    logits, grads = logits_and_grads(model, "safeops", ids, mask)
    assert model.config._attn_implementation == "safeops"
    keep = mask.bool()
    assert logits.isfinite().all()  # padded rows included
    torch.testing.assert_close(logits[keep], logits_ref[keep], rtol=1e-4, atol=2e-5)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        assert grads[name].isfinite().all(), name
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-3, atol=2e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gpt2"])
@given(seed=seeds())
def test_causal_masking_is_applied(family, hf, seed, reference_backend):
    """Changing the last token must not change any earlier position's logits (the mask is not dropped)."""
    model = build(hf, family, seed, attn_implementation="safeops").eval()
    model.set_attn_implementation("safeops")
    ids, mask = batch(seed, "none")
    changed = ids.clone()
    changed[:, -1] = (ids[:, -1] + 1) % VOCAB
    with torch.no_grad():
        a = model(input_ids=ids).logits
        b = model(input_ids=changed).logits
    assert torch.equal(a[:, :-1], b[:, :-1])
    assert not torch.equal(a[:, -1], b[:, -1])


@given(seed=seeds())
def test_sliding_window_maps_to_window_left_minus_one(hf, seed, reference_backend, monkeypatch):
    """transformers: key j is visible from query i iff i - w < j <= i; safeops: window=(w - 1, 0)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    import safeops.transformers as sht

    w = 3
    q, k, v = (seed.randn(1, 2, 7, 8) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    calls = []
    real = safeops.attention
    with monkeypatch.context() as m:  # undone after each example
        m.setattr(safeops, "attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
        out, weights = sht.attention_forward(module, q, k, v, None, sliding_window=w, scaling=0.5)
    assert weights is None and calls[-1]["window"] == (w - 1, 0)
    i, j = torch.arange(7).unsqueeze(1), torch.arange(7).unsqueeze(0)
    mask = sliding_window_causal_mask_function(w)(0, 0, i, j)  # transformers' own definition
    assert mask[6].tolist() == [False, False, False, False, True, True, True]
    p = torch.softmax((q @ k.transpose(-1, -2) * 0.5).masked_fill(~mask, float("-inf")), -1)
    torch.testing.assert_close(out, (p @ v).transpose(1, 2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@given(seed=seeds())
def test_gpt_oss_sinks_match_eager(hf, seed, dtype, backend):
    """gpt-oss passes its layer's ``sinks`` parameter as ``s_aux``: safeops' attention function against the
    model's own eager attention, with sinks large enough to matter (std 2, in the units of scaling * q.k),
    GQA, its additive causal / padding mask and a padded row that sees no key: outputs and the gradients
    of q, k, v and the sinks parameter. float64 on the reference, fp32 on both backends."""
    if dtype == torch.float64 and backend != "reference":
        pytest.skip("float64 runs the reference")
    from transformers.models.gpt_oss import modeling_gpt_oss

    import safeops.transformers as sht

    cls, cfg = config_for(hf, "gpt_oss")
    module = modeling_gpt_oss.GptOssAttention(cfg, layer_idx=1).to(dtype)
    with torch.no_grad():
        module.sinks.copy_(seed.randn(4, std=2.0).to(dtype))
    q, k, v = (seed.randn(2, h, 7, 8, dtype=dtype) for h in (4, 2, 2))
    mask = torch.zeros(2, 1, 7, 7, dtype=dtype)
    mask.masked_fill_(~torch.ones(7, 7, dtype=torch.bool).tril(), torch.finfo(dtype).min)
    mask[1, :, :, :3] = torch.finfo(dtype).min  # left padding: rows 0-2 of batch 1 see no key
    g = seed.randn(2, 7, 4, 8, dtype=dtype)
    results = []
    for fn in (modeling_gpt_oss.eager_attention_forward, sht.attention_forward):
        module.zero_grad()
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, _ = fn(module, *leaves, mask, scaling=module.scaling, dropout=0.0, s_aux=module.sinks)
        out.backward(g)
        results.append([out.detach()] + [t.grad for t in leaves] + [module.sinks.grad.clone()])
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), results[1], results[0], strict=True):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"{n}: {m}")


@given(seed=seeds())
def test_entry_points(hf, seed, tmp_path, reference_backend):
    cls, cfg = config_for(hf, "llama")
    model = hf.AutoModelForCausalLM.from_config(cfg, attn_implementation="safeops")
    assert model.config._attn_implementation == "safeops"
    model.save_pretrained(tmp_path)
    loaded = hf.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="safeops")
    assert loaded.config._attn_implementation == "safeops"
    ids, _ = batch(seed, "none")
    with torch.no_grad():
        a = loaded(input_ids=ids).logits
        loaded.set_attn_implementation("sdpa")
        b = loaded(input_ids=ids).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


@given(seed=seeds())
def test_training_with_attention_dropout_matches_eager(hf, seed, reference_backend):
    """Dropout acts on the probabilities (materialized path); with the same RNG state, eager agrees."""
    model = build(hf, "llama", seed, attention_dropout=0.3).train()
    ids, mask = batch(seed, "none")
    torch.manual_seed(seed.value)
    logits_ref, grads_ref = logits_and_grads(model, "eager", ids, mask)
    torch.manual_seed(seed.value)
    logits, grads = logits_and_grads(model, "safeops", ids, mask)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-4, atol=2e-5)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-3, atol=2e-5)
    model.eval()
    with torch.no_grad():
        assert not torch.equal(model(input_ids=ids).logits, logits)  # dropout really acted in training


@given(seed=seeds())
def test_training_step_with_left_padding_stays_finite(hf, seed, reference_backend):
    model = build(hf, "gemma2", seed, attn_implementation="safeops").train()
    model.set_attn_implementation("safeops")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids, mask = batch(seed, "left")
    labels = ids.masked_fill(mask == 0, -100)
    for _ in range(2):
        opt.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        assert out.loss.isfinite() and out.logits.isfinite().all()
        assert all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)
        opt.step()


@given(seed=seeds())
def test_replace_modules_switches_and_restores(hf, seed, reference_backend):
    model = build(hf, "llama", seed)
    model.set_attn_implementation("sdpa")
    wrapper = torch.nn.Module()
    wrapper.lm = model
    wrapper.gate = torch.nn.Softmax(-1)
    safeops.replace_modules(wrapper)
    assert model.config._attn_implementation == "safeops"
    assert any(name == "lm" and "safeops" in new for name, _, new in wrapper.safeops_report.replaced)
    safeops.restore_modules(wrapper)
    assert model.config._attn_implementation == "sdpa" and type(wrapper.gate) is torch.nn.Softmax

    safeops.replace_modules(model, exclude=hf.PreTrainedModel)
    assert model.config._attn_implementation == "sdpa"


@given(seed=seeds())
def test_unsupported_arguments_raise(hf, seed, reference_backend):
    import safeops.transformers as sht

    q = seed.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="position_bias"):
        sht.attention_forward(torch.nn.Module(), q, q, q, None, position_bias=torch.zeros(1, 2, 3, 3))
    with pytest.raises(ValueError, match="heads"):
        sht.attention_forward(torch.nn.Module(), q, seed.randn(1, 3, 3, 8), seed.randn(1, 3, 3, 8), None)
    assert sht.is_registered()


@given(seed=seeds())
def test_kernel_path_under_the_interpreter(hf, seed, triton_backend):
    """The Triton kernels (interpreted on CPU) behind a GQA Llama with left padding."""
    model = build(hf, "llama", seed).eval()
    ids, mask = batch(seed, "left")
    with torch.no_grad():
        model.set_attn_implementation("eager")
        ref = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation("safeops")
        out = model(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(out[keep], ref[keep], rtol=1e-4, atol=2e-5)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
@given(seed=seeds())
def test_decoding_with_kv_cache_matches_full_forward(family, hf, seed, reference_backend):
    """Prefill, then one token at a time through the KV cache (q_len 1, keys beyond the window, padding)."""
    model = build(hf, family, seed).eval()
    ids, mask = batch(seed, "left")
    model.set_attn_implementation("eager")
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits
    model.set_attn_implementation("safeops")
    prefill = 5
    with torch.no_grad():
        out = model(input_ids=ids[:, :prefill], attention_mask=mask[:, :prefill], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for t in range(prefill, SEQ):
            out = model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache,
                        use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    logits = torch.cat(steps, dim=1)
    keep = mask.bool()
    torch.testing.assert_close(logits[keep], full[keep], rtol=1e-4, atol=2e-5)


def test_mask_function_under_cuda_graph_capture_matches_eager(hf, monkeypatch):
    """While a CUDA graph is captured, some transformers 5.x releases build an explicit causal mask even
    with no padding (they count capture as tracing), so a captured step would run another attention call
    than the eager one. safeops' mask function returns what the eager call returns: None (is_causal) without
    padding, the same mask with padding or a window shorter than the keys."""
    import transformers.masking_utils as mu

    import safeops.transformers as sht

    def make(fn, **kw):
        args = dict(batch_size=2, q_length=6, kv_length=6, q_offset=0, kv_offset=0,
                    mask_function=mu.causal_mask_function, attention_mask=None, allow_is_causal_skip=True)
        args.update(kw)
        return fn(**args)

    padding = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    window = dict(mask_function=mu.sliding_window_causal_mask_function(3), local_size=3)
    eager = [make(mu.sdpa_mask), make(mu.sdpa_mask, attention_mask=padding), make(mu.sdpa_mask, **window)]
    assert eager[0] is None and eager[1] is not None and eager[2] is not None

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    # The rule of the releases that count capture as tracing (5.17's _ignore_causal_mask_sdpa): never skip.
    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", lambda *a, **k: False)
    assert make(mu.sdpa_mask) is not None  # the hazard this guards against
    captured = [make(sht.capture_safe_sdpa_mask), make(sht.capture_safe_sdpa_mask, attention_mask=padding),
                make(sht.capture_safe_sdpa_mask, **window)]
    assert captured[0] is None
    assert torch.equal(captured[1], eager[1]) and torch.equal(captured[2], eager[2])
    assert make(sht.capture_safe_sdpa_mask, allow_is_causal_skip=False) is not None
