"""flash_moe: fused Mixture-of-Experts for Hopper (sm_90a), forward and backward.

Reach it through the registry (``prime_kernels.load("flash_moe")``), which checks that the
extension is built and the device is one it was built for. Ops live in
``torch.ops.prime_moe``; this module wraps them, registers their fake implementations for
torch.compile, and exports the shape rules the kernels have, read from the extension.
:func:`moe` is the differentiable entry point for training: its backward runs flash_moe's
own kernels, registered with ``torch.library.register_autograd``.
"""

from __future__ import annotations

import importlib

import torch

try:
    _constants = importlib.import_module(f"{__name__}._C")
    EXTENSION_BUILT = True
except ModuleNotFoundError as error:  # not compiled into this install: the shape rules answer
    if error.name != f"{__name__}._C":
        raise
    from . import _constants

    EXTENSION_BUILT = False
except ImportError as error:  # in this install, but it does not load: say why, here
    from .. import build_info

    built = build_info()
    raise ImportError(
        f"{__name__}'s extension does not load ({error}); it was built for "
        f"torch >= {built.get('torch_target_version', '2.10')} with CUDA "
        f"{built.get('torch_cuda', '13')}, so install the prime-kernels wheel that matches this torch"
    ) from error

BLOCK_M: int = _constants.BLOCK_M
MXFP8_SCALE_BLOCK: int = _constants.MXFP8_SCALE_BLOCK
DIM_MULTIPLE: int = _constants.DIM_MULTIPLE
HIDDEN_MULTIPLE: int = _constants.HIDDEN_MULTIPLE
MXFP8_DIM_MULTIPLE: int = _constants.MXFP8_DIM_MULTIPLE
MXFP8_HIDDEN_MULTIPLE: int = _constants.MXFP8_HIDDEN_MULTIPLE
MAX_EXPERTS: int = _constants.MAX_EXPERTS
MAX_ROWS: int = _constants.MAX_ROWS

__all__ = [
    "BLOCK_M",
    "MXFP8_SCALE_BLOCK",
    "fused_moe_bf16",
    "fused_moe_mxfp8",
    "get_num_sms",
    "moe",
    "moe_align",
    "moe_align_max_padded",
    "pack_scales_blocked",
    "quantize_mxfp8",
    "set_num_sms",
    "unpack_scales_blocked",
    "unsupported_shape_reason",
]


def set_num_sms(num_sms: int) -> None:
    """Caps the SMs the persistent GEMM kernels use (0, the default: every SM), so that
    kernels running alongside (communication, say) keep the rest. Process-wide; takes
    effect at the next call (a CUDA graph keeps the grid it captured). The backward's GEMMs
    run in clusters of two CTAs: under an odd cap they use one SM fewer, under a cap of 1
    two."""
    if not EXTENSION_BUILT:
        raise RuntimeError("flash_moe is not compiled into this install")
    _constants.set_num_sms(int(num_sms))


def get_num_sms() -> int:
    """The cap set by :func:`set_num_sms` (0: none)."""
    return _constants.get_num_sms() if EXTENSION_BUILT else 0


def unsupported_shape_reason(
    dim: int, hidden_dim: int, *, mxfp8: bool = False, split: bool = True
) -> str | None:
    """None when this install's kernels take a layer of model dim ``dim`` and expert
    hidden dim ``hidden_dim``; otherwise one sentence naming the dimension, the multiple
    required and why. Call it once per MoE layer at setup."""
    if mxfp8:
        if dim <= 0 or dim % MXFP8_DIM_MULTIPLE:
            return (
                f"dim={dim} must be a positive multiple of {MXFP8_DIM_MULTIPLE} for MXFP8: "
                f"the blocked scale layout tiles w2's dim rows by 128 and w's dim/32 scale "
                f"columns by 4"
            )
        if hidden_dim <= 0 or hidden_dim % MXFP8_HIDDEN_MULTIPLE:
            return (
                f"hidden_dim={hidden_dim} must be a positive multiple of "
                f"{MXFP8_HIDDEN_MULTIPLE} for MXFP8: the blocked scale layout tiles w's rows "
                f"by 128 (the up rows start at hidden_dim) and w2's hidden_dim/32 scale "
                f"columns by 4"
            )
        return None
    if dim <= 0 or dim % DIM_MULTIPLE:
        return (
            f"dim={dim} must be a positive multiple of {DIM_MULTIPLE}: it is the gate/up "
            f"GEMM's reduction dim, read in whole {DIM_MULTIPLE}-element TMA K steps"
        )
    if hidden_dim <= 0 or hidden_dim % HIDDEN_MULTIPLE:
        return (
            f"hidden_dim={hidden_dim} must be a positive multiple of {HIDDEN_MULTIPLE}: it is "
            f"the down GEMM's reduction dim, read in whole {HIDDEN_MULTIPLE}-element TMA K steps"
        )
    return None


