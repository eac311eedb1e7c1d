"""safeops.merge_attention on the CPU: the reference and the Triton kernel under the interpreter.

- attention over random disjoint key splits (some empty, some rows fully masked), merged, against float64
  attention over the union (tests/oracle.py), output and lse (contract sections 2 and 4);
- empty partials contribute exactly nothing, whatever their output holds (NaN included); all-empty rows
  give 0 / -inf with zero gradients; lses near 1e11 give the exact weights, never NaN (sections 4, 5);
- gradients to every partial's output and lse against float64 autograd of the plain formula, and finite
  (zero) gradients for empty partials (section 3);
- stacked and list inputs, non-contiguous stacks, opcheck, and bad input (section 8);
- 64-bit head-dim offsets: when the launcher picks them (meta tensors), and that they give the 32-bit
  kernels' bits (section 8; a real offset past 2**31 is in tests/test_merge_gpu.py).
"""

from __future__ import annotations

import math
import textwrap

import oracle
import pytest
import sm90
import torch
from hypothesis import given
from oracle import eps
from strategies import seeds

import safeops

NEG_INF = float("-inf")
F64 = torch.float64
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _naive64(outs, lses):
    """float64 merge written from the definition: softmax weights of the lses times the outputs.

    The max is subtracted first (exact for fp32 values) and the weights are ``exp(z_i - logsumexp(z))``: near
    1e11, ``logsumexp(lses)`` itself is resolved only to float64's spacing there (2**-16), which would put
    8e-6 relative errors into the weights."""
    m = torch.stack(lses).detach().amax(0)
    z = [li - m for li in lses]
    lse_z = torch.logsumexp(torch.stack(z), 0)
    out = sum(torch.exp(zi - lse_z).unsqueeze(-1) * oi for oi, zi in zip(outs, z, strict=True))
    return out, m + lse_z


