"""fused_moe_bf16 on the GPU against reference.py with CONTRACT.md's bars: relative error
<= 1.5e-2 against the grouped-mm path, and an error against the fp32 expert loop at most
1.5x the grouped-mm path's own; over shapes, routings, both split modes."""

from __future__ import annotations

import pytest
import torch

from prime_kernels.flash_moe import reference

from .test_moe_align import make_ids

pytestmark = pytest.mark.gpu

BAR = 1.5e-2
RATIO_TO_REFERENCE = 1.5


def make_inputs(T, D, H, E, k, kind, generator, device="cuda"):
    x = (0.2 * torch.randn(T, D, generator=generator)).bfloat16()
    w = (0.05 * torch.randn(E, 2 * H, D, generator=generator)).bfloat16()
    w2 = (0.05 * torch.randn(E, D, H, generator=generator)).bfloat16()
    ids = make_ids(kind, T, E, k, generator)
    weights = torch.rand(T, k, generator=generator) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    return [t.to(device) for t in (x, w, w2, ids, weights)]


def run_ours(flash_moe, x, w, w2, ids, weights, *, split, block_m=None, **tuning):
    block_m = block_m or flash_moe.BLOCK_M
    E, k = w.shape[0], ids.shape[1]
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, E, block_m)
    # split=True must overwrite every element: poison it with NaN.
    out = torch.full_like(x, float("nan")) if split else torch.zeros_like(x)
    result = flash_moe.fused_moe_bf16(
        x,
        w,
        w2,
        sorted_ids,
        expert_ids,
        total,
        weights,
        out,
        k,
        block_m=block_m,
        split=split,
        **tuning,
    )
    assert result is out
    return out


def check(flash_moe, inputs, *, split, **tuning):
    x, w, w2, ids, weights = inputs
    out = run_ours(flash_moe, *inputs, split=split, **tuning)
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output elements"
    ref = reference.moe_grouped_mm(x, w, w2, ids, weights)
    truth = reference.moe_expert_loop_fp32(x, w, w2, ids, weights)
    if truth.norm() == 0:  # every pair dropped
        assert (out == 0).all()
        return out
    error = reference.relative_error(out, ref)
    ours_vs_truth = reference.relative_error(out, truth)
    ref_vs_truth = reference.relative_error(ref, truth)
    assert error <= BAR, f"relative error {error:.3e} against the grouped-mm path"
    assert ours_vs_truth <= RATIO_TO_REFERENCE * ref_vs_truth + 1e-6, (
        f"error against fp32 {ours_vs_truth:.3e} > {RATIO_TO_REFERENCE} x the grouped-mm "
        f"path's {ref_vs_truth:.3e}"
    )
    return out


# (T, D, H, E, k, routing): the contract test's shape first, then the grid of the issue.
CASES = [
    (512, 256, 128, 4, 2, "uniform"),
    (1, 256, 128, 8, 2, "uniform"),
    (7, 512, 256, 8, 2, "uniform"),
    (1000, 1024, 512, 128, 8, "uniform"),
    (4096, 512, 256, 8, 1, "uniform"),
    (1000, 256, 128, 1, 1, "uniform"),
    (1000, 512, 256, 256, 8, "zipf"),
    (1000, 512, 256, 64, 4, "one_expert"),
    (1000, 512, 256, 16, 2, "empty_experts"),
    (1000, 512, 256, 16, 2, "dropped"),
    (300, 64, 64, 8, 2, "uniform"),
    (300, 64, 192, 8, 2, "zipf"),
    (64, 2048, 768, 128, 8, "uniform"),
    (300, 512, 256, 32, 16, "uniform"),  # k > 8: the combine's second batch of 8 pairs
    (600, 256, 128, 64, 16, "zipf"),
]


@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
@pytest.mark.parametrize(("T", "D", "H", "E", "k", "kind"), CASES)
def test_against_reference(flash_moe, seed, split, T, D, H, E, k, kind):
    generator = torch.Generator().manual_seed(seed)
    check(flash_moe, make_inputs(T, D, H, E, k, kind, generator), split=split)


