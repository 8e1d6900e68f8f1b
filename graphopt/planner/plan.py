"""``ParallelPlan``: the degrees of every parallel dimension, their placement on the cluster,
the pipeline schedule, activation recomputation and the predicted cost; JSON in and out.

Vocabulary (torchtitan's ``ParallelDims``, Megatron-Core's MoE parallel folding): a mesh
*axis* is a parallel dimension; devices = dp_replicate * dp_shard * cp * tp * pp. Axes are
laid out innermost first in ``mesh_order`` (default tp, cp, dp_shard, dp_replicate, pp: TP on
the fastest links). MoE layers *fold* EP (and expert TP) over the devices of
dp_shard * cp * tp, so experts use the same devices as the attention's data/context/tensor
parallel groups (Megatron-Core "MoE parallel folding"; Hypertron's dimension fusion).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphopt.errors import ConfigError

AXES = ("tp", "cp", "dp_shard", "dp_replicate", "pp")


@dataclass(frozen=True)
class Prediction:
    """Cost-model prediction of one training iteration on one device (seconds, bytes)."""

    step_s: float
    compute_s: float
    bubble_s: float
    comm_s: dict[str, float]
    """Exposed (not overlapped) communication per axis: tp, cp, ep, pp, dp."""
    memory_bytes: float
    memory_parts: dict[str, float]
    mfu: float
    tokens_per_s: float


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value >= 0


@dataclass(frozen=True)
class ParallelPlan:
    """A parallel plan (see the module docstring). All degrees are ints >= 1.

    Raises:
        ConfigError: on construction, for anything :meth:`problems` finds without a job
            (a degree < 1 or not an int, an unknown cp_kind / pp_schedule, ep not dividing
            dp_shard*cp*tp, ...); :meth:`validate` adds the job's checks (devices, layers,
            heads, batch, sequence).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    zero_stage: int = 1
    """ZeRO stage over dp_shard (1: optimizer states, 2: + gradients, 3: + parameters =
    FSDP)."""
    tp: int = 1
    sp: bool = True
    """Sequence parallelism with TP (norms/residuals split too; reduce-scatter/all-gather
    instead of all-reduce)."""
    cp: int = 1
    cp_kind: str = "ring"
    """"ring" (ring attention, KV blocks passed around) | "all_to_all" (Ulysses)."""
    pp: int = 1
    virtual_stages: int = 1
    """Model chunks per pipeline rank (> 1: with ``pp_schedule`` "interleaved" or
    "zero_bubble"; "1f1b", the default, takes 1)."""
    microbatch: int = 1
    """Sequences per microbatch."""
    pp_schedule: str = "1f1b"
    """"1f1b" | "interleaved" (virtual_stages > 1) | "zero_bubble" (interleaved with the
    weight-gradient computation deferred into the bubbles: Qi et al. 2024, torch's
    ScheduleInterleavedZeroBubble; searched and priced with a third of interleaving's
    bubble, see :mod:`graphopt.planner.perf`)."""
    ep: int = 1
    expert_tp: int = 1
    recompute_layers: int = 0
    """Layers per pipeline stage whose activations are fully recomputed (0: none)."""
    selective_recompute: bool = False
    """The other layers keep only their input, attention outputs and every second GEMM
    output and recompute the rest in the backward (torchtitan's per-op selective activation
    checkpointing; Korthikanti et al. 2022 sec. 5 recompute the attention core instead,
    which flash attention already does)."""
    stage_layers: tuple[int, ...] = ()
    """Decoder layers of each pipeline stage, first to last (empty: layers / pp each). Uneven
    stages balance the embedding on the first and the LM head + loss on the last stage, or
    place layer counts pp does not divide (Llama 3 405B: 126 layers on 16 stages, 7 on the
    first and last); 1F1B only (virtual_stages 1)."""
    mesh_order: tuple[str, ...] = AXES
    prediction: Prediction | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # lists are taken as the tuples they mean (a review: stage_layers=[2, 1] was refused
        # as "must be a list of ints"); the plan stays hashable
        for name in ("stage_layers", "mesh_order"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        # what is wrong whatever the job is raises here, not at the first torchrun launch
        # (a review: ParallelPlan(tp=0) was saved and described as "mb=1")
        problems = self.problems()
        if problems:
            raise ConfigError("invalid parallel plan: " + "; ".join(problems))

    @property
    def devices(self) -> int:
        """Devices the plan uses: dp_replicate * dp_shard * cp * tp * pp."""
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree (replicas x shards)."""
        return self.dp_replicate * self.dp_shard

    @property
    def edp_shard(self) -> int:
        """Ranks of the MoE fold that hold the same experts (the experts' FSDP group):
        dp_shard*cp*tp / (ep*expert_tp) (graphopt.parallel.mesh.expert_mesh)."""
        return self.dp_shard * self.cp * self.tp // (self.ep * self.expert_tp)

    def stride(self, axis: str) -> int:
        """Devices between neighbours of ``axis`` in the mesh (1: innermost)."""
        out = 1
        for name in self.mesh_order:
            if name == axis:
                return out
            out *= getattr(self, name)
        raise ConfigError(f"unknown mesh axis {axis!r}; axes: {', '.join(AXES)}")

    def group_stride(self, axes: tuple[str, ...], size: int | None = None) -> int:
        """Mean devices between neighbours of a group spanning ``axes`` (e.g. ("dp_shard",
        "cp"): the gradient group when CP shards the sequence) that holds ``size`` ranks
        (default: the product of the axes' degrees; less for a subgroup such as the
        experts' data-parallel one, which takes every (ep x expert_tp)-th rank of its
        fold). It is the span of the group's ranks divided by their count: the stride of
        the one axis, or for axes not adjacent in ``mesh_order`` the stride that puts as
        many ranks in a node as the real placement does."""
        used = [a for a in axes if getattr(self, a) > 1]
        if not used:
            return 1
        if size is None:
            size = math.prod(getattr(self, a) for a in used)
        span = max(self.stride(a) * getattr(self, a) for a in used)
        return max(1, span // max(size, 1))

    def problems(self, devices: int | None = None, layers: int | None = None,
                 heads: int | None = None, experts: int | None = None,
                 global_batch: int | None = None, seq: int | None = None,
                 kv_heads: int | None = None) -> list[str]:
        """Everything wrong with the plan for this job, as sentences naming the fix."""
        out = []
        for name in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "virtual_stages",
                     "microbatch", "ep", "expert_tp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                out.append(f"{name} must be an int >= 1, got {v!r}")
        r = self.recompute_layers
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            out.append(f"recompute_layers must be an int >= 0, got {r!r}")
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2, 3) or \
                not isinstance(self.zero_stage, int):
            out.append(f"zero_stage must be one of the ints 0, 1, 2, 3, got {self.zero_stage!r}")
        for name in ("sp", "selective_recompute"):
            if not isinstance(getattr(self, name), bool):
                out.append(f"{name} must be True or False, got {getattr(self, name)!r}")
        stages = self.stage_layers
        if not isinstance(stages, tuple) or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in stages):
            out.append(f"stage_layers must be a list of ints >= 1 (one per pipeline stage) or "
                       f"empty, got {stages!r}")
            stages = ()
        for name, value in (("devices", devices), ("layers", layers), ("heads", heads),
                            ("experts", experts), ("global_batch", global_batch),
                            ("seq", seq)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                out.append(f"the job's {name} must be an int >= 0, got {value!r}")
        if out:
            return out
        if self.cp_kind not in ("ring", "all_to_all"):
            out.append(f"cp_kind must be 'ring' or 'all_to_all', got {self.cp_kind!r}")
        if self.pp_schedule not in ("1f1b", "interleaved", "zero_bubble"):
            out.append(f"pp_schedule must be '1f1b', 'interleaved' or 'zero_bubble', got "
                       f"{self.pp_schedule!r}")
        if self.pp_schedule == "zero_bubble" and self.virtual_stages < 2:
            out.append("the zero-bubble schedule (interleaved, weight gradients deferred) "
                       "needs virtual_stages >= 2")
        elif self.pp_schedule == "1f1b" and self.virtual_stages > 1 and \
                not self.stage_layers:  # (stage_layers: its own message says 1F1B)
            out.append(f"pp_schedule='1f1b' needs virtual_stages == 1, got "
                       f"{self.virtual_stages}: set pp_schedule='interleaved' or "
                       "'zero_bubble' (1f1b is the default)")
        elif self.pp_schedule == "interleaved" and self.virtual_stages < 2:
            out.append(f"pp_schedule='interleaved' needs virtual_stages > 1, got "
                       f"{self.virtual_stages}" if self.pp > 1 else
                       "pp_schedule='interleaved' interleaves pipeline stages: it needs "
                       "pp > 1 and virtual_stages > 1 (or keep pp_schedule='1f1b')")
        if not isinstance(self.mesh_order, tuple) or \
                not all(isinstance(a, str) for a in self.mesh_order) or \
                sorted(self.mesh_order) != sorted(AXES):
            out.append(f"mesh_order must order all of {AXES}, got {self.mesh_order}")
        elif self.zero_stage >= 2 and self.dp_replicate > 1 and self.dp_shard * self.cp > 1:
            order = list(self.mesh_order)
            if order.index("dp_replicate") < max(order.index("dp_shard"), order.index("cp")):
                # FSDP2's HSDP mesh (dp_replicate, dp_shard x cp) must be in the device
                # mesh's order (a review: a raw KeyError after TP/EP were applied)
                out.append(f"HSDP (ZeRO-{self.zero_stage} over dp_shard with dp_replicate) "
                           "needs dp_replicate outside dp_shard and cp in mesh_order "
                           f"(innermost first), got {self.mesh_order}: move dp_replicate "
                           "after them")
        fold = self.dp_shard * self.cp * self.tp
        if (self.ep * self.expert_tp) > fold or fold % (self.ep * self.expert_tp):
            out.append(f"ep ({self.ep}) x expert_tp ({self.expert_tp}) must divide "
                       f"dp_shard*cp*tp ({fold}): MoE layers fold EP over those devices"
                       + (" (with tensor-parallel experts, EP over dp_shard x cp "
                          f"({self.dp_shard * self.cp}) and expert_tp over tp)"
                          if self.expert_tp > 1 else ""))
        if devices is not None and self.devices != devices:
            out.append(f"the degrees multiply to {self.devices} devices, the job has {devices}")
        if stages and len(stages) != self.pp:
            out.append(f"stage_layers has {len(stages)} entries; pp is {self.pp}")
        if stages and self.virtual_stages > 1:
            out.append("uneven stages (stage_layers) take 1F1B: set virtual_stages to 1 or "
                       "drop stage_layers")
        if stages and layers is not None and sum(stages) != layers:
            out.append(f"stage_layers add up to {sum(stages)} layers, the model has {layers}")
        if not stages and layers is not None and layers % (self.pp * self.virtual_stages):
            out.append(f"layers ({layers}) must divide into pp ({self.pp}) x virtual stages "
                       f"({self.virtual_stages}), or give stage_layers (uneven stages)")
        most = max(stages) if stages else (layers // self.pp if layers is not None else None)
        if most is not None and self.recompute_layers > most:
            out.append(f"recompute_layers ({self.recompute_layers}) exceeds the layers per "
                       f"stage ({most})")
        if heads is not None and heads % self.tp:
            out.append(f"attention heads ({heads}) must be divisible by tp ({self.tp})")
        if kv_heads is not None and kv_heads % self.tp:
            out.append(f"KV heads ({kv_heads}) must be divisible by tp ({self.tp}): each TP "
                       "rank holds whole KV groups (Megatron's num_query_groups % tp == 0)")
        if heads is not None and self.cp_kind == "all_to_all" and heads % (self.tp * self.cp):
            out.append(f"all-to-all CP needs heads ({heads}) divisible by tp*cp "
                       f"({self.tp * self.cp})")
        if experts is not None and experts and experts % self.ep:
            out.append(f"experts ({experts}) must be divisible by ep ({self.ep})")
        if experts == 0 and self.ep > 1:
            out.append(f"ep ({self.ep}) > 1 but the model has no experts")
        if global_batch is not None and global_batch % (self.dp * self.microbatch):
            out.append(f"global batch ({global_batch}) must divide into dp ({self.dp}) x "
                       f"microbatch ({self.microbatch})")
        elif global_batch is not None and self.virtual_stages > 1 and \
                (global_batch // (self.dp * self.microbatch)) % self.pp:
            out.append(f"interleaved 1F1B needs the microbatches per iteration "
                       f"({global_batch // (self.dp * self.microbatch)}) to be a multiple of "
                       f"pp ({self.pp}), as Megatron-LM's schedule does")
        if seq is not None and seq % (self.cp * (2 if self.cp > 1 else 1)):
            out.append(f"sequence ({seq}) must split into 2*cp ({2 * self.cp}) load-balanced "
                       "chunks")
        elif seq is not None and self.sp and self.tp > 1 and seq % (self.cp * self.tp):
            out.append(f"SP splits each rank's {seq // self.cp} tokens over tp ({self.tp}): "
                       f"use a sequence divisible by cp*tp ({self.cp * self.tp}) or sp=False")
        if self.virtual_stages > 1 and self.pp == 1:
            out.append(f"virtual_stages ({self.virtual_stages}) interleave pipeline stages: "
                       "they need pp > 1")
        if self.expert_tp > 1 and self.ep == 1:
            out.append(f"expert_tp ({self.expert_tp}) splits experts that EP distributes: it "
                       "needs ep > 1")
        return out

    def validate(self, devices: int | None = None, layers: int | None = None,
                 heads: int | None = None, experts: int | None = None,
                 global_batch: int | None = None, seq: int | None = None,
                 kv_heads: int | None = None) -> None:
        """Raise ConfigError listing :meth:`problems` (empty: the plan is valid)."""
        problems = self.problems(devices, layers, heads, experts, global_batch, seq, kv_heads)
        if problems:
            raise ConfigError("invalid parallel plan: " + "; ".join(problems))

    def zero_bubble_refusal(self) -> str:
        """Why ``graphopt.parallelize`` refuses this plan's zero-bubble schedule ("" if not).

        A valid plan that torch's ``ScheduleInterleavedZeroBubble`` (Qi et al., "Zero Bubble
        Pipeline Parallelism", ICLR 2024) does not run exactly with graphopt's executor. The
        one predicate behind ``apply.parallelize``'s refusal, ``parallel.auto``'s
        ``not_executable`` and the planner's search (which skips such plans), so the three
        cannot disagree (they were written apart, and the search once lagged behind).

        Returns:
            The message (what fails, and the fix), or "" when the plan is not zero-bubble or
            runs.
        """
        if self.pp_schedule != "zero_bubble":
            return ""
        if self.zero_stage == 3 and self.dp_shard * self.cp > 1:
            # measured (a review, Llama pp=2 x dp_shard=2): 9-20 of 20 gradients per rank
            # wrong by 0.6-1.0 relative; FSDP2 reshards between the deferred weight-gradient
            # passes. ZeRO-2 is exact. FSDP shards over dp_shard x cp: pp=2 x cp=2 alone
            # gave the same errors (a later review)
            return ("pp_schedule='zero_bubble' with ZeRO-3 (parameters resharded after "
                    "forward) gives wrong weight gradients with torch's zero-bubble "
                    "schedule: use zero_stage=2, or pp_schedule='interleaved'")
        if self.selective_recompute:
            # torch's selective checkpoint allows one backward per forward; the schedule runs
            # two, input and weight gradients ("Trying to backward an extra time", a review);
            # full recomputation (recompute_layers) is exact there
            return ("pp_schedule='zero_bubble' with selective_recompute=True is not "
                    "executed: torch's selective activation checkpoint allows one backward, "
                    "the schedule splits it into input and weight gradients; use "
                    "recompute_layers (full recomputation) or pp_schedule='interleaved'")
        if self.recompute_layers and self.ep > 1:
            # the full recomputation runs under the selective context too, saving the EP op
            # (recomputing it would repeat its all-to-alls): the same one-backward limit (an
            # 8-rank review: "Trying to backward an extra time" on the last stage)
            return ("pp_schedule='zero_bubble' with recompute_layers and ep > 1 is not "
                    "executed: the recomputed layers keep the expert-parallel op's output "
                    "through torch's selective activation checkpoint, which allows one "
                    "backward, and the schedule splits it into input and weight gradients; "
                    "use pp_schedule='interleaved', or recompute_layers=0")
        return ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field (prediction included)."""
        data = dataclasses.asdict(self)
        data["mesh_order"] = list(self.mesh_order)
        data["stage_layers"] = list(self.stage_layers)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelPlan:
        """Raises ConfigError for anything but a dict of plan fields (unknown keys named),
        and for values :meth:`problems` rejects."""
        if not isinstance(data, dict):
            raise ConfigError(f"a plan must be a JSON object of plan fields, got "
                              f"{type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(map(str, set(data) - known))
        if unknown:
            raise ConfigError(f"unknown plan keys {unknown}; valid: {sorted(known)}")
        data = dict(data)
        pred = data.get("prediction")
        if pred is not None:
            fields = {f.name for f in dataclasses.fields(Prediction)}
            if not isinstance(pred, dict) or set(pred) != fields:
                raise ConfigError(f"plan 'prediction' must be null or an object with keys "
                                  f"{sorted(fields)}")
            bad = [k for k, v in pred.items() if not (_number(v) if k not in (
                "comm_s", "memory_parts") else isinstance(v, dict) and all(
                    isinstance(a, str) and _number(b) for a, b in v.items()))]
            if _number(pred["mfu"]) and pred["mfu"] > 1:
                bad.append("mfu")
            if bad:  # a hand-edited prediction would print as "predicted" in the report
                raise ConfigError(f"plan 'prediction' has bad values for {sorted(set(bad))} "
                                  "(numbers >= 0, mfu in [0, 1], comm_s / memory_parts "
                                  "objects of numbers): fix them or set it to null")
            data["prediction"] = Prediction(**pred)
        if isinstance(data.get("stage_layers"), list):
            data["stage_layers"] = tuple(data["stage_layers"])
        if "mesh_order" in data:
            if not isinstance(data["mesh_order"], (list, tuple)):
                raise ConfigError(f"mesh_order must be a list of axes {list(AXES)}")
            data["mesh_order"] = tuple(data["mesh_order"])
        return cls(**data)  # __post_init__ raises ConfigError for what problems() rejects

    def save(self, path: str | Path) -> None:
        """Write :meth:`to_dict` as JSON to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | os.PathLike[str], index: int | None = None) -> ParallelPlan:
        """Read a plan written by :meth:`save`, or plan ``index`` of the output of
        ``graphopt plan --json`` (ranked, best first: 0 is the best; the default, None, is
        the best one graphopt.parallelize executes, as the file's ``not_executed`` list
        says); ConfigError as :meth:`from_dict`, for a file that is missing or not JSON,
        for an index the file does not have, and when no plan of the file is executed."""
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read the plan file {str(path)!r} ({exc.strerror}): "
                              "write one with ParallelPlan.save, "
                              "or pass a ParallelPlan") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"the plan file {str(path)!r} is not JSON ({exc}): write it "
                              "with ParallelPlan.save") from exc
        if isinstance(data, dict) and "plans" in data and "dp_shard" not in data:
            plans = data["plans"]  # graphopt plan --json: the ranked plans, best first
            if not isinstance(plans, list) or not plans:
                raise ConfigError(f"{str(path)!r} looks like `graphopt plan --json` output "
                                  "but its 'plans' list is empty")
            if index is None:
                # the ranked plans include ones graphopt does not execute (expert_tp, ...):
                # the first one it does (a review: README's workflow loaded a CP x PP plan)
                why = data.get("not_executed") or [""] * len(plans)
                if not isinstance(why, list) or len(why) != len(plans) or \
                        not all(isinstance(w, str) for w in why):
                    raise ConfigError(
                        f"{str(path)!r}: 'not_executed' must list one string per plan "
                        f"({len(plans)}: '' for a plan graphopt.parallelize executes, else "
                        f"why not), got {why!r}; write the file with `graphopt plan --json`"
                        ", or load a plan with index=i")
                runnable = [i for i, w in enumerate(why) if not w]
                if not runnable:
                    raise ConfigError(
                        f"none of the {len(plans)} plans in {str(path)!r} is executed by "
                        f"graphopt.parallelize ({'; '.join(dict.fromkeys(why))}); load one "
                        "with index=i to inspect it, or plan with other devices or batch")
                index = runnable[0]
            if not isinstance(index, int) or not -len(plans) <= index < len(plans):
                raise ConfigError(f"{str(path)!r} holds {len(plans)} plans (0 .. "
                                  f"{len(plans) - 1}, best first); index {index!r} is not one")
            return cls.from_dict(plans[index])
        if index:
            raise ConfigError(f"{str(path)!r} holds one plan; index {index} needs the output "
                              "of `graphopt plan --json`")
        return cls.from_dict(data)

    def describe(self) -> str:
        """One line naming the parallel degrees and options that are not 1/off."""
        parts = [f"{a}={getattr(self, a)}" for a in ("dp_replicate", "dp_shard", "tp", "cp",
                                                      "pp", "ep") if getattr(self, a) > 1]
        if self.expert_tp > 1:
            parts.append(f"expert_tp={self.expert_tp}")
        if self.dp_shard > 1 or (self.cp > 1 and self.zero_stage >= 2):  # FSDP over dp x cp
            parts.append(f"ZeRO-{self.zero_stage}")
        if self.tp > 1 and self.sp:
            parts.append("SP")
        if self.cp > 1:
            parts.append(f"CP {self.cp_kind}")
        if self.virtual_stages > 1:
            kind = "zero-bubble" if self.pp_schedule == "zero_bubble" else "interleaved"
            parts.append(f"{kind} v={self.virtual_stages}")
        if self.stage_layers:
            parts.append("stages " + "/".join(map(str, self.stage_layers)))
        parts.append(f"mb={self.microbatch}")
        if self.recompute_layers:
            parts.append(f"recompute {self.recompute_layers} layers/stage")
        if self.selective_recompute:
            parts.append("selective recompute")
        return ", ".join(parts) or "single device"