def _random_splits(seed, sk: int, parts: int) -> list[torch.Tensor]:
    """A random partition of range(sk) into ``parts`` index sets, the first one empty."""
    owner = seed.randint(1, parts, sk) if parts > 1 else torch.zeros(sk, dtype=torch.long)
    perm = torch.randperm(sk, generator=seed.gen)
    return [perm[owner[perm] == p] if p else perm[:0] for p in range(parts)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts", [1, 3, 5])
@given(seed=seeds())
def test_matches_attention_over_the_union(backend, seed, dtype, parts):
    b, h, sq, sk, d = 2, 2, 6, 20, 24  # d = 24 crosses the interpreter's 16-wide head-dim tiles
    q, k, v = seed.randn(b, h, sq, d, dtype=dtype), seed.randn(b, h, sk, d, dtype=dtype), \
        seed.randn(b, h, sk, d, dtype=dtype)
    mask = seed.mask(b, h, sq, sk, keep=0.6)
    mask[:, :, 0] = False  # query 0 sees no key at all: an all-empty row
    splits = _random_splits(seed, sk, parts + 1)
    mask[:, :, 1] = False
    mask[:, :, 1, splits[-1]] = True  # query 1 sees keys of one split only
    outs, lses = [], []
    for idx in splits:
        o, lse = safeops.attention(q, k[:, :, idx], v[:, :, idx], attn_mask=mask[..., idx], return_lse=True)
        outs.append(o)
        lses.append(lse)
    out, lse = safeops.merge_attention(outs, lses)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == (b, h, sq, d) and lse.shape == (b, h, sq)

    r = oracle.attention(q, k, v, attn_mask=mask)
    # Each partial is rounded to `dtype` once by attention, the merge rounds once more: ~2 ulps of the
    # largest |v| a row mixes, plus the fp32 score error that the attention bounds allow.
    out_b, lse_b = oracle.attention_bounds(r, q)
    vmax = v.double().abs().amax(2, keepdim=True).expand_as(out_b)
    bound = out_b + 2 * eps(dtype) * vmax + 16 * eps(torch.float32) * vmax
    oracle.assert_close(out.double(), r.out, bound, f"merged out ({dtype}, {parts} splits)", seed)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert (lse[:, :, 0] == NEG_INF).all()
    lse_bound = lse_b + 16 * eps(torch.float32) * (r.lse.abs().nan_to_num(0.0, neginf=0.0) + 1)
    oracle.assert_close(lse.double(), r.lse, lse_bound, "merged lse", seed)


@given(seed=seeds())
def test_empty_partials_contribute_nothing(backend, seed):
    outs = [seed.randn(3, 7, 20) for _ in range(3)]
    lses = [seed.randn(3, 7, std=4.0) for _ in range(3)]
    base_out, base_lse = safeops.merge_attention(outs, lses)
    junk = torch.full((3, 7, 20), float("nan"))
    empty = torch.full((3, 7), NEG_INF)
    out, lse = safeops.merge_attention([outs[0], junk, outs[1], outs[2], junk.clone()],
                                       [lses[0], empty, lses[1], lses[2], empty.clone()])
    assert not out.isnan().any() and not lse.isnan().any(), seed
    torch.testing.assert_close(out, base_out, rtol=4 * eps(torch.float32), atol=1e-7)
    torch.testing.assert_close(lse, base_lse, rtol=4 * eps(torch.float32), atol=0.0)
    # A partial that is empty in some rows only.
    lses2 = [t.clone() for t in lses]
    lses2[1][0] = NEG_INF
    outs2 = [t.clone() for t in outs]
    outs2[1][0] = float("nan")
    out2, _ = safeops.merge_attention(outs2, lses2)
    ref0, _ = safeops.merge_attention([outs[0][0], outs[2][0]], [lses[0][0], lses[2][0]])
    torch.testing.assert_close(out2[0], ref0, rtol=4 * eps(torch.float32), atol=1e-7)
    assert not out2.isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(seed=seeds())
def test_all_empty_rows(backend, seed, dtype):
    outs = [seed.randn(2, 5, 16, dtype=dtype).requires_grad_(True) for _ in range(3)]
    lses = [seed.randn(2, 5).requires_grad_(True) for _ in range(3)]
    with torch.no_grad():
        for o, lse in zip(outs, lses, strict=True):
            lse[:, 2] = NEG_INF  # row 2 of both batches: every partial empty
            o[:, 2] = float("nan")
    out, lse = safeops.merge_attention(outs, lses)
    assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2]))
    assert (lse[:, 2] == NEG_INF).all()
    assert not out.isnan().any() and not lse.isnan().any()
    grads = torch.autograd.grad((out * seed.randn(2, 5, 16)).sum() + (lse.nan_to_num(neginf=0.0) * 3).sum(),
                                outs + lses)
    for g in grads:
        assert torch.isfinite(g).all()
        assert (g[:, 2] == 0).all()


@given(seed=seeds())
def test_single_partial_is_identity(backend, seed):
    o, lse = seed.randn(4, 3, 8), seed.randn(4, 3, std=10.0)
    lse[0, 1] = NEG_INF
    o[0, 1] = 0.0
    out, lse_out = safeops.merge_attention([o], [lse])
    assert torch.equal(out, o) and torch.equal(lse_out, lse)


