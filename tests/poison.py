"""NaN-filled free memory in the caching allocator, so that a kernel reading a workspace element it
never wrote sees NaN rather than a leftover zero."""

from __future__ import annotations

import torch

NAN_BF16_PAIRS = 0x7FC07FC0  # two bf16 NaNs per int32, a float32 NaN, a huge int32


def poison_allocator(large_bytes: int = 256 << 20, small_blocks: int = 64) -> None:
    """Leaves the caching allocator's free blocks full of NaN: one large block (the large
    pool, > 1 MiB requests) and ``small_blocks`` 1 MiB blocks (the small pool, which serves
    requests up to 1 MiB: pair_to_row, dtopk_weights and small workspaces come from there)."""
    torch.cuda.synchronize()
    large = torch.full((large_bytes // 4,), NAN_BF16_PAIRS, dtype=torch.int32, device="cuda")
    small = [
        torch.full((1 << 18,), NAN_BF16_PAIRS, dtype=torch.int32, device="cuda")
        for _ in range(small_blocks)
    ]
    del large, small
