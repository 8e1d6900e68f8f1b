"""Step time of data/tensor/pipeline-parallel transformer training on a cluster profile.

The per-layer compute comes from the cost model on a traced graph: one decoder layer of a
real transformers model class is built on the meta device at the target size, its forward
and backward are traced with fake tensors (:func:`graphopt.cost.estimate.trace_step`) and
priced per node by :func:`graphopt.cost.graph_cost.graph_cost`. GEMM/attention nodes are
split over the TP degree; the rest (norms, residuals, dropout: replicated in Megatron's TP
without sequence parallelism) are not. Communication uses :mod:`graphopt.cost.collectives`.

Per microbatch and pipeline stage of L/p layers (Narayanan et al., "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", SC'21, sec. 2-3):
- compute: forward + backward of L/p layers (+ one more forward with full activation
  recomputation); GEMMs and the element-wise work on per-head and 4h tensors split by TP,
  the [b, s, h] element-wise work (norms, residuals) replicated;
- TP: 2 all-reduces of b*s*h activations per layer in the forward, 2 in the backward
  (+2 for the recomputed forward), over the TP group (consecutive devices: NVLink);
- PP: the 1F1B schedule takes (m + p - 1) slots of one microbatch's forward+backward per
  stage (bubble fraction (p - 1)/m), plus the p2p send of b*s*h activations per boundary;
- DP: one all-reduce of the stage's gradients (2 bytes/param) across the DP group (stride
  t*p devices), not overlapped (a conservative bound; Megatron overlaps part of it);
- embedding/LM head on the first/last stage: V*h GEMMs, added to the last stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from graphopt.cost.collectives import collective_time
from graphopt.cost.graph_cost import GraphCost, graph_cost
from graphopt.cost.profiles import ClusterProfile
from graphopt.errors import ConfigError


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-style decoder: layers, hidden size, heads, sequence length, vocabulary."""

    layers: int
    hidden: int
    heads: int
    seq: int = 2048
    vocab: int = 51200

    @property
    def params(self) -> float:
        """12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h)): Megatron-LM SC'21, eq. in sec. 5.1."""
        h, lyr = self.hidden, self.layers
        return 12 * lyr * h * h * (1 + 13 / (12 * h) + (self.vocab + self.seq) / (12 * lyr * h))

    def model_flops_per_iteration(self, batch: int, recompute: bool = True) -> float:
        """Megatron-LM SC'21 eq. (3): 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with full
        recomputation (72 instead of 96 without it)."""
        h, lyr, s = self.hidden, self.layers, self.seq
        factor = 96 if recompute else 72
        return factor * batch * s * lyr * h * h * (1 + s / (6 * h) + self.vocab / (16 * lyr * h))


@dataclass(frozen=True)
class Parallel:
    """Degrees and batch: dp * tp * pp devices; global batch in sequences; microbatch size."""

    tp: int
    pp: int
    dp: int
    global_batch: int
    microbatch: int = 1
    recompute: bool = True

    def __post_init__(self) -> None:
        per_replica = self.global_batch / self.dp
        if per_replica != int(per_replica) or per_replica % self.microbatch:
            raise ConfigError(f"global batch {self.global_batch} must split into dp "
                              f"({self.dp}) x microbatches of {self.microbatch}")

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.microbatch)


@dataclass
class StepTime:
    """Seconds per iteration and its parts (per device)."""

    compute: float
    tp_comm: float
    pp_comm: float
    dp_comm: float
    bubble: float
    total: float