@pytest.mark.sanitize
def test_stale_rows_in_the_workspace(flash_moe, seed):
    """At decode sizes the inference forward leaves its pair -> row map unfilled and the combine
    checks each row against the routing. A first call leaves its rows in the cached workspace
    the second call gets back; with 30% of the pairs dropped there, those rows must not count."""
    generator = torch.Generator().manual_seed(seed)
    first = make_inputs(64, 512, 256, 16, 4, "uniform", generator)
    second = first[:3] + make_inputs(64, 512, 256, 16, 4, "dropped", generator)[3:]
    run_ours(flash_moe, *first, split=True)
    check(flash_moe, second, split=True)


@pytest.mark.sanitize
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
@pytest.mark.parametrize(
    ("T", "D", "H", "E", "k", "kind"),
    [
        (37, 128, 64, 4, 2, "uniform"),
        (9, 64, 128, 3, 1, "dropped"),
        (50, 128, 128, 8, 8, "zipf"),
    ],
)
def test_small_shapes_for_sanitizer(flash_moe, seed, split, T, D, H, E, k, kind):
    generator = torch.Generator().manual_seed(seed)
    check(flash_moe, make_inputs(T, D, H, E, k, kind, generator), split=split)


@pytest.mark.sanitize
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
@pytest.mark.parametrize("H", [192, 128], ids=["whole-96-tiles", "partial-96-tile"])
def test_large_tile_for_sanitizer(flash_moe, seed, split, H):
    """The ping-pong gate/up tile (block_n=96, with the ping-pong down tile), which small shapes
    do not pick by themselves, under the sanitizers; H = 128 leaves the second 96-wide gate/up
    tile partial."""
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs(300, 256, H, 4, 2, "uniform", generator)
    check(flash_moe, inputs, split=split, block_n=96, warp_n=0)


@pytest.mark.parametrize("block_n", [None, 64, 128])
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_block_m_64(flash_moe, seed, split, block_n):
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs(700, 512, 256, 16, 4, "zipf", generator)
    check(flash_moe, inputs, split=split, block_m=64, block_n=block_n)


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_partial_last_n_tile(flash_moe, seed, split, block_m):
    """gpt-oss's D = H = 2880 with block_n = 128: the gate/up GEMM's last n tile holds 64 of
    128 columns, the down GEMM's (256 wide) 64 of 256."""
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs(200, 2880, 2880, 8, 4, "uniform", generator)
    check(flash_moe, inputs, split=split, block_m=block_m, block_n=128)


@pytest.mark.sanitize
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
@pytest.mark.parametrize(
    ("T", "H", "E", "k"), [(1000, 256, 32, 8), (225, 2048, 9, 4)], ids=["pairs", "odd-blocks"]
)
def test_clustered_gate_up(flash_moe, seed, monkeypatch, capfd, split, T, H, E, k):
    """Up to 256 rows an expert the cooperative 128 x (128 + 128) gate/up tile runs in 2-CTA
    clusters (cpc = 2), the weight tile multicast to both CTAs where the pair's blocks share an
    expert, each copying its own where they do not, and a pair's missing tile (an odd count of
    blocks) passing its stages empty."""
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs(T, 256, H, E, k, "uniform", generator)
    monkeypatch.setenv("PRIME_MOE_PRINT_CONFIG", "1")
    check(flash_moe, inputs, split=split)
    printed = capfd.readouterr().err
    assert "cpc=2 " in printed and "2-CTA clusters" in printed, printed


@pytest.mark.parametrize(
    ("T", "D", "H", "E", "k", "clustered"),
    [(2048, 6144, 1024, 8, 2, True), (4096, 512, 1024, 8, 2, False)],
    ids=["outgrow-l2", "fit-l2"],
)
def test_gate_up_clusters_past_256_rows(
    flash_moe, seed, monkeypatch, capfd, T, D, H, E, k, clustered
):
    """Past 256 rows an expert the cooperative gate/up tile clusters only where the weight
    tiles its CTAs read at once outgrow L2 (forward_kernels.h, gate_up_weights_outgrow_l2):
    512 rows an expert of D = 6144 (about 100 MB in flight on a 132-SM, 50 MiB-L2 GPU) does,
    1024 rows of D = 512 (about 4 MB) does not."""
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs(T, D, H, E, k, "uniform", generator)
    monkeypatch.setenv("PRIME_MOE_PRINT_CONFIG", "1")
    check(flash_moe, inputs, split=True)
    printed = capfd.readouterr().err
    assert ("cpc=2 " in printed) == clustered, printed


