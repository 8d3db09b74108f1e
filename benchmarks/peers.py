"""The MoE implementations benchmarks/flash_moe.py times, behind one interface.

Every implementation computes, from x (T, D) bf16, w (E, 2H, D) bf16 (rows [0, H) gate,
[H, 2H) up), w2 (E, D, H) bf16, topk_ids (T, k) int32 and topk_weights (T, k) fp32::

    out[t] = sum_j topk_weights[t, j] * (silu(x_t gate_e^T) * (x_t up_e^T)) w2_e^T

``prepare(w, w2)`` converts weights into the implementation's layout once per config
(outside any timed region); ``forward(state, x, ids, wts)`` returns a zero-argument
callable whose every call is one whole forward as a user pays it (no autograd, inference
settings). Training, the step a trainer runs, goes through ``train_step(state, topk_ids)``
(called outside any timed region, so that it may prepare index tensors from the routing):
a function ``(x, w, w2, topk_weights) -> out`` differentiable w.r.t. x, w, w2 and, where
``routing_grad``, topk_weights, in our layouts. From it ``forward_train(...)`` returns
a callable running the forward with grad enabled on fresh leaf copies of x, w, w2 and
topk_weights (all requiring grad), returning out and so keeping what autograd saved, as a
trainer's forward does; ``forward_backward(..., grad_out)`` a callable running forward and
backward (``torch.autograd.grad``, no accumulation into ``.grad``, as after a
``zero_grad(set_to_none=True)``) and returning the gradients (dx, dw, dw2, dtopk_weights),
dtopk_weights None where the implementation cannot differentiate w.r.t. routing weights.
``settings()`` says what it ran with (autotune, layout flags), for the raw numbers' meta;
``recover(failure=..., rel_err=...)`` may change a setting after a failed or wrong first call
and say which (the harness then tries once more); ``row_note(mode)`` is a line for its rows
of that mode ("fwd", "fwd-train" or "fwd+bwd").
``Skip`` (harness.Skip) carries the one-line reason an implementation cannot run.

Ours: ``Ours`` (moe_align + fused_moe_bf16, split or not; flash_moe.moe for training) and
``OursMxfp8`` (moe_align + fused_moe_mxfp8 on inputs quantized outside the timing, or with
the quantizers of x, w and w2 in every call).

Peers (wheels from scripts/fetch-peer-wheels, installed into PYTHONPATH):

- Liger-Kernel 0.8.5, ``liger_kernel.ops.fused_moe.LigerFusedMoEFunction.apply(x,
  gate_up_proj (E, 2I, D), down_proj (E, D, I), top_k_index int32 (T, k), top_k_weights
  (T, k))``: Triton; our layout exactly (gate rows first), so no conversion. Its kernels
  autotune (32 configs, keyed on D and I) unless ``LIGER_FUSED_MOE_AUTOTUNE=0`` is set
  before the import; the benchmark sets it unless asked to tune peers. Its backward returns
  the gradient of top_k_weights too, computed in dO's dtype (bf16: ``dS``, Triton
  atomic_add across the N tiles into a bf16 buffer), which autograd casts to fp32.
- SonicMoE 0.1.2.post1, ``sonicmoe.moe_general_routing_inputs(x, router_scores (TK,)
  fp32, token_indices (TK,) int32 sorted, expert_indices (TK,) int32, w1 (2I, D, E), b1,
  w2 (D, I, E), b2, E, stream_id, ActivationType.SWIGLU, is_inference_mode_enabled,
  concat_layout)`` returns ``(out, expert_frequency)``. w1/w2 are our tensors permuted
  (1, 2, 0) (views, no copy); ``concat_layout=True`` means gate rows then up rows, as ours;
  without it SonicMoE expects gate/up rows interleaved. Its GEMMs are QuACK's CuTe-DSL
  grouped GEMMs, autotuned per shape unless we pass ``tuned=False`` (the benchmark does,
  unless asked to tune peers). Training mode is ``is_inference_mode_enabled=False`` (the
  up projection then keeps its pre-activations for the backward); router_scores are
  differentiable there: ``_DownProjection.backward`` returns ``ds`` (TK,) fp32 for them,
  scattered back to the input's order. Our router_scores are topk_weights' (T, k) leaf
  viewed flat (token-major, as token_indices), so its gradient is dtopk_weights.
- vLLM's Triton fused_moe: not timed (``VLLM_REASON`` says why).
"""