def _megatron_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                        dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention as Megatron-LM (2021) computes it on GPU: Q K^T and P V as half-precision
    batched GEMMs and a causal softmax over the S x S scores (its fused scale-mask-softmax
    kernel: one pass here too, the scale folded into Q). Used only to trace layer costs
    (a meta-device trace of SDPA would take PyTorch's CPU math path, which upcasts to fp32)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    s = query.shape[-2]
    causal = torch.ones(s, s, dtype=torch.bool, device=query.device).tril()
    scores = torch.matmul(query * scale, key.transpose(-1, -2))
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return torch.matmul(probs, value).transpose(1, 2), None


_LAYER_CACHE: dict[tuple[Any, ...], tuple[float, float, float]] = {}


def layer_times(cfg: GPTConfig, microbatch: int, cluster: ClusterProfile,
                dtype: torch.dtype = torch.float16) -> tuple[float, float, float]:
    """Seconds of (GEMM nodes at the device's peak, other nodes TP splits, other nodes TP
    replicates) for forward + backward of one GPT-2 decoder block (transformers'
    ``GPT2Block``) at this size on one device. The caller divides the first by the matmul
    efficiency and the first two by the TP degree."""
    device = dataclasses.replace(cluster.device, matmul_efficiency=1.0)
    key = (cfg.hidden, cfg.heads, cfg.seq, microbatch, repr(device), dtype)
    if key in _LAYER_CACHE:
        return _LAYER_CACHE[key]
    from transformers import AttentionInterface, GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from graphopt.cost.estimate import trace_step

    AttentionInterface.register("graphopt_megatron_cost", _megatron_attention)
    config = GPT2Config(n_embd=cfg.hidden, n_head=cfg.heads, n_positions=cfg.seq,
                        n_layer=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "graphopt_megatron_cost"
    with torch.device("meta"):
        block = GPT2Block(config, layer_idx=0).to(dtype)
    x = torch.empty(microbatch, cfg.seq, cfg.hidden, dtype=dtype, device="meta",
                    requires_grad=True)

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = block

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.block(x)
            return out[0] if isinstance(out, tuple) else out

    gm = trace_step(Layer(), (x,), tracing="fake")
    _LAYER_CACHE[key] = tp_split_times(gm, graph_cost(gm, device), cfg.hidden)
    return _LAYER_CACHE[key]


def tp_split_times(gm: torch.fx.GraphModule, cost: GraphCost, hidden: int
                   ) -> tuple[float, float, float]:
    """Seconds of a priced graph's (compute-bound nodes, other nodes TP splits, other nodes
    TP replicates) (see :func:`_replicated_under_tp`)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    gemm = sharded = replicated = 0.0
    for c in cost.nodes:
        if c.bound == "compute":
            gemm += float(c.time_s)
        elif _replicated_under_tp(nodes[c.name], hidden):
            replicated += float(c.time_s)
        else:
            sharded += float(c.time_s)
    return gemm, sharded, replicated


def _replicated_under_tp(node: torch.fx.Node, hidden: int) -> bool:
    """Megatron TP (no sequence parallelism) splits heads and the FFN's 4h dimension; the
    [b, s, h] activations (layer norms, residual adds, dropout) stay replicated."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() in (2, 3) and val.shape[-1] == hidden


def step_time(cfg: GPTConfig, par: Parallel, cluster: ClusterProfile,
              dtype: torch.dtype = torch.float16) -> StepTime:
    """Predicted seconds per training iteration (see the module docstring).

    Raises:
        ConfigError: the plan needs more devices than the cluster, layers not divisible by pp,
            heads not divisible by tp.
    """
    if cfg.layers % par.pp:
        raise ConfigError(f"layers ({cfg.layers}) must be divisible by pp ({par.pp})")
    if cfg.heads % par.tp:
        raise ConfigError(f"heads ({cfg.heads}) must be divisible by tp ({par.tp})")
    cluster = cluster.scaled(par.devices)
    gemm, sharded, replicated = layer_times(cfg, par.microbatch, cluster, dtype)
    gemm /= cluster.device.matmul_efficiency
    fwd_share = 1 / 3  # forward is a third of forward + backward
    per_layer = (gemm + sharded) / par.tp + replicated
    if par.recompute:
        per_layer *= 1 + fwd_share
    layers_per_stage = cfg.layers // par.pp
    act_bytes = par.microbatch * cfg.seq * cfg.hidden * 2
    ar = collective_time("all_reduce", act_bytes, par.tp, cluster) if par.tp > 1 else 0.0
    tp_per_layer = ar * (6 if par.recompute else 4)
    head = 2 * 3 * par.microbatch * cfg.seq * cfg.hidden * cfg.vocab / par.tp / (
        cluster.device.flops_for("float16") * cluster.device.matmul_efficiency)
    stage_compute = layers_per_stage * per_layer + head / max(par.pp, 1)
    stage_tp = layers_per_stage * tp_per_layer
    p2p = 0.0
    if par.pp > 1:
        p2p = 2 * collective_time("p2p", act_bytes / par.tp, 2, cluster, stride=par.tp)
    m = par.microbatches
    slots = m + par.pp - 1
    compute = m * stage_compute
    bubble = (par.pp - 1) * (stage_compute + stage_tp + p2p)
    grad_bytes = 2 * cfg.params / (par.tp * par.pp)
    dp = collective_time("all_reduce", grad_bytes, par.dp, cluster, stride=par.tp * par.pp) \
        if par.dp > 1 else 0.0
    total = slots * (stage_compute + stage_tp + p2p) + dp
    return StepTime(compute, m * stage_tp, m * p2p, dp, bubble, total)


# Megatron-LM SC'21 (Narayanan et al. 2021), Table 1: GPT models, sequence 2048, vocab 51,200,
# A100 (Selene, 80 GB SXM, 8 per DGX node with NVLink/NVSwitch, 8x200 Gb/s HDR InfiniBand),
# mixed precision, full activation recomputation. Columns: params (B), heads, hidden, layers,
# TP, PP, GPUs, global batch, achieved TFLOP/s per GPU.
MEGATRON_SC21_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
