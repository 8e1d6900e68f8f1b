"""Pipeline parallelism for a plan: decoder-layer stages run by torch.distributed.pipelining.

Contract: :func:`pipeline` cuts a transformers decoder-only LM (``*ForCausalLM``: token
embedding, a ModuleList of decoder layers, final norm, LM head) into ``pp x
virtual_stages`` stages at decoder-layer boundaries (:func:`stage_layers`: as even as
possible, the first and last stages, which also hold the embedding and the head, take the
fewer layers when the count does not divide), keeps this rank's stages (1F1B: stage
``pp_rank``; interleaved 1F1B: stages ``pp_rank + k * pp``, looped as Megatron-LM's
interleaved schedule, Narayanan et al. SC'21 sec. 2.2) and returns a
:class:`PipelinedModel` whose :meth:`~PipelinedModel.step` runs forward and backward of
all microbatches with torch's ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` (PipeDream-
Flush 1F1B, Narayanan et al. 2021), or ``ScheduleInterleavedZeroBubble`` for
``pp_schedule="zero_bubble"`` (Qi et al. 2024: weight gradients deferred into the bubbles).
Gradients are those of the mean loss over every labelled position of the global batch (all
microbatches, all DP ranks: Megatron-LM's per-token loss, as :func:`graphopt.parallel.
context.cp_loss`), and they accumulate over ``step`` calls: the schedules run with
``scale_grads=False`` (torch's default divides the whole ``.grad`` by the microbatch count
after the last backward, gradients of earlier calls included) and the loss carries the
weights instead.

A stage computes what the model's own forward does for its layers, with no padding mask
(causal attention through SDPA's ``is_causal``; padding masks are refused, see
:meth:`PipelinedModel.step`): first stage ``embed(input_ids)``; every stage the rotary
position embeddings for positions ``0..S-1`` (transformers' ``rotary_emb``) and its layers
``layer(h, attention_mask=None, position_ids=..., position_embeddings=...)``; last stage
``lm_head(norm(h))``. Tied embeddings (one weight used by the first stage's embedding and
the last stage's LM head): each of the two ranks holds a copy and computes its part of the
gradient; after the schedule, the two parts of this step's gradient are summed over the
pair (an all-reduce in a group of the first and last pipeline rank of each pipeline,
Megatron-LM's "embedding group"; the gradient accumulated by earlier steps is kept out of
the sum), so both copies get the exact gradient and stay equal through the optimizer. The
weight is looked up by name at each step: data parallelism (FSDP2, replicate) replaces the
stage's parameters after :func:`pipeline` built it.

With CP (``plan.cp > 1``) each rank's batch is its chunk of every sequence
(:func:`graphopt.parallel.context.shard_sequence`, labels shifted across the chunks, so
``step`` needs them): the stages take the chunk's global positions
(:func:`~graphopt.parallel.context.chunk_positions`), attention is CP's (installed by
:func:`~graphopt.parallel.context.apply_cp`), the default loss does not shift again and
counts labels over the dp x cp ranks (:func:`~graphopt.parallel.context.cp_loss`'s
scaling), and every rank refuses chunks of different lengths together.

Errors (ConfigError, before anything changes): a model whose forward is not that
composition (eager attention, sliding windows, or a difference found by running both on
a probe sequence: :func:`_check_stages_compute_the_model`), a model without that structure, more
stages than decoder layers, a batch that the microbatch size does not divide, a
microbatch count that is not a multiple of pp for interleaving (torch's requirement).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from graphopt.distributed import all_reduce_host
from graphopt.errors import ConfigError
from graphopt.parallel.rng import Generators, drew
from graphopt.parallel.scaler import GradScaler
from graphopt.planner.plan import ParallelPlan

STAGE_SEED_STRIDE = 0x9E3779B97F4A7C15
"""Distance between the stages' random-stream seeds (:meth:`DecoderStage.random_stream`):
the 64-bit golden-ratio constant, so stage seeds do not meet the nearby seeds users give
their DP ranks (``seed + dp_rank``)."""

CP_SEED_STRIDE = 0xBF58476D1CE4E5B9
"""Distance between the CP ranks' stage seeds (splitmix64's multiplier): under CP each
rank's stage draws its chunk's masks from ``base + STAGE_SEED_STRIDE * (index + 1) +
CP_SEED_STRIDE * (cp_rank + 1)``."""

SCHEDULE_CACHE = 8
"""Pipeline schedules (with their stages' buffers) kept per PipelinedModel, one per
(microbatch count, sequence length); the least recently used goes first."""


def stage_layers(layers: int, stages: int) -> list[tuple[int, int]]:
    """[(first layer, end)] per stage: ``layers // stages`` each, the remainder given to the
    middle stages first (the first and last stages also run the embedding / LM head).

    Raises:
        ConfigError: more stages than layers.
    """
    if stages > layers:
        raise ConfigError(f"{stages} pipeline stages (pp x virtual_stages) but only {layers} "
                          "decoder layers: every stage needs a layer; lower pp or "
                          "virtual_stages")
    base, extra = divmod(layers, stages)
    order = sorted(range(stages), key=lambda s: (s in (0, stages - 1), abs(s - stages / 2)))
    sizes = [base + (s in order[:extra]) for s in range(stages)]
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


class DecoderStage(nn.Module):
    """Stage ``index`` of ``count``: [embedding] + decoder layers [start, end) + [final norm +
    LM head] of a transformers causal LM (module docstring). Input: token ids [B, S]
    (int64, first stage) or hidden states [B, S, H]; output: hidden states [B, S, H] or
    logits [B, S, V] (last stage)."""

    embed_tokens: Any
    rotary_emb: Any
    norm: Any
    lm_head: Any

    def __init__(self, model: Any, layers: list[nn.Module], start: int, end: int,
                 index: int, count: int, seq_split: int = 1,
                 cp: tuple[int, int, bool] | None = None) -> None:
        super().__init__()
        self.seq_split = 1 if index == 0 else seq_split
        """SP: a later stage receives its sequence shard (positions count the whole)."""
        self.cp = cp
        """CP: (this rank's CP index, CP size, ring): the stage holds this rank's chunk of
        each sequence, and its positions are the chunk's global ones
        (:func:`graphopt.parallel.context.chunk_positions`)."""
        inner = model.model
        self.first, self.last = index == 0, index == count - 1
        self.index, self.start, self.end, self.count = index, start, end, count
        self.drew = False
        """Whether a forward drew random numbers since TP's check last reset it
        (:meth:`random_stream`)."""
        self.embed_tokens = model.get_input_embeddings() if self.first else None
        self.layers = nn.ModuleDict({str(i): layers[i] for i in range(start, end)})
        self.rotary_emb = getattr(inner, "rotary_emb", None)
        self.norm = inner.norm if self.last else None
        self.lm_head = model.get_output_embeddings() if self.last else None
        # the new containers take the model's mode (nn.Module starts in train mode: an eval
        # model's stages said training=True, a review); the layers keep their own
        self.training = self.layers.training = model.training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [B, S] (first stage) or hidden states [B, S(/tp under SP), H] ->
        hidden states, or logits [B, S, V] on the last stage (class docstring), its random
        numbers (dropout) seeded for this stage and call (:meth:`random_stream`)."""
        if self.count == 1:
            return self._compute(x)
        with self.random_stream(x.device):
            out = self._compute(x)
        if not self.last and torch.is_grad_enabled() and out.is_floating_point() and \
                not out.requires_grad:
            # the stages before this one train nothing (a frozen embedding and first
            # layers): the next stage's input would need no gradient. torch's zero-bubble
            # schedule finds a stage's weights from its inputs' autograd graph, so that stage
            # computed no weight gradient at all (silently: a review); and the schedules
            # keep the stages' metadata, so unfreezing the prefix later left the next stage
            # sending no gradient the prefix then waited for (a hang). A leaf that requires
            # a gradient keeps every stage's metadata whatever is frozen; the gradient sent
            # back to it is discarded
            out = out.detach().requires_grad_()
        return out

    @contextlib.contextmanager
    def random_stream(self, device: torch.device) -> Iterator[None]:
        """Run the body with the CPU (and ``device``'s) default generator seeded for this
        stage and call, then restore the caller's states and advance the CPU generator by
        one draw.

        Each call draws ``base`` from the default CPU generator (one ``randint``, so every
        pipeline rank, which makes the same number of stage calls per step, advances its
        generator alike) and seeds the stage's draws with ``base + STAGE_SEED_STRIDE *
        (index + 1)`` (mod 2**63). Why: every pipeline rank holds the same model and is
        seeded alike (TP asks it), so without a per-stage seed stage k's dropout masks
        repeated stage 0's bit for bit (a review: identical in every call; one process
        draws them independently), and the ranks' generators drifted apart by each stage's
        own draws, so a batch drawn after a step (``step`` needs the same ``input_ids`` on
        every pipeline rank) differed between ranks. Megatron-LM offsets the seed per
        pipeline rank the same way (``seed + 100 * pp_rank``,
        ``megatron/training/initialize.py``); per stage also separates the virtual stages
        of one rank; under CP the CP rank is added too (``CP_SEED_STRIDE``: the ranks of a
        CP group run the same stage on their chunks). Derived from the default generator,
        the masks follow ``torch.manual_seed`` and ``torch.set_rng_state`` as one process's
        do (a re-review: a stream kept per stage ignored a second ``manual_seed`` of the
        same value and a restored state). Activation checkpoints inside the stage save and
        replay the seeded state. ``self.drew`` becomes True when the body drew random
        numbers (TP's check, graphopt.parallel.apply._tp_rng_check)."""
        generators = Generators(device)
        base = int(torch.randint(0, 2**62, (1,)).item())
        # CP: the ranks of a CP group run the same stage on their chunks (one process draws
        # independent masks over the whole sequence; graphopt.parallel.rng)
        chunk = 0 if self.cp is None else CP_SEED_STRIDE * (self.cp[0] + 1)
        start = (base + STAGE_SEED_STRIDE * (self.index + 1) + chunk) % 2**63
        accel = generators.module is not None
        with torch.random.fork_rng(devices=[generators.index] if accel else [],
                                   device_type=device.type if accel else "cuda"):
            generators.seed(start)
            before = generators.states()
            yield
            if not self.drew:
                self.drew = drew(before, generators.states())

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        length = h.shape[1] * self.seq_split
        if self.cp is None:
            positions = torch.arange(length, device=h.device).unsqueeze(0)
        else:
            from graphopt.parallel.context import chunk_positions

            positions = chunk_positions(length, *self.cp, device=h.device).unsqueeze(0)
        kwargs: dict[str, Any] = {"attention_mask": None, "position_ids": positions}
        if self.rotary_emb is not None:
            kwargs["position_embeddings"] = self.rotary_emb(h, positions)
        for layer in self.layers.values():
            out = layer(h, **kwargs)
            h = out[0] if isinstance(out, tuple) else out
        if self.lm_head is not None:
            assert self.norm is not None
            h = self.lm_head(self.norm(h))
        return h


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits [B, S, V] for labels [B, S] (int64), in
    float32 at least (float64 logits stay float64; transformers' ``labels`` loss upcasts to
    float32 always)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class PipelinedModel(nn.Module):
    """This rank's pipeline stages (``parts``) and the schedule that runs them.

    ``parameters()`` are this rank's (give them to the optimizer); ``original_names`` maps
    each of this module's parameter names to the full model's name (checkpoints, tests).
    """

    def __init__(self, parts: list[DecoderStage], plan: ParallelPlan, group: Any,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 prefix: str) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.training = self.parts.training = all(p.training for p in parts)
        self.plan, self.group, self.loss_fn = plan, group, loss_fn
        self.prefix = prefix
        """The full model's path of the decoder layer list (``model.layers``)."""
        self._schedules: dict[tuple[int, ...], Any] = {}
        self.seq_split = 1
        self.vocab_size: int | None = None
        """Token ids at or past it are refused on every rank (only the first stage would
        fail in its embedding, and the others waited for it: a review's hang)."""
        """TP degree whose ranks split the sequence (SP): S must divide by it (set by
        :func:`pipeline`, the same on every rank so all of them refuse a bad batch)."""
        self._microbatches, self._labelled = 1, 1
        self._scaler: GradScaler | None = None  # step(scaler=...): scaling in the schedule
        self.dp_group: Any = None
        """The group of DP and CP ranks (dp_replicate x dp_shard x cp), over which the
        labelled positions are counted; None: one such rank."""
        self.cp = 1
        """CP size: each rank's batch is its chunk of every sequence (from
        :func:`graphopt.parallel.context.shard_sequence`, labels shifted already)."""
        self.cp_ring = False
        self.cp_group: Any = None
        """The CP group (cp > 1): its ranks' chunks must be equal in length."""
        self.compute_dtype: torch.dtype | None = None
        """mixed_precision's compute dtype (parallelize sets it): a caller's autocast of
        another dtype is refused before the schedule."""
        self.tied: tuple[str, Any] | None = None
        """(name of the tied embedding weight in this module, group of the first and last
        pipeline rank) if any."""
        self.original_names = {}
        for i, part in enumerate(parts):
            for name, _ in part.named_parameters():
                self.original_names[f"parts.{i}.{name}"] = _original(name, prefix)

    @property
    def is_first(self) -> bool:
        """Whether this rank holds the first stage (it feeds the token ids)."""
        return any(p.first for p in self.parts)

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (it computes the loss)."""
        return any(p.last for p in self.parts)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Not a forward: raises ConfigError (pipeline stages run inside ``step``)."""
        raise ConfigError("a PipelinedModel (pp > 1) trains with loss = model.step(input_ids, "
                          "labels=None) (under CP: ids, labels = graphopt.parallel.context."
                          "shard_sequence(batch, mesh); model.step(ids, labels=labels)); its "
                          "stages run inside the pipeline schedule, not through model(...)")

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Not supported: raises ConfigError (an AttributeError before; a review)."""
        raise ConfigError("generate() is not supported on a PipelinedModel (pp > 1): each "
                          "rank holds only its stages' layers, and decoding runs one token "
                          "at a time through all of them. Save a distributed checkpoint "
                          "(torch.distributed.checkpoint with graphopt.parallel.checkpoint."
                          "ModelState) and load it into the model parallelized without PP "
                          "(or unparallelized) to generate")

    def _schedule(self, key: tuple[Any, ...]) -> Any:
        """The schedule for ``key`` = (microbatch count, training, *batch shape past B):
        the cached one (most recently used last), or a new one."""
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
        )

        microbatches = key[0]  # stages size their buffers from the first batch
        if key in self._schedules:  # most recently used last
            self._schedules[key] = self._schedules.pop(key)
        else:
            while len(self._schedules) >= SCHEDULE_CACHE:  # a review: a new sequence length
                self._schedules.pop(next(iter(self._schedules)))  # every step kept 3-8 MB
            count = self.plan.pp * self.plan.virtual_stages
            device = next(self.parameters()).device
            parts: list[Any] = list(self.parts)
            stages: list[Any] = [PipelineStage(p, p.index, count, device, group=self.group)
                                 for p in parts]
            for stage, part in zip(stages, parts):  # its metadata inference runs the
                # layers on torch.empty inputs: verify (option) waits for the first
                # microbatch's call, and the buffers get their values back
                for name in ("_forward_metadata_inference", "_backward_metadata_inference"):
                    if hasattr(stage, name):
                        setattr(stage, name, _on_placeholders(getattr(stage, name), part))
            loss = self._microbatch_loss
            if self.plan.pp_schedule == "zero_bubble":
                self._schedules[key] = ScheduleInterleavedZeroBubble(
                    stages, microbatches, loss_fn=loss, scale_grads=False)
            elif self.plan.virtual_stages > 1:
                self._schedules[key] = ScheduleInterleaved1F1B(stages, microbatches,
                                                               loss_fn=loss, scale_grads=False)
            else:
                self._schedules[key] = Schedule1F1B(stages[0], microbatches, loss_fn=loss,
                                                    scale_grads=False)
        return self._schedules[key]

    def _microbatch_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One microbatch's share of the loss; the schedule sums the shares' gradients
        (``scale_grads=False``) and data parallelism averages over its n ranks. The default
        loss: n * (this microbatch's summed next-token loss) / (labelled positions over all
        microbatches and DP ranks), so the result is the gradient of the global batch's
        mean over labelled positions (microbatches and DP ranks may hold different numbers
        of -100 labels). A custom loss_fn: its value / microbatches (its mean over
        microbatches, as torch's schedules average)."""
        loss = self._unscaled_loss(logits, labels)
        return loss if self._scaler is None else self._scaler.scale(loss)

    def _unscaled_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is not next_token_loss:
            return self.loss_fn(logits, labels) / self._microbatches
        # in float32 at least, as transformers' loss and cp_loss upcast: bf16 logits (mixed
        # precision) summed in bf16 gave a loss 0.5% off and gradients 0.45% (a new user)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if self.cp == 1:
            logits, labels = logits[:, :-1], labels[:, 1:]
        # under CP the labels come shifted across chunk boundaries (shard_sequence), as
        # cp_loss takes them
        summed = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                             ignore_index=-100, reduction="sum")
        return summed * self._dp_size() / self._labelled

    def _dp_size(self) -> int:
        return 1 if self.dp_group is None else torch.distributed.get_world_size(self.dp_group)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None,
             scaler: GradScaler | None = None) -> torch.Tensor | None:
        """Forward and backward of the batch ``input_ids`` [B, S] (int64, this DP rank's
        share, the same on every pipeline rank) in microbatches of ``plan.microbatch``
        sequences; gradients accumulate into this rank's parameters. Under
        ``torch.no_grad()`` the schedule runs forward only (an evaluation loss; before, torch
        raised "step() requires gradients").

        ``scaler``: a :class:`graphopt.parallel.GradScaler` (fp16 loss scaling): each
        microbatch's loss is scaled inside the schedule, so the gradients are scaled as
        ``scaler.scale(loss).backward()`` scales them; then ``scaler.step(optimizer)`` and
        ``scaler.update()`` as usual (the returned loss is unscaled).

        Returns:
            on the last stage's ranks the loss (the default next-token loss: this DP rank's
            share of the global batch's mean over labelled positions, -100 ignored, scaled
            so that its mean over the DP ranks is that global mean, which it equals with one
            DP rank or the same label count on every DP rank; a custom ``loss_fn``: the mean
            of its microbatch values), else None.
        Raises:
            ConfigError: input_ids not [B, S] integers or outside the vocabulary, labels of
                another shape, a ``scaler`` other than graphopt.parallel.GradScaler (torch's
                checks each stage's gradients on its own: stages skipped different steps
                and their scales drifted apart, a review), a padding
                ``attention_mask``, B not divisible by the microbatch size, fewer
                microbatches than pp, a microbatch count that interleaving cannot split
                (not a multiple of pp), S not divisible by tp under SP; under CP, no
                labels, a chunk the ring cannot halve, chunks of different lengths over
                the ranks.
        """
        try:
            if scaler is not None and not isinstance(scaler, GradScaler):
                raise ConfigError(
                    f"PipelinedModel.step(scaler=...) takes a graphopt.parallel.GradScaler, "
                    f"got {type(scaler).__name__}: a pipeline stage holds part of the model, "
                    "and torch's scaler checks only this rank's gradients for inf, so stages "
                    "would skip different steps; use graphopt.parallel.GradScaler(...) with "
                    "the same arguments")
            if self.compute_dtype is not None:
                from graphopt.parallel.apply import check_outer_autocast

                check_outer_autocast(next((p.device.type for p in self.parameters()), "cpu"),
                                     self.compute_dtype)
            count = self._microbatch_count(input_ids, labels, attention_mask)
            problem = None
        except ConfigError as exc:
            count, problem = 0, exc
        training = torch.is_grad_enabled()  # no_grad: forward only (an evaluation loss)
        # train and eval keep their own schedules: torch re-initialises a schedule's stages
        # when it switches between them
        key = (count, training, *input_ids.shape[1:])
        cached = self._schedules.get(key)
        fresh = cached is None or _will_initialize(cached, training)
        fresh = self._same_count_everywhere(count, problem,
                                            input_ids.shape[-1] if self.cp > 1 else None,
                                            fresh)
        if fresh:  # on every rank together: the stages' first run is collective (FSDP)
            self._schedules.pop(key, None)
        schedule = self._schedule(key)
        target = labels if labels is not None else input_ids
        self._microbatches = count
        labelled = ((target if self.cp > 1 else target[:, 1:]) != -100).sum().to(torch.float64)
        if self.dp_group is not None:  # every DP (and CP) rank's labels (uneven -100)
            torch.distributed.all_reduce(labelled, group=self.dp_group)
        if int(labelled) == 0:  # every rank has the same count: a warning on each, no hang
            warnings.warn("PipelinedModel.step: no labelled token in this global batch "
                          "(every label is -100): the loss reads 0.0 and the gradients are "
                          "zero, where one process's mean over no tokens is NaN (a review)",
                          stacklevel=2)
        self._labelled = max(1, int(labelled))
        report = getattr(self, "graphopt_parallel", None)
        if report is not None:
            report.record_step_start()
        run = schedule.step if training else schedule.eval
        active = scaler if scaler is not None and training and scaler.is_enabled() else None
        self._scaler = active
        if active is not None:  # the scale exists on every stage (made at the first
            # scale(), which only the last stage's loss calls), for scaler.step / update
            active.scale(torch.zeros((), device=input_ids.device))
        # a new schedule first runs torch's metadata inference (a real forward and
        # backward), whose cleanup sets .grad = None on every FSDP2 / replicate module's
        # parameters: the gradient of earlier step() calls is kept aside (a review: it was
        # dropped when the second call of an accumulation had another length, and an
        # evaluation step between backward and optimizer.step wiped every gradient)
        kept: dict[str, Any] = {}
        for name, param in self.named_parameters() if fresh else ():
            if param.grad is not None:
                kept[name], param.grad = param.grad, None
        tied, earlier = self._tied_grad() if training else None, None
        if tied is not None and tied[0].grad is not None:  # gradient of earlier steps: kept
            earlier, tied[0].grad = tied[0].grad, None  # out of this step's pair sum
        losses: list[torch.Tensor] = []
        if self.is_first:
            run(input_ids, target=target if self.is_last else None, losses=losses)
        elif self.is_last:
            run(target=target, losses=losses)
        else:
            run()
        if tied is not None:  # the first and last stage each hold part of the gradient
            weight, group = tied
            grad: Any = weight.grad
            if grad is not None:
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                torch.distributed.all_reduce(local, group=group)
            if earlier is not None:
                weight.grad = earlier if grad is None else earlier + grad
        for name, param in self.named_parameters():  # (by name: FSDP2 swaps parameters)
            if name in kept:
                param.grad = kept[name] if param.grad is None else kept[name] + param.grad
        self._scaler = None
        total = torch.stack(losses).sum() if losses else None
        if total is not None and active is not None:
            total = total / active.get_scale()  # the loss as without scaling
        return total

    def _microbatch_count(self, input_ids: torch.Tensor, labels: torch.Tensor | None,
                          attention_mask: torch.Tensor | None) -> int:
        """This rank's microbatch count for the batch (checks of :meth:`step`)."""
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            raise ConfigError(f"input_ids must be [B, S] token ids (int64); got "
                              f"{input_ids.dtype} of shape {tuple(input_ids.shape)}")
        if labels is not None and labels.shape != input_ids.shape:
            raise ConfigError(f"labels {tuple(labels.shape)} must have input_ids' shape "
                              f"{tuple(input_ids.shape)}")
        if self.vocab_size is not None and input_ids.numel() and (
                int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size):
            raise ConfigError(f"token ids range over [{int(input_ids.min())}, "
                              f"{int(input_ids.max())}]; the model's vocabulary has "
                              f"{self.vocab_size}")
        if self.cp > 1 and labels is None:
            raise ConfigError("under CP (cp > 1) step takes this rank's chunk of the batch "
                              "and its labels, shifted across the chunk boundaries: "
                              "ids, labels = graphopt.parallel.context.shard_sequence(batch, "
                              "mesh); model.step(ids, labels=labels)")
        if self.cp > 1:
            from graphopt.parallel.context import SHARDED, UNTAGGED_RING, check_layout

            check_layout(input_ids, "ring" if self.cp_ring else "all_to_all")
            if self.cp_ring and input_ids.numel() and getattr(input_ids, SHARDED, None) is None:
                raise ConfigError(UNTAGGED_RING)
        if self.cp_ring and input_ids.shape[1] % 2:
            raise ConfigError(f"ring CP holds two chunks per rank (zigzag); this rank's "
                              f"{input_ids.shape[1]} tokens do not split in two: cut the "
                              "batch with graphopt.parallel.context.shard_sequence")
        if self.seq_split > 1 and input_ids.shape[1] % self.seq_split:
            raise ConfigError(f"sequence length {input_ids.shape[1]} is not divisible by "
                              f"tp={self.seq_split} under SP: pad to a multiple or use "
                              "ParallelPlan(..., sp=False)")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ConfigError("pipeline stages run causal attention without a padding mask; "
                              "this batch has padding: pack sequences without padding or "
                              "use pp=1")
        batch, mb = input_ids.shape[0], self.plan.microbatch
        if batch % mb:
            raise ConfigError(f"the batch ({batch} sequences) is not divisible by the "
                              f"microbatch size ({mb}): change the batch or plan.microbatch")
        count = batch // mb
        if count < self.plan.pp:
            raise ConfigError(f"{count} microbatch(es) of {mb} for {self.plan.pp} pipeline "
                              "ranks: a pipeline needs at least one microbatch per rank; "
                              "use a larger batch or a smaller plan.microbatch")
        if self.plan.virtual_stages > 1 and count % self.plan.pp:
            raise ConfigError(f"interleaved 1F1B needs the microbatch count ({count}) to be "
                              f"a multiple of pp ({self.plan.pp}): change the batch or "
                              "plan.microbatch")
        return count

    def _same_count_everywhere(self, count: int, problem: ConfigError | None,
                               length: int | None = None, fresh: bool = False) -> bool:
        """Raise on every rank when any rank refused its batch or the ranks' microbatch
        counts differ (FSDP's collectives and the pipeline's sends run per microbatch: a
        review found DP ranks with 2 and 3 microbatches deadlocked in FSDP's reduce-scatter
        and all-gather, or gloo aborted on mismatched sizes), or, under CP (``length``:
        this rank's chunk length), the chunks of one CP group differ in length (Ulysses'
        all-to-all and the ring need equal chunks; other CP groups may hold other lengths:
        an 8-rank review found them refused). One all-reduce over all ranks, and one over
        the CP group first under CP.

        Returns:
            whether any rank's schedule is ``fresh`` (new, or initialising its stages):
            then every rank builds a new one, so that their first runs, which run FSDP's
            collectives, happen together (DP ranks with other lengths in one step, whose
            schedule caches then differed, aborted gloo on mismatched sizes a step later,
            a review).
        """
        if not torch.distributed.is_initialized():
            if problem is not None:
                raise problem
            return fresh
        if length is not None and self.cp_group is not None:
            sizes = all_reduce_host(torch.tensor([length, -length], dtype=torch.float64),
                                    torch.distributed.ReduceOp.MAX, self.cp_group)
            if sizes[0] != -sizes[1] and problem is None:
                problem = ConfigError(
                    f"the ranks of this CP group hold chunks of different lengths "
                    f"({int(-sizes[1])} to {int(sizes[0])} tokens; this rank {length}): cut "
                    "every batch with graphopt.parallel.context.shard_sequence (the same "
                    "sequence length on the CP group's ranks)")
        flags = torch.tensor([count, -count, problem is not None, fresh],
                             dtype=torch.float64)
        flags = all_reduce_host(flags, torch.distributed.ReduceOp.MAX)
        if problem is not None:
            raise problem
        if flags[2]:
            raise ConfigError("another rank refused its batch (its ConfigError says why); "
                              "every rank stops here")
        if flags[0] != -flags[1]:
            raise ConfigError(f"ranks split their batches into different microbatch counts "
                              f"({int(-flags[1])} to {int(flags[0])}; this rank {count}): "
                              "every DP rank's batch must hold the same number of "
                              "sequences (FSDP and the pipeline run per microbatch); pad "
                              "or drop the last uneven batch")
        return bool(flags[3])

    def _tied_grad(self) -> tuple[nn.Parameter, Any] | None:
        """(the tied embedding weight as this module holds it now, its group) or None."""
        if self.tied is None:
            return None
        name, group = self.tied
        return dict(self.named_parameters())[name], group


