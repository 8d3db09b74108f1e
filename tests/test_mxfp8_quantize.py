"""flash_moe.quantize_mxfp8 (CUDA) bit for bit against mxfp8.quantize_mxfp8, the Python
specification: both roundings, activations (row-major scales) and weights (blocked scales),
on data that reaches every rule: normal values, values whose blocks scale into e4m3's
subnormals, bf16 subnormals, huge values, all-zero blocks, negative zeros, and blocks with
NaN or +-Inf (scale 0xFF, values 0x7F whatever the rest holds). Then flash_moe's
pack_scales_blocked and unpack_scales_blocked (CUDA) bit for bit against mxfp8.py's on random
scale bytes: the shapes of each of the kernel's paths, views it must copy or realign, the
errors of the pure-PyTorch path, and torch.compile."""

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


def test_unaligned_view_is_refused(flash_moe):
    """The kernel reads x in 16-byte vectors: a contiguous view that starts 2 bytes into its
    storage is refused before any launch, naming x and what to do."""
    x = torch.randn(4 * 64 + 1, device="cuda").bfloat16()[1:].view(4, 64)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    with pytest.raises(ValueError, match="argument 'x' must start on a 16-byte boundary"):
        flash_moe.quantize_mxfp8(x)
    values, _ = flash_moe.quantize_mxfp8(x.clone())
    assert values.shape == x.shape


def test_no_rows(flash_moe):
    values, scales = flash_moe.quantize_mxfp8(torch.empty(0, 64, dtype=torch.bfloat16).cuda())
    assert values.shape == (0, 64) and scales.shape == (0, 2)


# Blocked scale layout

U8 = torch.uint8
E8M0 = torch.float8_e8m0fnu


def scale_bytes(shape, seed):
    return torch.randint(0, 256, shape, dtype=U8, generator=torch.Generator().manual_seed(seed))


def check_pack_unpack(flash_moe, scales, want_bits):
    """pack_scales_blocked of CUDA ``scales`` (..., MN, K/32) is mxfp8.py's packing of
    ``want_bits`` (its row-major bytes on the CPU), and unpacking it gives them back."""
    *lead, mn, kb = want_bits.shape
    packed = flash_moe.pack_scales_blocked(scales)
    assert packed.dtype == E8M0 and packed.shape == (*lead, mn * kb) and packed.is_cuda
    want = mxfp8.pack_scales_blocked(want_bits).reshape(*lead, mn * kb)
    assert torch.equal(bits(packed).cpu(), want)
    back = flash_moe.unpack_scales_blocked(packed, mn)
    assert back.dtype == E8M0 and back.shape == want_bits.shape
    assert torch.equal(bits(back).cpu(), want_bits)


@pytest.mark.parametrize("kb", [4, 8, 64, 224])
@pytest.mark.parametrize("mn", [128, 256, 768 * 2])
@pytest.mark.parametrize("lead", [(), (3,)])
def test_pack_scales_blocked_bitwise(flash_moe, seed, lead, mn, kb):
    raw = scale_bytes((*lead, mn, kb), seed)
    check_pack_unpack(flash_moe, raw.cuda().view(E8M0), raw)
    # unpacking any bytes, not only a packed image, is mxfp8.py's unpacking
    got = flash_moe.unpack_scales_blocked(raw.cuda().reshape(*lead, mn * kb), mn)
    assert torch.equal(bits(got).cpu(), mxfp8.unpack_scales_blocked(raw))


# Rows of 24 scales (Qwen3's w2): 16-byte vectors span rows. Beyond 128 scales a CTA takes a
# row segment: 4-byte vectors when K/32 is no multiple of 16 (132, 260), 16 bytes otherwise
# with a narrower last segment (272). Several tile rows per CTA, the last CTA's fewer (2048
# rows of 24, 640 of 12, 40 * 128 of 4), more leading dims, and no experts at all.
@pytest.mark.parametrize(
    "shape",
    [
        (128, 24),
        (2, 2048, 24),
        (2, 256, 132),
        (384, 260),
        (384, 272),
        (640, 12),
        (40, 128, 4),
        (2, 3, 128, 16),
        (0, 128, 8),
    ],
)
def test_pack_scales_blocked_kernel_paths(flash_moe, seed, shape):
    raw = scale_bytes(shape, seed)
    check_pack_unpack(flash_moe, raw.cuda(), raw)


