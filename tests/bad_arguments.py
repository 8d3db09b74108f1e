"""Every bad argument flash_moe's ops must refuse, each with the error it must raise.

A wrong argument must raise a ValueError naming it, before any launch, never kill the
process; so every case runs in a process of its own (a crash there is a failed case, not a
dead test run). ``python tests/bad_arguments.py [--device cuda|cpu] [CASE ...]``: with no
case names, runs every case, each in its own process, and prints one line per case; with
names, runs those cases in this process. It imports whichever prime_kernels is first on
sys.path, so it checks an installed wheel as well as the in-place build (run it from outside
the source tree for the wheel). With ``--device cpu`` every tensor is a CPU tensor: the
checks of dtypes, shapes and values come before the device check, so they all answer without
a GPU (the tuning values, which are resolved on the GPU, need ``--device cuda``).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

T, D, H, E, K = 64, 256, 128, 4, 2


@dataclass(frozen=True)
class Case:
    call: Callable[[object, str], None]  # (flash_moe, device) -> None; must raise
    message: str  # a regular expression the error's text must match
    cuda_only: bool = False  # the check runs after the device's properties are read


def base_inputs(flash_moe, device: str, block_m: int = 128) -> list:
    """A valid call's arguments: x, w, w2, the alignment of random routing, weights, out, k."""
    from prime_kernels.flash_moe import reference

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=generator).bfloat16()
    w = (0.05 * torch.randn(E, 2 * H, D, generator=generator)).bfloat16()
    w2 = (0.05 * torch.randn(E, D, H, generator=generator)).bfloat16()
    ids, weights = reference.routing(T, E, K, generator=generator)
    aligned = reference.moe_align_reference(ids, E, block_m)
    out = torch.empty(T, D).bfloat16()
    return [t.to(device) for t in (x, w, w2, *aligned, weights, out)] + [K]


def fused(**replace):
    """A fused_moe_bf16 call with some arguments replaced: by position (int keys as
    ``a0``..``a8``, values computed from the valid inputs) or tuning keywords."""
    positions = {f"a{i}": i for i in range(9)}

    def call(flash_moe, device):
        args = base_inputs(flash_moe, device)
        kwargs = {}
        for key, value in replace.items():
            if key in positions:
                args[positions[key]] = value(args, device) if callable(value) else value
            else:
                kwargs[key] = value
        flash_moe.fused_moe_bf16(*args, **kwargs)

    return call


MAX_PADDED = 640  # moe_align's length for T * K = 128 pairs, E = 4, block_m = 128


def training_inputs(flash_moe, device: str) -> list:
    """A valid moe_backward call's arguments: grad_out, x, w, w2, the alignment, weights, z,
    pair_to_row, k, the four need flags and overwrite_z (moe_forward's are x .. weights and
    k). z and
    pair_to_row have the shapes moe_forward returns; their values are never read, since
    every case fails its checks first."""
    x, w, w2, sorted_ids, expert_ids, total, weights, _, k = base_inputs(flash_moe, device)
    assert sorted_ids.shape == (MAX_PADDED,)
    grad_out = torch.randn(T, D, device=device).bfloat16()
    z = torch.zeros(MAX_PADDED, 2 * H, device=device).bfloat16()
    pair_to_row = torch.full((T * K,), -1, dtype=torch.int32, device=device)
    aligned = [sorted_ids, expert_ids, total]
    flags = [True, True, True, True, False]  # the four need flags, overwrite_z
    return [grad_out, x, w, w2, *aligned, weights, z, pair_to_row, k, *flags]


def training(op: str, **replace):
    """A moe_forward or moe_backward call with some arguments replaced by name (values
    computed from the valid inputs, as ``fused``'s: ``lambda a, d`` with ``a`` the argument
    dict), through torch.ops.prime_moe (the binding's checks, not flash_moe.moe's)."""
    names = [
        "grad_out",
        "x",
        "w",
        "w2",
        "sorted_token_ids",
        "expert_ids",
        "num_tokens_post_padded",
        "topk_weights",
        "z",
        "pair_to_row",
        "top_k",
        "need_dx",
        "need_dw",
        "need_dw2",
        "need_dtopk_weights",
        "overwrite_z",
    ]
    forward_names = names[1:8] + ["top_k"]

    def call(flash_moe, device):
        args = dict(zip(names, training_inputs(flash_moe, device)))
        for key, value in replace.items():
            assert key in args, key
            args[key] = value(args, device) if callable(value) else value
        used = forward_names if op == "moe_forward" else names
        getattr(torch.ops.prime_moe, op)(*(args[n] for n in used))

    return call