def _will_initialize(schedule: Any, training: bool) -> bool:
    """Whether ``schedule``'s next run (``training``: step, else eval) initialises its
    stages (torch's ``_initialize_pp_stages``: the first run, or a switch between train
    and eval). True when torch's flags are not found (another torch version): a rebuild
    costs one more forward, a missed one loses gradients."""
    for prefix in ("_stage", "_stages"):
        fwd = getattr(schedule, f"{prefix}_forward_initialized", None)
        bwd = getattr(schedule, f"{prefix}_backward_initialized", None)
        if isinstance(fwd, bool) and isinstance(bwd, bool):
            return not fwd or bwd != training
    return True


def _original(name: str, prefix: str) -> str:
    """A stage's parameter name -> the full model's."""
    head, _, rest = name.partition(".")
    if head == "layers":
        return f"{prefix}.{rest}"
    return {"embed_tokens": "model.embed_tokens", "norm": "model.norm",
            "lm_head": "lm_head"}[head] + f".{rest}"


def pipeline(model: Any, plan: ParallelPlan, mesh: Any,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             sp: bool = False) -> PipelinedModel:
    """This rank's stages of ``model`` (module docstring) as a :class:`PipelinedModel`.

    Raises:
        ConfigError: see the module docstring.
    """
    check_pipeline(model, plan)
    if plan.cp > 1 and loss_fn is not None:  # a review: per-chunk means, NaN for a chunk
        # without labels, and labels that come shifted already
        raise ConfigError("under CP the pipeline's loss is the per-token mean over every "
                          "chunk (graphopt.parallel.context.cp_loss's scaling); a custom "
                          "loss_fn would see one chunk with labels shifted already and "
                          "average per chunk: drop loss_fn, or use cp=1")
    from graphopt.parallel.apply import decoder_layers

    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is _parent_list(model, layers))
    count = plan.pp * plan.virtual_stages
    bounds = _plan_bounds(plan, len(layers))
    rank = mesh["pp"].get_local_rank()
    mine = [s for s in range(count) if s % plan.pp == rank]
    cp = None
    if plan.cp > 1:
        cp = (mesh["cp"].get_local_rank(), plan.cp, plan.cp_kind == "ring")
    parts = [DecoderStage(model, layers, *bounds[s], s, count, plan.tp if sp else 1, cp)
             for s in mine]
    pipe = PipelinedModel(parts, plan, mesh["pp"].get_group(), loss_fn or next_token_loss,
                          prefix)
    pipe.seq_split = plan.tp if sp else 1
    # (cp_kind defaults to "ring": with cp = 1 it refused odd lengths, an 8-rank review)
    pipe.cp, pipe.cp_ring = plan.cp, plan.cp > 1 and plan.cp_kind == "ring"
    if plan.cp > 1:
        pipe.cp_group = mesh["cp"].get_group()
    pipe.vocab_size = model.get_input_embeddings().num_embeddings
    if plan.dp_replicate * plan.dp_shard * plan.cp > 1:
        pipe.dp_group = mesh["dp_cp"].get_group()
    weight = model.get_input_embeddings().weight
    if weight is model.get_output_embeddings().weight:
        group = _embedding_group(mesh)
        if rank in (0, plan.pp - 1):
            pipe.tied = (next(n for n, p in pipe.named_parameters() if p is weight), group)
        shared = next(n for n, p in model.named_parameters() if p is weight)
        pipe.original_names = {k: shared if p is weight else pipe.original_names[k]
                               for k, p in pipe.named_parameters()}
    return pipe


