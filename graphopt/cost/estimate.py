"""Whole-model estimates: trace a training (or inference) step to an ATen graph and price it.

    est = estimate(model, {"input_ids": ids, "labels": ids}, profile="h100-sxm")
    est.time_s, est.flops, est.mfu, est.peak_bytes, est.cost.top(10)

``tracing="real"`` runs the step once on the given tensors under a dispatch-mode recorder
(:func:`record_step`: data-dependent code such as transformers' eager MoE expert loop is fine,
the graph is what this run dispatched); ``"fake"`` traces with ``make_fx`` and fake tensors and
never computes: use it for models built on the meta device, without weights. Forward and
``torch.autograd.grad`` of the loss are traced together, so the graph holds the backward's
ATen ops too, and parameters are graph inputs (their memory is counted separately).
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from graphopt.cost.graph_cost import GraphCost, graph_cost
from graphopt.cost.memory import liveness_peak
from graphopt.cost.profiles import ClusterProfile, default_profile_name, load_profile
from graphopt.errors import ConfigError


@dataclass
class Estimate:
    """Predicted cost of one step on one device of ``profile``.

    time_s: seconds; flops: FLOPs of the traced step; mfu: the time those FLOPs take at the
    peak FLOP/s of the dtype each op computes in, over time_s (the same per-dtype rates the
    time uses, so it is at most 1; for a one-dtype step, flops / (time_s * peak(dtype)));
    dtype: the parameters' dtype (for display); param_bytes: parameters and buffers;
    activation_bytes: liveness peak of the step's own tensors (gradients included);
    peak_bytes: their sum.
    """

    cost: GraphCost
    profile: ClusterProfile
    dtype: str
    param_bytes: int
    activation_bytes: int

    @property
    def time_s(self) -> float:
        return float(self.cost.time_s)

    @property
    def flops(self) -> float:
        return float(self.cost.flops)

    @property
    def mfu(self) -> float:
        return self.cost.mfu

    @property
    def peak_bytes(self) -> int:
        return self.param_bytes + self.activation_bytes


def _loss(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits.float().sum()
    leaves = [x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor)
              and x.is_floating_point()]
    if not leaves:
        raise ConfigError("the model returned no floating-point tensor to differentiate")
    return sum(x.float().sum() for x in leaves)  # type: ignore[return-value]


class _FlashAttention(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to the fused kernels an accelerator runs
    (``_scaled_dot_product_flash_attention``; ``_efficient_attention`` with a mask), so a fake
    trace on the meta device prices flash attention instead of PyTorch's CPU math path (which
    materializes S x S scores in fp32). ``cpu``: the CPU flash kernel a CPU run takes
    (``_scaled_dot_product_flash_attention_for_cpu``): on the meta device SDPA decomposes into
    the math path, so a CPU profile's estimate priced S x S scores the real run never keeps
    (a review); with dropout the CPU run does take the math path, and so does the estimate."""

    def __init__(self, cpu: bool = False) -> None:
        super().__init__()
        self.cpu = cpu

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                 "enable_gqa"]
        a = dict(zip(names, args)) | kwargs
        q, k, v = a["query"], a["key"], a["value"]
        mask = a.get("attn_mask")
        if not q.is_meta and torch.is_autocast_enabled(q.device.type):
            # autocast casts SDPA's floating operands to its dtype (CUDA's and the CPU's
            # lists); the kernels below are not on them (Llama's RoPE gives float32
            # queries and keys under autocast)
            dt = torch.get_autocast_dtype(q.device.type)
            q, k, v = (x.to(dt) if x.is_floating_point() else x for x in (q, k, v))
            if mask is not None and mask.is_floating_point():
                mask = mask.to(dt)
        if k.shape[1] != q.shape[1]:  # GQA: the kernels take equal head counts
            n = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1)
        p = float(a.get("dropout_p", 0.0) or 0.0)
        scale = a.get("scale")
        if self.cpu and p > 0:  # the CPU flash kernel has no dropout: torch takes the
            # math path (S x S scores), as on the meta device (a review: GPT-2's estimate
            # was 37% below its measured memory, with dropout 0.1)
            return func(*args, **kwargs)
        if self.cpu:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, p, bool(a.get("is_causal", False)), attn_mask=mask, scale=scale)[0]
        if mask is None:
            dv = v.shape[-1]  # V's head dim below Q's (MLA): padded, as FA2 callers do
            if dv < q.shape[-1]:
                v = torch.nn.functional.pad(v, (0, q.shape[-1] - dv))
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, p, bool(a.get("is_causal", False)), False, scale=scale)[0][..., :dv]
        bias = mask if mask.dtype != torch.bool else torch.zeros(
            mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, p, bool(a.get("is_causal", False)), scale=scale)[0]


