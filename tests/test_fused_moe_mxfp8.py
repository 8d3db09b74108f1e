"""fused_moe_mxfp8 on the GPU. Two kinds of bars: CONTRACT.md's (relative error <= 1e-1
against the grouped-mm path, and an error against the fp32 expert loop at most 1.5x the
quantization floor, the fp32 model on MXFP8 round-tripped inputs), which a lossy shortcut
could pass, and agreement with the exact-MX emulation (reference.moe_mxfp8_emulation) at
bf16-level tolerance, which it could not. Over the bf16 tests' shapes and routings, both
split modes, and the consumer's own sequence."""

from __future__ import annotations

import math

import pytest
import torch

from prime_kernels.flash_moe import mxfp8, reference

from .poison import poison_allocator
from .test_fused_moe_bf16 import CASES, make_inputs

pytestmark = pytest.mark.gpu

BAR = 1e-1
RATIO_TO_FLOOR = 1.5
# Kernel against exact MX: the emulation rounds where the kernel rounds (h, y or weight * y,
# out), so split=True differs only by fp32 summation order (and the rare re-quantization flips
# it causes). split=False adds each pair into out with bf16 atomics in whatever order they
# land: with k > 2 the roundings of the partial sums depend on it, which no emulation can
# follow (on the CPU, one random order against the fp32 sum of the same bf16 terms: 3.0e-3 at
# k = 4, 4.0e-3 at 8, 5.3e-3 at 16), so that bar grows as sqrt(k / 2).
EMULATION_BAR = 3e-3


# The two ways the op runs (fused_moe_mxfp8.cu), by the mean rows per routed expert: the fp8
# weights widened in the GEMMs' registers (decode sizes), or widened to bf16 once by a pre-pass
# (prefill sizes, above 256 rows an expert). PRIME_MOE_PRINT_CONFIG=1 names the one taken.
# The register path's weights are widened to bf16, or on the 64 x 64 decode tiles converted to
# f16, in registers; the widened path's once by a pre-pass.
PATH_MARKERS = {"registers": "in registers", "widened": "widened to bf16 once"}


def expect_path(capfd, path: str) -> None:
    printed = capfd.readouterr().err
    assert PATH_MARKERS[path] in printed, f"expected the {path} path, the op printed: {printed}"


def emulation_bar(split: bool, k: int) -> float:
    return EMULATION_BAR if split else EMULATION_BAR * max(1.0, math.sqrt(k / 2))


def emulate(ops, ws, w2s, ids, weights, split):
    return reference.moe_mxfp8_emulation(
        ops[0], ops[1], ops[2], ws, ops[4], w2s, ids, weights, split=split
    )


def quantize(flash_moe, x, w, w2):
    """As the consumer quantizes: block 32, e4m3, RCEIL; x's scales row-major, the weights'
    packed with pack_scales_blocked. Returns the op's operands and the row-major weight
    scales (for the emulation)."""
    xq, xs = flash_moe.quantize_mxfp8(x)
    wq, ws = flash_moe.quantize_mxfp8(w)
    w2q, w2s = flash_moe.quantize_mxfp8(w2)
    ops = (xq, xs, wq, flash_moe.pack_scales_blocked(ws), w2q, flash_moe.pack_scales_blocked(w2s))
    return ops, (ws, w2s)


