"""What a decode forward's weight bytes cost on this GPU: flash_moe's forward against plain
reads of the same weights and the copy ceiling, measured in the same run.

    python benchmarks/decode_read.py [--configs orig,qwen3] [--tokens 64] [--self-test]

At decode sizes the forward is bound by its weights: every routed expert's w (2H x D) and
w2 (D x H) are read once. Per config and T, this times (harness.Timer: CUDA events, median, L2
flushed before every call; the median over --rounds interleaved rounds, the order reversed
every other round) the forward op (moe_align + fused_moe_bf16, split=True) and two plain reads
of the weights, torch.sum of w and of w2 with fp32 accumulation. It prints each one's us, GB/s
(the routed experts' bytes for the forward, all of w and w2 for the reads: the line says when
not every expert is routed) and fraction of the copy rate, and the forward's time per byte
over the reads'. The plain read is not a ceiling: it shows how close a kernel that only reads
these bytes comes to the copy rate at this size (docs/flash_moe_decode.md).
--self-test runs reference.moe_grouped_mm in the forward's place on CPU at a toy shape (no
timing claims).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
if str(HERE.parent) not in sys.path:
    sys.path.append(str(HERE.parent))

import harness  # noqa: E402
from flash_moe import (  # noqa: E402
    CONFIGS,
    SELF_TEST_CONFIGS,
    make_inputs,
    make_weights,
    resolve_configs,
)


def main(argv=None):
    import torch

    from prime_kernels.flash_moe import reference

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="orig,olmoe,qwen3,deepseek,mixtral")
    p.add_argument("--tokens", default="64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args, device, timer = harness.standalone_timer(p, argv)
    if args.self_test:
        configs = SELF_TEST_CONFIGS
        keys = list(configs)

        def forward(x, w, w2, ids, wts, E, k, out):
            return reference.moe_grouped_mm(x, w, w2, ids, wts)

        ceilings = None
    else:
        import prime_kernels

        fm = prime_kernels.load("flash_moe")
        configs = CONFIGS
        keys = resolve_configs(args.configs.split(","))

        def forward(x, w, w2, ids, wts, E, k, out):
            sorted_ids, expert_ids, total = fm.moe_align(ids, E)
            return fm.fused_moe_bf16(x, w, w2, sorted_ids, expert_ids, total, wts, out, k)

        ceilings = harness.measure_ceilings(timer, device, small=False)
        print(harness.ceilings_line(ceilings))

    def frac(gbps):
        return f"{gbps / ceilings['copy_gbps']:.1%}" if ceilings else "-"

    print(
        f"{'config':16} {'T':>5} {'experts':>9} {'MB':>8} | {'forward us':>10} {'GB/s':>6} "
        f"{'of copy':>7} | {'read us':>8} {'GB/s':>6} {'of copy':>7} | forward / read"
    )

    def shape(label, D, H, E, k, T, w, w2, gen):
        """One config and T; its tensors are gone when it returns."""
        x, ids, wts = make_inputs(T, D, E, k, gen, device)
        routed = ids.unique().numel()
        nbytes = routed * 3 * D * H * w.element_size()
        read_bytes = (w.numel() + w2.numel()) * w.element_size()
        out = torch.empty(T, D, device=device, dtype=torch.bfloat16)
        fns = {
            "forward": lambda: forward(x, w, w2, ids, wts, E, k, out),
            "read": lambda: (w.sum(dtype=torch.float32), w2.sum(dtype=torch.float32)),
        }
        times = {name: [] for name in fns}
        for r in range(max(1, args.rounds)):
            for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
                times[name].append(timer.median_ms(fns[name]))
        fwd_ms, read_ms = (statistics.median(times[n]) for n in ("forward", "read"))
        fwd_gbps = nbytes / (fwd_ms * 1e-3) / 1e9
        read_gbps = read_bytes / (read_ms * 1e-3) / 1e9
        note = "" if routed == E else f"  (the reads cover all {E} experts)"
        print(
            f"{label:16} {T:5d} {routed:4d} / {E:<3d} {nbytes / 1e6:8.1f} | "
            f"{fwd_ms * 1e3:10.1f} {fwd_gbps:6.0f} {frac(fwd_gbps):>7} | "
            f"{read_ms * 1e3:8.1f} {read_gbps:6.0f} {frac(read_gbps):>7} | "
            f"{read_gbps / fwd_gbps:.2f}x{note}"
        )

    for key in keys:
        label, D, H, E, k = configs[key]
        gen = torch.Generator(device=device).manual_seed(args.seed)
        w, w2 = make_weights(D, H, E, gen, device)
        for T in [int(t) for t in args.tokens.split(",")]:
            shape(label, D, H, E, k, T, w, w2, gen)
        del w, w2
        harness.free_memory(device)


if __name__ == "__main__":
    main()
