"""Pure-PyTorch references for flash_moe (CPU and CUDA, no compiled extension needed).

Everything here follows the host-side contract (``CONTRACT.md``): ``x`` is (T, D), ``w`` is
(E, 2H, D) with rows [0, H) the gate projection and rows [H, 2H) the up projection (not
interleaved), ``w2`` is (E, D, H), ``topk_ids`` / ``topk_weights`` are (T, k) and are read
flat at index ``i = t * k + j``. An expert id outside [0, E) marks a dropped pair: it
contributes nothing to any output and appears in no expert segment.

- :func:`moe_grouped_mm` is the reference the consumer tests the fused kernels against (the
  grouped-mm expert path), with its rounding points.
- :func:`moe_expert_loop_fp32` is the ground truth: a per-expert loop in fp32 (or fp64).
- :func:`moe_mxfp8_emulation` is exact MX: what ``fused_moe_mxfp8`` computes, up to fp32
  summation order; :func:`moe_mxfp8_floor` is the contract's quantization floor for MXFP8.
- :func:`moe_backward_reference` is the backward in closed form: the math the backward
  kernels implement, and what they keep from the forward.
- :func:`moe_align_reference` pins the exact output of the ``moe_align`` op.
- :func:`routing` and :func:`relative_error` are what tests and benchmarks use to make
  inputs and to score outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "moe_grouped_mm",
    "moe_expert_loop_fp32",
    "moe_mxfp8_emulation",
    "moe_mxfp8_floor",
    "moe_backward_reference",
    "moe_align_reference",
    "routing",
    "relative_error",
]

_GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_moe_inputs(x, w, w2, topk_ids, topk_weights):
    if x.ndim != 2:
        raise ValueError(f"x must be (T, D), got shape {tuple(x.shape)}")
    T, D = x.shape
    if w.ndim != 3 or w.shape[2] != D or w.shape[1] % 2 != 0:
        raise ValueError(f"w must be (E, 2H, D) with D={D}, got shape {tuple(w.shape)}")
    E, H = w.shape[0], w.shape[1] // 2
    if tuple(w2.shape) != (E, D, H):
        raise ValueError(f"w2 must be (E, D, H) = {(E, D, H)}, got shape {tuple(w2.shape)}")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids must be (T, k) with T={T}, got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, "
            f"got {tuple(topk_weights.shape)}"
        )
    return T, D, E, H, topk_ids.shape[1]


def _use_grouped_mm(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm(a, b, offs=...)`` can take these operands.

    ``a`` is a contiguous (M, K) tensor, ``b`` an (E, K, N) view. torch 2.11 runs
    ``_grouped_mm`` on CPU too (bf16, fp16, fp32; forward and backward), but not fp64. On CUDA
    every stride of both operands must be a multiple of 16 bytes.
    """
    if not hasattr(torch, "_grouped_mm") or a.dtype not in _GROUPED_MM_DTYPES:
        return False
    if a.device.type == "cuda":
        size = a.element_size()
        strides = [s for s in (*a.stride(), *b.stride()) if s != 1]
        if any((s * size) % 16 for s in strides):
            return False
    return True


