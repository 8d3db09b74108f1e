"""flash_moe's Python surface on any machine: constants from C++, shape rules, fake
implementations under FakeTensorMode (the binding's input checks: test_bad_arguments.py)."""

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

    names = (
        "BLOCK_M",
        "MXFP8_SCALE_BLOCK",
        "DIM_MULTIPLE",
        "HIDDEN_MULTIPLE",
        "MXFP8_DIM_MULTIPLE",
        "MXFP8_HIDDEN_MULTIPLE",
        "MAX_EXPERTS",
        "MAX_ROWS",
    )
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
        (2048, 768, {"mxfp8": True}, None),
        (7168, 2048, {"mxfp8": True}, None),
        (256, 128, {"mxfp8": True, "split": False}, None),
        (192, 128, {"mxfp8": True}, "dim=192 must be a positive multiple of 128 for MXFP8"),
        (2048, 192, {"mxfp8": True}, "hidden_dim=192 must be a positive multiple of 128"),
        (64, 64, {"mxfp8": True}, "dim=64 must be a positive multiple of 128"),
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


@needs_extension
def test_num_sms_setting():
    assert flash_moe.get_num_sms() == 0
    try:
        flash_moe.set_num_sms(16)
        assert flash_moe.get_num_sms() == 16
        with pytest.raises(ValueError, match="num_sms must be >= 0"):
            flash_moe.set_num_sms(-1)
    finally:
        flash_moe.set_num_sms(0)
    assert flash_moe.get_num_sms() == 0


