"""MXFP8 helpers in pure PyTorch: quantize, dequantize, and the blocked scale layout.

MXFP8 (OCP Microscaling) stores a tensor as float8_e4m3fn values plus one float8_e8m0fnu
scale (a bare biased exponent: scale = 2^(s - 127), s in [0, 254], s = 255 is NaN) per
block of 32 consecutive elements along the last dim (the GEMM's reduction dim). The
element represented is ``value * scale``.

This module is the bit-exact specification the CUDA quantizers must reproduce, so every
choice is spelled out:

Scale rounding (``rounding=``), from the block's absolute maximum ``amax`` (fp32):

- ``"rceil"`` (what the consumer uses, and NVIDIA's recommended recipe): the smallest power
  of two ``scale`` with ``amax / scale <= 448``, i.e. ``2^ceil(log2(amax / 448))``.
  Computed exactly: ``q = amax / 448`` as an IEEE fp32 division (round to nearest, denormals
  kept, no flush to zero), then ``q`` rounded up to a power of two from its bits (biased
  exponent, plus one when the mantissa is non-zero; an fp32-denormal ``q`` gives s = 1 when
  ``q > 2^-127`` and s = 0 otherwise). This is what PTX ``cvt.rp.satfinite.ue8m0x2.f32``
  does with ``q``. s is clamped to [0, 254]. (torchao's ``_to_mx_rceil`` uses
  ``ceil(log2(q))`` in floating point, which agrees except where ``log2`` rounds, and scales
  the values of a block with s = 0 by 1 instead of 2^127; both differ only for
  ``amax < 448 * 2^-126``.)
- ``"floor"`` (the kernel's own re-quantization of the SwiGLU output, the OCP spec's rule):
  ``s = ((bits(amax) >> 23) & 0xFF) - 8``, clamped to [0, 254]: the biased exponent of
  ``amax`` minus e4m3's max exponent 8. ``amax / scale`` lies in [256, 512), so the largest
  values of a block can saturate at 448.

Values: ``x * 2^(127 - s)`` in fp32 (the same real number as ``x / scale``, so the same
correctly rounded result), clamped to [-448, 448], cast to e4m3 with round-to-nearest-even
(torch's cast). The sign of zero is kept. Finite fp32 input never gives s > 247 (rceil) or
s > 246 (floor), so 2^(127 - s) is always a normal fp32 number; but fp32-denormal inputs
and products matter (a tiny block has s = 0 and is scaled up by 2^127), so a CUDA port must
not flush denormals to zero.

Zero blocks: ``amax = 0`` gives s = 0 (scale 2^-127) under both roundings (rceil: ``q = 0``
rounds up to the smallest scale, floor: 0 - 8 clamps to 0), and all values are +-0.

NaN / Inf: e4m3fn has no infinity, and the OCP spec makes a whole block NaN when its scale
is NaN. So a block holding any NaN or +-Inf gets scale byte 0xFF (NaN) and every one of its
32 value bytes is 0x7F (positive NaN), whatever the other elements are. Inf is treated as
NaN; no saturation of Inf to 448. Blocks without NaN/Inf are unaffected by their
neighbours.
"""

from __future__ import annotations

import torch

__all__ = [
    "E4M3_MAX",
    "quantize_mxfp8",
    "dequantize_mxfp8",
    "pack_scales_blocked",
    "unpack_scales_blocked",
]

E4M3_MAX = 448.0
_E8M0_NAN = 0xFF
_E4M3_NAN = 0x7F
_FP32_2_POW_M127 = 0x00400000  # bits of the fp32 denormal 2^-127


def _pow2_bits(n: torch.Tensor) -> torch.Tensor:
    """fp32 bits (int32) of 2^n for integer n in [-127, 127]."""
    return torch.where(n >= -126, (n + 127) << 23, _FP32_2_POW_M127).to(torch.int32)


def _check_block_dim(t: torch.Tensor, block: int, name: str) -> int:
    if block < 1:
        raise ValueError(f"block must be positive, got {block}")
    if t.ndim < 1 or t.shape[-1] % block != 0:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}: its last dim must be a multiple of the "
            f"scale block {block}"
        )
    return t.shape[-1] // block


