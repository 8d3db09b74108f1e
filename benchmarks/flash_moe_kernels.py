"""Where flash_moe's training step spends its time, kernel by kernel (GPU only).

    python benchmarks/flash_moe_kernels.py [--configs qwen3,mixtral] [--tokens 32768]
                                           [--routing softmax|one] [--steps 5]
                                           [--impl ours|sonic]
                                           [--step train|fwd-train|fwd|fwd-mxfp8]
                                           [--timeline]

Runs flash_moe.moe forward and backward (x, w, w2 and topk_weights requiring grad) a few
times under torch.profiler and prints, per kernel, the mean device time per step and, for
the GEMMs, TFLOP/s. Kernels are named by the parts they are composed of (MoeGemm's
template arguments), so dh, dxe and the weight gradients are told apart (dW2 and dW
are one kernel, so one row). The step's own wall time is
benchmarks/flash_moe.py --training's job; this splits it. ``--impl sonic`` splits SonicMoE's
training step (peers.Sonic, its default configs, the step benchmarks/flash_moe.py times) the
same way, by its kernels' names. ``--step fwd-train`` splits the training forward alone and
``--step fwd`` the forward op (split=True): what keeping z costs the forward; ``--step
fwd-mxfp8`` the MXFP8 forward op (peers.OursMxfp8: inputs quantized once, outside the steps).
``--timeline`` prints, instead, one step's stream operations in launch order, each step
after an L2 flush (as the benchmark times it): the median over the steps of each one's start
(from the step's first), duration and gap after the one before (negative: it overlapped,
e.g. a programmatic dependent launch): where a decode-sized call spends what its kernels do
not.
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

import flash_moe  # noqa: E402

# (substring of the demangled kernel name, label, FLOPs per step as a multiple of T*k*D*H)
KERNELS = (
    ("SwiGluToH<true>", "forward gate/up (keeps z)", 4),
    ("SwiGluToH<false>", "forward gate/up", 4),
    ("SwiGluToMxfp8", "MXFP8 forward gate/up", 4),
    ("Mxfp8WeightTiles", "MXFP8 forward down", 2),
    ("StoreRows, prime_moe::TmaWeightTiles<", "forward down", 2),
    ("SwiGluBackward", "dh (SwiGLU backward epilogue)", 2),
    # dW2 and dW are one kernel (K-grouped, both operands by TMA): one row for the two
    ("ExpertKScheduler", "dW2 + dW", 6),
    ("StoreRows, prime_moe::TmaWeightTilesMN", "dxe", 4),
    ("moe_combine_kernel", "combine (out, then dx)", 0),
    ("moe_scatter_rows_kernel", "dO, x in padded-row order (dh, dW2; dW)", 0),
    ("moe_routing_weight_grad_kernel", "routing-weight gradient", 0),
    ("moe_expert_segments_kernel", "expert segments", 0),
    ("moe_align", "moe_align", 0),
)


# SonicMoE's (its CuTe DSL kernels through QuACK): the forward's down projection, dW2, dW1
# and dx share one kernel name, so one row.
SONIC_KERNELS = (
    ("actGemmGated", "forward gate/up (SwiGLU)", 4),
    ("dactGemmDGated", "dh (SwiGLU backward epilogue)", 2),
    ("GemmDefault", "forward down + dW2 + dW1 + dx", 12),
    ("token_gather_sum_kernel", "token gathers and sums (out, then dx)", 0),
)
# Its forward alone launches that kernel once, for the down projection.
SONIC_FORWARD_KERNELS = (
    ("actGemmGated", "forward gate/up (SwiGLU)", 4),
    ("GemmDefault", "forward down", 2),
    ("token_gather_sum_kernel", "token gathers and sums (out)", 0),
)


def label_of(name, table=KERNELS):
    for key, label, flops in table:
        if key in name:
            return label, flops
    return name[:80], 0


def step_timeline(events, flush_names):
    """events: (name, start_us, duration_us) of every device operation, in start order;
    each step begins after an operation named in flush_names. Returns, per position in a step,
    (name, median start from the step's first operation, median duration, median gap after
    the end of the operations before it), over the steps that launched the same sequence as
    the first; and the median span of a step."""
    import statistics

    steps, current = [], None
    for name, start, duration in events:
        if name in flush_names:
            current = []
            steps.append(current)
        elif current is not None:
            current.append((name, start, duration))
    steps = [s for s in steps if s and [n for n, _, _ in s] == [n for n, _, _ in steps[0]]]
    if not steps:
        return [], 0.0
    rows, spans = [], []
    for i in range(len(steps[0])):
        starts, durations, gaps = [], [], []
        for step in steps:
            t0 = step[0][1]
            end_before = max((s + d for _, s, d in step[:i]), default=t0)
            starts.append(step[i][1] - t0)
            durations.append(step[i][2])
            gaps.append(step[i][1] - end_before)
        med = statistics.median
        rows.append((steps[0][i][0], med(starts), med(durations), med(gaps)))
    for step in steps:
        spans.append(max(s + d for _, s, d in step) - step[0][1])
    return rows, statistics.median(spans)


def device_events(prof):
    """(name, start_us, duration_us) of the kernels and memsets a profile recorded."""
    import json
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    ops = [e for e in trace if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    return sorted(((e["name"], e["ts"], e["dur"]) for e in ops), key=lambda e: e[1])


def make_step(impl, fm, x, w, w2, ids, wts, grad_out, what="train"):
    """(what benchmarks/flash_moe.py times, through peers: ``train`` the training step (forward
    and backward of x, w, w2 and topk_weights), ``fwd-train`` its forward alone, ``fwd`` the
    forward op (split=True, no autograd); its kernel table)."""
    import peers

    if impl == "sonic":
        table = SONIC_KERNELS if what == "train" else SONIC_FORWARD_KERNELS
        peer = peers.Sonic(tuned=False)
    elif what == "fwd-mxfp8":
        peer, table = peers.OursMxfp8(fm, quantize_each_call=False), KERNELS
    else:
        peer, table = peers.Ours(fm, True), KERNELS
    state = peer.prepare(w, w2)
    if what in ("fwd", "fwd-mxfp8"):
        return peer.forward(state, x, ids, wts), table
    if what == "fwd-train":
        return peer.forward_train(state, x, w, w2, ids, wts), table
    return peer.forward_backward(state, x, w, w2, ids, wts, grad_out), table


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="qwen3,mixtral")
    p.add_argument("--tokens", default="32768")
    p.add_argument(
        "--routing",
        choices=("softmax", "one"),
        default="softmax",
        help="one: every token on experts 0..k-1 (the skewed extreme)",
    )
    p.add_argument(
        "--steps", type=int, default=5, help="profiled steps (0: one step, no profiler, for ncu)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", choices=("ours", "sonic"), default="ours")
    p.add_argument(
        "--step",
        choices=("train", "fwd-train", "fwd", "fwd-mxfp8"),
        default="train",
        help="train: forward + backward; fwd-train: the training forward alone (keeping what "
        "backward reads); fwd: the forward op, split=True; fwd-mxfp8: the MXFP8 forward op (default train)",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="one step's stream operations in order (start, duration, gap), each step after "
        "an L2 flush, instead of the time per kernel",
    )
    return p.parse_args(argv)


def main(argv=None):
    import torch
    from torch.profiler import ProfilerActivity, profile

    import prime_kernels

    args = parse_args(argv)
    reason = prime_kernels.unavailable_reason("flash_moe")
    if reason:
        sys.exit(reason)
    fm = prime_kernels.load("flash_moe")
    device = torch.device("cuda")
    for cfg in flash_moe.resolve_configs(args.configs.split(",")):
        label, D, H, E, k = flash_moe.CONFIGS[cfg]
        gen = torch.Generator(device=device).manual_seed(args.seed)
        w, w2 = flash_moe.make_weights(D, H, E, gen, device)
        for T in (int(t) for t in args.tokens.split(",")):
            x, ids, wts = flash_moe.make_inputs(T, D, E, k, gen, device)
            if args.routing == "one":
                ids = torch.arange(k, dtype=torch.int32, device=device).expand(T, k).contiguous()
            grad_out = (0.1 * torch.randn(x.shape, generator=gen, device=device)).to(x.dtype)
            step, table = make_step(args.impl, fm, x, w, w2, ids, wts, grad_out, args.step)
            for _ in range(2 if args.steps else 1):
                step()
            torch.cuda.synchronize()
            if args.steps == 0:  # under ncu, which profiles the launches itself
                continue
            if args.timeline:
                print_timeline(step, table, args, label, T, device)
                del x, ids, wts, grad_out, step
                torch.cuda.empty_cache()
                continue
            # The steps back to back, timed by events: what the GPU spends beyond the sum of
            # the kernels (gaps between launches, host time it waits for) is the difference.
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.steps):
                step()
            end.record()
            torch.cuda.synchronize()
            wall_ms = start.elapsed_time(end) / args.steps
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    step()
                torch.cuda.synchronize()
            rows = {}
            for event in prof.key_averages():
                us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
                if us <= 0:
                    continue
                name, flops = label_of(event.key, table)
                ms, _ = rows.get(name, (0.0, flops))
                rows[name] = (ms + us / 1000 / args.steps, flops)
            total = sum(ms for ms, _ in rows.values())
            print(
                f"== {args.impl} {args.step}: {label} T={T} ({args.routing} routing): "
                f"{total:.3f} ms of kernels a step, "
                f"{wall_ms:.3f} ms a step back to back (events, without the profiler)"
            )
            for name, (ms, flops) in sorted(rows.items(), key=lambda r: -r[1][0]):
                rate = f"{flops * T * k * D * H / ms / 1e9:7.0f} TFLOP/s" if flops else ""
                print(f"  {ms:8.3f} ms  {rate:>15}  {name}")
            del x, ids, wts, grad_out, step
            torch.cuda.empty_cache()


def print_timeline(step, table, args, label, T, device):
    import torch
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)  # larger than L2
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        flush.fill_(1)
        torch.cuda.synchronize()
    flush_names = {name for name, _, _ in device_events(prof)}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            flush.fill_(1)
            step()
        torch.cuda.synchronize()
    rows, span = step_timeline(device_events(prof), flush_names)
    print(
        f"== {args.impl} {args.step}: {label} T={T} ({args.routing} routing): "
        f"{span:.1f} us from the first operation's start to the last one's end (median)"
    )
    for name, start, duration, gap in rows:
        # GEMMs by their role; the rest by their function's name (moe_align's passes apart)
        short = (
            label_of(name, table)[0]
            if "moe_gemm_kernel" in name
            else name.split("(")[0].split("<")[0].split("::")[-1]
        )
        print(f"  start {start:8.1f}  duration {duration:8.1f}  gap {gap:7.1f}  {short}")


if __name__ == "__main__":
    main()
