"""A seeded random sweep of fused_moe_bf16 against reference.py: shapes, k, E, routing skew,
dropped ids, both split modes, block_m and block_n, with the bars of test_fused_moe_bf16.py.
Each case is reproducible from its index and PRIME_KERNELS_TEST_SEED (conftest's seed)."""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

from .test_fused_moe_bf16 import check, make_inputs

pytestmark = pytest.mark.gpu

NUM_CASES = int(os.environ.get("PRIME_KERNELS_FUZZ_CASES", "300"))
KINDS = ["uniform", "uniform", "zipf", "one_expert", "empty_experts", "dropped"]


def draw_case(index: int) -> dict:
    rng = random.Random(f"{os.environ.get('PRIME_KERNELS_TEST_SEED', '0')}:fuzz:{index}")
    E = rng.choice([1, 2, 3, 8, 16, 33, 64, 128])
    k = rng.randint(1, min(E, 16))
    return dict(
        T=rng.choice([1, 2, 7, 33, 100, 257, 600, 1500]),
        D=64 * rng.randint(1, 16),
        H=64 * rng.randint(1, 12),
        E=E,
        k=k,
        kind=rng.choice(KINDS),
        split=rng.random() < 0.5,
        block_m=rng.choice([64, 128]),
        block_n=rng.choice([None, 64, 128]),
    )


@pytest.mark.parametrize("index", range(NUM_CASES))
def test_random_case(flash_moe, index):
    case = draw_case(index)
    generator = torch.Generator().manual_seed(
        zlib.crc32(f"{os.environ.get('PRIME_KERNELS_TEST_SEED', '0')}:fuzz-data:{index}".encode())
    )
    inputs = make_inputs(
        case["T"], case["D"], case["H"], case["E"], case["k"], case["kind"], generator
    )
    try:
        check(
            flash_moe,
            inputs,
            split=case["split"],
            block_m=case["block_m"],
            block_n=case["block_n"],
        )
    except AssertionError as error:
        raise AssertionError(f"case {index} {case}: {error}") from None