def bf16(*shape):
    return lambda args, device: torch.randn(*shape, device=device).bfloat16()


def align(ids_fn, num_experts=E, *rest):
    return lambda flash_moe, device: flash_moe.moe_align(ids_fn(device), num_experts, *rest)


def ids(*shape, dtype=torch.int32):
    return lambda device: torch.zeros(*shape, dtype=dtype, device=device)


def max_pairs(flash_moe, num_experts: int, pad: int) -> int:
    """The most pairs moe_align takes with this E and pad: its padded length <= MAX_ROWS."""
    n = flash_moe.MAX_ROWS // pad * pad - num_experts * (pad - 1)
    assert flash_moe.moe_align_max_padded(n, num_experts, pad) <= flash_moe.MAX_ROWS
    assert flash_moe.moe_align_max_padded(n + 1, num_experts, pad) > flash_moe.MAX_ROWS
    return n


def padded_overflow(extra: int):
    """moe_align at E = 4096 and block_m * bpc = 65536 (padding alone reaches 2^28 rows) with
    ``extra`` pairs past the most it takes. The tensor is never read: the check comes first."""

    def call(flash_moe, device):
        n = max_pairs(flash_moe, 4096, 65536) + extra
        flash_moe.moe_align(torch.empty(n, 1, dtype=torch.int32, device=device), 4096, 1024, 64)

    return call


def scale_bytes(*shape, dtype=torch.uint8):
    return lambda device: torch.zeros(shape, dtype=dtype, device=device)


def pack(scales_fn):
    """pack_scales_blocked through torch.ops.prime_moe (the binding's checks, not those
    flash_moe.pack_scales_blocked makes first)."""
    return lambda flash_moe, device: torch.ops.prime_moe.pack_scales_blocked(scales_fn(device))


def unpack(packed_fn, mn):
    return lambda flash_moe, device: torch.ops.prime_moe.unpack_scales_blocked(
        packed_fn(device), mn
    )


def mx_inputs(flash_moe, device: str, dim: int = D, hidden: int = H) -> list:
    """A valid fused_moe_mxfp8 call's arguments (x, x_scales, w, w_scales, w2, w2_scales, the
    alignment, weights, out, k), quantized by the pure-PyTorch mxfp8 (the weight scales packed
    as the consumer packs them); at a dim or hidden_dim the blocked layout cannot tile, the
    weight scales are zeros of the size the kernel expects."""
    from prime_kernels.flash_moe import mxfp8

    x, w, w2, sorted_ids, expert_ids, total, weights, out, k = base_inputs(flash_moe, "cpu")
    if (dim, hidden) != (D, H):
        x = torch.randn(T, dim).bfloat16()
        w = torch.randn(E, 2 * hidden, dim).bfloat16()
        w2 = torch.randn(E, dim, hidden).bfloat16()
        out = torch.empty(T, dim).bfloat16()
    xq, xs = mxfp8.quantize_mxfp8(x)
    wq, ws = mxfp8.quantize_mxfp8(w)
    w2q, w2s = mxfp8.quantize_mxfp8(w2)
    if dim % 128 == 0 and hidden % 128 == 0:
        ws = mxfp8.pack_scales_blocked(ws).reshape(E, -1)
        w2s = mxfp8.pack_scales_blocked(w2s).reshape(E, -1)
    else:
        ws = ws.reshape(E, -1)
        w2s = w2s.reshape(E, -1)
    tensors = (xq, xs, wq, ws, w2q, w2s, sorted_ids, expert_ids, total, weights, out)
    return [t.to(device) for t in tensors] + [k]


