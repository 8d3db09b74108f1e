"""A/B of two builds of prime_kernels' flash_moe (or of up to four: A/B/C/D), each measured in
its own processes.

    python benchmarks/ab.py --a PATH_A --b PATH_B [--c PATH_C [--d PATH_D]] [--rounds 3]
                            [--configs qwen3,...] [--tokens 64,1024,...] [--splits true,false]
                            [--mode fwd|train|mxfp8]

PATH_A, PATH_B, ... are source trees of prime_kernels, each built in place (e.g. /work/main
and a copy of an older commit under scratch/). All register torch.ops.prime_moe, which a
process can load only once, so every measurement runs in a child process of this script
with PYTHONPATH=PATH (the child refuses a prime_kernels imported from anywhere else). Each
round runs every build once, each round's order the last one's rotated by one (A B, B A, ...;
A B C, B C A, C A B, ...): drift in clocks or temperature falls on all builds alike, and the
ratios of more than two builds come from one sitting.

A child creates each config's weights once, and every input, from --seed (the same data for
A and B: each child records an exact fingerprint of its inputs, and the parent compares
them), then times ours as benchmarks/flash_moe.py's "ours" does (moe_align +
fused_moe_bf16; split=False includes zeroing out; with --mode train, the training step
flash_moe.moe forward plus the backward of x, w, w2 and topk_weights; with --mode mxfp8,
moe_align + fused_moe_mxfp8 split=True on inputs quantized once outside the timing, as
flash_moe.py's ours-mxfp8 row) with harness.Timer:
CUDA events, median, after warm-up, with a buffer larger than L2 zeroed before every call,
so that inputs come from HBM. In its first round each build's outputs (the largest of the
four gradients' errors, in train mode) are checked against reference.py's grouped-mm path
(relative error).

Prints config | T | split | A ms | B ms (medians over rounds) | A/B of each round | their
median (above 1: B is faster) | the SM clock each ran at (NVML, median over rounds: at the power
cap a faster build may run at a lower clock) | both rel errs, then the geometric mean of the median
ratios, and writes every child's raw numbers and the summary to $OUT/ab.json (or --json). With
--c (--d) the same for C (D): its ms, A/C of each round and their median, its clock and rel err.
``--self-test`` runs it all on CPU at a toy shape, with grouped-mm standing in for ours
and two more trees that link to this one's prime_kernels, and checks the result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import flash_moe  # noqa: E402
import harness  # noqa: E402
import peers  # noqa: E402
from harness import log  # noqa: E402

SPLITS = (True, False)


def parse_bool_list(text):
    out = []
    for s in text.split(","):
        s = s.strip().lower()
        if s not in ("true", "false"):
            raise argparse.ArgumentTypeError(f"split must be true or false, got {s!r}")
        out.append(s == "true")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--a", help="source tree of build A (built in place)")
    p.add_argument("--b", help="source tree of build B (built in place)")
    p.add_argument("--c", help="source tree of a build C, timed in the same rounds")
    p.add_argument("--d", help="source tree of a build D (with --c)")
    p.add_argument(
        "--rounds", type=int, default=3, help="A,B then B,A, ...; with C: rotated (default 3)"
    )
    p.add_argument(
        "--configs",
        default=",".join(flash_moe.CONFIGS),
        help=f"comma list of {','.join(flash_moe.CONFIGS)} (default all)",
    )
    p.add_argument(
        "--tokens",
        default=",".join(map(str, flash_moe.TOKENS)),
        help=f"comma list of T (default {','.join(map(str, flash_moe.TOKENS))})",
    )
    p.add_argument(
        "--splits",
        type=parse_bool_list,
        default=list(SPLITS),
        help="comma list of true/false (default true,false)",
    )
    p.add_argument(
        "--mode",
        choices=("fwd", "train", "mxfp8"),
        default="fwd",
        help="fwd: the forward op; train: moe() forward + backward; mxfp8: fused_moe_mxfp8 "
        "(one row per shape for train and mxfp8)",
    )
    p.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warmup (default 25)")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench rep (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="raw numbers and summary (default $OUT/ab.json)")
    p.add_argument(
        "--self-test",
        action="store_true",
        help="CPU dry run at a toy shape (grouped-mm stands in for ours)",
    )
    # a child process: one build, one pass over the shapes
    p.add_argument("--child", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv if argv is None else ["benchmarks/ab.py", *argv])
    if args.self_test:
        args.configs_list = list(flash_moe.SELF_TEST_CONFIGS)
        args.tokens_list = list(flash_moe.SELF_TEST_TOKENS)
    else:
        try:
            args.configs_list = flash_moe.resolve_configs(args.configs.split(","))
        except ValueError as exc:
            p.error(str(exc))
        args.tokens_list = [int(t) for t in args.tokens.split(",") if t.strip()]
        if not args.child and not (args.a and args.b):
            p.error("--a and --b are required (or --self-test)")
        if args.d and not args.c:
            p.error("--d needs --c")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.mode in ("train", "mxfp8"):
        args.splits = [True]  # moe() runs the split forward; ours-mxfp8 is timed split
    return args


# --------------------------------------------------------------------------- child


def fingerprint(*tensors):
    """Exact sums of the tensors' bits as integers: equal for A and B when their data is."""
    import torch

    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    out = []
    for t in tensors:
        flat = t.contiguous().view(as_int[t.element_size()]).view(-1)
        # in chunks: the int64 sum casts its input first, 4x the bytes of Mixtral's weights
        out.append(sum(int(c.sum(dtype=torch.int64)) for c in flat.split(1 << 26)))
    return out