def test_fused_adds_into_out(flash_moe, seed):
    """split=False adds into what out holds."""
    generator = torch.Generator().manual_seed(seed)
    x, w, w2, ids, weights = make_inputs(500, 512, 256, 16, 4, "uniform", generator)
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, 16)
    before = torch.randn(x.shape, generator=generator).bfloat16().cuda()
    out = before.clone()
    flash_moe.fused_moe_bf16(x, w, w2, sorted_ids, expert_ids, total, weights, out, 4, split=False)
    want = before.float() + reference.moe_grouped_mm(x, w, w2, ids, weights).float()
    assert reference.relative_error(out, want) <= BAR


@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_non_default_stream(flash_moe, seed, split):
    """Every launch goes to the current stream: x is written on a side stream after a delay,
    so a kernel on another stream would read the old x."""
    generator = torch.Generator().manual_seed(seed)
    x, w, w2, ids, weights = make_inputs(1024, 512, 256, 16, 4, "uniform", generator)
    new_x = torch.randn(x.shape, generator=generator).bfloat16().cuda()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~25 ms at the H200's clock
        x.copy_(new_x)
        sorted_ids, expert_ids, total = flash_moe.moe_align(ids, 16)
        out = torch.zeros_like(x)
        flash_moe.fused_moe_bf16(
            x, w, w2, sorted_ids, expert_ids, total, weights, out, 4, split=split
        )
    side.synchronize()
    ref = reference.moe_grouped_mm(new_x, w, w2, ids, weights)
    assert reference.relative_error(out, ref) <= BAR


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_poisoned_workspace(flash_moe, seed, split, block_m):
    """The workspace (h, y, pair_to_row) comes from the caching allocator unwritten: fill
    its free memory with NaN first; no NaN may reach out."""
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs(1000, 512, 256, 16, 4, "zipf", generator)
    nan_bf16_pairs = 0x7FC07FC0  # two bf16 NaNs per int32 (and a float32 NaN)
    torch.cuda.synchronize()
    poison = torch.full((64 << 20,), nan_bf16_pairs, dtype=torch.int32, device="cuda")
    del poison
    check(flash_moe, inputs, split=split, block_m=block_m)


@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_no_tokens(flash_moe, split):
    """T = 0 (an expert-parallel rank that got no tokens): moe_align gives an all-padding
    layout with total 0, and the forward launches nothing, also under graph capture."""
    D, H, E, k = 256, 128, 8, 2
    x = torch.empty(0, D, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(E, 2 * H, D, device="cuda").bfloat16()
    w2 = torch.randn(E, D, H, device="cuda").bfloat16()
    ids = torch.empty(0, k, dtype=torch.int32, device="cuda")
    weights = torch.empty(0, k, device="cuda")
    out = torch.empty_like(x)
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, E)
    assert total.item() == 0 and (sorted_ids == -1).all() and (expert_ids == -1).all()

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = flash_moe.fused_moe_bf16(
            x, w, w2, sorted_ids, expert_ids, total, weights, out, k, split=split
        )
        torch.cuda.synchronize()
    assert result is out and out.shape == (0, D)
    launched = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert not launched, f"T = 0 launched {launched}"

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_moe.moe_align(ids, E)
        flash_moe.fused_moe_bf16(x, w, w2, *captured, weights, out, k, split=split)
    graph.replay()
    torch.cuda.synchronize()
    assert captured[2].item() == 0 and (captured[0] == -1).all()


FIRST_CALL_IN_CAPTURE = """
import torch, prime_kernels
from prime_kernels.flash_moe import reference
flash_moe = prime_kernels.load("flash_moe")
split = {split}
torch.manual_seed(0)
T, D, H, E, k = 1024, 512, 256, 16, 4
x = (0.2 * torch.randn(T, D, device="cuda")).bfloat16()
w = (0.05 * torch.randn(E, 2 * H, D, device="cuda")).bfloat16()
w2 = (0.05 * torch.randn(E, D, H, device="cuda")).bfloat16()
ids, weights = reference.routing(T, E, k, device="cuda")
out = torch.full_like(x, float("nan"))
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):  # the first call of either op in this process
    aligned = flash_moe.moe_align(ids, E)
    if not split:
        out.zero_()
    flash_moe.fused_moe_bf16(x, w, w2, *aligned, weights, out, k, split=split)
graph.replay()
ref = reference.moe_grouped_mm(x, w, w2, ids, weights)
error = reference.relative_error(out, ref)
assert error <= {bar}, error
print("ok", error)
"""