def _training_inputs(T, D, H, E, k, needs, device):
    x = torch.empty(T, D, dtype=torch.bfloat16, device=device)
    w = torch.empty(E, 2 * H, D, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(E, D, H, dtype=torch.bfloat16, device=device)
    tw = torch.empty(T, k, dtype=torch.float32, device=device)
    leaves = [t.requires_grad_(n) for t, n in zip((x, w, w2, tw), needs)]
    ids = torch.empty(T, k, dtype=torch.int32, device=device)
    return leaves, ids


@needs_extension
@pytest.mark.parametrize(
    "needs",
    [
        (True, True, True, True),
        (True, False, False, False),
        (False, True, True, False),
        (False, False, False, True),
        (True, False, True, True),
    ],
)
@pytest.mark.parametrize("mxfp8", [False, True], ids=["bf16", "mxfp8"])
def test_moe_autograd_wiring_on_meta_tensors(needs, mxfp8):
    """moe's registered autograd on any machine (meta tensors run the fakes; the autograd
    engine needs a GPU for fake CUDA tensors): every input that requires grad gets a
    gradient of its shape and dtype, a frozen one gets None; with mxfp8, through
    moe_forward_mxfp8's own registration."""
    T, D, H, E, k = 7, 256, 128, 4, 2
    leaves, ids = _training_inputs(T, D, H, E, k, needs, "meta")
    out = flash_moe.moe(*leaves[:3], ids, leaves[3], mxfp8=mxfp8)
    assert out.shape == (T, D) and out.dtype == torch.bfloat16
    out.backward(torch.empty_like(out))
    for leaf, need in zip(leaves, needs):
        if need:
            assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == leaf.dtype
        else:
            assert leaf.grad is None


@needs_extension
def test_moe_compiles_once_for_every_token_count():
    """torch.compile(fullgraph=True, dynamic=True) of forward and backward through moe's
    fakes and registered autograd: one graph for three token counts (meta tensors, so this
    runs without a GPU; test_moe_training.py runs the kernels)."""
    from torch._dynamo.utils import counters

    def loss(x, w, w2, ids, tw):
        return flash_moe.moe(x, w, w2, ids, tw).float().sum()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(loss, fullgraph=True, dynamic=True, backend="aot_eager")
    for T in (64, 200, 333):
        leaves, ids = _training_inputs(T, 256, 128, 4, 2, (True,) * 4, "meta")
        compiled(*leaves[:3], ids, leaves[3]).backward()
        assert [t.grad.shape for t in leaves] == [t.shape for t in leaves]
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("lead", [(), (3,), (2, 2), (0,)])
def test_pack_scales_blocked_follows_the_contract(lead):
    """Every scale (r, c) of each leading index's (MN, K/32) block lands at the byte
    CONTRACT.md gives; the result is e8m0 of shape (*lead, MN*K/32), and unpacking it gives
    the row-major scales back."""
    MN, KB = 256, 12
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 256, (*lead, MN, KB), dtype=torch.uint8, generator=gen)
    packed = flash_moe.pack_scales_blocked(bits.view(torch.float8_e8m0fnu))
    assert packed.dtype == torch.float8_e8m0fnu and packed.shape == (*lead, MN * KB)
    r = torch.arange(MN).view(MN, 1)
    c = torch.arange(KB).view(1, KB)
    offset = ((r // 128) * (KB // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4
    offset = (offset + c % 4).reshape(-1)
    flat = packed.view(torch.uint8).reshape(-1, MN * KB)
    assert torch.equal(flat[:, offset], bits.reshape(-1, MN * KB))
    unpacked = flash_moe.unpack_scales_blocked(packed, MN)
    assert unpacked.dtype == torch.float8_e8m0fnu
    assert torch.equal(unpacked.view(torch.uint8), bits)
    assert torch.equal(
        flash_moe.pack_scales_blocked(bits).view(torch.uint8), packed.view(torch.uint8)
    )


def test_pack_scales_blocked_refuses_what_it_cannot_tile():
    with pytest.raises(ValueError, match="multiple of 128"):
        flash_moe.pack_scales_blocked(torch.zeros(64, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 4"):
        flash_moe.pack_scales_blocked(torch.zeros(128, 6, dtype=torch.uint8))
    with pytest.raises(TypeError, match="float8_e8m0fnu"):
        flash_moe.pack_scales_blocked(torch.zeros(128, 4))
    with pytest.raises(ValueError, match="mn"):
        flash_moe.unpack_scales_blocked(torch.zeros(100, dtype=torch.uint8), 128)


@pytest.mark.parametrize("lead", [(), (3,), (2, 2)])
@needs_extension
def test_pack_scales_blocked_fakes(lead, monkeypatch):
    """CUDA tensors take the ops (here their fakes), never the pure-PyTorch path: e8m0 of the
    original's shapes, and that path's errors before the op."""
    from prime_kernels.flash_moe import mxfp8

    def pure_pytorch(*args):
        raise AssertionError("the pure-PyTorch path ran for a CUDA tensor")

    monkeypatch.setattr(mxfp8, "pack_scales_blocked", pure_pytorch)
    monkeypatch.setattr(mxfp8, "unpack_scales_blocked", pure_pytorch)
    with FakeTensorMode():
        scales = torch.empty((*lead, 256, 12), dtype=torch.float8_e8m0fnu, device="cuda")
        packed = flash_moe.pack_scales_blocked(scales)
        unpacked = flash_moe.unpack_scales_blocked(packed, 256)
        with pytest.raises(ValueError, match=r"scales has shape \(128, 6\): K/32 = shape\[-1\]"):
            flash_moe.pack_scales_blocked(torch.empty(128, 6, dtype=torch.uint8, device="cuda"))
        with pytest.raises(ValueError, match=r"packed has shape \(2, 64, 4\): MN = shape\[-2\]"):
            flash_moe.unpack_scales_blocked(
                torch.empty(2, 256, dtype=torch.uint8, device="cuda"), 64
            )
    assert packed.dtype == unpacked.dtype == torch.float8_e8m0fnu
    assert packed.shape == (*lead, 256 * 12) and unpacked.shape == (*lead, 256, 12)
    assert packed.device.type == unpacked.device.type == "cuda"
