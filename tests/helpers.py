"""Test-only passes (registered once) and small modules shared by tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from graphopt.cost.profiles import ClusterProfile, load_profile
from graphopt.passes import register_pass
from graphopt.passes.base import GraphPass, PassContext, PassResult
from graphopt.passes.fx_utils import site_name

aten = torch.ops.aten


def _sin_to_cos(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    changed = False
    for node in gm.graph.nodes:
        if node.target is aten.sin.default:
            node.target = aten.cos.default  # deliberately wrong: same meta, other values
            ctx.record("rewritten", site_name(node), "sin -> cos (test-only, wrong)")
            changed = True
    return PassResult(gm, changed)


@register_pass
@dataclass(frozen=True)
class WrongExactPass(GraphPass):
    """Claims exactness but replaces sin by cos: verify must catch it and name it."""

    name = "test_wrong_exact"
    stage = "pre_autograd"
    exact = True

    def run(self, gm, ctx):
        return _sin_to_cos(gm, ctx)


@register_pass
@dataclass(frozen=True)
class GradientScalePass(GraphPass):
    """Claims exactness, keeps the forward bit for bit and makes every gradient 1.5x eager's
    (``y + 0.5 * (y - y.detach())`` on the first output): verify must catch it also when
    the gradients are small (a mean loss's, ~1e-3)."""

    name = "test_gradient_scale"
    stage = "pre_autograd"
    exact = True

    def run(self, gm, ctx):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        y = out.args[0][0]
        with gm.graph.inserting_before(out):
            detached = gm.graph.call_function(aten.detach.default, (y,))
            half = gm.graph.call_function(
                aten.mul.Tensor, (gm.graph.call_function(aten.sub.Tensor, (y, detached)), 0.5))
            scaled = gm.graph.call_function(aten.add.Tensor, (y, half))
        for node in (detached, half, scaled, half.args[0]):
            node.meta["val"] = y.meta["val"]
        out.args = ((scaled, *out.args[0][1:]),)
        ctx.record("rewritten", site_name(y), "gradient x1.5 (test-only, wrong)")
        gm.recompile()
        return PassResult(gm, True)


@register_pass
@dataclass(frozen=True)
class SilentRewritePass(GraphPass):
    """Rewrites sin into cos and says it changed nothing (modified=False): the pipeline
    records it as modified from the op counts (tests/test_pipeline.py)."""

    name = "test_silent_rewrite"
    stage = "pre_autograd"
    exact = False

    def run(self, gm, ctx):
        return PassResult(_sin_to_cos(gm, ctx).gm, False)


@register_pass
@dataclass(frozen=True)
class NudgeSinPass(GraphPass):
    """Claims exactness but adds 1e-4 to every sin(): an error far above float64 rounding
    that verify must catch beside a large entry of the same tensor."""

    name = "test_nudge_sin"
    stage = "pre_autograd"
    exact = True

    def run(self, gm, ctx):
        changed = False
        for node in list(gm.graph.nodes):
            if node.target is aten.sin.default:
                with gm.graph.inserting_after(node):
                    add = gm.graph.call_function(aten.add.Tensor, (node, 1e-4))
                node.replace_all_uses_with(add)
                add.args = (node, 1e-4)  # its own input again
                add.meta.update(node.meta)
                ctx.record("rewritten", site_name(node), "sin + 1e-4 (test-only, wrong)")
                changed = True
        gm.recompile()
        return PassResult(gm, changed)


@register_pass
@dataclass(frozen=True)
class WrongApproximatePass(GraphPass):
    name = "test_wrong_approximate"
    stage = "pre_autograd"
    exact = False

    def run(self, gm, ctx):
        return _sin_to_cos(gm, ctx)


@register_pass
@dataclass(frozen=True)
class WrongJointPass(GraphPass):
    name = "test_wrong_joint"
    stage = "joint"
    exact = True

    def run(self, gm, ctx):
        return _sin_to_cos(gm, ctx)


@register_pass
@dataclass(frozen=True)
class ScaleLastGradientPass(GraphPass):
    """Claims exactness but scales the joint graph's last gradient by 0.9: verify must name
    it even where other tensors are noisy (tests/test_verify.py)."""

    name = "test_scale_last_gradient"
    stage = "joint"
    exact = True

    def run(self, gm, ctx):
        if ctx.graph_kind != "joint":
            return PassResult(gm, False)
        out = next(n for n in gm.graph.nodes if n.op == "output")
        flat = list(out.args[0])
        i = max(k for k, n in enumerate(flat) if isinstance(n, torch.fx.Node))
        with gm.graph.inserting_before(out):
            scaled = gm.graph.call_function(aten.mul.Tensor, (flat[i], 0.9))
        scaled.meta.update(flat[i].meta)
        flat[i] = scaled
        out.args = (type(out.args[0])(flat),)
        ctx.record("rewritten", "gradient", "scaled on purpose (test-only, wrong)")
        return PassResult(gm, True)


@register_pass
@dataclass(frozen=True)
class ScaleSinPass(GraphPass):
    """Claims exactness but scales every sin by 1.01: a 1% error that bf16's tolerance
    would hide (tests/test_verify.py)."""

    name = "test_scale_sin"
    stage = "pre_autograd"
    exact = True
    factor = 1.01

    def run(self, gm, ctx):
        modified = False
        for node in [n for n in gm.graph.nodes if n.target is aten.sin.default]:
            with gm.graph.inserting_after(node):
                scaled = gm.graph.call_function(aten.mul.Tensor, (node, self.factor))
            scaled.meta.update(node.meta)
            node.replace_all_uses_with(scaled, delete_user_cb=lambda u, s=scaled: u is not s)
            modified = True
        return PassResult(gm, modified)


@register_pass
@dataclass(frozen=True)
class ScaleSin5Pass(ScaleSinPass):
    """As ``test_scale_sin`` with 1.05: a 5% error, within bf16's relative L2 of 8 eps
    (6.25%) that verify accepted beyond atol before it asked a float64 run."""

    name = "test_scale_sin_5pct"
    factor = 1.05


@register_pass
@dataclass(frozen=True)
class FlipAbovePass(GraphPass):
    """Claims exactness but negates sin(x) where x > 4.4: wrong at a few entries only (a
    boundary or a dropped token), which an RMS over the whole tensor dilutes."""

    name = "test_flip_above"
    stage = "pre_autograd"
    exact = True

    def run(self, gm, ctx):
        modified = False
        for node in [n for n in gm.graph.nodes if n.target is aten.sin.default]:
            x = node.args[0]
            with gm.graph.inserting_after(node):
                mask = gm.graph.call_function(aten.gt.Scalar, (x, 4.4))
            with gm.graph.inserting_after(mask):
                neg = gm.graph.call_function(aten.neg.default, (node,))
            with gm.graph.inserting_after(neg):
                flipped = gm.graph.call_function(aten.where.self, (mask, neg, node))
            mask.meta["val"] = x.meta["val"] > 4.4
            neg.meta.update(node.meta)
            flipped.meta.update(node.meta)
            node.replace_all_uses_with(
                flipped, delete_user_cb=lambda u, mine=(neg, flipped): u not in mine)
            modified = True
        gm.recompile()
        return PassResult(gm, modified)


@register_pass
@dataclass(frozen=True)
class SplitSumPass(GraphPass):
    """Exact in real arithmetic, another rounding in floating point: a sum over the last
    dim becomes the sum of its two halves' sums (a legitimate reordering, as a chunked
    kernel's: verify must not fail it where the sum cancels to near zero)."""

    name = "test_split_sum"
    stage = "pre_autograd"
    exact = True

    def run(self, gm, ctx):
        modified = False
        for node in [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList
                     and list(n.args[1]) in ([-1], [1])]:
            x = node.args[0]
            half = x.meta["val"].shape[-1] // 2
            with gm.graph.inserting_before(node):
                parts = [gm.graph.call_function(aten.sum.dim_IntList, (
                    gm.graph.call_function(aten.slice.Tensor, (x, -1, a, b)), [-1]))
                    for a, b in ((0, half), (half, x.meta["val"].shape[-1]))]
                total = gm.graph.call_function(aten.add.Tensor, tuple(parts))
            for part, (a, b) in zip(parts, ((0, half), (half, x.meta["val"].shape[-1]))):
                sliced = part.args[0]
                sliced.meta["val"] = x.meta["val"][..., a:b]
                part.meta["val"] = sliced.meta["val"].sum(-1)
            total.meta.update(node.meta)
            node.replace_all_uses_with(total)
            gm.graph.erase_node(node)
            ctx.record("rewritten", site_name(total), "sum of two halves (test-only)")
            modified = True
        gm.recompile()
        return PassResult(gm, modified)


@register_pass
@dataclass(frozen=True)
class CountMatmulsPass(GraphPass):
    """Joint-stage analysis: records every mm/addmm it sees as "matched"."""

    name = "test_count_matmuls"
    stage = "joint"
    exact = True

    def run(self, gm, ctx):
        for node in gm.graph.nodes:
            if node.target in (aten.mm.default, aten.addmm.default):
                ctx.record("matched", site_name(node))
        return PassResult(gm, False)


@register_pass
@dataclass(frozen=True)
class CrashingPass(GraphPass):
    name = "test_crash"
    stage = "pre_autograd"
    exact = True

    def run(self, gm, ctx):
        raise RuntimeError("boom")


@register_pass
@dataclass(frozen=True)
class MetaDroppingPass(GraphPass):
    """Inserts a node without meta['val']: the runner must reject it."""

    name = "test_drop_meta"
    stage = "pre_autograd"
    exact = True

    def run(self, gm, ctx):
        out = gm.graph.output_node()
        first = out.all_input_nodes[0]
        with gm.graph.inserting_before(out):
            neg = gm.graph.call_function(aten.neg.default, (first,))
            neg2 = gm.graph.call_function(aten.neg.default, (neg,))
        first.replace_all_uses_with(neg2, delete_user_cb=lambda u: u is out)
        return PassResult(gm, True)


@torch.library.custom_op("graphopt_test::noisy", mutates_args=())
def noisy(x: torch.Tensor) -> torch.Tensor:
    """Another library's op that draws random numbers (noise injection): torch.library tags
    it pt2_compliant and nothing says it is random."""
    return x + 0.1 * torch.randn_like(x)


noisy.register_fake(lambda x: torch.empty_like(x))
noisy.register_autograd(lambda ctx, grad: grad)


class MLP(torch.nn.Module):
    def __init__(self, dim: int = 8, dtype=torch.float64):
        super().__init__()
        self.up = torch.nn.Linear(dim, 2 * dim, dtype=dtype)
        self.down = torch.nn.Linear(2 * dim, dim, dtype=dtype)

    def forward(self, x):
        return self.down(torch.sin(self.up(x))) * 1.0 + x


def calibrated_like_cpu() -> ClusterProfile:
    """A profile shaped like `graphopt calibrate`'s output on a CPU without fast bf16: a
    float32 GEMM curve, a bf16 peak 25x below the fp32 peak (the setting in which `graphopt
    estimate` once printed MFU 2543%)."""
    return load_profile({
        "name": "local", "levels": [{"name": "node", "size": 2,
                                      "link": {"bandwidth": 5e9, "latency": 5e-5}}],
        "device": {"name": "local CPU", "kind": "cpu", "memory_bytes": 16e9,
                   "memory_bandwidth": 20e9, "matmul_efficiency": 1.0,
                   "memory_efficiency": 1.0, "kernel_overhead_s": 5e-6,
                   "peak_flops": {"float32": 100e9, "bfloat16": 4e9, "float16": 4e9},
                   "matmul_curve": [[32, 5e9], [256, 60e9], [2048, 100e9]]}})


def config_errors(*calls) -> list[str]:
    """Each call's ConfigError message, or "ran" when it raised none (multi-rank tests
    collect them on every rank: all ranks must refuse the same inputs)."""
    from graphopt.errors import ConfigError

    out = []
    for call in calls:
        try:
            call()
            out.append("ran")
        except ConfigError as exc:
            out.append(str(exc))
    return out


BATCH = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
"""The global batch of the parallel-plan tests (token ids [8, 16])."""


def lm_loss(model, ids):
    """Mean next-token cross-entropy of ``model``'s logits on ``ids``, in float32 at least
    (float64 logits stay float64)."""
    logits = model(input_ids=ids, use_cache=False).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                             ids[:, 1:].flatten())


