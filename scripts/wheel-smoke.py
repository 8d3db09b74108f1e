"""Run from outside the repository with only an installed wheel on sys.path: proves the
wheel imports under this torch and runs moe_align on this GPU (scripts/gpu-check wheel)."""

import json

import torch

import prime_kernels

print("prime_kernels from", prime_kernels.__file__)
assert "site-packages" in prime_kernels.__file__ or "pk-wheel" in prime_kernels.__file__, (
    "imported the source tree, not the wheel"
)
print("torch", torch.__version__, "| build record", json.dumps(prime_kernels.build_info()))
print("status", prime_kernels.status())
flash_moe = prime_kernels.load("flash_moe")
from prime_kernels.flash_moe import reference  # noqa: E402

T, E, k = 4096, 128, 8
topk_ids, _ = reference.routing(T, E, k, device="cuda")
got = flash_moe.moe_align(topk_ids, E, flash_moe.BLOCK_M)
want = reference.moe_align_reference(topk_ids, E, flash_moe.BLOCK_M)
for name, a, b in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), got, want):
    assert torch.equal(a, b), f"{name} differs from the reference"
print(f"moe_align from the wheel matches the reference at T={T}, E={E}, k={k}: ok")
