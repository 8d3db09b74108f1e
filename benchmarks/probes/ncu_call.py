"""One forward call (moe_align + fused_moe_bf16, split=True; with ``mxfp8`` third,
fused_moe_mxfp8 on inputs quantized outside the range) inside an NVTX range, for ncu (GPU only).

    ncu --nvtx --nvtx-include "call/" --set full --import-source yes -o call \\
        python benchmarks/probes/ncu_call.py orig 64 [mxfp8]

Profiles every kernel of one call, after three warm-up calls outside the range, whatever the
kernels are named. ncu replays each kernel alone with caches flushed and clocks locked, so durations here are the
kernels' own, not the call's timeline (benchmarks/flash_moe_kernels.py --timeline).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.append(str(ROOT))
import torch  # noqa: E402
from flash_moe import CONFIGS, make_inputs, make_weights  # noqa: E402

import prime_kernels  # noqa: E402


def main():
    key = sys.argv[1] if len(sys.argv) > 1 else "orig"
    T = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    fm = prime_kernels.load("flash_moe")
    device = torch.device("cuda")
    _, D, H, E, k = CONFIGS[key]
    gen = torch.Generator(device=device).manual_seed(0)
    w, w2 = make_weights(D, H, E, gen, device)
    x, ids, wts = make_inputs(T, D, E, k, gen, device)
    out = torch.empty(T, D, device=device, dtype=torch.bfloat16)
    mxfp8 = len(sys.argv) > 3 and sys.argv[3] == "mxfp8"
    if mxfp8:
        ops = (
            *fm.quantize_mxfp8(x, blocked=False),
            *fm.quantize_mxfp8(w, blocked=True),
            *fm.quantize_mxfp8(w2, blocked=True),
        )

    def call():
        s, e, t = fm.moe_align(ids, E)
        if mxfp8:
            fm.fused_moe_mxfp8(*ops, s, e, t, wts, out, k)
        else:
            fm.fused_moe_bf16(x, w, w2, s, e, t, wts, out, k)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("call")
    call()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print(f"profiled one call: {key} T={T}" + (" mxfp8" if mxfp8 else ""))


if __name__ == "__main__":
    main()
