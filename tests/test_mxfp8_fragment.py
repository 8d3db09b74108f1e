"""The register widening of MXFP8 weights (csrc/device/mxfp8_fragment.cuh): e4m3 bytes and e8m0
scales into the bf16x2 A fragment of a register-A wgmma, against mxfp8.py's dequantization.

On the CPU: a host twin of the header's bit operations (the same masks, shifts, byte permutes and
one bf16 multiply rounded to nearest even), over every e4m3 byte and every scale byte, in every
position of the fragment. On the GPU (marked gpu and slow: it compiles a throwaway kernel with
nvcc): the device function itself over the same inputs."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from prime_kernels.flash_moe import mxfp8

from .test_build import REPO, load_setup_py

FAST_SCALE_MAX = 134  # kMxfp8FastScaleMax
U32 = np.uint32


def byte_perm(x, y, selector: int):
    """PTX prmt / __byte_perm (default mode): byte i of the result is byte nibble_i of {y, x}."""
    src = (y.astype(np.uint64) << np.uint64(32)) | x.astype(np.uint64)
    out = np.zeros_like(x, dtype=U32)
    for i in range(4):
        sel = (selector >> (4 * i)) & 0x7
        byte = (src >> np.uint64(8 * sel)) & np.uint64(0xFF)
        out |= byte.astype(U32) << U32(8 * i)
    return out


def odd_bytes_biased(w):
    return (w & U32(0x80008000)) | ((w >> U32(4)) & U32(0x07F007F0))


def even_bytes_biased(w):
    return ((w << U32(8)) & U32(0x80008000)) | ((w << U32(4)) & U32(0x07F007F0))


def fast_scale(s):
    return (s + U32(120)) * U32(0x00800080)


def bf16_bits_to_f64(h):
    return (h.astype(U32) << U32(16)).view(np.float32).astype(np.float64)


def f32_to_bf16_rne(f):
    """fp32 -> bf16 bits, round to nearest even (finite inputs; NaN passed through quiet)."""
    bits = f.astype(np.float32).view(U32)
    rounded = (bits + U32(0x7FFF) + ((bits >> U32(16)) & U32(1))) >> U32(16)
    return np.where(np.isnan(f), U32(0x7FC0), rounded).astype(U32)


def mul_bf16x2(a, b):
    """mul.rn.bf16x2: each half's exact product rounded once to bf16. The products here are
    e4m3 x 2^(s - 127) with s <= 134: exact in fp32 (>= 2^-136, 4 significant bits), so rounding
    fp32 to bf16 is rounding the exact product."""
    out = np.zeros_like(a, dtype=U32)
    for half in range(2):
        ha = (a >> U32(16 * half)) & U32(0xFFFF)
        hb = (b >> U32(16 * half)) & U32(0xFFFF)
        prod = bf16_bits_to_f64(ha) * bf16_bits_to_f64(hb)
        out |= f32_to_bf16_rne(prod.astype(np.float32)) << U32(16 * half)
    return out


def e4m3_to_f32(byte):
    return torch.from_numpy(byte.astype(np.uint8)).view(torch.float8_e4m3fn).float().numpy()


def scale_value(s):
    """mxfp8_scale_value: 2^(s - 127) in fp32 (2^-127 as the denormal), NaN for 255."""
    bits = np.where(s == 0, U32(0x00400000), s.astype(U32) << U32(23))
    return np.where(s == 255, U32(0x7FC00000), bits).astype(U32).view(np.float32)


def pair_to_bf16x2_twin(two, scale):
    """mxfp8_pair_to_bf16x2: e4m3 -> fp32, times the scale in fp32, rounded to bf16."""
    with np.errstate(over="ignore", invalid="ignore"):
        lo = e4m3_to_f32(two & U32(0xFF)) * scale
        hi = e4m3_to_f32((two >> U32(8)) & U32(0xFF)) * scale
        return f32_to_bf16_rne(lo) | (f32_to_bf16_rne(hi) << U32(16))


def nan_bytes(lo, hi):
    """e4m3_nan_bytes, masked to its meaningful bits (bit 7 of each byte)."""
    t = ((lo & U32(0x7F7F7F7F)) + U32(0x01010101)) | ((hi & U32(0x7F7F7F7F)) + U32(0x01010101))
    return t & U32(0x80808080)


def has_nan(lo, hi):
    return nan_bytes(lo, hi) != 0


ROW_NAN_BITS = (U32(0x00800080), U32(0x80008000))  # kNanBytesRow0, kNanBytesRow1


def fragment_fast(lo, hi, s0, s1):
    f0, f1 = fast_scale(s0), fast_scale(s1)
    return [
        mul_bf16x2(even_bytes_biased(lo), f0),
        mul_bf16x2(odd_bytes_biased(lo), f1),
        mul_bf16x2(even_bytes_biased(hi), f0),
        mul_bf16x2(odd_bytes_biased(hi), f1),
    ]


def fragment_twin(lo, hi, s0, s1):
    """mxfp8_fragment: the fast path where the scales allow it, else the fp32 route; and
    e4m3_nan_bytes of the two words."""
    fast = np.maximum(s0, s1) <= FAST_SCALE_MAX
    with np.errstate(over="ignore"):
        quick = fragment_fast(
            lo, hi, np.minimum(s0, FAST_SCALE_MAX), np.minimum(s1, FAST_SCALE_MAX)
        )
    sc0, sc1 = scale_value(s0), scale_value(s1)
    slow = [
        pair_to_bf16x2_twin(byte_perm(lo, U32(0) * lo, 0x4420), sc0),
        pair_to_bf16x2_twin(byte_perm(lo, U32(0) * lo, 0x4431), sc1),
        pair_to_bf16x2_twin(byte_perm(hi, U32(0) * hi, 0x4420), sc0),
        pair_to_bf16x2_twin(byte_perm(hi, U32(0) * hi, 0x4431), sc1),
    ]
    return [np.where(fast, q, s) for q, s in zip(quick, slow)], nan_bytes(lo, hi)


def all_inputs():
    """Every (e4m3 byte, scale byte) pair, each byte in every slot of a fragment: the fragment's
    two rows get different scales and its 8 bytes are the pair's byte and 7 others."""
    b, s = np.meshgrid(np.arange(256, dtype=U32), np.arange(256, dtype=U32), indexing="ij")
    b, s = b.ravel(), s.ravel()
    cases = []
    for slot in range(8):
        others = [(b * U32(37 + 16 * k) + U32(11 * k + 3)) & U32(0xFF) for k in range(8)]
        row_bytes = [b if k == slot else others[k] for k in range(8)]
        # slot k: row r0 (k even) or r1 (k odd) of columns (2q, 2q + 1, 2q + 8, 2q + 9)[k // 2]
        r0 = [row_bytes[0], row_bytes[2], row_bytes[4], row_bytes[6]]
        r1 = [row_bytes[1], row_bytes[3], row_bytes[5], row_bytes[7]]
        lo = byte_perm(r0[0] | (r0[1] << U32(8)), r1[0] | (r1[1] << U32(8)), 0x5140)
        hi = byte_perm(r0[2] | (r0[3] << U32(8)), r1[2] | (r1[3] << U32(8)), 0x5140)
        other_s = (s * U32(7) + U32(3)) & U32(0xFF)
        s0, s1 = (s, other_s) if slot % 2 == 0 else (other_s, s)
        cases.append((lo, hi, s0, s1, r0, r1))
    return cases


