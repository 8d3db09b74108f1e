"""flash_moe's Python surface on any machine: constants from C++, shape rules, fake
implementations under FakeTensorMode, and the binding's input checks (CPU tensors reach the
same checks as CUDA ones)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from prime_kernels import flash_moe
from prime_kernels.flash_moe import _constants

needs_extension = pytest.mark.skipif(
    not flash_moe.EXTENSION_BUILT, reason="flash_moe is not compiled into this install"
)


@needs_extension
def test_python_mirror_equals_the_extension():
    from prime_kernels.flash_moe import _C

    names = ("BLOCK_M", "MXFP8_SCALE_BLOCK", "DIM_MULTIPLE", "HIDDEN_MULTIPLE", "MAX_EXPERTS")
    assert {n: getattr(_C, n) for n in names} == {n: getattr(_constants, n) for n in names}
    assert flash_moe.BLOCK_M == _C.BLOCK_M == 128
    assert flash_moe.MXFP8_SCALE_BLOCK == 32


@pytest.mark.parametrize(
    ("dim", "hidden_dim", "kwargs", "expected"),
    [
        (2048, 768, {}, None),
        (7168, 2048, {}, None),
        (4096, 14336, {"split": False}, None),
        (256, 128, {}, None),
        (64, 64, {}, None),
        (96, 128, {}, "dim=96 must be a positive multiple of 64"),
        (2048, 800, {}, "hidden_dim=800 must be a positive multiple of 64"),
        (0, 128, {}, "dim=0 must be a positive multiple"),
        (2048, 768, {"mxfp8": True}, "flash_moe has no MXFP8 kernel for sm_90"),
    ],
)
def test_unsupported_shape_reason(dim, hidden_dim, kwargs, expected):
    reason = flash_moe.unsupported_shape_reason(dim, hidden_dim, **kwargs)
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and reason.startswith(expected), reason


@pytest.mark.parametrize(
    ("T", "k", "E", "block_m", "bpc"),
    [(1, 1, 1, 128, 1), (512, 2, 4, 128, 1), (1000, 8, 128, 64, 2)],
)
@needs_extension
def test_moe_align_fake_shapes(T, k, E, block_m, bpc):
    with FakeTensorMode():
        ids = torch.empty(T, k, dtype=torch.int32, device="cuda")
        sorted_ids, expert_ids, total = flash_moe.moe_align(ids, E, block_m, bpc)
    pad = block_m * bpc
    max_padded = -(-(T * k + E * (pad - 1)) // pad) * pad
    assert sorted_ids.shape == (max_padded,) and sorted_ids.dtype == torch.int32
    assert expert_ids.shape == (max_padded // block_m,) and expert_ids.dtype == torch.int32
    assert total.shape == (1,) and total.dtype == torch.int32
    assert sorted_ids.device.type == "cuda"


@needs_extension
def test_fused_moe_bf16_fake_returns_out():
    T, D, H, E, k = 7, 256, 128, 4, 2
    with FakeTensorMode():
        x = torch.empty(T, D, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(E, 2 * H, D, dtype=torch.bfloat16, device="cuda")
        w2 = torch.empty(E, D, H, dtype=torch.bfloat16, device="cuda")
        ids = torch.empty(T, k, dtype=torch.int32, device="cuda")
        tw = torch.empty(T, k, dtype=torch.float32, device="cuda")
        sorted_ids, expert_ids, total = flash_moe.moe_align(ids, E)
        out = torch.empty(T, D, dtype=torch.bfloat16, device="cuda")
        result = flash_moe.fused_moe_bf16(x, w, w2, sorted_ids, expert_ids, total, tw, out, k)
    assert result is out


def cpu_args(T=8, D=256, H=128, E=4, k=2):
    x = torch.randn(T, D).bfloat16()
    w = torch.randn(E, 2 * H, D).bfloat16()
    w2 = torch.randn(E, D, H).bfloat16()
    tw = torch.rand(T, k)
    pad = flash_moe.BLOCK_M
    max_padded = flash_moe.moe_align_max_padded(T * k, E, pad)
    sorted_ids = torch.full((max_padded,), -1, dtype=torch.int32)
    expert_ids = torch.zeros(max_padded // pad, dtype=torch.int32)
    total = torch.zeros(1, dtype=torch.int32)
    out = torch.empty(T, D).bfloat16()
    return dict(
        x=x,
        w=w,
        w2=w2,
        sorted_token_ids=sorted_ids,
        expert_ids=expert_ids,
        num_tokens_post_padded=total,
        topk_weights=tw,
        out=out,
        top_k=k,
    )


@needs_extension
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"x": lambda a: a["x"].float()},
            "argument 'x' must be a torch.bfloat16 tensor, got torch.float32",
        ),
        (
            {"w2": lambda a: a["w2"].half()},
            "argument 'w2' must be a torch.bfloat16 tensor, got torch.float16",
        ),
        (
            {"topk_weights": lambda a: a["topk_weights"].double()},
            "argument 'topk_weights' must be a torch.float32 tensor, got torch.float64",
        ),
        (
            {"sorted_token_ids": lambda a: a["sorted_token_ids"].long()},
            "argument 'sorted_token_ids' must be a torch.int32 tensor, got torch.int64",
        ),
        ({"x": lambda a: a["x"]}, "argument 'x' must be on a CUDA device, got a CPU tensor"),
    ],
)
def test_fused_moe_bf16_rejects_bad_input_by_name(change, message):
    args = cpu_args()
    for key, edit in change.items():
        args[key] = edit(args)
    with pytest.raises(ValueError) as error:
        flash_moe.fused_moe_bf16(**args)
    assert message in str(error.value)


@needs_extension
def test_moe_align_rejects_bad_input_by_name():
    with pytest.raises(
        ValueError, match="argument 'topk_ids' must be a torch.int32 tensor, got torch.int64"
    ):
        flash_moe.moe_align(torch.zeros(4, 2, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="argument 'topk_ids' must be on a CUDA device"):
        flash_moe.moe_align(torch.zeros(4, 2, dtype=torch.int32), 4)
