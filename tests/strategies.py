"""Hypothesis strategies and per-test example budgets shared by the tests.

Tensor contents come from a drawn integer seed (:class:`Seed`, a ``torch.Generator`` on it): drawing whole
tensors element by element would be far too slow under Triton's interpreter. Everything else that a test
varies, shapes, dims, memory layouts (permuted, sliced, broadcast views), dtypes, masks and scales, is drawn
by the strategies here, and so shrinks to a small failing case. Sizes stay small: the interpreter runs every
Triton kernel on the CPU.

The settings profiles (``ci``, the default, and ``deep``) are registered in ``conftest.py``; a test that
needs more examples than the profile's default asks for them with :func:`examples`.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
from hypothesis import settings
from hypothesis import strategies as st

PROFILE_ENV = "SAFEOPS_HYPOTHESIS"  # "ci" (default) or "deep"
EXAMPLES_ENV = "SAFEOPS_HYPOTHESIS_EXAMPLES"  # the deep profile's example count (default 200)
DEEP_EXAMPLES = 200


def profile() -> str:
    name = os.environ.get(PROFILE_ENV, "ci")
    if name not in ("ci", "deep"):
        raise ValueError(f"{PROFILE_ENV} must be 'ci' or 'deep', got {name!r}")
    return name


def deep_examples() -> int:
    return int(os.environ.get(EXAMPLES_ENV, DEEP_EXAMPLES))


def examples(ci: int, deep: int | None = None) -> settings:
    """``@examples(ci, deep)``: this test's example count, ``ci`` under the ci profile; under the deep
    profile ``deep`` (for a slow test) or the profile's count, whichever is smaller."""
    if profile() == "ci":
        return settings(max_examples=ci)
    return settings(max_examples=min(deep or deep_examples(), deep_examples()))


def each_example(context):
    """``@each_example(context)`` below ``@given``: every example runs inside ``context()``, for state that
    a function-scoped fixture sets up once per test but each example must start from (Dynamo's caches,
    the rewrite statistics)."""

    def decorate(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with context():
                return fn(*args, **kwargs)

        return run

    return decorate


# --------------------------------------------------------------------------------------------------
# Tensor contents from one drawn seed
# --------------------------------------------------------------------------------------------------


class Seed:
    """A seed and a ``torch.Generator`` on it: every random tensor of one example comes from here."""

    def __init__(self, value: int):
        self.value = value
        self.gen = torch.Generator().manual_seed(value)

    def __str__(self) -> str:
        return f"seed={self.value}"

    def __repr__(self) -> str:  # what Hypothesis prints in a falsifying example: Seed(value) replays it
        return f"Seed({self.value})"

    def randn(self, *shape: int, dtype=torch.float32, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=self.gen, dtype=torch.float64) * std).to(dtype)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.gen, dtype=torch.float64)

    def mask(self, *shape, keep: float = 0.7) -> torch.Tensor:
        return self.rand(*shape) < keep

    def randint(self, low: int, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.gen)

    def uniform(self, low: float, high: float) -> float:
        return low + (high - low) * float(self.rand())


def seeds() -> st.SearchStrategy[Seed]:
    return st.integers(0, 2**31 - 1).map(Seed)