def _grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-group ``a[start:end] @ b[g]``: the fallback for operands ``_grouped_mm`` refuses.

    Same rounding points as ``_grouped_mm`` (one matmul per group in a's dtype, fp32
    accumulation for 16-bit types). It reads ``offs`` on the host (a sync on CUDA).
    """
    ends = offs.tolist()
    pieces, start = [], 0
    for g, end in enumerate(ends):
        if end > start:
            pieces.append(a[start:end] @ b[g])
        start = end
    if not pieces:
        return a.new_zeros(a.shape[0], b.shape[2])
    return torch.cat(pieces, dim=0)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if _use_grouped_mm(a, b):
        return torch._grouped_mm(a, b, offs=offs)
    return _grouped_mm_loop(a, b, offs)


def moe_grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """The grouped-mm expert path, as the consumer's reference computes it.

    Steps and rounding points (all in ``x.dtype`` unless said otherwise):

    1. stable argsort of the T*k flat pairs by expert id (ties keep flat order ``t*k + j``);
       dropped pairs (id outside [0, E)) sort last;
    2. ``x`` gathered into that order;
    3. one ``torch._grouped_mm`` against ``w`` transposed gives gate and up together (each
       output element is its own fp32-accumulated dot product rounded once to ``x.dtype``,
       so this matches two separate grouped mms for gate and up up to accumulation order);
    4. ``h = silu(gate) * up`` in ``x.dtype`` (two roundings for 16-bit types);
    5. ``torch._grouped_mm`` against ``w2`` transposed for the down projection;
    6. times the routing weight in fp32 (fp64 for fp64 inputs), cast to ``x.dtype``;
    7. ``index_add`` into zeros of (T, D) in ``x.dtype``.

    Returns (T, D) in ``x.dtype``; zeros when T * k == 0.

    Differentiable by autograd w.r.t. ``x``, ``w``, ``w2`` and ``topk_weights``.

    ``offs`` (int32 cumulative row counts per expert) comes from ``searchsorted`` on the
    sorted ids, so on CUDA nothing here waits on the device. Dropped pairs are kept in the
    buffer, counted into the last expert's group (so ``offs[-1]`` is always T*k and
    ``_grouped_mm`` never leaves rows uninitialized), with their gathered rows zeroed and their
    down-projection rows masked to zero (with ``where``, so even non-finite weights of the
    last expert cannot leak through) before the routing weight is applied: they add nothing
    to ``out`` and get exactly zero gradient.

    ``torch._grouped_mm`` runs on CPU in torch 2.11 (bf16, fp16 and fp32, forward and
    backward), so CPU uses it too. A per-expert loop with the same rounding points (which
    reads ``offs`` on the host) replaces it where it cannot run: fp64 inputs, a torch
    without ``_grouped_mm``, or, on CUDA, strides that are not multiples of 16 bytes (D or H
    not a multiple of 8 for 16-bit types). On CUDA, torch itself falls back to a per-group
    loop (with a host sync) for dtypes its fast kernel lacks (e.g. fp32 on sm90).
    """
    T, D, E, H, k = _check_moe_inputs(x, w, w2, topk_ids, topk_weights)
    if w.dtype != x.dtype or w2.dtype != x.dtype:
        raise TypeError(f"x, w and w2 must share a dtype, got {x.dtype}, {w.dtype}, {w2.dtype}")
    M = T * k
    if M == 0:
        return x.new_zeros(T, D)

    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < E)
    key = torch.where(valid, ids, E)  # dropped pairs sort after every expert
    sorted_key, order = torch.sort(key, stable=True)
    sorted_valid = (sorted_key < E).unsqueeze(1)
    token = order // k

    # offs[e] = rows of experts <= e; the last boundary is E + 1 so offs[-1] == M (dropped
    # rows ride in the last group and are masked below).
    bounds = torch.arange(1, E + 1, device=ids.device)
    bounds = bounds + (bounds == E).to(bounds.dtype)
    offs = torch.searchsorted(sorted_key, bounds, out_int32=True)

    zero = x.new_zeros(())
    xs = torch.where(sorted_valid, x.index_select(0, token), zero)
    gate_up = _grouped_mm(xs, w.contiguous().transpose(-2, -1), offs)  # (M, 2H)
    h = F.silu(gate_up[:, :H]) * gate_up[:, H:]
    y = _grouped_mm(h.contiguous(), w2.contiguous().transpose(-2, -1), offs)  # (M, D)
    y = torch.where(sorted_valid, y, zero)
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    tw = topk_weights.reshape(-1).index_select(0, order).to(acc)
    y = (y.to(acc) * tw.unsqueeze(1)).to(x.dtype)
    return x.new_zeros(T, D).index_add(0, token, y)


def moe_expert_loop_fp32(
    x: torch.Tensor,
    w: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    round_h: bool = True,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Ground truth: a loop over experts with every input upcast to ``dtype`` (fp32 default).

    ``out[t] = sum_j topk_weights[t, j] * (silu(x_t @ gate_e^T) * (x_t @ up_e^T)) @ w2_e^T``
    with ``e = topk_ids[t, j]``; pairs whose id is outside [0, E) are dropped. The result is
    in ``dtype`` (not cast back to ``x.dtype``).

    ``round_h=True`` rounds the SwiGLU output h to ``x.dtype`` before the down projection
    when ``x`` is bf16 (or fp16), as the contract has the kernels do; for fp32/fp64 inputs,
    or with ``round_h=False``, h stays in ``dtype``. ``dtype=torch.float64`` (with fp64
    inputs) makes this usable with ``torch.autograd.gradcheck``. Differentiable w.r.t.
    ``x``, ``w``, ``w2`` and ``topk_weights`` (the bf16 rounding of h passes gradients
    straight through, as ``Tensor.to`` does).
    """
    T, D, E, H, k = _check_moe_inputs(x, w, w2, topk_ids, topk_weights)
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    round_to = x.dtype if round_h and x.dtype in (torch.bfloat16, torch.float16) else None
    xf, wf, w2f = x.to(dtype), w.to(dtype), w2.to(dtype)
    twf = topk_weights.to(dtype)
    ids = topk_ids.to(torch.int64)
    out = torch.zeros(T, D, dtype=dtype, device=x.device)
    for e in range(E):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = xf[tok] @ wf[e].T
        h = F.silu(gu[:, :H]) * gu[:, H:]
        if round_to is not None:
            h = h.to(round_to).to(dtype)
        y = (h @ w2f[e].T) * twf[tok, slot].unsqueeze(1)
        out = out.index_add(0, tok, y)
    return out