from __future__ import annotations

import functools
import os
import site

from harness import Skip, first_line, package_version

# far above bf16 rounding (~6e-3 here): SonicMoE read the gate/up rows in the wrong layout
WRONG_LAYOUT_REL_ERR = 0.2
VLLM_REASON = (
    "vLLM's Triton fused_moe is not timed: vllm 0.33.0 pins torch==2.14.0, and "
    "vllm/model_executor/layers/fused_moe/fused_moe.py imports vllm._custom_ops (vLLM's "
    "compiled extensions, built for that torch), vllm.envs, vllm.platforms and the rest of "
    "the package at import time, so the kernel does not import standalone under another torch"
)


def activate_pth_files() -> None:
    """Runs the .pth files of PYTHONPATH entries, which Python does only for site dirs.

    ``pip install --target /tmp/site`` + ``PYTHONPATH=/tmp/site`` leaves
    nvidia_cutlass_dsl.pth unprocessed; it is what puts the ``cutlass`` package
    (/tmp/site/nvidia_cutlass_dsl/python_packages) on sys.path."""
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and os.path.isdir(entry):
            try:
                if any(name.endswith(".pth") for name in os.listdir(entry)):
                    site.addsitedir(entry)
            except OSError:
                pass


def peer_versions() -> dict[str, str | None]:
    names = (
        "liger-kernel",
        "sonic-moe",
        "quack-kernels",
        "nvidia-cutlass-dsl",
        "nvidia-cutlass-dsl-libs-base",
        "apache-tvm-ffi",
        "triton",
        "torch",
    )
    return {name: package_version(name) for name in names}


class Impl:
    name = "?"
    kind = "peer"  # "ours", "baseline" or "peer"
    note = ""
    # whether train_step is differentiable w.r.t. topk_weights, and how (for settings)
    routing_grad = True
    routing_grad_note = "fp32"

    def prepare(self, w, w2):
        return (w, w2)

    def settings(self) -> dict:
        return {"dtopk_weights": self.routing_grad_note if self.routing_grad else None}

    def recover(self, failure=None, rel_err=None) -> str | None:
        return None

    def row_note(self, mode) -> str | None:
        if mode != "fwd" and not self.routing_grad:
            return "no gradient w.r.t. topk_weights (routing weights held constant)"
        return None

    def forward(self, state, x, topk_ids, topk_weights):
        raise NotImplementedError

    def train_step(self, state, topk_ids):
        """``(x, w, w2, topk_weights) -> out`` with autograd, for this routing (Skip if
        none)."""
        raise Skip(f"{self.name} has no backward here")

    def forward_train(self, state, x, w, w2, topk_ids, topk_weights):
        step = self.train_step(state, topk_ids)
        leaves = _leaves(x, w, w2, topk_weights, self.routing_grad)
        return lambda: step(*leaves)

    def forward_backward(self, state, x, w, w2, topk_ids, topk_weights, grad_out):
        import torch

        step = self.train_step(state, topk_ids)
        leaves = _leaves(x, w, w2, topk_weights, self.routing_grad)
        wanted = [t for t in leaves if t.requires_grad]

        def fn():
            out = step(*leaves)
            grads = iter(torch.autograd.grad(out, wanted, grad_out))
            return tuple(next(grads) if t.requires_grad else None for t in leaves)

        return fn


def _leaves(x, w, w2, topk_weights, routing_grad=True):
    """Fresh leaf copies of x, w, w2 and topk_weights, made outside any timed region; all
    require grad, topk_weights only with ``routing_grad``."""
    return tuple(
        t.detach().clone().requires_grad_(grad)
        for t, grad in ((x, True), (w, True), (w2, True), (topk_weights, routing_grad))
    )


class GroupedMM(Impl):
    """prime_kernels.flash_moe.reference.moe_grouped_mm: torch._grouped_mm expert path."""

    name = "grouped-mm"
    kind = "baseline"

    def __init__(self):
        from prime_kernels.flash_moe import reference

        self.reference = reference

    def forward(self, state, x, topk_ids, topk_weights):
        import torch

        w, w2 = state
        ref = self.reference.moe_grouped_mm

        def fn():
            with torch.no_grad():
                return ref(x, w, w2, topk_ids, topk_weights)

        return fn

    def train_step(self, state, topk_ids):
        ref = self.reference.moe_grouped_mm
        return lambda x, w, w2, topk_weights: ref(x, w, w2, topk_ids, topk_weights)


