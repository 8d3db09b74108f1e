"""flash_moe.moe, the differentiable entry point, on the GPU: the forward and all four
gradients (dx, dw, dw2, dtopk_weights) against autograd of reference.moe_grouped_mm on bf16
leaves (relative error <= 1.5e-2) and against the fp64 ground truth (error at most 1.5x the
grouped-mm path's own); frozen inputs, bitwise determinism, NaN-poisoned workspaces, T = 0,
opcheck of the two ops, torch.compile (fullgraph, dynamic T), and one large-index problem.

Every call of :func:`run_moe` first fills the caching allocator's free memory with NaN, so
an element the ops forget to write shows up as NaN, not as a lucky zero."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from prime_kernels.flash_moe import reference

from .poison import poison_allocator
from .test_moe_align import make_ids

pytestmark = pytest.mark.gpu

BAR = 1.5e-2
RATIO_TO_REFERENCE = 1.5
EPS = 1e-6  # absolute slack of the ratio bar (errors that are all but zero on both sides)

GRAD_NAMES = ("dx", "dw", "dw2", "dtopk_weights")
ALL = (True, True, True, True)  # which of x, w, w2, topk_weights require grad


def make_routing(kind, T, E, k, generator):
    """(topk_ids int32, topk_weights fp32), both (T, k), on the CPU.

    Beyond make_ids' kinds: ``softmax`` (the consumer's: top-k of a softmax, weights
    renormalized, reference.routing), ``first_k`` (every token on experts 0..k-1) and
    ``few_tokens`` (experts E-1 and E-2 get 1 and 3 pairs, so their segments are nearly all
    padding; the rest are routed over the other E-2 experts)."""
    if kind == "softmax":
        return reference.routing(T, E, k, generator=generator)
    if kind == "first_k":
        ids = torch.arange(k, dtype=torch.int32).expand(T, k).contiguous()
    elif kind == "few_tokens":
        assert k <= E - 2 and T >= 4
        ids = reference.routing(T, E - 2, k, generator=generator)[0]
        ids[0, 0] = E - 1
        ids[1:4, 0] = E - 2
    else:
        ids = make_ids(kind, T, E, k, generator)
    weights = torch.rand(T, k, generator=generator) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def make_inputs(T, D, H, E, k, kind, seed):
    """x ~ 0.2 randn, w and w2 ~ 0.05 randn (bf16, drawn on the GPU), routing on the CPU,
    and grad_out ~ 0.1 randn (bf16). Returns ([x, w, w2, ids, weights], grad_out), on CUDA."""
    cpu = torch.Generator().manual_seed(seed)
    gpu = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale):
        return (scale * torch.randn(*shape, generator=gpu, device="cuda")).bfloat16()

    x = randn(T, D, scale=0.2)
    w = randn(E, 2 * H, D, scale=0.05)
    w2 = randn(E, D, H, scale=0.05)
    ids, weights = make_routing(kind, T, E, k, cpu)
    grad_out = randn(T, D, scale=0.1)
    return [x, w, w2, ids.cuda(), weights.cuda()], grad_out


def leaves(inputs, needs):
    """Fresh leaves of x, w, w2 and topk_weights, each requiring grad as ``needs`` says."""
    x, w, w2, ids, weights = inputs
    return [t.detach().clone().requires_grad_(n) for t, n in zip((x, w, w2, weights), needs)]


def run_moe(flash_moe, inputs, grad_out, needs=ALL, *, poison=True, mxfp8=False):
    """flash_moe.moe forward and backward: (out, [dx, dw, dw2, dtopk_weights]), a gradient
    None where its input does not require grad (or nothing does)."""
    ids = inputs[3]
    lx, lw, lw2, ltw = leaves(inputs, needs)
    if poison:
        poison_allocator()
    out = flash_moe.moe(lx, lw, lw2, ids, ltw, mxfp8=mxfp8)
    assert out.requires_grad == any(needs)
    if any(needs):
        if poison:
            poison_allocator()
        out.backward(grad_out)
    return out.detach(), [leaf.grad for leaf in (lx, lw, lw2, ltw)]


def run_grouped_mm(inputs, grad_out, needs=ALL):
    """Autograd of reference.moe_grouped_mm on bf16 leaves (fp32 topk_weights)."""
    ids = inputs[3]
    lx, lw, lw2, ltw = leaves(inputs, needs)
    out = reference.moe_grouped_mm(lx, lw, lw2, ids, ltw)
    if any(needs):
        out.backward(grad_out)
    return out.detach(), [leaf.grad for leaf in (lx, lw, lw2, ltw)]


def truth(inputs, grad_out):
    """The fp64 ground truth: the expert loop's forward (h rounded to bf16, as the kernels
    do) and the closed-form backward (moe_backward_reference, fp64)."""
    x, w, w2, ids, weights = inputs
    out = reference.moe_expert_loop_fp32(x, w, w2, ids, weights, dtype=torch.float64)
    grads = reference.moe_backward_reference(x, w, w2, ids, weights, grad_out, dtype=torch.float64)
    return out, list(grads)


def score(name, ours, ref, true) -> list[str]:
    """What is wrong with ``ours`` (empty when nothing): non-finite elements, the bar against
    the grouped-mm path, the ratio bar against the fp64 truth."""
    if not torch.isfinite(ours).all():
        bad = (~torch.isfinite(ours)).sum().item()
        return [f"{name}: {bad} of {ours.numel()} elements are not finite (unwritten?)"]
    if true.norm() == 0:
        return [] if (ours == 0).all() else [f"{name}: nonzero where the truth is all zeros"]
    error = reference.relative_error(ours, ref)
    ours_vs_truth = reference.relative_error(ours, true)
    ref_vs_truth = reference.relative_error(ref, true)
    problems = []
    if error > BAR:
        problems.append(f"{name}: relative error {error:.3e} against the grouped-mm path")
    if ours_vs_truth > RATIO_TO_REFERENCE * ref_vs_truth + EPS:
        problems.append(
            f"{name}: error against fp64 {ours_vs_truth:.3e} > {RATIO_TO_REFERENCE} x the "
            f"grouped-mm path's {ref_vs_truth:.3e}"
        )
    return problems


def exact_zeros(inputs, out, grads) -> list[str]:
    """What must be exactly zero: dtopk_weights of dropped pairs, dw and dw2 of experts with
    no pairs, out and dx rows of tokens whose every pair is dropped."""
    x, w, w2, ids, weights = inputs
    E = w.shape[0]
    valid = (ids >= 0) & (ids < E)
    dead = ~valid.any(dim=1)
    counts = torch.bincount(ids[valid].long(), minlength=E)
    empty = counts == 0
    dx, dw, dw2, dtw = grads
    problems = []
    for name, tensor, mask in (
        ("out", out, dead),
        ("dx", dx, dead),
        ("dw", dw, empty),
        ("dw2", dw2, empty),
        ("dtopk_weights", dtw, ~valid),
    ):
        if tensor is not None and mask.any() and not (tensor[mask] == 0).all():
            problems.append(f"{name}: nonzero where it must be exactly 0 ({int(mask.sum())} rows)")
    return problems


def check(flash_moe, inputs, grad_out, needs=ALL):
    """Ours (forward, backward) against the grouped-mm path and the fp64 truth; returns ours."""
    out, grads = run_moe(flash_moe, inputs, grad_out, needs)
    ref_out, ref_grads = run_grouped_mm(inputs, grad_out, needs)
    true_out, true_grads = truth(inputs, grad_out)

    x, w, w2, ids, weights = inputs
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    problems = score("out", out, ref_out, true_out)
    for name, need, like, ours, ref, true in zip(
        GRAD_NAMES, needs, (x, w, w2, weights), grads, ref_grads, true_grads
    ):
        if not need:
            assert ours is None, f"{name}: a gradient for an input that does not require grad"
            continue
        assert ours is not None, f"{name}: no gradient"
        assert ours.shape == like.shape and ours.dtype == like.dtype, (
            f"{name}: {tuple(ours.shape)} {ours.dtype}, want {tuple(like.shape)} {like.dtype}"
        )
        problems += score(name, ours, ref, true)
    problems += exact_zeros(inputs, out, grads)
    assert not problems, "\n".join(problems)
    return out, grads


# (T, D, H, E, k, routing)
CASES = [
    (512, 256, 128, 4, 2, "softmax"),  # the consumer's shape and routing
    (1, 256, 128, 8, 2, "uniform"),
    (7, 512, 256, 8, 2, "uniform"),
    (1000, 1024, 512, 128, 8, "uniform"),
    (4096, 512, 256, 8, 1, "uniform"),
    (300, 256, 192, 16, 16, "uniform"),  # k = 16: every token on every expert
    (2048, 1024, 256, 16, 4, "one_expert"),  # every pair on one expert
    (1000, 512, 256, 16, 2, "empty_experts"),
    (1000, 512, 256, 64, 4, "zipf"),
    (1000, 512, 256, 16, 2, "dropped"),  # ids -1, E, E + 7, -2^31, 2^31 - 1
    (600, 256, 128, 16, 4, "few_tokens"),
    (64, 2880, 2880, 4, 2, "uniform"),  # partial tiles: 2880 % 128 == 64
]


@pytest.mark.parametrize(("T", "D", "H", "E", "k", "kind"), CASES)
def test_against_reference(flash_moe, seed, T, D, H, E, k, kind):
    assert flash_moe.unsupported_shape_reason(D, H) is None
    check(flash_moe, *make_inputs(T, D, H, E, k, kind, seed))


def test_num_sms_cap(flash_moe, seed):
    """set_num_sms caps the backward's GEMMs too. They run in clusters of two CTAs: a cap of 1
    still gets one cluster (two SMs), an odd cap one SM fewer."""
    inputs, grad_out = make_inputs(1000, 512, 256, 16, 4, "uniform", seed)
    try:
        for cap in (1, 5):
            flash_moe.set_num_sms(cap)
            check(flash_moe, inputs, grad_out)
    finally:
        flash_moe.set_num_sms(0)


@pytest.mark.sanitize
@pytest.mark.parametrize(
    ("T", "D", "H", "E", "k", "kind"),
    [
        (37, 128, 64, 4, 2, "uniform"),
        (9, 64, 128, 3, 1, "dropped"),
        (50, 128, 128, 8, 8, "zipf"),
        (40, 64, 64, 6, 2, "few_tokens"),
    ],
)
def test_small_shapes_for_sanitizer(flash_moe, seed, T, D, H, E, k, kind):
    check(flash_moe, *make_inputs(T, D, H, E, k, kind, seed))


# Every pattern of which of (x, w, w2, topk_weights) require grad, all four excepted.
FROZEN_PATTERNS = [p for p in itertools.product((True, False), repeat=4) if not all(p)]


def pattern_id(needs):
    names = [n for n, need in zip(("x", "w", "w2", "topk_weights"), needs) if need]
    return "+".join(names) if names else "none"


def test_retain_graph_keeps_z(flash_moe, seed):
    """A backward that keeps the graph (retain_graph=True) leaves z intact: a second one
    gives the same gradients; the last, which does not keep it, computes dz into z's memory
    and gets the same bits too."""
    inputs, grad_out = make_inputs(500, 256, 128, 8, 2, "uniform", seed)
    lx, lw, lw2, ltw = leaves(inputs, ALL)
    out = flash_moe.moe(lx, lw, lw2, inputs[3], ltw)
    wrt = (lx, lw, lw2, ltw)
    first = torch.autograd.grad(out, wrt, grad_out, retain_graph=True)
    second = torch.autograd.grad(out, wrt, grad_out, retain_graph=True)
    last = torch.autograd.grad(out, wrt, grad_out)
    for name, a, b, c in zip(GRAD_NAMES, first, second, last):
        assert torch.equal(a, b), f"{name} changed after a backward that kept the graph"
        assert torch.equal(a, c), f"{name} differs when dz takes z's memory"


@pytest.mark.parametrize("needs", FROZEN_PATTERNS, ids=pattern_id)
def test_frozen_inputs(flash_moe, seed, monkeypatch, needs):
    """Only the gradients of inputs that require grad are computed (moe_backward is asked
    for exactly those) and they are right; the others are None. Nothing requiring grad:
    out does not require grad and no backward runs."""
    inputs, grad_out = make_inputs(300, 256, 128, 8, 2, "dropped", seed)
    calls = []
    original = torch.ops.prime_moe.moe_backward

    def spy(*args):
        result = original(*args)
        calls.append((args[-5:-1], [tuple(t.shape) for t in result], args[-1]))
        return result

    monkeypatch.setattr(torch.ops.prime_moe, "moe_backward", spy)
    check(flash_moe, inputs, grad_out, needs)
    monkeypatch.undo()
    if not any(needs):
        assert calls == []
        return
    assert len(calls) == 1, calls
    (asked, shapes, overwrite_z), likes = calls[0], (inputs[0], inputs[1], inputs[2], inputs[4])
    assert tuple(asked) == needs, f"moe_backward asked for {asked}, want {needs}"
    assert overwrite_z, "a backward that does not keep the graph computes dz into z's memory"
    for name, need, shape, like in zip(GRAD_NAMES, needs, shapes, likes):
        assert shape == (tuple(like.shape) if need else (0,)), f"{name}: shape {shape}"


@pytest.mark.sanitize
def test_frozen_weights_small(flash_moe, seed):
    """The sanitizer's frozen cases: weights frozen (dx and dtopk_weights only), and only
    w2 requiring grad."""
    inputs, grad_out = make_inputs(37, 128, 64, 4, 2, "dropped", seed)
    check(flash_moe, inputs, grad_out, (True, False, False, True))
    check(flash_moe, inputs, grad_out, (False, False, True, False))


@pytest.mark.parametrize(
    ("T", "D", "H", "E", "k", "kind"),
    [
        (2048, 512, 256, 16, 4, "zipf"),
        (2048, 512, 256, 16, 4, "first_k"),  # every token on the same k experts
        (1000, 256, 128, 8, 2, "one_expert"),
        (300, 256, 192, 16, 16, "uniform"),
    ],
)
def test_bitwise_deterministic(flash_moe, seed, T, D, H, E, k, kind):
    """Repeated runs on the same inputs give the same bits: out and all four gradients."""
    inputs, grad_out = make_inputs(T, D, H, E, k, kind, seed)
    first_out, first_grads = run_moe(flash_moe, inputs, grad_out)
    for _ in range(3):
        out, grads = run_moe(flash_moe, inputs, grad_out)
        assert torch.equal(out, first_out), "out differs between runs"
        for name, a, b in zip(GRAD_NAMES, grads, first_grads):
            assert torch.equal(a, b), f"{name} differs between runs"


@pytest.mark.parametrize(
    ("T", "D", "H", "E", "k", "kind"),
    [(1000, 512, 256, 16, 4, "few_tokens"), (200, 2880, 2880, 8, 2, "few_tokens")],
)
def test_poisoned_workspace(flash_moe, seed, T, D, H, E, k, kind):
    """With 1 GiB of NaN in the large pool and 256 MiB in the small pool before the forward
    and before the backward (out, z, pair_to_row, the gradients and every workspace come from
    the caching allocator unwritten), and experts of 1 and 3 pairs (segments of nearly all
    padding rows): every output finite and right."""
    inputs, grad_out = make_inputs(T, D, H, E, k, kind, seed)
    poison_allocator(1 << 30, 256)
    out, grads = check(flash_moe, inputs, grad_out)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)


def test_ops_directly(flash_moe, seed):
    """moe_forward's pair_to_row inverts sorted_token_ids (-1 for dropped pairs) and z holds
    each routed row's gate/up pre-activations; moe_backward returns (0,) tensors for the
    gradients not asked for and the same gradients as through autograd for the others."""
    inputs, grad_out = make_inputs(500, 256, 128, 8, 2, "dropped", seed)
    x, w, w2, ids, weights = inputs
    E, k, H = w.shape[0], ids.shape[1], w.shape[1] // 2
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, E)
    poison_allocator()
    out, z, pair_to_row = torch.ops.prime_moe.moe_forward(
        x, w, w2, sorted_ids, expert_ids, total, weights, k
    )
    assert z.shape == (sorted_ids.shape[0], 2 * H) and z.dtype == torch.bfloat16
    assert pair_to_row.shape == (ids.numel(),) and pair_to_row.dtype == torch.int32

    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < E)
    want = torch.full_like(pair_to_row, -1)
    rows = (sorted_ids >= 0).nonzero().squeeze(1)
    want[sorted_ids[rows].long()] = rows.int()
    assert torch.equal(pair_to_row, want), "pair_to_row is not the inverse of sorted_token_ids"
    assert (pair_to_row[~valid] == -1).all()

    routed = pair_to_row[valid].long()
    pairs = valid.nonzero().squeeze(1)
    gate_up = torch.bmm(
        x[pairs // k].float().unsqueeze(1), w[flat[pairs]].float().transpose(1, 2)
    ).squeeze(1)
    assert reference.relative_error(z[routed], gate_up) <= 1e-2

    ref_out, ref_grads = run_grouped_mm(inputs, grad_out)
    assert reference.relative_error(out, ref_out) <= BAR
    aligned = (sorted_ids, expert_ids, total)
    for needs in [ALL, (False,) * 4, (True, False, False, True), (False, True, True, False)]:
        poison_allocator()
        result = torch.ops.prime_moe.moe_backward(
            grad_out, x, w, w2, *aligned, weights, z, pair_to_row, k, *needs, False
        )
        for name, need, ours, ref in zip(GRAD_NAMES, needs, result, ref_grads):
            if not need:
                assert ours.shape == (0,), f"{name}: not asked for, got shape {ours.shape}"
                continue
            assert ours.shape == ref.shape and ours.dtype == ref.dtype, name
            assert torch.isfinite(ours).all(), name
            assert reference.relative_error(ours, ref) <= BAR, name


@pytest.mark.sanitize
@pytest.mark.parametrize("overwrite_z", [False, True], ids=["keep_z", "overwrite_z"])
def test_backward_garbage_routing_never_goes_out_of_bounds(flash_moe, seed, overwrite_z):
    """Whatever sorted_token_ids, expert_ids, the padded total and pair_to_row hold (moe_backward
    checks their shapes and trusts their values), the backward's kernels only touch valid
    memory (compute-sanitizer memcheck runs this) and return; the numbers are unspecified."""
    inputs, grad_out = make_inputs(200, 128, 64, 4, 2, "uniform", seed)
    x, w, w2, ids, weights = inputs
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, 4)
    _, z, pair_to_row = torch.ops.prime_moe.moe_forward(
        x, w, w2, sorted_ids, expert_ids, total, weights, 2
    )
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def junk(like, low, high):
        return torch.randint(low, high, like.shape, generator=generator, device="cuda").to(
            torch.int32
        )

    garbage = [
        (junk(sorted_ids, -5, 10**6), junk(expert_ids, -5, 100), junk(pair_to_row, -5, 10**6)),
        (junk(sorted_ids, -5, 2 * 200), junk(expert_ids, -1, 5), junk(pair_to_row, -5, 2000)),
    ]
    for bad_sorted, bad_experts, bad_rows in garbage:
        for bad_total in (10**7, -3, int(total.item())):
            result = torch.ops.prime_moe.moe_backward(
                grad_out, x, w, w2, bad_sorted, bad_experts, torch.full_like(total, bad_total),
                weights, z.clone(), bad_rows, 2, *ALL, overwrite_z,
            )  # fmt: skip
            torch.cuda.synchronize()
            assert [g.shape for g in result] == [x.shape, w.shape, w2.shape, weights.shape]


@pytest.mark.sanitize
def test_no_tokens(flash_moe):
    """T = 0 (an expert-parallel rank that got no tokens): out is (0, D), dx and
    dtopk_weights are empty, dw and dw2 are zeros of their full shape."""
    D, H, E, k = 256, 128, 8, 2
    x = torch.empty(0, D, dtype=torch.bfloat16, device="cuda")
    w = (0.05 * torch.randn(E, 2 * H, D, device="cuda")).bfloat16()
    w2 = (0.05 * torch.randn(E, D, H, device="cuda")).bfloat16()
    ids = torch.empty(0, k, dtype=torch.int32, device="cuda")
    weights = torch.empty(0, k, device="cuda")
    grad_out = torch.empty(0, D, dtype=torch.bfloat16, device="cuda")
    out, (dx, dw, dw2, dtw) = run_moe(flash_moe, [x, w, w2, ids, weights], grad_out)
    torch.cuda.synchronize()
    assert out.shape == (0, D) and out.dtype == torch.bfloat16
    assert dx.shape == (0, D) and dtw.shape == (0, k)
    assert dw.shape == w.shape and dw2.shape == w2.shape
    assert (dw == 0).all() and (dw2 == 0).all()


@pytest.mark.parametrize(
    ("T", "D", "H", "E", "k", "kind"),
    [
        (512, 256, 128, 4, 2, "softmax"),  # the consumer's shape and routing
        (1000, 512, 256, 16, 4, "dropped"),
        (300, 256, 128, 16, 16, "uniform"),  # 300 rows an expert: the widened weights
        (1200, 256, 128, 4, 2, "softmax"),  # the consumer's routing at 600 rows an expert
    ],
)
def test_mxfp8_forward_and_gradients(flash_moe, seed, T, D, H, E, k, kind):
    """moe(mxfp8=True): out is fused_moe_mxfp8's on x, w and w2 quantized as the consumer
    quantizes them (RCEIL, weights' scales blocked), bit for bit (above 256 rows an expert it
    quantizes and widens them back in one pass and runs the widened path's kernels on the bf16
    values); the gradients are the bf16 layer's at the unquantized inputs, bit for bit those of
    moe(mxfp8=False), and a frozen input gets none."""
    inputs, grad_out = make_inputs(T, D, H, E, k, kind, seed)
    x, w, w2, ids, weights = inputs
    out, grads = run_moe(flash_moe, inputs, grad_out, mxfp8=True)

    xq, xs = flash_moe.quantize_mxfp8(x)
    wq, ws = flash_moe.quantize_mxfp8(w, blocked=True)
    w2q, w2s = flash_moe.quantize_mxfp8(w2, blocked=True)
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, E)
    want = torch.full_like(x, float("nan"))
    flash_moe.fused_moe_mxfp8(
        xq, xs, wq, ws, w2q, w2s, sorted_ids, expert_ids, total, weights, want, k, split=True
    )
    assert torch.equal(out, want), "moe(mxfp8=True) is not fused_moe_mxfp8 on its quantized inputs"

    _, bf16_grads = run_moe(flash_moe, inputs, grad_out)
    for name, a, b in zip(GRAD_NAMES, grads, bf16_grads):
        assert a is not None and torch.equal(a, b), f"{name} differs from the bf16 backward's"

    frozen = (True, False, False, True)
    _, some = run_moe(flash_moe, inputs, grad_out, frozen, mxfp8=True)
    for name, need, a, b in zip(GRAD_NAMES, frozen, some, bf16_grads):
        assert (a is None) != need, f"{name}: requires_grad={need}, got {a is not None}"
        if need:
            assert torch.equal(a, b), f"{name} differs with w, w2 frozen"


def test_mxfp8_shape_rules(flash_moe, seed):
    """A layer unsupported_shape_reason(mxfp8=True) refuses is refused by moe(mxfp8=True),
    naming the dimension."""
    assert flash_moe.unsupported_shape_reason(192, 128, mxfp8=True) is not None
    inputs, _ = make_inputs(16, 192, 128, 4, 2, "uniform", seed)
    x, w, w2, ids, weights = inputs
    with pytest.raises((ValueError, RuntimeError), match="dim=192"):
        flash_moe.moe(x, w, w2, ids, weights, mxfp8=True)


def test_opcheck_moe_forward_mxfp8(flash_moe, seed):
    """opcheck of moe_forward_mxfp8: schema, autograd registration and fake kernel."""
    inputs, _ = make_inputs(100, 256, 128, 4, 2, "uniform", seed)
    x, w, w2, ids, weights = inputs
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, 4)
    x, w, w2, weights = (t.detach().requires_grad_() for t in (x, w, w2, weights))
    args = (x, w, w2, sorted_ids, expert_ids, total, weights, 2)
    torch.library.opcheck(
        torch.ops.prime_moe.moe_forward_mxfp8.default, args, test_utils=FORWARD_UTILS
    )


def test_torch_compile_fullgraph_mxfp8(flash_moe, seed):
    """torch.compile(fullgraph=True) of moe(mxfp8=True) plus a loss: eager's gradients."""
    torch._dynamo.reset()
    inputs, _ = make_inputs(256, 256, 128, 8, 2, "softmax", seed)
    g = torch.randn(256, 256, device="cuda")

    def loss(x, w, w2, ids, weights, g):
        return (flash_moe.moe(x, w, w2, ids, weights, mxfp8=True).float() * g).sum()

    eager_loss, eager_grads = loss_and_grads(loss, inputs, g)
    compiled = torch.compile(loss, fullgraph=True)
    got_loss, grads = loss_and_grads(compiled, inputs, g)
    assert math.isclose(got_loss, eager_loss, rel_tol=1e-4, abs_tol=1e-4)
    for name, a, b in zip(GRAD_NAMES, grads, eager_grads):
        assert a is not None and torch.equal(a, b), f"{name} differs from eager"
    torch._dynamo.reset()