@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_graph_capture_without_warm_up(flash_moe, split):
    """Captured in a fresh process before any eager call (module loading, tensor maps and
    function attributes all happen inside the capture)."""
    import subprocess
    import sys

    script = FIRST_CALL_IN_CAPTURE.format(split=split, bar=BAR)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")


# The original's tuning values, as callers spell them (one passes all positionally).
ORIGINAL_TUNINGS = [(64, 4, 2), (64, 4, 1), (64, 4, 5), (32, 8, 2), (32, 8, 4)]


@pytest.mark.parametrize(("block_n", "warp_n", "stages"), ORIGINAL_TUNINGS)
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_original_tuning_values(flash_moe, seed, split, block_n, warp_n, stages):
    generator = torch.Generator().manual_seed(seed)
    x, w, w2, ids, weights = make_inputs(700, 512, 256, 16, 4, "zipf", generator)
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, 16)
    out = torch.full_like(x, float("nan")) if split else torch.zeros_like(x)
    args = (x, w, w2, sorted_ids, expert_ids, total, weights, out, 4)
    flash_moe.fused_moe_bf16(*args, 128, block_n, warp_n, stages, 1, 1, split)
    ref = reference.moe_grouped_mm(x, w, w2, ids, weights)
    assert reference.relative_error(out, ref) <= BAR


# The same values by keyword, the rest left to the wrapper: the original's wrapper defaults
# (block_n 64, warp_n 4) make each of these one of its tiles, so each is a hint here too, though
# none names a tile of this kernel (1 stage; 5 past what its 128-wide ring holds). The original
# takes 5 stages without split only.
ORIGINAL_KEYWORDS = [
    {"stages": 1},
    {"stages": 5, "split": False},
    {"warp_n": 4},
    {"block_n": 64, "stages": 1},
    {"block_n": 32, "warp_n": 8},
]


@pytest.mark.parametrize(
    "hints", ORIGINAL_KEYWORDS, ids=lambda h: ",".join(f"{k}={v}" for k, v in h.items())
)
def test_original_tuning_keywords(flash_moe, seed, hints):
    generator = torch.Generator().manual_seed(seed)
    x, w, w2, ids, weights = make_inputs(4096, 512, 512, 16, 4, "uniform", generator)
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, 16)
    split = hints.get("split", True)
    out = torch.full_like(x, float("nan")) if split else torch.zeros_like(x)
    flash_moe.fused_moe_bf16(x, w, w2, sorted_ids, expert_ids, total, weights, out, 4, **hints)
    ref = reference.moe_grouped_mm(x, w, w2, ids, weights)
    assert reference.relative_error(out, ref) <= BAR


PRINT_CONFIG = """
import torch, prime_kernels
from prime_kernels.flash_moe import reference
flash_moe = prime_kernels.load("flash_moe")
T, D, H, E, k = 8192, 1024, 768, 32, 4
x = torch.randn(T, D, device="cuda").bfloat16()
w = torch.randn(E, 2 * H, D, device="cuda").bfloat16()
w2 = torch.randn(E, D, H, device="cuda").bfloat16()
ids, weights = reference.routing(T, E, k, device="cuda")
aligned = flash_moe.moe_align(ids, E)
out = torch.empty_like(x)
flash_moe.fused_moe_bf16(x, w, w2, *aligned, weights, out, k, 128, 64, 4, 2, 1, 1, True)
flash_moe.fused_moe_bf16(x, w, w2, *aligned, weights, out, k, block_n=64, stages=3)
flash_moe.set_num_sms(8)
flash_moe.fused_moe_bf16(x, w, w2, *aligned, weights, out, k)
flash_moe.set_num_sms(0)
few = flash_moe.moe_align(ids[:16], E)
flash_moe.fused_moe_bf16(x[:16], w, w2, *few, weights[:16], out[:16], k)
torch.cuda.synchronize()
"""


