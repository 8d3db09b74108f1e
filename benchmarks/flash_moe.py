"""flash_moe against its peers, with the machine's own ceilings measured in the same run.

Run on the GPU machine (peers' wheels from scripts/fetch-peer-wheels installed into
PYTHONPATH first)::

    python benchmarks/flash_moe.py [--quick] [--configs qwen3,...] [--tokens 64,1024,...]
                                   [--results benchmarks/RESULTS.md] [--training]
                                   [--zipf qwen3:32768,...] [--no-mxfp8]

Times, with CUDA events (triton.testing.do_bench, median, L2 flushed before each call),
the median over ``--rounds`` interleaved rounds per shape:

- by default, the whole forward a user pays (no autograd): ours = moe_align +
  fused_moe_bf16 (split=True, and split=False with the zeroing of out), the grouped-mm
  expert path (reference.py), Liger-Kernel's Triton fused MoE and SonicMoE (inference
  mode); each output checked against grouped-mm's. With them, where
  ``unsupported_shape_reason(D, H, mxfp8=True)`` is None (``--no-mxfp8``: not at all), ours
  in MXFP8: ``ours-mxfp8`` = moe_align + fused_moe_mxfp8 (split=True) on x, w and w2
  quantized as the consumer quantizes them (RCEIL, weight scales blocked) once, outside the
  timing, with the bytes it moves against the copy rate; ``ours-mxfp8+quant`` = the same
  with the quantizers of x, w and w2 in every call (a trainer's forward pays them each
  step); both against our bf16 forward (split=True) as well as the peers. And quantize_mxfp8
  (RCEIL) alone in GB/s (bytes read + written) against the copy rate: each config's x (T, D)
  at its largest T, w and w2 (blocked scales), and x (32768, 7168). Section ``forward``, raw
  numbers in benchmarks/results/flash_moe.json.
- with ``--training`` (alias ``--backward``), the step a trainer runs, at T in {8192,
  32768} for the five configs by default, for ours (``flash_moe.moe``), autograd of the
  grouped-mm path, Liger and SonicMoE (training mode), in the same sitting: x, w, w2 and
  topk_weights are leaves requiring grad. Per path the training forward (``fwd-train``:
  grad enabled, output kept with what autograd saved) and forward + backward (``fwd+bwd``:
  the gradients dx, dw, dw2 and dtopk_weights, each checked against grouped-mm's), both
  with the memory they allocate above what was allocated before them (weights and inputs
  excluded), and the backward alone as their difference (``bwd``); among the training
  forward's rows ours' forward op without autograd (``forward op``, split=True), timed in the
  same rounds, so that what the training forward costs over it is measured in one sitting.
  Uniform (softmax top-k) routing, plus a Zipf-routed shape (``--zipf``; default Qwen3 at
  the largest T). Sections
  ``training`` (the step), ``training-backward`` and ``training-forward``, raw numbers in
  benchmarks/results/flash_moe-training.json.

Each peer is skipped with its reason when it is missing or fails. A run writes its
sections into the results file between ``<!-- flash_moe:NAME -->`` and ``<!--
/flash_moe:NAME -->`` (the rest of the file is left as it is) and its raw numbers into
``--results-json``, and, where $OUT is set, $OUT/flash_moe_bench.json (the raw numbers,
also split by mode), $OUT/RESULTS.md and the results JSON (the updated files, to copy back)
and $OUT/flash_moe_sections.md (this run's sections alone, for ``--merge`` on another
checkout). ``--combine A.json,B.json`` writes the raw numbers of several runs of one commit
(the full training run takes longer than one command on the GPU machine may) as one run's
sections and JSON, each shape's rows from the last run that timed it in every mode, the runs'
commands, dates and ceilings in its meta. ``--self-test`` runs the whole pipeline on CPU at a toy shape, the forward run
and then the training run (only the latter with ``--training``), writing into a temporary
directory, and checks what they wrote; grouped-mm stands in for ours, and mxfp8.py's
quantizer with the exact-MX emulation for ours in MXFP8.

This file holds the workloads; benchmarks/harness.py times, tabulates and writes them, and
benchmarks/peers.py holds the implementations.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # an installed prime_kernels comes first

import harness  # noqa: E402
import peers  # noqa: E402
from harness import log  # noqa: E402

OP = "flash_moe"
# name: (label, D, H, E, k); D model dim, H expert hidden dim
CONFIGS = {
    "qwen3": ("Qwen3-30B-A3B", 2048, 768, 128, 8),
    "deepseek": ("DeepSeek-V3-32", 7168, 2048, 32, 8),
    "mixtral": ("Mixtral-8x7B", 4096, 14336, 8, 2),
    "olmoe": ("OLMoE", 2048, 1024, 64, 8),
    "orig": ("orig", 2048, 1024, 32, 4),
}
ALIASES = {
    "qwen3-30b-a3b": "qwen3",
    "deepseek-v3-32": "deepseek",
    "dsv3": "deepseek",
    "mixtral-8x7b": "mixtral",
}
TOKENS = (64, 1024, 8192, 32768)
QUICK_CONFIGS = ("qwen3", "mixtral")
QUICK_TOKENS = (64, 8192)
LARGE_T = (8192, 32768)
TRAINING_TOKENS = LARGE_T
QUICK_TRAINING_TOKENS = (8192,)
ZIPF_S = 1.2  # expert of rank r drawn with probability proportional to r^-s
ZIPF_CONFIG = "qwen3"  # the default Zipf-routed shape's config, at the run's largest T
SOFTMAX = "softmax"  # the routing of every other shape (reference.routing)
FORWARD_SECTIONS = ("forward",)
TRAINING_SECTIONS = ("training", "training-backward", "training-forward")
# the modes of a run's rows; "bwd" is derived: fwd+bwd - fwd-train
TRAINING_MODES = ("fwd-train", "fwd+bwd", "bwd")
# FLOPs per mode in units of 2*T*k*D*H (one MoE layer: gate/up 2 of them, down 1)
FLOP_UNITS = {"fwd": 3, "fwd-train": 3, "fwd+bwd": 9, "bwd": 6}
GRADS = ("dx", "dw", "dw2", "dtopk_weights")
WEIGHT_READ_MAX_T = 1024
PEERS = ("grouped-mm", "liger", "sonic")
# SonicMoE autotuned beside the pinned row (the "sonicmoe at its best" column takes the faster):
# opt-in, since QuACK's autotune costs tens of seconds of GPU time a shape.
OPT_IN_PEERS = ("sonic-tuned",)
PEER_PACKAGES = ("liger-kernel", "sonic-moe", "quack-kernels", "nvidia-cutlass-dsl")
ERR_FLAG = 2e-2  # relative error vs grouped-mm above which a row is flagged
# the MXFP8 rows' flag: the contract's bar against grouped-mm (quantizing the inputs alone
# costs several percent)
MXFP8_ERR_FLAG = 1e-1
MXFP8_IMPLS = (peers.MXFP8, peers.MXFP8_QUANT)
BF16 = "ours split=True"  # what the MXFP8 rows are compared with: fused_moe_mxfp8 splits too
# the training forward's row of ours' forward op (no autograd), timed in the same rounds
FORWARD_OP = "forward op"
SONIC_TUNED = "sonicmoe autotuned"
QUANTIZE = "quantize"  # the mode of the quantizers' rows
QUANTIZE_BAR = (32768, 7168)  # the x shape of the quantizer's bar: >= 75% of the copy rate
QUANTIZE_BAR_FRAC = 0.75
SELF_TEST_QUANTIZE_BAR = (32, 256)  # no config's x: the bar's own row runs too
# H a multiple of 128, so that the MXFP8 rows run
SELF_TEST_CONFIGS = {"toy": ("toy", 128, 128, 8, 2)}
SELF_TEST_TOKENS = (16, 64)
SELF_TEST_ZIPF_CONFIG = "toy"
# (default, --quick)
WARMUP_MS, REP_MS, BUDGET_S = (25.0, 10.0), (100.0, 40.0), (520.0, 170.0)


def resolve_configs(names):
    """Config keys for user-given names or aliases; ValueError naming the known ones."""
    out = []
    for name in names:
        key = ALIASES.get(name.strip().lower(), name.strip().lower())
        if key not in CONFIGS:
            raise ValueError(f"unknown config {name!r}; known: {', '.join(CONFIGS)}")
        out.append(key)
    return out


def zipf_shapes(args):
    """[(config key, T)] of the Zipf-routed shapes: --zipf's, or by default (training runs)
    the Zipf config at the run's largest T when it is among the configs."""
    spec = (args.zipf or "").strip().lower()
    if spec == "none" or (not spec and not args.training):
        return []
    if not spec:
        cfg = SELF_TEST_ZIPF_CONFIG if args.self_test else ZIPF_CONFIG
        return [(cfg, max(args.tokens_list))] if cfg in args.configs_list else []
    known = SELF_TEST_CONFIGS if args.self_test else CONFIGS
    out = []
    for item in spec.split(","):
        name, sep, t = item.strip().partition(":")
        if not sep or not t.strip().isdigit():
            raise ValueError(f"--zipf takes CONFIG:T items, got {item.strip()!r}")
        key = ALIASES.get(name.strip(), name.strip())
        if key not in known:
            raise ValueError(f"unknown config {name!r} in --zipf; known: {', '.join(known)}")
        out.append((key, int(t)))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_run_args(
        p,
        OP,
        f"configs {','.join(QUICK_CONFIGS)}, T in {QUICK_TOKENS} (with --training "
        f"{QUICK_TRAINING_TOKENS}), shorter timing",
        WARMUP_MS,
        REP_MS,
        BUDGET_S,
    )
    p.add_argument("--configs", help=f"comma list of {','.join(CONFIGS)}")
    p.add_argument(
        "--tokens",
        help=f"comma list of T (default {','.join(map(str, TOKENS))}; with --training "
        f"{','.join(map(str, TRAINING_TOKENS))})",
    )
    p.add_argument(
        "--training",
        "--backward",
        dest="training",
        action="store_true",
        help="time the training step instead of the forward: per path the training forward, "
        "forward + backward (gradients of x, w, w2, topk_weights) with the memory above what "
        "was held before, and backward = their difference; T in "
        f"{{{', '.join(map(str, TRAINING_TOKENS))}}} by default, plus a Zipf-routed shape",
    )
    p.add_argument(
        "--zipf",
        help="comma list of CONFIG:T shapes routed by a Zipf law over the experts, after the "
        f"config's other shapes (default with --training: {ZIPF_CONFIG} at the run's largest T "
        f"when {ZIPF_CONFIG} is among the configs; 'none' for none)",
    )
    p.add_argument(
        "--zipf-s",
        type=float,
        default=ZIPF_S,
        help=f"Zipf exponent s: the expert of rank r is drawn with probability ~ r^-s "
        f"(default {ZIPF_S:g})",
    )
    p.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"comma list of peers to time, of {','.join(PEERS + OPT_IN_PEERS)} (or 'none'; "
        f"default {','.join(PEERS)}); sonic-tuned times SonicMoE autotuned beside the pinned "
        "sonic row",
    )
    p.add_argument("--no-ours", action="store_true", help="time the peers only")
    p.add_argument(
        "--mxfp8",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="in the forward run (not with --training or --no-ours), also time ours in MXFP8 "
        f"where the shape allows it: {peers.MXFP8} (inputs quantized outside the timing), "
        f"{peers.MXFP8_QUANT} (quantizing x, w and w2 in every call) and quantize_mxfp8 "
        "alone in GB/s (default: on)",
    )
    p.add_argument(
        "--tune-peers",
        action="store_true",
        help="let Liger (Triton autotune, 32 configs per kernel) and SonicMoE "
        "(QuACK autotune per shape) tune; off by default: it costs minutes",
    )
    p.add_argument(
        "--combine",
        metavar="JSON,JSON,...",
        help="only write the results of these runs' raw numbers (results JSONs of one commit, "
        "all --training or none) as one run's sections and JSON, then exit",
    )
    p.add_argument(
        "--self-test",
        action="store_true",
        help="CPU dry run at a toy shape into a temporary directory, the forward run and then "
        "the training run (only the latter with --training); grouped-mm stands in for ours, "
        "mxfp8.py's quantizer and the exact-MX emulation for ours in MXFP8",
    )
    args = p.parse_args(argv)
    if args.self_test:
        args.configs_list = list(SELF_TEST_CONFIGS)
        args.tokens_list = list(SELF_TEST_TOKENS)
    else:
        names = (
            args.configs.split(",")
            if args.configs
            else (list(QUICK_CONFIGS) if args.quick else list(CONFIGS))
        )
        try:
            args.configs_list = resolve_configs(names)
        except ValueError as exc:
            p.error(str(exc))
        if args.tokens:
            args.tokens_list = [int(t) for t in args.tokens.split(",") if t.strip()]
        elif args.training:
            args.tokens_list = list(QUICK_TRAINING_TOKENS if args.quick else TRAINING_TOKENS)
        else:
            args.tokens_list = list(QUICK_TOKENS if args.quick else TOKENS)
    try:
        args.zipf_list = zipf_shapes(args)
    except ValueError as exc:
        p.error(str(exc))
    if args.zipf_s <= 0:
        p.error(f"--zipf-s must be positive, got {args.zipf_s:g}")
    peer_names = (
        []
        if args.peers.strip().lower() == "none"
        else [s.strip().lower() for s in args.peers.split(",") if s.strip()]
    )
    for name in peer_names:
        if name not in PEERS + OPT_IN_PEERS:
            p.error(f"unknown peer {name!r}; known: {', '.join(PEERS + OPT_IN_PEERS)}")
    if "sonic-tuned" in peer_names and args.tune_peers:
        p.error("--tune-peers already autotunes the sonic row; leave sonic-tuned out")
    if "sonic-tuned" in peer_names and "sonic" not in peer_names:
        p.error("sonic-tuned is timed beside the pinned sonic row: add sonic to --peers")
    args.peer_list = peer_names
    args.mxfp8 = args.mxfp8 and not (args.training or args.no_ours)
    harness.finish_run_args(
        args,
        OP,
        argv,
        "benchmarks/flash_moe.py",
        TRAINING_SECTIONS if args.training else FORWARD_SECTIONS,
        WARMUP_MS,
        REP_MS,
        BUDGET_S,
        plain_json=not args.training,  # a training run's: flash_moe-training.json
    )
    return args