def trace_step(model: torch.nn.Module, inputs: Mapping[str, Any] | tuple, *,
               train: bool = True, tracing: str = "real",
               fused_attention: bool | str = False,
               autocast: torch.dtype | None = None) -> fx.GraphModule:
    """The ATen graph of ``model(**inputs)`` (+ the gradients of its loss w.r.t. every
    trainable parameter and every input with requires_grad when ``train``). Parameters and
    buffers are the graph's first inputs.

    ``fused_attention`` (fake traces): SDPA becomes the flash/efficient attention kernels
    accelerators run, or with "cpu" the CPU flash kernel (see :class:`_FlashAttention`).

    ``autocast`` (fake traces): the step runs under ``torch.autocast(dtype=autocast)`` over
    the parameters as they are (float32 master weights: what ``graphopt.parallelize(...,
    mixed_precision="bf16")`` runs). Autocast has no meta device, so parameters, buffers and
    meta inputs become fake CPU tensors and the CPU's autocast op lists apply; for
    transformers' decoders they give CUDA's dtypes (GEMMs and SDPA in ``autocast``; norms,
    RoPE and the loss upcast to float32 in the model's own code), except that CUDA also
    upcasts a softmax over scores (eager attention), which the CPU keeps in bf16.

    Raises:
        ConfigError: ``tracing`` not "real"/"fake"; ``inputs`` neither a mapping nor a
            tuple/list; a fake trace of data-dependent code; ``autocast`` with a real trace
            or not a 16-bit floating dtype.
    """
    if tracing not in ("real", "fake"):
        raise ConfigError(f"tracing must be 'real' or 'fake', got {tracing!r}")
    if autocast is not None and (tracing != "fake" or autocast not in (torch.bfloat16,
                                                                       torch.float16)):
        raise ConfigError(f"autocast takes torch.bfloat16 or torch.float16 with tracing='fake'"
                          f", got {autocast!r} with tracing={tracing!r}")
    if not isinstance(inputs, Mapping | tuple | list):  # a bare tensor was unpacked into
        # its rows as positional arguments (a review)
        raise ConfigError(f"inputs must be a mapping of keyword arguments or a tuple of "
                          f"positional ones, got {type(inputs).__name__}; wrap one tensor "
                          "as (x,)")
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    trainable = [k for k, p in params.items() if p.requires_grad]
    kwargs = dict(inputs) if isinstance(inputs, Mapping) else {}
    args = tuple(inputs) if not isinstance(inputs, Mapping) else ()

    def step(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
             args: tuple, kwargs: dict[str, Any]) -> Any:
        # the parameters stay swapped in through the backward too: activation
        # checkpointing's recomputation (torch.utils.checkpoint) runs the module again there
        wrapper = _Step(model, train, [params[k] for k in trainable])
        prefixed = ({f"model.{k}": v for k, v in params.items()},
                    {f"model.{k}": v for k, v in buffers.items()})
        return torch.func.functional_call(wrapper, prefixed, args, kwargs)

    if "use_cache" not in kwargs and "use_cache" in inspect.signature(model.forward).parameters:
        kwargs["use_cache"] = False  # a training step keeps no KV cache (transformers built a
        # real DynamicCache inside the fake trace: an AssertionError, found by a review)
    if tracing == "real":
        if any(p.is_meta for p in params.values()):
            raise ConfigError("the model's parameters are on the meta device: a real trace "
                              "runs them; use tracing='fake'")
        if train and not trainable and not any(
                isinstance(t, torch.Tensor) and t.requires_grad
                for t in torch.utils._pytree.tree_leaves((args, kwargs))):
            raise ConfigError("nothing to differentiate: no trainable parameter and no input "
                              "with requires_grad; use train=False")
        return record_step(model, args, kwargs, train)
    detached = {k: v.detach().requires_grad_(v.requires_grad) for k, v in params.items()}
    context = torch.enable_grad() if train else torch.no_grad()
    attention = _FlashAttention(cpu=fused_attention == "cpu") if fused_attention else \
        contextlib.nullcontext()
    fresh = all(kwargs.get(k) is None for k in ("past_key_values", "attention_mask",
                                                 "position_ids"))
    causal = _no_packed_sequences() if fresh else contextlib.nullcontext()
    mixed = contextlib.nullcontext()
    if autocast is not None:
        detached, buffers, args, kwargs = _fake_cpu((detached, buffers, args, kwargs))
        mixed = torch.autocast("cpu", dtype=autocast)  # type: ignore[assignment]
    try:  # activation checkpointing's tracing marks torch.fx.traceback's current node
        # meta with its policy; restored so that later traces do not inherit the marks
        with context, attention, causal, mixed, torch.fx.traceback.preserve_node_meta():
            # tensors the model makes itself are constants of the trace (Falcon indexes
            # its fused QKV with a Python list, which becomes a meta tensor)
            return make_fx(step, tracing_mode=tracing,  # type: ignore[arg-type]
                           _allow_non_fake_inputs=True)(detached, buffers, args, kwargs)
    except Exception as exc:
        if "data-dependent" in str(exc).lower() or "_local_scalar_dense" in str(exc):
            raise ConfigError(
                "a fake trace hit data-dependent code (e.g. transformers' eager MoE expert "
                "loop); build the model with real weights and use tracing='real', or use "
                "experts_implementation='grouped_mm'") from exc
        raise