# --------------------------------------------------------------------------------------------------
# Memory layouts: a tensor of a given shape seen through a permuted, sliced or broadcast view
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How a tensor of some shape lies in memory: its dims stored in the order ``perm`` (a transposed
    view), each a slice ``offset::step`` of a bigger tensor, and the dims in ``broadcast`` expanded from
    size 1 (stride 0). The identity is the contiguous tensor."""

    perm: tuple[int, ...]
    steps: tuple[int, ...]
    offsets: tuple[int, ...]
    broadcast: tuple[bool, ...]

    @property
    def name(self) -> str:
        parts = []
        if self.perm != tuple(range(len(self.perm))):
            parts.append(f"perm{self.perm}")
        if any(s != 1 for s in self.steps) or any(self.offsets):
            parts.append(f"slice{tuple(f'{o}::{s}' for o, s in zip(self.offsets, self.steps, strict=True))}")
        if any(self.broadcast):
            parts.append(f"broadcast{self.broadcast}")
        return " ".join(parts) or "contiguous"

    def build(self, shape, fill) -> torch.Tensor:
        """The view of ``shape`` with this layout into ``fill(*sizes)``, a contiguous tensor of the sizes
        the view needs, in memory order."""
        shape = tuple(shape)
        assert len(shape) == len(self.perm), (shape, self)
        base = [1 if b else o + max(n - 1, 0) * s + 1
                for n, s, o, b in zip(shape, self.steps, self.offsets, self.broadcast, strict=True)]
        t = fill(*[base[p] for p in self.perm])
        t = t.permute(tuple(sorted(range(len(shape)), key=lambda i: self.perm[i])))  # back to logical order
        index = tuple(slice(0, 1) if b else slice(o, o + max(n - 1, 0) * s + 1 if n else o, s)
                      for n, s, o, b in zip(shape, self.steps, self.offsets, self.broadcast, strict=True))
        t = t[index].expand(shape)
        assert t.shape == shape, (t.shape, shape, self)
        return t

    def make(self, seed: Seed, shape, dtype=torch.float32, std: float = 1.0,
             neg_inf: float = 0.0) -> torch.Tensor:
        """A random tensor of ``shape`` with this layout (values drawn in float64, rounded to ``dtype``), a
        fraction ``neg_inf`` of them -inf."""

        def fill(*sizes):
            t = seed.randn(*sizes, dtype=dtype, std=std)
            if neg_inf:
                t[seed.rand(*sizes) < neg_inf] = -math.inf
            return t

        return self.build(shape, fill)


def contiguous(ndim: int) -> Layout:
    return Layout(tuple(range(ndim)), (1,) * ndim, (0,) * ndim, (False,) * ndim)


@st.composite
def layouts(draw, ndim: int, broadcast: bool = True) -> Layout:
    """A layout for ``ndim`` dims: contiguous, or transposed / sliced / broadcast in any combination."""
    kind = draw(st.sampled_from(["contiguous", "permuted", "sliced", "mixed"]))
    perm = tuple(range(ndim))
    steps, offsets, bcast = (1,) * ndim, (0,) * ndim, (False,) * ndim
    if kind in ("permuted", "mixed") and ndim > 1:
        perm = tuple(draw(st.permutations(range(ndim))))
    if kind in ("sliced", "mixed") and ndim:
        steps = tuple(draw(st.lists(st.sampled_from([1, 2, 3]), min_size=ndim, max_size=ndim)))
        offsets = tuple(draw(st.lists(st.integers(0, 2), min_size=ndim, max_size=ndim)))
    if kind == "mixed" and broadcast and ndim:
        bcast = tuple(draw(st.lists(st.booleans(), min_size=ndim, max_size=ndim)))
    return Layout(perm, steps, offsets, bcast)


# --------------------------------------------------------------------------------------------------
# softmax, log_softmax, logsumexp
# --------------------------------------------------------------------------------------------------

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class Scale:
    """None, a python float, or a one-element tensor of ``dtype`` (0-d or shape (1,))."""

    kind: str  # "none", "float" or "tensor"
    value: float = 1.0
    dtype: torch.dtype = torch.float32
    one_d: bool = False

    def make(self):
        if self.kind == "none":
            return None
        if self.kind == "float":
            return self.value
        t = torch.tensor(self.value, dtype=torch.float64).to(self.dtype)
        return t.reshape(1) if self.one_d else t


@st.composite
def scales(draw, tensor_dtypes=FLOATS) -> Scale:
    kind = draw(st.sampled_from(["none", "float", "tensor"]))
    if kind == "none":
        return Scale("none")
    magnitude = draw(st.floats(0.05, 4.0, allow_nan=False, allow_infinity=False))
    value = magnitude if draw(st.booleans()) else -magnitude
    if kind == "float":
        return Scale("float", value)
    return Scale("tensor", value, draw(st.sampled_from(tensor_dtypes)), draw(st.booleans()))


@dataclass(frozen=True)
class MaskSpec:
    """A bool mask broadcastable to x: the trailing ``len(shape)`` dims of x, each kept or 1, True with
    probability ``keep``, optionally stored transposed (a strided mask)."""

    shape: tuple[int, ...]
    keep: float
    transposed: bool

    def make(self, seed: Seed) -> torch.Tensor:
        if not self.shape:
            return torch.tensor(bool(seed.rand() < self.keep))
        if self.transposed and len(self.shape) >= 2:
            return seed.mask(*reversed(self.shape), keep=self.keep).permute(
                *reversed(range(len(self.shape))))
        return seed.mask(*self.shape, keep=self.keep)


@st.composite
def masks(draw, shape) -> MaskSpec | None:
    """None or a mask broadcastable to ``shape`` (fewer leading dims, size-1 dims, a 0-d mask)."""
    if draw(st.booleans()):
        return None
    ndim = draw(st.integers(0, len(shape)))
    trailing = shape[len(shape) - ndim:]
    mshape = tuple(n if draw(st.booleans()) else 1 for n in trailing)
    keep = draw(st.sampled_from([0.5, 0.8, 1.0, 0.0]))
    return MaskSpec(mshape, keep, draw(st.booleans()))


@dataclass(frozen=True)
class RowCase:
    """One call of softmax / log_softmax / logsumexp: x's shape, layout and dtype, the dim, the output
    dtype (None: x's), keepdim, mask, scale, a fraction of -inf entries, and the seed of the values."""

    shape: tuple[int, ...]
    dim: int
    layout: Layout
    dtype: torch.dtype
    out_dtype: torch.dtype | None
    keepdim: bool
    mask: MaskSpec | None
    scale: Scale
    neg_inf: float
    seed: Seed

    def __repr__(self) -> str:
        return (f"RowCase(shape={self.shape}, dim={self.dim}, layout={self.layout.name}, dtype={self.dtype}, "
                f"out_dtype={self.out_dtype}, keepdim={self.keepdim}, mask={self.mask}, scale={self.scale}, "
                f"neg_inf={self.neg_inf}, {self.seed})")


@st.composite
def row_cases(draw, dtypes=FLOATS, max_row: int = 70, max_elements: int = 1200) -> RowCase:
    """A shape of 0-4 dims (size-0 and size-1 dims included; the reduced dim up to ``max_row``) and
    everything else a call takes (logsumexp ignores ``out_dtype``, softmax and log_softmax ``keepdim``)."""
    ndim = draw(st.integers(0, 4))
    dim = draw(st.integers(-max(ndim, 1), max(ndim, 1) - 1))
    shape = []
    for i in range(ndim):
        if i == dim % ndim:
            shape.append(draw(st.one_of(st.integers(1, 8), st.integers(1, max_row))))
        else:
            shape.append(draw(st.integers(0, 6)))
    while math.prod(shape) > max_elements:
        shape[shape.index(max(shape))] //= 2
    shape = tuple(shape)
    dtype = draw(st.sampled_from(dtypes))
    out_dtype = None if draw(st.booleans()) else draw(st.sampled_from(dtypes))
    scale = draw(scales())
    # -inf entries are excluded (contract section 4); times a negative scale they would be +inf (section 5,
    # tested on its own).
    neg_inf = draw(st.sampled_from([0.0, 0.0, 0.2])) if scale.kind == "none" or scale.value > 0 else 0.0
    return RowCase(shape=shape, dim=dim, layout=draw(layouts(ndim)), dtype=dtype, out_dtype=out_dtype,
                   keepdim=draw(st.booleans()), mask=draw(masks(shape)), scale=scale,
                   neg_inf=neg_inf, seed=draw(seeds()))


# --------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionCase:
    """One attention call: sizes, dtype, layout of q / k / v / the incoming gradient ("bhsd" contiguous,
    "bshd" (B, S, H, D) memory seen as (B, H, S, D), or "sliced"), the options, the mask kind and its
    broadcast shape, and the seed of the values."""

    b: int
    hq: int
    hkv: int
    sq: int
    sk: int
    d: int
    dv: int
    dtype: torch.dtype
    layout: str
    grad_layout: str
    is_causal: bool
    window: tuple | None
    softcap: float | None
    scale: float | None
    mask: str | None  # None, "bool" or "add"
    mask_shape: tuple[int, ...]  # of (B, Hq, Sq, Sk), each kept or 1
    seed: Seed

    def tensor(self, shape, layout: str, std: float = 1.0) -> torch.Tensor:
        b, h, s, d = shape
        if layout == "bshd":
            return self.seed.randn(b, s, h, d, dtype=self.dtype, std=std).transpose(1, 2)
        if layout == "sliced":
            return self.seed.randn(b, h, 2 * s, d + 3, dtype=self.dtype, std=std)[:, :, ::2, 1:d + 1]
        return self.seed.randn(b, h, s, d, dtype=self.dtype, std=std)

    def inputs(self):
        """(q, k, v, grad_out, options) for safeops.attention."""
        q = self.tensor((self.b, self.hq, self.sq, self.d), self.layout)
        k = self.tensor((self.b, self.hkv, self.sk, self.d), self.layout)
        v = self.tensor((self.b, self.hkv, self.sk, self.dv), self.layout)
        g = self.tensor((self.b, self.hq, self.sq, self.dv), self.grad_layout)
        options = {}
        if self.is_causal:
            options["is_causal"] = True
        for name in ("window", "softcap", "scale"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        if self.mask == "bool":
            options["attn_mask"] = self.seed.mask(*self.mask_shape, keep=0.7)
        elif self.mask == "add":
            add = self.seed.randn(*self.mask_shape)
            options["attn_mask"] = torch.where(self.seed.mask(*self.mask_shape, keep=0.8), add, -math.inf)
        return q, k, v, g, options


@st.composite
def attention_cases(draw, dtypes=(torch.float32, torch.float16), max_seq: int = 40) -> AttentionCase:
    """MHA / GQA / MQA, Sq != Sk (empty sides included), D != Dv, causal, windows, softcap, scale, bool and
    additive masks of every broadcast shape, transposed and sliced layouts."""
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.integers(1, 3))
    b = draw(st.integers(1, 2))
    sq = draw(st.one_of(st.integers(1, 20), st.integers(0, max_seq)))
    sk = draw(st.one_of(st.integers(1, 20), st.integers(0, max_seq)))
    d = draw(st.sampled_from([16, 8, 24, 32, 5]))
    dv = d if draw(st.booleans()) else draw(st.sampled_from([16, 8, 40]))
    window = None
    if draw(st.booleans()):
        side = st.one_of(st.none(), st.integers(0, 20))
        window = (draw(side), draw(side))
    mask = draw(st.sampled_from([None, "bool", "add"]))
    mask_shape = tuple(n if draw(st.booleans()) else 1 for n in (b, hq, sq, sk))
    return AttentionCase(
        b=b, hq=hq, hkv=hkv, sq=sq, sk=sk, d=d, dv=dv, dtype=draw(st.sampled_from(dtypes)),
        layout=draw(st.sampled_from(["bhsd", "bshd", "sliced"])),
        grad_layout=draw(st.sampled_from(["bhsd", "bshd", "sliced"])),
        is_causal=draw(st.booleans()), window=window,
        softcap=draw(st.one_of(st.none(), st.floats(0.5, 30.0))),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0), st.floats(-2.0, -0.05))),
        mask=mask, mask_shape=mask_shape, seed=draw(seeds()))


