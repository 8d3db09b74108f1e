"""moe_align + fused_moe_mxfp8 (split=True) at moe_align's block_m 128 and 64, one build (GPU only).

    python benchmarks/probes/mxfp8_block_m.py time qwen3,deepseek,mixtral 64,1024 TAG >> runs.jsonl
    python benchmarks/probes/mxfp8_block_m.py summary runs.jsonl

``time`` prints one JSON line per config, T and block_m: the median ms (harness.Timer: CUDA
events after warm-up, L2 flushed before each call, --warmup-ms 10 --rep-ms 40), the bytes of
flash_moe.mxfp8_bytes over that time, and the output's relative difference from block_m 128's.
Inputs as benchmarks/flash_moe.py's ours-mxfp8 row: weights quantized once per config, x once per
shape, outside the timing. Two builds are compared by running ``time`` with each on PYTHONPATH in
alternating processes (A, B, A, B, ...), each tagged; ``summary`` gives, per shape, the median
over rounds of each tag and their ratio (the first tag over the second).
"""

import collections
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def time_shape(fm, ours, timer, weights, key, T, tag, gen):
    """Prints one JSON line per block_m for config key at T tokens."""
    import flash_moe
    import torch

    _, D, H, E, k = flash_moe.CONFIGS[key]
    device = torch.device("cuda")
    x, ids, wts = flash_moe.make_inputs(T, D, E, k, gen, device)
    xq, xs = ours.quantize(x, False)
    active = int(torch.unique(ids).numel())
    first = None
    for block_m in (128, 64):

        def call(block_m=block_m):
            s, e, n = fm.moe_align(ids, E, block_m=block_m)
            out = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
            return fm.fused_moe_mxfp8(xq, xs, *weights, s, e, n, wts, out, k, block_m=block_m)

        out = call().float()
        first = out if first is None else first
        ms = timer.median_ms(call)
        row = dict(tag=tag, cfg=key, T=T, block_m=block_m, ms=ms)
        row["gbs"] = flash_moe.mxfp8_bytes(T, D, H, active) / ms / 1e6
        row["rel_diff"] = ((out - first).norm() / first.norm()).item()
        print(json.dumps(row), flush=True)


def time_shapes(configs, tokens, tag):
    import flash_moe
    import harness
    import peers
    import torch

    import prime_kernels

    fm = prime_kernels.load("flash_moe")
    device = torch.device("cuda")
    timer = harness.Timer(device, 10, 40)
    ours = peers.OursMxfp8(fm, quantize_each_call=False)
    for key in configs:
        _, D, H, E, _ = flash_moe.CONFIGS[key]
        gen = torch.Generator(device=device).manual_seed(0)
        w, w2 = flash_moe.make_weights(D, H, E, gen, device)
        weights = ours.prepare(w, w2)
        del w, w2
        for T in tokens:
            time_shape(fm, ours, timer, weights, key, T, tag, gen)
        del weights
        torch.cuda.empty_cache()


def summary(path):
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    tags = list(dict.fromkeys(r["tag"] for r in rows))
    by = collections.defaultdict(list)
    for r in rows:
        by[(r["cfg"], r["T"], r["block_m"], r["tag"])].append(r)
    for shape in sorted({key[:3] for key in by}):
        cells, medians = [], []
        for tag in tags:
            runs = by.get(shape + (tag,), [])
            if not runs:
                continue
            ms = statistics.median(r["ms"] for r in runs)
            gbs = statistics.median(r["gbs"] for r in runs)
            medians.append(ms)
            rounds = " ".join(f"{r['ms']:.4f}" for r in runs)
            cells.append(f"{tag} {ms:.4f} ms {gbs:.0f} GB/s [{rounds}]")
        ratio = f"  x {medians[0] / medians[1]:.3f}" if len(medians) == 2 else ""
        cfg, T, block_m = shape
        print(f"{cfg} T={T} block_m={block_m}: " + " | ".join(cells) + ratio)


if __name__ == "__main__":
    if sys.argv[1] == "time":
        time_shapes(sys.argv[2].split(","), [int(t) for t in sys.argv[3].split(",")], sys.argv[4])
    else:
        summary(sys.argv[2])