def moe_mxfp8_emulation(
    x: torch.Tensor,
    x_scales: torch.Tensor,
    w: torch.Tensor,
    w_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    split: bool = True,
) -> torch.Tensor:
    """Exact MX: the numerics of ``fused_moe_mxfp8`` in fp32, up to the order of sums. ``x`` (T, D), ``w`` (E, 2H, D), ``w2`` (E, D, H) are float8_e4m3fn with
    row-major scales (..., K/32) (unpack blocked ones first). Every value times its scale
    exactly (fp32); gate/up in fp32; h = silu(g) * u re-quantized to MXFP8 per 32 along H
    (:func:`mxfp8.quantize_mxfp8` rounding "floor") and dequantized, then rounded to bf16 as
    the kernel stores it (exact but below about 2^-130); the down projection in fp32; then with
    ``split`` each pair's y rounded to bf16 (the kernel's y workspace) times the routing weight,
    without it bf16(weight * y) (what the kernel adds into out with bf16 atomics, whose
    roundings of the partial sums depend on the order and are not modelled), summed in fp32,
    out rounded to bf16."""
    from . import mxfp8

    T, D, E, H, k = _check_moe_inputs(x, w, w2, topk_ids, topk_weights)
    xf = mxfp8.dequantize_mxfp8(x, x_scales)
    ids = topk_ids.to(torch.int64)
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    for e in range(E):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = xf[tok] @ mxfp8.dequantize_mxfp8(w[e], w_scales[e]).T
        h = F.silu(gu[:, :H]) * gu[:, H:]
        hq, hs = mxfp8.quantize_mxfp8(h, rounding="floor")
        h = mxfp8.dequantize_mxfp8(hq, hs).bfloat16().float()
        y = h @ mxfp8.dequantize_mxfp8(w2[e], w2_scales[e]).T
        weight = topk_weights[tok, slot].float().unsqueeze(1)
        y = y.bfloat16().float() * weight if split else (y * weight).bfloat16().float()
        out = out.index_add(0, tok, y)
    return out.bfloat16()


