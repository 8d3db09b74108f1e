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
``<!-- /flash_moe:forward -->`` (the rest of the file is left as it is), and, where $OUT
is set, $OUT/flash_moe_bench.json (raw numbers), $OUT/RESULTS.md (the updated file) and
$OUT/flash_moe_sections.md (this run's sections alone, for ``--merge`` on another
checkout). ``--self-test`` runs the whole pipeline on CPU at a toy shape.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # an installed prime_kernels comes first

import peers  # noqa: E402

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
ERR_FLAG = 2e-2  # relative error vs grouped-mm above which a row is flagged
SELF_TEST_CONFIGS = {"toy": ("toy", 128, 64, 8, 2)}
SELF_TEST_TOKENS = (16, 64)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"configs {','.join(QUICK_CONFIGS)}, T in {QUICK_TOKENS}, shorter timing",
    )
    p.add_argument("--configs", help=f"comma list of {','.join(CONFIGS)}")
    p.add_argument("--tokens", help=f"comma list of T (default {','.join(map(str, TOKENS))})")
    p.add_argument(
        "--results",
        default=str(HERE / "RESULTS.md"),
        help="markdown file whose flash_moe sections this run rewrites",
    )
    p.add_argument("--no-results", action="store_true", help="write no results file")
    p.add_argument(
        "--section",
        help="marker name (default forward / backward; "
        "forward-quick / backward-quick with --quick)",
    )
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
    p.add_argument("--warmup-ms", type=float, help="do_bench warmup (default 25, quick 10)")
    p.add_argument("--rep-ms", type=float, help="do_bench rep (default 100, quick 40)")
    p.add_argument(
        "--budget-s",
        type=float,
        help="stop timing new rows after this many seconds and write what ran "
        "(default 520, quick 170)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the raw numbers here (default $OUT/...)")
    p.add_argument(
        "--merge",
        metavar="SECTIONS_MD",
        help="only merge the flash_moe sections of this file into --results, then exit",
    )
    p.add_argument(
        "--self-test",
        action="store_true",
        help="CPU dry run at a toy shape (grouped-mm stands in for ours)",
    )
    args = p.parse_args(argv)
    args.argv = list(sys.argv if argv is None else ["benchmarks/flash_moe.py", *argv])
    if args.self_test:
        args.configs_list = list(SELF_TEST_CONFIGS)
        args.tokens_list = list(SELF_TEST_TOKENS)
    else:
        names = (
            args.configs.split(",")
            if args.configs
            else (list(QUICK_CONFIGS) if args.quick else list(CONFIGS))
        )
        out = []
        for name in names:
            key = ALIASES.get(name.strip().lower(), name.strip().lower())
            if key not in CONFIGS:
                p.error(f"unknown config {name!r}; known: {', '.join(CONFIGS)}")
            out.append(key)
        args.configs_list = out
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
    args.warmup_ms = args.warmup_ms or (10.0 if args.quick else 25.0)
    args.rep_ms = args.rep_ms or (40.0 if args.quick else 100.0)
    args.budget_s = args.budget_s or (170.0 if args.quick else 520.0)
    return args


# --------------------------------------------------------------------------- results file


def _marker(name):
    return f"<!-- flash_moe:{name} -->", f"<!-- /flash_moe:{name} -->"


def replace_section(text: str, name: str, body: str) -> str:
    """``text`` with the section ``name`` (markers included) replaced by ``body`` (or
    appended when absent); everything outside the markers is kept byte for byte."""
    begin, end = _marker(name)
    block = f"{begin}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text, count=1)
    if text and not text.endswith("\n"):
        text += "\n"
    return f"{text}\n{block}\n" if text else f"# Benchmark results\n\n{block}\n"


def read_sections(text: str) -> dict[str, str]:
    found = re.findall(r"<!-- flash_moe:([\w.-]+) -->\n(.*?)\n<!-- /flash_moe:\1 -->", text, re.S)
    return dict(found)


def write_results(path: Path, sections: dict[str, str]) -> str:
    text = path.read_text() if path.exists() else ""
    for name, body in sections.items():
        text = replace_section(text, name, body)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


# --------------------------------------------------------------------------- formatting


def fmt(v, spec=".3f", none=""):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    return format(v, spec)


def fmt_ms(ms):
    return fmt(ms, ".4f" if ms < 0.1 else ".3f")