def test_print_config_shows_what_hints_became(flash_moe):
    """The original's (64, 4, 2) takes the tuned tile (the 96-wide ping-pong tile at 1024 rows
    an expert and H = 768, as deep as shared memory allows); this kernel's own block_n and
    stages are kept; set_num_sms caps the persistent grid; decode-sized routing (2 rows an
    expert) takes the 64-wide tile."""
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", PRINT_CONFIG],
        capture_output=True,
        text=True,
        env={**os.environ, "PRIME_MOE_PRINT_CONFIG": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("fused_moe_bf16:")]
    assert len(lines) == 4, result.stderr
    (original, asked), (pinned, _), (capped, _), (decode, _) = (
        line.split("; asked ") for line in lines
    )
    assert asked.startswith("block_n=64 warp_n=4 stages=2") and "Blackwell tile" in asked
    assert "block_n=96 " in original and "stages=2 " not in original
    assert "block_n=64 " in pinned and "stages=3 " in pinned
    all_sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert "sms=8 " in capped and f"sms={all_sms} " in original
    assert "block_n=64 " in decode and f"sms={all_sms} " in decode


def test_num_sms_cap(flash_moe, seed):
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs(2048, 512, 256, 16, 4, "uniform", generator)
    try:
        flash_moe.set_num_sms(5)
        for split in (True, False):
            check(flash_moe, inputs, split=split)
    finally:
        flash_moe.set_num_sms(0)


def test_split_is_bitwise_deterministic(flash_moe, seed):
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs(4096, 1024, 512, 32, 8, "zipf", generator)
    first = run_ours(flash_moe, *inputs, split=True)
    for _ in range(5):
        assert torch.equal(run_ours(flash_moe, *inputs, split=True), first)


@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_cuda_graph_capture(flash_moe, seed, split):
    generator = torch.Generator().manual_seed(seed)
    x, w, w2, ids, weights = make_inputs(1024, 512, 256, 16, 4, "uniform", generator)
    out = torch.empty_like(x)

    def forward():
        sorted_ids, expert_ids, total = flash_moe.moe_align(ids, 16)
        if not split:
            out.zero_()
        flash_moe.fused_moe_bf16(
            x, w, w2, sorted_ids, expert_ids, total, weights, out, 4, split=split
        )

    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    new_x, _, _, new_ids, _ = make_inputs(1024, 512, 256, 16, 4, "zipf", generator)
    x.copy_(new_x)
    ids.copy_(new_ids)
    out.fill_(float("nan"))
    graph.replay()
    ref = reference.moe_grouped_mm(x, w, w2, ids, weights)
    assert reference.relative_error(out, ref) <= BAR


def test_torch_compile_fullgraph(flash_moe, seed):
    generator = torch.Generator().manual_seed(seed)
    x, w, w2, ids, weights = make_inputs(256, 256, 128, 8, 2, "uniform", generator)

    def forward(x, w, w2, ids, weights):
        sorted_ids, expert_ids, total = flash_moe.moe_align(ids, w.shape[0])
        out = torch.empty_like(x)
        return flash_moe.fused_moe_bf16(
            x, w, w2, sorted_ids, expert_ids, total, weights, out, ids.shape[1]
        )

    compiled = torch.compile(forward, fullgraph=True)
    out = compiled(x, w, w2, ids, weights)
    ref = reference.moe_grouped_mm(x, w, w2, ids, weights)
    assert reference.relative_error(out, ref) <= BAR