def mx(dim: int = D, hidden: int = H, op: bool = False, **replace):
    """A fused_moe_mxfp8 call with some arguments replaced, as ``fused``'s (``a0``..``a11``
    by position, tuning keywords by name): through flash_moe.fused_moe_mxfp8, or with ``op``
    straight through torch.ops.prime_moe (the caller's e8m0 scales not viewed as bytes)."""
    positions = {f"a{i}": i for i in range(12)}

    def call(flash_moe, device):
        args = mx_inputs(flash_moe, device, dim, hidden)
        kwargs = {}
        for key, value in replace.items():
            if key in positions:
                args[positions[key]] = value(args, device) if callable(value) else value
            else:
                kwargs[key] = value
        if op:
            torch.ops.prime_moe.fused_moe_mxfp8(*args, **kwargs)
        else:
            flash_moe.fused_moe_mxfp8(*args, **kwargs)

    return call


CASES: dict[str, Case] = {
    # fused_moe_bf16: dtypes, ranks, contiguity
    "x_dtype": Case(
        fused(a0=lambda a, d: a[0].float()),
        r"argument 'x' must be a torch\.bfloat16 tensor, got torch\.float32",
    ),
    "w2_dtype": Case(
        fused(a2=lambda a, d: a[2].half()),
        r"argument 'w2' must be a torch\.bfloat16 tensor, got torch\.float16",
    ),
    "weights_dtype": Case(
        fused(a6=lambda a, d: a[6].double()),
        r"argument 'topk_weights' must be a torch\.float32 tensor, got torch\.float64",
    ),
    "sorted_ids_dtype": Case(
        fused(a3=lambda a, d: a[3].long()),
        r"argument 'sorted_token_ids' must be a torch\.int32 tensor, got torch\.int64",
    ),
    "x_rank": Case(
        fused(a0=lambda a, d: a[0].reshape(-1)), r"argument 'x' must be 2-D, got shape \(16384,\)"
    ),
    "x_not_contiguous": Case(
        fused(a0=lambda a, d: torch.empty(D, T, device=d).bfloat16().t()),
        r"argument 'x' must be contiguous, got shape \(64, 256\)",
    ),
    "w_not_contiguous": Case(
        fused(a1=lambda a, d: a[1].transpose(1, 2).contiguous().transpose(1, 2)),
        r"argument 'w' must be contiguous, got shape \(4, 256, 256\)",
    ),
    # shapes
    "w_shape": Case(
        fused(a1=bf16(E, 2 * H, 128)),
        r"argument 'w' must have shape \(E, 2 \* hidden_dim, dim\) = \(E, 2H, 256\)",
    ),
    "w2_shape": Case(
        fused(a2=lambda a, d: a[2][:, :, :64].contiguous()),
        r"argument 'w2' must have shape \(4, 256, 128\) \(E, dim, hidden_dim\), got \(4, 256, 64\)",
    ),
    "out_shape": Case(
        fused(a7=lambda a, d: a[7][:10]), r"argument 'out' must have shape \(64, 256\)"
    ),
    "weights_transposed": Case(
        fused(a6=lambda a, d: a[6].t().contiguous()),
        r"argument 'topk_weights' must have shape \(64, 2\) \(T, top_k\).*got \(2, 64\)",
    ),
    "weights_flat": Case(
        fused(a6=lambda a, d: a[6].reshape(-1)),
        r"argument 'topk_weights' must be 2-D, got shape \(128,\)",
    ),
    "top_k_mismatch": Case(
        fused(a8=3),
        r"argument 'topk_weights' must have shape \(64, 3\) \(T, top_k\).*got \(64, 2\)",
    ),
    "top_k_zero": Case(fused(a8=0), r"top_k=0 must be at least 1"),
    "total_shape": Case(
        fused(a5=lambda a, d: torch.zeros(2, dtype=torch.int32, device=d)),
        r"argument 'num_tokens_post_padded' must have shape \(1,\)",
    ),
    "dim_multiple": Case(
        fused(a0=bf16(T, 96), a1=bf16(E, 2 * H, 96), a2=bf16(E, 96, H), a7=bf16(T, 96)),
        r"dim=96 \(x\.size\(1\)\) must be a multiple of 64",
    ),
    "hidden_multiple": Case(
        fused(a1=bf16(E, 200, D), a2=bf16(E, D, 100)),
        r"hidden_dim=100 \(w\.size\(1\) / 2\) must be a multiple of 64",
    ),
    "sorted_ids_length": Case(
        fused(a3=lambda a, d: a[3][:-1]), r"not a multiple of block_m \* bpc = 128"
    ),
    "expert_ids_length": Case(
        fused(a4=lambda a, d: a[4][:-1]), r"argument 'expert_ids' must have length"
    ),
    "block_m_not_multiple": Case(
        fused(block_m=100), r"block_m=100 must be a positive multiple of 16"
    ),
    "bpc_zero": Case(fused(bpc=0), r"bpc=0 must be positive"),
    # block_m * bpc would wrap to 0 in int64 (and divide by zero after the check)
    "bpc_huge": Case(fused(bpc=2**60), r"bpc=1152921504606846976 must be positive"),
    "block_n_huge": Case(fused(block_n=2**32 + 64), r"block_n=4294967360 must be in \[0, 1024\]"),
    # devices
    "x_on_cpu": Case(
        fused(a0=lambda a, d: a[0].cpu()),
        r"argument 'x' must be on a CUDA device, got a CPU tensor",
    ),
    "out_on_cpu": Case(
        fused(a7=lambda a, d: a[7].cpu()),
        r"argument 'out' must be on a CUDA device, got a CPU tensor",
        cuda_only=True,
    ),
    # tuning values and what sm_90 supports (resolved on x's device)
    "block_n": Case(fused(block_n=80), r"block_n=80 is not supported on sm_90", cuda_only=True),
    "stages": Case(fused(stages=99), r"stages=99 is not supported on sm_90", cuda_only=True),
    "cpc": Case(fused(cpc=2), r"cpc=2 is not supported on sm_90", cuda_only=True),
    "warp_n": Case(fused(warp_n=3), r"warp_n=3 is not supported on sm_90", cuda_only=True),
    "original_tile": Case(
        fused(block_n=128, warp_n=4),
        r"block_n=128 with warp_n=4 is not supported on sm_90; the original's tiles are "
        r"\(block_n, warp_n\) = \(64, 4\) or \(32, 8\)",
        cuda_only=True,
    ),
    "original_stages": Case(
        fused(block_n=64, warp_n=4, stages=6),
        r"stages=6 is not supported on sm_90 with the original's tiles; use 1\.\.5",
        cuda_only=True,
    ),
    "block_m_32": Case(
        lambda fm, d: fm.fused_moe_bf16(*base_inputs(fm, d, block_m=32), block_m=32),
        r"block_m=32 is not supported on sm_90",
        cuda_only=True,
    ),
    # moe_align
    "ids_dtype": Case(
        align(ids(4, 2, dtype=torch.int64)),
        r"argument 'topk_ids' must be a torch\.int32 tensor, got torch\.int64",
    ),
    "ids_rank": Case(align(ids(8)), r"argument 'topk_ids' must be 2-D, got shape \(8,\)"),
    "ids_not_contiguous": Case(
        align(lambda d: torch.zeros(2, 4, dtype=torch.int32, device=d).t()),
        r"argument 'topk_ids' must be contiguous, got shape \(4, 2\)",
    ),
    "num_experts_zero": Case(align(ids(4, 2), 0), r"num_experts=0 must be in \[1, 4096\]"),
    "num_experts_4097": Case(align(ids(4, 2), 4097), r"num_experts=4097 must be in \[1, 4096\]"),
    "align_block_m": Case(
        align(ids(4, 2), E, 100), r"block_m=100 must be a positive multiple of 16"
    ),
    "align_pad": Case(
        align(ids(4, 2), E, 1024, 128), r"bpc=128 must be positive with block_m \* bpc <= 65536"
    ),
    "align_bpc_huge": Case(
        align(ids(4, 2), E, 16, 2**60), r"bpc=1152921504606846976 must be positive"
    ),
    "ids_on_cpu": Case(
        lambda fm, d: fm.moe_align(torch.zeros(4, 2, dtype=torch.int32), E),
        r"argument 'topk_ids' must be on a CUDA device, got a CPU tensor",
    ),
    "padded_overflow": Case(
        padded_overflow(1),
        r"argument 'topk_ids' of shape \(\d+, 1\) with num_experts=4096 and block_m \* bpc = 65536 gives up to "
        r"2147483648 padded rows; at most 2\^31 - 1",
    ),
    # moe_forward (the training forward: fused_moe_bf16's checks, no out)
    "forward_x_dtype": Case(
        training("moe_forward", x=lambda a, d: a["x"].float()),
        r"moe_forward: argument 'x' must be a torch\.bfloat16 tensor, got torch\.float32",
    ),
    "forward_w_shape": Case(
        training("moe_forward", w=bf16(E, 2 * H, 128)),
        r"moe_forward: argument 'w' must have shape \(E, 2 \* hidden_dim, dim\) = \(E, 2H, 256\)",
    ),
    "forward_weights_shape": Case(
        training("moe_forward", topk_weights=lambda a, d: a["topk_weights"].t().contiguous()),
        r"moe_forward: argument 'topk_weights' must have shape \(64, 2\) \(T, top_k\).*got \(2, 64\)",
    ),
    "forward_top_k_mismatch": Case(
        training("moe_forward", top_k=3),
        r"moe_forward: argument 'topk_weights' must have shape \(64, 3\) \(T, top_k\).*got \(64, 2\)",
    ),
    "forward_hidden_multiple": Case(
        training("moe_forward", w=bf16(E, 200, D), w2=bf16(E, D, 100)),
        r"moe_forward: hidden_dim=100 \(w\.size\(1\) / 2\) must be a multiple of 64",
    ),
    "forward_x_on_cpu": Case(
        training("moe_forward", x=lambda a, d: a["x"].cpu()),
        r"moe_forward: argument 'x' must be on a CUDA device, got a CPU tensor",
    ),
    # moe_backward: the forward's checks with grad_out in out's place, then z and pair_to_row
    "backward_x_dtype": Case(
        training("moe_backward", x=lambda a, d: a["x"].float()),
        r"moe_backward: argument 'x' must be a torch\.bfloat16 tensor, got torch\.float32",
    ),
    "backward_w_shape": Case(
        training("moe_backward", w=bf16(E, 2 * H, 128)),
        r"moe_backward: argument 'w' must have shape \(E, 2 \* hidden_dim, dim\) = \(E, 2H, 256\)",
    ),
    "backward_weights_shape": Case(
        training("moe_backward", topk_weights=lambda a, d: a["topk_weights"].t().contiguous()),
        r"moe_backward: argument 'topk_weights' must have shape \(64, 2\) \(T, top_k\).*got \(2, 64\)",
    ),
    "backward_grad_out_dtype": Case(
        training("moe_backward", grad_out=lambda a, d: a["grad_out"].float()),
        r"moe_backward: argument 'grad_out' must be a torch\.bfloat16 tensor, got torch\.float32",
    ),
    "backward_grad_out_shape": Case(
        training("moe_backward", grad_out=lambda a, d: a["grad_out"][:10]),
        r"moe_backward: argument 'grad_out' must have shape \(64, 256\) \(T, dim\), like x, "
        r"got \(10, 256\)",
    ),
    "backward_z_dtype": Case(
        training("moe_backward", z=lambda a, d: a["z"].float()),
        r"moe_backward: argument 'z' must be a torch\.bfloat16 tensor, got torch\.float32",
    ),
    "backward_z_shape": Case(
        training("moe_backward", z=lambda a, d: a["z"][:-128]),
        r"moe_backward: argument 'z' must have shape \(640, 256\) "
        r"\(len\(sorted_token_ids\), 2 \* hidden_dim\).*got \(512, 256\)",
    ),
    "backward_z_hidden": Case(
        training("moe_backward", z=lambda a, d: a["z"][:, :128].contiguous()),
        r"moe_backward: argument 'z' must have shape \(640, 256\).*got \(640, 128\)",
    ),
    "backward_pair_to_row_dtype": Case(
        training("moe_backward", pair_to_row=lambda a, d: a["pair_to_row"].long()),
        r"moe_backward: argument 'pair_to_row' must be a torch\.int32 tensor, got torch\.int64",
    ),
    "backward_pair_to_row_length": Case(
        training("moe_backward", pair_to_row=lambda a, d: a["pair_to_row"][:-1]),
        r"moe_backward: argument 'pair_to_row' must have shape \(128,\) \(T \* top_k,\).*"
        r"got \(127,\)",
    ),
    "backward_top_k_zero": Case(
        training("moe_backward", top_k=0), r"moe_backward: top_k=0 must be at least 1"
    ),
    "backward_z_on_cpu": Case(
        training("moe_backward", z=lambda a, d: a["z"].cpu()),
        r"moe_backward: argument 'z' must be on a CUDA device, got a CPU tensor",
        cuda_only=True,
    ),
    # pack_scales_blocked / unpack_scales_blocked: the bytes of e8m0 scales
    "pack_scales_dtype": Case(
        pack(scale_bytes(128, 4, dtype=torch.float8_e8m0fnu)),
        r"pack_scales_blocked: argument 'scales' must be a torch\.uint8 tensor \(the bits of "
        r"e8m0 scales\), got a dtype the stable ABI does not name, such as torch\.float8_e8m0fnu",
    ),
    "unpack_scales_dtype": Case(
        unpack(scale_bytes(512, dtype=torch.int32), 128),
        r"unpack_scales_blocked: argument 'packed' must be a torch\.uint8 tensor \(the bits of "
        r"e8m0 scales\), got torch\.int32",
    ),
    "pack_scales_rank": Case(
        pack(scale_bytes(512)),
        r"pack_scales_blocked: argument 'scales' must be \(\.\.\., MN, K/32\), got shape \(512,\)",
    ),
    "pack_scales_not_contiguous": Case(
        pack(lambda d: torch.zeros(4, 128, dtype=torch.uint8, device=d).t()),
        r"pack_scales_blocked: argument 'scales' must be contiguous, got shape \(128, 4\)",
    ),
    "pack_scales_mn": Case(
        pack(scale_bytes(2, 64, 4)),
        r"pack_scales_blocked: argument 'scales' has shape \(2, 64, 4\): MN = shape\[-2\] = 64 "
        r"must be a multiple of 128",
    ),
    "pack_scales_kb": Case(
        pack(scale_bytes(128, 6)),
        r"pack_scales_blocked: argument 'scales' has shape \(128, 6\): K/32 = shape\[-1\] = 6 "
        r"must be a multiple of 4",
    ),
    "pack_scales_on_cpu": Case(
        lambda fm, d: torch.ops.prime_moe.pack_scales_blocked(
            torch.zeros(128, 4, dtype=torch.uint8)
        ),
        r"pack_scales_blocked: argument 'scales' must be on a CUDA device, got a CPU tensor",
    ),
    "unpack_scales_rank": Case(
        unpack(scale_bytes(), 128),
        r"unpack_scales_blocked: argument 'packed' must be \(\.\.\., MN \* K/32\), got shape \(\)",
    ),
    "unpack_scales_mn_zero": Case(
        unpack(scale_bytes(512), 0),
        r"unpack_scales_blocked: argument 'packed' has shape \(512,\): its last dim must be "
        r"mn \* K/32 with mn=0",
    ),
    "unpack_scales_mn_divides": Case(
        unpack(scale_bytes(2, 100), 128), r"its last dim must be mn \* K/32 with mn=128"
    ),
    "unpack_scales_mn": Case(
        unpack(scale_bytes(2, 512), 64),
        r"unpack_scales_blocked: argument 'packed' has shape \(2, 512\): mn = 64 must be a "
        r"multiple of 128",
    ),
    "unpack_scales_kb": Case(
        unpack(scale_bytes(2, 768), 128),
        r"unpack_scales_blocked: argument 'packed' has shape \(2, 768\): K/32 = shape\[-1\] / "
        r"mn = 6 must be a multiple of 4",
    ),
    "unpack_scales_on_cpu": Case(
        lambda fm, d: torch.ops.prime_moe.unpack_scales_blocked(
            torch.zeros(2, 512, dtype=torch.uint8), 128
        ),
        r"unpack_scales_blocked: argument 'packed' must be on a CUDA device, got a CPU tensor",
    ),
    # fused_moe_mxfp8: e4m3 values, e8m0 scales (their bytes), shapes, the blocked layout
    "mx_x_dtype": Case(
        mx(a0=lambda a, d: a[0].bfloat16()),
        r"fused_moe_mxfp8: argument 'x' must be a torch\.float8_e4m3fn tensor, got "
        r"torch\.bfloat16",
    ),
    "mx_w2_dtype": Case(
        mx(a4=lambda a, d: a[4].view(torch.uint8)),
        r"fused_moe_mxfp8: argument 'w2' must be a torch\.float8_e4m3fn tensor, got torch\.uint8",
    ),
    "mx_out_dtype": Case(
        mx(a10=lambda a, d: a[10].float()),
        r"fused_moe_mxfp8: argument 'out' must be a torch\.bfloat16 tensor, got torch\.float32",
    ),
    "mx_x_scales_dtype": Case(
        mx(a1=lambda a, d: a[1].float()),
        r"fused_moe_mxfp8: argument 'x_scales' must be float8_e8m0fnu scales \(their "
        r"torch\.uint8 bits\), got torch\.float32",
    ),
    "mx_scales_e8m0_through_the_op": Case(
        mx(op=True),
        r"fused_moe_mxfp8: argument 'x_scales' must be a torch\.uint8 tensor \(the bits of e8m0 "
        r"scales\), got a dtype the stable ABI does not name",
    ),
    "mx_x_scales_shape": Case(
        mx(a1=lambda a, d: a[1][:, :4].contiguous()),
        r"fused_moe_mxfp8: argument 'x_scales' must have shape \(64, 8\) \(T, dim / 32\), "
        r"row-major, got \(64, 4\)",
    ),
    "mx_x_scales_not_contiguous": Case(
        mx(a1=lambda a, d: a[1].t().contiguous().t()),
        r"fused_moe_mxfp8: argument 'x_scales' must be contiguous",
    ),
    "mx_w_scales_size": Case(
        mx(a3=lambda a, d: a[3][:, :-16].contiguous()),
        r"fused_moe_mxfp8: argument 'w_scales' must hold 8192 scales \(E \* 2H \* dim/32",
    ),
    "mx_w2_scales_size": Case(
        mx(a5=lambda a, d: a[5][:2]),
        r"fused_moe_mxfp8: argument 'w2_scales' must hold 4096 scales \(E \* dim \* H/32",
    ),
    "mx_w_shape": Case(
        mx(a2=lambda a, d: a[2][:, :128].contiguous()),
        r"fused_moe_mxfp8: argument 'w2' must have shape \(4, 256, 64\)",
    ),
    "mx_dim": Case(
        mx(dim=192),
        r"fused_moe_mxfp8: dim=192 \(x\.size\(1\)\) must be a multiple of 128 \(the blocked "
        r"scale layout",
    ),
    "mx_hidden_dim": Case(
        mx(hidden=192),
        r"fused_moe_mxfp8: hidden_dim=192 \(w\.size\(1\) / 2\) must be a multiple of 128 "
        r"\(the blocked scale layout",
    ),
    "mx_topk_weights_shape": Case(
        mx(a9=lambda a, d: a[9][:, :1].contiguous()),
        r"fused_moe_mxfp8: argument 'topk_weights' must have shape \(64, 2\)",
    ),
    "mx_expert_ids_length": Case(
        mx(a7=lambda a, d: a[7][:-1]),
        r"fused_moe_mxfp8: argument 'expert_ids' must have length len\(sorted_token_ids\) / "
        r"block_m = 5, got 4",
    ),
    "mx_top_k": Case(mx(a11=0), r"fused_moe_mxfp8: top_k=0 must be at least 1"),
    "mx_stages_original": Case(
        mx(stages=5),
        r"fused_moe_mxfp8: stages=5 is not supported on sm_90 with the original's tiles; use "
        r"1\.\.4",
        cuda_only=True,
    ),
    "mx_warp_n": Case(
        mx(warp_n=3),
        r"fused_moe_mxfp8: warp_n=3 is not supported on sm_90",
        cuda_only=True,
    ),
    "mx_block_m": Case(
        mx(block_m=64),
        r"fused_moe_mxfp8: argument 'expert_ids' must have length len\(sorted_token_ids\) / "
        r"block_m = 10",
    ),
    "mx_x_scales_on_cpu": Case(
        mx(a1=lambda a, d: a[1].cpu()),
        r"fused_moe_mxfp8: argument 'x_scales' must be on a CUDA device, got a CPU tensor",
        cuda_only=True,
    ),
}

