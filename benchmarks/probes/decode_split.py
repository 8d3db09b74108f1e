"""What moe_align costs a decode-sized forward call (GPU only).

    python benchmarks/probes/decode_split.py [orig,olmoe,qwen3] [64]

Times, per config and T, the whole forward (moe_align + fused_moe_bf16, split=True), the op alone
on moe_align's outputs computed once outside the timing, and moe_align alone: harness.Timer
(CUDA events, median, L2 flushed before every call), the median over 5 interleaved rounds, the
order reversed every other round. The whole call minus the op alone is what the align costs the
call; the percentages are the routed experts' bf16 weight bytes over the time, against a copy
rate of 4245 GB/s (an H200's; on another GPU read the microseconds).
"""

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.append(str(ROOT))
import harness  # noqa: E402
import torch  # noqa: E402
from flash_moe import CONFIGS, make_inputs, make_weights  # noqa: E402

import prime_kernels  # noqa: E402

fm = prime_kernels.load("flash_moe")
device = torch.device("cuda")
timer = harness.Timer(device, 10, 40)
COPY_GBPS = 4245.0


def shape(label, D, E, k, T, w, w2, gen):
    x, ids, wts = make_inputs(T, D, E, k, gen, device)
    nbytes = ids.unique().numel() * 3 * D * w2.shape[2] * 2
    out = torch.empty(T, D, device=device, dtype=torch.bfloat16)
    pre = fm.moe_align(ids, E)

    def whole():
        s, e, t = fm.moe_align(ids, E)
        return fm.fused_moe_bf16(x, w, w2, s, e, t, wts, out, k)

    fns = {
        "whole": whole,
        "op": lambda: fm.fused_moe_bf16(x, w, w2, *pre, wts, out, k),
        "align": lambda: fm.moe_align(ids, E),
    }
    times = {n: [] for n in fns}
    for r in range(5):
        for n in list(fns) if r % 2 == 0 else list(fns)[::-1]:
            times[n].append(timer.median_ms(fns[n]))
    us = {n: statistics.median(v) * 1e3 for n, v in times.items()}

    def frac(t_us):
        return f"{nbytes / t_us / 1e3 / COPY_GBPS:.1%}"

    print(
        f"{label:14} T={T:5d} whole {us['whole']:7.1f} us ({frac(us['whole'])}) | op "
        f"{us['op']:7.1f} us ({frac(us['op'])}) | align {us['align']:6.1f} us | rounds whole "
        f"{[round(v * 1e3, 1) for v in times['whole']]}",
        flush=True,
    )


def main():
    keys = sys.argv[1].split(",") if len(sys.argv) > 1 else ["orig", "olmoe", "qwen3"]
    tokens = [int(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "64").split(",")]
    for key in keys:
        label, D, H, E, k = CONFIGS[key]
        gen = torch.Generator(device=device).manual_seed(0)
        w, w2 = make_weights(D, H, E, gen, device)
        for T in tokens:
            shape(label, D, E, k, T, w, w2, gen)
        del w, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
