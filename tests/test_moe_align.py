"""moe_align on the GPU against the pure-PyTorch reference: exact equality, over uniform,
Zipf-skewed and single-expert routing, T=1, empty experts and dropped ids."""

from __future__ import annotations

import pytest
import torch

from prime_kernels.flash_moe import reference

pytestmark = pytest.mark.gpu

POISON = 0x7EADBEEF


def poison_allocator(nbytes: int = 64 << 20) -> None:
    """Leave the caching allocator's free blocks full of a poison pattern, so an output
    element the op forgets to write shows up as that pattern, not as a lucky zero."""
    block = torch.full((nbytes // 4,), POISON, dtype=torch.int32, device="cuda")
    del block


def zipf_ids(T, E, k, generator):
    """Each token's k distinct experts drawn with probability ~ 1 / rank^1.2."""
    weights = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
    weights = weights[torch.randperm(E, generator=generator)]
    ids = torch.multinomial(weights.expand(T, E), k, replacement=False, generator=generator)
    return ids.to(torch.int32)


def make_ids(kind, T, E, k, generator):
    if kind == "uniform":
        return reference.routing(T, E, k, generator=generator)[0]
    if kind == "zipf":
        return zipf_ids(T, E, k, generator)
    if kind == "one_expert":
        return torch.full((T, k), E // 2, dtype=torch.int32)
    if kind == "empty_experts":  # only even experts get tokens
        return (torch.randint(0, max(E // 2, 1), (T, k), generator=generator) * 2 % E).int()
    if kind == "dropped":  # ids outside [0, E): -1, E, large, very negative
        ids = reference.routing(T, E, k, generator=generator)[0]
        mask = torch.rand(T, k, generator=generator) < 0.3
        bad = torch.tensor([-1, E, E + 7, -(2**31), 2**31 - 1], dtype=torch.int32)
        choice = bad[torch.randint(0, len(bad), (T, k), generator=generator)]
        return torch.where(mask, choice, ids)
    raise ValueError(kind)


def check_against_reference(flash_moe, ids, E, block_m, bpc):
    poison_allocator()
    got = flash_moe.moe_align(ids, E, block_m, bpc)
    want = reference.moe_align_reference(ids, E, block_m, bpc)
    for name, a, b in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), got, want):
        assert a.dtype == torch.int32 and a.device == ids.device, name
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        mismatch = (a != b).nonzero()
        assert mismatch.numel() == 0, (
            f"{name}: {mismatch.shape[0]} of {a.numel()} elements differ, first at "
            f"{mismatch[0].item()}: got {a[mismatch[0]].item()}, want {b[mismatch[0]].item()}"
        )
    return got


@pytest.mark.sanitize
@pytest.mark.parametrize("kind", ["uniform", "zipf", "one_expert", "empty_experts", "dropped"])
# moe_align runs in one block while its runs of consecutive pairs (up to 32 runs of at most 8
# steps of 32 pairs, runs x E <= 8192 bins) hold them all and the padded length is at most 65536,
# past that in three passes: (1024, 32, 4), (1000, 128, 8) and (1024, 128, 8) take the one block
# with 32 runs of 4, 8 (the last one short) and 8 (all full) steps, (1200, 128, 8) and
# (4096, 64, 4) the passes.
@pytest.mark.parametrize(
    ("T", "E", "k"),
    [
        (1, 8, 2),
        (7, 4, 1),
        (1024, 32, 4),
        (1000, 128, 8),
        (1024, 128, 8),
        (1200, 128, 8),
        (4096, 64, 4),
    ],
)
def test_routing_kinds(flash_moe, seed, kind, T, E, k):
    generator = torch.Generator().manual_seed(seed)
    ids = make_ids(kind, T, E, min(k, E), generator).cuda()
    check_against_reference(flash_moe, ids, E, flash_moe.BLOCK_M, 1)


@pytest.mark.parametrize("T", [500, 3000])  # one block, and the three passes
@pytest.mark.parametrize(("block_m", "bpc"), [(64, 1), (128, 2), (16, 4), (256, 1)])
def test_block_sizes(flash_moe, seed, T, block_m, bpc):
    generator = torch.Generator().manual_seed(seed)
    ids = make_ids("zipf", T, 32, 4, generator).cuda()
    check_against_reference(flash_moe, ids, 32, block_m, bpc)


# Past 256 experts the one block has fewer runs (8192 bins / E), so fewer pairs: 8 runs of 7 steps
# at E = 1024, 2 of 8 (full, then one pair over: the passes) at E = 4096. block_m = 16 keeps the
# padded length within the one block's 65536 rows; E = 1024 stays within the 40960 rows it builds
# in shared memory, E = 4096 at T = 64 (61952 rows) writes them to global memory directly.
@pytest.mark.sanitize
@pytest.mark.parametrize(("T", "E", "k"), [(200, 1024, 8), (64, 4096, 8), (65, 4096, 8)])
def test_one_block_with_many_experts(flash_moe, seed, T, E, k):
    generator = torch.Generator().manual_seed(seed)
    ids = make_ids("zipf", T, E, k, generator).cuda()
    check_against_reference(flash_moe, ids, E, 16, 1)


# The offsets pass splits each expert's chunk counts into runs: 32 at E = 1 over 40 chunks, 3 at
# E = 300, one at E = 1024 (the last count whose scatter keeps its next rows in shared memory).
@pytest.mark.parametrize(
    ("T", "E", "k"),
    [
        (32768, 128, 8),
        (20000, 4096, 8),
        (300, 1, 1),
        (8192, 4095, 2),
        (40000, 1, 1),
        (20000, 300, 4),
        (20000, 1024, 8),
    ],
)
def test_large_and_extreme_expert_counts(flash_moe, seed, T, E, k):
    generator = torch.Generator().manual_seed(seed)
    ids = make_ids("uniform" if k <= E else "one_expert", T, E, k, generator).cuda()
    check_against_reference(flash_moe, ids, E, flash_moe.BLOCK_M, 1)


def test_no_tokens(flash_moe):
    ids = torch.empty(0, 8, dtype=torch.int32, device="cuda")
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, 16)
    assert total.item() == 0
    assert (sorted_ids == -1).all() and (expert_ids == -1).all()


def test_no_tokens_under_graph_capture(flash_moe):
    ids = torch.empty(0, 4, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sorted_ids, expert_ids, total = flash_moe.moe_align(ids, 16, 64, 2)
    for t in (sorted_ids, expert_ids, total):
        t.fill_(POISON)
    graph.replay()
    want = reference.moe_align_reference(ids, 16, 64, 2)
    assert all(torch.equal(a, b) for a, b in zip((sorted_ids, expert_ids, total), want))


def test_padded_length_at_the_limit(flash_moe):
    """The largest moe_align its padded-length check admits (one pair more is refused, see
    bad_arguments.py): 256 experts padded to 65536 rows, 2^31 - 2^24 pairs, rows up to
    2^31 - 2^16. Routing is monotone in the pair index, so every segment is known exactly."""
    E, block_m, bpc = 256, 1024, 64
    pad = block_m * bpc
    n = flash_moe.MAX_ROWS // pad * pad - E * (pad - 1)
    max_padded = flash_moe.moe_align_max_padded(n, E, pad)
    assert max_padded <= flash_moe.MAX_ROWS < flash_moe.moe_align_max_padded(n + 1, E, pad)
    first = [-(-e * n // E) for e in range(E + 1)]  # first pair of expert e: ceil(e * n / E)
    ids = torch.empty(n, 1, dtype=torch.int32, device="cuda")
    for e in range(E):
        ids[first[e] : first[e + 1]] = e
    sorted_ids, expert_ids, total = flash_moe.moe_align(ids, E, block_m, bpc)
    del ids
    assert sorted_ids.shape == (max_padded,) and expert_ids.shape == (max_padded // block_m,)
    start = 0
    want_experts = torch.full((max_padded // block_m,), -1, dtype=torch.int32, device="cuda")
    for e in range(E):
        count = first[e + 1] - first[e]
        padded = -(-count // pad) * pad
        segment = sorted_ids[start : start + padded]
        assert torch.equal(
            segment[:count],
            torch.arange(first[e], first[e + 1], dtype=torch.int32, device="cuda"),
        ), f"expert {e}: rows {start}..{start + count} out of order"
        assert (segment[count:] == -1).all(), f"expert {e}: padding rows not -1"
        want_experts[start // block_m : (start + padded) // block_m] = e
        start += padded
    assert total.item() == start and (sorted_ids[start:] == -1).all()
    assert torch.equal(expert_ids, want_experts)


def test_deterministic(flash_moe, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = make_ids("zipf", 8192, 128, 8, generator).cuda()
    first = flash_moe.moe_align(ids, 128)
    for _ in range(5):
        again = flash_moe.moe_align(ids, 128)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_cuda_graph_capture(flash_moe, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = make_ids("uniform", 2048, 64, 8, generator).cuda()
    flash_moe.moe_align(ids, 64)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_moe.moe_align(ids, 64)
    ids.copy_(make_ids("zipf", 2048, 64, 8, generator).cuda())
    graph.replay()
    want = reference.moe_align_reference(ids, 64)
    assert all(torch.equal(a, b) for a, b in zip(captured, want))


def test_torch_compile_fullgraph(flash_moe, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = make_ids("uniform", 512, 16, 2, generator).cuda()
    compiled = torch.compile(lambda t: flash_moe.moe_align(t, 16), fullgraph=True)
    got = compiled(ids)
    want = reference.moe_align_reference(ids, 16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_opcheck(flash_moe, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = make_ids("uniform", 300, 16, 4, generator).cuda()
    torch.library.opcheck(torch.ops.prime_moe.moe_align.default, (ids, 16, 128, 1))
    torch.library.opcheck(torch.ops.prime_moe.moe_align.default, (ids, 16, 64, 2))