# On CPU tensors a call that passes every check ends at the device check: the largest
# moe_align the padded-length limit admits gets that far, one pair more does not.
CPU_ONLY_CASES: dict[str, Case] = {
    "padded_at_limit": Case(padded_overflow(0), r"argument 'topk_ids' must be on a CUDA device"),
    # training_inputs pass every check but the device's, so each case above fails on its
    # replacement alone.
    "forward_valid_on_cpu": Case(
        training("moe_forward"), r"moe_forward: argument 'x' must be on a CUDA device"
    ),
    "backward_valid_on_cpu": Case(
        training("moe_backward"), r"moe_backward: argument 'x' must be on a CUDA device"
    ),
    "mx_valid_on_cpu": Case(mx(), r"fused_moe_mxfp8: argument 'x' must be on a CUDA device"),
}


def cases_for(device: str) -> dict[str, Case]:
    if device == "cpu":
        return {n: c for n, c in {**CASES, **CPU_ONLY_CASES}.items() if not c.cuda_only}
    return dict(CASES)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def load_flash_moe(device: str):
    import prime_kernels

    if device == "cuda":
        return prime_kernels.load("flash_moe")  # RuntimeError with the registry's reason
    from prime_kernels import flash_moe

    if not flash_moe.EXTENSION_BUILT:
        raise RuntimeError(prime_kernels.unavailable_reason("flash_moe"))
    return flash_moe