def pack_scales_blocked(scales: torch.Tensor) -> torch.Tensor:
    """MXFP8 scales from row-major (..., MN, K/32) to the blocked layout the MXFP8 kernels
    read: tiles of 128 rows x 4 scale columns (512 bytes each), ordered row-tile-major then
    column-tile; inside a tile, row r and column c at byte (r % 32) * 16 + ((r % 128) // 32)
    * 4 + c % 4. Returns float8_e8m0fnu of shape (..., MN * K/32), as the original does.
    Takes float8_e8m0fnu (or its uint8 bits); needs MN % 128 == 0 and (K/32) % 4 == 0
    (ValueError otherwise: pad first). CUDA tensors are permuted by flash_moe's CUDA kernel
    (a non-contiguous one is made contiguous first), other devices' by the pure-PyTorch
    :func:`mxfp8.pack_scales_blocked`; both give the same bytes."""
    from . import mxfp8

    if scales.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"scales must be float8_e8m0fnu (or uint8 bits), got {scales.dtype}")
    bits = scales.view(torch.uint8)
    if EXTENSION_BUILT and scales.is_cuda:
        mxfp8.check_blocked_shape(scales.shape, "scales")
        packed = torch.ops.prime_moe.pack_scales_blocked(bits.contiguous())
    else:
        packed = mxfp8.pack_scales_blocked(bits)
        packed = packed.reshape(*scales.shape[:-2], scales.shape[-2] * scales.shape[-1])
    return packed.view(torch.float8_e8m0fnu)


