"""flash_moe.quantize_mxfp8's and pack_scales_blocked's bandwidth against the copy ceiling
measured in the same run.

    python benchmarks/mxfp8_quantize.py [--self-test]

Times (harness.Timer: CUDA events, median, L2 flushed before every call) the quantizer of
activations (T, D) with row-major scales and of weights (E, N, K) with blocked scales, both
roundings, at the shapes a trainer quantizes every step, and prints ms, GB/s (bf16 read plus
e4m3 and scale bytes written) and the fraction of the device copy rate. Then
pack_scales_blocked and unpack_scales_blocked of weight scales (E, N, K/32), with GB/s of
bytes read plus written and the time of mxfp8.py's pure-PyTorch permutation on the same
device. Each output is checked bit for bit against mxfp8.py once. --self-test runs the Python
reference on CPU at toy shapes (no timing claims). benchmarks/flash_moe.py's forward run times
the RCEIL quantizers of its own configs' tensors, and of x (32768, 7168), beside the MXFP8
forward; this script adds the floor rounding, the bit checks and the scale layout's permutes.
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
# Weight scales (E, N, K/32): DeepSeek-V3-32's w (E=32, 2 * 2048 rows, K = 7168) and w2 (7168
# rows, K = 2048), Qwen3-30B-A3B's w (E=128, 2 * 768 rows, K = 2048) and w2 (2048 rows, K = 768).
SCALE_SHAPES = (
    ("DeepSeek-V3-32 w scales (32, 4096, 224)", (32, 4096, 224)),
    ("DeepSeek-V3-32 w2 scales (32, 7168, 64)", (32, 7168, 64)),
    ("Qwen3 w scales (128, 1536, 64)", (128, 1536, 64)),
    ("Qwen3 w2 scales (128, 2048, 24)", (128, 2048, 24)),
)
SELF_TEST_SCALE_SHAPES = (("toy scales (2, 256, 8)", (2, 256, 8)),)


def main(argv=None):
    import torch

    from prime_kernels.flash_moe import mxfp8

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args, device, timer = harness.standalone_timer(p, argv)
    shapes = SELF_TEST_SHAPES if args.self_test else SHAPES
    if args.self_test:
        # the pure-PyTorch path: flash_moe's CUDA kernels are for CUDA tensors
        from prime_kernels import flash_moe as fm

        def quantize(x, rounding, blocked):
            values, scales = mxfp8.quantize_mxfp8(x, rounding=rounding)
            if blocked:
                scales = fm.pack_scales_blocked(scales)
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

    print()
    print(f"{'scales':40} {'op':6} {'ms':>8} {'GB/s':>8} {'of copy':>8} {'torch ms':>9}  bits")
    for label, shape in SELF_TEST_SCALE_SHAPES if args.self_test else SCALE_SHAPES:
        gen = torch.Generator(device=device).manual_seed(0)
        raw = torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.uint8)
        scales, mn = raw.view(torch.float8_e8m0fnu), shape[-2]
        want_rows = mxfp8.pack_scales_blocked(raw)  # blocked bytes, shaped as the scales
        want = want_rows.reshape(*shape[:-2], -1)
        packed = fm.pack_scales_blocked(scales)
        rows = (
            (
                "pack",
                lambda s=scales: fm.pack_scales_blocked(s),
                lambda r=raw: mxfp8.pack_scales_blocked(r),
                torch.equal(packed.view(torch.uint8), want),
            ),
            (
                "unpack",
                lambda p=packed, mn=mn: fm.unpack_scales_blocked(p, mn),
                lambda w=want_rows: mxfp8.unpack_scales_blocked(w),
                torch.equal(fm.unpack_scales_blocked(packed, mn).view(torch.uint8), raw),
            ),
        )
        for op, ours, pure_pytorch, same in rows:
            ms = timer.median_ms(ours)
            torch_ms = timer.median_ms(pure_pytorch)
            gbps = 2 * raw.numel() / (ms * 1e-3) / 1e9
            frac = f"{gbps / ceilings['copy_gbps']:.0%}" if ceilings else "-"
            print(
                f"{label:40} {op:6} {ms:8.4f} {gbps:8.0f} {frac:>8} {torch_ms:9.4f}  "
                f"{'equal' if same else 'DIFFERENT'}"
            )
            if not same:
                sys.exit(f"{label} {op}: not bit for bit mxfp8.py's")
        del raw, scales, want_rows, want, packed


if __name__ == "__main__":
    main()