def moe_mxfp8_floor(
    x: torch.Tensor,
    w: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """The contract's quantization floor for MXFP8: :func:`moe_expert_loop_fp32` on ``x``,
    ``w`` and ``w2`` round-tripped through MXFP8 as the consumer quantizes (block 32, e4m3,
    rounding "rceil"), h not rounded. Its error against the fp32 loop on the originals is
    what quantizing the inputs alone costs."""
    from . import mxfp8

    def round_trip(t):
        return mxfp8.dequantize_mxfp8(*mxfp8.quantize_mxfp8(t))

    return moe_expert_loop_fp32(
        round_trip(x), round_trip(w), round_trip(w2), topk_ids, topk_weights, round_h=False
    )


def moe_backward_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of the MoE forward, written out, in ``dtype``: ``(dx, dw, dw2,
    dtopk_weights)`` for ``grad_out`` = dO (T, D).

    Per routed pair p = (t, j) of expert e, with a = x_t, s = topk_weights[t, j], and what
    the forward keeps per pair, the gate/up pre-activations g = gate_e a and u = up_e a
    (h = silu(g) * u is recomputed; neither h nor the down projection's output y is stored):

    - dh' = w2_e^T dO_t (the dgrad of the down projection, before the routing weight);
    - ds_p = <dh', h> (= <dO_t, y>, so y is never needed);
    - dh = s dh'; dg = dh * u * silu'(g), silu'(g) = sig(g) (1 + g (1 - sig(g))); du = dh * silu(g);
    - dw2_e += s dO_t h^T; dgate_e += dg a^T; dup_e += du a^T (reductions over the expert's
      pairs: the weight gradients' K dimension is the expert's tokens);
    - dx_t += gate_e^T dg + up_e^T du, summed over the token's k pairs.

    Dropped pairs (id outside [0, E)) get ds = 0 and contribute nothing. h is not rounded
    (the fp64 truth of the unrounded model, as autograd of :func:`moe_expert_loop_fp32`
    with ``round_h=False`` and ``dtype=torch.float64``).
    """
    T, D, E, H, k = _check_moe_inputs(x, w, w2, topk_ids, topk_weights)
    if grad_out.shape != (T, D):
        raise ValueError(f"grad_out must be (T, D) = ({T}, {D}), got {tuple(grad_out.shape)}")
    xf, wf, w2f = x.to(dtype), w.to(dtype), w2.to(dtype)
    twf, dof = topk_weights.to(dtype), grad_out.to(dtype)
    ids = topk_ids.to(torch.int64)
    dx = torch.zeros_like(xf)
    dw = torch.zeros_like(wf)
    dw2 = torch.zeros_like(w2f)
    dtw = torch.zeros_like(twf)
    for e in range(E):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        a = xf[tok]
        g = a @ wf[e, :H].T
        u = a @ wf[e, H:].T
        sig = torch.sigmoid(g)
        h = g * sig * u
        dh_pre = dof[tok] @ w2f[e]  # (n, H): w2_e^T dO_t per pair
        s = twf[tok, slot].unsqueeze(1)
        dtw[tok, slot] = (dh_pre * h).sum(1)
        dh = s * dh_pre
        dg = dh * u * sig * (1 + g * (1 - sig))
        du = dh * g * sig
        dw2[e] = (s * dof[tok]).T @ h
        dw[e, :H] = dg.T @ a
        dw[e, H:] = du.T @ a
        dx.index_add_(0, tok, dg @ wf[e, :H] + du @ wf[e, H:])
    return dx, dw, dw2, dtw


def moe_align_reference(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int = 128,
    bpc: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact expected output of the ``moe_align`` op.

    The T*k flat pairs ``i = t * k + j`` are sorted by expert id ``topk_ids[t, j]``, stable in
    ``i``. Each expert's segment is padded up to a multiple of ``pad = block_m * bpc``; an
    expert with no pairs gets no rows. Segments are laid out in expert order.

    Returns, all int32 on ``topk_ids``' device:

    - ``sorted_token_ids``, length ``max_padded = ceil((T*k + E*(pad-1)) / pad) * pad``: the
      flat pair index ``i`` (token ``i // k``) in each real row; -1 in each padding row,
      including every row past the padded total;
    - ``expert_ids``, length ``max_padded // block_m``: the expert of each block of
      ``block_m`` rows; -1 for blocks past the padded total (kernels never read those,
      because they stop at ``num_tokens_post_padded``);
    - ``num_tokens_post_padded``, shape (1,): the padded total, a multiple of ``pad``.

    Ids outside [0, num_experts) are dropped pairs: they appear in no segment. Nothing here
    reads device values on the host.
    """
    if topk_ids.ndim != 2:
        raise ValueError(f"topk_ids must be (T, k), got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if num_experts < 1 or block_m < 1 or bpc < 1:
        raise ValueError(
            f"num_experts, block_m and bpc must be positive, got {num_experts}, {block_m}, {bpc}"
        )
    E, dev = int(num_experts), topk_ids.device
    pad = block_m * bpc
    n = topk_ids.numel()
    max_padded = -(-(n + E * (pad - 1)) // pad) * pad

    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < E)
    key = torch.where(valid, ids, E)
    sorted_key, order = torch.sort(key, stable=True)

    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:E]
    padded = (counts + pad - 1) // pad * pad
    seg_end = torch.cumsum(padded, 0)
    seg_start = seg_end - padded
    first = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    total = seg_end[-1:]

    # Row of each sorted pair: its segment's start plus its rank inside the expert. Dropped
    # pairs go to a spare slot past the end, which is cut off.
    ek = sorted_key.clamp(max=E - 1)
    rank = torch.arange(n, device=dev) - first[ek]
    row = torch.where(sorted_key < E, seg_start[ek] + rank, max_padded)
    sorted_ids = torch.full((max_padded + 1,), -1, dtype=torch.int64, device=dev)
    sorted_ids.scatter_(0, row, order)
    sorted_token_ids = sorted_ids[:max_padded].to(torch.int32)

    starts = torch.arange(0, max_padded, block_m, device=dev)
    block_expert = torch.searchsorted(seg_end, starts, right=True)
    expert_ids = torch.where(starts < total, block_expert, -1).to(torch.int32)
    return sorted_token_ids, expert_ids, total.to(torch.int32)


def routing(
    T: int,
    E: int,
    k: int,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of a softmax over random normal logits (T, E), renormalized to sum 1 per token.

    Returns ``(topk_ids int32 (T, k), topk_weights float32 (T, k))``; the k ids of a token
    are distinct. ``device`` defaults to the generator's device (CPU without one).
    """
    if not 1 <= k <= E:
        raise ValueError(f"k must be in [1, E={E}], got {k}")
    if device is None:
        device = generator.device if generator is not None else "cpu"
    logits = torch.randn(T, E, generator=generator, device=device, dtype=torch.float32)
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights.to(torch.float32)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b||_F / ||b||_F`` computed in float64 (b is the reference).

    ``a`` is moved to ``b``'s device when they differ. When ``||b||`` is 0 the answer is 0.0
    if ``a`` is all zeros too, else ``inf``.
    """
    b64 = b.detach().to(torch.float64)
    a64 = a.detach().to(device=b64.device, dtype=torch.float64)
    num = torch.linalg.vector_norm(a64 - b64).item()
    den = torch.linalg.vector_norm(b64).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den