def test_opcheck(flash_moe, seed):
    generator = torch.Generator().manual_seed(seed)
    x, w, w2, ids, weights = make_inputs(100, 256, 128, 4, 2, "uniform", generator)
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, 4)
    out = torch.empty_like(x)
    args = (x, w, w2, sorted_ids, expert_ids, total, weights, out, 2)
    torch.library.opcheck(
        torch.ops.prime_moe.fused_moe_bf16.default,
        args,
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


@pytest.mark.sanitize
@pytest.mark.parametrize(
    ("T", "H", "E", "k"), [(100, 64, 4, 2), (1000, 256, 32, 8)], ids=["single", "clustered"]
)
def test_garbage_routing_never_goes_out_of_bounds(flash_moe, seed, T, H, E, k):
    """Whatever sorted_token_ids and expert_ids hold, the kernels only touch valid memory
    (compute-sanitizer memcheck runs this) and raise no fault. With random ids the numbers are
    unspecified, and may be non-finite: the down GEMM copies a block's upper 64 rows of h only
    where its first row has a pair (moe_align's layout puts routed rows first; TmaRows), so
    under another layout its upper half may multiply what a stage held before (H100, with the
    free memory NaN-poisoned: some routed rows of such halves came out NaN). A padded total
    below zero routes nothing, and out must say so. The second shape takes the gate/up tile in
    2-CTA clusters (the tile choice reads the sizes, not the ids), whose pairs decide from the
    ids whether they share a weight tile."""
    generator = torch.Generator().manual_seed(seed)
    x, w, w2, ids, weights = make_inputs(T, 128, H, E, k, "uniform", generator)
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, E)
    sorted_ids = torch.randint(-5, 10**6, sorted_ids.shape, dtype=torch.int32, device="cuda")
    expert_ids = torch.randint(-5, 100, expert_ids.shape, dtype=torch.int32, device="cuda")
    for bad_total in (10**7, -3):
        total.fill_(bad_total)
        for split in (True, False):
            out = torch.zeros_like(x)
            flash_moe.fused_moe_bf16(
                x, w, w2, sorted_ids, expert_ids, total, weights, out, k, split=split
            )
            torch.cuda.synchronize()  # a fault in any kernel raises here
            if bad_total < 0:  # no rows: split=True writes zeros, split=False adds nothing
                assert (out == 0).all()


@pytest.mark.sanitize
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_out_of_range_routing_drops_exactly_those_pairs(flash_moe, seed, split):
    """Rows whose id is outside [0, T*k) and blocks whose expert is outside [0, E) are
    skipped, and everything else is computed as usual: out equals the reference with exactly
    those pairs dropped. A padded total past the end reads as the end, a negative one as 0."""
    generator = torch.Generator().manual_seed(seed)
    T, E, k = 300, 8, 2
    x, w, w2, ids, weights = make_inputs(T, 128, 64, E, k, "uniform", generator)
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, E)
    bad_rows = torch.rand(sorted_ids.shape, generator=generator).cuda() < 0.1
    # Not the first row of a block's upper 64-row half: the down GEMM copies that half only
    # when its first row holds a pair (moe_align puts an expert's rows first; TmaRows), so a
    # junk id there leaves the half's later rows unspecified rather than computed.
    rows = torch.arange(len(bad_rows), device=bad_rows.device)
    bad_rows[rows % flash_moe.BLOCK_M == 64] = False
    junk_ids = torch.tensor([T * k, T * k + 1, 10**6, -2, -(2**31)], dtype=torch.int32)
    junk = junk_ids[torch.randint(0, 5, sorted_ids.shape, generator=generator)].cuda()
    bad_blocks = torch.zeros(expert_ids.shape, dtype=torch.bool)
    bad_blocks[torch.randperm(len(bad_blocks), generator=generator)[:2]] = True
    bad_blocks = bad_blocks.cuda()
    junk_experts = torch.tensor([-5, E, 100], dtype=torch.int32, device="cuda")
    junk_experts = junk_experts[torch.arange(len(expert_ids), device="cuda") % 3]

    block_m = flash_moe.BLOCK_M
    lost = bad_rows | bad_blocks.repeat_interleave(block_m)
    dropped = sorted_ids[lost & (sorted_ids >= 0)].long()
    expected_ids = ids.clone().view(-1)
    expected_ids[dropped] = -1
    want = reference.moe_grouped_mm(x, w, w2, expected_ids.view(T, k), weights)
    assert dropped.numel() > 0

    bad_sorted = torch.where(bad_rows, junk, sorted_ids)
    bad_experts = torch.where(bad_blocks, junk_experts, expert_ids)
    for bad_total, expected in (
        (total, want),
        (torch.full_like(total, 10**7), want),
        (torch.full_like(total, -3), torch.zeros_like(want)),
    ):
        out = torch.full_like(x, float("nan")) if split else torch.zeros_like(x)
        flash_moe.fused_moe_bf16(
            x, w, w2, bad_sorted, bad_experts, bad_total, weights, out, k, split=split
        )
        if expected.norm() == 0:
            assert (out == 0).all()
        else:
            assert reference.relative_error(out, expected) <= BAR