def reference(byte, s):
    """mxfp8.dequantize_mxfp8 of one byte at one scale, as bf16 bits."""
    values = torch.from_numpy(byte.astype(np.uint8)).view(torch.float8_e4m3fn).reshape(-1, 1)
    scales = torch.from_numpy(s.astype(np.uint8)).reshape(-1, 1)
    out = mxfp8.dequantize_mxfp8(values, scales, block=1, dtype=torch.bfloat16)
    return out.reshape(-1).view(torch.int16).numpy().astype(np.uint16).astype(U32)


def expected_halves(r0, r1, s0, s1):
    """Reference bf16 bits of the fragment's 8 halves: a[0] = r0 columns 0, 1; a[1] = r1 0, 1;
    a[2] = r0 2, 3; a[3] = r1 2, 3 (column index into the 4 held columns)."""
    return [
        (reference(r0[0], s0), reference(r0[1], s0)),
        (reference(r1[0], s1), reference(r1[1], s1)),
        (reference(r0[2], s0), reference(r0[3], s0)),
        (reference(r1[2], s1), reference(r1[3], s1)),
    ]


def assert_same_bits(got, want, what):
    nan_got, nan_want = is_bf16_nan(got), is_bf16_nan(want)
    bad = (nan_got != nan_want) | (~nan_want & (got != want))
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} mismatches, first at {int(np.argmax(bad))}: "
        f"got {int(got[bad][0]):#06x}, want {int(want[bad][0]):#06x}"
    )


def is_bf16_nan(h):
    return ((h & U32(0x7F80)) == U32(0x7F80)) & ((h & U32(0x7F)) != 0)