# Not test_aot_dispatch_dynamic: it compares every output of an eager and a compiled call,
# and z's rows that no pair reaches (padding past the padded total, all-padding halves) are
# never written, since backward never reads them. The compile tests below run moe_forward
# through AOTAutograd and compare out and every gradient bitwise.
FORWARD_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")


def test_opcheck_moe_forward(flash_moe, seed):
    """opcheck of moe_forward with every input that has a gradient requiring grad: the
    schema, the autograd registration (register_autograd) and the fake kernel."""
    inputs, _ = make_inputs(100, 256, 128, 4, 2, "uniform", seed)
    x, w, w2, ids, weights = inputs
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, 4)
    x, w, w2, weights = (t.detach().requires_grad_() for t in (x, w, w2, weights))
    args = (x, w, w2, sorted_ids, expert_ids, total, weights, 2)
    torch.library.opcheck(torch.ops.prime_moe.moe_forward.default, args, test_utils=FORWARD_UTILS)


@pytest.mark.parametrize("needs", [ALL, (True, False, True, False)], ids=pattern_id)
def test_opcheck_moe_backward(flash_moe, seed, needs):
    """opcheck of moe_backward (not differentiable itself): schema, fake kernel (including
    the (0,) tensors of gradients not asked for) and AOTAutograd on plain inputs; the
    autograd registration with grad_out requiring grad (its outputs must not)."""
    inputs, grad_out = make_inputs(100, 256, 128, 4, 2, "uniform", seed)
    x, w, w2, ids, weights = inputs
    aligned = flash_moe.moe_align(ids, 4)
    _, z, pair_to_row = torch.ops.prime_moe.moe_forward(x, w, w2, *aligned, weights, 2)
    op = torch.ops.prime_moe.moe_backward.default
    args = (grad_out, x, w, w2, *aligned, weights, z, pair_to_row, 2, *needs)
    torch.library.opcheck(
        op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    )
    grad_args = (grad_out.detach().requires_grad_(), *args[1:])
    torch.library.opcheck(op, grad_args, test_utils=("test_autograd_registration",))