def test_pack_scales_blocked_takes_any_view(flash_moe, seed):
    raw = scale_bytes((2, 256, 16), seed)
    strided = raw.cuda().transpose(-2, -1).contiguous().transpose(-2, -1)
    assert not strided.is_contiguous()
    check_pack_unpack(flash_moe, strided, raw)


@pytest.mark.parametrize("offset", [1, 4, 8])
def test_pack_scales_blocked_of_unaligned_views(flash_moe, seed, offset):
    """Views starting mid-word (copied first) or on a word but not 16 bytes (4-byte vectors)."""
    raw = scale_bytes((2, 256, 8), seed)
    storage = torch.zeros(raw.numel() + offset, dtype=U8, device="cuda")
    storage[offset:] = raw.reshape(-1).cuda()
    check_pack_unpack(flash_moe, storage[offset:].view(raw.shape), raw)
    packed = mxfp8.pack_scales_blocked(raw).reshape(-1).cuda()
    storage[offset:] = packed
    back = flash_moe.unpack_scales_blocked(storage[offset:].view(2, -1), 256)
    assert torch.equal(bits(back).cpu(), raw)


@pytest.mark.parametrize(
    ("call", "shape", "dtype", "mn"),
    [
        ("pack", (64, 4), U8, None),
        ("pack", (128, 6), U8, None),
        ("pack", (2, 130, 4), E8M0, None),
        ("pack", (512,), U8, None),
        ("pack", (128, 4), torch.float32, None),
        ("unpack", (100,), U8, 128),
        ("unpack", (512,), U8, 0),
        ("unpack", (2, 130 * 4), U8, 130),
        ("unpack", (2, 128 * 6), E8M0, 128),
        ("unpack", (), U8, 128),
        ("unpack", (512,), torch.int32, 128),
    ],
)
def test_pack_scales_blocked_errors_are_the_python_paths(flash_moe, call, shape, dtype, mn):
    """CUDA tensors get the very errors CPU tensors get from the pure-PyTorch path, before
    any launch."""

    def run(device):
        if dtype == E8M0:
            t = torch.zeros(shape, dtype=U8, device=device).view(E8M0)
        else:
            t = torch.zeros(shape, dtype=dtype, device=device)
        if call == "pack":
            flash_moe.pack_scales_blocked(t)
        else:
            flash_moe.unpack_scales_blocked(t, mn)

    with pytest.raises((TypeError, ValueError)) as on_cpu:
        run("cpu")
    with pytest.raises(on_cpu.type) as on_cuda:
        run("cuda")
    assert str(on_cuda.value) == str(on_cpu.value)
    torch.cuda.synchronize()


def test_pack_scales_blocked_compiles(flash_moe, seed):
    raw = scale_bytes((2, 256, 8), seed)

    def pack_unpack(scales):
        packed = flash_moe.pack_scales_blocked(scales)
        return packed, flash_moe.unpack_scales_blocked(packed, scales.shape[-2])

    compiled = torch.compile(pack_unpack, fullgraph=True)
    packed, back = compiled(raw.cuda().view(E8M0))
    assert packed.dtype == back.dtype == E8M0
    assert torch.equal(bits(packed).cpu(), mxfp8.pack_scales_blocked(raw).reshape(2, -1))
    assert torch.equal(bits(back).cpu(), raw)


@pytest.mark.sanitize
def test_pack_scales_blocked_small_for_sanitizer(flash_moe, seed):
    for shape in ((2, 128, 12), (128, 132)):
        raw = scale_bytes(shape, seed)
        check_pack_unpack(flash_moe, raw.cuda(), raw)