# --------------------------------------------------------------------------------------------------
# cast_transpose
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CastCase:
    """One cast_transpose call: (M, K), x's dtype and layout, the fp8 dtype, tensorwise or rowwise, the scale
    dtype, and the seed of the values."""

    m: int
    k: int
    x_dtype: torch.dtype
    layout: Layout
    fp8: torch.dtype
    rowwise: bool
    scale_dtype: torch.dtype
    seed: Seed

    def __repr__(self) -> str:
        return (f"CastCase(m={self.m}, k={self.k}, x_dtype={self.x_dtype}, layout={self.layout.name}, "
                f"fp8={self.fp8}, rowwise={self.rowwise}, scale_dtype={self.scale_dtype}, {self.seed})")


@st.composite
def cast_cases(draw, max_side: int = 80) -> CastCase:
    return CastCase(
        m=draw(st.one_of(st.integers(1, 20), st.integers(0, max_side))),
        k=draw(st.one_of(st.integers(1, 20), st.integers(0, max_side))),
        x_dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
        layout=draw(layouts(2)), fp8=draw(st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2])),
        rowwise=draw(st.booleans()),
        scale_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])), seed=draw(seeds()))


# --------------------------------------------------------------------------------------------------
# cross_entropy
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CrossEntropyCase:
    """One cross_entropy call: logits (N, C), (C,) or (N, C, d...) with a layout (permuted / sliced, never
    broadcast: the ignored rows' logits are overwritten), their dtype, targets (dtype, ignore_index, the
    fraction ignored), class weights, reduction, label smoothing, z-loss, a fraction of -inf logits, NaN in
    the ignored rows, the logits' scale and the seed of the values."""

    shape: tuple[int, ...]
    layout: Layout
    dtype: torch.dtype
    target_dtype: torch.dtype
    ignore_index: int
    ignored: float
    weight: str  # "none", "same" (the logits' dtype) or "fp32"
    reduction: str
    label_smoothing: float
    z_loss: float
    neg_inf: float
    nan_ignored: bool
    std: float
    seed: Seed

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in (
            "shape", "dtype", "target_dtype", "ignore_index", "ignored", "weight", "reduction",
            "label_smoothing", "z_loss", "neg_inf", "nan_ignored", "std"))
        return f"CrossEntropyCase({fields}, layout={self.layout.name}, {self.seed})"

    @property
    def classes(self) -> int:
        return self.shape[0] if len(self.shape) == 1 else self.shape[1]

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(logits, target, weight)."""
        s, c = self.seed, self.classes
        x = self.layout.make(s, self.shape, self.dtype, std=self.std, neg_inf=self.neg_inf)
        t_shape = () if len(self.shape) == 1 else (self.shape[0], *self.shape[2:])
        target = s.randint(0, max(c, 1), *t_shape) if c else torch.zeros(t_shape, dtype=torch.long)
        drop = s.rand(*t_shape) < self.ignored
        target = torch.where(drop, torch.full_like(target, self.ignore_index), target)
        if self.nan_ignored and drop.any():
            rows = x if x.dim() > 1 else x.unsqueeze(0)
            rows = rows.movedim(1, -1) if rows.dim() > 2 else rows
            rows[drop.reshape(rows.shape[:-1])] = math.nan  # writes through the view into x's memory
        if self.target_dtype == torch.uint8:
            target = target.clamp(0, 255)
        target = target.to(self.target_dtype)
        weight = None
        if self.weight != "none":
            w = s.rand(c) * 2.0
            weight = w.to(self.dtype if self.weight == "same" else torch.float32)
        return x, target, weight


@st.composite
def cross_entropy_cases(draw, dtypes=(torch.float32, torch.bfloat16, torch.float16), max_classes: int = 70,
                        max_elements: int = 600) -> CrossEntropyCase:
    form = draw(st.sampled_from(["rows", "rows", "one_d", "spatial"]))
    c = draw(st.one_of(st.integers(1, 8), st.integers(1, max_classes)))
    if form == "one_d":
        shape = (c,)
    else:
        n = draw(st.one_of(st.integers(1, 8), st.integers(0, 12)))
        extra = (draw(st.integers(1, 3)),) if form == "spatial" else ()
        shape = (n, c, *extra)
        while math.prod(shape) > max_elements:
            shape = (max(1, shape[0] // 2), *shape[1:])
    dtype = draw(st.sampled_from(dtypes))
    ignore_index = draw(st.sampled_from([-100, -100, 0, c - 1]))
    target_dtype = draw(st.sampled_from([torch.int64, torch.int64, torch.int32, torch.uint8]))
    if target_dtype == torch.uint8 and ignore_index < 0:
        ignore_index = 255
    smoothing = draw(st.sampled_from([0.0, 0.0, 1.0]) | st.floats(0.01, 0.99))
    z_loss = draw(st.sampled_from([0.0, 0.0]) | st.floats(1e-4, 1.0))
    return CrossEntropyCase(
        shape=shape, layout=draw(layouts(len(shape), broadcast=False)), dtype=dtype,
        target_dtype=target_dtype,
        ignore_index=ignore_index, ignored=draw(st.sampled_from([0.0, 0.3, 0.3, 1.0])),
        weight=draw(st.sampled_from(["none", "none", "same", "fp32"])),
        reduction=draw(st.sampled_from(["mean", "sum", "none"])), label_smoothing=smoothing, z_loss=z_loss,
        neg_inf=draw(st.sampled_from([0.0, 0.0, 0.1])), nan_ignored=draw(st.booleans()),
        std=draw(st.sampled_from([1.0, 4.0, 30.0])), seed=draw(seeds()))