# --------------------------------------------------------------------------- workloads


def make_weights(D, H, E, gen, device):
    """w (E, 2H, D) and w2 (E, D, H) in bf16, small enough that SwiGLU stays in range."""
    import torch

    w = (torch.randn(E, 2 * H, D, generator=gen, device=device) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, D, H, generator=gen, device=device) * 0.05).to(torch.bfloat16)
    return w, w2


def softmax_topk_routing(T, E, k, generator, device):
    """What reference.routing computes: top-k of a softmax over normal logits, renormalized.
    For a reference.py older than reference.routing, and for ab.py, whose two builds'
    reference.py may differ while their inputs must not."""
    import torch

    logits = torch.randn(T, E, generator=generator, device=device)
    wts, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return ids.to(torch.int32), (wts / wts.sum(-1, keepdim=True)).float()


def make_x(T, D, gen, device):
    """x (T, D) bf16."""
    import torch

    return (torch.randn(T, D, generator=gen, device=device) * 0.2).to(torch.bfloat16)


def make_inputs(T, D, E, k, gen, device, routing=None):
    """x (T, D) bf16 and the routing: ids (T, k) int32, weights (T, k) fp32."""
    x = make_x(T, D, gen, device)
    ids, wts = (routing or softmax_topk_routing)(T, E, k, generator=gen, device=device)
    return x, ids, wts


