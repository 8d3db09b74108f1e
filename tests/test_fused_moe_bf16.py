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


def make_inputs(T, D, H, E, k, kind, generator):
    x = (0.2 * torch.randn(T, D, generator=generator)).bfloat16()
    w = (0.05 * torch.randn(E, 2 * H, D, generator=generator)).bfloat16()
    w2 = (0.05 * torch.randn(E, D, H, generator=generator)).bfloat16()
    ids = make_ids(kind, T, E, k, generator)
    weights = torch.rand(T, k, generator=generator) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    return [t.cuda() for t in (x, w, w2, ids, weights)]


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
]


@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
@pytest.mark.parametrize(("T", "D", "H", "E", "k", "kind"), CASES)
def test_against_reference(flash_moe, seed, split, T, D, H, E, k, kind):
    generator = torch.Generator().manual_seed(seed)
    check(flash_moe, make_inputs(T, D, H, E, k, kind, generator), split=split)


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


@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_block_m_64(flash_moe, seed, split):
    generator = torch.Generator().manual_seed(seed)
    check(flash_moe, make_inputs(700, 512, 256, 16, 4, "zipf", generator), split=split, block_m=64)


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
def test_garbage_routing_never_goes_out_of_bounds(flash_moe, seed):
    """Whatever sorted_token_ids and expert_ids hold, the kernels only touch valid memory
    (compute-sanitizer memcheck runs this); the numbers are unspecified."""
    generator = torch.Generator().manual_seed(seed)
    x, w, w2, ids, weights = make_inputs(100, 128, 64, 4, 2, "uniform", generator)
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, 4)
    sorted_ids = torch.randint(-5, 10**6, sorted_ids.shape, dtype=torch.int32, device="cuda")
    expert_ids = torch.randint(-5, 100, expert_ids.shape, dtype=torch.int32, device="cuda")
    for bad_total in (10**7, -3):
        total.fill_(bad_total)
        for split in (True, False):
            out = torch.zeros_like(x)
            flash_moe.fused_moe_bf16(
                x, w, w2, sorted_ids, expert_ids, total, weights, out, 2, split=split
            )
    torch.cuda.synchronize()