def _embedding_group(mesh: Any) -> Any:
    """This rank's group of {first, last} pipeline rank with the same other coordinates.
    ``dist.new_group`` is collective: every rank creates every pair, in the same order."""
    import torch.distributed as dist

    names = mesh.mesh_dim_names
    ranks = mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, mesh["pp"].size())
    mine = None
    for row in ranks.tolist():
        group = dist.new_group([row[0], row[-1]])
        if dist.get_rank() in (row[0], row[-1]):
            mine = group
    return mine


def _parent_list(model: nn.Module, layers: list[nn.Module]) -> nn.Module:
    return next(m for m in model.modules() if isinstance(m, nn.ModuleList) and
                len(m) == len(layers) and m[0] is layers[0])


def check_pipeline(model: Any, plan: ParallelPlan) -> None:
    """Raise ConfigError unless ``model`` can be cut into the plan's stages."""
    from graphopt.parallel.apply import decoder_layers

    inner = getattr(model, "model", None)
    missing = ("no .model (the decoder stack)" if inner is None else
               "no .model.norm (the final norm)" if not hasattr(inner, "norm") else
               "no output embeddings (LM head)" if model.get_output_embeddings() is None
               else "")
    if missing:
        raise ConfigError(f"pp > 1 cuts transformers causal LMs laid out as Llama's (.model."
                          f"embed_tokens, .model.layers, .model.norm, .lm_head); "
                          f"{type(model).__name__} has another structure ({missing}): use "
                          "pp=1")
    _plan_bounds(plan, len(decoder_layers(model)))
    _check_stages_compute_the_model(model, decoder_layers(model))