def plan_backward(model, plan, mesh, ids=BATCH):
    """Forward and backward of a parallelized ``model`` on this rank's share of ``ids``:
    PP's ``step``, CP's sequence shard with ``cp_loss``, else :func:`lm_loss` of the DP
    share. Returns the logits' dtype (None under PP)."""
    from graphopt.parallel import cp_loss, shard_sequence

    local = ids.chunk(plan.dp)[mesh["dp"].get_local_rank()]
    if plan.pp > 1:
        model.step(local)
        return None
    if plan.cp > 1:
        shard, labels = shard_sequence(local, mesh)
        logits = model(input_ids=shard, use_cache=False).logits
        cp_loss(logits, labels, mesh).backward()
        return logits.dtype
    logits = model(input_ids=local, use_cache=False).logits
    logits_f = logits.to(torch.promote_types(logits.dtype, torch.float32))
    torch.nn.functional.cross_entropy(logits_f[:, :-1].flatten(0, 1),
                                      local[:, 1:].flatten()).backward()
    return logits.dtype


def held_grads(model, ref):
    """(name, this rank's gradient of ``model`` gathered over its mesh, ``ref``'s gradient
    of the same parameter: the slice of experts this rank holds under EP, and their FFN
    slice with expert_tp) per parameter of a parallelized ``model`` (PP: its stage names
    mapped to the model's)."""
    from graphopt.parallel.expert import held_part

    refs, names = dict(ref.named_parameters()), getattr(model, "original_names", {})
    report = model.graphopt_parallel
    out = []
    for name, p in model.named_parameters():
        full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        name = names.get(name, name)
        want = refs[name].grad
        for path, (start, end, _) in report.experts.items():
            if name.startswith(path + "."):
                want = held_part(name.rsplit(".", 1)[1], want, (start, end),
                                 report.expert_ffn)
        out.append((name, full, want))
    return out



