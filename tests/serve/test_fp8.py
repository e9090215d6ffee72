"""Float8 draft weights (serve/fp8.py): the rounding is exact in the weight's own dtype, so the float8 copy and the
rounded weight are the same values; the head is rounded in place, borrowed weights are left alone."""

import pytest
import torch
from torch import nn

from eyas.serve.fp8 import E4M3_MAX, Fp8Weights, dequantize, quantize, quantize_linears


def weights(seed=0) -> torch.Tensor:
    """[6, 50]: rows from 1e-6 to 1e3 in scale, one row of zeros, one with a single non-zero entry."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 50, generator=g) * torch.logspace(-6, 3, 6)[:, None]
    w[2] = 0
    w[4, 1:] = 0
    return w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rounding_is_exact_in_the_weights_dtype(dtype):
    w = weights().to(dtype)
    copy = quantize(w)
    assert copy.values.dtype == torch.float8_e4m3fn and copy.scale.dtype == torch.float32
    mantissa, _ = torch.frexp(copy.scale)
    assert torch.all(mantissa == 0.5), "scales are powers of two"
    values = copy.values.float()
    assert values.abs().max() <= E4M3_MAX and torch.isfinite(values).all()
    exact = values * copy.scale[:, None]
    assert torch.equal(dequantize(copy, dtype).float(), exact), "values · scale needs no rounding in the dtype"
    # Each row's largest magnitude lands in e4m3's top binade, so every normal value keeps e4m3's 3 mantissa bits.
    largest = values.abs().amax(dim=1)
    assert torch.all((largest >= E4M3_MAX / 2) | (largest == 0))
    assert torch.equal(largest == 0, w.float().abs().amax(dim=1) == 0)
    # Round to nearest: within half an e4m3 step (2^-4 relative) of the weight, or of e4m3's smallest step (2^-9).
    step = torch.maximum(w.float().abs() * 2**-4, 2**-9 * copy.scale[:, None].expand_as(w))
    assert torch.all((exact - w.float()).abs() <= step)


def test_rounding_twice_changes_nothing():
    copy = quantize(weights(1).bfloat16())
    again = quantize(dequantize(copy, torch.bfloat16))
    assert torch.equal(again.scale, copy.scale) and torch.equal(again.values.float(), copy.values.float())


def test_linears_are_rounded_in_place_and_borrowed_weights_left_alone():
    borrowed = torch.randn(20, 8)
    model = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 8, bias=False))
    model.register_buffer("lm_head_weight", borrowed)  # an EAGLE-1/2 head's lm_head is the target's tensor
    before = [m.weight for m in model]
    table = quantize_linears(model)
    assert len(table) == 2 and model.lm_head_weight is borrowed and table.get(borrowed) is None
    for module, old in zip(model, before, strict=True):
        assert module.weight is not old and not module.weight.requires_grad
        copy = table.get(module.weight)
        assert torch.equal(dequantize(copy, module.weight.dtype), module.weight)
        assert table.get(old) is None


def test_quantizing_again_keeps_the_weights_and_copies_engines_read():
    model = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 8))
    table = quantize_linears(model)
    weights = [m.weight for m in model]
    assert quantize_linears(model) is table and all(m.weight is w for m, w in zip(model, weights, strict=True))


def test_a_copy_is_found_by_the_weight_itself():
    table, w = Fp8Weights(), torch.randn(4, 4)
    copy = quantize(w)
    table.add(w, copy)
    assert table.get(w) is copy and table.get(w.clone()) is None and table.get(w.view(4, 4)) is None