@given(seed=seeds())
def test_huge_lses(backend, seed):
    """lses near 1e11 (fp32 spacing 8192 there): the weights are exp of exact differences, no inf/NaN."""
    base = 1e11
    steps = seed.randint(-3, 1, 3, 4, 6).to(F64)  # differences of 0, -8192, ... exactly representable
    lses = [(base + 8192.0 * steps[i]).to(torch.float32) for i in range(3)]
    lses[2][0] = NEG_INF
    outs = [seed.randn(4, 6, 8) for _ in range(3)]
    out, lse = safeops.merge_attention(outs, lses)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref_out, ref_lse = _naive64([o.double() for o in outs], [t.double() for t in lses])
    # The weights are exactly 1 or 0 (differences 0 or <= -8192): a mean of up to 3 outputs in fp32, two
    # additions, 1 / s and a multiply, at most 4 U32 * omax = 2 eps * omax; 8 eps leaves a 4x margin.
    omax = torch.stack(outs).double().abs().amax(0)
    oracle.assert_close(out.double(), ref_out, 8 * eps(torch.float32) * omax, "out, lses near 1e11", seed)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2 * eps(torch.float32), atol=0.0)
    # Equal huge lses: exactly the mean of the outputs.
    same = [torch.full((4, 6), 1.0e11) for _ in range(4)]
    outs4 = [torch.full((4, 6, 8), float(i)) for i in range(4)]
    mean, lse4 = safeops.merge_attention(outs4, same)
    assert torch.equal(mean, torch.full((4, 6, 8), 1.5))
    assert torch.equal(lse4, torch.full((4, 6), 1.0e11) + torch.tensor(math.log(4.0), dtype=torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@given(seed=seeds())
def test_gradients_match_float64(backend, seed, dtype):
    p, shape, d = 4, (3, 5), 24
    outs = [seed.randn(*shape, d, dtype=dtype).requires_grad_(True) for _ in range(p)]
    lses = [seed.randn(*shape, std=3.0, dtype=F64 if dtype == F64 else torch.float32).requires_grad_(True)
            for _ in range(p)]
    g_out, g_lse = seed.randn(*shape, d), seed.randn(*shape)
    out, lse = safeops.merge_attention(outs, lses)
    loss = (out * g_out.to(dtype)).sum() + (lse * g_lse.to(lse.dtype)).sum()
    grads = torch.autograd.grad(loss, outs + lses)

    leaves = [t.detach().double().requires_grad_(True) for t in outs + lses]
    ref_out, ref_lse = _naive64(leaves[:p], leaves[p:])
    g_out64 = g_out.to(dtype).double()
    ref = torch.autograd.grad((ref_out * g_out64).sum() + (ref_lse * g_lse.to(lse.dtype).double()).sum(),
                              leaves)
    u = eps(torch.float32) if dtype != F64 else eps(F64)
    omax = max(t.detach().double().abs().max().item() for t in outs)
    gmax = g_out64.abs().max().item()
    for i, (g, r) in enumerate(zip(grads, ref, strict=True)):
        assert g.dtype == (outs + lses)[i].dtype
        # d out_i = a_i g: one rounding to the output dtype. d lse_i: fp32 dot products of length d.
        bound = eps(g.dtype) * r.abs() + (4 * d * u) * (omax + 1) * (gmax + g_lse.abs().max().item()) \
            + 2 * oracle.subnormal_step(g.dtype)
        what = f"grad of {'out' if i < p else 'lse'} {i % p} ({dtype})"
        oracle.assert_close(g.double(), r, bound, what, seed)


@given(seed=seeds())
def test_gradients_with_empty_partials(backend, seed):
    outs = [seed.randn(4, 6, 8).requires_grad_(True) for _ in range(3)]
    lses = [seed.randn(4, 6).requires_grad_(True) for _ in range(3)]
    with torch.no_grad():
        lses[1][:2] = NEG_INF
        outs[1][:2] = 0.0
    g_out, g_lse = seed.randn(4, 6, 8), seed.randn(4, 6)
    out, lse = safeops.merge_attention(outs, lses)
    grads = torch.autograd.grad((out * g_out).sum() + (lse * g_lse).sum(), outs + lses)
    for g in grads:
        assert torch.isfinite(g).all()
    assert (grads[1][:2] == 0).all() and (grads[4][:2] == 0).all()
    # The finite partials get the gradients of the merge without the empty one.
    sub_o = [outs[0][:2], outs[2][:2]]
    sub_l = [lses[0][:2], lses[2][:2]]
    leaves = [t.detach().double().requires_grad_(True) for t in sub_o + sub_l]
    r_out, r_lse = _naive64(leaves[:2], leaves[2:])
    ref = torch.autograd.grad((r_out * g_out[:2].double()).sum() + (r_lse * g_lse[:2].double()).sum(), leaves)
    for g, r in zip((grads[0][:2], grads[2][:2], grads[3][:2], grads[5][:2]), ref, strict=True):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)


@given(seed=seeds())
def test_stacked_and_list_agree(backend, seed):
    outs = seed.randn(3, 2, 4, 5, 16)
    lses = seed.randn(3, 2, 4, 5)
    a = safeops.merge_attention(outs, lses)
    b = safeops.merge_attention(list(outs.unbind(0)), list(lses.unbind(0)))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # Non-contiguous stacks (partials dim last in memory, transposed rows) read in place.
    outs_t = outs.permute(1, 2, 3, 4, 0).contiguous().permute(4, 0, 1, 2, 3)
    lses_t = lses.transpose(1, 3).contiguous().transpose(1, 3)
    c = safeops.merge_attention(outs_t, lses_t)
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])


