"""flash_moe.quantize_mxfp8's bandwidth against the copy ceiling measured in the same run.

    python benchmarks/mxfp8_quantize.py [--self-test]

Times (harness.Timer: CUDA events, median, L2 flushed before every call) the quantizer of
activations (T, D) with row-major scales and of weights (E, N, K) with blocked scales, both
roundings, at the shapes a trainer quantizes every step, and prints ms, GB/s (bf16 read plus
e4m3 and scale bytes written) and the fraction of the device copy rate. Each output is
checked bit for bit against mxfp8.py once. --self-test runs the Python reference on CPU at a
toy shape (no timing claims).
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

import harness  # noqa: E402

# (label, shape, blocked): the T = 32768, D = 7168 activations, and the weights of
# Qwen3-30B-A3B (w: (E, 2H, D), w2: (E, D, H)) and DeepSeek-V3-32 (w).
SHAPES = (
    ("x T=32768 D=7168", (32768, 7168), False),
    ("x T=32768 D=2048", (32768, 2048), False),
    ("Qwen3 w (128, 1536, 2048)", (128, 1536, 2048), True),
    ("Qwen3 w2 (128, 2048, 768)", (128, 2048, 768), True),
    ("DeepSeek-V3-32 w (32, 4096, 7168)", (32, 4096, 7168), True),
)
SELF_TEST_SHAPES = (("toy x", (64, 256), False), ("toy w", (2, 128, 128), True))


def main(argv=None):
    import torch

    from prime_kernels.flash_moe import mxfp8

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--self-test", action="store_true")
    p.add_argument("--warmup-ms", type=float, default=10.0)
    p.add_argument("--rep-ms", type=float, default=50.0)
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.self_test else "cuda")
    timer = harness.Timer(device, args.warmup_ms, args.rep_ms)
    shapes = SELF_TEST_SHAPES if args.self_test else SHAPES
    if args.self_test:

        def quantize(x, rounding, blocked):
            values, scales = mxfp8.quantize_mxfp8(x, rounding=rounding)
            if blocked:
                from prime_kernels import flash_moe

                scales = flash_moe.pack_scales_blocked(scales)
            return values, scales

        ceilings = None
    else:
        import prime_kernels

        fm = prime_kernels.load("flash_moe")

        def quantize(x, rounding, blocked):
            return fm.quantize_mxfp8(x, rounding=rounding, blocked=blocked)

        ceilings = harness.measure_ceilings(timer, device, small=False)
        print(harness.ceilings_line(ceilings))
    print(f"{'shape':36} {'rounding':8} {'ms':>8} {'GB/s':>8} {'of copy':>8}  bits")
    for label, shape, blocked in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(shape, generator=gen, device=device).bfloat16()
        for rounding in ("rceil", "floor"):
            values, scales = quantize(x, rounding, blocked)
            # the Python specification, run with torch ops on the same device
            want_values, want_scales = mxfp8.quantize_mxfp8(x, rounding=rounding)
            if blocked:
                from prime_kernels import flash_moe

                want_scales = flash_moe.pack_scales_blocked(want_scales)
            same = torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
            same &= torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8))
            del values, scales, want_values, want_scales
            ms = timer.median_ms(lambda x=x, r=rounding, b=blocked: quantize(x, r, b))
            nbytes = x.numel() * 2 + x.numel() + x.numel() // 32
            gbps = nbytes / (ms * 1e-3) / 1e9
            frac = f"{gbps / ceilings['copy_gbps']:.0%}" if ceilings else "-"
            print(
                f"{label:36} {rounding:8} {ms:8.3f} {gbps:8.0f} {frac:>8}  "
                f"{'equal' if same else 'DIFFERENT'}"
            )
            if not same:
                sys.exit(f"{label} {rounding}: not bit for bit mxfp8.py's")
        del x
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
