"""The register-A MXFP8 forward's index math (tile.cuh RegisterAConsumers, mxfp8_loaders.cuh
Mxfp8WeightTilesRS, mma.cuh WarpgroupMainloopRS, epilogues.cuh transposed_pair), modelled on the
CPU: element ids instead of values, so a wrong address shows as a wrong id. Independent
definitions on the other side: TMA's 64-byte swizzle (address bits 7-8 into bits 4-5), mxfp8.py's
pack_scales_blocked, the wgmma A-fragment and accumulator layouts of the PTX ISA. Runs without a
GPU; it checks that the C++ formulas, transcribed here, address what they claim to."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prime_kernels.flash_moe import mxfp8

BLOCK_K = 64


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
        self.scale_blocks = block_n // 128 if block_n > 128 else 1
        self.weight_bytes = num_b * block_n * BLOCK_K
        # RegisterAConsumers
        self.split_rows = block_n >= 128
        self.mma_per_tile = block_n // 128 if self.split_rows else 1
        self.mma_m = num_b * self.mma_per_tile
        self.mma_n = block_m if self.split_rows else block_m // 2
        self.wg_rows = block_n // 2 if self.split_rows else block_n

    def m_offset(self, c):
        return 0 if self.split_rows else c * self.mma_n

    def n_offset(self, c):
        return c * self.wg_rows if self.split_rows else 0

    def block_row(self, mh):
        return (mh // self.mma_per_tile) * self.block_n + (mh % self.mma_per_tile) * 64


def stage_bytes(cfg: Config, weights, packed_scales, expert, kb):
    """Mxfp8WeightTilesRS::load: the stage's B buffer as ids (weights, then scale blocks)."""
    value_row = expert * cfg.rows_per_expert + cfg.n0
    out = []
    for b in range(cfg.num_b):
        first = value_row + b * cfg.second_offset
        box = np.full((cfg.block_n, 64), -1, dtype=np.int64)
        have = max(0, min(cfg.block_n, weights.shape[0] - first))
        box[:have] = weights[first : first + have, kb * BLOCK_K : (kb + 1) * BLOCK_K]
        out.append(sw64(box))
    scales = packed_scales[expert]
    row_tiles, col_tiles = cfg.rows_per_expert // 128, cfg.k_dim // 128
    blocks = []
    for b in range(cfg.num_b):
        row_tile = (cfg.n0 + b * cfg.second_offset) // 128
        for j in range(cfg.scale_blocks):
            t = min(row_tile + j, row_tiles - 1)
            at = (t * col_tiles + kb // 2) * 512
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
                tile = cfg.block_row(mh) // cfg.block_n
                row = cfg.block_row(mh) % cfg.block_n + cfg.n_offset(c) + 16 * warp + g
                value_at = (tile * cfg.block_n + row) * BLOCK_K + 2 * q
                r = cfg.n0 % 128 + row
                scale_at = (
                    cfg.weight_bytes
                    + (tile * cfg.scale_blocks + r // 128) * 512
                    + (r % 32) * 16
                    + (r % 128) // 32 * 4
                )
                for kk in range(4):
                    r0 = value_at + 16 * (kk ^ swizzle)
                    pieces = {
                        "r0_lo": smem[r0 : r0 + 2],
                        "r1_lo": smem[r0 + 8 * BLOCK_K : r0 + 8 * BLOCK_K + 2],
                        "r0_hi": smem[r0 + 8 : r0 + 10],
                        "r1_hi": smem[r0 + 8 * BLOCK_K + 8 : r0 + 8 * BLOCK_K + 10],
                    }
                    at = scale_at + 2 * (kb & 1) + kk // 2
                    s0, s1 = smem[at], smem[at + 128]
                    a = [pieces["r0_lo"], pieces["r1_lo"], pieces["r0_hi"], pieces["r1_hi"]]
                    result[(mh, kk, warp, lane)] = (a, s0, s1)
    return result


CONFIGS = [
    # (block_m, block_n, num_b, rows_per_expert, second_offset, k_dim, n0): H = D = 384
    (128, 128, 2, 768, 384, 256, 256),  # gate/up 128 x (128 + 128): rows split
    (128, 64, 2, 768, 384, 256, 64),  # gate/up block_n 64: the upper half of a scale block
    (64, 64, 2, 768, 384, 256, 128),
    (128, 256, 1, 384, 0, 384, 256),  # down: the last n tile, half past D
    (64, 128, 1, 384, 0, 384, 128),
]


@pytest.mark.parametrize("params", CONFIGS, ids=lambda p: "x".join(map(str, p[:3])))
def test_fragments_address_their_weights_and_scales(params):
    cfg = Config(*params)
    experts = 2
    rows, k = experts * cfg.rows_per_expert, cfg.k_dim
    weights = np.arange(rows * k, dtype=np.int64).reshape(rows, k)
    scale_ids = torch.arange(rows * (k // 32), dtype=torch.int64).reshape(experts, -1, k // 32)
    packed = mxfp8.pack_scales_blocked(scale_ids).reshape(experts, -1).numpy()
    expert = 1
    for kb in range(k // BLOCK_K):
        smem = stage_bytes(cfg, weights, packed, expert, kb)
        for c in range(2):
            frags = consumer_fragments(cfg, smem, c, kb)
            for (mh, kk, warp, lane), (a, s0, s1) in frags.items():
                g, q = lane // 4, lane % 4
                tile = cfg.block_row(mh) // cfg.block_n
                # PTX A fragment: a[0] = (16w + g, 2q..2q+1), a[1] = row + 8, a[2] = cols + 8,
                # a[3] = both.
                for reg in range(4):
                    m = 16 * warp + g + 8 * (reg % 2)
                    col0 = 2 * q + 8 * (reg // 2)
                    out_col = cfg.n0 + cfg.n_offset(c) + cfg.block_row(mh) % cfg.block_n + m
                    w_row = expert * cfg.rows_per_expert + tile * cfg.second_offset + out_col
                    if w_row >= (expert + 1) * cfg.rows_per_expert:
                        continue  # past the expert's rows: output columns the epilogue drops
                    k0 = kb * BLOCK_K + 16 * kk + col0
                    want = weights[w_row, k0 : k0 + 2]
                    assert list(a[reg]) == list(want), (params, c, mh, kk, warp, lane, reg)
                for s, m in ((s0, 16 * warp + g), (s1, 16 * warp + g + 8)):
                    out_col = cfg.n0 + cfg.n_offset(c) + cfg.block_row(mh) % cfg.block_n + m
                    row = tile * cfg.second_offset + out_col
                    if row >= cfg.rows_per_expert:
                        continue
                    block = (kb * BLOCK_K + 16 * kk) // 32
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


def test_mxfp8_block_reduction_spans_32_columns():
    """SwiGluToMxfp8::store_transposed: a token's amax combines lanes l, l ^ 8, l ^ 16, l ^ 24 of
    warps w and w ^ 1, whose columns are exactly one 32-column block."""
    for warp in range(4):
        for lane in range(32):
            g, q = lane // 4, lane % 4
            token = 2 * q + (g & 1)
            cols = set()
            for w2 in (warp, warp ^ 1):
                for l2 in (lane, lane ^ 8, lane ^ 16, lane ^ 24):
                    g2, q2 = l2 // 4, l2 % 4
                    assert 2 * q2 + (g2 & 1) == token
                    for i in range(2):
                        c = 16 * w2 + (g2 & ~1) + 8 * i
                        cols |= {c, c + 1}
            block = (16 * warp) // 32
            assert cols == set(range(32 * block, 32 * block + 32))