def child(args):
    """(exit code, JSON document) of one build timed over every requested shape; a child
    that stops early still returns what it timed."""
    import torch

    root = Path(args.child).resolve()
    doc = {"build": {"path": str(root)}, "check": args.check, "shapes": [], "error": None}
    try:
        import prime_kernels

        pk_root = Path(prime_kernels.__file__).parent.parent
        doc["build"].update(
            prime_kernels=prime_kernels.__file__,
            build_info=prime_kernels.build_info(),
            commit=harness.git_commit(root, built_first=True),
        )
        if not os.path.samefile(pk_root, root):
            doc["error"] = f"prime_kernels was imported from {pk_root}, not {root}"
            return 2, doc
        from prime_kernels.flash_moe import reference

        device = torch.device("cpu" if args.self_test else "cuda")
        if args.self_test:
            make_impl = flash_moe.SelfTestOurs
        else:
            reason = prime_kernels.unavailable_reason("flash_moe")
            if reason:
                doc["error"] = reason
                return 2, doc
            fm = prime_kernels.load("flash_moe")
            doc["build"]["flash_moe"] = fm.__file__

            def make_impl(split):
                if args.mode == "mxfp8":
                    return peers.OursMxfp8(fm, quantize_each_call=False)
                return peers.Ours(fm, split)

        timer = harness.Timer(device, args.warmup_ms, args.rep_ms)
        doc.update(harness.device_meta(device), timing=timer.method())
        if device.type == "cuda":
            doc["l2_bytes"] = torch.cuda.get_device_properties(device).L2_cache_size
        impls = {split: make_impl(split) for split in args.splits}
        configs = flash_moe.SELF_TEST_CONFIGS if args.self_test else flash_moe.CONFIGS
        for cfg in args.configs_list:
            if not time_config(args, doc, cfg, configs[cfg], impls, timer, reference, device):
                doc["error"] = "the CUDA context is gone (a sticky error): stopped there"
                return 3, doc
            harness.free_memory(device)
        return 0, doc
    except Exception as exc:
        doc["error"] = harness.first_line(exc)
        return 1, doc


