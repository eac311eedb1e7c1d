"""Contract section 8: bad input gets a clear error naming the argument, never a wrong answer."""

from __future__ import annotations

import math

import pytest
import torch

import safeops

FN = {"softmax": safeops.softmax, "log_softmax": safeops.log_softmax, "logsumexp": safeops.logsumexp}
OPS = list(FN)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool],
                         ids=["int32", "int64", "uint8", "bool"])
@pytest.mark.parametrize("op", OPS)
def test_integer_or_bool_x_raises_type_error_naming_x(backend, op, dtype):
    x = torch.ones(3, 4, dtype=dtype)
    with pytest.raises(TypeError, match=r"\bx\b") as info:
        FN[op](x)
    assert str(dtype) in str(info.value), info.value


@pytest.mark.parametrize("op", OPS)
def test_x_not_a_tensor(backend, op):
    with pytest.raises(TypeError, match=r"\bx\b"):
        FN[op]([[1.0, 2.0]])


@pytest.mark.parametrize("shape,dim", [((3, 4), 2), ((3, 4), -3), ((), 1), ((), -2), ((5,), 1)],
                         ids=["2d_dim2", "2d_dim_minus3", "0d_dim1", "0d_dim_minus2", "1d_dim1"])
@pytest.mark.parametrize("op", OPS)
def test_dim_out_of_range_raises_value_error(backend, op, shape, dim):
    with pytest.raises(ValueError, match=r"\bdim\b") as info:
        FN[op](torch.zeros(shape), dim)
    assert str(dim) in str(info.value), info.value


@pytest.mark.parametrize("dim", [1.0, "1", None, True], ids=["float", "str", "none", "bool"])
@pytest.mark.parametrize("op", OPS)
def test_dim_of_wrong_type_raises_type_error(backend, op, dim):
    with pytest.raises(TypeError, match=r"\bdim\b"):
        FN[op](torch.zeros(3, 4), dim)


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.int64, torch.uint8],
                         ids=["float32", "int64", "uint8"])
@pytest.mark.parametrize("op", OPS)
def test_non_bool_mask_raises_type_error(backend, op, mask_dtype):
    with pytest.raises(TypeError, match=r"\bmask\b"):
        FN[op](torch.zeros(3, 4), mask=torch.ones(3, 4, dtype=mask_dtype))


@pytest.mark.parametrize("op", OPS)
def test_mask_not_a_tensor_raises_type_error(backend, op):
    with pytest.raises(TypeError, match=r"\bmask\b"):
        FN[op](torch.zeros(3, 4), mask=[[True] * 4] * 3)


@pytest.mark.parametrize("mask_shape", [(4, 3), (2, 3, 4), (5,), (3, 1, 4)],
                         ids=["transposed", "more_rows_than_x", "wrong_length", "extra_dim"])
@pytest.mark.parametrize("op", OPS)
def test_non_broadcastable_mask_raises_value_error(backend, op, mask_shape):
    # A mask must broadcast TO x: one that would broadcast x up to a bigger shape is an error too.
    with pytest.raises(ValueError, match=r"\bmask\b"):
        FN[op](torch.zeros(3, 4), mask=torch.ones(mask_shape, dtype=torch.bool))


@pytest.mark.parametrize("op", OPS)
def test_mask_on_another_device_raises_value_error(backend, op):
    with pytest.raises(ValueError, match=r"\bmask\b"):
        FN[op](torch.zeros(3, 4), mask=torch.ones(3, 4, dtype=torch.bool, device="meta"))


BAD_SCALES = {
    "string": ("0.5", TypeError),
    "bool": (True, TypeError),
    "complex": (1 + 2j, TypeError),
    "list": ([0.5], TypeError),
    "tensor_two_elements": (torch.tensor([0.5, 0.5]), ValueError),
    "tensor_2d": (torch.ones(1, 1), ValueError),
    "tensor_empty": (torch.ones(0), ValueError),
    "tensor_int": (torch.tensor(2), TypeError),
    "tensor_bool": (torch.tensor(True), TypeError),
}


@pytest.mark.parametrize("bad", list(BAD_SCALES), ids=list(BAD_SCALES))
@pytest.mark.parametrize("op", OPS)
def test_bad_scale(backend, op, bad):
    scale, error = BAD_SCALES[bad]
    with pytest.raises(error, match=r"\bscale\b"):
        FN[op](torch.zeros(3, 4), scale=scale)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, "float32", torch.complex64],
                         ids=["int32", "bool", "str", "complex64"])
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_bad_dtype_raises_type_error(backend, op, dtype):
    with pytest.raises(TypeError, match=r"\bdtype\b"):
        FN[op](torch.zeros(3, 4), dtype=dtype)


def test_bad_keepdim_raises_type_error(backend):
    with pytest.raises(TypeError, match=r"\bkeepdim\b"):
        safeops.logsumexp(torch.zeros(3, 4), keepdim=1)


@pytest.mark.parametrize("op", OPS)
def test_unknown_backend_raises_value_error(monkeypatch, op):
    monkeypatch.setenv("SAFEOPS_BACKEND", "bogus")
    with pytest.raises(ValueError, match="SAFEOPS_BACKEND") as info:
        FN[op](torch.zeros(3, 4))
    assert "bogus" in str(info.value)


# --------------------------------------------------------------------------------------------------
# Empty tensors return empty results (the same shapes as torch's own ops)
# --------------------------------------------------------------------------------------------------

EMPTY = {
    "zero_rows": ((0, 5), -1),
    "zero_rows_dim0": ((0, 5), 0),
    "zero_batch_3d": ((2, 0, 5), -1),
    "zero_length_1d": ((0,), 0),
    "zero_columns": ((3, 0), -1),
}

@pytest.mark.parametrize("case", list(EMPTY), ids=list(EMPTY))
@pytest.mark.parametrize("op", OPS)
def test_empty_tensors_return_empty_results(backend, op, case):
    shape, dim = EMPTY[case]
    x = torch.zeros(shape, requires_grad=True)
    torch_fn = {"softmax": torch.softmax, "log_softmax": torch.log_softmax, "logsumexp": torch.logsumexp}[op]
    expected = torch_fn(x.detach(), dim)
    y = FN[op](x, dim)
    assert y.shape == expected.shape and y.dtype == expected.dtype, (y.shape, expected.shape)
    if op == "logsumexp":
        # A reduction over nothing is an empty row: -inf (contract section 4), as torch.logsumexp gives.
        assert (y == -math.inf).all(), y
    (dx,) = torch.autograd.grad(torch.where(y.isinf(), 0, y).sum(), [x], allow_unused=True)
    assert dx is None or (dx.shape == x.shape and (dx == 0).all())
