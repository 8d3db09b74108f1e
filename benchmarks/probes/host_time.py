"""Host time a forward call costs at decode sizes, against its time on the GPU (GPU only).

    python benchmarks/probes/host_time.py [orig,qwen3] [64]

Per config: moe_align alone, ours in bf16 (moe_align + fused_moe_bf16, split=True) and in MXFP8
(moe_align + fused_moe_mxfp8 on inputs quantized once), each called 40 times back to back after
20 warm-up calls. "host" is the time the loop takes to enqueue them (no synchronization inside
it), "with GPU" the time until the GPU has run them all: where the two are close, the host, not
the GPU, bounds a caller that calls the op back to back. Then torch.profiler's table of the CUDA
runtime calls and allocations behind 20 MXFP8 calls. Host times move by tens of percent between
processes (the first one run is the slowest): compare builds within one process's figures only
with that in mind.
"""

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.append(str(ROOT))
import peers  # noqa: E402
import torch  # noqa: E402
from flash_moe import CONFIGS, make_inputs, make_weights  # noqa: E402

import prime_kernels  # noqa: E402

WARMUP, CALLS, PROFILED = 20, 40, 20


def per_call_us(fn):
    """(host, with GPU) microseconds a call over CALLS back-to-back calls."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    enqueued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return 1e6 * (enqueued - start) / CALLS, 1e6 * (done - start) / CALLS


def main():
    keys = sys.argv[1].split(",") if len(sys.argv) > 1 else ["orig", "qwen3"]
    T = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    fm = prime_kernels.load("flash_moe")
    device = torch.device("cuda")
    for key in keys:
        _, D, H, E, k = CONFIGS[key]
        gen = torch.Generator(device=device).manual_seed(0)
        w, w2 = make_weights(D, H, E, gen, device)
        x, ids, wts = make_inputs(T, D, E, k, gen, device)
        bf16 = peers.Ours(fm, True)
        mxfp8 = peers.OursMxfp8(fm, False)
        calls = {
            "moe_align": lambda ids=ids, E=E: fm.moe_align(ids, E, block_m=fm.BLOCK_M),
            "bf16": bf16.forward(bf16.prepare(w, w2), x, ids, wts),
            "mxfp8": mxfp8.forward(mxfp8.prepare(w, w2), x, ids, wts),
        }
        for name, fn in calls.items():
            host, total = per_call_us(fn)
            print(f"{key} T={T} {name}: host {host:.1f} us/call, with GPU {total:.1f} us/call")
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(PROFILED):
                calls["mxfp8"]()
            torch.cuda.synchronize()
        table = prof.key_averages().table(
            sort_by="cpu_time_total", row_limit=25, max_name_column_width=60
        )
        print(f"{key} T={T} mxfp8, {PROFILED} calls:\n{table}")


if __name__ == "__main__":
    main()
