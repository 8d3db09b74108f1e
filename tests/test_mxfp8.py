"""Tests of the MXFP8 helpers in prime_kernels.flash_moe.mxfp8 (CPU; CUDA variants skip
without a device)."""

from __future__ import annotations

import math

import pytest
import torch

from prime_kernels.flash_moe import mxfp8

U8 = torch.uint8


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(request.param)


def wide_range(shape, *, seed, lo=-30, hi=30, dtype=torch.float32):
    """randn with one random power-of-two magnitude per 32-block (spans many scales)."""
    g = torch.Generator().manual_seed(seed)
    *lead, K = shape
    mag = torch.randint(lo, hi, (*lead, K // 32, 1), generator=g).to(torch.float64)
    x = torch.randn(*lead, K // 32, 32, generator=g, dtype=torch.float64) * torch.exp2(mag)
    return x.reshape(shape).to(dtype)


def bits(t):
    return t.view(U8)


def scale_exponent_oracle(amax: float, rounding: str) -> int:
    """The biased e8m0 exponent for one block's amax, from exact float64 arithmetic."""
    if amax == 0.0:
        return 0
    if rounding == "rceil":
        # smallest e with amax <= 448 * 2^e (448 * 2^e and the comparison are exact in fp64)
        e = math.frexp(amax / 448.0)[1] - 1  # floor(log2(amax / 448)), approximately
        while amax > 448.0 * 2.0**e:
            e += 1
        while amax <= 448.0 * 2.0 ** (e - 1):
            e -= 1
    else:
        e = math.frexp(amax)[1] - 1 - 8  # floor(log2(amax)) - 8
    return min(max(e + 127, 0), 254)


def e4m3_bound(x, scale):
    """Max |x - dequant(quant(x))| without saturation: half an e4m3 ulp (relative 2^-4) or
    half the subnormal step (2^-10 in units of the scale), whichever is larger."""
    return torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)


def block_scales(scales, K):
    """Per-element fp64 scale (2^(s-127)) broadcast over the 32 elements of each block."""
    s = bits(scales).to(torch.float64)
    return torch.exp2(s - 127).repeat_interleave(32, dim=-1)[..., :K]


# ----------------------------------------------------------------------------------------
# Scales and values against exact oracles


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_scales_match_exact_oracle(rounding):
    x = wide_range((16, 512), seed=1, lo=-100, hi=100)
    _, scales = mxfp8.quantize_mxfp8(x, rounding=rounding)
    assert scales.dtype == torch.float8_e8m0fnu and scales.shape == (16, 16)
    amax = x.double().abs().reshape(16, 16, 32).amax(-1)
    want = [[scale_exponent_oracle(a, rounding) for a in row] for row in amax.tolist()]
    assert bits(scales).tolist() == want


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_values_match_oracle(rounding):
    x = wide_range((8, 256), seed=2)
    values, scales = mxfp8.quantize_mxfp8(x, rounding=rounding)
    assert values.dtype == torch.float8_e4m3fn and values.shape == x.shape
    scale = block_scales(scales, 256)
    v = (x.double() / scale).clamp(-448, 448).float()  # exact: division by a power of two
    assert torch.equal(bits(values), bits(v.to(torch.float8_e4m3fn)))
    assert not ((bits(values) & 0x7F) == 0x7F).any()  # no NaN from a finite input


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_within_e4m3_bound_rceil(dtype):
    lo, hi = (-10, 10) if dtype == torch.float16 else (-40, 40)
    x = wide_range((4, 3, 1024), seed=3, lo=lo, hi=hi, dtype=dtype)
    values, scales = mxfp8.quantize_mxfp8(x)
    assert scales.shape == (4, 3, 32)
    back = mxfp8.dequantize_mxfp8(values, scales)
    assert back.dtype == torch.float32
    err = (back.double() - x.double()).abs()
    bound = e4m3_bound(x.double(), block_scales(scales, 1024))
    assert (err <= bound).all()
    # rceil never saturates: every block's amax fits under 448 * scale.
    amax_ratio = x.double().abs().reshape(4, 3, 32, 32).amax(-1) / torch.exp2(
        bits(scales).double() - 127
    )
    assert (amax_ratio <= 448).all() and (amax_ratio > 224).all()
    # and the bound is not vacuous: the error is a real e4m3 rounding error
    rel = (err.norm() / x.double().norm()).item()
    assert 1e-3 < rel < 2.0**-4


def test_round_trip_floor_saturates_exactly():
    x = wide_range((8, 512), seed=4)
    values, scales = mxfp8.quantize_mxfp8(x, rounding="floor")
    back = mxfp8.dequantize_mxfp8(values, scales).double()
    scale = block_scales(scales, 512)
    ratio = x.double().abs() / scale
    sat = ratio > 448
    assert sat.any()  # floor leaves amax/scale in [256, 512): some blocks clip
    assert torch.equal(back[sat], 448 * scale[sat] * x.double()[sat].sign())
    err = (back - x.double()).abs()
    assert (err[~sat] <= e4m3_bound(x.double(), scale)[~sat]).all()
    amax_ratio = ratio.reshape(8, 16, 32).amax(-1)
    assert (amax_ratio >= 256).all() and (amax_ratio < 512).all()


def test_input_dtypes_agree():
    x = wide_range((4, 128), seed=5, lo=-8, hi=8, dtype=torch.bfloat16)  # exact in all three
    for rounding in ("rceil", "floor"):
        ref_v, ref_s = mxfp8.quantize_mxfp8(x.float(), rounding=rounding)
        for dtype in (torch.bfloat16, torch.float16):
            v, s = mxfp8.quantize_mxfp8(x.to(dtype), rounding=rounding)
            assert torch.equal(bits(v), bits(ref_v)) and torch.equal(bits(s), bits(ref_s))


def test_rne_cast_points():
    # amax 448 -> scale 1 under rceil (s = 127): values are quantized as they are.
    x = torch.zeros(32)
    x[0] = 448
    x[1:9] = torch.tensor([1.0625, 1.1875, 2**-8, 3 * 2**-10, 2**-10, 5 * 2**-11, -448, -0.0])
    values, scales = mxfp8.quantize_mxfp8(x)
    assert bits(scales).tolist() == [127]
    # 1.0625 ties to 1.0 (even), 1.1875 ties to 1.25, 2^-8 = 2 * 2^-9 exact, 3*2^-10 ties to
    # 2 * 2^-9, 2^-10 ties to 0, 5*2^-11 rounds to 1 * 2^-9; -448 and -0 keep their sign.
    got = bits(values)[:9].tolist()
    assert got == [0x7E, 0x38, 0x3A, 0x02, 0x02, 0x00, 0x01, 0xFE, 0x80]


# ----------------------------------------------------------------------------------------
# rceil vs floor


def test_rceil_floor_relation():
    x = wide_range((32, 1024), seed=6, lo=-60, hi=60)
    _, s_r = mxfp8.quantize_mxfp8(x, rounding="rceil")
    _, s_f = mxfp8.quantize_mxfp8(x, rounding="floor")
    d = bits(s_r).int() - bits(s_f).int()
    assert set(d.unique().tolist()) == {0, 1}
    amax = x.double().abs().reshape(32, 32, 32).amax(-1)
    mant = 2 * torch.frexp(amax).mantissa  # amax / 2^floor(log2(amax)), in [1, 2)
    assert torch.equal(d == 1, mant > 1.75)


@pytest.mark.parametrize("e", [-100, -20, 0, 1, 7, 50])
def test_rceil_floor_at_the_boundary(e):
    one_up = 1 + 2.0**-23
    cases = {  # amax: (rceil - 127, floor - 127) in units of 2^e
        1.75 * 2.0**e: (e - 8, e - 8),  # 448 * 2^(e-8): exactly at the top, no round-up
        1.75 * one_up * 2.0**e: (e - 7, e - 8),
        2.0**e: (e - 8, e - 8),
        (2 - 2.0**-23) * 2.0**e: (e - 7, e - 8),
    }
    for amax, (want_r, want_f) in cases.items():
        x = torch.zeros(32)
        x[5] = -amax
        x[6] = amax / 3
        _, s_r = mxfp8.quantize_mxfp8(x, rounding="rceil")
        _, s_f = mxfp8.quantize_mxfp8(x, rounding="floor")
        assert bits(s_r).item() - 127 == want_r, amax
        assert bits(s_f).item() - 127 == want_f, amax


# ----------------------------------------------------------------------------------------
# Zero blocks, denormal range, saturating values


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_zero_blocks(rounding):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 128, generator=g)
    x[0, 32:64] = 0.0
    x[1, :32] = -0.0
    x[2] = 0.0
    values, scales = mxfp8.quantize_mxfp8(x, rounding=rounding)
    s = bits(scales)
    assert s[0, 1] == 0 and s[1, 0] == 0 and (s[2] == 0).all()
    assert (bits(values)[0, 32:64] == 0x00).all()
    assert (bits(values)[1, :32] == 0x80).all()  # the sign of zero is kept
    assert (bits(values)[2] == 0).all()
    assert (mxfp8.dequantize_mxfp8(values, scales)[2] == 0).all()
    # Neighbouring blocks are unaffected by the zero block.
    v1, s1 = mxfp8.quantize_mxfp8(x[0, :32].clone(), rounding=rounding)
    assert torch.equal(bits(v1), bits(values)[0, :32]) and bits(s1).item() == s[0, 0]


def test_tiny_amax_clamps_to_smallest_scale():
    for rounding in ("rceil", "floor"):
        # fp32 denormal inputs and tiny normals: s = 0, scale 2^-127, values x * 2^127.
        x = torch.zeros(2, 32)
        x[0, :4] = torch.tensor([1e-42, -3e-43, 1e-44, 5e-45])
        x[1, :3] = torch.tensor([1e-37, -4e-38, 3e-39])
        values, scales = mxfp8.quantize_mxfp8(x, rounding=rounding)
        assert bits(scales).tolist() == [[0], [0]]
        scale = torch.full((2, 32), 2.0**-127, dtype=torch.float64)
        back = mxfp8.dequantize_mxfp8(values, scales).double()
        assert ((back - x.double()).abs() <= e4m3_bound(x.double(), scale)).all()
        assert back[1, 0] != 0  # 1e-37 * 2^127 = 17.0: really scaled, not flushed


def test_rceil_denormal_quotient():
    # q = amax / 448 is an fp32 denormal here; rounding q up gives s = 0 iff q <= 2^-127.
    at = 448 * 2.0**-127  # q = 2^-127 exactly
    for amax, want in [(at, 0), (at * (1 + 2.0**-10), 1), (at * 0.75, 0), (at * 1.99, 1)]:
        x = torch.zeros(32)
        x[3] = amax
        values, scales = mxfp8.quantize_mxfp8(x)
        assert bits(scales).item() == want, amax
        assert mxfp8.dequantize_mxfp8(values, scales)[3].item() == pytest.approx(amax, rel=2**-4)
        assert bits(values)[3] != 0x7F


def test_e4m3_subnormals_in_block():
    # Elements far below the block's max land in e4m3's subnormal range (m * 2^-9 * scale).
    g = torch.Generator().manual_seed(8)
    x = torch.randn(64, 32, generator=g) * 2.0**-12
    x[:, 0] = 448.0 * 2.0**-3
    values, scales = mxfp8.quantize_mxfp8(x)
    assert (bits(scales) == 124).all()
    back = mxfp8.dequantize_mxfp8(values, scales).double()
    scale = torch.full_like(back, 2.0**-3)
    assert ((back - x.double()).abs() <= e4m3_bound(x.double(), scale)).all()
    sub = (bits(values) & 0x78) == 0  # exponent field 0: subnormal or zero
    assert sub[:, 1:].float().mean() > 0.9 and (back[:, 1:] != 0).any()


def test_saturating_and_extreme_values():
    big = torch.finfo(torch.float32).max
    x = torch.zeros(3, 32)
    x[0, 0], x[0, 1] = 500.0, -500.0
    x[1, 0] = big
    x[1, 1] = -big / 7
    x[2, 0] = 447.9
    vr, sr = mxfp8.quantize_mxfp8(x, rounding="rceil")
    vf, sf = mxfp8.quantize_mxfp8(x, rounding="floor")
    # floor: 500 has exponent 8, s = 127: scale 1, 500 clamps to 448.
    assert bits(sf)[0].item() == 127 and bits(vf)[0, :2].tolist() == [0x7E, 0xFE]
    # rceil: 500 / 448 > 1, s = 128: 250 rounds to 256 (0x78).
    assert bits(sr)[0].item() == 128 and bits(vr)[0, 0].item() == 0x78
    # fp32 max: rceil s = 127 + ceil(log2(max / 448)) = 247; floor 127 + 127 - 8 = 246.
    assert bits(sr)[1].item() == 247 and bits(sf)[1].item() == 246
    for v in (vr, vf):
        assert not ((bits(v) & 0x7F) == 0x7F).any()
    back = mxfp8.dequantize_mxfp8(vr, sr)
    assert torch.isfinite(back[[0, 2]]).all() and torch.isfinite(back[1, 1:]).all()
    # fp32 max / 2^120 = 255.99.. rounds to 256 in e4m3: 256 * 2^120 overflows fp32 again.
    assert bits(vr)[1, 0].item() == 0x78 and back[1, 0].item() == math.inf
    # 447.9: rceil keeps scale 1 (s=127) and rounds to 448.
    assert bits(sr)[2].item() == 127 and bits(vr)[2, 0].item() == 0x7E


def test_dequantize_extremes():
    values = torch.full((2, 32), 448.0).to(torch.float8_e4m3fn)
    scales = torch.tensor([[254], [0]], dtype=U8)
    out = mxfp8.dequantize_mxfp8(values, scales)
    assert torch.isinf(out[0]).all()  # 448 * 2^127 overflows fp32
    assert (out[1] == 448 * 2.0**-127).all()
    out16 = mxfp8.dequantize_mxfp8(values, scales.view(torch.float8_e8m0fnu), dtype=torch.bfloat16)
    assert out16.dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------
# NaN / Inf policy


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_block_is_nan(rounding, bad, dtype):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 96, generator=g)
    x[0, 40] = bad
    x[1, 95] = bad
    x = x.to(dtype)
    values, scales = mxfp8.quantize_mxfp8(x, rounding=rounding)
    s, v = bits(scales), bits(values)
    assert s[0].tolist()[1] == 0xFF and s[1].tolist()[2] == 0xFF
    assert (v[0, 32:64] == 0x7F).all() and (v[1, 64:] == 0x7F).all()
    # Other blocks: exactly what quantizing them alone gives.
    for r, cols in ((0, [0, 2]), (1, [0, 1])):
        for c in cols:
            ov, os_ = mxfp8.quantize_mxfp8(x[r, c * 32 : (c + 1) * 32].clone(), rounding=rounding)
            assert torch.equal(v[r, c * 32 : (c + 1) * 32], bits(ov))
            assert s[r, c] == bits(os_).item() != 0xFF
    back = mxfp8.dequantize_mxfp8(values, scales)
    assert torch.isnan(back[0, 32:64]).all() and torch.isnan(back[1, 64:]).all()
    assert torch.isfinite(back[0, :32]).all() and torch.isfinite(back[1, :64]).all()