def geomean(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def table_columns(rows, mode):
    impls = []
    for r in rows:
        if r["kind"] != "ours" and r["impl"] not in impls:
            impls.append(r["impl"])
    cols = ["config", "T", "impl", "ms", "TFLOP/s", "of dense"]
    if mode == "fwd":
        cols += ["weight GB/s", "of copy"]
    else:
        cols += ["peak GB", "extra GB"]
    cols += [f"x vs {name}" for name in impls] + ["rel err"]
    return cols, impls


def row_cells(r, impls, mode):
    err = r.get("rel_err")
    err_s = fmt(err, ".2e")
    if err is not None and err > ERR_FLAG:
        err_s += " (!)"
    cells = [
        r["config"],
        str(r["T"]),
        r["impl"],
        fmt_ms(r["ms"]),
        fmt(r["tflops"], ".1f"),
        fmt(r["frac_dense"], ".1%"),
    ]
    if mode == "fwd":
        cells += [fmt(r.get("weight_gbps"), ".0f"), fmt(r.get("frac_copy"), ".1%")]
    else:
        cells += [fmt(r.get("peak_gb"), ".2f"), fmt(r.get("extra_gb"), ".2f")]
    cells += [fmt(r["speedup"].get(name), ".2f") for name in impls]
    cells.append(err_s)
    return cells


def text_table(rows, mode):
    if not rows:
        return "(no rows)"
    cols, impls = table_columns(rows, mode)
    body = [row_cells(r, impls, mode) for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(out)


def md_table(rows, mode):
    if not rows:
        return "(no rows)"
    cols, impls = table_columns(rows, mode)
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    out += ["| " + " | ".join(row_cells(r, impls, mode)) + " |" for r in rows]
    return "\n".join(out)


def geomeans(rows):
    """For every ours row-kind: geometric mean of (other ms / ours ms) over shapes where both
    ran, over T in LARGE_T and over all T."""
    out = []
    ours = [n for n in dict.fromkeys(r["impl"] for r in rows if r["kind"] == "ours")]
    others = [n for n in dict.fromkeys(r["impl"] for r in rows if r["kind"] != "ours")]
    for o in ours:
        for other in others:
            ratios_all, ratios_large = [], []
            for r in rows:
                if r["impl"] != o or other not in r["speedup"]:
                    continue
                ratios_all.append(r["speedup"][other])
                if r["T"] in LARGE_T:
                    ratios_large.append(r["speedup"][other])
            if ratios_all:
                out.append(
                    {
                        "ours": o,
                        "vs": other,
                        "large_T": geomean(ratios_large),
                        "n_large": len(ratios_large),
                        "all": geomean(ratios_all),
                        "n_all": len(ratios_all),
                    }
                )
    return out


def geomean_lines(gms):
    lines = []
    for g in gms:
        large = (
            f"{g['large_T']:.2f}x over T in {{{', '.join(map(str, LARGE_T))}}} "
            f"({g['n_large']} shapes)"
            if g["large_T"]
            else "no large-T shapes"
        )
        lines.append(
            f"{g['ours']} vs {g['vs']}: {large}; {g['all']:.2f}x over all ({g['n_all']} shapes)"
        )
    return lines


# --------------------------------------------------------------------------- measuring


class Timer:
    def __init__(self, device, warmup_ms, rep_ms):
        self.device = device
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms

    def sync(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def median_ms(self, fn):
        if self.device.type == "cuda":
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median"))
        # CPU (self-test): wall clock, median of a few calls after one warm-up
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return times[len(times) // 2]


def _gemm_ms(timer, device, n):
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return timer.median_ms(lambda: torch.matmul(a, b))


def _copy_ms(timer, device, nbytes):
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return timer.median_ms(lambda: dst.copy_(src))


def measure_ceilings(timer, device, self_test):
    n = 256 if self_test else 8192
    gemm_ms = _gemm_ms(timer, device, n)
    nbytes = (64 << 20) if self_test else (2 << 30)
    copy_ms = _copy_ms(timer, device, nbytes)
    free_memory(device)
    return {
        "gemm_n": n,
        "gemm_ms": gemm_ms,
        "gemm_tflops": 2 * n**3 / (gemm_ms * 1e-3) / 1e12,
        "copy_bytes": nbytes,
        "copy_ms": copy_ms,
        "copy_gbps": 2 * nbytes / (copy_ms * 1e-3) / 1e9,
    }


def free_memory(device):
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def context_alive(device):
    import torch

    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        torch.empty(1, device=device).add_(1)
        torch.cuda.synchronize(device)
        return True
    except Exception:
        return False


def git_commit():
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        if head:
            return head + ("-dirty" if dirty.strip() else "")
    except Exception:
        pass
    env = os.environ.get("PRIME_KERNELS_COMMIT")
    if env:
        return env
    try:
        import prime_kernels

        built = prime_kernels.build_info().get("git_commit")
        if built:
            return f"{built[:12]} (build info)"
    except Exception:
        pass
    return "unknown"


# --------------------------------------------------------------------------- the run


def load_impls(args, device, log):
    """[(impl or None, name, reason)] in table order: ours, grouped-mm, peers."""
    impls = []
    if not args.no_ours:
        if args.self_test:
            impls.append((SelfTestOurs(True), "ours split=True", None))
            impls.append((SelfTestOurs(False), "ours split=False", None))
        else:
            try:
                import prime_kernels

                reason = prime_kernels.unavailable_reason("flash_moe")
                if reason is None:
                    fm = prime_kernels.load("flash_moe")
                    impls.append((peers.Ours(fm, True), "ours split=True", None))
                    impls.append((peers.Ours(fm, False), "ours split=False", None))
                else:
                    log(f"ours: skipped: {reason}")
                    impls.append((None, "ours", reason))
            except Exception as exc:
                reason = f"prime_kernels not importable ({peers._first_line(exc)})"
                log(f"ours: skipped: {reason}")
                impls.append((None, "ours", reason))
    impls.append((peers.GroupedMM(), "grouped-mm", None))  # always: the reference
    if not args.tune_peers:
        os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")
    for name in args.peer_list:
        if name == "grouped-mm":
            continue
        if device.type != "cuda":
            impls.append((None, name, "needs a CUDA device"))
            continue
        try:
            impl = peers.Liger() if name == "liger" else peers.Sonic(tuned=args.tune_peers)
            impls.append((impl, impl.name, None))
            log(f"{impl.name}: {impl.note}")
        except peers.Skip as exc:
            log(f"{name}: skipped: {exc}")
            impls.append((None, name, str(exc)))
    impls.append((None, "vllm", peers.VLLM_REASON))
    return impls


class SelfTestOurs(peers.Impl):
    """CPU stand-in for ours in --self-test: the grouped-mm path under another name."""

    kind = "ours"

    def __init__(self, split):
        from prime_kernels.flash_moe import reference

        self.ref = reference.moe_grouped_mm
        self.name = f"ours split={split}"

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


def make_routing(reference, T, E, k, device, gen):
    import torch

    if hasattr(reference, "routing"):
        return reference.routing(T, E, k, generator=gen, device=device)
    logits = torch.randn(T, E, generator=gen, device=device)
    wts, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return ids.to(torch.int32), (wts / wts.sum(-1, keepdim=True)).float()


def run(args):
    import torch

    from prime_kernels.flash_moe import reference

    started = time.time()
    device = torch.device("cpu" if args.self_test else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run this on the GPU machine, or use --self-test on CPU")
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    peers.activate_pth_files()
    timer = Timer(device, args.warmup_ms, args.rep_ms)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": gpu or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": git_commit(),
        "command": " ".join(shlex.quote(a) for a in args.argv),
        "versions": peers.peer_versions(),
        "tune_peers": args.tune_peers,
        "warmup_ms": args.warmup_ms,
        "rep_ms": args.rep_ms,
        "self_test": args.self_test,
    }
    log(f"{meta['date']} | {meta['gpu']} | torch {meta['torch']} | commit {meta['commit']}")
    log(f"command: {meta['command']}")

    ceilings = measure_ceilings(timer, device, args.self_test)
    log(
        f"ceilings: dense bf16 GEMM {ceilings['gemm_n']}^3 {ceilings['gemm_tflops']:.1f} "
        f"TFLOP/s; device copy {ceilings['copy_gbps']:.0f} GB/s (read + written, "
        f"{ceilings['copy_bytes'] / 2**30:.2f} GiB)"
    )

    impls = load_impls(args, device, log)
    skips = [{"impl": name, "reason": reason} for impl, name, reason in impls if impl is None]
    live = [impl for impl, _, _ in impls if impl is not None]
    fwd_rows, bwd_rows = [], []
    configs = SELF_TEST_CONFIGS if args.self_test else CONFIGS
    out_of_time = False
    dead = False

    def over_budget():
        nonlocal out_of_time
        if not out_of_time and time.time() - started > args.budget_s:
            out_of_time = True
            log(f"budget of {args.budget_s:.0f} s spent: skipping the remaining rows")
        return out_of_time

    def skip(impl_name, cfg, T, reason):
        log(f"  {impl_name}: skipped at {cfg} T={T}: {reason}")
        skips.append({"impl": impl_name, "config": cfg, "T": T, "reason": reason})

    try:
        for cfg_key in args.configs_list:
            if over_budget() or dead:
                break
            label, D, H, E, k = configs[cfg_key]
            gen = torch.Generator(device=device).manual_seed(args.seed)
            w = (torch.randn(E, 2 * H, D, generator=gen, device=device) * 0.05).to(torch.bfloat16)
            w2 = (torch.randn(E, D, H, generator=gen, device=device) * 0.05).to(torch.bfloat16)
            log(f"== {label}: D={D} H={H} E={E} k={k}")
            states, broken = {}, {}
            for impl in live:
                try:
                    states[impl.name] = impl.prepare(w, w2)
                except peers.Skip as exc:
                    broken[impl.name] = str(exc)
                    skip(impl.name, label, "all", str(exc))
            for T in args.tokens_list:
                if over_budget() or dead:
                    break
                x = (torch.randn(T, D, generator=gen, device=device) * 0.2).to(torch.bfloat16)
                ids, wts = make_routing(reference, T, E, k, device, gen)
                e_active = int(torch.unique(ids).numel())
                flops = 6.0 * T * k * D * H
                wbytes = e_active * 3.0 * D * H * 2
                ref_out = None
                shape_rows = []
                # grouped-mm first: its output is what every other row is checked against
                for impl in sorted(live, key=lambda i: i.kind != "baseline"):
                    if impl.name in broken or over_budget():
                        continue
                    row, err = time_forward(
                        impl, states, x, ids, wts, w, w2, ref_out, timer, reference, log
                    )
                    if row is None:
                        skip(impl.name, label, T, err)
                        if not context_alive(device):
                            dead = True
                            log("the CUDA context is gone (a sticky error): stopping here")
                            break
                        broken[impl.name] = err
                        continue
                    if impl.kind == "baseline":
                        ref_out = row.pop("out")
                    row.pop("out", None)
                    row.update(
                        config=label,
                        D=D,
                        H=H,
                        E=E,
                        k=k,
                        T=T,
                        impl=impl.name,
                        kind=impl.kind,
                        e_active=e_active,
                        mode="fwd",
                    )
                    row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
                    row["frac_dense"] = row["tflops"] / ceilings["gemm_tflops"]
                    if T <= WEIGHT_READ_MAX_T:
                        row["weight_gbps"] = wbytes / (row["ms"] * 1e-3) / 1e9
                        row["frac_copy"] = row["weight_gbps"] / ceilings["copy_gbps"]
                    shape_rows.append(row)
                    log(
                        f"  T={T:<6} {impl.name:<18} {fmt_ms(row['ms']):>9} ms "
                        f"{row['tflops']:7.1f} TFLOP/s  first call {row['first_call_s']:.1f} s"
                        f"  rel err {fmt(row.get('rel_err'), '.2e', 'n/a')}"
                    )
                rank = {impl.name: i for i, impl in enumerate(live)}
                shape_rows.sort(key=lambda r: rank[r["impl"]])
                add_speedups(shape_rows)
                fwd_rows += shape_rows
                if args.backward and not dead and not over_budget():
                    bwd_rows += time_backward(
                        live,
                        states,
                        broken,
                        x,
                        ids,
                        wts,
                        w,
                        w2,
                        timer,
                        reference,
                        device,
                        log,
                        label,
                        dict(D=D, H=H, E=E, k=k, T=T, flops=3 * flops),
                        ceilings,
                        skip,
                        over_budget,
                    )
                del x, ids, wts, ref_out
                free_memory(device)
            del w, w2, states
            free_memory(device)
    finally:
        result = finish(args, meta, ceilings, skips, fwd_rows, bwd_rows, started, log)
    return result


def _first_call(fn, timer):
    t0 = time.perf_counter()
    out = fn()
    timer.sync()
    return out, time.perf_counter() - t0


def time_forward(impl, states, x, ids, wts, w, w2, ref_out, timer, reference, log):
    """(row dict with ms, first_call_s, rel_err, out) or (None, reason)."""
    state = states[impl.name]
    try:
        fn = impl.forward(state, x, ids, wts)
        try:
            out, first = _first_call(fn, timer)
        except Exception as exc:
            if isinstance(impl, peers.Sonic) and impl.inference:
                log(
                    f"  {impl.name}: is_inference_mode_enabled=True failed "
                    f"({peers._first_line(exc)}); retrying with False"
                )
                impl.inference = False
                out, first = _first_call(fn, timer)
            else:
                raise
        err = reference.relative_error(out, ref_out) if ref_out is not None else None
        if (
            isinstance(impl, peers.Sonic)
            and impl.concat
            and err is not None
            and err > 10 * ERR_FLAG
        ):
            log(
                f"  {impl.name}: concat_layout=True gives rel err {err:.2e}; "
                "trying interleaved gate/up rows"
            )
            impl.concat = False
            states[impl.name] = state = impl.prepare(w, w2)
            fn = impl.forward(state, x, ids, wts)
            out, first = _first_call(fn, timer)
            err = reference.relative_error(out, ref_out)
        ms = timer.median_ms(fn)
    except peers.Skip as exc:
        return None, str(exc)
    except Exception as exc:
        return None, peers._first_line(exc)
    row = {"ms": ms, "first_call_s": first, "rel_err": err, "out": out}
    if isinstance(impl, peers.Sonic):
        row["note"] = f"concat_layout={impl.concat}, is_inference_mode_enabled={impl.inference}"
    return row, None


def add_speedups(shape_rows):
    times = {r["impl"]: r["ms"] for r in shape_rows}
    for r in shape_rows:
        r["speedup"] = {
            name: ms / r["ms"]
            for name, ms in times.items()
            if name != r["impl"] and not (r["kind"] == "ours" and name.startswith("ours"))
        }


def time_backward(
    live,
    states,
    broken,
    x,
    ids,
    wts,
    w,
    w2,
    timer,
    reference,
    device,
    log,
    label,
    shape,
    ceilings,
    skip,
    over_budget,
):
    import torch

    T = shape["T"]
    grad_out = (torch.randn(x.shape, device=device) * 0.1).to(x.dtype)
    rows, ref_grads = [], None
    # grouped-mm first: its gradients are the reference
    order = sorted(live, key=lambda i: i.kind != "baseline")
    seen_ours = False
    for impl in order:
        if impl.name in broken or over_budget():
            continue
        if impl.kind == "ours":
            if seen_ours:  # one backward row for ours: moe() has no split choice
                continue
            seen_ours = True
        name = "ours" if impl.kind == "ours" else impl.name
        try:
            fn = impl.forward_backward(states[impl.name], x, w, w2, ids, wts, grad_out)
            grads, first = _first_call(fn, timer)
            err = None
            if ref_grads is not None:
                err = max(reference.relative_error(g, r) for g, r in zip(grads, ref_grads))
            elif impl.kind == "baseline":
                ref_grads = grads
            del grads
            peak = extra = None
            if device.type == "cuda":
                free_memory(device)
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                fn()
                torch.cuda.synchronize(device)
                peak = torch.cuda.max_memory_allocated(device) / 1e9
                extra = peak - base / 1e9
            ms = timer.median_ms(fn)
        except peers.Skip as exc:
            skip(f"{name} (fwd+bwd)", label, T, str(exc))
            continue
        except Exception as exc:
            skip(f"{name} (fwd+bwd)", label, T, peers._first_line(exc))
            if not context_alive(device):
                break
            continue
        tflops = shape["flops"] / (ms * 1e-3) / 1e12
        row = {
            "config": label,
            **{k: shape[k] for k in ("D", "H", "E", "k", "T")},
            "impl": name,
            "kind": impl.kind,
            "mode": "fwd+bwd",
            "ms": ms,
            "first_call_s": first,
            "tflops": tflops,
            "frac_dense": tflops / ceilings["gemm_tflops"],
            "peak_gb": peak,
            "extra_gb": extra,
            "rel_err": err,
        }
        rows.append(row)
        log(
            f"  T={T:<6} {name + ' fwd+bwd':<18} {fmt_ms(ms):>9} ms {tflops:7.1f} TFLOP/s"
            f"  peak {fmt(peak, '.2f', 'n/a')} GB  grad rel err {fmt(err, '.2e', 'n/a')}"
        )
    rank = {impl.name: i for i, impl in enumerate(live)}
    rank["ours"] = -1
    rows.sort(key=lambda r: rank.get(r["impl"], len(rank)))
    add_speedups(rows)
    del ref_grads
    free_memory(device)
    return rows


def section_md(title, meta, ceilings, rows, mode, skips, notes):
    v = meta["versions"]
    peer_v = ", ".join(
        f"{n} {v[n]}"
        for n in ("liger-kernel", "sonic-moe", "quack-kernels", "nvidia-cutlass-dsl")
        if v.get(n)
    )
    out = [
        f"## {title}",
        "",
        f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · commit "
        f"`{meta['commit']}`" + (f" · {peer_v}" if peer_v else ""),
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Ceilings measured in this run: dense bf16 GEMM ({ceilings['gemm_n']}³, "
        f"torch.matmul, random data) **{ceilings['gemm_tflops']:.1f} TFLOP/s**; "
        f"device-to-device copy **{ceilings['copy_gbps']:.0f} GB/s** (bytes read + "
        f"written, {ceilings['copy_bytes'] / 2**30:g} GiB).",
        "",
        f"Median of CUDA-event timings (triton do_bench, L2 flushed, warmup "
        f"{meta['warmup_ms']:g} ms, rep {meta['rep_ms']:g} ms). Peers "
        f"{'autotuned' if meta['tune_peers'] else 'not autotuned (their default configs)'}. "
        "`x vs P` = P's ms / this row's ms (above 1: this row is faster). "
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
        + f"; (!) marks > {ERR_FLAG:g}.",
        "",
        md_table(rows, mode),
        "",
    ]
    gms = geomeans(rows)
    if gms:
        out += ["Geometric means of the speedup:", ""]
        out += [f"- {line}" for line in geomean_lines(gms)]
        out.append("")
    if notes:
        out += [f"- {n}" for n in notes]
        out.append("")
    if skips:
        out += ["Skipped:", ""]
        for s in skips:
            where = f" ({s['config']}, T={s['T']})" if "config" in s else ""
            out.append(f"- {s['impl']}{where}: {s['reason']}")
        out.append("")
    return "\n".join(out)


def finish(args, meta, ceilings, skips, fwd_rows, bwd_rows, started, log):
    elapsed = time.time() - started
    log("")
    log("forward:")
    log(text_table(fwd_rows, "fwd"))
    for line in geomean_lines(geomeans(fwd_rows)):
        log(line)
    if args.backward:
        log("")
        log("forward + backward:")
        log(text_table(bwd_rows, "bwd"))
        for line in geomean_lines(geomeans(bwd_rows)):
            log(line)
    log(f"total {elapsed:.0f} s")
    notes = sorted({f"{r['impl']}: {r['note']}" for r in fwd_rows if r.get("note")})
    suffix = "-quick" if args.quick and not args.section else ""
    fwd_name = args.section or f"forward{suffix}"
    sections = {
        fwd_name: section_md(
            "flash_moe forward" + (" (quick)" if suffix else ""),
            meta,
            ceilings,
            fwd_rows,
            "fwd",
            [s for s in skips if "(fwd+bwd)" not in s["impl"]],
            notes,
        )
    }
    if args.backward:
        bwd_name = (args.section + "-backward") if args.section else f"backward{suffix}"
        sections[bwd_name] = section_md(
            "flash_moe forward + backward" + (" (quick)" if suffix else ""),
            meta,
            ceilings,
            bwd_rows,
            "bwd",
            [s for s in skips if "(fwd+bwd)" in s["impl"]],
            [],
        )
    result = {
        "meta": meta,
        "ceilings": ceilings,
        "skips": skips,
        "forward": fwd_rows,
        "backward": bwd_rows,
        "geomeans": {"forward": geomeans(fwd_rows), "backward": geomeans(bwd_rows)},
        "elapsed_s": elapsed,
    }
    out_dir = os.environ.get("OUT")
    if not args.no_results:
        text = write_results(Path(args.results), sections)
        log(f"wrote sections {', '.join(sections)} of {args.results}")
        if out_dir:
            Path(out_dir, "RESULTS.md").write_text(text)
    if out_dir:
        Path(out_dir, "flash_moe_sections.md").write_text(
            "\n\n".join(
                f"{_marker(n)[0]}\n{b.rstrip()}\n{_marker(n)[1]}" for n, b in sections.items()
            )
            + "\n"
        )
    json_path = args.json or (os.path.join(out_dir, "flash_moe_bench.json") if out_dir else None)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1, default=str))
        log(f"wrote {json_path}")
    return result


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        sections = read_sections(Path(args.merge).read_text())
        if not sections:
            sys.exit(f"no flash_moe sections in {args.merge}")
        write_results(Path(args.results), sections)
        print(f"merged sections {', '.join(sections)} into {args.results}")
        return
    run(args)


if __name__ == "__main__":
    main()