def time_config(args, doc, cfg, config, impls, timer, reference, device):
    """Appends one entry per T and split to doc["shapes"]; False once the context is dead."""
    import torch

    label, D, H, E, k = config
    gen = torch.Generator(device=device).manual_seed(args.seed)
    w, w2 = flash_moe.make_weights(D, H, E, gen, device)
    weights = fingerprint(w, w2)
    states = {}
    for split, impl in impls.items():
        try:
            states[split] = impl.prepare(w, w2)
        except harness.Skip as exc:
            states[split] = exc
    train = args.mode == "train"
    for T in args.tokens_list:
        x, ids, wts = flash_moe.make_inputs(T, D, E, k, gen, device)
        grad_out = None
        if train:
            grad_out = (0.1 * torch.randn(x.shape, generator=gen, device=device)).to(x.dtype)
        if not args.check:
            ref = None
        elif train:
            ref = peers.GroupedMM().forward_backward((w, w2), x, w, w2, ids, wts, grad_out)()
        else:
            ref = reference.moe_grouped_mm(x, w, w2, ids, wts)
        common = dict(
            config=cfg,
            label=label,
            D=D,
            H=H,
            E=E,
            k=k,
            T=T,
            inputs=weights + fingerprint(x, ids, wts, *([grad_out] if train else [])),
            input_bytes=sum(t.numel() * t.element_size() for t in (x, w, w2, ids, wts)),
        )
        for split, impl in impls.items():
            entry = {**common, "split": split}
            try:
                if isinstance(states[split], Exception):
                    raise states[split]
                if train:
                    fn = impl.forward_backward(states[split], x, w, w2, ids, wts, grad_out)
                else:
                    fn = impl.forward(states[split], x, ids, wts)
                out, entry["first_call_s"] = timer.first_call(fn)
                if ref is not None and train:
                    entry["rel_err"] = max(
                        reference.relative_error(g, r)
                        for g, r in zip(out, ref)
                        if g is not None and r is not None
                    )
                elif ref is not None:
                    entry["rel_err"] = reference.relative_error(out, ref)
                del out
                entry["ms"] = timer.median_ms(fn)
                if timer.last_clocks:
                    entry["clocks"] = timer.last_clocks
                log(
                    f"  {label} T={T} split={split}: {harness.fmt_ms(entry['ms'])} ms"
                    + (f", rel err {entry['rel_err']:.2e}" if ref is not None else "")
                )
            except Exception as exc:
                entry["error"] = (
                    str(exc) if isinstance(exc, harness.Skip) else harness.first_line(exc)
                )
                log(f"  {label} T={T} split={split}: {entry['error']}")
            doc["shapes"].append(entry)
            if "error" in entry and not harness.context_alive(device):
                return False
        del x, ids, wts, ref, grad_out
        harness.free_memory(device)
    return True


# --------------------------------------------------------------------------- parent


