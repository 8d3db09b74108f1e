"""Shared test helpers. GPU tests carry the `gpu` marker and skip with the registry's own
reason wherever the kernel cannot run, so a skip says exactly why."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

import prime_kernels


def kernel_or_skip(name: str):
    """The loaded kernel module, or a skip carrying the registry's reason."""
    reason = prime_kernels.unavailable_reason(name)
    if reason is not None:
        pytest.skip(reason)
    return prime_kernels.load(name)


@pytest.fixture
def flash_moe():
    return kernel_or_skip("flash_moe")


@pytest.fixture
def seed(request):
    """A per-test seed: different inputs for every test, reproducible from the test's name
    and PRIME_KERNELS_TEST_SEED (set it to draw another set of inputs)."""
    base = os.environ.get("PRIME_KERNELS_TEST_SEED", "0")
    value = zlib.crc32(f"{base}:{request.node.nodeid}".encode()) % (2**31)
    torch.manual_seed(value)
    return value
