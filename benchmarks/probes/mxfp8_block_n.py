"""moe_align + fused_moe_mxfp8 (split=True) at several block_n hints, one build (GPU only).

    python benchmarks/probes/mxfp8_block_n.py deepseek:1024,mixtral:512 0,96 [ROUNDS]

Per shape (CONFIG:T) prints one JSON line per hint (0 is the tuned tile; warp_n and stages are
left to the kernel): the median over ROUNDS (default 3) interleaved rounds of harness.Timer's
median (CUDA events after warm-up, L2 flushed before each call, --warmup-ms 10 --rep-ms 40),
the first hint's time over this one's, and the output's relative difference from the first
hint's. The resolved tiles are printed to stderr (PRIME_MOE_PRINT_CONFIG). Inputs as
benchmarks/flash_moe.py's ours-mxfp8 row: weights quantized once per shape, x once, outside the
timing.
"""

import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.append(str(ROOT))


def time_shape(fm, ours, timer, key, T, hints, rounds):
    import flash_moe
    import torch

    _, D, H, E, k = flash_moe.CONFIGS[key]
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    w, w2 = flash_moe.make_weights(D, H, E, gen, device)
    weights = ours.prepare(w, w2)
    del w, w2
    x, ids, wts = flash_moe.make_inputs(T, D, E, k, gen, device)
    xq, xs = ours.quantize(x, False)

    def call(block_n):
        s, e, n = fm.moe_align(ids, E)
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
        return fm.fused_moe_mxfp8(
            xq, xs, *weights, s, e, n, wts, out, k, block_n=block_n, warp_n=0, stages=0
        )

    outs = {}
    os.environ["PRIME_MOE_PRINT_CONFIG"] = "1"
    for block_n in hints:
        outs[block_n] = call(block_n).float()
    del os.environ["PRIME_MOE_PRINT_CONFIG"]
    ms = {block_n: [] for block_n in hints}
    for _ in range(rounds):
        for block_n in hints:
            ms[block_n].append(timer.median_ms(lambda block_n=block_n: call(block_n)))
    first = outs[hints[0]]
    base = statistics.median(ms[hints[0]])
    for block_n in hints:
        median = statistics.median(ms[block_n])
        row = dict(cfg=key, T=T, block_n=block_n, ms=median, x_vs_first=base / median)
        row["rounds"] = ms[block_n]
        row["rel_diff"] = ((outs[block_n] - first).norm() / first.norm()).item()
        print(json.dumps(row), flush=True)


def main():
    import harness
    import peers
    import torch

    import prime_kernels

    fm = prime_kernels.load("flash_moe")
    timer = harness.Timer(torch.device("cuda"), 10, 40)
    ours = peers.OursMxfp8(fm, quantize_each_call=False)
    hints = [int(h) for h in sys.argv[2].split(",")]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    for shape in sys.argv[1].split(","):
        key, T = shape.split(":")
        time_shape(fm, ours, timer, key, int(T), hints, rounds)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
