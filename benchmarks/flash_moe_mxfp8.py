"""fused_moe_mxfp8's forward against our bf16 forward at the configs of benchmarks/flash_moe.py.

    python benchmarks/flash_moe_mxfp8.py [--configs qwen3,deepseek,mixtral] [--tokens 64,1024,32768]

Times (harness.Timer: CUDA events, median, L2 flushed before every call) fused_moe_mxfp8 and
fused_moe_bf16 (split=True, the same moe_align output, out preallocated) on the same inputs,
the MXFP8 ones quantized as the consumer quantizes (RCEIL, weight scales blocked), and prints
per shape: ms, TFLOP/s (6 T k D H), the bytes the MXFP8 forward moves (the routed experts' e4m3
weights and their scales, x's values and scales, out) per second and as a fraction of the copy
rate measured in the same run, and the bf16 forward's ms over ours.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
if str(HERE.parent) not in sys.path:
    sys.path.append(str(HERE.parent))

import flash_moe as bench  # noqa: E402  (benchmarks/flash_moe.py: configs and inputs)
import harness  # noqa: E402

TOKENS = (64, 1024, 32768)
DEFAULT_CONFIGS = ("qwen3", "deepseek", "mixtral")


def mxfp8_bytes(T, D, H, k, e_active):
    """Bytes one MXFP8 forward must move: the routed experts' e4m3 weights (w and w2) and
    their scales, x's values and scales, and out (bf16)."""
    weights = e_active * 3 * H * D
    return weights + weights // 32 + T * D + T * D // 32 + 2 * T * D


def main(argv=None):
    import torch

    import prime_kernels

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    p.add_argument("--tokens", default=",".join(str(t) for t in TOKENS))
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=100.0)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    fm = prime_kernels.load("flash_moe")
    timer = harness.Timer(device, args.warmup_ms, args.rep_ms)
    ceilings = harness.measure_ceilings(timer, device, small=False)
    print(harness.ceilings_line(ceilings))
    print(
        f"{'shape':34} {'ms':>8} {'TFLOP/s':>8} {'GB/s':>8} {'of copy':>8} "
        f"{'bf16 ms':>8} {'x bf16':>7}"
    )
    for key in args.configs.split(","):
        name, D, H, E, k = bench.CONFIGS[key]
        gen = torch.Generator(device=device).manual_seed(0)
        w, w2 = bench.make_weights(D, H, E, gen, device)
        wq, ws = fm.quantize_mxfp8(w, blocked=True)
        w2q, w2s = fm.quantize_mxfp8(w2, blocked=True)
        for T in (int(t) for t in args.tokens.split(",")):
            x, ids, weights = bench.make_inputs(T, D, E, k, gen, device)
            xq, xs = fm.quantize_mxfp8(x)
            aligned = fm.moe_align(ids, E)
            out = torch.empty_like(x)
            ops = (xq, xs, wq, ws, w2q, w2s, *aligned, weights, out, k)

            def ours(ops=ops):
                return fm.fused_moe_mxfp8(*ops)

            def bf16(x=x, w=w, w2=w2, aligned=aligned, weights=weights, out=out, k=k):
                return fm.fused_moe_bf16(x, w, w2, *aligned, weights, out, k)

            ms = timer.median_ms(ours)
            bf16_ms = timer.median_ms(bf16)
            e_active = bench.expert_load(ids, E)["e_active"]
            gbps = mxfp8_bytes(T, D, H, k, e_active) / (ms * 1e-3) / 1e9
            tflops = 6 * T * k * D * H / (ms * 1e-3) / 1e12
            print(
                f"{name + ' T=' + str(T):34} {ms:8.3f} {tflops:8.1f} {gbps:8.0f} "
                f"{gbps / ceilings['copy_gbps']:8.0%} {bf16_ms:8.3f} {bf16_ms / ms:7.2f}"
            )
            del x, ids, weights, xq, xs, aligned, out, ops
        del w, w2, wq, ws, w2q, w2s
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