def zipf_topk_routing(s):
    """A routing function (reference.routing's signature) with skewed expert load: each
    token draws k distinct experts without replacement, the expert of rank r with
    probability proportional to r^-s (the ranks a random permutation of the experts, drawn
    from the generator); its weights are a softmax over normal logits at those experts,
    renormalized, as in the softmax routing."""

    def routing(T, E, k, generator, device):
        import torch

        perm = torch.randperm(E, generator=generator, device=device)
        ranks = torch.empty(E, device=device)
        ranks[perm] = torch.arange(1, E + 1, device=device, dtype=ranks.dtype)
        probs = ranks.pow(-s).expand(T, E).contiguous()
        ids = torch.multinomial(probs, k, replacement=False, generator=generator)
        logits = torch.randn(T, E, generator=generator, device=device)
        wts = torch.softmax(logits, -1).gather(1, ids)
        return ids.to(torch.int32), (wts / wts.sum(-1, keepdim=True)).float()

    return routing


def expert_load(ids, E):
    """What a routing gives the experts: how many have pairs, and the busiest one's pairs
    over the mean T*k/E (1: perfectly even)."""
    import torch

    counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
    return {
        "e_active": int((counts > 0).sum()),
        "load_max_over_mean": float(counts.max()) * E / max(ids.numel(), 1),
    }


def mxfp8_bytes(T, D, H, e_active):
    """Bytes one MXFP8 forward must move: the routed experts' e4m3 weights (w and w2) and
    their scales, x's values and scales, and out (bf16)."""
    weights = e_active * 3 * H * D
    return weights + weights // 32 + T * D + T * D // 32 + 2 * T * D


def quantized_bytes(numel):
    """Bytes quantize_mxfp8 of ``numel`` elements reads and writes: bf16 in, e4m3 values
    and one e8m0 scale per 32 out."""
    return numel * 2 + numel + numel // 32


def rates(ceilings, flops, wbytes=None, mx_bytes=None):
    """derive() for Session.time_shape: TFLOP/s and the fraction of the dense GEMM, and the
    bytes a row moves per second with the fraction of the copy rate: ``wbytes`` (the weights
    read, bf16) for every row but the MXFP8 ones, ``mx_bytes`` for ours-mxfp8, none for
    ours-mxfp8+quant (its quantizers read every expert's weights: no bar)."""
    moved = {peers.MXFP8: ("mxfp8_gbps", mx_bytes), peers.MXFP8_QUANT: (None, None)}

    def derive(row):
        s = row["ms"] * 1e-3
        out = {"tflops": flops / s / 1e12}
        out["frac_dense"] = out["tflops"] / ceilings["gemm_tflops"]
        key, nbytes = moved.get(row["impl"], ("weight_gbps", wbytes))
        if nbytes is not None:
            out[key] = nbytes / s / 1e9
            out["frac_copy"] = out[key] / ceilings["copy_gbps"]
        return out

    return derive


def quantize_rates(ceilings, numel):
    """derive() of a quantizer's row: bytes read + written per second, and over the copy
    rate (which counts the same way)."""
    nbytes = quantized_bytes(numel)

    def derive(row):
        gbps = nbytes / (row["ms"] * 1e-3) / 1e9
        return {"gbps": gbps, "frac_copy": gbps / ceilings["copy_gbps"]}

    return derive


def compare_with_bf16(shape_rows):
    """Adds our bf16 forward to the MXFP8 rows' speedups: add_speedups compares none of our
    variants with another, and MXFP8 against bf16 is what these rows are for."""
    bf16 = next((r for r in shape_rows if r["impl"] == BF16), None)
    if bf16 is None:
        return
    for r in shape_rows:
        if r["impl"] in MXFP8_IMPLS and r["ms"] > 0:
            r["speedup"][BF16] = bf16["ms"] / r["ms"]


def load_impls(args, device, session):
    """The implementations to time, in table order: ours, grouped-mm, peers; those that
    cannot run are in session.skips."""
    impls = []
    if not args.no_ours:
        if args.self_test:
            impls += [SelfTestOurs(True), SelfTestOurs(False)]
            if args.mxfp8:
                impls += [SelfTestMxfp8(False), SelfTestMxfp8(True)]
        else:
            try:
                import prime_kernels

                reason = prime_kernels.unavailable_reason("flash_moe")
                if reason is None:
                    fm = prime_kernels.load("flash_moe")
                    impls += [peers.Ours(fm, True), peers.Ours(fm, False)]
                    if args.mxfp8:
                        impls += [peers.OursMxfp8(fm, False), peers.OursMxfp8(fm, True)]
            except Exception as exc:
                reason = f"prime_kernels not importable ({harness.first_line(exc)})"
            if reason is not None:
                for name in ("ours", *(MXFP8_IMPLS if args.mxfp8 else ())):
                    session.skip(name, reason)
    bf16 = next((i for i in impls if i.name == BF16), None)
    if args.training and bf16 is not None:
        impls.append(ForwardOp(bf16))
    impls.append(peers.GroupedMM())  # always: the reference
    if args.self_test:
        impls += [SelfTestPeer(1), SelfTestPeer(2)]
    if not args.tune_peers:
        os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")
    for name in args.peer_list:
        if name == "grouped-mm":
            continue
        if device.type != "cuda":
            session.skips.append({"impl": name, "reason": "needs a CUDA device"})
            continue
        try:
            if name == "liger":
                impl = peers.Liger()
            elif name == "sonic-tuned":
                impl = peers.Sonic(tuned=True, name=SONIC_TUNED)
            else:
                impl = peers.Sonic(tuned=args.tune_peers)
            impls.append(impl)
            log(f"{impl.name}: {impl.note}")
        except peers.Skip as exc:
            session.skip(name, str(exc))
    session.skips.append({"impl": "vllm", "reason": peers.VLLM_REASON})
    return impls


class ForwardOp(peers.Impl):
    """Ours' forward op (split=True, no autograd) as a row of the training forward, timed in
    the same rounds: ours' ``x vs forward op`` there is what keeping z and recording the
    autograd graph cost the forward, measured in one sitting."""

    name = FORWARD_OP
    kind = "reference"  # compared with, and not itself an implementation under test

    def __init__(self, ours):
        self.ours = ours

    def settings(self):
        return {**super().settings(), "op": f"{self.ours.name}'s forward, no autograd"}

    def prepare(self, w, w2):
        return self.ours.prepare(w, w2)

    def forward_train(self, state, x, w, w2, topk_ids, topk_weights):
        return self.ours.forward(state, x, topk_ids, topk_weights)


class SelfTestOurs(peers.Impl):
    """CPU stand-in for ours in self-tests: the grouped-mm path under another name."""

    kind = "ours"

    def __init__(self, split):
        from prime_kernels.flash_moe import reference

        self.ref = reference.moe_grouped_mm
        self.split = split
        self.name = f"ours split={split}"

    def settings(self):
        return {**super().settings(), "split": self.split, "stand-in": "reference.moe_grouped_mm"}

    def forward(self, state, x, topk_ids, topk_weights):
        w, w2 = state
        return lambda: self.ref(x, w, w2, topk_ids, topk_weights)

    def train_step(self, state, topk_ids):
        ref = self.ref
        return lambda x, w, w2, topk_weights: ref(x, w, w2, topk_ids, topk_weights)