def run_child(args, path, check):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "child.json")
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            str(path),
            "--child-out",
            str(out),
            "--configs",
            ",".join(args.configs_list),
            "--tokens",
            ",".join(map(str, args.tokens_list)),
            "--splits",
            ",".join(str(s).lower() for s in args.splits),
            "--warmup-ms",
            str(args.warmup_ms),
            "--rep-ms",
            str(args.rep_ms),
            "--seed",
            str(args.seed),
            "--mode",
            args.mode,
            *(["--check"] if check else []),
            *(["--self-test"] if args.self_test else []),
        ]
        pythonpath = [str(path), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
        started = time.time()
        rc = subprocess.run(cmd, env=env).returncode
        if out.exists():
            doc = json.loads(out.read_text())
        else:
            doc = {"shapes": [], "error": f"exited with {rc} before writing its JSON"}
    doc.update(returncode=rc, wall_s=time.time() - started)
    if doc.get("error"):
        log(f"  child failed (exit {rc}): {doc['error']}")
    return doc


def ratio_key(side, key):
    """The summary's key of A over `side`: B's keep their two-build names ("ratios")."""
    return key if side == "b" else f"{key}_{side}"


def summarize(args, rounds, sides):
    """One row per (config, T, split) in request order."""
    rows = []
    configs = flash_moe.SELF_TEST_CONFIGS if args.self_test else flash_moe.CONFIGS
    for cfg in args.configs_list:
        for T in args.tokens_list:
            for split in args.splits:
                per = {side: [] for side in sides}
                for rec in rounds:
                    for side in sides:
                        found = [
                            e
                            for e in rec[side]["shapes"]
                            if (e["config"], e["T"], e["split"]) == (cfg, T, split)
                        ]
                        per[side].append(found[0] if found else {})
                ms = {side: [e.get("ms") for e in per[side]] for side in sides}
                inputs = [e["inputs"] for side in sides for e in per[side] if "inputs" in e]
                row = {"config": configs[cfg][0], "T": T, "split": split}
                for side in sides:
                    row[f"{side}_ms"] = ms[side]
                    row[f"{side}_median_ms"] = median([m for m in ms[side] if m])
                for side in sides[1:]:
                    ratios = [a / x if a and x else None for a, x in zip(ms["a"], ms[side])]
                    row[ratio_key(side, "ratios")] = ratios
                    row[ratio_key(side, "median_ratio")] = median([r for r in ratios if r])
                for side in sides:
                    # the SM clock (MHz) each side ran at, its median over rounds (NVML)
                    row[f"{side}_sm_clock_mhz"] = median(
                        [e["clocks"]["sm_clock_mhz"] for e in per[side] if "clocks" in e]
                    )
                for side in sides:
                    row[f"{side}_rel_err"] = per[side][0].get("rel_err")
                # None: no run of this shape got as far as its inputs
                row["inputs_identical"] = all(i == inputs[0] for i in inputs) if inputs else None
                row["errors"] = {
                    side: sorted({e["error"] for e in per[side] if "error" in e}) for side in sides
                }
                rows.append(row)
    return rows


def median(xs):
    return statistics.median(xs) if xs else None


def table(rows, sides, mode):
    def ms(key):
        return lambda r: harness.fmt_ms(r[key]) if r[key] else ""

    # MXFP8 outputs are compared with grouped-mm on the unquantized inputs (quantizing costs ~7%).
    limit = flash_moe.MXFP8_ERR_FLAG if mode == "mxfp8" else flash_moe.ERR_FLAG
    flagged = harness.rel_err_column(limit).cell

    def err(key):
        return lambda r: flagged({"rel_err": r[key]})

    def per_round(key):
        return lambda r: " ".join(harness.fmt(x, ".3f", "-") for x in r[key])

    cols = [
        harness.value_column("config", "config"),
        harness.value_column("T", "T"),
        harness.value_column("split", "split"),
        *(harness.Column(f"{side.upper()} ms", ms(f"{side}_median_ms")) for side in sides),
    ]
    for side in sides[1:]:
        name = f"A/{side.upper()}"
        cols.append(harness.Column(f"{name} per round", per_round(ratio_key(side, "ratios"))))
        cols.append(harness.value_column(f"median {name}", ratio_key(side, "median_ratio"), ".3f"))
    cols.append(
        harness.Column(
            " / ".join(side.upper() for side in sides) + " MHz",
            lambda r: " / ".join(
                harness.fmt(r[f"{side}_sm_clock_mhz"], ".0f", "-") for side in sides
            ),
        )
    )
    cols += [harness.Column(f"{side.upper()} rel err", err(f"{side}_rel_err")) for side in sides]
    return harness.text_table(cols, rows)


def self_test_trees():
    """(A, B, C, scratch): this tree, and two temporary ones whose prime_kernels links to it, so
    the children import the same code from three different PYTHONPATHs."""
    scratch = Path(tempfile.mkdtemp(prefix="ab-self-test-"))
    for name in "bc":
        (scratch / name).mkdir()
        (scratch / name / "prime_kernels").symlink_to(harness.ROOT / "prime_kernels")
    return harness.ROOT, scratch / "b", scratch / "c", scratch


def round_order(sides, i):
    """Round i's order: the sides rotated by i (A B, B A, ... for two)."""
    shift = i % len(sides)
    return sides[shift:] + sides[:shift]


def check_self_test(args, doc, sides):
    problems = []
    rows = doc["shapes"]
    if len(rows) != len(args.configs_list) * len(args.tokens_list) * len(args.splits):
        problems.append(f"{len(rows)} summary rows")
    for r in rows:
        where = f"{r['config']} T={r['T']} split={r['split']}"
        for side in sides[1:]:
            ratios, med = r[ratio_key(side, "ratios")], r[ratio_key(side, "median_ratio")]
            if not (all(ratios) and len(ratios) == args.rounds and med):
                problems.append(f"{where}: A/{side.upper()} ratios {ratios}")
        errs = [r[f"{side}_rel_err"] for side in sides]
        if any(e != 0.0 for e in errs):
            problems.append(f"{where}: rel errs {errs}")
        if r["inputs_identical"] is not True:
            problems.append(f"{where}: the builds saw different inputs")
    orders = [rec["order"] for rec in doc["rounds"]]
    if orders != [round_order(sides, i) for i in range(args.rounds)]:
        problems.append(f"orders {orders}")
    for rec in doc["rounds"]:
        for side in sides:
            got = rec[side]
            imported = Path(got.get("build", {}).get("prime_kernels", "/nonexistent"))
            if not imported.exists() or not os.path.samefile(
                imported.parent.parent, doc["meta"][side]["path"]
            ):
                problems.append(f"round {rec['round']} {side} imported {imported}")
            if got.get("check") != (rec["round"] == 0):
                problems.append(f"round {rec['round']} {side}: checked {got.get('check')}")
    if json.loads(Path(args.json).read_text())["shapes"] != json.loads(harness.json_text(rows)):
        problems.append("the JSON file differs from the summary")
    return problems


def parent(args):
    scratch = None
    if args.self_test:
        a, b, c, scratch = self_test_trees()
        args.json = args.json or str(scratch / "ab.json")
        paths = {"a": a, "b": b, "c": c}
    else:
        given = {"a": args.a, "b": args.b, "c": args.c, "d": args.d}
        paths = {side: Path(p).resolve() for side, p in given.items() if p}
    sides = list(paths)
    out_dir = os.environ.get("OUT")
    json_path = args.json or (os.path.join(out_dir, "ab.json") if out_dir else None)
    meta = harness.run_meta(args.argv)
    meta.update(
        {
            side: {"path": str(p), "commit": harness.git_commit(p, built_first=True)}
            for side, p in paths.items()
        },
        rounds=args.rounds,
        configs=args.configs_list,
        tokens=args.tokens_list,
        splits=args.splits,
        mode=args.mode,
        seed=args.seed,
        warmup_ms=args.warmup_ms,
        rep_ms=args.rep_ms,
        self_test=args.self_test,
    )
    log(
        f"{meta['date']} | "
        + " | ".join(f"{side.upper()} {p} ({meta[side]['commit']})" for side, p in paths.items())
    )
    log(f"command: {meta['command']}")
    doc = {"meta": meta, "rounds": [], "shapes": [], "geomean_ratio": None}
    for i in range(args.rounds):
        order = round_order(sides, i)
        rec = {"round": i, "order": order}
        for side in order:
            log(f"round {i + 1}/{args.rounds}: {side.upper()} ({paths[side]})")
            rec[side] = run_child(args, paths[side], check=i == 0)
        doc["rounds"].append(rec)
        if json_path:  # after every round: a run cut short still leaves its numbers
            harness.write_json(json_path, doc)
    rows = summarize(args, doc["rounds"], sides)
    doc["shapes"] = rows
    log("")
    log(table(rows, sides, args.mode))
    for side in sides[1:]:
        med = ratio_key(side, "median_ratio")
        doc[ratio_key(side, "geomean_ratio")] = harness.geomean([r[med] for r in rows])
        doc[ratio_key(side, "geomean_ratio_by_split")] = {
            str(s): harness.geomean([r[med] for r in rows if r["split"] == s]) for s in args.splits
        }
        n = sum(1 for r in rows if r[med])
        name = f"A/{side.upper()}"
        log(
            f"geometric mean of the median {name} over {n} shapes: "
            f"{harness.fmt(doc[ratio_key(side, 'geomean_ratio')], '.3f', 'n/a')} "
            f"(above 1: {side.upper()} is faster)"
        )
        for s, g in doc[ratio_key(side, "geomean_ratio_by_split")].items():
            log(f"  split={s}: {harness.fmt(g, '.3f', 'n/a')}")
    failed = [
        f"round {rec['round'] + 1} {side.upper()}: {rec[side]['error']}"
        for rec in doc["rounds"]
        for side in sides
        if rec[side].get("error")
    ]
    mismatched = [f"{r['config']} T={r['T']}" for r in rows if r["inputs_identical"] is False]
    for line in failed:
        log(f"failed: {line}")
    if mismatched:
        log(f"the builds did not see the same inputs at: {', '.join(sorted(set(mismatched)))}")
    if json_path:
        harness.write_json(json_path, doc)
        log(f"wrote {json_path}")
    if args.self_test:
        problems = check_self_test(args, doc, sides)
        harness.self_test_verdict(
            problems, scratch, f"{len(rows)} shapes, {len(sides)} builds, {args.rounds} rounds"
        )
    return 1 if failed or mismatched else 0


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        # stdout carries the child's JSON alone (without --child-out); its log goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            rc, doc = child(args)
        if args.child_out:
            Path(args.child_out).write_text(harness.json_text(doc))
        else:
            print(harness.json_text(doc), end="")
        sys.exit(rc)
    sys.exit(parent(args))


if __name__ == "__main__":
    main()