class Ours(Impl):
    """prime_kernels' flash_moe: moe_align + fused_moe_bf16 (the whole forward)."""

    kind = "ours"

    def __init__(self, fm, split: bool):
        self.fm = fm
        self.split = split
        self.name = f"ours split={split}"

    def settings(self):
        return {
            **super().settings(),
            "split": self.split,
            "block_m": self.fm.BLOCK_M,
            "training": "flash_moe.moe (one row: the split forward, keeping the gate/up "
            "pre-activations, and flash_moe's backward kernels)",
        }

    def prepare(self, w, w2):
        reason_fn = getattr(self.fm, "unsupported_shape_reason", None)
        if reason_fn is not None:
            E, two_h, D = w.shape
            try:
                reason = reason_fn(D, two_h // 2, split=self.split)
            except TypeError:
                reason = reason_fn(D, two_h // 2)
            if reason:
                raise Skip(reason)
        return (w, w2)

    def forward(self, state, x, topk_ids, topk_weights):
        import torch

        fm, split = self.fm, self.split
        w, w2 = state
        E, k = w.shape[0], topk_ids.shape[1]
        T, D = x.shape
        block_m = fm.BLOCK_M

        def fn():
            sorted_ids, expert_ids, ntpp = fm.moe_align(topk_ids, E, block_m=block_m)
            if split:
                out = torch.empty(T, D, dtype=x.dtype, device=x.device)
            else:
                out = torch.zeros(T, D, dtype=x.dtype, device=x.device)
            return fm.fused_moe_bf16(
                x, w, w2, sorted_ids, expert_ids, ntpp, topk_weights, out, k, split=split
            )

        return fn

    def train_step(self, state, topk_ids):
        """flash_moe.moe: moe_align, the split forward keeping the gate/up pre-activations,
        and flash_moe's backward kernels (bf16; moe() has no split choice)."""
        moe = getattr(self.fm, "moe", None)
        if moe is None:
            raise Skip("prime_kernels.flash_moe has no moe() (autograd function) yet")
        return lambda x, w, w2, topk_weights: moe(x, w, w2, topk_ids, topk_weights)


MXFP8 = "ours-mxfp8"
MXFP8_QUANT = "ours-mxfp8+quant"


class OursMxfp8(Impl):
    """prime_kernels' flash_moe in MXFP8: moe_align + fused_moe_mxfp8 (split=True), on x, w
    and w2 quantized as the consumer quantizes them (RCEIL; the weights' scales blocked). The
    op takes quantized inputs, so by default the weights are quantized once per config and x
    once per shape, outside the timing; with ``quantize_each_call`` every call quantizes all
    three first, as a trainer's forward must each step (the weights change every step)."""

    kind = "ours"

    def __init__(self, fm, quantize_each_call: bool):
        self.fm = fm
        self.quantize_each_call = quantize_each_call
        self.name = MXFP8_QUANT if quantize_each_call else MXFP8

    def settings(self):
        return {
            **super().settings(),
            "split": True,
            "block_m": self.fm.BLOCK_M,
            "rounding": "rceil",
            "scales": "x row-major, w and w2 blocked (pack_scales_blocked's layout)",
            "quantized": "x, w and w2 in every call"
            if self.quantize_each_call
            else "once, outside the timing",
        }

    def quantize(self, t, blocked):
        """(values, scales) of ``t`` as the consumer quantizes it."""
        return self.fm.quantize_mxfp8(t, blocked=blocked)

    def run(self, xq, xs, wq, ws, w2q, w2s, topk_ids, topk_weights):
        """The forward on quantized inputs, as the user pays it: moe_align, out, the op."""
        import torch

        fm = self.fm
        E, k = wq.shape[0], topk_ids.shape[1]
        sorted_ids, expert_ids, ntpp = fm.moe_align(topk_ids, E, block_m=fm.BLOCK_M)
        out = torch.empty(xq.shape, dtype=torch.bfloat16, device=xq.device)
        return fm.fused_moe_mxfp8(
            xq, xs, wq, ws, w2q, w2s, sorted_ids, expert_ids, ntpp, topk_weights, out, k
        )

    def prepare(self, w, w2):
        E, two_h, D = w.shape
        reason = self.fm.unsupported_shape_reason(D, two_h // 2, mxfp8=True)
        if reason:
            raise Skip(reason)
        if self.quantize_each_call:
            return (w, w2)
        try:
            return (*self.quantize(w, True), *self.quantize(w2, True))
        except Exception as exc:  # a build without the quantizer: skip, not stop the run
            raise Skip(f"quantize_mxfp8 of the weights failed ({first_line(exc)})") from None

    def forward(self, state, x, topk_ids, topk_weights):
        run, quantize = self.run, self.quantize
        if self.quantize_each_call:
            w, w2 = state

            def fn():
                return run(
                    *quantize(x, False),
                    *quantize(w, True),
                    *quantize(w2, True),
                    topk_ids,
                    topk_weights,
                )

            return fn
        xq, xs = quantize(x, False)
        return lambda: run(xq, xs, *state, topk_ids, topk_weights)


class Liger(Impl):
    name = "liger"
    routing_grad_note = "bf16 (atomic_add into a bf16 buffer), cast to fp32 by autograd"

    def __init__(self):
        try:
            from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
        except Exception as exc:  # ImportError and whatever its imports raise
            raise Skip(f"liger-kernel not importable ({first_line(exc)})") from None
        self.fn = LigerFusedMoEFunction
        import liger_kernel.ops.fused_moe_kernels as kernels

        self.tuned = not getattr(kernels, "_AUTOTUNE_DISABLED", False)
        self.note = (
            f"liger-kernel {package_version('liger-kernel')}, "
            f"autotune {'on' if self.tuned else 'off'}"
        )

    def settings(self):
        return {**super().settings(), "autotune": self.tuned}

    def forward(self, state, x, topk_ids, topk_weights):
        import torch

        w, w2 = state
        apply = self.fn.apply

        def fn():
            with torch.no_grad():
                return apply(x, w, w2, topk_ids, topk_weights)

        return fn

    def train_step(self, state, topk_ids):
        apply = self.fn.apply
        return lambda x, w, w2, topk_weights: apply(x, w, w2, topk_ids, topk_weights)


def _interleave_gate_up(w):
    """(E, 2H, D) [gate; up] -> (E, 2H, D) with rows gate_0, up_0, gate_1, up_1, ..."""
    E, two_h, D = w.shape
    h = two_h // 2
    return w.view(E, 2, h, D).transpose(1, 2).reshape(E, two_h, D).contiguous()


class Sonic(Impl):
    """SonicMoE pinned to QuACK's default GEMM config (``tuned=False``) or autotuned per shape
    (``tuned=True``, SonicMoE's own default). Both settings may be timed in one process: the
    GEMM entry points SonicMoE's modules imported are switched to the setting of the instance
    that calls (``_call``, which every forward and training step goes through), a comparison
    per call, a rebinding only where the setting changes."""

    name = "sonicmoe"
    peer = "sonicmoe"
    _GEMM_MODULES = (
        "sonicmoe.functional",
        "sonicmoe.functional.forward",
        "sonicmoe.functional.backward",
    )
    _gemms = None  # (module, attribute) -> QuACK's function, as SonicMoE imported it
    _pinned = None  # the setting the modules hold now

    def __init__(self, tuned: bool, name: str | None = None):
        activate_pth_files()
        try:
            import sonicmoe
            import sonicmoe.functional as functional
            from sonicmoe.enums import ActivationType
        except Exception as exc:
            raise Skip(f"sonic-moe not importable ({first_line(exc)})") from None
        self.general = sonicmoe.moe_general_routing_inputs
        self.swiglu = ActivationType.SWIGLU
        self.tuned = tuned
        if name is not None:
            self.name = name
        if Sonic._gemms is None:
            import importlib

            gemms = {}
            for mod_name in Sonic._GEMM_MODULES:
                try:
                    mod = importlib.import_module(mod_name)
                except ImportError:
                    continue
                for fn_name in ("gemm", "gemm_gated", "gemm_dgated"):
                    fn = getattr(mod, fn_name, None)
                    if fn is not None:
                        gemms[(mod, fn_name)] = fn
            Sonic._gemms = gemms
        del functional
        self.concat = True  # set False by recover() if concat_layout proves wrong
        self.inference = True  # set False by recover() if is_inference_mode_enabled=True fails
        versions = ", ".join(
            f"{n} {package_version(n)}"
            for n in ("sonic-moe", "quack-kernels", "nvidia-cutlass-dsl")
        )
        self.note = f"{versions}, autotune {'on' if tuned else 'off'}"

    def _select(self):
        """QuACK's gemm/gemm_gated/gemm_dgated autotune per shape (tuned=True, their default);
        pinned, every module that imported them calls them with tuned=False instead."""
        pinned = not self.tuned
        if Sonic._pinned is pinned:
            return
        for (mod, fn_name), fn in Sonic._gemms.items():
            setattr(mod, fn_name, functools.partial(fn, tuned=False) if pinned else fn)
        Sonic._pinned = pinned

    def settings(self):
        return {
            **super().settings(),
            "autotune": self.tuned,
            "training": "is_inference_mode_enabled=False, router_scores a leaf's flat view",
            "concat_layout": self.concat,
            "is_inference_mode_enabled": self.inference,
        }

    def recover(self, failure=None, rel_err=None):
        if failure is not None and self.inference:
            self.inference = False
            return (
                f"is_inference_mode_enabled=True failed ({first_line(failure)}); "
                "retrying with False"
            )
        if rel_err is not None and self.concat and rel_err > WRONG_LAYOUT_REL_ERR:
            self.concat = False
            return (
                f"concat_layout=True gives rel err {rel_err:.2e}; trying interleaved gate/up rows"
            )
        return None

    def row_note(self, mode):
        inference = self.inference if mode == "fwd" else False
        return f"concat_layout={self.concat}, is_inference_mode_enabled={inference}"

    def prepare(self, w, w2):
        return {"w": w, "w2": w2.permute(1, 2, 0)}  # w2 (D, H, E) view

    def _w1(self, state):
        """(2H, D, E): a view of ours (gate rows then up rows), or, once concat_layout has
        proved wrong, an interleaved copy made outside any timed region."""
        key = "w1" if self.concat else "w1_interleaved"
        if key not in state:
            w = state["w"]
            state[key] = (w if self.concat else _interleave_gate_up(w)).permute(1, 2, 0)
        return state[key]

    def _index(self, topk_ids):
        """token_indices (sorted, token-major) and expert_indices, int32 (TK,)."""
        import torch

        T, k = topk_ids.shape
        token = torch.arange(T, device=topk_ids.device, dtype=torch.int32).repeat_interleave(k)
        return token, topk_ids.reshape(-1).to(torch.int32).contiguous()

    def _routing(self, x, topk_ids, topk_weights):
        import torch

        token, expert = self._index(topk_ids)
        return topk_weights.reshape(-1).to(torch.float32).contiguous(), token, expert

    def _call(self, x, scores, token, expert, w1, w2, inference):
        import torch

        self._select()
        E = w2.shape[-1]
        stream = torch.cuda.current_stream().cuda_stream
        out, _ = self.general(
            x,
            scores,
            token,
            expert,
            w1,
            None,
            w2,
            None,
            E,
            stream,
            self.swiglu,
            is_inference_mode_enabled=inference,
            concat_layout=self.concat,
        )
        return out

    def forward(self, state, x, topk_ids, topk_weights):
        import torch

        w1, w2 = self._w1(state), state["w2"]
        scores, token, expert = self._routing(x, topk_ids, topk_weights)
        call = self._call

        def fn():
            with torch.no_grad():
                return call(x, scores, token, expert, w1, w2, self.inference)

        return fn

    def train_step(self, state, topk_ids):
        """SonicMoE in training mode (is_inference_mode_enabled=False) on our layouts: w1 and
        w2 the leaves' permuted views, router_scores topk_weights' leaf viewed flat (fp32,
        token-major as token_indices), so autograd returns dtopk_weights (T, k) from its ds.
        token_indices and expert_indices are made here, outside the timing, as forward()
        makes them."""
        if not self.concat:
            raise Skip("sonicmoe training is only set up for concat_layout=True")
        token, expert = self._index(topk_ids)
        call = self._call

        def step(x, w, w2, topk_weights):
            scores = topk_weights.view(-1)
            return call(x, scores, token, expert, w.permute(1, 2, 0), w2.permute(1, 2, 0), False)

        return step