class SelfTestPeer(peers.Impl):
    """CPU stand-in in self-tests for a peer timed at two settings (SonicMoE pinned and
    autotuned): the grouped-mm path, run ``repeats`` times a call, the rows sharing ``peer``,
    so that ours' rows are compared with the faster setting too."""

    peer = "stand-in"

    def __init__(self, repeats):
        from prime_kernels.flash_moe import reference

        self.ref = reference.moe_grouped_mm
        self.repeats = repeats
        self.name = self.peer if repeats == 1 else f"{self.peer} x{repeats}"

    def settings(self):
        return {
            **super().settings(),
            "repeats": self.repeats,
            "stand-in": "reference.moe_grouped_mm",
        }

    def _step(self, topk_ids):
        ref, repeats = self.ref, self.repeats

        def step(x, w, w2, topk_weights):
            for _ in range(repeats - 1):
                ref(x, w, w2, topk_ids, topk_weights)
            return ref(x, w, w2, topk_ids, topk_weights)

        return step

    def forward(self, state, x, topk_ids, topk_weights):
        w, w2 = state
        step = self._step(topk_ids)
        return lambda: step(x, w, w2, topk_weights)

    def train_step(self, state, topk_ids):
        return self._step(topk_ids)


class SelfTestMxfp8(peers.OursMxfp8):
    """CPU stand-in for ours' MXFP8 rows: mxfp8.py's quantizer, the weights' scales packed as
    the op takes them, and the exact-MX emulation (which reads them unpacked) for the op."""

    def __init__(self, quantize_each_call):
        from prime_kernels import flash_moe
        from prime_kernels.flash_moe import mxfp8, reference

        super().__init__(flash_moe, quantize_each_call)
        self.mxfp8 = mxfp8
        self.emulation = reference.moe_mxfp8_emulation

    def settings(self):
        return {
            **super().settings(),
            "stand-in": "mxfp8.quantize_mxfp8, reference.moe_mxfp8_emulation",
        }

    def quantize(self, t, blocked):
        values, scales = self.mxfp8.quantize_mxfp8(t)
        return values, (self.fm.pack_scales_blocked(scales) if blocked else scales)

    def run(self, xq, xs, wq, ws, w2q, w2s, topk_ids, topk_weights):
        def row_major(packed, values):
            return self.fm.unpack_scales_blocked(packed, values.shape[-2])

        return self.emulation(
            xq, xs, wq, row_major(ws, wq), w2q, row_major(w2s, w2q), topk_ids, topk_weights
        )


# --------------------------------------------------------------------------- the run


def zipf_name(s):
    return f"zipf s={s:g}"


def shape_plan(args):
    """{config key: [(T, routing)]}: each config's softmax-routed shapes, then its
    Zipf-routed ones (a config named only by --zipf runs just those)."""
    plan = {key: [(T, SOFTMAX) for T in args.tokens_list] for key in args.configs_list}
    for key, T in args.zipf_list:
        plan.setdefault(key, []).append((T, zipf_name(args.zipf_s)))
    return plan


def quantize_bar(args):
    return SELF_TEST_QUANTIZE_BAR if args.self_test else QUANTIZE_BAR


