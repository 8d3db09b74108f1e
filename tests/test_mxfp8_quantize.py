"""flash_moe.quantize_mxfp8 (CUDA) bit for bit against mxfp8.quantize_mxfp8, the Python
specification: both roundings, activations (row-major scales) and weights (blocked scales),
on data that reaches every rule: normal values, values whose blocks scale into e4m3's
subnormals, bf16 subnormals, huge values, all-zero blocks, negative zeros, and blocks with
NaN or +-Inf (scale 0xFF, values 0x7F whatever the rest holds)."""

from __future__ import annotations

import pytest
import torch

from prime_kernels.flash_moe import mxfp8

pytestmark = pytest.mark.gpu

ROUNDINGS = ("rceil", "floor")


def hard_data(shape, generator):
    """bf16 data, 32-element blocks of mixed kinds along the last dim."""
    x = torch.randn(shape, generator=generator)
    blocks = x.view(-1, 32)
    kind = torch.randint(0, 8, (blocks.shape[0], 1), generator=generator)
    span = torch.exp2(torch.randint(-40, 40, (blocks.shape[0], 1), generator=generator).float())
    blocks.mul_(torch.where(kind == 0, span, torch.ones_like(span)))  # any exponent range
    blocks.mul_(torch.where(kind == 1, torch.full_like(span, 2.0**-130), 1.0))  # subnormal
    blocks.mul_(torch.where(kind == 2, torch.full_like(span, 2.0**120), 1.0))  # huge
    blocks.mul_(torch.where(kind == 3, torch.zeros_like(span), 1.0))  # zero block
    sign = torch.where(torch.rand(blocks.shape, generator=generator) < 0.5, -1.0, 1.0)
    blocks.copy_(torch.where(kind == 3, sign * 0.0, blocks))  # with signed zeros
    special = torch.rand(blocks.shape, generator=generator) < 0.02
    blocks.copy_(torch.where((kind == 4) & special, float("nan"), blocks))
    blocks.copy_(torch.where((kind == 5) & special, float("inf"), blocks))
    blocks.copy_(torch.where((kind == 6) & special, -float("inf"), blocks))
    return x.bfloat16()


def bits(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (513, 2048), (64, 7168)])
def test_activations_bitwise(flash_moe, seed, rounding, shape):
    x = hard_data(shape, torch.Generator().manual_seed(seed))
    values, scales = flash_moe.quantize_mxfp8(x.cuda(), rounding=rounding)
    want_values, want_scales = mxfp8.quantize_mxfp8(x, rounding=rounding)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu
    assert scales.shape == (*shape[:-1], shape[-1] // 32)
    assert torch.equal(bits(scales).cpu(), bits(want_scales))
    assert torch.equal(bits(values).cpu(), bits(want_values))


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("shape", [(1, 128, 128), (3, 256, 512), (2, 384, 2048)])
def test_weights_blocked_bitwise(flash_moe, seed, rounding, shape):
    w = hard_data(shape, torch.Generator().manual_seed(seed))
    values, scales = flash_moe.quantize_mxfp8(w.cuda(), rounding=rounding, blocked=True)
    want_values, want_scales = mxfp8.quantize_mxfp8(w, rounding=rounding)
    want_blocked = flash_moe.pack_scales_blocked(want_scales)
    assert scales.shape == want_blocked.shape == (shape[0], shape[1] * shape[2] // 32)
    assert torch.equal(bits(scales).cpu(), bits(want_blocked))
    assert torch.equal(bits(values).cpu(), bits(want_values))


@pytest.mark.sanitize
def test_small_for_sanitizer(flash_moe, seed):
    x = hard_data((5, 64), torch.Generator().manual_seed(seed))
    values, scales = flash_moe.quantize_mxfp8(x.cuda())
    want_values, want_scales = mxfp8.quantize_mxfp8(x)
    assert torch.equal(bits(values).cpu(), bits(want_values))
    assert torch.equal(bits(scales).cpu(), bits(want_scales))


def test_no_rows(flash_moe):
    values, scales = flash_moe.quantize_mxfp8(torch.empty(0, 64, dtype=torch.bfloat16).cuda())
    assert values.shape == (0, 64) and scales.shape == (0, 2)
