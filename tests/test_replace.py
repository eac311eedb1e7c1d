"""replace_modules / restore_modules: what is swapped, what is shared, the report, filters, the way back."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from hypothesis import given
from strategies import seeds

import safeops
from safeops import nn as snn


class MySoftmax(torch.nn.Softmax):
    pass


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.LogSoftmax(-1))
        self.gate = torch.nn.Softmax(-1)
        self.custom = MySoftmax(-1)

    def forward(self, x, key_padding_mask=None):
        h, _ = self.attn(self.proj(x), x, x, key_padding_mask=key_padding_mask)
        return self.head(h) + self.gate(h).sum(-1, keepdim=True) + self.custom(h).mean(-1, keepdim=True)


def forward_and_grads(model, x, **kw):
    model.zero_grad()
    out = model(x, **kw)
    out.sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@given(seed=seeds())
def test_replaces_shares_and_matches(seed, reference_backend):
    model = Net().double()
    params_before = {n: p for n, p in model.named_parameters()}
    x = seed.randn(2, 4, 8, dtype=torch.float64)
    out_ref, grads_ref = forward_and_grads(model, x)
    originals = {n: m for n, m in model.named_modules()}

    assert safeops.replace_modules(model) is model
    assert type(model.attn) is snn.MultiheadAttention
    assert type(model.head[1]) is snn.LogSoftmax
    assert type(model.gate) is snn.Softmax
    assert type(model.custom) is MySoftmax  # a subclass: reported, not replaced
    params_after = {n: p for n, p in model.named_parameters()}
    assert params_after.keys() == params_before.keys()
    assert all(params_after[n] is params_before[n] for n in params_before)  # shared, not copied
    assert list(model.state_dict()) == list(Net().state_dict())
    out, grads = forward_and_grads(model, x)
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-12)
    for n in grads:
        torch.testing.assert_close(grads[n], grads_ref[n], rtol=1e-9, atol=1e-12)

    report = model.safeops_report
    text = str(report)
    assert {name for name, _, _ in report.replaced} == {"attn", "head.1", "gate"}
    assert "custom" in text and "subclass of torch.nn.modules.activation.Softmax" in text
    assert "3 replaced" in text

    safeops.restore_modules(model)
    assert all(m is originals[n] for n, m in model.named_modules())
    assert type(model.attn) is torch.nn.MultiheadAttention
    assert not hasattr(model, "safeops_report")


@given(seed=seeds())
def test_fully_padded_sample_after_replace(seed, reference_backend):
    model = Net()
    x = seed.randn(2, 4, 8)
    kpm = torch.zeros(2, 4, dtype=torch.bool)
    kpm[0] = True
    assert model(x, key_padding_mask=kpm)[0].isnan().all()
    safeops.replace_modules(model)
    out = model(x, key_padding_mask=kpm)
    out.sum().backward()
    assert out.isfinite().all() and all(p.grad.isfinite().all() for p in model.parameters())


@given(seed=seeds())
def test_hooks_training_mode_dtype_preserved(seed, reference_backend):
    model = Net().double().eval()
    seen = []
    pre = model.attn.register_forward_pre_hook(lambda m, a: seen.append(("pre", type(m))))
    model.gate.register_forward_hook(lambda m, a, o: seen.append(("post", type(m))))
    safeops.replace_modules(model)
    assert not model.training and not model.attn.training and model.attn.in_proj_weight.dtype == torch.float64
    model(seed.randn(1, 3, 8, dtype=torch.float64))
    assert seen == [("pre", snn.MultiheadAttention), ("post", snn.Softmax)]
    pre.remove()  # a handle taken before the swap still removes the hook from the replacement
    seen.clear()
    model(seed.randn(1, 3, 8, dtype=torch.float64))
    assert seen == [("post", snn.Softmax)]
    model.train()  # flags are shared both ways
    assert model.attn.training
    safeops.restore_modules(model)
    assert model.attn.training and type(model.gate) is torch.nn.Softmax


@pytest.mark.parametrize("include,exclude,expected", [
    (None, None, {"attn", "head.1", "gate"}),
    ("head.*", None, {"head.1"}),
    (["gate", "attn"], None, {"gate", "attn"}),
    (torch.nn.MultiheadAttention, None, {"attn"}),
    (None, torch.nn.Softmax, {"attn", "head.1"}),
    (None, ["attn", "head.*"], {"gate"}),
    (torch.nn.Softmax, "gate", set()),
])
def test_include_exclude(include, exclude, expected):
    model = safeops.replace_modules(Net(), include=include, exclude=exclude)
    assert {name for name, _, _ in model.safeops_report.replaced} == expected
    kept = {name: why for name, _, why in model.safeops_report.skipped}
    for name in {"attn", "head.1", "gate"} - expected:
        assert kept[name] in ("not matched by include", "matched by exclude")


def test_filter_type_errors():
    with pytest.raises(TypeError, match="include/exclude"):
        safeops.replace_modules(Net(), include=3)
    with pytest.raises(TypeError, match="model"):
        safeops.replace_modules("not a module")


def test_shared_module_root_instance_forward_and_idempotence(caplog):
    shared = torch.nn.Softmax(-1)
    model = torch.nn.Sequential(shared, torch.nn.Identity(), shared)
    odd = torch.nn.LogSoftmax(-1)
    odd.forward = lambda x: x
    model.append(odd)
    with caplog.at_level(logging.INFO, logger="safeops.replace"):
        safeops.replace_modules(model)
    assert "safeops.replace_modules" in caplog.text
    assert model[0] is model[2] and type(model[0]) is snn.Softmax  # one replacement for one shared object
    assert type(model[3]) is torch.nn.LogSoftmax
    assert any("instance" in why for _, _, why in model.safeops_report.skipped)
    safeops.replace_modules(model)  # a second call finds nothing new to replace
    assert model.safeops_report.replaced == []
    safeops.restore_modules(model)
    assert model[0] is shared and model[2] is shared

    root = torch.nn.Softmax(-1)
    safeops.replace_modules(root)
    assert "root module" in str(root.safeops_report) and type(root) is torch.nn.Softmax


@given(seed=seeds())
def test_deepcopy_and_state_dict_after_replace(seed, reference_backend):
    model = safeops.replace_modules(Net())
    clone = copy.deepcopy(model)
    assert type(clone.attn) is snn.MultiheadAttention
    assert clone.attn.in_proj_weight is not model.attn.in_proj_weight
    plain = Net()
    plain.load_state_dict(model.state_dict())
    x = seed.randn(2, 3, 8)
    torch.testing.assert_close(plain(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@given(seed=seeds())
def test_transformer_encoder_fast_path_is_bypassed(seed, monkeypatch, reference_backend):
    layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True, dropout=0.0)
    encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True).eval()
    x = seed.randn(2, 5, 8)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[1, 3:] = True
    with torch.no_grad():
        expected = encoder(x, src_key_padding_mask=kpm)
    calls = []
    forward = snn.MultiheadAttention.forward
    with monkeypatch.context() as m:  # undone after each example
        m.setattr(snn.MultiheadAttention, "forward",
                  lambda self, *a, **kw: calls.append(1) or forward(self, *a, **kw))
        safeops.replace_modules(encoder)
        assert encoder.use_nested_tensor is False and "fused inference path" in str(encoder.safeops_report)
        with torch.no_grad():
            out = encoder(x, src_key_padding_mask=kpm)
    assert len(calls) == 2  # each layer ran the safeops attention, not torch's fused kernel
    keep = ~kpm
    torch.testing.assert_close(out[keep], expected[keep], rtol=1e-4, atol=1e-5)
    safeops.restore_modules(encoder)
    assert encoder.use_nested_tensor is True
    assert all(len(layer.self_attn._forward_pre_hooks) == 0 for layer in encoder.layers)