def run(args):
    import torch

    from prime_kernels.flash_moe import reference

    started = time.time()
    device = torch.device("cpu" if args.self_test else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run this on the GPU machine, or use --self-test on CPU")

    peers.activate_pth_files()
    timer = harness.Timer(device, args.warmup_ms, args.rep_ms, args.rounds)
    meta = harness.environment(device, args.argv, timer)
    meta.update(
        versions=peers.peer_versions(),
        tune_peers=args.tune_peers,
        self_test=args.self_test,
        training=args.training,
        zipf={"s": args.zipf_s, "shapes": [f"{c}:{T}" for c, T in args.zipf_list]},
        mxfp8=args.mxfp8,
    )
    log(harness.header_line(meta))
    log(f"command: {meta['command']}")
    ceilings = harness.measure_ceilings(timer, device, args.self_test)
    log(harness.ceilings_line(ceilings))

    session = harness.Session(device, timer, harness.Budget(args.budget_s, started))
    live = load_impls(args, device, session)
    configs = SELF_TEST_CONFIGS if args.self_test else CONFIGS
    rows = {mode: [] for mode in (TRAINING_MODES if args.training else ("fwd",))}
    if args.mxfp8:
        rows[QUANTIZE] = []
    # the quantizers' rows time ours-mxfp8's own quantize (a stand-in's in self-tests)
    quantizer = next((i for i in live if isinstance(i, peers.OursMxfp8)), None)
    rel_err = reference.relative_error
    softmax = getattr(reference, "routing", None)
    zipf = zipf_topk_routing(args.zipf_s)

    def grads_err(grads, ref):
        return {
            name: None if g is None or r is None else rel_err(g, r)
            for name, g, r in zip(GRADS, grads, ref)
        }

    def one_ours(impl):  # one training row for ours: moe() has no split choice
        return "ours" if impl.kind == "ours" else impl.name

    # the training rows' implementations: the first of each row name (ours split=True)
    trainers = []
    for impl in live:
        if all(one_ours(t) != one_ours(impl) for t in trainers):
            trainers.append(impl)

    def time_graphed(fwd_rows, states, x, ids, wts, wbytes):
        """Ours' bf16 rows at decode sizes timed once more as the replay of a CUDA graph of
        the whole call (no launch gaps, no host work): the figure a server that graphs the layer
        gets, next to the plain one a training stack gets."""
        for row in fwd_rows:
            impl = next((i for i in live if i.name == row["impl"]), None)
            if impl is None or impl.kind != "ours" or impl.name in MXFP8_IMPLS:
                continue
            try:
                fn = impl.forward(states[impl.name], x, ids, wts)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()  # allocations and first-call work outside the capture
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                ms = statistics.median(timer.median_ms(graph.replay) for _ in range(args.rounds))
                del graph
            except Exception as exc:
                log(f"  {impl.name}: no graphed time: {harness.first_line(exc)}")
                continue
            row["graphed_ms"] = ms
            row["graphed_frac_copy"] = wbytes / (ms * 1e-3) / 1e9 / ceilings["copy_gbps"]
            log(
                f"    {impl.name} as a CUDA graph: {ms:.3f} ms, {row['graphed_frac_copy']:.1%} of copy"
            )

    # one function per config and per shape, so that their tensors are gone when they return
    def shape(label, D, H, E, k, T, routing, w, w2, states, broken, gen):
        route = softmax if routing == SOFTMAX else zipf
        x, ids, wts = make_inputs(T, D, E, k, gen, device, route)
        where = dict(config=label, D=D, H=H, E=E, k=k, T=T, routing=routing, **expert_load(ids, E))
        unit = 2.0 * T * k * D * H
        if not args.training:
            e_active = where["e_active"]
            small = T <= WEIGHT_READ_MAX_T
            wbytes = e_active * 3.0 * D * H * 2 if small else None
            mx_bytes = mxfp8_bytes(T, D, H, e_active) if small else None
            fwd = session.time_shape(
                live,
                where,
                "fwd",
                lambda impl: impl.forward(states[impl.name], x, ids, wts),
                rel_err,
                broken,
                derive=rates(ceilings, FLOP_UNITS["fwd"] * unit, wbytes, mx_bytes),
            )
            compare_with_bf16(fwd)
            if small and device.type == "cuda":
                time_graphed(fwd, states, x, ids, wts, wbytes)
            rows["fwd"].extend(fwd)
            return
        # The training step: the forward with grad enabled alone, then forward + backward;
        # an implementation failing either is not tried again in this config.
        train = session.time_shape(
            trainers,
            where,
            "fwd-train",
            lambda impl: impl.forward_train(states[impl.name], x, w, w2, ids, wts),
            rel_err,
            broken,
            derive=rates(ceilings, FLOP_UNITS["fwd-train"] * unit),
            name=one_ours,
            memory=True,
            recover=False,
        )
        rows["fwd-train"].extend(train)
        if session.stopped():
            return
        grad_out = (torch.randn(x.shape, generator=gen, device=device) * 0.1).to(x.dtype)
        step = session.time_shape(
            [t for t in trainers if not isinstance(t, ForwardOp)],
            where,
            "fwd+bwd",
            lambda impl: impl.forward_backward(states[impl.name], x, w, w2, ids, wts, grad_out),
            grads_err,
            broken,
            derive=rates(ceilings, FLOP_UNITS["fwd+bwd"] * unit),
            name=one_ours,
            memory=True,
            recover=False,
        )
        rows["fwd+bwd"].extend(step)
        bwd = harness.difference_rows(
            step, train, "bwd", derive=rates(ceilings, FLOP_UNITS["bwd"] * unit)
        )
        for r in bwd:
            log(harness.row_line(r))
        rows["bwd"].extend(bwd)
        session.check_context()

    def quantize_row(label, tensor, t, blocked, T="-"):
        """The quantizer's row of one tensor: T is x's, or "-" for the weights."""
        scales = "blocked" if blocked else "row-major"
        where = dict(config=label, T=T, tensor=tensor, shape=list(t.shape), scales=scales)
        for r in session.time_shape(
            [quantizer],
            where,
            QUANTIZE,
            lambda impl: lambda: impl.quantize(t, blocked),
            rel_err,
            {},
            derive=quantize_rates(ceilings, t.numel()),
            name=lambda impl: "quantize_mxfp8",
        ):
            log(f"    {tensor} {tuple(t.shape)}, {scales} scales: {r['gbps']:.0f} GB/s")
            rows[QUANTIZE].append(r)

    def config(cfg_key, shapes):
        label, D, H, E, k = configs[cfg_key]
        gen = torch.Generator(device=device).manual_seed(args.seed)
        w, w2 = make_weights(D, H, E, gen, device)
        log(f"== {label}: D={D} H={H} E={E} k={k}")
        states, broken = {}, {}
        for impl in live:
            try:
                states[impl.name] = impl.prepare(w, w2)
            except peers.Skip as exc:
                broken[impl.name] = str(exc)
                session.skip(impl.name, str(exc), label, "all")
        for T, routing in shapes:
            if session.stopped():
                break
            shape(label, D, H, E, k, T, routing, w, w2, states, broken, gen)
            harness.free_memory(device)
        # what a trainer quantizes every step, where the MXFP8 forward takes the shape
        if quantizer is not None and quantizer.name in states and not session.stopped():
            T = max(T for T, _ in shapes)
            quantize_row(label, "x", make_x(T, D, gen, device), False, T)
            quantize_row(label, "w", w, True)
            quantize_row(label, "w2", w2, True)

    try:
        for cfg_key, shapes in shape_plan(args).items():
            if session.stopped():
                break
            config(cfg_key, shapes)
            harness.free_memory(device)
        # the quantizer's bar, unless a config's x had its shape
        bar = quantize_bar(args)
        timed = {(r["tensor"], tuple(r["shape"])) for r in rows.get(QUANTIZE, ())}
        if quantizer is not None and ("x", bar) not in timed and not session.stopped():
            gen = torch.Generator(device=device).manual_seed(args.seed)
            quantize_row("-", "x", make_x(*bar, gen, device), False, bar[0])
            harness.free_memory(device)
    finally:
        doc = finish(args, meta, ceilings, live, session.skips, rows, started)
    return doc


# --------------------------------------------------------------------------- reporting

TITLES = {
    "fwd": "forward",
    "fwd-train": "training forward",
    "fwd+bwd": "training step: forward + backward",
    "bwd": "backward alone: (forward + backward) - training forward",
    QUANTIZE: "quantize_mxfp8 (RCEIL)",
}


def routed(rows, softmax=True):
    """The rows of softmax-routed shapes (the means are over these), or the others."""
    return [r for r in rows if (r.get("routing", SOFTMAX) == SOFTMAX) == softmax]


# on the MXFP8 rows only (compare_with_bf16 adds it); a peer's is the inverse of ours
# split=True's `x vs` that peer
VS_BF16_COLUMN = harness.Column(
    f"x vs {BF16}",
    lambda r: harness.fmt(r["speedup"].get(BF16), ".2f") if r["impl"] in MXFP8_IMPLS else "",
)


def err_flag(row):
    return MXFP8_ERR_FLAG if row["impl"] in MXFP8_IMPLS else ERR_FLAG


def columns(rows, mode):
    cols = [harness.value_column("config", "config"), harness.value_column("T", "T")]
    if routed(rows, softmax=False):
        cols += [
            harness.value_column("routing", "routing"),
            harness.Column(
                "busiest expert",
                lambda r: (
                    f"{r['load_max_over_mean']:.1f}x mean" if "load_max_over_mean" in r else ""
                ),
            ),
        ]
    cols += [harness.value_column("impl", "impl"), harness.MS_COLUMN]
    if mode == "bwd":
        cols += [
            harness.Column("fwd+bwd ms", lambda r: harness.fmt_ms(r["total_ms"])),
            harness.Column("fwd-train ms", lambda r: harness.fmt_ms(r["part_ms"])),
        ]
    cols += [
        harness.value_column("TFLOP/s", "tflops", ".1f"),
        harness.value_column("of dense", "frac_dense", ".1%"),
    ]
    if any(r.get("clocks") for r in rows):
        cols.append(
            harness.Column(
                "SM MHz",
                lambda r: (
                    harness.fmt(r["clocks"]["sm_clock_mhz"], ".0f") if r.get("clocks") else ""
                ),
            )
        )
    if mode == "fwd":
        cols += [
            harness.Column(
                "GB/s", lambda r: harness.fmt(r.get("weight_gbps", r.get("mxfp8_gbps")), ".0f")
            ),
            harness.value_column("of copy", "frac_copy", ".1%"),
        ]
        if any("graphed_frac_copy" in r for r in rows):
            cols.append(harness.value_column("graphed of copy", "graphed_frac_copy", ".1%"))
    elif mode == "fwd-train":
        cols += [
            harness.value_column("peak GB", "extra_gb", ".2f"),
            harness.value_column("kept GB", "held_gb", ".2f"),
        ]
    elif mode == "fwd+bwd":
        cols.append(harness.value_column("peak GB", "extra_gb", ".2f"))
    if any(BF16 in r["speedup"] for r in rows):
        cols.append(VS_BF16_COLUMN)
    return cols + harness.speedup_columns(rows) + [harness.rel_err_column(err_flag)]


def quantize_columns():
    return [
        harness.value_column("config", "config"),
        harness.value_column("tensor", "tensor"),
        harness.Column("shape", lambda r: str(tuple(r["shape"]))),
        harness.value_column("scales", "scales"),
        harness.MS_COLUMN,
        harness.value_column("GB/s", "gbps", ".0f"),
        harness.value_column("of copy", "frac_copy", ".1%"),
    ]


def quantize_lines(rows, bar):
    """The quantizer's bar, at x of shape ``bar``: its fraction of the copy rate."""
    for r in rows:
        if (r["tensor"], tuple(r["shape"])) == ("x", bar):
            verdict = "met" if r["frac_copy"] >= QUANTIZE_BAR_FRAC else "missed"
            return [
                f"quantize_mxfp8 of x {bar}: {r['gbps']:.0f} GB/s, {r['frac_copy']:.1%} of the "
                f"copy rate (bar {QUANTIZE_BAR_FRAC:.0%}: {verdict})"
            ]
    return []


def quantize_md(rows, bar):
    """The quantizers' table, a block of the forward section."""
    legend = (
        "quantize_mxfp8 with RCEIL scales, what a trainer quantizes every step: each config's "
        "x (T, D) at its largest T with row-major scales, w (E, 2H, D) and w2 (E, D, H) with "
        f"blocked scales, where the MXFP8 forward takes the config, and x {bar} (the bar: "
        f"≥ {QUANTIZE_BAR_FRAC:.0%} of the copy rate). GB/s = (2 + 1 + 1/32) bytes per element "
        "(bf16 read, e4m3 values and e8m0 scales written) / time, timed as the forward's rows."
    )
    lines = [f"### {TITLES[QUANTIZE]}", "", legend, "", harness.md_table(quantize_columns(), rows)]
    lines += ["", *(f"- {line}" for line in quantize_lines(rows, bar))]
    return "\n".join(lines)


TRAINING_LEGEND = (
    "The step a trainer runs: x, w, w2 and topk_weights are fresh leaf copies requiring "
    "grad (made outside the timing), gradients by torch.autograd.grad (nothing accumulated "
    "into .grad). ours = flash_moe.moe; grouped-mm = autograd of reference.moe_grouped_mm; "
    "liger = LigerFusedMoEFunction; sonicmoe = moe_general_routing_inputs with "
    "is_inference_mode_enabled=False, router_scores = topk_weights' leaf viewed flat."
)
MODE_LEGEND = {
    "fwd": (
        "TFLOP/s counts 6·T·k·D·H; GB/s = the bytes a forward must move / time, for "
        f"T ≤ {WEIGHT_READ_MAX_T}: E_active·3·D·H·2 (the routed experts' bf16 weights) "
        "unless said otherwise; of copy = GB/s over the copy rate; graphed of copy = the "
        "same bytes over the time of one CUDA graph replay of the whole call (ours' bf16 rows). "
        "rel err = ‖out − grouped-mm‖/‖grouped-mm‖"
    ),
    "fwd-train": (
        "The forward with grad enabled, its output (and what autograd saved for the "
        "backward) alive until the call returns. TFLOP/s counts 6·T·k·D·H. peak GB = the "
        "peak allocated during one call minus what was allocated just before it (weights and "
        "inputs excluded); kept GB = what is still allocated after it while its output is "
        "alive, minus the same base (the output and what the backward will read). "
        f"{FORWARD_OP} = ours' forward op (moe_align + fused_moe_bf16, split=True) without "
        "autograd, timed in the same rounds. rel err = ‖out − grouped-mm‖/‖grouped-mm‖"
    ),
    "fwd+bwd": (
        "Forward and backward, returning dx, dw, dw2 and dtopk_weights. TFLOP/s counts "
        "18·T·k·D·H. peak GB = the peak allocated during one step minus what was allocated "
        "just before it (weights and inputs excluded, the gradients included). rel err = the "
        "largest over the four gradients of ‖g − grouped-mm's‖/‖grouped-mm's‖ (each one in "
        "the JSON's rel_errs)"
    ),
    "bwd": (
        "Backward ms = fwd+bwd ms − fwd-train ms, each the median of its own rounds, so "
        "`x vs P` compares the backward alone. TFLOP/s counts 12·T·k·D·H. rel err: the "
        "step's (the largest over the four gradients)"
    ),
}


MXFP8_LEGEND = (
    f"{peers.MXFP8} = moe_align + fused_moe_mxfp8 (split=True) on x, w and w2 quantized as "
    "the consumer quantizes them (RCEIL, weight scales blocked) once, outside the timing; its "
    "GB/s counts E_active·3·D·H·33/32 + T·D·33/32 + 2·T·D bytes (the routed experts' e4m3 "
    f"weights and their scales, x's values and scales, bf16 out). {peers.MXFP8_QUANT} "
    "quantizes x, w and w2 in every call first, what a trainer's forward pays each step "
    f"(reported without a bar or GB/s). `x vs {BF16}` compares them with our bf16 forward. "
    f"Their rel err is flagged above {MXFP8_ERR_FLAG:g}, the contract's bar against "
    "grouped-mm (quantizing the inputs alone costs several percent)."
)


def legend(meta, mode):
    tuned = (
        "autotuned per shape (Liger's Triton autotune, SonicMoE's QuACK autotune)"
        if meta["tune_peers"]
        else "not autotuned: Liger with LIGER_FUSED_MOE_AUTOTUNE=0, SonicMoE's QuACK GEMMs "
        "with tuned=False (QuACK's default_config); SonicMoE's own default autotunes per shape, "
        "which `--tune-peers` times"
    )
    if meta["peers"].get(SONIC_TUNED):
        tuned += (
            f"; `{SONIC_TUNED}` is SonicMoE at that default in the same rounds, and "
            f"`{harness.best_name('sonicmoe')}` the faster of its two rows in each shape where "
            "both ran"
        )
    parts = [
        harness.timing_sentence(meta),
        f"Peers {tuned}.",
        harness.SPEEDUP_LEGEND,
        "SM MHz = the median SM clock while the row was timed (NVML; the JSON's `clocks` also "
        "hold the board power and the share of samples the power cap held the clock down).",
    ]
    if mode != "fwd":
        parts.append(TRAINING_LEGEND)
    parts.append(f"{MODE_LEGEND[mode]}; (!) marks > {ERR_FLAG:g}.")
    if mode == "fwd" and meta.get("mxfp8"):
        parts.append(MXFP8_LEGEND)
    if meta["zipf"]["shapes"]:
        parts.append(
            "Routing: top-k of a softmax over normal logits; zipf rows draw k distinct experts "
            f"per token, the expert of rank r with probability ∝ r^-{meta['zipf']['s']:g}, "
            "and are left out of the geometric means."
        )
    return " ".join(parts)


def gm_lines(rows):
    return harness.geomean_lines(harness.geomeans(routed(rows), LARGE_T), LARGE_T)


def zipf_lines(rows, what):
    """One line per Zipf-routed shape: ours' speedups there (not in the means)."""
    out = []
    for r in routed(rows, softmax=False):
        if r["kind"] != "ours" or not r["speedup"]:
            continue
        ratios = ", ".join(f"vs {name} {x:.2f}x" for name, x in r["speedup"].items())
        out.append(
            f"Zipf-routed, {what}: {r['config']} T={r['T']} {r['routing']} (busiest expert "
            f"{r['load_max_over_mean']:.1f}x the mean load): {r['impl']} {ratios}"
        )
    return out


def notes(rows, what, *more):
    """A section's notes: the Zipf-routed shapes' speedups, then the rows' notes."""
    lines = [*zipf_lines(rows, what), *more]
    return lines + sorted({f"{r['impl']}: {r['note']}" for r in rows if r.get("note")})


def section(title, meta, ceilings, rows, mode, skips, note_lines, extra_means=(), more=()):
    return harness.section_md(
        title,
        meta,
        ceilings,
        legend(meta, mode),
        harness.md_table(columns(rows, mode), rows),
        [*gm_lines(rows), *extra_means],
        note_lines,
        skips,
        PEER_PACKAGES,
        more,
    )


DEFINITIONS = {
    "flops": "fwd and fwd-train 6*T*k*D*H, fwd+bwd 18*T*k*D*H, bwd 12*T*k*D*H",
    "weight_bytes": f"E_active*3*D*H*2, for T <= {WEIGHT_READ_MAX_T}; weight_gbps = that / time",
    "mxfp8_bytes": f"{peers.MXFP8}: E_active*3*D*H*33/32 + T*D*33/32 + 2*T*D (e4m3 "
    "weights and scales, x's values and scales, bf16 out), for T <= "
    f"{WEIGHT_READ_MAX_T}; mxfp8_gbps = that / time",
    "mxfp8": f"{peers.MXFP8}: moe_align + fused_moe_mxfp8 (split=True) on x, w, w2 "
    "quantized once outside the timing (RCEIL, w and w2 scales blocked); "
    f"{peers.MXFP8_QUANT}: the same quantizing x, w, w2 in every call",
    "quantize": f"the rows of mode {QUANTIZE!r}: quantize_mxfp8 RCEIL of x (T, D) "
    "with row-major scales, w (E, 2H, D) and w2 (E, D, H) with blocked scales; gbps = "
    "numel*(2 + 1 + 1/32) bytes (read + written) / time",
    "frac_copy": "weight_gbps, mxfp8_gbps or gbps over ceilings.copy_gbps",
    "graphed": f"ours' bf16 rows for T <= {WEIGHT_READ_MAX_T}: graphed_ms, the median of "
    "replaying a CUDA graph of the whole call (moe_align, allocations, the op), timed as the "
    "rest; graphed_frac_copy = weight_bytes / graphed_ms over ceilings.copy_gbps",
    "speedup": "other impl's ms / this row's ms (above 1: this row is faster); the MXFP8 "
    f"rows also against {BF16!r}; where a peer ran at several settings (rows sharing 'peer': "
    f"sonicmoe and {SONIC_TUNED!r}), also against '<peer> at its best', the fastest of them in "
    "the shape, set only where every setting ran",
    "rel_err": "||out - grouped-mm|| / ||grouped-mm||; fwd+bwd and bwd: the largest of "
    "rel_errs, the same per gradient (dx, dw, dw2, dtopk_weights) against grouped-mm "
    "autograd's",
    "fwd-train": "the forward with grad enabled on leaf copies of x, w, w2, topk_weights "
    "(all requiring grad), its output kept until the call returns",
    "fwd+bwd": "fwd-train plus torch.autograd.grad w.r.t. the four leaves",
    "bwd": "fwd+bwd ms - fwd-train ms, each the median over its interleaved rounds",
    "memory": "peak_gb: torch.cuda.max_memory_allocated during one call; extra_gb: that "
    "peak minus memory_allocated just before the call (weights, inputs, leaf copies and "
    "the reference's outputs excluded); held_gb: allocated after the call while its "
    "result is alive, minus the same base (fwd-train: out and what autograd saved; "
    "fwd+bwd: the gradients)",
    "routing": "softmax: top-k of a softmax over normal logits, renormalized "
    "(reference.routing); zipf s: k distinct experts per token drawn without replacement, "
    "rank r with probability proportional to r^-s over a random permutation of the "
    "experts, weights a softmax over normal logits at those experts, renormalized; "
    "load_max_over_mean: the busiest expert's pairs over T*k/E",
    "geomeans": f"over softmax-routed shapes only; large_T = T in {list(LARGE_T)}",
    "clocks": "NVML samples every 20 ms while a row was timed (harness.GpuClocks): sm_clock_mhz "
    "and power_w the medians over its rounds, power_capped and thermal the fractions of samples "
    "with the software power cap, or a heat or power-brake slowdown, holding the clock down",
}


def finish(args, meta, ceilings, live, skips, rows, started):
    elapsed = time.time() - started
    meta["peers"] = harness.impls_meta(live)
    meta["definitions"] = DEFINITIONS
    return publish(args, meta, ceilings, skips, rows, elapsed)


def publish(args, meta, ceilings, skips, rows, elapsed):
    """Logs the run's tables and means, then writes its sections and raw numbers."""
    for mode, mode_rows in rows.items():
        log()
        log(f"{TITLES[mode]}:")
        if mode == QUANTIZE:
            log(harness.text_table(quantize_columns(), mode_rows))
            lines = quantize_lines(mode_rows, quantize_bar(args))
        else:
            log(harness.text_table(columns(mode_rows, mode), mode_rows))
            lines = gm_lines(mode_rows) + zipf_lines(mode_rows, mode)
        for line in lines:
            log(line)
    log(f"total {elapsed:.0f} s")
    # A quick run's titles say so; a run kept beside the main one (--section) names its GPU.
    suffix = " (quick)" if args.quick and not args.section else ""
    suffix += f" on {meta['gpu']}" if args.section else ""
    if not args.training:
        fwd_rows = rows["fwd"]
        quantized = rows.get(QUANTIZE)
        sections = {
            args.sections["forward"]: section(
                f"flash_moe forward{suffix}",
                meta,
                ceilings,
                fwd_rows,
                "fwd",
                skips,
                notes(fwd_rows, "forward"),
                more=[] if quantized is None else [quantize_md(quantized, quantize_bar(args))],
            )
        }
        geomeans = {"forward": harness.geomeans(routed(fwd_rows), LARGE_T)}
        bench_extra = {"forward": fwd_rows}
        if quantized is not None:
            bench_extra[QUANTIZE] = quantized
    else:
        train, step, bwd = rows["fwd-train"], rows["fwd+bwd"], rows["bwd"]
        # the step's section also carries the backward's means and Zipf ratios: the
        # headline figures in one place
        bwd_means = [f"backward alone: {line}" for line in gm_lines(bwd)]
        sections = {
            args.sections["training"]: section(
                f"flash_moe {TITLES['fwd+bwd']}{suffix}",
                meta,
                ceilings,
                step,
                "fwd+bwd",
                skips,
                notes(step, "fwd+bwd", *zipf_lines(bwd, "backward alone")),
                bwd_means,
            ),
            args.sections["training-backward"]: section(
                f"flash_moe {TITLES['bwd']}{suffix}",
                meta,
                ceilings,
                bwd,
                "bwd",
                [],
                notes(bwd, "backward alone"),
            ),
            args.sections["training-forward"]: section(
                f"flash_moe {TITLES['fwd-train']}{suffix}",
                meta,
                ceilings,
                train,
                "fwd-train",
                [],
                notes(train, "training forward"),
            ),
        }
        geomeans = {mode: harness.geomeans(routed(r), LARGE_T) for mode, r in rows.items()}
        bench_extra = dict(rows)
    doc = {
        "meta": meta,
        "ceilings": ceilings,
        "rows": [r for mode_rows in rows.values() for r in mode_rows],
        "skips": skips,
        "geomeans": geomeans,
        "elapsed_s": elapsed,
    }
    harness.publish(OP, args, sections, doc, bench_extra)
    return doc


def combine(args):
    """One results section set and JSON from several runs of one tree on one machine (a full
    training run does not fit one call of the 600 s a GPU machine allows a command): each
    shape's rows come from the last run that timed it in every mode, the runs' commands,
    dates and ceilings stay in the JSON's meta."""
    docs = [harness.read_json(path) for path in args.combine.split(",")]
    first = docs[0]["meta"]
    for doc in docs:
        meta = doc["meta"]
        if meta["commit"] != first["commit"] or meta["training"] != args.training:
            sys.exit(
                f"--combine: {meta['command']!r} ran commit {meta['commit']} with training="
                f"{meta['training']}; every run must be of commit {first['commit']} and "
                f"training={args.training} (pass --training to combine training runs)"
            )
    modes = TRAINING_MODES if args.training else ("fwd",)
    shapes = {}
    for doc in docs:
        by_shape = {}
        for r in doc["rows"]:
            key = (r["config"], r["T"], r.get("routing"), r.get("tensor"))
            by_shape.setdefault(key, []).append(r)
        for key, shape_rows in by_shape.items():
            if key[3] is not None or {r["mode"] for r in shape_rows} >= set(modes):
                shapes[key] = shape_rows
    rows = {mode: [] for mode in modes}
    for shape_rows in shapes.values():
        for r in shape_rows:
            rows.setdefault(r["mode"], []).append(r)
    meta = dict(first)
    meta["command"] = " ; then ".join(doc["meta"]["command"] for doc in docs)
    meta["peers"] = {name: p for doc in docs for name, p in doc["meta"]["peers"].items()}
    meta["runs"] = [
        {
            "command": doc["meta"]["command"],
            "date": doc["meta"]["date"],
            "ceilings": doc["ceilings"],
            "elapsed_s": doc["elapsed_s"],
        }
        for doc in docs
    ]
    skips = list({json.dumps(s, sort_keys=True): s for doc in docs for s in doc["skips"]}.values())
    elapsed = sum(doc["elapsed_s"] for doc in docs)
    return publish(args, meta, docs[0]["ceilings"], skips, rows, elapsed)


def check_rows(args, doc):
    """Problems with a self-test run's rows: every shape has its rows in every mode, with
    rates, speedups, errors (the four gradients' in fwd+bwd) and memory where due."""
    problems = []
    ours = [] if args.no_ours else ["ours split=True", "ours split=False"]
    stand_ins = {SelfTestPeer(1).name, SelfTestPeer(2).name}
    if args.training:
        want = {
            mode: {"grouped-mm", *stand_ins, *(["ours"] if ours else [])} for mode in TRAINING_MODES
        }
        if ours:
            want["fwd-train"].add(FORWARD_OP)
    else:
        want = {"fwd": {"grouped-mm", *stand_ins, *ours, *(MXFP8_IMPLS if args.mxfp8 else ())}}
    shapes = [(T, SOFTMAX) for T in args.tokens_list]
    shapes += [(T, zipf_name(args.zipf_s)) for _, T in args.zipf_list]
    if args.mxfp8:
        configs = SELF_TEST_CONFIGS if args.self_test else CONFIGS
        quantized = {("x", quantize_bar(args))}
        for key, plan in shape_plan(args).items():
            _, D, H, E, _ = configs[key]
            quantized |= {("x", (max(T for T, _ in plan), D)), ("w", (E, 2 * H, D))}
            quantized.add(("w2", (E, D, H)))
        got = {(r["tensor"], tuple(r["shape"])) for r in doc["rows"] if r["mode"] == QUANTIZE}
        if got != quantized:
            problems.append(f"quantizer rows {sorted(got)}, expected {sorted(quantized)}")
    for T, routing in shapes:
        for mode in want:
            got = {
                r["impl"]
                for r in doc["rows"]
                if r["T"] == T and r["mode"] == mode and r["routing"] == routing
            }
            if got != want[mode]:
                problems.append(f"{mode} rows at T={T} ({routing}): {sorted(got)}")
    for r in doc["rows"]:
        if r["mode"] == QUANTIZE:
            if not (r["ms"] > 0 and r["gbps"] > 0 and r["frac_copy"] > 0):
                problems.append(f"quantize_mxfp8 {r['tensor']} {r['shape']}: GB/s missing")
            continue
        where = f"{r['impl']} {r['mode']} T={r['T']} ({r['routing']})"
        if r["mode"] == "bwd" and not math.isfinite(r["ms"]):
            if "no difference" not in r.get("note", ""):
                problems.append(f"{where}: NaN without its note")
            continue
        if not (r["ms"] > 0 and r["tflops"] > 0 and "frac_dense" in r and "speedup" in r):
            problems.append(f"{where}: rates or speedups missing")
        if r["kind"] == "ours" and not (r["rel_err"] is not None and r["rel_err"] <= err_flag(r)):
            problems.append(f"{where}: rel err {r['rel_err']}")
        if r["mode"] == "fwd":
            key = {peers.MXFP8: "mxfp8_gbps", peers.MXFP8_QUANT: None}.get(r["impl"], "weight_gbps")
            small = r["T"] <= WEIGHT_READ_MAX_T and key is not None
            if (key in r) != small or ("frac_copy" in r) != small:
                problems.append(f"{where}: GB/s")
            if r["kind"] == "ours" and (r["impl"] in MXFP8_IMPLS) != (BF16 in r["speedup"]):
                problems.append(f"{where}: speedup against {BF16}")
        if r["mode"] == "fwd-train" and r["kind"] == "ours" and FORWARD_OP not in r["speedup"]:
            problems.append(f"{where}: speedup against {FORWARD_OP}")
        if r["mode"] in ("fwd-train", "fwd+bwd") and not {"extra_gb", "held_gb"} <= set(r):
            problems.append(f"{where}: memory")
        if r["mode"] in ("fwd+bwd", "bwd") and r["kind"] != "baseline":
            errs = r.get("rel_errs") or {}
            if set(errs) != set(GRADS) or None in errs.values():
                problems.append(f"{where}: gradient errors {errs}")
        if r.get("peer") != SelfTestPeer.peer and r["speedup"] and math.isfinite(r["ms"]):
            best = harness.best_name(SelfTestPeer.peer)
            settings = [
                x["ms"]
                for x in doc["rows"]
                if x.get("peer") == SelfTestPeer.peer
                and (x["config"], x["T"], x["routing"], x["mode"])
                == (r["config"], r["T"], r["routing"], r["mode"])
            ]
            expected = min(settings) / r["ms"] if all(ms > 0 for ms in settings) else None
            got = r["speedup"].get(best)
            wrong = len(settings) != 2 or (got is None) != (expected is None)
            if not wrong and expected is not None:
                wrong = abs(got - expected) > 1e-9 * expected
            if wrong:
                problems.append(f"{where}: speedup against {best} {got}, expected {expected}")
        if r["mode"] == "bwd" and abs(r["ms"] - (r["total_ms"] - r["part_ms"])) > 1e-9:
            problems.append(f"{where}: backward is not fwd+bwd - fwd-train")
        if r["routing"] != SOFTMAX and not r["load_max_over_mean"] > 1:
            problems.append(f"{where}: Zipf routing without skew")
    if set(doc["geomeans"]) != set(want if args.training else ["forward"]):
        problems.append(f"geomeans: {sorted(doc['geomeans'])}")
    return problems


def self_test(args, argv):
    """The forward run, then (or only, with --training) the training run, both writing
    into one temporary results file: each run must leave the other's sections as they
    were."""
    runs = [args] if args.training else [args, parse_args([*argv, "--training"])]
    scratch, problems, total = None, [], 0
    for run_args in runs:
        scratch, original = harness.self_test_paths(run_args, scratch)
        doc = run(run_args)
        total += len(doc["rows"])
        problems += harness.check_written(
            OP,
            run_args,
            doc,
            original,
            scratch,
            lambda src, dst: main(["--merge", src, "--results", dst]),
        )
        problems += [
            f"{'training' if run_args.training else 'forward'} run: {p}"
            for p in check_rows(run_args, doc) + check_combine(run_args, doc, scratch)
        ]
    harness.self_test_verdict(
        problems, scratch, f"{total} rows in {len(runs)} runs, files, --merge and --combine"
    )


def check_combine(args, doc, scratch):
    """Problems with --combine of the run's raw numbers split in two by shape: it must
    give back the run's rows and geometric means."""
    first = (doc["rows"][0]["config"], doc["rows"][0]["T"])
    paths = []
    for part in (True, False):
        path = Path(scratch, f"combine-part-{int(part)}.json")
        rows = [r for r in doc["rows"] if ((r["config"], r["T"]) == first) == part]
        harness.write_json(path, {**doc, "rows": rows})
        paths.append(str(path))
    argv = ["--combine", ",".join(paths), "--results", str(Path(scratch, "combined.md"))]
    argv += ["--results-json", str(Path(scratch, "combined.json"))]
    combined = combine(parse_args([*argv, *(["--training"] if args.training else [])]))
    problems = []

    def texts(rows):
        return sorted(json.dumps(r, sort_keys=True) for r in rows)

    if texts(combined["rows"]) != texts(doc["rows"]):
        problems.append("--combine of the run in two parts changed its rows")
    if combined["geomeans"] != doc["geomeans"]:
        problems.append("--combine of the run in two parts changed its geometric means")
    return problems


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        harness.merge(args, OP)
    elif args.combine:
        combine(args)
    elif args.self_test:
        self_test(args, list(sys.argv[1:] if argv is None else argv))
    else:
        harness.interrupt_on_sigterm()  # a time limit's SIGTERM still writes what ran
        run(args)


if __name__ == "__main__":
    main()