def check_fragments(convert):
    """Every fragment half is mxfp8.py's dequantized value, bit for bit, except where that is
    NaN: there the half is NaN (the slow path) or its row's NaN flag is set (the fast path
    widens a NaN byte to a finite value; the epilogue makes the row NaN). A row's flag is set
    exactly when one of its four bytes is an e4m3 NaN."""
    for slot, (lo, hi, s0, s1, r0, r1) in enumerate(all_inputs()):
        got, nan = convert(lo, hi, s0, s1)
        for row, row_bytes in enumerate((r0, r1)):
            byte_nan = np.any([(b & U32(0x7F)) == U32(0x7F) for b in row_bytes], axis=0)
            flag = (nan & ROW_NAN_BITS[row]) != 0
            assert (flag == byte_nan).all(), f"slot {slot}: row r{row}'s NaN flag"
        for reg, halves in enumerate(expected_halves(r0, r1, s0, s1)):
            flag = (nan & ROW_NAN_BITS[reg % 2]) != 0
            for shift, want, what in zip((0, 16), halves, ("low", "high")):
                half = (got[reg] >> U32(shift)) & U32(0xFFFF)
                flagged = flag & is_bf16_nan(want)
                assert_same_bits(
                    np.where(flagged, want, half), want, f"slot {slot} a[{reg}] {what} half"
                )


def test_host_twin_matches_dequantize_everywhere():
    """Every e4m3 byte x every scale byte, in each of the fragment's 8 byte slots."""
    check_fragments(fragment_twin)


def test_fast_path_alone_is_exact_up_to_its_bound():
    """Without the fallback: exact for every non-NaN byte at s <= 134; at s = 135 the scale word
    2^128 is no bf16 (the bound is tight)."""
    b = np.arange(256, dtype=U32)
    b = b[(b & U32(0x7F)) != U32(0x7F)]
    for s in range(FAST_SCALE_MAX + 1):
        sv = np.full_like(b, s)
        word = byte_perm(b | (b << U32(8)), b | (b << U32(8)), 0x5140)
        got = fragment_fast(word, word, sv, sv)[0]
        assert_same_bits(got & U32(0xFFFF), reference(b, sv), f"fast path at s = {s}")
    assert (int(fast_scale(U32(FAST_SCALE_MAX + 1))) >> 7) & 0x1FF == 0x0FF  # exponent 255: Inf


def test_nan_byte_detection():
    b = np.arange(256, dtype=U32)
    for shift in (0, 8, 16, 24):
        word = b << U32(shift)
        assert (has_nan(word, U32(0) * word) == ((b & U32(0x7F)) == U32(0x7F))).all()
        assert (has_nan(U32(0) * word, word) == ((b & U32(0x7F)) == U32(0x7F))).all()


# The kernel and its launcher, and the torch wrapper (the host C++ side) that passes raw pointers.
KERNEL = r"""
#include <cstdint>
#include "device/mxfp8_fragment.cuh"

__global__ void fragment_kernel(const uint32_t* in, uint32_t* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const uint32_t lo = in[4 * i], hi = in[4 * i + 1], s0 = in[4 * i + 2], s1 = in[4 * i + 3];
  uint32_t a[4];
  prime_moe::mxfp8_fragment(lo, hi, s0, s1, a);
  for (int r = 0; r < 4; ++r) out[5 * i + r] = a[r];
  out[5 * i + 4] = prime_moe::e4m3_nan_bytes(lo, hi) & 0x80808080u;
}

void launch_fragments(const uint32_t* in, uint32_t* out, int n) {
  fragment_kernel<<<(n + 255) / 256, 256>>>(in, out, n);
}
"""

WRAPPER = r"""
#include <torch/extension.h>
void launch_fragments(const uint32_t* in, uint32_t* out, int n);
torch::Tensor fragments(torch::Tensor in) {
  auto out = torch::empty({in.size(0), 5}, in.options());
  launch_fragments(reinterpret_cast<const uint32_t*>(in.data_ptr()),
                   reinterpret_cast<uint32_t*>(out.data_ptr()), int(in.size(0)));
  return out;
}
"""


@pytest.mark.gpu
@pytest.mark.slow
def test_device_fragment_matches_dequantize_everywhere(tmp_path):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    if shutil.which("nvcc") is None:
        pytest.skip("no CUDA toolkit (nvcc) on this machine")
    from torch.utils.cpp_extension import load_inline

    from prime_kernels._manifest import load_manifest

    setup = load_setup_py()
    spec = load_manifest(REPO / "prime_kernels" / "kernels.toml")["flash_moe"]
    module = load_inline(
        name="mxfp8_fragment_test",
        cpp_sources=WRAPPER,
        cuda_sources=KERNEL,
        functions=["fragments"],
        # load_inline puts torch/types.h in front of the CUDA source, which the stable-ABI
        # defines of setup.py refuse: the rest of its device flags.
        extra_cuda_cflags=[f for f in setup.nvcc_flags(spec) if "TORCH_" not in f],
        extra_include_paths=[
            str(REPO / "prime_kernels" / "flash_moe" / "csrc"),
            str(REPO / "prime_kernels" / "include"),
        ],
        build_directory=str(tmp_path),
    )

    def convert(lo, hi, s0, s1):
        packed = np.stack([lo, hi, s0, s1], axis=1).astype(U32).view(np.int32)
        out = module.fragments(torch.from_numpy(packed).cuda()).cpu().numpy().view(U32)
        return [out[:, r] for r in range(4)], out[:, 4]

    check_fragments(convert)