def unpack_scales_blocked(packed: torch.Tensor, mn: int) -> torch.Tensor:
    """Inverse of :func:`pack_scales_blocked`: blocked (..., MN * K/32) scales of ``mn`` rows
    back to row-major (..., MN, K/32), float8_e8m0fnu; a CUDA kernel for CUDA tensors, as
    there."""
    from . import mxfp8

    if packed.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"packed must be float8_e8m0fnu (or uint8 bits), got {packed.dtype}")
    if packed.ndim < 1 or mn <= 0 or packed.shape[-1] % mn:
        raise ValueError(
            f"packed has shape {tuple(packed.shape)}: its last dim must be mn * K/32 with mn={mn}"
        )
    bits = packed.view(torch.uint8)
    rows_shape = (*packed.shape[:-1], mn, packed.shape[-1] // mn)
    if EXTENSION_BUILT and packed.is_cuda:
        mxfp8.check_blocked_shape(rows_shape, "packed")
        rows = torch.ops.prime_moe.unpack_scales_blocked(bits.contiguous(), mn)
    else:
        rows = mxfp8.unpack_scales_blocked(bits.reshape(rows_shape))
    return rows.view(torch.float8_e8m0fnu)


def quantize_mxfp8(
    x: torch.Tensor, *, rounding: str = "rceil", blocked: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 quantization on the GPU, bit for bit :func:`mxfp8.quantize_mxfp8` (whose
    docstring gives the rules: scale per 32 elements of the last dim, ``rounding`` "rceil"
    as the consumer quantizes or "floor" as the kernel re-quantizes, NaN/Inf blocks all NaN).
    ``x``: bf16 (T, K) activations or (E, N, K) weights. Returns ``(values, scales)``:
    float8_e4m3fn like ``x`` and float8_e8m0fnu, row-major (..., K/32), or with ``blocked``
    each (N, K/32) in :func:`pack_scales_blocked`'s layout, shape (E, N*K/32) (needs
    N % 128 == 0 and (K/32) % 4 == 0)."""
    if rounding not in ("rceil", "floor"):
        raise ValueError(f"rounding must be 'rceil' or 'floor', got {rounding!r}")
    values, scale_bits = torch.ops.prime_moe.quantize_mxfp8(x, rounding == "rceil", blocked)
    return values, scale_bits.view(torch.float8_e8m0fnu)


def moe_align_max_padded(num_pairs: int, num_experts: int, pad: int) -> int:
    """Length of moe_align's sorted_token_ids: every expert may waste pad - 1 rows."""
    return -(-(num_pairs + num_experts * (pad - 1)) // pad) * pad


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M, bpc: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorts the T*k (token, slot) pairs by expert, stable by flat pair index, each expert's
    segment padded to a multiple of ``block_m * bpc``. Returns ``(sorted_token_ids,
    expert_ids, num_tokens_post_padded)``: flat pair indices with -1 on padding, one expert
    per block of ``block_m`` rows (-1 past the padded total), and the padded total (device
    memory, never synchronized). Ids outside [0, num_experts) are dropped pairs."""
    return torch.ops.prime_moe.moe_align(topk_ids, num_experts, block_m, bpc)


def fused_moe_bf16(
    x: torch.Tensor,
    w: torch.Tensor,
    w2: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor,
    top_k: int,
    block_m: int = BLOCK_M,
    block_n: int | None = None,
    warp_n: int | None = None,
    stages: int | None = None,
    bpc: int = 1,
    cpc: int | None = None,
    split: bool = True,
) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * (silu(x_t gate_e^T) * (x_t up_e^T)) w2_e^T``.

    ``split=True`` writes every element of ``out`` (bitwise deterministic);
    ``split=False`` adds into ``out``, which the caller must zero first. ``block_m`` and
    ``bpc`` must be those given to :func:`moe_align`. ``block_n``, ``warp_n``, ``stages`` and
    ``cpc`` are hints. None (or 0) takes the kernel's tuned choice for the shape, and so do
    the original's Blackwell tiles, spelled with ``warp_n`` 4 or 8 ((block_n, warp_n) in
    {(64, 4), (32, 8)}, stages 1..5, cpc 1), or by stages alone that only the original's
    default (64, 4) tile takes (1, or more than this kernel's ring holds). With ``warp_n`` None
    or 2 (this kernel's two consumer warpgroups), ``block_n`` (64, 128; 96 at block_m 128: the
    ping-pong gate/up tile) and ``stages`` (2 up to what shared memory holds) pin this
    kernel's own tile.
    ``cpc`` (1 or 0) is always a hint: the kernel picks its gate/up clusters by the shape.
    ``PRIME_MOE_PRINT_CONFIG=1`` prints what each hint became."""
    torch.ops.prime_moe.fused_moe_bf16(
        x,
        w,
        w2,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        topk_weights,
        out,
        top_k,
        block_m,
        block_n or 0,
        warp_n or 0,
        stages or 0,
        bpc,
        cpc or 0,
        split,
    )
    return out


def fused_moe_mxfp8(
    x: torch.Tensor,
    x_scales: torch.Tensor,
    w: torch.Tensor,
    w_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor,
    top_k: int,
    block_m: int = BLOCK_M,
    block_n: int = 64,
    warp_n: int = 4,
    stages: int = 4,
    bpc: int = 1,
    split: bool = True,
) -> torch.Tensor:
    """The MXFP8 forward: :func:`fused_moe_bf16`'s ``out`` from float8_e4m3fn ``x`` (T, D),
    ``w`` (E, 2H, D), ``w2`` (E, D, H) and their float8_e8m0fnu scales (one per 32 elements
    along each GEMM's reduction dim): ``x_scales`` row-major (T, D/32), ``w_scales`` and
    ``w2_scales`` each expert's (2H, D/32) and (D, H/32) in :func:`pack_scales_blocked`'s
    layout (any shape holding E*2H*D/32 and E*D*H/32 bytes, e.g. its (E, MN*K/32)). Exact MX
    numerics: every value times its scale exactly, the SwiGLU output re-quantized to MXFP8 per
    32 along H (rounding "floor" of :mod:`mxfp8`) before the down projection, fp32
    accumulation. ``split`` and the hints as :func:`fused_moe_bf16`: the defaults are the
    original's (block_n 64, warp_n 4, stages 4), which take the tuned tile here; ``block_m``
    and ``bpc`` must be those given to :func:`moe_align`. Shapes:
    :func:`unsupported_shape_reason` with ``mxfp8=True``. Memory: above 256 rows per routed
    expert on average (T*k / min(E, T*k)), the weights are widened once to bf16 in a workspace
    of E*3*D*H*2 bytes (csrc/fused_moe_mxfp8.cu); up to that they stream as fp8."""
    # The stable ABI does not name e8m0: the op takes the scales' bits (same bytes, a view).
    torch.ops.prime_moe.fused_moe_mxfp8(
        x,
        _scale_bits(x_scales),
        w,
        _scale_bits(w_scales),
        w2,
        _scale_bits(w2_scales),
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        topk_weights,
        out,
        top_k,
        block_m,
        block_n or 0,
        warp_n or 0,
        stages or 0,
        bpc,
        split,
    )
    return out


def _scale_bits(scales: torch.Tensor) -> torch.Tensor:
    if scales.dtype == torch.float8_e8m0fnu:
        return scales.view(torch.uint8)
    return scales  # anything else reaches the op's check, which names the argument


def moe(
    x: torch.Tensor,
    w: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    mxfp8: bool = False,
) -> torch.Tensor:
    """The MoE layer's expert computation for training: ``out[t] = sum_j topk_weights[t, j]
    * (silu(x_t gate_e^T) * (x_t up_e^T)) w2_e^T`` with ``e = topk_ids[t, j]`` (ids outside
    [0, E) are dropped pairs), differentiable w.r.t. ``x``, ``w``, ``w2`` and
    ``topk_weights``. Runs :func:`moe_align` and the deterministic (split) forward, keeping the
    gate/up pre-activations (len(sorted_token_ids) x 2H bf16) for the backward, whose kernels
    compute only the gradients of inputs that require them, bitwise repeatably. The shapes it
    takes are those :func:`unsupported_shape_reason` accepts.

    ``mxfp8=True``: the forward quantizes x, w and w2 as a consumer of :func:`fused_moe_mxfp8`
    does (per 32 along each GEMM's reduction dim, RCEIL scales) and runs it, keeping nothing;
    the backward runs the bf16 training forward again for what it needs and returns the bf16
    layer's gradients at the unquantized weights (the straight-through MXFP8 backward). Its
    shapes are those of ``unsupported_shape_reason(..., mxfp8=True)``."""
    sorted_ids, expert_ids, total = moe_align(topk_ids, w.shape[0], BLOCK_M)
    if mxfp8:
        return torch.ops.prime_moe.moe_forward_mxfp8(
            x, w, w2, sorted_ids, expert_ids, total, topk_weights, topk_ids.shape[1]
        )
    out, _, _ = torch.ops.prime_moe.moe_forward(
        x, w, w2, sorted_ids, expert_ids, total, topk_weights, topk_ids.shape[1]
    )
    return out


if EXTENSION_BUILT:

    @torch.library.register_fake("prime_moe::moe_align")
    def _moe_align_fake(topk_ids, num_experts, block_m=BLOCK_M, bpc=1):
        max_padded = moe_align_max_padded(topk_ids.numel(), num_experts, block_m * bpc)
        return (
            topk_ids.new_empty((max_padded,)),
            topk_ids.new_empty((max_padded // block_m,)),
            topk_ids.new_empty((1,)),
        )

    @torch.library.register_fake("prime_moe::fused_moe_bf16")
    def _fused_moe_bf16_fake(
        x,
        w,
        w2,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        topk_weights,
        out,
        top_k,
        block_m=BLOCK_M,
        block_n=0,
        warp_n=0,
        stages=0,
        bpc=1,
        cpc=0,
        split=True,
    ):
        return None

    @torch.library.register_fake("prime_moe::fused_moe_mxfp8")
    def _fused_moe_mxfp8_fake(
        x,
        x_scales,
        w,
        w_scales,
        w2,
        w2_scales,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        topk_weights,
        out,
        top_k,
        block_m=BLOCK_M,
        block_n=0,
        warp_n=0,
        stages=0,
        bpc=1,
        split=True,
    ):
        return None

    @torch.library.register_fake("prime_moe::quantize_mxfp8")
    def _quantize_mxfp8_fake(x, rceil=True, blocked=False):
        k_blocks = x.shape[-1] // MXFP8_SCALE_BLOCK
        if blocked:
            scale_shape = (*x.shape[:-2], x.shape[-2] * k_blocks)
        else:
            scale_shape = (*x.shape[:-1], k_blocks)
        return (
            x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty(scale_shape, dtype=torch.uint8),
        )

    @torch.library.register_fake("prime_moe::pack_scales_blocked")
    def _pack_scales_blocked_fake(scales):
        return scales.new_empty((*scales.shape[:-2], scales.shape[-2] * scales.shape[-1]))

    @torch.library.register_fake("prime_moe::unpack_scales_blocked")
    def _unpack_scales_blocked_fake(packed, mn):
        return packed.new_empty((*packed.shape[:-1], mn, packed.shape[-1] // mn))

    @torch.library.register_fake("prime_moe::moe_forward")
    def _moe_forward_fake(
        x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, top_k
    ):
        T, D = x.shape
        H = w.shape[1] // 2
        return (
            x.new_empty((T, D)),
            x.new_empty((sorted_token_ids.shape[0], 2 * H)),
            sorted_token_ids.new_empty((T * top_k,)),
        )

    @torch.library.register_fake("prime_moe::moe_forward_mxfp8")
    def _moe_forward_mxfp8_fake(
        x, w, w2, sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, top_k
    ):
        return x.new_empty(x.shape)

    @torch.library.register_fake("prime_moe::moe_backward")
    def _moe_backward_fake(
        grad_out,
        x,
        w,
        w2,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        topk_weights,
        z,
        pair_to_row,
        top_k,
        need_dx,
        need_dw,
        need_dw2,
        need_dtopk_weights,
        overwrite_z=False,
    ):
        def grad(need, like):
            return like.new_empty(like.shape if need else (0,))

        return (
            grad(need_dx, x),
            grad(need_dw, w),
            grad(need_dw2, w2),
            grad(need_dtopk_weights, topk_weights),
        )

    def _moe_forward_setup_context(ctx, inputs, output):
        x, w, w2, sorted_ids, expert_ids, total, topk_weights, top_k = inputs
        _, z, pair_to_row = output
        # Only out carries a gradient; z and pair_to_row are what backward keeps.
        ctx.mark_non_differentiable(z, pair_to_row)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, w, w2, sorted_ids, expert_ids, total, topk_weights, z, pair_to_row)
        ctx.top_k = top_k

    def _gradients(ctx, grad_out, inputs, z, pair_to_row, overwrite_z):
        """moe_backward's gradients for moe_forward's (or moe_forward_mxfp8's) inputs, None for
        every input that needs none."""
        need = ctx.needs_input_grad
        need_dx, need_dw, need_dw2, need_dtw = need[0], need[1], need[2], need[6]
        x, w, w2, sorted_ids, expert_ids, total, topk_weights = inputs
        dx, dw, dw2, dtw = torch.ops.prime_moe.moe_backward(
            grad_out.contiguous(),
            x,
            w,
            w2,
            sorted_ids,
            expert_ids,
            total,
            topk_weights,
            z,
            pair_to_row,
            ctx.top_k,
            need_dx,
            need_dw,
            need_dw2,
            need_dtw,
            overwrite_z,
        )
        return (
            dx if need_dx else None,
            dw if need_dw else None,
            dw2 if need_dw2 else None,
            None,
            None,
            None,
            dtw if need_dtw else None,
            None,
        )

    def _needs_none(ctx, grad_out):
        need = ctx.needs_input_grad
        return grad_out is None or not (need[0] or need[1] or need[2] or need[6])

    def _moe_forward_backward(ctx, grad_out, _grad_z, _grad_pair_to_row):
        if _needs_none(ctx, grad_out):
            return None, None, None, None, None, None, None, None
        *inputs, z, pair_to_row = ctx.saved_tensors
        # Unless the graph is kept for another backward (retain_graph=True, or no running
        # backward at all: tracing), z is not read again, so dz takes its memory: the largest
        # buffer this backward would otherwise allocate.
        overwrite_z = not torch._C._autograd._get_current_graph_task_keep_graph()
        return _gradients(ctx, grad_out, inputs, z, pair_to_row, overwrite_z)

    torch.library.register_autograd(
        "prime_moe::moe_forward",
        _moe_forward_backward,
        setup_context=_moe_forward_setup_context,
    )

    def _moe_forward_mxfp8_setup_context(ctx, inputs, output):
        x, w, w2, sorted_ids, expert_ids, total, topk_weights, top_k = inputs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, w, w2, sorted_ids, expert_ids, total, topk_weights)
        ctx.top_k = top_k

    def _moe_forward_mxfp8_backward(ctx, grad_out):
        if _needs_none(ctx, grad_out):
            return None, None, None, None, None, None, None, None
        inputs = ctx.saved_tensors
        # What the bf16 backward reads, from the bf16 forward at the unquantized inputs: its
        # z is this backward's own, so dz takes its memory.
        _, z, pair_to_row = torch.ops.prime_moe.moe_forward(*inputs, ctx.top_k)
        return _gradients(ctx, grad_out, inputs, z, pair_to_row, True)

    torch.library.register_autograd(
        "prime_moe::moe_forward_mxfp8",
        _moe_forward_mxfp8_backward,
        setup_context=_moe_forward_mxfp8_setup_context,
    )


def self_check(T: int = 1024, D: int = 1024, H: int = 512, E: int = 16, k: int = 4):
    """One small random problem through every op, against reference.py (for the CLI).
    Yields ``(label, relative error, ms)``."""
    from . import reference

    def timed(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        start.record()
        result = fn()
        end.record()
        torch.cuda.synchronize()
        return result, start.elapsed_time(end)

    x = (0.2 * torch.randn(T, D, device="cuda")).bfloat16()
    w = (0.05 * torch.randn(E, 2 * H, D, device="cuda")).bfloat16()
    w2 = (0.05 * torch.randn(E, D, H, device="cuda")).bfloat16()
    topk_ids, topk_weights = reference.routing(T, E, k, device="cuda")

    aligned, ms = timed(lambda: moe_align(topk_ids, E))
    expected = reference.moe_align_reference(topk_ids, E)
    mismatches = sum(int((a != b).sum()) for a, b in zip(aligned, expected))
    yield f"moe_align T={T} E={E} k={k} (mismatches)", float(mismatches), ms

    ref = reference.moe_grouped_mm(x, w, w2, topk_ids, topk_weights)
    for split in (True, False):
        out = torch.zeros_like(x)

        def forward(out=out, split=split):
            if not split:
                out.zero_()
            return fused_moe_bf16(x, w, w2, *aligned, topk_weights, out, k, split=split)

        result, ms = timed(forward)
        label = f"fused_moe_bf16 split={split} T={T} D={D} H={H} E={E} k={k}"
        yield label, reference.relative_error(result, ref), ms

    # MXFP8: against the exact-MX emulation (the contract's bars are wider).
    xq, xs = quantize_mxfp8(x)
    wq, ws = quantize_mxfp8(w)
    w2q, w2s = quantize_mxfp8(w2)
    operands = (xq, xs, wq, pack_scales_blocked(ws), w2q, pack_scales_blocked(w2s))
    for split in (True, False):
        out = torch.zeros_like(x)
        emulated = reference.moe_mxfp8_emulation(
            xq, xs, wq, ws, w2q, w2s, topk_ids, topk_weights, split=split
        )

        def forward(out=out, split=split):
            if not split:
                out.zero_()
            return fused_moe_mxfp8(*operands, *aligned, topk_weights, out, k, split=split)

        result, ms = timed(forward)
        label = f"fused_moe_mxfp8 split={split} T={T} D={D} H={H} E={E} k={k} (vs exact MX)"
        yield label, reference.relative_error(result, emulated), ms