def test_nan_scale_alone_dequantizes_to_nan():
    values = torch.ones(32).to(torch.float8_e4m3fn)
    assert torch.isnan(mxfp8.dequantize_mxfp8(values, torch.tensor([0xFF], dtype=U8))).all()


# ----------------------------------------------------------------------------------------
# Shapes and errors


def test_leading_dims():
    x = wide_range((2, 3, 5, 96), seed=10, dtype=torch.bfloat16)
    v, s = mxfp8.quantize_mxfp8(x)
    assert v.shape == (2, 3, 5, 96) and s.shape == (2, 3, 5, 3)
    v2, s2 = mxfp8.quantize_mxfp8(x.reshape(30, 96))
    assert torch.equal(bits(v).reshape(30, 96), bits(v2))
    assert torch.equal(bits(s).reshape(30, 3), bits(s2))
    # 1-D and non-contiguous inputs
    v1, s1 = mxfp8.quantize_mxfp8(x[1, 2, 4])
    assert torch.equal(bits(v1), bits(v)[1, 2, 4]) and s1.shape == (3,)
    xt = wide_range((64, 96), seed=11).t()  # (96, 64), non-contiguous
    vt, _ = mxfp8.quantize_mxfp8(xt)
    assert torch.equal(bits(vt), bits(mxfp8.quantize_mxfp8(xt.contiguous())[0]))
    back = mxfp8.dequantize_mxfp8(v, s)
    assert back.shape == x.shape