def run_ours(flash_moe, ops, ids, weights, *, split, block_m=None, **tuning):
    block_m = block_m or flash_moe.BLOCK_M
    E, k = ops[2].shape[0], ids.shape[1]
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, E, block_m)
    # split=True must overwrite every element: poison it with NaN.
    out = torch.full(ops[0].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    if not split:
        out.zero_()
    result = flash_moe.fused_moe_mxfp8(
        *ops, sorted_ids, expert_ids, total, weights, out, k, block_m=block_m, split=split, **tuning
    )
    assert result is out
    return out


def check(flash_moe, inputs, *, split, **tuning):
    x, w, w2, ids, weights = inputs
    ops, (ws, w2s) = quantize(flash_moe, x, w, w2)
    out = run_ours(flash_moe, ops, ids, weights, split=split, **tuning)
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output elements"
    emulated = emulate(ops, ws, w2s, ids, weights, split)
    truth = reference.moe_expert_loop_fp32(x, w, w2, ids, weights)
    if truth.norm() == 0:  # every pair dropped
        assert (out == 0).all()
        return out
    k = ids.shape[1]
    vs_emulation = reference.relative_error(out, emulated)
    assert vs_emulation <= emulation_bar(split, k), (
        f"relative error {vs_emulation:.3e} against the exact-MX emulation"
    )
    ref = reference.moe_grouped_mm(x, w, w2, ids, weights)
    error = reference.relative_error(out, ref)
    assert error <= BAR, f"relative error {error:.3e} against the grouped-mm path"
    floor = reference.relative_error(reference.moe_mxfp8_floor(x, w, w2, ids, weights), truth)
    ours_vs_truth = reference.relative_error(out, truth)
    assert ours_vs_truth <= RATIO_TO_FLOOR * floor + 1e-6, (
        f"error against fp32 {ours_vs_truth:.3e} > {RATIO_TO_FLOOR} x the quantization floor "
        f"{floor:.3e}"
    )
    return out


def mx_cases():
    from prime_kernels import flash_moe

    return [c for c in CASES if flash_moe.unsupported_shape_reason(c[1], c[2], mxfp8=True) is None]


@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
@pytest.mark.parametrize(("T", "D", "H", "E", "k", "kind"), mx_cases())
def test_against_emulation_and_contract(flash_moe, seed, split, T, D, H, E, k, kind):
    generator = torch.Generator().manual_seed(seed)
    check(flash_moe, make_inputs(T, D, H, E, k, kind, generator), split=split)


# The inputs on which a stage released before the consumers' generic reads of it returned
# (WarpgroupMainloop::release_read, mma.cuh) showed: test_against_emulation_and_contract's
# [1000-512-256-256-8-zipf-fused] case, whose seed this is (tests/conftest.py).
REPEAT_SEED = 430560378
REPEAT_CALLS = 100


def test_repeated_decode_calls(flash_moe):
    """One split=false decode call (64 x 64 tiles, h as MXFP8, the down GEMM's atomics) 100 times
    on NaN-filled free memory, every output checked against the exact-MX emulation: that race
    made 19 of 400 calls wrong or NaN here (H100, benchmarks/probes/mxfp8_repeat.py), so if that
    rate holds under pytest, all 100 would miss it about once in 130 runs."""
    T, D, H, E, k = 1000, 512, 256, 256, 8
    x, w, w2, ids, weights = make_inputs(
        T, D, H, E, k, "zipf", torch.Generator().manual_seed(REPEAT_SEED)
    )
    ops, (ws, w2s) = quantize(flash_moe, x, w, w2)
    emulated = emulate(ops, ws, w2s, ids, weights, False)
    bar = emulation_bar(False, k)
    for call in range(REPEAT_CALLS):
        poison_allocator()
        out = run_ours(flash_moe, ops, ids, weights, split=False)
        assert torch.isfinite(out).all(), f"call {call}: NaN or Inf in out"
        error = reference.relative_error(out, emulated)
        assert error <= bar, f"call {call}: relative error {error:.3e} against the emulation"


def test_consumer_sequence(flash_moe, seed):
    """The consumer's own test: E=4, k=2, D=256, H=128, T=512, x ~ 0.2 randn, weights ~ 0.05
    randn, top-2 of a softmax; x, cat(w1, w3) and w2 quantized (block 32, e4m3, RCEIL), the
    weight scales packed, fused_moe_mxfp8(..., split=True)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    E, k, D, H, T = 4, 2, 256, 128, 512
    x = (0.2 * torch.randn(T, D, generator=generator, device="cuda")).bfloat16()
    w1 = (0.05 * torch.randn(E, H, D, generator=generator, device="cuda")).bfloat16()
    w3 = (0.05 * torch.randn(E, H, D, generator=generator, device="cuda")).bfloat16()
    w2 = (0.05 * torch.randn(E, D, H, generator=generator, device="cuda")).bfloat16()
    ids, weights = reference.routing(T, E, k, generator=generator)
    w = torch.cat([w1, w3], dim=1)
    xq, xs = mxfp8.quantize_mxfp8(x)
    wq, ws = mxfp8.quantize_mxfp8(w)
    w2q, w2s = mxfp8.quantize_mxfp8(w2)
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, E)
    out = torch.empty_like(x)
    flash_moe.fused_moe_mxfp8(
        xq,
        xs,
        wq,
        flash_moe.pack_scales_blocked(ws),
        w2q,
        flash_moe.pack_scales_blocked(w2s),
        sorted_ids,
        expert_ids,
        total,
        weights,
        out,
        k,
        split=True,
    )
    truth = reference.moe_expert_loop_fp32(x, w, w2, ids, weights)
    floor = reference.relative_error(reference.moe_mxfp8_floor(x, w, w2, ids, weights), truth)
    assert reference.relative_error(out, reference.moe_grouped_mm(x, w, w2, ids, weights)) <= BAR
    assert reference.relative_error(out, truth) <= RATIO_TO_FLOOR * floor
    emulated = reference.moe_mxfp8_emulation(xq, xs, wq, ws, w2q, w2s, ids, weights)
    assert reference.relative_error(out, emulated) <= EMULATION_BAR


@pytest.mark.sanitize
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
@pytest.mark.parametrize(
    ("T", "D", "H", "E", "k", "kind"),
    [
        (37, 128, 128, 4, 2, "uniform"),
        (9, 128, 128, 3, 1, "dropped"),
        (50, 256, 128, 8, 8, "zipf"),
        (600, 128, 128, 2, 1, "uniform"),  # 300 rows an expert: the widened weights
        # 19 rows an expert on average (64-row tiles of 128-row blocks, two CTAs an SM), the
        # heaviest with full blocks: their upper tiles run, the others' are skipped
        (300, 128, 128, 32, 2, "zipf"),
    ],
)
def test_small_shapes_for_sanitizer(flash_moe, seed, split, T, D, H, E, k, kind):
    generator = torch.Generator().manual_seed(seed)
    check(flash_moe, make_inputs(T, D, H, E, k, kind, generator), split=split)


@pytest.mark.parametrize("block_n", [None, 64, 128])
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_block_m_64(flash_moe, seed, split, block_n):
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs(700, 512, 256, 16, 4, "zipf", generator)
    # warp_n = stages = 0: this kernel's own tile with the deepest ring it holds (the Python
    # default stages=4 is the original's, past shared memory at block_n = 128 here).
    check(flash_moe, inputs, split=split, block_m=64, block_n=block_n, warp_n=0, stages=0)


@pytest.mark.parametrize(("path", "T"), [("registers", 300), ("widened", 1000)])
@pytest.mark.parametrize(
    ("block_m", "block_n"), [(64, 128), (64, 64), (128, 64), (128, 96), (128, 128)]
)
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_tiles_and_partial_last_n_tile(
    flash_moe, seed, monkeypatch, capfd, split, block_m, block_n, path, T
):
    """D = H = 384: at block_m = 64, block_n = 128 the register path's down GEMM's last
    256-wide n tile holds 128 rows of w2 and reads the last scale tile for the rest; block_n =
    64 puts gate/up tiles in the upper half of a 128-row scale tile. On the widened path (bf16
    tiles) block_m = 64, block_n = 128 gives the same partial 256-wide down tile."""
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs(T, 384, 384, 8, 4, "uniform", generator)
    monkeypatch.setenv("PRIME_MOE_PRINT_CONFIG", "1")
    check(flash_moe, inputs, split=split, block_m=block_m, block_n=block_n, warp_n=0, stages=0)
    expect_path(capfd, path)


@pytest.mark.sanitize
@pytest.mark.parametrize("kind", ["uniform", "zipf"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
@pytest.mark.parametrize(
    ("T", "H", "E"),
    [
        (512, 768, 16),  # 64 rows an expert, H whole 96-row tiles (Qwen3-30B-A3B's 768)
        (1024, 640, 8),  # 256 rows an expert, a last tile of 64 rows
    ],
)
def test_three_consumer_gate_up(flash_moe, seed, monkeypatch, capfd, split, kind, T, H, E):
    """33 to 256 rows an expert (past decode sizes, below the widening pre-pass): the gate/up
    tile of three consumer warpgroups (block_n = 96), whose 96-row weight tiles at n0 % 128 in
    {32, 64, 96} may straddle two 128-row scale blocks, and whose last tile is partial where H is
    not a multiple of 96."""
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs(T, 256, H, E, 2, kind, generator)
    monkeypatch.setenv("PRIME_MOE_PRINT_CONFIG", "1")
    check(flash_moe, inputs, split=split)
    printed = capfd.readouterr().err
    assert "block_n=96" in printed, printed


@pytest.mark.parametrize(
    ("T", "E", "k", "path"),
    [
        (64, 128, 8, "registers"),  # Qwen3-30B-A3B's routing at decode: 4 rows an expert
        (1024, 16, 4, "registers"),  # 256 rows an expert: the last size widened in registers
        (1032, 16, 4, "widened"),
        (4096, 8, 1, "widened"),
        (2048, 256, 8, "registers"),
    ],
)
def test_weights_widened_once_above_256_rows_an_expert(
    flash_moe, seed, monkeypatch, capfd, T, E, k, path
):
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs(T, 256, 128, E, k, "uniform", generator)
    monkeypatch.setenv("PRIME_MOE_PRINT_CONFIG", "1")
    check(flash_moe, inputs, split=True)
    expect_path(capfd, path)


@pytest.mark.parametrize("T", [1000, 2000], ids=["registers", "widened"])
@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_poisoned_workspace(flash_moe, seed, split, block_m, T):
    """The workspace (x dequantized, h, y, pair_to_row, the widened weights) comes from the
    caching allocator unwritten: fill its free memory with NaN first; no NaN may reach out."""
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs(T, 512, 256, 16, 4, "zipf", generator)
    poison_allocator()
    check(flash_moe, inputs, split=split, block_m=block_m)


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_decode_down_gemm_reads_only_stored_h(flash_moe, seed, monkeypatch, capfd, split, block_m):
    """On the decode tiles the down GEMM copies a 64-row tile's h as soon as the gate/up GEMM has
    counted every column of it stored, while other gate/up tiles still run (RowsReady,
    csrc/device/moe_gemm.cuh). Here each GEMM has about two waves of tiles, so the down GEMM's
    first tiles start while the gate/up GEMM's last ones run, and H = 768 (12 gate/up n tiles)
    gives two raster groups, so that a block's h is complete only in the second. block_m = 128
    runs the 64-row tiles over 128-row blocks (upper tiles skipped), 64 one tile a block. The
    workspace (h included) is NaN-poisoned before each of three calls: h read before it is
    stored would put NaN in out, and stale h from the call before would miss the emulation."""
    generator = torch.Generator().manual_seed(seed)
    monkeypatch.setenv("PRIME_MOE_PRINT_CONFIG", "1")
    for _ in range(3):
        inputs = make_inputs(64, 1024, 768, 64, 8, "uniform", generator)
        poison_allocator()
        check(flash_moe, inputs, split=split, block_m=block_m)
        assert "converted to f16" in capfd.readouterr().err, "expected the decode tiles"


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_every_wgmma_n_of_a_block(flash_moe, seed, split, block_m):
    """A register-A tile multiplies only the first 16, 32, 64 or block_m token rows of its
    block, the fewest that cover its routed rows; the rest of the block's h rows are left
    unwritten. Experts with 1, 16, 17, 32, 33, 64, 65 and 128 + 5 tokens put a block's last
    routed row at each side of every boundary, over a NaN-poisoned workspace; no NaN may reach
    out and every token must match the emulation."""
    generator = torch.Generator().manual_seed(seed)
    counts = [1, 16, 17, 32, 33, 64, 65, 133]
    E, T = len(counts), sum(counts)
    x, w, w2, _, _ = make_inputs(T, 256, 128, E, 1, "uniform", generator)
    ids = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    ids = ids[torch.randperm(T, generator=generator)].to(torch.int32).view(T, 1).cuda()
    weights = torch.rand(T, 1, generator=generator).add(0.5).cuda()
    poison_allocator()
    check(flash_moe, (x, w, w2, ids, weights), split=split, block_m=block_m)


def test_num_sms_cap(flash_moe, seed):
    """Under a set_num_sms cap the decode tiles, two CTAs an SM uncapped, run one per SM."""
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs(200, 256, 128, 32, 4, "zipf", generator)  # 25 rows an expert
    try:
        flash_moe.set_num_sms(5)
        for split in (True, False):
            check(flash_moe, inputs, split=split)
    finally:
        flash_moe.set_num_sms(0)


def test_split_is_bitwise_deterministic(flash_moe, seed):
    generator = torch.Generator().manual_seed(seed)
    x, w, w2, ids, weights = make_inputs(4096, 1024, 512, 32, 8, "zipf", generator)
    ops, _ = quantize(flash_moe, x, w, w2)
    first = run_ours(flash_moe, ops, ids, weights, split=True)
    for _ in range(5):
        assert torch.equal(run_ours(flash_moe, ops, ids, weights, split=True), first)


@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_x_blocks_far_apart(flash_moe, seed, monkeypatch, capfd, split):
    """The decode gate/up loop's tokens rebased by x's pre-pass (mxfp8_dequantize.cuh): a
    token whose nonzero blocks' scales lie within 15 of its largest is written times
    2^(s - largest) in f16 and its factor applied once; one whose scales lie further apart keeps
    a factor per block, and so does every tile holding such a token. Here: tokens with a block
    2^-14, 2^-15 (the last exact rebase, f16's subnormal 2^-15) and 2^-16 or 2^-40 (not
    rebased) below the rest, an all-zero block under a huge scale (ignored by the rebase), at
    a decode size (10 rows an expert: the f16 loop), against the exact-MX emulation."""
    generator = torch.Generator().manual_seed(seed)
    T, D, H, E, k = 40, 512, 256, 8, 2
    x, w, w2, ids, weights = make_inputs(T, D, H, E, k, "uniform", generator)
    x = x.clone()
    x[3, 64:96] *= 2.0**-14
    x[5, 0:32] *= 2.0**-15
    x[5, 256:288] *= 2.0**-15
    x[8, 480:512] *= 2.0**-16
    x[13, 32:64] *= 2.0**-40
    x[21, 128:160] = 0
    ops, (ws, w2s) = quantize(flash_moe, x, w, w2)
    xs = ops[1].view(torch.uint8).clone()
    xs[21, 4] = 200  # zeros under 2^73: still zeros
    ops = (ops[0], xs.view(torch.float8_e8m0fnu), *ops[2:])
    monkeypatch.setenv("PRIME_MOE_PRINT_CONFIG", "1")
    out = run_ours(flash_moe, ops, ids, weights, split=split)
    printed = capfd.readouterr().err
    assert "rebased per token" in printed, (
        f"expected the f16 decode loop, the op printed: {printed}"
    )
    assert torch.isfinite(out).all()
    emulated = emulate(ops, ws, w2s, ids, weights, split)
    error = reference.relative_error(out, emulated)
    assert error <= emulation_bar(split, k), f"relative error {error:.3e} against the emulation"
    # Per token too: a wrong factor on one token would hide in the whole tensor's norm.
    for t in (3, 5, 8, 13, 21):
        token_error = reference.relative_error(out[t], emulated[t])
        assert token_error <= 4 * emulation_bar(split, k), f"token {t}: {token_error:.3e}"


@pytest.mark.parametrize("T", [40, 300, 1200], ids=["decode", "registers", "widened"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_nan_scale_poisons_exactly_its_token(flash_moe, seed, split, T):
    """A NaN scale (0xFF) makes its block NaN (mxfp8.py's policy): every output of that
    token is NaN (each h column reads all of x's row), every other token's is finite."""
    generator = torch.Generator().manual_seed(seed)
    x, w, w2, ids, weights = make_inputs(T, 256, 128, 8, 2, "uniform", generator)
    ops, _ = quantize(flash_moe, x, w, w2)
    xs = ops[1].view(torch.uint8).clone()
    xs[17, 3] = 0xFF
    ops = (ops[0], xs.view(torch.float8_e8m0fnu), *ops[2:])
    out = run_ours(flash_moe, ops, ids, weights, split=split)
    assert torch.isnan(out[17]).all()
    others = torch.cat([out[:17], out[18:]])
    assert torch.isfinite(others).all()


@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_no_tokens(flash_moe, split):
    D, H, E, k = 256, 128, 8, 2
    x = torch.empty(0, D, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(E, 2 * H, D, device="cuda").bfloat16()
    w2 = torch.randn(E, D, H, device="cuda").bfloat16()
    ids = torch.empty(0, k, dtype=torch.int32, device="cuda")
    weights = torch.empty(0, k, device="cuda")
    ops, _ = quantize(flash_moe, x, w, w2)
    out = run_ours(flash_moe, ops, ids, weights, split=split)
    assert out.shape == (0, D)


# The original's tuning values, as callers spell them (stages 1..4 for mxfp8), positionally.
ORIGINAL_TUNINGS = [(64, 4, 4), (64, 4, 1), (32, 8, 2), (32, 8, 4)]


@pytest.mark.parametrize(("block_n", "warp_n", "stages"), ORIGINAL_TUNINGS)
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_original_tuning_values(flash_moe, seed, split, block_n, warp_n, stages):
    generator = torch.Generator().manual_seed(seed)
    x, w, w2, ids, weights = make_inputs(700, 512, 256, 16, 4, "zipf", generator)
    ops, (ws, w2s) = quantize(flash_moe, x, w, w2)
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, 16)
    out = torch.full_like(x, float("nan")) if split else torch.zeros_like(x)
    args = (*ops, sorted_ids, expert_ids, total, weights, out, 4)
    flash_moe.fused_moe_mxfp8(*args, 128, block_n, warp_n, stages, 1, split)
    emulated = emulate(ops, ws, w2s, ids, weights, split)
    assert reference.relative_error(out, emulated) <= emulation_bar(split, 4)


@pytest.mark.parametrize("T", [1024, 2048], ids=["registers", "widened"])
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_cuda_graph_capture(flash_moe, seed, split, T):
    generator = torch.Generator().manual_seed(seed)
    x, w, w2, ids, weights = make_inputs(T, 512, 256, 16, 4, "uniform", generator)
    ops, (ws, w2s) = quantize(flash_moe, x, w, w2)
    out = torch.empty_like(x)

    def forward():
        sorted_ids, expert_ids, total = flash_moe.moe_align(ids, 16)
        if not split:
            out.zero_()
        flash_moe.fused_moe_mxfp8(*ops, sorted_ids, expert_ids, total, weights, out, 4, split=split)

    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    new_x, _, _, new_ids, _ = make_inputs(T, 512, 256, 16, 4, "zipf", generator)
    xq, xs = flash_moe.quantize_mxfp8(new_x)
    ops[0].copy_(xq)
    ops[1].copy_(xs)
    ids.copy_(new_ids)
    out.fill_(float("nan"))
    graph.replay()
    emulated = emulate(ops, ws, w2s, ids, weights, split)
    assert reference.relative_error(out, emulated) <= emulation_bar(split, 4)


def test_torch_compile_fullgraph(flash_moe, seed):
    generator = torch.Generator().manual_seed(seed)
    x, w, w2, ids, weights = make_inputs(256, 256, 128, 8, 2, "uniform", generator)
    ops, (ws, w2s) = quantize(flash_moe, x, w, w2)

    def forward(xq, xs, wq, wsb, w2q, w2sb, ids, weights):
        sorted_ids, expert_ids, total = flash_moe.moe_align(ids, wq.shape[0])
        out = torch.empty(xq.shape, dtype=torch.bfloat16, device=xq.device)
        return flash_moe.fused_moe_mxfp8(
            xq, xs, wq, wsb, w2q, w2sb, sorted_ids, expert_ids, total, weights, out, ids.shape[1]
        )

    compiled = torch.compile(forward, fullgraph=True)
    out = compiled(*ops, ids, weights)
    emulated = emulate(ops, ws, w2s, ids, weights, True)
    assert reference.relative_error(out, emulated) <= EMULATION_BAR


def test_opcheck(flash_moe, seed):
    generator = torch.Generator().manual_seed(seed)
    x, w, w2, ids, weights = make_inputs(100, 256, 128, 4, 2, "uniform", generator)
    ops, _ = quantize(flash_moe, x, w, w2)
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, 4)
    out = torch.empty_like(x)
    bits = [t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t for t in ops]
    args = (*bits, sorted_ids, expert_ids, total, weights, out, 2)
    torch.library.opcheck(
        torch.ops.prime_moe.fused_moe_mxfp8.default,
        args,
        # No test_schema: its mutation check runs arithmetic on every input, and
        # float8_e4m3fn has no CUDA multiply. fused_moe_bf16's opcheck covers the schema
        # pattern this op shares.
        test_utils=("test_faketensor", "test_aot_dispatch_static"),
    )


@pytest.mark.sanitize
@pytest.mark.parametrize("T", [40, 100, 600], ids=["decode", "registers", "widened"])
def test_garbage_routing_never_goes_out_of_bounds(flash_moe, seed, T):
    """Whatever sorted_token_ids and expert_ids hold, the kernels only touch valid memory
    (compute-sanitizer memcheck runs this) and raise no fault; with random ids the numbers are
    unspecified, non-finite ones included (test_fused_moe_bf16.py's test says why). A padded
    total below zero routes nothing, and out must say so. T = 40 (20 rows an expert) runs the
    64 x 64 decode tiles and their e4m3 down GEMM."""
    generator = torch.Generator().manual_seed(seed)
    x, w, w2, ids, weights = make_inputs(T, 128, 128, 4, 2, "uniform", generator)
    ops, _ = quantize(flash_moe, x, w, w2)
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, 4)
    sorted_ids = torch.randint(-5, 10**6, sorted_ids.shape, dtype=torch.int32, device="cuda")
    expert_ids = torch.randint(-5, 100, expert_ids.shape, dtype=torch.int32, device="cuda")
    for bad_total in (10**7, -3):
        total.fill_(bad_total)
        for split in (True, False):
            out = torch.zeros_like(x)
            flash_moe.fused_moe_mxfp8(
                *ops, sorted_ids, expert_ids, total, weights, out, 2, split=split
            )
            torch.cuda.synchronize()  # a fault in any kernel raises here
            if bad_total < 0:  # no rows: split=True writes zeros, split=False adds nothing
                assert (out == 0).all()


@pytest.mark.parametrize("T", [300, 1200], ids=["registers", "widened"])
@pytest.mark.parametrize(
    "block_n", [64, 96, 128], ids=["interleaved", "three-consumers", "gate-up-blocks"]
)
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_weight_blocks_off_the_fast_path(flash_moe, seed, split, block_n, T):
    """The register widening's slow path inside the kernel (csrc/device/mxfp8_fragment.cuh):
    weight blocks whose scale is past 134 (2^(s - 7) is no bf16: here 135 and 140, with
    subnormal e4m3 values so the products stay moderate); and e4m3 NaN bytes under finite
    scales, which the fast path widens to finite values and the epilogues turn into NaN rows
    (mxfp8.py dequantizes them to NaN: every token routed to that expert is NaN), in a gate/up
    row of each gate/up tile layout (block_n = 96 at H = 128: a partial last tile, whose rows
    past H are read and dropped) and in a down row. Against the exact-MX emulation of the
    same bytes; the NaN pattern must match exactly. At T = 1200 (300 rows an expert) the same
    bytes go through the widening pre-pass and the bf16 GEMMs."""
    generator = torch.Generator().manual_seed(seed)
    D, H, E, k = 256, 128, 8, 2
    x, w, w2, ids, weights = make_inputs(T, D, H, E, k, "uniform", generator)
    ops, (ws, w2s) = quantize(flash_moe, x, w, w2)
    wq, w2q = ops[2].view(torch.uint8).clone(), ops[4].view(torch.uint8).clone()
    ws, w2s = ws.view(torch.uint8).clone(), w2s.view(torch.uint8).clone()
    small = torch.randint(0, 8, (2, 32), generator=generator) | (
        torch.randint(0, 2, (2, 32), generator=generator) << 7
    )
    small = small.to(torch.uint8).cuda()
    wq[3, 5, 64:96], ws[3, 5, 2] = small[0], 140  # a gate row of expert 3
    w2q[1, 7, 32:64], w2s[1, 7, 1] = small[1], 135  # a down row of expert 1
    wq[5, H + 9, 40] = 0x7F  # an up row of expert 5: NaN byte, finite scale
    w2q[6, 77, 100] = 0xFF  # a down row of expert 6: a negative NaN byte
    e4m3, e8m0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
    ws, w2s = ws.view(e8m0), w2s.view(e8m0)
    ops = (
        ops[0],
        ops[1],
        wq.view(e4m3),
        flash_moe.pack_scales_blocked(ws),
        w2q.view(e4m3),
        flash_moe.pack_scales_blocked(w2s),
    )
    out = run_ours(flash_moe, ops, ids, weights, split=split, block_n=block_n, warp_n=0, stages=0)
    emulated = emulate(ops, ws, w2s, ids, weights, split)
    nan_rows = torch.isnan(emulated).any(-1)
    assert nan_rows.any() and not nan_rows.all()
    assert torch.equal(torch.isnan(out), torch.isnan(emulated))
    error = reference.relative_error(out[~nan_rows], emulated[~nan_rows])
    assert error <= emulation_bar(split, k), f"relative error {error:.3e} against the emulation"
