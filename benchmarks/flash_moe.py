"""flash_moe against its peers, with the machine's own ceilings measured in the same run.

Run on the GPU machine (peers' wheels from scripts/fetch-peer-wheels installed into
PYTHONPATH first)::

    python benchmarks/flash_moe.py [--quick] [--configs qwen3,...] [--tokens 64,1024,...]
                                   [--results benchmarks/RESULTS.md] [--backward]

Times, with CUDA events (triton.testing.do_bench, median, L2 flushed before each call),
the whole forward a user pays: ours = moe_align + fused_moe_bf16 (split=True, and
split=False with the zeroing of out), the grouped-mm expert path (reference.py),
Liger-Kernel's Triton fused MoE and SonicMoE; each peer is skipped with its reason when it
is missing or fails. Every output is checked against grouped-mm's (relative error) once per
shape. Writes the table into the results file between ``<!-- flash_moe:forward -->`` and
``<!-- /flash_moe:forward -->`` (the rest of the file is left as it is) and the raw numbers
into ``--results-json`` (benchmarks/results/flash_moe.json; flash_moe-forward-quick.json
with --quick), and, where $OUT is set, $OUT/flash_moe_bench.json (the raw numbers, also
split into forward and backward), $OUT/RESULTS.md and $OUT/flash_moe.json (the updated
files, to copy back) and $OUT/flash_moe_sections.md (this run's sections alone, for
``--merge`` on another checkout). ``--self-test`` runs the whole pipeline, forward and
backward, on CPU at a toy shape, writing into a temporary directory, and checks what it
wrote.

This file holds the workloads; benchmarks/harness.py times, tabulates and writes them, and
benchmarks/peers.py holds the implementations.
"""

from __future__ import annotations

