"""A model of how an sm_90a e4m3 wgmma sums a k32 block, fitted to fp8_wgmma_sums.cu's
measurements, and what it does to fused_moe_mxfp8's exactness check (CPU only).

    python benchmarks/probes/fp8_wgmma_model.py [--cases 0,8,11,13] [--seeds 0,1]

The model: every product is exact; each is truncated toward zero to a multiple of 2^(r - 13),
r the largest exponent sum ea + eb over the block's 32 products (subnormal e4m3 counted at
-6); the truncated products are summed exactly; the sum is truncated toward zero to 13 fraction
bits. On MX-quantized Gaussians (`fit`, 200,000 rows) it gives 29.19% exact k32 sums (the H200
probe: 29.16%), 70.99% of the inexact ones toward zero (70.90%), and a k128 relative error, four
k32 results promoted in fp32, of 4.427e-5 (4.426e-5; with the half-unit bit 3.715e-5, the same).

The forward emulated with that model in one or both GEMMs (each k32 block's sum promoted in
fp32 times both scales, h re-quantized as the kernel does, split=True) is compared with
reference.moe_mxfp8_emulation, the exact-MX bar of tests/test_fused_moe_mxfp8.py (3e-3), over
cases of tests/test_fused_moe_bf16.py's grid, with its routings. Variants: the half-unit bit set on each block
result, and the k32 block summed as k16 halves or k8 quarters (the other products zeroed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from prime_kernels.flash_moe import mxfp8, reference  # noqa: E402
from tests.test_fused_moe_bf16 import CASES, make_inputs  # noqa: E402


def operand(values, scales):
    """e4m3 values as fp32, each 32-block's scale as fp32, each value's exponent as the tensor
    core aligns it (subnormals at -6; zeros far below anything)."""
    v = values.to(torch.float32)
    scale = torch.pow(2.0, scales.view(torch.uint8).to(torch.float32) - 127)
    mag = v.abs()
    e = torch.floor(torch.log2(torch.where(mag > 0, mag, torch.ones_like(mag)))).clamp(min=-6)
    return v, scale, torch.where(mag > 0, e, torch.full_like(e, -1000.0))


def model_sums(prods, exps, half_unit=False):
    """The model's sum over the last dim of exact products with exponent sums exps."""
    unit = torch.pow(2.0, exps.amax(-1, keepdim=True) - 13)
    s = (torch.trunc(prods / unit) * unit).sum(-1)
    e = torch.floor(torch.log2(torch.where(s != 0, s.abs(), torch.ones_like(s))))
    ulp = torch.pow(2.0, e - 13)
    s = torch.trunc(s / ulp) * ulp
    return torch.where(s != 0, s + torch.sign(s) * ulp / 2, s) if half_unit else s


def gemm_model(aq, a_scales, bq, b_scales, parts=1, half_unit=False):
    """A (M, K) x B (N, K)^T, each k32 block as `parts` model sums promoted in fp32."""
    av, asc, ae = operand(aq, a_scales)
    bv, bsc, be = operand(bq, b_scales)
    (m, k), n = av.shape, bv.shape[0]
    acc = torch.zeros(m, n)
    width = 32 // parts
    for kb in range(k // 32):
        scale = asc[:, kb, None] * bsc[None, :, kb]
        for part in range(parts):
            cols = slice(kb * 32 + part * width, kb * 32 + (part + 1) * width)
            s = torch.cat(
                [
                    model_sums(
                        av[r : r + 64, None, cols] * bv[None, :, cols],
                        ae[r : r + 64, None, cols] + be[None, :, cols],
                        half_unit,
                    )
                    for r in range(0, m, 64)
                ]
            )
            acc = acc + s * scale
    return acc


def gemm_exact(aq, a_scales, bq, b_scales):
    return mxfp8.dequantize_mxfp8(aq, a_scales) @ mxfp8.dequantize_mxfp8(bq, b_scales).T


def forward(ops, ids, weights, gate_up, down):
    """split=True's numerics (reference.moe_mxfp8_emulation) with the two GEMMs given."""
    xq, xs, wq, ws, w2q, w2s = ops
    T, D = xq.shape
    H = wq.shape[1] // 2
    out = torch.zeros(T, D)
    ids = ids.long()
    for e in range(wq.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = gate_up(xq[tok], xs[tok], wq[e], ws[e])
        hq, hs = mxfp8.quantize_mxfp8(F.silu(gu[:, :H]) * gu[:, H:], rounding="floor")
        y = down(hq, hs, w2q[e], w2s[e]).bfloat16().float()
        out = out.index_add(0, tok, y * weights[tok, slot].float().unsqueeze(1))
    return out.bfloat16()


VARIANTS = {
    "k32 both": (gemm_model, gemm_model),
    "k32 both, half unit": (
        lambda *a: gemm_model(*a, half_unit=True),
        lambda *a: gemm_model(*a, half_unit=True),
    ),
    "k32 down only": (gemm_exact, gemm_model),
    "k16 halves both": (lambda *a: gemm_model(*a, parts=2), lambda *a: gemm_model(*a, parts=2)),
    "k8 quarters, half unit": (
        lambda *a: gemm_model(*a, parts=4, half_unit=True),
        lambda *a: gemm_model(*a, parts=4, half_unit=True),
    ),
}


def fit(rows=200_000, seed=0):
    """The model against the probe's MX Gaussian lines: share of exact k32 sums, share of the
    inexact ones toward zero, k128 relative error promoted per k32 (and with the half unit)."""
    gen = torch.Generator().manual_seed(seed)

    def mx_gaussian():
        return operand(
            *mxfp8.quantize_mxfp8(torch.randn(rows, 128, generator=gen), rounding="floor")
        )

    (av, _, ae), (bv, _, be) = mx_gaussian(), mx_gaussian()
    prods = (av * bv).double().view(rows, 4, 32)
    exps = (ae + be).view(rows, 4, 32)
    exact = prods.sum(-1)
    got = model_sums(prods, exps)
    err = got - exact
    inexact = err != 0
    toward_zero = (err * exact < 0)[inexact].float().mean().item()
    total = exact.sum(-1)

    def k128(half_unit):
        promoted = model_sums(prods, exps, half_unit).float().sum(-1).double()
        return ((promoted - total).norm() / total.norm()).item()

    print(
        f"model on MX Gaussians: k32 sums exact {1 - inexact.double().mean().item():.4f}, "
        f"inexact toward zero {toward_zero:.4f}; k128 promoted {k128(False):.3e}, "
        f"with the half unit {k128(True):.3e}"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="0,8,11,13", help="indices into the bf16 tests' CASES")
    ap.add_argument("--seeds", default="0,1")
    args = ap.parse_args(argv)
    fit()
    for c in (int(c) for c in args.cases.split(",")):
        T, D, H, E, k, kind = CASES[c]
        for seed in (int(s) for s in args.seeds.split(",")):
            gen = torch.Generator().manual_seed(seed)
            x, w, w2, ids, weights = make_inputs(T, D, H, E, k, kind, gen, device="cpu")
            ops = sum((mxfp8.quantize_mxfp8(t) for t in (x, w, w2)), ())
            exact = reference.moe_mxfp8_emulation(*ops, ids, weights, split=True)
            errors = [
                f"{name} {reference.relative_error(forward(ops, ids, weights, *g), exact):.2e}"
                for name, g in VARIANTS.items()
            ]
            print(f"{CASES[c]} seed {seed}: " + " | ".join(errors), flush=True)


if __name__ == "__main__":
    main()