def _fake_cpu(tree: Any) -> Any:
    """``tree`` with its meta tensors replaced by fake CPU tensors of one fake mode (same
    shapes, strides, dtypes and requires_grad; nothing allocated), which make_fx then
    traces in."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def convert(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return t
        with mode:
            fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
        return fake.requires_grad_(t.requires_grad)

    return torch.utils._pytree.tree_map(convert, tree)


@contextlib.contextmanager
def _no_packed_sequences() -> Any:
    """A fake trace of a step without cache, padding mask or position ids builds
    transformers' causal mask as the real run does: not at all (SDPA's is_causal).
    transformers looks for packed sequences in the position ids it makes (arange); a fake
    trace cannot read them, so it kept an explicit S x S mask, and ``graphopt estimate``
    priced a mask the model never builds (2-5.5x the memory at short lengths, attention
    FLOPs without causal halving: a review). Arange position ids hold one sequence per row,
    so no packing is reported."""
    try:
        import transformers.masking_utils as masking
    except ImportError:
        yield
        return
    original = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


class _Step(torch.nn.Module):
    """Forward, loss and gradients of ``model`` as one module call (see :func:`trace_step`)."""

    def __init__(self, model: torch.nn.Module, train: bool,
                 params: list[torch.Tensor]) -> None:
        super().__init__()
        self.model, self.train_step, self.wrt_params = model, train, params

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.model(*args, **kwargs)
        if not self.train_step:
            return out
        loss = _loss(out)
        wrt = self.wrt_params + [
            t for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.requires_grad]
        if not wrt:
            raise ConfigError("nothing to differentiate: no trainable parameter and no input "
                              "with requires_grad; use train=False")
        return loss, torch.autograd.grad(loss, wrt, allow_unused=True)


class _Recorder(TorchDispatchMode):
    """Builds an FX graph of the ATen ops a real run dispatches (forward and backward),
    with meta-tensor ``val`` s; tensors are matched to their producing node by identity."""

    def __init__(self) -> None:
        super().__init__()
        self.graph = fx.Graph()
        self.producer: dict[int, fx.Node] = {}
        self.leaves: dict[int, torch.Tensor] = {}  # keep inputs alive: ids stay unique

    def _arg(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        node = self.producer.get(id(x))
        if node is None:
            node = self.graph.placeholder(f"input_{len(self.leaves)}")
            node.meta["val"] = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype,
                                                   device="meta")
            self.producer[id(x)] = node
            self.leaves[id(x)] = x
        return node

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        fx_args, fx_kwargs = torch.utils._pytree.tree_map(self._arg, (args, kwargs))
        node = self.graph.call_function(func, tuple(fx_args), dict(fx_kwargs))
        node.meta["val"] = torch.utils._pytree.tree_map(
            lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            if isinstance(t, torch.Tensor) else t, out)
        if isinstance(out, torch.Tensor):
            self.producer[id(out)] = node
        elif isinstance(out, (tuple, list)):
            for i, t in enumerate(out):
                if isinstance(t, torch.Tensor):
                    item = self.graph.call_function(operator.getitem, (node, i))
                    item.meta["val"] = node.meta["val"][i]
                    self.producer[id(t)] = item
        return out


def record_step(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any],
                train: bool = True) -> fx.GraphModule:
    """Run ``model(*args, **kwargs)`` (+ backward of its loss when ``train``) for real and
    return the graph of the ATen ops it dispatched (data-dependent code is fine: the run
    decides). Leaf tensors (parameters, inputs) become placeholders; gradients the output."""
    recorder = _Recorder()
    context = torch.enable_grad() if train else torch.no_grad()
    with context, recorder:
        out = model(*args, **kwargs)
        if train:
            wrt = [p for p in model.parameters() if p.requires_grad]
            grads = torch.autograd.grad(_loss(out), wrt, allow_unused=True)
            results = [g for g in grads if g is not None]
        else:
            results = [x for x in torch.utils._pytree.tree_leaves(out)
                       if isinstance(x, torch.Tensor)]
    graph = recorder.graph
    graph.output(tuple(recorder.producer[id(r)] for r in results
                       if id(r) in recorder.producer))
    return fx.GraphModule(torch.nn.Module(), graph)


def estimate(model: torch.nn.Module | Callable[..., Any], inputs: Mapping[str, Any] | tuple,
             profile: str | Path | ClusterProfile | None = None, *, train: bool = True,
             tracing: str = "real", gm: fx.GraphModule | None = None) -> Estimate:
    """Predict time, FLOPs, MFU and memory of one forward(+backward) step on one device of
    ``profile`` (default: :func:`~graphopt.cost.profiles.default_profile_name`, the
    calibrated "local" profile when there is one, else h100-sxm).

    Raises:
        ConfigError: unknown profile (lists the valid ones), bad tracing mode, or a
            bfloat16/float16 model on a profile without that rate.
    """
    prof = load_profile(profile if profile is not None else default_profile_name())
    if not isinstance(model, torch.nn.Module):
        raise ConfigError("estimate() takes an nn.Module (wrap functions in a Module)")
    threads = prof.device.threads
    if threads is not None and threads != torch.get_num_threads():
        import warnings

        warnings.warn(f"graphopt estimate: profile {prof.name!r} was calibrated with {threads} "
                      f"torch threads, this process runs {torch.get_num_threads()}: its rates "
                      "do not apply (set OMP_NUM_THREADS / torch.set_num_threads to match, or "
                      "recalibrate)", stacklevel=2)
    fused = tracing == "fake" and ("cpu" if prof.device.kind == "cpu" else True)
    graph = gm if gm is not None else trace_step(model, inputs, train=train, tracing=tracing,
                                                 fused_attention=fused)
    cost = graph_cost(graph, prof.device)
    dtype = next((str(p.dtype).replace("torch.", "") for p in model.parameters()
                  if p.is_floating_point()), "float32")
    prof.device.require_rate(dtype)
    states = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return Estimate(cost, prof, dtype, states, liveness_peak(graph))
