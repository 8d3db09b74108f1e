"""What every op's benchmark shares: timing (Timer, Budget), ceilings, the run's
environment, memory helpers, the timing loop over implementations (Session), tables,
geometric means, the results-file sections, the raw JSON, the common command-line flags
and the checks a self-test makes of what a run wrote.

A benchmark's rows are dicts with at least ``impl`` (the name in the table), ``kind``
(``"ours"``, ``"baseline"`` or ``"peer"``), ``config``, ``T`` (tokens), ``ms`` and, after
:func:`add_speedups`, ``speedup`` (``{other impl: other ms / this ms}``). Rows of one peer
timed at several settings share ``peer`` (the peer's name): the others' speedups then also
hold ``"<peer> at its best"``, against the fastest of those rows of the shape (only where every
setting ran in it). The results file
is markdown whose op sections sit between ``<!-- OP:NAME -->`` and ``<!-- /OP:NAME -->``;
a run rewrites its own sections and leaves every other byte of the file as it was.

Nothing here imports torch or triton at module level, so a parent process that only
orchestrates (benchmarks/ab.py) stays light.
"""

from __future__ import annotations

import datetime
import gc
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS_DIR = HERE / "results"  # raw numbers of full runs, one JSON per op and section


class Skip(Exception):
    """An implementation cannot run here; str() is the one-line reason."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def log(msg=""):
    print(msg, flush=True)


# --------------------------------------------------------------------------- timing

# NVML's clock-event reasons (nvmlClocksEventReason*): the software power cap, and the slowdowns
# for heat or a power brake.
POWER_CAP_REASON = 0x4
THERMAL_REASONS = 0x8 | 0x20 | 0x40 | 0x80


class GpuClocks:
    """The SM clock, board power and clock-event reasons of the timed GPU, sampled by NVML
    every ``period_s`` in a background thread while a measurement runs (``with``): a forward
    at prefill sizes runs at the power cap, where the clock, not the code, moves a row by
    5-10% between runs. ``summary()``: ``sm_clock_mhz`` and ``power_w`` (medians),
    ``power_capped`` and ``thermal`` (fractions of samples with those reasons), ``samples``;
    None on CPU, without NVML (nvidia-ml-py), or with no sample taken."""

    def __init__(self, device, period_s: float = 0.02):
        self.device = device
        self.period_s = period_s
        self.samples = []
        self._handle = None
        self._thread = None
        self._stop = None
        if getattr(device, "type", None) != "cuda":
            return
        try:
            import pynvml
            import torch

            pynvml.nvmlInit()
            # torch's own mapping from a CUDA device to its NVML index (CUDA_VISIBLE_DEVICES).
            index = torch.cuda._get_nvml_device_index(device)
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
            # the name before nvidia-ml-py 12.535: ...ThrottleReasons
            self._reasons = getattr(
                pynvml,
                "nvmlDeviceGetCurrentClocksEventReasons",
                getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None),
            )
        except Exception:
            self._handle = None

    def _sample(self):
        nvml = self._nvml
        clock = nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_SM)
        power = nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0
        reasons = self._reasons(self._handle)
        self.samples.append((clock, power, reasons))

    def _run(self):
        while not self._stop.wait(self.period_s):
            try:
                self._sample()
            except Exception:
                return

    def __enter__(self):
        if self._handle is not None:
            import threading

            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        return False

    def summary(self):
        if not self.samples:
            return None
        clocks, powers, reasons = zip(*self.samples)
        return {
            "sm_clock_mhz": statistics.median(clocks),
            "power_w": round(statistics.median(powers), 1),
            "power_capped": round(
                sum(bool(r & POWER_CAP_REASON) for r in reasons) / len(reasons), 3
            ),
            "thermal": round(sum(bool(r & THERMAL_REASONS) for r in reasons) / len(reasons), 3),
            "samples": len(reasons),
        }


def merge_clocks(summaries):
    """One summary from several measurements' (rounds of a row): medians of their medians and
    the mean of their fractions; None where none has samples."""
    summaries = [c for c in summaries if c]
    if not summaries:
        return None
    return {
        "sm_clock_mhz": statistics.median(c["sm_clock_mhz"] for c in summaries),
        "power_w": round(statistics.median(c["power_w"] for c in summaries), 1),
        "power_capped": round(statistics.fmean(c["power_capped"] for c in summaries), 3),
        "thermal": round(statistics.fmean(c["thermal"] for c in summaries), 3),
        "samples": sum(c["samples"] for c in summaries),
    }


class Timer:
    """Median of CUDA-event timings through triton's do_bench, which zeroes a buffer larger
    than L2 before every call, so each call reads its inputs from HBM. On CPU (self-tests
    only) the wall-clock median of five calls after one warm-up. ``rounds``: how many
    interleaved rounds Session.time_shape takes the median of (runs drift by 5-10%)."""

    def __init__(self, device, warmup_ms: float, rep_ms: float, rounds: int = 1):
        self.device = device
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms
        self.rounds = max(1, rounds)
        self.last_clocks = None  # GpuClocks.summary() of the last median_ms

    def sync(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def first_call(self, fn):
        """(fn's result, seconds to it): the first call pays for autotuning, JIT and
        workspace allocation, which the median leaves out."""
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - t0

    def median_ms(self, fn) -> float:
        """The median; ``last_clocks`` then holds the GPU's clocks while it ran."""
        self.last_clocks = None
        if self.device.type == "cuda":
            from triton.testing import do_bench

            with GpuClocks(self.device) as clocks:
                ms = do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")
            self.last_clocks = clocks.summary()
            return float(ms)
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return times[len(times) // 2]

    def method(self) -> dict:
        if self.device.type == "cuda":
            return {
                "method": "triton.testing.do_bench (CUDA events)",
                "statistic": "median",
                "warmup_ms": self.warmup_ms,
                "rep_ms": self.rep_ms,
                "l2_flush": True,
                "interleaved_rounds": self.rounds,
            }
        return {
            "method": "time.perf_counter, 5 calls after 1 warm-up",
            "statistic": "median",
            "l2_flush": False,
            "interleaved_rounds": self.rounds,
        }


def timing_sentence(meta) -> str:
    rounds = meta.get("timing", {}).get("interleaved_rounds", 1)
    over = (
        f"Median over {rounds} interleaved rounds (every implementation of a shape timed once "
        "per round, the order reversed every other round) of the median"
        if rounds > 1
        else "Median"
    )
    return (
        f"{over} of CUDA-event timings (triton do_bench, L2 flushed, warmup "
        f"{meta['warmup_ms']:g} ms, rep {meta['rep_ms']:g} ms)."
    )


SPEEDUP_LEGEND = "`x vs P` = P's ms / this row's ms (above 1: this row is faster)."


def interrupt_on_sigterm():
    """Makes SIGTERM (what a time limit such as ``timeout`` sends first) raise
    KeyboardInterrupt, as Ctrl-C does, so that a run's ``finally`` still writes the rows
    timed so far; from the main thread only."""
    import signal

    signal.signal(signal.SIGTERM, signal.default_int_handler)


class Budget:
    """Wall-clock allowance of a run: once spent, no new row starts, and the rows already
    timed are still written (a device session has a hard per-command limit)."""

    def __init__(self, seconds: float, started: float):
        self.seconds = seconds
        self.started = started
        self.spent = False

    def over(self) -> bool:
        if not self.spent and time.time() - self.started > self.seconds:
            self.spent = True
            log(f"budget of {self.seconds:.0f} s spent: skipping the remaining rows")
        return self.spent


# --------------------------------------------------------------------------- ceilings


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


def measure_ceilings(timer, device, small: bool) -> dict:
    """This machine's dense bf16 GEMM rate and device-to-device copy bandwidth (bytes read
    plus written), measured in the same run as the rows they are fractions of."""
    n = 256 if small else 8192
    gemm_ms = _gemm_ms(timer, device, n)
    nbytes = (64 << 20) if small else (2 << 30)
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


def ceilings_line(c) -> str:
    return (
        f"ceilings: dense bf16 GEMM {c['gemm_n']}^3 {c['gemm_tflops']:.1f} "
        f"TFLOP/s; device copy {c['copy_gbps']:.0f} GB/s (read + written, "
        f"{c['copy_bytes'] / 2**30:.2f} GiB)"
    )


def ceilings_sentence(c) -> str:
    return (
        f"Ceilings measured in this run: dense bf16 GEMM ({c['gemm_n']}³, "
        f"torch.matmul, random data) **{c['gemm_tflops']:.1f} TFLOP/s**; "
        f"device-to-device copy **{c['copy_gbps']:.0f} GB/s** (bytes read + "
        f"written, {c['copy_bytes'] / 2**30:g} GiB)."
    )


# --------------------------------------------------------------------------- memory


def standalone_timer(parser, argv=None):
    """For a benchmark script of its own: adds --self-test (CPU, toy shapes, no timing
    claims), --warmup-ms and --rep-ms to ``parser`` and parses ``argv``. Returns (args,
    device, Timer)."""
    import torch

    parser.add_argument("--self-test", action="store_true")
    parser.add_argument("--warmup-ms", type=float, default=10.0)
    parser.add_argument("--rep-ms", type=float, default=50.0)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.self_test else "cuda")
    return args, device, Timer(device, args.warmup_ms, args.rep_ms)


def free_memory(device):
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def context_alive(device) -> bool:
    """False once the CUDA context has a sticky error (an illegal address, a trap): every
    later launch in this process would fail too."""
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


def memory_gb(fn, device) -> dict:
    """What one call of fn allocates, in GB (1e9 bytes), from torch's allocator statistics
    (tensors only, not the allocator's cache): ``peak_gb`` the peak allocated during the
    call; ``extra_gb`` that peak minus what was allocated just before it, so whatever the
    process held before the call (weights, inputs, leaves, reference outputs) is excluded;
    ``held_gb`` what is still allocated after the call while its result is alive, minus the
    same base (a training forward: its output and what autograd saved for the backward; a
    step: the gradients). All None off CUDA."""
    import torch

    if device.type != "cuda":
        return {"peak_gb": None, "extra_gb": None, "held_gb": None}
    free_memory(device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - base
    del out
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_gb": peak / 1e9, "extra_gb": (peak - base) / 1e9, "held_gb": held / 1e9}


# --------------------------------------------------------------------------- environment


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(root, *args):
    return subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
    )


def built_record(root) -> str | None:
    """The commit (``-dirty`` where so) the build in place under ``root`` recorded (setup.py's
    build info)."""
    try:
        built = json.loads((Path(root) / "prime_kernels" / "_build_info.json").read_text())
    except (OSError, ValueError):
        return None
    return built.get("git_commit") or None


def built_commit(root) -> str | None:
    """The build's record, labelled as such."""
    built = built_record(root)
    return f"{built[:12]} (build info)" if built else None


def git_commit(root=ROOT, built_first=False) -> str:
    """PRIME_KERNELS_COMMIT when set (a copy of the tree whose .git is not its own);
    else the short HEAD (``-dirty`` with tracked changes) of the git checkout whose top is
    ``root``, naming the build's commit too where the extension in place was built from
    another (a copied .so, a stale checkout); else (a tree inside another checkout, or one
    without .git) the commit its build recorded. ``built_first``: the build's record before all
    of these (ab.py's trees, each built with its own PRIME_KERNELS_COMMIT, timed under one
    environment)."""
    root = Path(root)
    built = built_commit(root) if built_first else None
    if built:
        return built
    env = os.environ.get("PRIME_KERNELS_COMMIT")
    if env:
        return env
    try:
        top = _git(root, "rev-parse", "--show-toplevel")
        if top.returncode == 0 and os.path.samefile(top.stdout.strip(), root):
            head = _git(root, "rev-parse", "HEAD").stdout.strip()
            dirty = _git(root, "status", "--porcelain", "--untracked-files=no").stdout
            if head:
                label = head[:7] + ("-dirty" if dirty.strip() else "")
                built = built_record(root)
                if built and built.split("-")[0] != head:
                    label += f" (extension built from {built[:12]})"
                return label
    except (OSError, subprocess.SubprocessError):
        pass
    return built_commit(root) or "unknown"


def gpu_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def run_meta(argv, root=ROOT) -> dict:
    """What a run is, without touching a device: date, the exact command, commit, Python."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(shlex.quote(a) for a in argv),
        "commit": git_commit(root),
        "python": platform.python_version(),
        "executable": sys.executable,
        "cwd": os.getcwd(),
    }


def device_meta(device) -> dict:
    import torch

    cuda = device.type == "cuda"
    return {
        "gpu": (torch.cuda.get_device_name(device) if cuda else platform.processor()) or "cpu",
        "driver": gpu_driver() if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": package_version("triton"),
    }


def environment(device, argv, timer, root=ROOT) -> dict:
    return {
        **run_meta(argv, root),
        **device_meta(device),
        "timing": timer.method(),
        "warmup_ms": timer.warmup_ms,
        "rep_ms": timer.rep_ms,
    }


def impls_meta(impls) -> dict:
    """Each implementation's kind, note and settings; read at the end of a run, since an
    implementation may change a setting during it (``recover``)."""
    return {i.name: {"kind": i.kind, "note": i.note, "settings": i.settings()} for i in impls}


def header_line(meta) -> str:
    return f"{meta['date']} | {meta['gpu']} | torch {meta['torch']} | commit {meta['commit']}"


# --------------------------------------------------------------------------- numbers


def fmt(v, spec=".3f", none=""):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    return format(v, spec)


def fmt_ms(ms):
    return fmt(ms, ".4f" if ms < 0.1 else ".3f")


def geomean(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _positive(ms) -> bool:
    return ms is not None and math.isfinite(ms) and ms > 0


def best_name(peer: str) -> str:
    return f"{peer} at its best"


def peer_settings(rows) -> dict[str, list[str]]:
    """``{best_name(peer): [impl, ...]}`` for every peer that rows show at several settings."""
    settings = {}
    for r in rows:
        if r.get("peer"):
            settings.setdefault(r["peer"], {})[r["impl"]] = None  # a dict keeps row order
    return {best_name(peer): list(impls) for peer, impls in settings.items() if len(impls) > 1}


def add_speedups(shape_rows):
    """Sets each row's ``speedup`` against every other row of the same shape; our variants
    are not compared with each other, and a time that is not a positive number (a
    difference row's, see :func:`difference_rows`) is compared with nothing. Where a peer
    ran at several settings, rows other than that peer's are also compared with its fastest
    (:func:`peer_settings`)."""
    times = {r["impl"]: r["ms"] for r in shape_rows if _positive(r["ms"])}
    best = {
        name: (impls, min(times[i] for i in impls))
        for name, impls in peer_settings(shape_rows).items()
        if all(i in times for i in impls)
    }
    for r in shape_rows:
        r["speedup"] = (
            {
                name: ms / r["ms"]
                for name, ms in times.items()
                if name != r["impl"] and not (r["kind"] == "ours" and name.startswith("ours"))
            }
            if _positive(r["ms"])
            else {}
        )
        if r["speedup"]:
            for name, (impls, ms) in best.items():
                if r["impl"] not in impls:
                    r["speedup"][name] = ms / r["ms"]


def difference_rows(total_rows, part_rows, mode, derive=None):
    """Rows of one shape whose time is one measured row's minus another's, per
    implementation: e.g. the backward as (forward + backward) - (training forward), each
    term the median of its own rounds. ``{**where, impl, kind, mode, ms, total_ms,
    part_ms}`` plus the total row's ``rel_err`` (and ``rel_errs``, ``note``) and what
    ``derive(row)`` returns; speedups set. A difference that is not positive (noise on a
    tiny shape) is kept as NaN with a note, and neither derives rates nor compares."""
    parts = {r["impl"]: r for r in part_rows}
    measured = {
        "ms",
        "ms_rounds",
        "clocks",
        "speedup",
        "first_call_s",
        "peak_gb",
        "extra_gb",
        "held_gb",
    }
    rows = []
    for total in total_rows:
        part = parts.get(total["impl"])
        if part is None:
            continue
        # the total's shape, impl and errors; not its time, memory or rates
        drop = measured | (set(derive(total)) if derive else set())
        row = {k: v for k, v in total.items() if k not in drop}
        ms = total["ms"] - part["ms"]
        row.update(mode=mode, total_ms=total["ms"], part_ms=part["ms"], ms=ms)
        if ms > 0:
            if derive:
                row.update(derive(row))
        else:
            row["ms"] = float("nan")
            row["note"] = (
                f"{total['mode']} {fmt_ms(total['ms'])} ms <= {part['mode']} "
                f"{fmt_ms(part['ms'])} ms: no difference to report"
            )
        rows.append(row)
    add_speedups(rows)
    return rows


def geomeans(rows, large_T):
    """For every ours impl and every impl its rows have speedups against (the other kinds,
    and another of ours where the benchmark compared the two): geometric mean of the speedup
    over the shapes where both ran, over T in ``large_T`` and over all T."""
    out = []
    ours = list(dict.fromkeys(r["impl"] for r in rows if r["kind"] == "ours"))
    names = list(dict.fromkeys(r["impl"] for r in rows)) + list(peer_settings(rows))
    for o in ours:
        for other in names:
            ratios_all, ratios_large = [], []
            for r in rows:
                if r["impl"] != o or other not in r["speedup"]:
                    continue
                ratios_all.append(r["speedup"][other])
                if r["T"] in large_T:
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


def geomean_lines(gms, large_T):
    lines = []
    for g in gms:
        large = (
            f"{g['large_T']:.2f}x over T in {{{', '.join(map(str, large_T))}}} "
            f"({g['n_large']} shapes)"
            if g["large_T"]
            else "no large-T shapes"
        )
        lines.append(
            f"{g['ours']} vs {g['vs']}: {large}; {g['all']:.2f}x over all ({g['n_all']} shapes)"
        )
    return lines


# --------------------------------------------------------------------------- the run


class Session:
    """One run: its device, timer and budget, what was skipped and why, and whether the
    CUDA context still works (after a sticky error every later launch fails, so the run
    stops there and writes what it has).

    The implementations it times have ``name``, ``kind``, ``recover(failure=None,
    rel_err=None)`` (None, or a line saying which setting it changed so that one more try
    may work) and ``row_note(mode)`` (None or a line for their rows of that mode);
    benchmarks/peers.py's ``Impl`` is the model."""

    def __init__(self, device, timer, budget: Budget):
        self.device = device
        self.timer = timer
        self.budget = budget
        self.skips = []
        self.dead = False

    def stopped(self) -> bool:
        return self.dead or self.budget.over()

    def skip(self, impl, reason, config=None, T=None, mode=None):
        if config is None:
            log(f"{impl}: skipped: {reason}")
            self.skips.append({"impl": impl, "reason": reason})
            return
        log(f"  {impl}: skipped at {config} T={T}: {reason}")
        self.skips.append({"impl": impl, "config": config, "T": T, "mode": mode, "reason": reason})

    def check_context(self):
        if not self.dead and not context_alive(self.device):
            self.dead = True
            log("the CUDA context is gone (a sticky error): stopping here")
        return not self.dead

    def _measure(self, impl, make, error, ref, memory, recover):
        """(row, output); the output only when it becomes the reference (the first
        baseline's), else it is freed before the peak memory and the timing."""
        fn = make(impl)
        try:
            out, first = self.timer.first_call(fn)
        except Exception as exc:
            note = impl.recover(failure=exc) if recover else None
            if not note:
                raise
            log(f"  {impl.name}: {note}")
            fn = make(impl)
            out, first = self.timer.first_call(fn)
        errs = error(out, ref) if ref is not None else None
        err = max_error(errs)
        note = impl.recover(rel_err=err) if recover and err is not None else None
        if note:
            log(f"  {impl.name}: {note}")
            fn = make(impl)
            out, first = self.timer.first_call(fn)
            errs = error(out, ref)
            err = max_error(errs)
        if impl.kind != "baseline" or ref is not None:
            out = None
        elif hasattr(out, "detach"):
            out = out.detach()  # the reference needs no autograd graph (a training forward's)
        row = {"first_call_s": first, "rel_err": err}
        if isinstance(errs, dict):
            row["rel_errs"] = errs
        if memory:
            row.update(memory_gb(fn, self.device))
        row["ms"] = self.timer.median_ms(fn)
        row["clock_rounds"] = [self.timer.last_clocks]
        return row, out, fn

    def time_shape(
        self,
        impls,
        where,
        mode,
        make,
        error,
        broken,
        derive=None,
        name=None,
        memory=False,
        recover=True,
    ):
        """The rows of one shape, in the order of ``impls``, speedups set: ``{**where, impl,
        kind, mode, ms, first_call_s, rel_err}`` (and ``peak_gb``, ``extra_gb``, ``held_gb``
        with ``memory``, see :func:`memory_gb`; ``note`` where the impl has one for this
        mode; what ``derive(row)`` returns: the rates); each row is logged as it is done.
        ``where`` holds ``config`` and ``T``.

        The baseline runs first: every later output is scored against its output with
        ``error(out, ref)``, a float or a dict of named errors (several outputs, e.g. the
        gradients of a step: the row keeps the dict as ``rel_errs`` and its largest value,
        None values left out, as ``rel_err``); the baseline's output is kept detached from
        any autograd graph. ``make(impl)`` returns the zero-argument callable to time; an
        impl whose ``make``, first call or timing raises is skipped with the reason and
        added to ``broken`` (name: reason), which this call also reads. ``name(impl)``
        renames rows; impls sharing a name get one row, the first's. ``recover`` lets an
        impl change a setting after a failed or clearly wrong first call."""
        name = name or (lambda impl: impl.name)
        order = list(dict.fromkeys(name(impl) for impl in impls))
        label = "" if mode == "fwd" else f" ({mode})"
        rows, ref, seen, timed = [], None, set(), []
        for impl in sorted(impls, key=lambda i: i.kind != "baseline"):
            row_name = name(impl)
            if impl.name in broken or row_name in seen or self.stopped():
                continue
            seen.add(row_name)
            try:
                row, out, fn = self._measure(impl, make, error, ref, memory, recover)
            except Exception as exc:
                reason = str(exc) if isinstance(exc, Skip) else first_line(exc)
                self.skip(row_name + label, reason, where["config"], where["T"], mode)
                broken[impl.name] = reason
                if not self.check_context():
                    break
                continue
            if out is not None:
                ref = out
            del out
            row = {**where, "impl": row_name, "kind": impl.kind, "mode": mode, **row}
            if getattr(impl, "peer", None):
                row["peer"] = impl.peer
            note = impl.row_note(mode)
            if note:
                row["note"] = note
            row["ms_rounds"] = [row["ms"]]
            rows.append(row)
            timed.append((row, fn))
        # Further rounds over every implementation that ran, the order reversed every other
        # round so that none always runs first; each row keeps the median of its rounds.
        for r in range(1, self.timer.rounds):
            if self.stopped():
                break
            for row, fn in timed[::-1] if r % 2 else timed:
                try:
                    row["ms_rounds"].append(self.timer.median_ms(fn))
                    row["clock_rounds"].append(self.timer.last_clocks)
                except Exception as exc:
                    log(f"  {row['impl']}: round {r + 1} failed: {first_line(exc)}")
                    if not self.check_context():
                        break
        del timed
        for row in rows:
            row["ms"] = statistics.median(row["ms_rounds"])
            clocks = merge_clocks(row.pop("clock_rounds"))
            if clocks:
                row["clocks"] = clocks
            if derive:
                row.update(derive(row))
            log(row_line(row))
        rows.sort(key=lambda r: order.index(r["impl"]))
        add_speedups(rows)
        return rows


def max_error(errs):
    """The largest of a dict of errors (None values left out), or the float itself."""
    if isinstance(errs, dict):
        values = [v for v in errs.values() if v is not None]
        return max(values) if values else None
    return errs


def row_line(r) -> str:
    rate = f" {r['tflops']:7.1f} TFLOP/s" if "tflops" in r else ""
    peak = ""
    if "peak_gb" in r:
        peak = (
            f"  peak {fmt(r['peak_gb'], '.2f', 'n/a')} GB, extra {fmt(r['extra_gb'], '.2f', 'n/a')}"
        )
        peak += f", held {fmt(r['held_gb'], '.2f', 'n/a')}"
    first = f"  first call {r['first_call_s']:.1f} s" if "first_call_s" in r else ""
    clocks = ""
    if r.get("clocks"):
        c = r["clocks"]
        clocks = (
            f"  {c['sm_clock_mhz']:.0f} MHz {c['power_w']:.0f} W, capped {c['power_capped']:.0%}"
        )
    return (
        f"  T={r['T']:<6} {r['impl']:<18} {r['mode']:<9} {fmt_ms(r['ms']):>9} ms{rate}"
        f"{first}  rel err {fmt(r['rel_err'], '.2e', 'n/a')}{peak}{clocks}"
    )


# --------------------------------------------------------------------------- tables


class Column(NamedTuple):
    header: str
    cell: Callable[[dict], str]


def value_column(header, key, spec=""):
    return Column(header, lambda r: fmt(r.get(key), spec))


MS_COLUMN = Column("ms", lambda r: fmt_ms(r["ms"]))


def speedup_columns(rows):
    """One ``x vs P`` column per impl that is not ours, in row order, then one per peer at its
    best where it ran at several settings."""
    names = list(dict.fromkeys(r["impl"] for r in rows if r["kind"] != "ours"))
    names += list(peer_settings(rows))
    return [
        Column(f"x vs {name}", lambda r, name=name: fmt(r["speedup"].get(name), ".2f"))
        for name in names
    ]


def rel_err_column(flag):
    """``flag``: the error above which a row is marked (!), or a function of the row giving
    it (rows held to different bars)."""

    def cell(r):
        err = r.get("rel_err")
        s = fmt(err, ".2e")
        limit = flag(r) if callable(flag) else flag
        return s + " (!)" if err is not None and err > limit else s

    return Column("rel err", cell)


def text_table(columns, rows):
    if not rows:
        return "(no rows)"
    body = [[c.cell(r) for c in columns] for r in rows]
    widths = [max(len(c.header), *(len(b[i]) for b in body)) for i, c in enumerate(columns)]
    line = "  ".join(c.header.ljust(w) for c, w in zip(columns, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(s.ljust(w) for s, w in zip(b, widths)) for b in body]
    return "\n".join(out)


def log_table(title, columns, rows, large_T):
    log()
    log(f"{title}:")
    log(text_table(columns, rows))
    for line in geomean_lines(geomeans(rows, large_T), large_T):
        log(line)


def md_table(columns, rows):
    if not rows:
        return "(no rows)"
    out = [
        "| " + " | ".join(c.header for c in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    out += ["| " + " | ".join(c.cell(r) for c in columns) + " |" for r in rows]
    return "\n".join(out)


# --------------------------------------------------------------------------- results file


def marker(op, name):
    return f"<!-- {op}:{name} -->", f"<!-- /{op}:{name} -->"


def replace_section(text: str, op: str, name: str, body: str) -> str:
    """``text`` with the section ``name`` (markers included) replaced by ``body`` (or
    appended when absent); everything outside the markers is kept byte for byte."""
    begin, end = marker(op, name)
    block = f"{begin}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text, count=1)
    if text and not text.endswith("\n"):
        text += "\n"
    return f"{text}\n{block}\n" if text else f"# Benchmark results\n\n{block}\n"


def read_sections(text: str, op: str) -> dict[str, str]:
    found = re.findall(
        rf"<!-- {re.escape(op)}:([\w.-]+) -->\n(.*?)\n<!-- /{re.escape(op)}:\1 -->", text, re.S
    )
    return dict(found)


def write_sections(path: Path, op: str, sections: dict[str, str]) -> str:
    text = path.read_text() if path.exists() else ""
    for name, body in sections.items():
        text = replace_section(text, op, name, body)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def sections_text(op: str, sections: dict[str, str]) -> str:
    """The sections alone, with their markers: what ``--merge`` reads on another checkout."""
    blocks = []
    for name, body in sections.items():
        begin, end = marker(op, name)
        blocks.append(f"{begin}\n{body.rstrip()}\n{end}")
    return "\n\n".join(blocks) + "\n"


def section_md(title, meta, ceilings, legend, table, gm_lines, notes, skips, packages, more=()):
    """One results section: provenance (date, GPU, torch, commit, the versions of
    ``packages`` that are installed), the command, the ceilings, ``legend``, the table, the
    geometric means, notes, ``more`` (markdown blocks: further tables of the same run) and
    what was skipped and why."""
    v = meta["versions"]
    peer_v = ", ".join(f"{n} {v[n]}" for n in packages if v.get(n))
    out = [
        f"## {title}",
        "",
        f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · commit "
        f"`{meta['commit']}`" + (f" · {peer_v}" if peer_v else ""),
        "",
        f"Command: `{meta['command']}`",
        "",
        ceilings_sentence(ceilings),
        "",
        legend,
        "",
        table,
        "",
    ]
    if gm_lines:
        out += ["Geometric means of the speedup:", ""]
        out += [f"- {line}" for line in gm_lines]
        out.append("")
    if notes:
        out += [f"- {n}" for n in notes]
        out.append("")
    for block in more:
        out += [block.rstrip(), ""]
    if skips:
        out += ["Skipped:", ""]
        for s in skips:
            where = f" ({s['config']}, T={s['T']})" if "config" in s else ""
            out.append(f"- {s['impl']}{where}: {s['reason']}")
        out.append("")
    return "\n".join(out)


# --------------------------------------------------------------------------- JSON


def _strict(obj):
    """NaN and infinities as strings: json.dumps would write bare NaN, which is not JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def json_text(obj) -> str:
    return json.dumps(_strict(obj), indent=1, default=str) + "\n"


def write_json(path, obj):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json_text(obj))


_NON_FINITE = {str(v): v for v in (math.nan, math.inf, -math.inf)}


def _relaxed(obj):
    """The inverse of _strict: "nan", "inf" and "-inf" back to floats (a backward row's NaN
    time, which a run that reads raw numbers back, --combine, formats as a number)."""
    if isinstance(obj, str):
        return _NON_FINITE.get(obj, obj)
    if isinstance(obj, dict):
        return {k: _relaxed(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_relaxed(v) for v in obj]
    return obj


def read_json(path):
    """A JSON that write_json wrote, its non-finite numbers floats again."""
    return _relaxed(json.loads(Path(path).read_text()))


# --------------------------------------------------------------------------- command line


def add_run_args(p, op, quick_help, warmup_ms, rep_ms, budget_s):
    """The flags every op's benchmark has; ``warmup_ms``, ``rep_ms`` and ``budget_s`` are
    (default, --quick default) pairs."""
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument(
        "--results",
        help=f"markdown file whose {op} sections this run rewrites (default benchmarks/RESULTS.md)",
    )
    p.add_argument(
        "--results-json",
        help="raw numbers of this run, written with the results file (default "
        f"benchmarks/results/{op}.json, or {op}-SECTION.json for another section)",
    )
    p.add_argument("--no-results", action="store_true", help="write no results files")
    p.add_argument(
        "--section",
        help="marker name of the run's first section, the others named NAME-SECTION "
        "(default: the op's section names, with -quick appended under --quick)",
    )
    p.add_argument(
        "--warmup-ms",
        type=float,
        help=f"do_bench warmup (default {warmup_ms[0]:g}, quick {warmup_ms[1]:g})",
    )
    p.add_argument(
        "--rep-ms", type=float, help=f"do_bench rep (default {rep_ms[0]:g}, quick {rep_ms[1]:g})"
    )
    p.add_argument(
        "--rounds",
        type=int,
        help="interleaved rounds per shape, the median kept (default 3, quick 1)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        help="stop timing new rows after this many seconds and write what ran "
        f"(default {budget_s[0]:g}, quick {budget_s[1]:g})",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the raw numbers here (default $OUT/...)")
    p.add_argument(
        "--merge",
        metavar="SECTIONS_MD",
        help=f"only merge the {op} sections of this file into --results, then exit",
    )


def finish_run_args(args, op, argv, script, sections, warmup_ms, rep_ms, budget_s, plain_json=True):
    """Fills in what add_run_args left open: timing defaults, ``args.sections`` (base name
    in ``sections``: marker name), the results paths and ``args.argv``. The results JSON
    is named after the first section's marker (``OP-NAME.json``), or ``OP.json`` when that
    marker is its default name and ``plain_json`` (the op's main run)."""
    args.argv = list(sys.argv if argv is None else [script, *argv])
    pick = 1 if args.quick else 0
    args.warmup_ms = args.warmup_ms or warmup_ms[pick]
    args.rep_ms = args.rep_ms or rep_ms[pick]
    args.budget_s = args.budget_s or budget_s[pick]
    args.rounds = args.rounds or (1 if args.quick else 3)
    suffix = "-quick" if args.quick and not args.section else ""
    first = sections[0]
    args.sections = {
        base: (args.section if base == first else f"{args.section}-{base}")
        if args.section
        else f"{base}{suffix}"
        for base in sections
    }
    args.results = args.results or str(HERE / "RESULTS.md")
    name = args.sections[first]
    args.results_json = args.results_json or str(
        RESULTS_DIR / (f"{op}.json" if name == first and plain_json else f"{op}-{name}.json")
    )


def merge(args, op):
    sections = read_sections(Path(args.merge).read_text(), op)
    if not sections:
        sys.exit(f"no {op} sections in {args.merge}")
    write_sections(Path(args.results), op, sections)
    log(f"merged sections {', '.join(sections)} into {args.results}")


def publish(op, args, sections, doc, bench_extra):
    """Writes this run's sections into the results file and ``doc`` into the results JSON
    (unless --no-results), and where $OUT is set copies of both to bring back, the sections
    alone (for --merge) and ``{**doc, **bench_extra}`` as $OUT/OP_bench.json (or --json)."""
    out_dir = os.environ.get("OUT")
    if not args.no_results:
        text = write_sections(Path(args.results), op, sections)
        log(f"wrote sections {', '.join(sections)} of {args.results}")
        write_json(args.results_json, doc)
        log(f"wrote {args.results_json}")
        if out_dir:
            Path(out_dir, "RESULTS.md").write_text(text)
            write_json(Path(out_dir, Path(args.results_json).name), doc)
    if out_dir:
        Path(out_dir, f"{op}_sections.md").write_text(sections_text(op, sections))
    json_path = args.json or (os.path.join(out_dir, f"{op}_bench.json") if out_dir else None)
    if json_path:
        write_json(json_path, {**doc, **bench_extra})
        log(f"wrote {json_path}")


# --------------------------------------------------------------------------- self-tests


def self_test_paths(args, scratch=None):
    """Points the results files of a --self-test away from the repository's own (a toy run
    must never overwrite them), into a temporary directory holding a copy of RESULTS.md, so
    that the rewrite is checked against a file with other sections; returns (directory,
    the results file's text before the run). A later run of the same self-test passes the
    first's directory and writes into the same files."""
    scratch = Path(scratch) if scratch else Path(tempfile.mkdtemp(prefix="self-test-"))
    real = HERE / "RESULTS.md"
    if Path(args.results).resolve() == real.resolve():
        args.results = str(scratch / "RESULTS.md")
        if real.exists() and not Path(args.results).exists():
            shutil.copyfile(real, args.results)
    if Path(args.results_json).resolve().parent == RESULTS_DIR.resolve():
        args.results_json = str(scratch / "results" / Path(args.results_json).name)
    results = Path(args.results)
    return scratch, (results.read_text() if results.exists() else "")


def check_written(op, args, doc, original, scratch, merge_cli):
    """Problems with the files a run wrote: the results JSON has ``doc``'s rows and the
    meta and ceilings every run records; the results file has this run's sections and every
    other byte of ``original``; ``merge_cli(sections_md, results_md)`` (the op's --merge)
    rebuilds the same file from the sections alone."""
    problems = []
    if args.no_results:
        return problems
    saved = read_json(args.results_json)
    if len(saved["rows"]) != len(doc["rows"]):
        problems.append("results JSON: row count")
    meta_keys = ("date", "gpu", "driver", "commit", "command", "torch", "triton", "python")
    for key in (*meta_keys, "timing", "versions", "peers"):
        if key not in saved["meta"]:
            problems.append(f"results JSON: meta.{key}")
    if not {"gemm_tflops", "copy_gbps"} <= set(saved["ceilings"]):
        problems.append("results JSON: ceilings")
    text = Path(args.results).read_text()
    sections = read_sections(text, op)
    if not set(args.sections.values()) <= set(sections):
        problems.append("results file: this run's sections")
    expected = original
    for name, body in sections.items():
        expected = replace_section(expected, op, name, body)
    if text != expected:
        problems.append("results file: bytes outside this run's sections changed")
    sections_md, merged = Path(scratch, "sections.md"), Path(scratch, "merged.md")
    sections_md.write_text(sections_text(op, sections))
    merged.write_text(original)
    merge_cli(str(sections_md), str(merged))
    if merged.read_text() != text:
        problems.append("--merge of the sections alone gives another file")
    return problems


def self_test_verdict(problems, scratch, summary):
    if problems:
        sys.exit(f"self-test FAILED (files kept in {scratch}):\n- " + "\n- ".join(problems))
    shutil.rmtree(scratch)
    log(f"self-test passed: {summary}")
