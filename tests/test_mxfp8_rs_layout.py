"""The register-A MXFP8 forward's index math (tile.cuh RegisterAConsumers, mxfp8_loaders.cuh
Mxfp8WeightTiles, mma.cuh WarpgroupMainloopRS, epilogues.cuh transposed_pair), modelled on the
CPU: element ids instead of values, so a wrong address shows as a wrong id. Independent
definitions on the other side: TMA's 64-byte swizzle (address bits 7-8 into bits 4-5), mxfp8.py's
pack_scales_blocked, the wgmma A-fragment and accumulator layouts of the PTX ISA. Runs without a
GPU; it checks that the C++ formulas, transcribed here, address what they claim to."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prime_kernels.flash_moe import mxfp8

BLOCK_K = 128  # MoeGemmTileRS::kBlockK: two 64-wide K atoms a stage


def sw64(rows: np.ndarray) -> np.ndarray:
    """A TMA box of (n, 64) byte ids as the 64-byte swizzle lays it in shared memory."""
    n = rows.shape[0]
    out = np.full(n * 64, -1, dtype=np.int64)
    for r in range(n):
        for c in range(64):
            out[64 * r + 16 * ((c // 16) ^ ((r >> 1) & 3)) + c % 16] = rows[r, c]
    return out


class Config:
    """A tile of the forward: gate/up (num_b = 2, weight rows gate h and up H + h) or down."""

    def __init__(self, block_m, block_n, num_b, rows_per_expert, second_offset, k_dim, n0):
        self.block_m, self.block_n, self.num_b = block_m, block_n, num_b
        self.rows_per_expert, self.second_offset, self.k_dim, self.n0 = (
            rows_per_expert,
            second_offset,
            k_dim,
            n0,
        )
        # MoeGemmTileRS: a 96-row tile may straddle two 128-row scale blocks
        self.scale_blocks = 2 if block_n == 96 else block_n // 128 if block_n > 128 else 1
        self.weight_atom_bytes = num_b * block_n * 64  # one 64-wide K atom's tiles
        self.weight_bytes = num_b * block_n * BLOCK_K
        self.warpgroups = block_n // 32 if num_b == 2 and block_n <= 96 else 2
        # RegisterAConsumers
        self.interleaved = num_b == 2 and block_n <= 96
        self.mma_per_tile = 1 if self.interleaved else block_n // 128
        self.mma_m = 1 if self.interleaved else num_b * self.mma_per_tile
        self.wg_rows = block_n // self.warpgroups

    def n_offset(self, c):
        return c * self.wg_rows

    def stage_row(self, mh, i, warp, g, row_offset):
        """RegisterAConsumers::stage_row, transcribed."""
        if self.interleaved:
            return i * self.block_n + row_offset + 8 * warp + g
        return (
            (mh // self.mma_per_tile) * self.block_n
            + (mh % self.mma_per_tile) * 64
            + row_offset
            + 16 * warp
            + 8 * i
            + g
        )

    def meaning(self, c, mh, m):
        """What the epilogues take accumulator row m of m64 block mh to be: (weight tile,
        output column). Down (StoreRows, WeightedAtomicAdd): column col0 + 64 mh + m. Gate/up,
        split rows: tile mh (gate, up), column col0 + m. Interleaved: row half i = (m / 8) % 2
        is the tile, column col0 + 8 (m / 16) + m % 8."""
        col0 = self.n0 + self.n_offset(c)
        if self.interleaved:
            return (m // 8) % 2, col0 + 8 * (m // 16) + m % 8
        if self.num_b == 2:
            return mh, col0 + m
        return 0, col0 + 64 * mh + m


def stage_bytes(cfg: Config, weights, packed_scales, expert, kb):
    """Mxfp8WeightTiles::load: the stage's B buffer as ids (weights, per 64-wide K atom the
    num_b tiles, then scale blocks)."""
    value_row = expert * cfg.rows_per_expert + cfg.n0
    out = []
    for atom in range(BLOCK_K // 64):
        col = kb * BLOCK_K + 64 * atom
        for b in range(cfg.num_b):
            first = value_row + b * cfg.second_offset
            box = np.full((cfg.block_n, 64), -1, dtype=np.int64)
            have = max(0, min(cfg.block_n, weights.shape[0] - first))
            box[:have] = weights[first : first + have, col : col + 64]
            out.append(sw64(box))
    scales = packed_scales[expert]
    row_tiles, col_tiles = cfg.rows_per_expert // 128, cfg.k_dim // 128
    blocks = []
    for b in range(cfg.num_b):
        row_tile = (cfg.n0 + b * cfg.second_offset) // 128
        for j in range(cfg.scale_blocks):
            t = min(row_tile + j, row_tiles - 1)
            at = (t * col_tiles + kb * BLOCK_K // 128) * 512
            blocks.append(scales[at : at + 512])
    return np.concatenate(out + blocks)


def consumer_fragments(cfg: Config, smem, c, kb):
    """WarpgroupMainloopRS: per (mh, kk, warp, lane) the ids of a[0..3]'s 8 halves and of the two
    scale bytes (rows r0, r1)."""
    result = {}
    for warp in range(4):
        for lane in range(32):
            g, q = lane // 4, lane % 4
            swizzle = (g >> 1) & 3
            for mh in range(cfg.mma_m):
                value_at, scale_at = [], []
                for i in range(2):
                    row = cfg.stage_row(mh, i, warp, g, cfg.n_offset(c))
                    assert (row >> 1) & 3 == swizzle  # the mainloop's one swizzle per thread
                    tile = row // cfg.block_n
                    value_at.append(row * 64 + 2 * q)
                    r = cfg.n0 % 128 + row % cfg.block_n
                    scale_at.append(
                        cfg.weight_bytes
                        + (tile * cfg.scale_blocks + r // 128) * 512
                        + (r % 32) * 16
                        + (r % 128) // 32 * 4
                    )
                # the 4-byte scale reads: the stage's four columns
                for kk in range(BLOCK_K // 16):
                    chunk = (kk // 4) * cfg.weight_atom_bytes + 16 * ((kk % 4) ^ swizzle)
                    r0 = value_at[0] + chunk
                    r1 = value_at[1] + chunk
                    a = [smem[r0 : r0 + 2], smem[r1 : r1 + 2], smem[r0 + 8 : r0 + 10]]
                    a.append(smem[r1 + 8 : r1 + 10])
                    s0 = smem[scale_at[0] + kk // 2]
                    s1 = smem[scale_at[1] + kk // 2]
                    result[(mh, kk, warp, lane)] = (a, s0, s1)
    return result


CONFIGS = [
    # (block_m, block_n, num_b, rows_per_expert, second_offset, k_dim, n0): H = D = 384
    (128, 128, 2, 768, 384, 256, 256),  # gate/up 128 x (128 + 128): rows split
    (128, 64, 2, 768, 384, 256, 64),  # gate/up block_n 64 (interleaved): upper scale half
    (64, 64, 2, 768, 384, 256, 128),
    (128, 96, 2, 768, 384, 256, 96),  # three warpgroups, interleaved: rows 96-191, two blocks
    (128, 96, 2, 768, 384, 256, 288),  # rows 288-383: the upper three quarters of one block
    (128, 256, 1, 384, 0, 384, 256),  # down: the last n tile, half past D
    (64, 128, 1, 384, 0, 384, 128),
]


def numbered_weights(cfg, experts=2):
    """Two experts' weights numbered by flat index (rows, K), their scales' ids (expert, row, K /
    32), and those packed in the blocked layout, per expert: each value names where it came from."""
    rows, k = experts * cfg.rows_per_expert, cfg.k_dim
    weights = np.arange(rows * k, dtype=np.int64).reshape(rows, k)
    scale_ids = torch.arange(rows * (k // 32), dtype=torch.int64).reshape(experts, -1, k // 32)
    return weights, scale_ids, mxfp8.pack_scales_blocked(scale_ids).reshape(experts, -1).numpy()


@pytest.mark.parametrize("params", CONFIGS, ids=lambda p: "x".join(map(str, p[:3])))
def test_fragments_address_their_weights_and_scales(params):
    cfg = Config(*params)
    weights, scale_ids, packed = numbered_weights(cfg)
    expert = 1
    for kb in range(cfg.k_dim // BLOCK_K):
        smem = stage_bytes(cfg, weights, packed, expert, kb)
        for c in range(cfg.warpgroups):
            frags = consumer_fragments(cfg, smem, c, kb)
            for (mh, kk, warp, lane), (a, s0, s1) in frags.items():
                g, q = lane // 4, lane % 4
                # PTX A fragment: a[0] = (row 16w + g, columns 2q, 2q + 1), a[1] = row + 8,
                # a[2] = columns + 8, a[3] = both; the row means what the epilogue says.
                for reg in range(4):
                    m = 16 * warp + g + 8 * (reg % 2)
                    tile, out_col = cfg.meaning(c, mh, m)
                    row = tile * cfg.second_offset + out_col  # the expert's weight row
                    if out_col >= cfg.rows_per_expert // (2 if cfg.num_b == 2 else 1):
                        continue  # past the GEMM's N: output columns the epilogue drops
                    k0 = kb * BLOCK_K + 16 * kk + 2 * q + 8 * (reg // 2)
                    want = weights[expert * cfg.rows_per_expert + row, k0 : k0 + 2]
                    assert list(a[reg]) == list(want), (params, c, mh, kk, warp, lane, reg)
                    if reg < 2:  # the row's scale: s0 for r0, s1 for r1
                        block = (kb * BLOCK_K + 16 * kk) // 32
                        s = s0 if reg == 0 else s1
                        assert s == scale_ids[expert, row, block].item(), (params, c, mh, kk, lane)


def transposed_pair_model(n_tokens):
    """transposed_pair over a warpgroup: per (warp, lane, i, j) the (column, token) ids its two
    values carry, given the accumulator layout (register 4j + 2i + c: row 16w + g + 8i, column
    8j + 2q + c) and the shuffle with lane ^ 4."""
    acc = {}
    for warp in range(4):
        for lane in range(32):
            g, q = lane // 4, lane % 4
            for j in range(n_tokens // 8):
                for i in range(2):
                    for cc in range(2):
                        acc[(warp, lane, 4 * j + 2 * i + cc)] = (
                            16 * warp + g + 8 * i,
                            8 * j + 2 * q + cc,
                        )
    out = {}
    for warp in range(4):
        for lane in range(32):
            odd = (lane // 4) & 1
            for j in range(n_tokens // 8):
                for i in range(2):
                    c0, c1 = acc[(warp, lane, 4 * j + 2 * i)], acc[(warp, lane, 4 * j + 2 * i + 1)]
                    partner = lane ^ 4
                    p0 = acc[(warp, partner, 4 * j + 2 * i)]
                    p1 = acc[(warp, partner, 4 * j + 2 * i + 1)]
                    other = p1 if (partner // 4) & 1 == 0 else p0  # what the partner sends
                    out[(warp, lane, i, j)] = (other, c1) if odd else (c0, other)
    return out


@pytest.mark.parametrize("n_tokens", [32, 64, 128])
def test_transposed_pairs_cover_the_tile_once(n_tokens):
    seen = set()
    for (warp, lane, i, j), (x, y) in transposed_pair_model(n_tokens).items():
        g, q = lane // 4, lane % 4
        token = 8 * j + 2 * q + (g & 1)  # transposed_token
        column = 16 * warp + (g & ~1) + 8 * i  # transposed_column
        assert x == (column, token) and y == (column + 1, token)
        seen |= {x, y}
    assert seen == {(m, t) for m in range(64) for t in range(n_tokens)}


@pytest.mark.parametrize("interleaved", [False, True], ids=["split", "interleaved"])
def test_mxfp8_block_reduction_spans_32_columns(interleaved):
    """SwiGluToMxfp8::store_transposed: a token's amax combines lanes l, l ^ 8, l ^ 16, l ^ 24 of
    warps w and w ^ 1 (split rows: h = 16 w + (g & ~1) + 8 i + {0, 1}) or of all 4 warps
    (interleaved: h = 8 w + (g & ~1) + {0, 1}), whose columns are exactly one 32-column block."""
    for warp in range(4):
        for lane in range(32):
            g, q = lane // 4, lane % 4
            token = 2 * q + (g & 1)
            cols = set()
            warps = range(4) if interleaved else (warp, warp ^ 1)
            for w2 in warps:
                for l2 in (lane, lane ^ 8, lane ^ 16, lane ^ 24):
                    g2, q2 = l2 // 4, l2 % 4
                    assert 2 * q2 + (g2 & 1) == token
                    for i in range(1 if interleaved else 2):
                        c = (8 * w2 if interleaved else 16 * w2 + 8 * i) + (g2 & ~1)
                        cols |= {c, c + 1}
            block = 0 if interleaved else (16 * warp) // 32
            assert cols == set(range(32 * block, 32 * block + 32))


def mxfp8_f16_position(j: int) -> int:
    """mxfp8_fragment.cuh's mxfp8_f16_position, transcribed: where x's pre-pass puts element j of
    a 32-wide block of the f16 token rows."""
    return 16 * ((j % 8) // 4) + 8 * ((j % 4) // 2) + 2 * (j // 8) + j % 2


def test_f16_block_order_is_a_pairwise_permutation():
    """mxfp8_x_to_f16_kernel stores the f16x2 of elements (j, j + 1), j even, as one word at
    position mxfp8_f16_position(j): a permutation of the block that keeps those pairs together."""
    positions = [mxfp8_f16_position(j) for j in range(32)]
    assert sorted(positions) == list(range(32))
    for j in range(0, 32, 2):
        assert positions[j] % 2 == 0 and positions[j + 1] == positions[j] + 1


@pytest.mark.parametrize("params", [(64, 64, 2, 768, 384, 256, 128)], ids=["64x64x2"])
def test_f16_loop_reads_the_blocks_pre_pass_order(params):
    """WarpgroupMainloopF16 with 8-byte reads (the decode gate/up tile): thread (warp, lane) of
    consumer c reads bytes 8 (q % 2) of 16-byte chunk 2 (b % 2) + q / 2 (swizzled) of its rows'
    K atom b / 2, and takes bytes 4 s .. 4 s + 3 as k16 step s's a[0] / a[2] pairs. Its fragment
    register reg of step s must then hold, at wgmma column p, the weight of the K index whose token
    value the pre-pass put at p: element j of the block with mxfp8_f16_position(j) = p."""
    cfg = Config(*params)
    weights, _, packed = numbered_weights(cfg)
    element_at = {mxfp8_f16_position(j): j for j in range(32)}
    expert = 1
    for kb in range(cfg.k_dim // BLOCK_K):
        smem = stage_bytes(cfg, weights, packed, expert, kb)
        for c in range(2):
            for warp in range(4):
                for lane in range(32):
                    g, q = lane // 4, lane % 4
                    swizzle = (g >> 1) & 3
                    value_at = [
                        cfg.stage_row(0, i, warp, g, cfg.n_offset(c)) * 64 + 8 * (q & 1)
                        for i in range(2)
                    ]
                    block_chunk = [16 * ((q >> 1) ^ swizzle), 16 * ((2 + (q >> 1)) ^ swizzle)]
                    for b in range(BLOCK_K // 32):
                        chunk = (b // 2) * cfg.weight_atom_bytes + block_chunk[b % 2]
                        w = [smem[v + chunk : v + chunk + 8] for v in value_at]  # rows r0, r1
                        for s in range(2):
                            a = [w[0][4 * s : 4 * s + 2], w[1][4 * s : 4 * s + 2]]
                            a += [w[0][4 * s + 2 : 4 * s + 4], w[1][4 * s + 2 : 4 * s + 4]]
                            for reg in range(4):
                                m = 16 * warp + g + 8 * (reg % 2)
                                tile, out_col = cfg.meaning(c, 0, m)
                                row = expert * cfg.rows_per_expert + tile * cfg.second_offset
                                p = 16 * s + 2 * q + 8 * (reg // 2)
                                cols = [kb * BLOCK_K + 32 * b + element_at[p + e] for e in (0, 1)]
                                want = weights[row + out_col, cols]
                                assert list(a[reg]) == list(want), (c, warp, lane, b, s, reg)