def quantize_mxfp8(
    t: torch.Tensor, *, rounding: str = "rceil", block: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``t`` (..., K) to MXFP8 with one scale per ``block`` elements of the last dim.

    Returns ``(values, scales)``: ``values`` float8_e4m3fn of ``t``'s shape and ``scales``
    float8_e8m0fnu of shape (..., K / block), row-major. ``rounding`` is ``"rceil"`` (the
    consumer's) or ``"floor"`` (the kernel's re-quantization); the module docstring gives
    the exact rules, including zero blocks (s = 0) and NaN/Inf (scale 0xFF, values 0x7F).
    ``t`` may be bf16, fp16 or fp32, with any leading dims.
    """
    if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"t must be bf16, fp16 or fp32, got {t.dtype}")
    if rounding not in ("rceil", "floor"):
        raise ValueError(f"rounding must be 'rceil' or 'floor', got {rounding!r}")
    nb = _check_block_dim(t, block, "t")

    tf = t.detach().to(torch.float32).reshape(*t.shape[:-1], nb, block)
    finite = torch.isfinite(tf).all(dim=-1)
    amax = torch.where(finite, tf.abs().amax(dim=-1), 0.0)

    if rounding == "rceil":
        qbits = (amax / E4M3_MAX).view(torch.int32)
        exp = (qbits >> 23) & 0xFF
        mant = qbits & 0x7FFFFF
        s = torch.where(exp == 0, (mant > _FP32_2_POW_M127).to(torch.int32), exp + (mant != 0))
    else:
        s = ((amax.view(torch.int32) >> 23) & 0xFF) - 8
    s = s.clamp(0, 254).to(torch.int32)

    inv_scale = _pow2_bits(127 - s).view(torch.float32)
    v = (tf * inv_scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    vbits = v.to(torch.float8_e4m3fn).view(torch.uint8)
    vbits = torch.where(finite.unsqueeze(-1), vbits, _E4M3_NAN)
    sbits = torch.where(finite, s, _E8M0_NAN).to(torch.uint8)
    values = vbits.reshape(t.shape).view(torch.float8_e4m3fn)
    return values, sbits.view(torch.float8_e8m0fnu)


def dequantize_mxfp8(
    values: torch.Tensor,
    scales: torch.Tensor,
    *,
    block: int = 32,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``values * scale`` per block, computed in fp32, returned in ``dtype``.

    ``values`` is float8_e4m3fn (..., K); ``scales`` is float8_e8m0fnu (or its uint8 bits)
    of shape (..., K / block), row-major (unpack a blocked layout first). A scale byte 0xFF
    gives NaN for the whole block. Products past the fp32 range give +-Inf: ``448 * 2^127``
    for s = 254, and even quantized fp32 data near fp32's max (``quantize_mxfp8`` of 3.4e38
    gives s = 247 and value 256, as 255.99.. rounds up to 256 in e4m3).
    """
    if values.dtype != torch.float8_e4m3fn:
        raise TypeError(f"values must be float8_e4m3fn, got {values.dtype}")
    if scales.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"scales must be float8_e8m0fnu (or uint8 bits), got {scales.dtype}")
    nb = _check_block_dim(values, block, "values")
    if tuple(scales.shape) != (*values.shape[:-1], nb):
        raise ValueError(
            f"scales has shape {tuple(scales.shape)}, expected {(*values.shape[:-1], nb)} "
            f"for values of shape {tuple(values.shape)} and block {block}"
        )
    s = scales.view(torch.uint8).to(torch.int32)
    sbits = torch.where(s == 0, _FP32_2_POW_M127, s << 23)
    sbits = torch.where(s == _E8M0_NAN, 0x7FC00000, sbits).to(torch.int32)
    scale = sbits.view(torch.float32)
    vf = values.to(torch.float32).reshape(*values.shape[:-1], nb, block)
    return (vf * scale.unsqueeze(-1)).reshape(values.shape).to(dtype)


def check_blocked_shape(shape, name: str) -> tuple[list[int], int, int]:
    """``(lead, MN, K/32)`` of scales of shape (..., MN, K/32) that the blocked layout
    tiles; ValueError naming ``name`` otherwise."""
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"{name} must be (..., MN, K/32), got shape {shape}")
    *lead, mn, kb = shape
    if mn % 128 != 0:
        raise ValueError(
            f"{name} has shape {shape}: MN = shape[-2] = {mn} must be a multiple of "
            "128 (one scale tile is 128 rows)"
        )
    if kb % 4 != 0:
        raise ValueError(
            f"{name} has shape {shape}: K/32 = shape[-1] = {kb} must be a multiple "
            "of 4 (one scale tile is 4 scale columns)"
        )
    return lead, mn, kb


def _blocked_permute(t: torch.Tensor, name: str, inverse: bool) -> torch.Tensor:
    lead, mn, kb = check_blocked_shape(t.shape, name)
    nl = len(lead)
    # Row-major index (rt, r_hi, r_lo, ct, c4) with r = rt*128 + r_hi*32 + r_lo and
    # c = ct*4 + c4; blocked index (rt, ct, r_lo, r_hi, c4). The swap is its own inverse.
    if inverse:
        view = t.reshape(*lead, mn // 128, kb // 4, 32, 4, 4)
    else:
        view = t.reshape(*lead, mn // 128, 4, 32, kb // 4, 4)
    perm = [*range(nl), nl, nl + 3, nl + 2, nl + 1, nl + 4]
    return view.permute(perm).contiguous().reshape(t.shape)


def pack_scales_blocked(scales: torch.Tensor) -> torch.Tensor:
    """Row-major scales (..., MN, K/32) to the blocked layout, same shape and dtype.

    The blocked layout is the one Blackwell's block-scaled MMA reads (kept on every
    architecture so the caller has one contract): tiles of 128 rows x 4 scale columns (512
    bytes each), tiles ordered row-tile-major then column-tile; inside a tile, row r and
    column c sit at byte ``(r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)``. So element
    (r, c) lands at flat offset
    ``((r // 128) * (K/32 // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4``
    of each leading index's MN * K/32 chunk. The result's shape is a formality: only its
    contiguous memory is meaningful. Needs MN % 128 == 0 and (K/32) % 4 == 0 (ValueError
    otherwise; pad first).
    """
    return _blocked_permute(scales, "scales", inverse=False)


def unpack_scales_blocked(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_scales_blocked`: blocked memory (..., MN, K/32) to row-major."""
    return _blocked_permute(packed, "packed", inverse=True)