import argparse
import os
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
WEIGHT_READ_MAX_T = 1024
PEERS = ("grouped-mm", "liger", "sonic")
PEER_PACKAGES = ("liger-kernel", "sonic-moe", "quack-kernels", "nvidia-cutlass-dsl")
ERR_FLAG = 2e-2  # relative error vs grouped-mm above which a row is flagged
SELF_TEST_CONFIGS = {"toy": ("toy", 128, 64, 8, 2)}
SELF_TEST_TOKENS = (16, 64)
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_run_args(
        p,
        OP,
        f"configs {','.join(QUICK_CONFIGS)}, T in {QUICK_TOKENS}, shorter timing",
        WARMUP_MS,
        REP_MS,
        BUDGET_S,
    )
    p.add_argument("--configs", help=f"comma list of {','.join(CONFIGS)}")
    p.add_argument("--tokens", help=f"comma list of T (default {','.join(map(str, TOKENS))})")
    p.add_argument(
        "--backward", action="store_true", help="also time forward+backward, with peak memory"
    )
    p.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"comma list of peers to time, of {','.join(PEERS)} (or 'none')",
    )
    p.add_argument("--no-ours", action="store_true", help="time the peers only")
    p.add_argument(
        "--tune-peers",
        action="store_true",
        help="let Liger (Triton autotune, 32 configs per kernel) and SonicMoE "
        "(QuACK autotune per shape) tune; off by default: it costs minutes",
    )
    p.add_argument(
        "--self-test",
        action="store_true",
        help="CPU dry run at a toy shape, forward and backward, into a temporary directory "
        "(grouped-mm stands in for ours)",
    )
    args = p.parse_args(argv)
    if args.self_test:
        args.configs_list = list(SELF_TEST_CONFIGS)
        args.tokens_list = list(SELF_TEST_TOKENS)
        args.backward = True
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
        else:
            args.tokens_list = list(QUICK_TOKENS if args.quick else TOKENS)
    peer_names = (
        []
        if args.peers.strip().lower() == "none"
        else [s.strip().lower() for s in args.peers.split(",") if s.strip()]
    )
    for name in peer_names:
        if name not in PEERS:
            p.error(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    args.peer_list = peer_names
    harness.finish_run_args(
        args,
        OP,
        argv,
        "benchmarks/flash_moe.py",
        ("forward", "backward"),
        WARMUP_MS,
        REP_MS,
        BUDGET_S,
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


def make_inputs(T, D, E, k, gen, device, routing=None):
    """x (T, D) bf16 and the routing: ids (T, k) int32, weights (T, k) fp32."""
    import torch

    x = (torch.randn(T, D, generator=gen, device=device) * 0.2).to(torch.bfloat16)
    ids, wts = (routing or softmax_topk_routing)(T, E, k, generator=gen, device=device)
    return x, ids, wts


def rates(ceilings, flops, wbytes=None):
    """derive() for Session.time_shape: TFLOP/s and the fraction of the dense GEMM, and
    with ``wbytes`` the weight bytes read per second and the fraction of the copy rate."""

    def derive(row):
        s = row["ms"] * 1e-3
        out = {"tflops": flops / s / 1e12}
        out["frac_dense"] = out["tflops"] / ceilings["gemm_tflops"]
        if wbytes is not None:
            out["weight_gbps"] = wbytes / s / 1e9
            out["frac_copy"] = out["weight_gbps"] / ceilings["copy_gbps"]
        return out

    return derive


def load_impls(args, device, session):
    """The implementations to time, in table order: ours, grouped-mm, peers; those that
    cannot run are in session.skips."""
    impls = []
    if not args.no_ours:
        if args.self_test:
            impls += [SelfTestOurs(True), SelfTestOurs(False)]
        else:
            try:
                import prime_kernels

                reason = prime_kernels.unavailable_reason("flash_moe")
                if reason is None:
                    fm = prime_kernels.load("flash_moe")
                    impls += [peers.Ours(fm, True), peers.Ours(fm, False)]
                else:
                    session.skip("ours", reason)
            except Exception as exc:
                session.skip("ours", f"prime_kernels not importable ({harness.first_line(exc)})")
    impls.append(peers.GroupedMM())  # always: the reference
    if not args.tune_peers:
        os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")
    for name in args.peer_list:
        if name == "grouped-mm":
            continue
        if device.type != "cuda":
            session.skips.append({"impl": name, "reason": "needs a CUDA device"})
            continue
        try:
            impl = peers.Liger() if name == "liger" else peers.Sonic(tuned=args.tune_peers)
            impls.append(impl)
            log(f"{impl.name}: {impl.note}")
        except peers.Skip as exc:
            session.skip(name, str(exc))
    session.skips.append({"impl": "vllm", "reason": peers.VLLM_REASON})
    return impls


class SelfTestOurs(peers.Impl):
    """CPU stand-in for ours in self-tests: the grouped-mm path under another name."""

    kind = "ours"

    def __init__(self, split):
        from prime_kernels.flash_moe import reference

        self.ref = reference.moe_grouped_mm
        self.split = split
        self.name = f"ours split={split}"

    def settings(self):
        return {"split": self.split, "stand-in": "reference.moe_grouped_mm"}

    def forward(self, state, x, topk_ids, topk_weights):
        w, w2 = state
        return lambda: self.ref(x, w, w2, topk_ids, topk_weights)

    def forward_backward(self, state, x, w, w2, topk_ids, topk_weights, grad_out):
        import torch

        leaves = peers._leaves(x, w, w2)

        def fn():
            out = self.ref(*leaves, topk_ids, topk_weights)
            return torch.autograd.grad(out, leaves, grad_out)

        return fn


# --------------------------------------------------------------------------- the run


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
        versions=peers.peer_versions(), tune_peers=args.tune_peers, self_test=args.self_test
    )
    log(harness.header_line(meta))
    log(f"command: {meta['command']}")
    ceilings = harness.measure_ceilings(timer, device, args.self_test)
    log(harness.ceilings_line(ceilings))

    session = harness.Session(device, timer, harness.Budget(args.budget_s, started))
    live = load_impls(args, device, session)
    configs = SELF_TEST_CONFIGS if args.self_test else CONFIGS
    fwd_rows, bwd_rows = [], []
    rel_err = reference.relative_error

    def grads_err(grads, ref):
        return max(rel_err(g, r) for g, r in zip(grads, ref))

    # one function per config and per shape, so that their tensors are gone when they return
    def shape(label, D, H, E, k, T, w, w2, states, broken, gen):
        x, ids, wts = make_inputs(T, D, E, k, gen, device, getattr(reference, "routing", None))
        e_active = int(torch.unique(ids).numel())
        flops = 6.0 * T * k * D * H
        where = dict(config=label, D=D, H=H, E=E, k=k, T=T, e_active=e_active)
        wbytes = e_active * 3.0 * D * H * 2 if T <= WEIGHT_READ_MAX_T else None
        fwd_rows.extend(
            session.time_shape(
                live,
                where,
                "fwd",
                lambda impl: impl.forward(states[impl.name], x, ids, wts),
                rel_err,
                broken,
                derive=rates(ceilings, flops, wbytes),
            )
        )
        if not args.backward or session.stopped():
            return
        grad_out = (torch.randn(x.shape, device=device) * 0.1).to(x.dtype)
        bwd_rows.extend(
            session.time_shape(
                live,
                where,
                "fwd+bwd",
                lambda impl: impl.forward_backward(states[impl.name], x, w, w2, ids, wts, grad_out),
                grads_err,
                dict(broken),  # a backward failure leaves the forward alone
                derive=rates(ceilings, 3 * flops),
                # one backward row for ours: moe() has no split choice
                name=lambda impl: "ours" if impl.kind == "ours" else impl.name,
                memory=True,
                recover=False,
            )
        )
        session.check_context()

    def config(label, D, H, E, k):
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
        for T in args.tokens_list:
            if session.stopped():
                break
            shape(label, D, H, E, k, T, w, w2, states, broken, gen)
            harness.free_memory(device)

    try:
        for cfg_key in args.configs_list:
            if session.stopped():
                break
            config(*configs[cfg_key])
            harness.free_memory(device)
    finally:
        doc = finish(args, meta, ceilings, live, session.skips, fwd_rows, bwd_rows, started)
    return doc


# --------------------------------------------------------------------------- reporting


def columns(rows, mode):
    cols = [
        harness.value_column("config", "config"),
        harness.value_column("T", "T"),
        harness.value_column("impl", "impl"),
        harness.MS_COLUMN,
        harness.value_column("TFLOP/s", "tflops", ".1f"),
        harness.value_column("of dense", "frac_dense", ".1%"),
    ]
    if mode == "fwd":
        cols += [
            harness.value_column("weight GB/s", "weight_gbps", ".0f"),
            harness.value_column("of copy", "frac_copy", ".1%"),
        ]
    else:
        cols += [
            harness.value_column("peak GB", "peak_gb", ".2f"),
            harness.value_column("extra GB", "extra_gb", ".2f"),
        ]
    return cols + harness.speedup_columns(rows) + [harness.rel_err_column(ERR_FLAG)]


def legend(meta, mode):
    tuned = "autotuned" if meta["tune_peers"] else "not autotuned (their default configs)"
    counts = (
        "TFLOP/s counts "
        + ("6·T·k·D·H" if mode == "fwd" else "18·T·k·D·H (fwd+bwd)")
        + (
            f"; weight GB/s = E_active·3·D·H·2 bytes / time, for T ≤ {WEIGHT_READ_MAX_T}"
            if mode == "fwd"
            else "; peak GB = torch.cuda.max_memory_allocated over one "
            "step, extra GB = peak minus what was allocated before it"
        )
        + ". rel err = ‖out − grouped-mm‖/‖grouped-mm‖"
        + (" (max over dx, dw, dw2)" if mode != "fwd" else "")
        + f"; (!) marks > {ERR_FLAG:g}."
    )
    return " ".join(
        [harness.timing_sentence(meta), f"Peers {tuned}.", harness.SPEEDUP_LEGEND, counts]
    )


def section(title, meta, ceilings, rows, mode, skips, notes):
    return harness.section_md(
        title,
        meta,
        ceilings,
        legend(meta, mode),
        harness.md_table(columns(rows, mode), rows),
        harness.geomean_lines(harness.geomeans(rows, LARGE_T), LARGE_T),
        notes,
        skips,
        PEER_PACKAGES,
    )


def finish(args, meta, ceilings, live, skips, fwd_rows, bwd_rows, started):
    elapsed = time.time() - started
    harness.log_table("forward", columns(fwd_rows, "fwd"), fwd_rows, LARGE_T)
    if args.backward:
        harness.log_table("forward + backward", columns(bwd_rows, "bwd"), bwd_rows, LARGE_T)
    log(f"total {elapsed:.0f} s")
    meta["peers"] = harness.impls_meta(live)
    meta["definitions"] = {
        "flops": "fwd 6*T*k*D*H, fwd+bwd 18*T*k*D*H",
        "weight_bytes": f"E_active*3*D*H*2, for T <= {WEIGHT_READ_MAX_T}",
        "speedup": "other impl's ms / this row's ms (above 1: this row is faster)",
        "rel_err": "||out - grouped-mm|| / ||grouped-mm|| (fwd+bwd: max over dx, dw, dw2)",
    }
    notes = sorted({f"{r['impl']}: {r['note']}" for r in fwd_rows if r.get("note")})
    quick = " (quick)" if args.quick and not args.section else ""
    fwd_skips = [s for s in skips if s.get("mode") != "fwd+bwd"]
    sections = {
        args.sections["forward"]: section(
            f"flash_moe forward{quick}", meta, ceilings, fwd_rows, "fwd", fwd_skips, notes
        )
    }
    if args.backward:
        bwd_skips = [s for s in skips if s.get("mode") == "fwd+bwd"]
        sections[args.sections["backward"]] = section(
            f"flash_moe forward + backward{quick}",
            meta,
            ceilings,
            bwd_rows,
            "bwd",
            bwd_skips,
            [],
        )
    doc = {
        "meta": meta,
        "ceilings": ceilings,
        "rows": fwd_rows + bwd_rows,
        "skips": skips,
        "geomeans": {
            "forward": harness.geomeans(fwd_rows, LARGE_T),
            "backward": harness.geomeans(bwd_rows, LARGE_T),
        },
        "elapsed_s": elapsed,
    }
    harness.publish(OP, args, sections, doc, {"forward": fwd_rows, "backward": bwd_rows})
    return doc


def self_test(args):
    scratch, original = harness.self_test_paths(args)
    doc = run(args)
    problems = harness.check_written(
        OP,
        args,
        doc,
        original,
        scratch,
        lambda src, dst: main(["--merge", src, "--results", dst]),
    )
    ours = [] if args.no_ours else ["ours split=True", "ours split=False"]
    want = {"fwd": {"grouped-mm", *ours}, "fwd+bwd": {"grouped-mm", *(["ours"] if ours else [])}}
    for T in args.tokens_list:
        for mode in want:
            got = {r["impl"] for r in doc["rows"] if r["T"] == T and r["mode"] == mode}
            if got != want[mode]:
                problems.append(f"{mode} rows at T={T}: {sorted(got)}")
    for r in doc["rows"]:
        where = f"{r['impl']} {r['mode']} T={r['T']}"
        if not (r["ms"] > 0 and r["tflops"] > 0 and "frac_dense" in r and "speedup" in r):
            problems.append(f"{where}: rates or speedups missing")
        if r["kind"] == "ours" and not (r["rel_err"] is not None and r["rel_err"] <= ERR_FLAG):
            problems.append(f"{where}: rel err {r['rel_err']}")
        if r["mode"] == "fwd" and ("weight_gbps" in r) != (r["T"] <= WEIGHT_READ_MAX_T):
            problems.append(f"{where}: weight GB/s")
    harness.self_test_verdict(problems, scratch, f"{len(doc['rows'])} rows, files and --merge")


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        harness.merge(args, OP)
    elif args.self_test:
        self_test(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