class ZeroFills(TorchDispatchMode):
    """A dispatch mode recording the shape of every aten.zeros / zeros_like it sees
    (``shapes``): autograd's materialized zero gradients show up here."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.zeros:
            self.shapes.append(tuple(args[0]))
        elif func.overloadpacket is torch.ops.aten.zeros_like:
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def run_interpreted(script: str, timeout: int = 600) -> None:
    """Run ``script`` in a fresh Python with Triton's CPU interpreter (TRITON_INTERPRET=1 must
    be set before triton is imported, so not in this process) and assert it printed "ok"
    last; its stderr tail is the failure message."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=timeout,
                         check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().endswith("ok")



@register_pass
@dataclass(frozen=True)
class DetachOutputPass(GraphPass):
    """Records a rewrite that detaches the first output: the pipeline's gradient-path
    check must drop it (tests/test_capture.py)."""

    name = "test_detach_output"
    stage = "pre_autograd"
    exact = True

    def run(self, gm, ctx):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        first = out.args[0][0]
        with gm.graph.inserting_before(out):
            detached = gm.graph.call_function(aten.detach.default, (first,))
        detached.meta = dict(first.meta)
        out.args = ((detached, *out.args[0][1:]),)
        ctx.record("rewritten", site_name(first), "detached (test-only, wrong)")
        return PassResult(gm, True)