def loss_fn(flash_moe):
    def loss(x, w, w2, ids, weights, g):
        out = flash_moe.moe(x, w, w2, ids, weights)
        return (out.float() * g).sum()

    return loss


def loss_and_grads(fn, inputs, g):
    """fn's loss and its four gradients (the backward runs outside fn: AOTAutograd's
    compiled backward when fn is compiled)."""
    lx, lw, lw2, ltw = leaves(inputs, ALL)
    loss = fn(lx, lw, lw2, inputs[3], ltw, g)
    loss.backward()
    return loss.item(), [leaf.grad for leaf in (lx, lw, lw2, ltw)]


def test_torch_compile_fullgraph(flash_moe, seed):
    """torch.compile(fullgraph=True) of moe plus a loss: the same gradients as eager,
    bitwise (the same kernels on the same grad_out)."""
    torch._dynamo.reset()
    inputs, _ = make_inputs(256, 256, 128, 8, 2, "softmax", seed)
    g = torch.randn(256, 256, device="cuda")
    eager_loss, eager_grads = loss_and_grads(loss_fn(flash_moe), inputs, g)
    compiled = torch.compile(loss_fn(flash_moe), fullgraph=True)
    loss, grads = loss_and_grads(compiled, inputs, g)
    assert math.isclose(loss, eager_loss, rel_tol=1e-4, abs_tol=1e-4), (loss, eager_loss)
    for name, a, b in zip(GRAD_NAMES, grads, eager_grads):
        assert a is not None and torch.equal(a, b), f"{name} differs from eager"
    torch._dynamo.reset()