@given(seed=seeds())
def test_strided_incoming_gradient_same_bits(backend, seed):
    """The backward reads the incoming output gradient in place whatever its strides: the same bits as a
    contiguous gradient (a transposed layout, and one row broadcast with stride 0)."""
    outs, lses = seed.randn(3, 2, 4, 5, 16), seed.randn(3, 2, 4, 5, std=3.0)
    g = seed.randn(2, 4, 5, 16)
    grads = []
    for grad in (g, g.transpose(1, 2).contiguous().transpose(1, 2), g[:1, :1, :1].expand_as(g)):
        o, l = outs.clone().requires_grad_(True), lses.clone().requires_grad_(True)
        out, _ = safeops.merge_attention(o, l)
        out.backward(grad)
        grads.append((o.grad, l.grad))
    g_bcast = g[:1, :1, :1].expand_as(g).contiguous()
    o, l = outs.clone().requires_grad_(True), lses.clone().requires_grad_(True)
    safeops.merge_attention(o, l)[0].backward(g_bcast)
    assert torch.equal(grads[1][0], grads[0][0]) and torch.equal(grads[1][1], grads[0][1])
    assert torch.equal(grads[2][0], o.grad) and torch.equal(grads[2][1], l.grad)


@given(seed=seeds())
def test_row_alone_matches_row_in_batch(backend, seed):
    """Batch invariance (contract section 6): a row merged alone gets the same bits as inside a batch."""
    outs, lses = seed.randn(4, 3, 9, 40), seed.randn(4, 3, 9, std=3.0)
    lses[1, 2] = NEG_INF
    out, lse = safeops.merge_attention(outs, lses)
    for i, j in ((0, 0), (2, 8), (1, 5)):
        o1, l1 = safeops.merge_attention(outs[:, i, j:j + 1].contiguous(), lses[:, i, j:j + 1].contiguous())
        assert torch.equal(o1[0], out[i, j]) and torch.equal(l1[0], lse[i, j]), (i, j, seed)


def _recording_launch(monkeypatch, run: bool):
    """Replaces the launcher's ``launch`` by one recording each kernel's WIDE flag (and running the kernel
    when ``run``)."""
    from safeops.ops import merge_launch

    seen = []
    real = merge_launch.launch

    def record(kernel, grid, *args, **kwargs):
        seen.append((kernel.__name__ if hasattr(kernel, "__name__") else kernel.fn.__name__, kwargs["WIDE"]))
        if run:
            real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(merge_launch, "launch", record)
    return seen