_PROBE_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
"""Largest relative difference (to the largest logit) between the stages' composition and
the model's own forward accepted by the probe; 2e-2 for 16-bit dtypes."""


def _on_placeholders(method: Callable[..., Any], module: nn.Module) -> Callable[..., Any]:
    """``method`` run inside :func:`graphopt.verify.placeholder_inputs`, with ``module``'s
    buffers as they were before it (its forward on ``torch.empty`` inputs in training mode
    updated a BatchNorm's running statistics from garbage: a review found one batch too
    many counted)."""
    from graphopt.verify import placeholder_inputs

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with placeholder_inputs(), _buffers_kept(module):
            return method(*args, **kwargs)

    return run


@contextlib.contextmanager
def _buffers_kept(module: nn.Module) -> Iterator[None]:
    """``module``'s buffers get back the values they had before the block (a probe forward
    in training mode updates BatchNorm's running statistics, even under no_grad). Written
    through ``.data`` and only where changed: no version bump (batch_norm saves its running
    statistics for the backward and checks their version; its own update does not bump
    it, so a restore between a microbatch's forward and backward must not either)."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        for b, value in buffers:
            if not torch.equal(b, value):
                b.data.copy_(value)


def _check_stages_compute_the_model(model: Any, layers: list[nn.Module]) -> None:
    """Raise ConfigError unless the stages (:class:`DecoderStage`: embed, layers with
    ``attention_mask=None``, norm, LM head) compute what the model's own forward computes:
    refused by name are sliding-window and chunked attention (the window or chunks exist
    only in the masks transformers builds) and eager attention (it reads a missing mask as
    no mask: bidirectional); anything else a model's forward adds (Granite's embedding and
    logits multipliers, Cohere's logit scale) is caught by running both on one sequence of
    16 random tokens (eval mode, no grad; skipped for weights on the meta device), and
    random draws outside the stages' modules in training (Starcoder2's embedding dropout)
    by :func:`_random_outside`. Translation validation by execution, as the MoE pass does."""
    from graphopt.models import (
        eager_forward_failed,
        eval_mode,
        refuse_aux_loss,
        rope_state_kept,
    )

    config = model.config
    attn = getattr(config, "_attn_implementation", None)
    if attn == "eager":
        raise ConfigError("pp > 1 runs each stage's layers with attention_mask=None (causal "
                          "through SDPA's is_causal); eager attention reads that as no mask "
                          "(bidirectional): load the model with attn_implementation='sdpa', "
                          "or use pp=1")
    windowed = bool(getattr(config, "sliding_window", None)
                    and getattr(config, "use_sliding_window", True))
    if windowed or "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ConfigError("pp > 1 does not execute sliding-window attention (the window "
                          "exists only in the masks transformers builds, and the stages pass "
                          "none): set config.sliding_window=None if the sequences fit the "
                          "window, or use pp=1")
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk or "chunked_attention" in (getattr(config, "layer_types", None) or []):
        # (a review: Llama 4's chunked attention ran as plain causal attention, gradients
        # 1.4 off one process, silently; the probe's 16 tokens fit one chunk of 16)
        raise ConfigError(f"pp > 1 does not execute chunked attention (attention_chunk_size="
                          f"{chunk}: the chunks exist only in the masks transformers builds, "
                          "and the stages pass none): set config.attention_chunk_size=None "
                          "if the sequences fit one chunk, or use pp=1")
    # the stages' loss is the next-token loss of the last stage's logits; the MoE
    # load-balancing loss needs every stage's router logits
    refuse_aux_loss(config, "pp > 1", "the next-token loss alone", "from every layer's "
                    "router logits, which the pipeline's stages do not return")
    params = list(model.parameters())
    if not params or any(p.is_meta for p in params):
        return
    stage = DecoderStage(model, layers, 0, len(layers), 0, 1)
    ids = torch.randint(0, model.get_input_embeddings().num_embeddings, (1, 16),
                        generator=torch.Generator().manual_seed(0)).to(params[0].device)
    with torch.no_grad(), eval_mode(model), rope_state_kept(model):
        try:
            want = model(input_ids=ids, use_cache=False).logits
        except RuntimeError as exc:  # the model cannot run eagerly as built
            raise eager_forward_failed("pp > 1 checks its stages against one eager forward "
                                       "of the model", exc) from exc
        got = stage(ids)
    drawn = _random_outside(model, stage, ids)
    if drawn:  # (a review: Starcoder2's embedding_dropout was dropped by the stages, and
        # the probe above runs in eval mode, where it draws nothing)
        raise ConfigError(
            f"pp > 1 runs embed -> decoder layers -> norm -> LM head, and in training "
            f"{type(model).__name__}'s forward draws random numbers outside those modules "
            f"({', '.join(drawn[:3])}: dropout such as Starcoder2's embedding_dropout), which "
            "the stages would not apply: set that dropout probability to 0 in the config, "
            "or use pp=1")
    scale = float(want.abs().max()) or 1.0
    diff = float((got.to(want.dtype) - want).abs().max()) / scale
    if not diff <= _PROBE_TOLERANCE.get(want.dtype, 2e-2):
        raise ConfigError(
            f"pp > 1 cuts the model into embed -> decoder layers -> norm -> LM head stages, "
            f"and this model's forward computes something else: on a probe sequence the "
            f"stages' logits differ from the model's by {diff:.3g} of the largest logit "
            f"({type(model).__name__}: e.g. embedding or logit multipliers, extra inputs to "
            "its layers). Use pp=1 for this model")


def _random_outside(model: Any, stage: DecoderStage, ids: torch.Tensor) -> list[str]:
    """The random ops (:func:`graphopt.passes.fx_utils.is_random_call`: dropout with p > 0,
    rand*, ...) the model's own forward runs in training mode outside the modules
    ``stage`` runs (embedding, decoder layers, final norm, LM head). One forward under
    no_grad on a forked RNG (the caller's stream is left as it was)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from graphopt.models import rope_state_kept
    from graphopt.passes.fx_utils import is_random_call

    depth = [0]
    seen: list[str] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if depth[0] == 0 and is_random_call(func, args, kwargs):
                seen.append(str(func))
            return func(*args, **kwargs)

    def enter(*_: Any) -> None:
        depth[0] += 1

    def leave(*_: Any) -> None:
        depth[0] -= 1

    modules = [m for m in (stage.embed_tokens, stage.norm, stage.lm_head,
                           *stage.layers.values()) if isinstance(m, nn.Module)]
    # first in and last out: hooks on these modules (TP's RNG regions draw a seed in a
    # pre-hook) run inside them
    handles = [h for m in modules for h in (m.register_forward_pre_hook(enter, prepend=True),
                                            m.register_forward_hook(leave, always_call=True))]
    training = {m: m.training for m in model.modules()}
    try:
        model.train()
        cuda = list(range(torch.cuda.device_count())) if ids.is_cuda else []
        # (a review: 2 probe batches were counted in BatchNorm's num_batches_tracked)
        with torch.no_grad(), torch.random.fork_rng(devices=cuda), rope_state_kept(model), \
                _buffers_kept(model), Watch():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        for m, mode in training.items():
            m.train(mode)
    return list(dict.fromkeys(seen))


def _plan_bounds(plan: ParallelPlan, layers: int) -> list[tuple[int, int]]:
    """The plan's stages: its ``stage_layers`` when given (ConfigError unless they add up to
    the model's layers), else :func:`stage_layers`."""
    if not plan.stage_layers:
        return stage_layers(layers, plan.pp * plan.virtual_stages)
    if sum(plan.stage_layers) != layers:
        raise ConfigError(f"the plan's stage_layers {list(plan.stage_layers)} add up to "
                          f"{sum(plan.stage_layers)} layers; the model has {layers}")
    ends = list(itertools.accumulate(plan.stage_layers))
    return list(zip([0] + ends[:-1], ends))