def run_case(name: str, device: str) -> str:
    """Runs one case in this process; returns the error's text, or raises AssertionError."""
    case = cases_for(device)[name]
    flash_moe = load_flash_moe(device)
    try:
        case.call(flash_moe, device)
    # The stable ABI reports std::invalid_argument as ValueError (torch 2.11) or as
    # RuntimeError (torch 2.15); the text is ours either way.
    except (ValueError, RuntimeError) as error:
        text = str(error).splitlines()[0] if str(error) else ""
        if isinstance(error, RuntimeError) and torch_version() <= (2, 11):
            raise AssertionError(f"{name}: RuntimeError {text!r}, not ValueError") from None
        if not re.search(case.message, str(error)):
            raise AssertionError(
                f"{name}: {type(error).__name__} {text!r} does not match {case.message!r}"
            ) from None
        if device == "cuda":
            torch.cuda.synchronize()  # nothing was launched that could fail later
        return f"{type(error).__name__}: {text}"
    raise AssertionError(f"{name}: no error raised")


def run_each_in_own_process(
    names: list[str], device: str, jobs: int = 8
) -> dict[str, tuple[bool, str]]:
    """name -> (passed, what happened), every case in a fresh interpreter with this one's
    environment and sys.path."""

    def one(name):
        result = subprocess.run(
            [sys.executable, __file__, "--device", device, name], capture_output=True, text=True
        )
        if result.returncode < 0:
            return name, (False, f"killed by signal {-result.returncode}: {result.stderr[-500:]}")
        if result.returncode != 0:
            return name, (False, (result.stdout + result.stderr)[-800:])
        return name, (True, result.stdout.strip().splitlines()[-1])

    with ThreadPoolExecutor(jobs) as pool:
        return dict(pool.map(one, names))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("cases", nargs="*")
    args = parser.parse_args()
    if args.cases:
        for name in args.cases:
            print(run_case(name, args.device))
        return 0
    import prime_kernels

    print(f"prime_kernels from {prime_kernels.__file__}, torch {torch.__version__}")
    results = run_each_in_own_process(sorted(cases_for(args.device)), args.device)
    for name, (passed, what) in results.items():
        print(f"{'ok  ' if passed else 'FAIL'} {name}: {what}")
    failed = [name for name, (passed, _) in results.items() if not passed]
    print(f"{len(results) - len(failed)} of {len(results)} bad-argument cases raised as they must")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