def test_wide_offsets_chosen_from_sizes_and_strides(monkeypatch):
    """64-bit head-dim offsets (contract section 8) exactly when ``(D - 1) * stride`` reaches 2**31 for the
    head-dim stride of a tensor the kernel reads or writes (the only 32-bit index products: rows are
    64-bit): decided by the launcher from sizes and strides alone (meta tensors here, no memory) and
    passed to both kernels."""
    from safeops.ops import merge_launch as launcher

    assert launcher._wide(3, 2**30) and not launcher._wide(3, 2**30 - 1)  # the largest offset 2**31 - 2
    assert launcher._wide(64, 1, 2**31 // 63 + 1, 1) and not launcher._wide(64, 1, 2**31 // 63, 1)
    assert not launcher._wide(2**20, 1, 1)  # contiguous: col < 2**20

    monkeypatch.setattr(launcher, "_check_device", lambda o: None)  # meta tensors: the kernels do not run
    seen = _recording_launch(monkeypatch, run=False)
    meta = dict(device="meta", dtype=torch.bfloat16)
    r = 2**26
    lses = torch.empty((2, r), device="meta")
    # A stack read in place whose head dim is outermost in memory: (D, P, R) viewed as (P, R, D).
    stacked = torch.empty((64, 2, r), **meta).permute(1, 2, 0)
    assert stacked.stride(2) == 2**27
    launcher.forward(stacked, lses)
    launcher.backward(torch.empty((r, 64), **meta), None, stacked, lses)
    # Contiguous, 2**33 elements: rows are 64-bit, head-dim offsets stay below 64.
    contiguous = torch.empty((2, r, 64), **meta)
    launcher.forward(contiguous, lses)
    # Only the incoming gradient is wide: transposed, its head-dim stride is R.
    launcher.backward(torch.empty((64, r), **meta).t(), torch.empty(r, device="meta"), contiguous, lses)
    assert seen == [("merge_fwd_kernel", True), ("merge_bwd_kernel", True),
                    ("merge_fwd_kernel", False), ("merge_bwd_kernel", True)], seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(seed=seeds())
def test_wide_kernels_give_the_same_bits(triton_backend, seed, monkeypatch, dtype):
    """The 64-bit offset variants (forced on here: a real offset past 2**31 needs > 4 GB, see
    tests/test_merge_gpu.py) compute exactly what the 32-bit ones do, forward and backward, on in-place
    strided stacks (head dim outermost) and a transposed incoming gradient."""
    from safeops.ops import merge_launch

    p, b, r, d = 3, 2, 5, 24  # d = 24 crosses the interpreter's 16-wide head-dim tiles
    outs = seed.randn(d, p, b, r, dtype=dtype).permute(1, 2, 3, 0)  # head-dim stride p * b * r
    lses = seed.randn(p, b, r, std=3.0)
    lses[1, 0, 2] = NEG_INF
    lses[:, 1, 4] = NEG_INF  # an all-empty row
    g_out = seed.randn(d, b, r, dtype=dtype).permute(1, 2, 0)  # transposed: head-dim stride b * r
    g_lse = seed.randn(b, r)
    bwd = torch.ops.safeops.merge_attention_backward.default

    def run():
        out, lse = safeops.merge_attention(outs, lses)
        return (out, lse, *bwd(g_out, g_lse, outs, lses), *bwd(g_out, None, outs, lses))

    with monkeypatch.context() as m:  # undone after each example
        seen = _recording_launch(m, run=True)
        narrow = run()
        m.setattr(merge_launch, "_wide", lambda *args: True)
        wide = run()
    assert [w for _, w in seen] == [False] * 3 + [True] * 3, seen
    for a, w, what in zip(narrow, wide, ("out", "lse", "d outs", "d lses", "d outs (no g_lse)",
                                         "d lses (no g_lse)"), strict=True):
        assert torch.equal(a, w), f"{what}: WIDE changed bits ({seed})"
    # And they are right: against float64 autograd of the definition.
    o64 = outs.detach().double().requires_grad_(True)
    l64 = lses.double().requires_grad_(True)
    r_out, r_lse = _naive64(list(o64.unbind(0)), list(l64.unbind(0)))
    fin = torch.isfinite(r_lse)
    torch.testing.assert_close(wide[0][fin].double(), r_out[fin], rtol=2 * eps(dtype), atol=2 * eps(dtype))
    r_do, r_dl = torch.autograd.grad(
        [torch.where(fin.unsqueeze(-1), r_out, 0.0), torch.where(fin, r_lse, 0.0)], [o64, l64],
        [g_out.double(), g_lse.double()])
    torch.testing.assert_close(wide[2].double(), r_do.nan_to_num(0.0), rtol=2 * eps(dtype), atol=1e-6)
    torch.testing.assert_close(wide[3].double(), r_dl.nan_to_num(0.0), rtol=1e-5, atol=1e-5)


def test_empty_tensors(backend):
    out, lse = safeops.merge_attention([torch.randn(2, 0, 8)] * 3, [torch.randn(2, 0)] * 3)
    assert out.shape == (2, 0, 8) and lse.shape == (2, 0)
    lses = [torch.tensor([0.0, NEG_INF]), torch.tensor([0.0, NEG_INF])]
    out, lse = safeops.merge_attention([torch.randn(2, 0)] * 2, lses)
    assert out.shape == (2, 0)
    assert lse[0] == pytest.approx(math.log(2.0)) and lse[1] == NEG_INF


@given(seed=seeds())
def test_opcheck(backend, seed):
    outs = seed.randn(3, 2, 4, 16).requires_grad_(True)
    lses = seed.randn(3, 2, 4)
    lses[1, 0, 0] = NEG_INF
    lses.requires_grad_(True)
    torch.library.opcheck(torch.ops.safeops.merge_attention.default, (outs, lses))


@pytest.mark.parametrize("with_grad_lse", [True, False])
@given(seed=seeds())
def test_opcheck_backward(backend, seed, with_grad_lse):
    outs = seed.randn(3, 2, 4, 16)
    lses = seed.randn(3, 2, 4)
    lses[1, 0, 0] = NEG_INF
    lses[:, 1, 2] = NEG_INF  # a row where every partial is empty
    grad_out = seed.randn(2, 4, 16)
    grad_lse = seed.randn(2, 4) if with_grad_lse else None
    op = torch.ops.safeops.merge_attention_backward.default
    torch.library.opcheck(op, (grad_out, grad_lse, outs, lses))


def test_bad_input():
    o, lse = torch.randn(2, 3, 8), torch.randn(2, 3)
    with pytest.raises(ValueError, match="outs must hold at least one"):
        safeops.merge_attention([], [])
    with pytest.raises(ValueError, match="outs must hold at least one"):
        safeops.merge_attention(o[:0].unsqueeze(0)[:0], lse.unsqueeze(0)[:0])
    with pytest.raises(ValueError, match=r"outs\[1\] has shape"):
        safeops.merge_attention([o, o[:, :2]], [lse, lse])
    with pytest.raises(TypeError, match=r"outs\[1\] has dtype"):
        safeops.merge_attention([o, o.double()], [lse, lse])
    with pytest.raises(TypeError, match="lses must be float32"):
        safeops.merge_attention([o, o], [lse.bfloat16(), lse.bfloat16()])
    with pytest.raises(TypeError, match="lses must be float32"):
        safeops.merge_attention([o, o], [lse.double(), lse.double()])
    with pytest.raises(ValueError, match="lses must have the outputs' shape"):
        safeops.merge_attention([o, o], [lse[:, :2], lse[:, :2]])
    with pytest.raises(ValueError, match="one lse per output"):
        safeops.merge_attention([o, o], [lse])
    with pytest.raises(ValueError, match="lses are on"):
        safeops.merge_attention([o, o], [lse.to("meta"), lse.to("meta")])
    with pytest.raises(ValueError, match=r"outs\[1\] has device"):
        safeops.merge_attention([o, o.to("meta")], [lse, lse])
    with pytest.raises(TypeError, match="outs must be float16"):
        safeops.merge_attention([o.int()], [lse])
    with pytest.raises(TypeError, match="both"):
        safeops.merge_attention(torch.stack([o, o]), [lse, lse])
    with pytest.raises(TypeError, match=r"outs\[0\] must be a torch.Tensor"):
        safeops.merge_attention([o.numpy()], [lse])
    with pytest.raises(TypeError, match="outs must be a list"):
        safeops.merge_attention(3, 4)
    # fp64 outputs may come with fp64 lses (and are computed in fp64).
    out, lse64 = safeops.merge_attention([o.double()], [lse.double()])
    assert out.dtype == F64 and lse64.dtype == F64


# --------------------------------------------------------------------------------------------------
# Compiled for sm_90 (no GPU needed): fp contraction stays off (contract sections 1 and 6)
# --------------------------------------------------------------------------------------------------

_PTX_SCRIPT = textwrap.dedent(
    r"""
    import json, re
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from safeops.kernels import merge as k
    from safeops.ops import merge_launch as L

    block_r, block_d, num_warps = L.block_sizes(128, torch.device("cuda"))
    results = {}
    kernels = ((k.merge_fwd_kernel, {}), (k.merge_bwd_kernel, {"HAS_GLSE": True}))
    # With fusion on, one kernel is enough to show that the check sees contraction; the 64-bit offset
    # variants (WIDE) compile and stay fma-free too.
    cases = [(False, d, False, fn, extra) for d in ("bf16", "fp32") for fn, extra in kernels]
    cases += [(False, "bf16", True, fn, extra) for fn, extra in kernels]
    cases.append((True, "bf16", False) + kernels[0])
    for fusion, dtype, wide, fn, extra in cases:
        constexprs = {"BLOCK_R": block_r, "BLOCK_D": block_d, "WIDE": wide, **extra}
        sig = {n: "constexpr" if n in constexprs else
               (f"*{dtype}" if n in ("o_ptr", "out_ptr", "g_ptr", "go_ptr") else "*fp32")
               if n.endswith("_ptr") else "i32" for n in fn.arg_names}
        options = L._launch_options(num_warps)
        if fusion:
            options["enable_fp_fusion"] = True
        ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                             target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
        # fma in the PTX, and f32 multiplies/adds without .rn, which ptxas itself may fuse into an fma.
        name = f"{'on' if fusion else 'off'}/{fn.__name__}/{dtype}" + ("/wide" if wide else "")
        results[name] = (len(re.findall(r"\bfma\.rn(\.ftz)?\.f32\b", ptx))
                         + len(re.findall(r"\b(mul|add|sub)(\.ftz)?\.f32\b", ptx)))
    print(json.dumps(results))
    """
)


def test_no_fma_in_compiled_merge_kernels():
    counts = sm90.run_script(_PTX_SCRIPT, what="the merge kernels")
    off = {name: n for name, n in counts.items() if name.startswith("off/")}
    assert len(off) == 6 and not any(off.values()), f"fused multiply-adds (contract section 1): {off}"
    assert counts["on/merge_fwd_kernel/bf16"], "with fp fusion on nothing was contracted: the check is blind"


# bf16 at the edges (contract sections 2 and 8), fixed bit patterns: under Triton's interpreter numpy has no
# bf16, and its own conversions truncate and mangle subnormals; the kernels must not use them.
BF16_SUBNORMALS = [1e-39, -1e-39, 3e-40, -2e-40, 9.2e-41, -9.2e-41, 5e-39, 1.1e-38, -7e-39]  # < 2**-126
MERGE_LSES = [[0.0, 0.5, -1.0, 2.0, NEG_INF], [0.25, 0.0, 1.0, -3.0, 0.0], [-0.5, 1.5, 1.0, 0.0, 0.0]]


def _pattern(values: list[float], shape: tuple[int, ...], dtype=torch.bfloat16) -> torch.Tensor:
    """values repeated over shape in a fixed order that differs between neighbouring rows and partials."""
    n = math.prod(shape)
    idx = (torch.arange(n) * 5 + torch.arange(n) // shape[-1]) % len(values)
    return torch.tensor(values, dtype=F64)[idx].reshape(shape).to(dtype)


@pytest.mark.parametrize("grad", ["subnormal", "huge"])
def test_bf16_subnormal_partials(backend, grad):
    # Subnormal outputs merged (loads and stores of subnormals); their gradients from subnormal incoming
    # gradients (stored subnormal), or from huge ones (d lse then depends on g . out_i of the subnormals).
    p, r, d = len(MERGE_LSES), len(MERGE_LSES[0]), 24
    outs = _pattern(BF16_SUBNORMALS, (p, r, d)).requires_grad_(True)
    lses = torch.tensor(MERGE_LSES).requires_grad_(True)
    huge = [1.0, -0.5, 2.0, 0.25, -1.0, 3.0, -0.75]
    g_out = _pattern(BF16_SUBNORMALS[::-1] if grad == "subnormal" else [v * 1e38 for v in huge], (r, d))
    g_lse = torch.tensor([0.5, -1.0, 0.25, 2.0, -0.75])
    out, lse = safeops.merge_attention(outs, lses)
    grads = torch.autograd.grad((out * g_out).sum() + (lse * g_lse).sum(), (outs, lses))

    leaves = [outs.detach().double().requires_grad_(True), lses.detach().double().requires_grad_(True)]
    ref_out, ref_lse = _naive64(list(leaves[0]), list(leaves[1]))
    ref = torch.autograd.grad((ref_out * g_out.double()).sum() + (ref_lse * g_lse.double()).sum(), leaves)
    tiny = 2 * oracle.subnormal_step(torch.bfloat16)
    a_o = sum(torch.exp(leaves[1][i] - ref_lse).unsqueeze(-1).detach() * leaves[0][i].detach().abs()
              for i in range(p))
    bound = eps(torch.bfloat16) * ref_out.detach().abs() + 8 * eps(torch.float32) * a_o + tiny
    oracle.assert_close(out.double(), ref_out, bound, "merged out of subnormal partials", backend)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=4 * eps(torch.float32), atol=0.0)
    # d out_i = a_i g, rounded once; d lse_i = a_i (g_lse + g . out_i - g . out) from fp32 dots of length d.
    bound = eps(torch.bfloat16) * ref[0].abs() + 8 * eps(torch.float32) * g_out.double().abs() + tiny
    oracle.assert_close(grads[0].double(), ref[0], bound, f"grad of the outputs ({grad} g)", backend)
    go = (g_out.double().abs() * outs.detach().double().abs()).sum(-1)
    bound = 4 * d * eps(torch.float32) * (go + go.mean(0) + g_lse.double().abs()) + 1e-30
    oracle.assert_close(grads[1].double(), ref[1], bound, f"grad of the lses ({grad} g)", backend)


@pytest.mark.parametrize("parts", [2, 4])
def test_bf16_merged_outputs_round_to_nearest_even(backend, parts):
    # Equal lses: every weight is exactly 1 / parts, so the fp32 mean of bf16 outputs of one binade is exact
    # and the one rounding to bf16 decides (section 2), ties included (to even); a truncating conversion is
    # an ulp off in many of these. Likewise d out_i = g / parts for subnormal g: exact in fp32, rounded once.
    r, d = 6, 24
    values = [1.0, 1.0078125, 1.015625, 1.5, 1.9921875, 1.25, 1.7578125, 1.1328125, 1.0234375]
    sign = torch.tensor([1.0, -1.0, 0.5, -2.0, 4.0, -0.25], dtype=F64)[:, None]
    outs = torch.stack([_pattern(values[i:] + values[:i], (r, d), F64) * sign for i in range(parts)])
    outs = outs.to(torch.bfloat16).requires_grad_(True)
    lses = torch.tensor([0.0, 7.5, -3.0, 1e5, 0.5, -2.0])[None].expand(parts, r).contiguous()
    g_out = (torch.arange(r * d, dtype=F64).reshape(r, d) % 127 + 1) * oracle.subnormal_step(torch.bfloat16)
    g_out = g_out.to(torch.bfloat16)
    out, _ = safeops.merge_attention(outs, lses)
    (d_outs,) = torch.autograd.grad(out, outs, g_out)
    ctx = f"{backend}, {parts} partials"
    _assert_same_bits(out, (outs.detach().double().sum(0) / parts).to(torch.bfloat16), "merged outputs", ctx)
    expected = (g_out.double() / parts).to(torch.bfloat16).expand(parts, r, d)
    _assert_same_bits(d_outs, expected, "gradients of the outputs", ctx)


def _assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str, ctx: str) -> None:
    bad = actual.view(torch.int16) != expected.view(torch.int16)
    assert not bad.any(), (f"{int(bad.sum())} of {actual.numel()} {what} are not the nearest bf16: "
                           f"{actual[bad][:4].tolist()} vs {expected[bad][:4].tolist()}; {ctx}")