def test_torch_compile_dynamic_tokens(flash_moe, seed):
    """torch.compile(dynamic=True): three token counts through one compiled frame (a
    recompile is an error after the first), each with eager's gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(loss_fn(flash_moe), dynamic=True, fullgraph=True, backend=counter)
    for i, T in enumerate((64, 200, 333)):
        inputs, _ = make_inputs(T, 256, 128, 8, 2, "uniform", seed + i)
        g = torch.randn(T, 256, device="cuda")
        eager_loss, eager_grads = loss_and_grads(loss_fn(flash_moe), inputs, g)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            loss, grads = loss_and_grads(compiled, inputs, g)
        assert math.isclose(loss, eager_loss, rel_tol=1e-4, abs_tol=1e-4), (T, loss, eager_loss)
        for name, a, b in zip(GRAD_NAMES, grads, eager_grads):
            assert a is not None and torch.equal(a, b), f"T={T}: {name} differs from eager"
    assert counter.frame_count == 1, f"{counter.frame_count} frames compiled for 3 token counts"
    torch._dynamo.reset()


def restrict_to_experts(ids, experts):
    """ids renumbered to positions in ``experts`` (every other id becomes -1, dropped)."""
    remap = torch.full((int(ids.max()) + 2,), -1, dtype=torch.int32, device=ids.device)
    remap[experts.long()] = torch.arange(len(experts), dtype=torch.int32, device=ids.device)
    return torch.where(ids >= 0, remap[ids.long().clamp(min=0)], -1)


LARGE_FREE_BYTES = 100 << 30


def test_large_index_deepseek_v3_32_experts(flash_moe, seed):
    """LARGE (skipped unless >= 100 GiB of GPU memory is free): DeepSeek-V3's D = 7168,
    H = 2048 with E = 32, k = 8, T = 65536, so T * k * 2H = 2^31 and z has more than 2^31
    elements (every element offset of z, dz and the gate/up weights' gradients must be
    64-bit). Forward and backward finite; out, dx and dtopk_weights of a few tokens (those
    whose rows are last in z) and dw, dw2 of the last expert against the fp64 truth."""
    free, _ = torch.cuda.mem_get_info()
    if free < LARGE_FREE_BYTES:
        pytest.skip(f"needs {LARGE_FREE_BYTES >> 30} GiB of free GPU memory, {free >> 30} free")
    T, D, H, E, k = 65536, 7168, 2048, 32, 8
    assert T * k * 2 * H == 2**31
    assert flash_moe.moe_align_max_padded(T * k, E, flash_moe.BLOCK_M) * 2 * H > 2**31
    gpu = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale):
        return (scale * torch.randn(*shape, generator=gpu, device="cuda")).bfloat16()

    x = randn(T, D, scale=0.2)
    w = randn(E, 2 * H, D, scale=0.05)
    w2 = randn(E, D, H, scale=0.05)
    ids, weights = reference.routing(T, E, k, generator=gpu)
    grad_out = randn(T, D, scale=0.1)
    inputs = [x, w, w2, ids, weights]
    out, (dx, dw, dw2, dtw) = run_moe(flash_moe, inputs, grad_out, poison=False)
    for name, tensor in zip(("out", *GRAD_NAMES), (out, dx, dw, dw2, dtw)):
        assert torch.isfinite(tensor).all(), f"{name}: non-finite elements"

    # Tokens routed to the last expert have the last rows of z; add the first and last token.
    last = (ids == E - 1).any(dim=1).nonzero().squeeze(1)
    tokens = torch.cat([last[:2], last[-3:], torch.tensor([0, T - 1], device="cuda")]).unique()
    experts = ids[tokens].unique()
    sub_ids = restrict_to_experts(ids[tokens], experts)
    sub = (x[tokens], w[experts], w2[experts], sub_ids, weights[tokens])
    true_out = reference.moe_expert_loop_fp32(*sub, dtype=torch.float64)
    true_dx, _, _, true_dtw = reference.moe_backward_reference(
        *sub, grad_out[tokens], dtype=torch.float64
    )
    problems = []
    for name, ours, true in (
        ("out", out[tokens], true_out),
        ("dx", dx[tokens], true_dx),
        ("dtopk_weights", dtw[tokens], true_dtw),
    ):
        error = reference.relative_error(ours, true)
        if error > BAR:
            problems.append(f"{name} of tokens {tokens.tolist()}: error {error:.3e} vs fp64")

    # The last expert's weight gradients: the contributions of exactly its pairs.
    mine = (ids == E - 1).any(dim=1).nonzero().squeeze(1)
    e_ids = torch.where(ids[mine] == E - 1, 0, -1).int()
    _, true_dw, true_dw2, _ = reference.moe_backward_reference(
        x[mine], w[E - 1 :], w2[E - 1 :], e_ids, weights[mine], grad_out[mine], dtype=torch.float64
    )
    for name, ours, true in (("dw", dw[E - 1], true_dw[0]), ("dw2", dw2[E - 1], true_dw2[0])):
        error = reference.relative_error(ours, true)
        if error > BAR:
            problems.append(f"{name} of expert {E - 1}: error {error:.3e} vs fp64")
    assert not problems, "\n".join(problems)