def test_quantize_errors():
    with pytest.raises(ValueError, match="multiple of the scale block 32"):
        mxfp8.quantize_mxfp8(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="rounding"):
        mxfp8.quantize_mxfp8(torch.zeros(4, 32), rounding="nearest")
    with pytest.raises(TypeError):
        mxfp8.quantize_mxfp8(torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(TypeError):
        mxfp8.quantize_mxfp8(torch.zeros(4, 32, dtype=torch.float64))
    v, s = mxfp8.quantize_mxfp8(torch.zeros(4, 64))
    with pytest.raises(ValueError, match="scales has shape"):
        mxfp8.dequantize_mxfp8(v, s[:, :1])
    with pytest.raises(TypeError):
        mxfp8.dequantize_mxfp8(v.view(U8), s)
    with pytest.raises(TypeError):
        mxfp8.dequantize_mxfp8(v, s.view(U8).float())


def test_block_argument():
    x = wide_range((4, 64), seed=12)
    v16, s16 = mxfp8.quantize_mxfp8(x, block=16)
    assert s16.shape == (4, 4)
    halves = [
        mxfp8.quantize_mxfp8(x[:, i * 16 : (i + 1) * 16].contiguous(), block=16) for i in range(4)
    ]
    assert torch.equal(bits(v16), torch.cat([bits(h[0]) for h in halves], dim=1))
    assert mxfp8.dequantize_mxfp8(v16, s16, block=16).shape == (4, 64)


def test_quantize_on_device_matches_cpu(device):
    x = wide_range((64, 256), seed=13, lo=-130, hi=120)
    x[3, 7] = math.nan
    x[5, 200] = -math.inf
    x[9, 64:96] = 0.0
    x[10, :32] = 1e-42
    for rounding in ("rceil", "floor"):
        cv, cs = mxfp8.quantize_mxfp8(x, rounding=rounding)
        dv, ds = mxfp8.quantize_mxfp8(x.to(device), rounding=rounding)
        assert dv.device.type == device.type
        assert torch.equal(bits(cv), bits(dv).cpu()) and torch.equal(bits(cs), bits(ds).cpu())
        back = mxfp8.dequantize_mxfp8(dv, ds)
        assert torch.allclose(
            back.cpu(), mxfp8.dequantize_mxfp8(cv, cs), equal_nan=True, rtol=0, atol=0
        )


# ----------------------------------------------------------------------------------------
# Blocked scale layout


def blocked_offset(r, c, kb):
    """Byte offset of row-major scale (r, c) in the blocked layout, straight from the contract."""
    tile = (r // 128) * (kb // 4) + (c // 4)
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)


@pytest.mark.parametrize("mn,kb", [(128, 4), (256, 8), (384, 12)])
def test_pack_matches_per_element_formula(mn, kb):
    g = torch.Generator().manual_seed(14)
    scales = torch.randint(0, 256, (mn, kb), generator=g, dtype=U8).view(torch.float8_e8m0fnu)
    packed = mxfp8.pack_scales_blocked(scales)
    assert packed.shape == scales.shape and packed.dtype == scales.dtype
    assert packed.is_contiguous()
    flat = bits(packed).reshape(-1).tolist()
    src = bits(scales).tolist()
    seen = set()
    for r in range(mn):
        for c in range(kb):
            off = blocked_offset(r, c, kb)
            assert flat[off] == src[r][c], (r, c, off)
            seen.add(off)
    assert len(seen) == mn * kb  # a bijection onto the buffer


def test_pack_leading_dims_are_independent_chunks():
    g = torch.Generator().manual_seed(15)
    scales = torch.randint(0, 256, (3, 2, 256, 8), generator=g, dtype=U8)
    packed = mxfp8.pack_scales_blocked(scales)
    assert packed.shape == scales.shape
    for i in range(3):
        for j in range(2):
            assert torch.equal(packed[i, j], mxfp8.pack_scales_blocked(scales[i, j]))
    # chunk (i, j) occupies bytes [(i*2 + j) * 2048, ... + 2048) of the buffer
    flat = packed.reshape(-1)
    assert torch.equal(flat[2048 * 3 : 2048 * 4], packed[1, 1].reshape(-1))


@pytest.mark.parametrize("dtype", [torch.float8_e8m0fnu, U8])
def test_pack_unpack_inverse(dtype):
    g = torch.Generator().manual_seed(16)
    raw = torch.randint(0, 256, (2, 512, 16), generator=g, dtype=U8)
    scales = raw.view(dtype) if dtype != U8 else raw
    packed = mxfp8.pack_scales_blocked(scales)
    assert not torch.equal(bits(packed), bits(scales))
    assert torch.equal(bits(mxfp8.unpack_scales_blocked(packed)), raw)
    assert torch.equal(bits(mxfp8.pack_scales_blocked(mxfp8.unpack_scales_blocked(scales))), raw)
    # non-contiguous input packs by value
    t = raw.transpose(-2, -1).contiguous().transpose(-2, -1)
    assert torch.equal(mxfp8.pack_scales_blocked(t), mxfp8.pack_scales_blocked(raw))


def test_pack_quantized_weights():
    # w (E, 2H, D) quantized along D: scales (E, 2H, D/32) pack per expert.
    w = wide_range((2, 256, 128), seed=17, dtype=torch.bfloat16)
    _, s = mxfp8.quantize_mxfp8(w)
    packed = mxfp8.pack_scales_blocked(s)
    assert packed.shape == (2, 256, 4) and packed.dtype == torch.float8_e8m0fnu
    assert bits(packed)[1].reshape(-1)[blocked_offset(200, 3, 4)] == bits(s)[1, 200, 3]


def test_pack_errors():
    with pytest.raises(ValueError, match=r"scales has shape \(64, 4\).*multiple of 128"):
        mxfp8.pack_scales_blocked(torch.zeros(64, 4, dtype=U8))
    with pytest.raises(ValueError, match=r"scales has shape \(128, 6\).*multiple of 4"):
        mxfp8.pack_scales_blocked(torch.zeros(128, 6, dtype=U8))
    with pytest.raises(ValueError, match=r"packed has shape \(2, 130, 4\)"):
        mxfp8.unpack_scales_blocked(torch.zeros(2, 130, 4, dtype=U8))
    with pytest.raises(ValueError, match="scales must be"):
        mxfp8.pack_scales_blocked(torch.zeros(512, dtype=U8))


def test_pack_on_device_matches_cpu(device):
    raw = torch.randint(0, 256, (2, 256, 8), generator=torch.Generator().manual_seed(18), dtype=U8)
    s = raw.view(torch.float8_e8m0fnu)
    got = mxfp8.pack_scales_blocked(s.to(device))
    assert got.device.type == device.type and torch.equal(
        bits(got).cpu(), bits(mxfp8.pack_scales_blocked(s))
    )
