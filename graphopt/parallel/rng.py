"""Random streams of model-parallel regions: dropout masks that differ where TP or CP splits
the values and agree where TP keeps them replicated.

Megatron-LM's model-parallel RNG tracker (``megatron/core/tensor_parallel/random.py``,
``get_cuda_rng_tracker().fork()``) draws dropout in the tensor-parallel regions from a seed
offset by the TP rank and everything else from the seed every TP rank shares. graphopt's TP
layout is derived from the model's data flow (:mod:`graphopt.parallel.tp_layout`), so the
regions are marked with module hooks on that layout instead of in the model's code:

- **head region** (TP): inside a split mixer, from a reader's (ColwiseParallel) output to its
  writer's (RowwiseParallel) input, where each TP rank holds its heads or FFN columns
  (attention-probability dropout). Seeded per TP rank.
- **sequence region** (TP + SP): a decoder layer outside its mixers and replicated modules,
  and a split mixer after its writer (Starcoder2's residual dropout inside the mixer),
  where each TP rank holds a sequence shard of the residual stream. Seeded per TP rank. Its
  mixers and replicated modules (which all-gather the sequence) run on a stream derived
  from the region's shared base and the module, the same on every TP rank.
- **chunk region** (CP): the model's forward, where each CP rank holds its chunk of every
  sequence. Seeded per CP rank (Megatron-LM does not offset CP ranks; one process draws
  independent masks over the whole sequence, which this matches in distribution). Under PP
  the stages add the CP rank to their seed
  (:data:`graphopt.parallel.pipeline.CP_SEED_STRIDE`).

Everything else draws from the default generators as the user seeded them (TP ranks must be
seeded alike: graphopt.parallel.apply checks it at the first training forward).

Mechanics: entering a region saves the CPU (and, on an accelerator, the device's) generator
state, draws a 31-bit ``base`` from the CPU generator and seeds both generators with
``base << 32 | hash(base, kind, rank)`` (:func:`region_seed`); leaving restores the saved
states and, only if the region drew random numbers, advances the CPU generator by one draw.
So a model that draws nothing sees its generators untouched (TP training matches one
process bit for bit), and two regions entered from one state draw different bases. Which
stream a mixer's hook is in is read from the seed itself (``torch.initial_seed()``,
restored by ``set_rng_state``), not from hook bookkeeping, so activation checkpointing
(``torch.utils.checkpoint`` saves and restores the generator states) replays the same
masks (tests/test_parallel_rng.py: recompute_layers gives bit-identical gradients).

The hooks are installed only when the model has something that draws in training
(:func:`draws_randomly`: dropout modules with p > 0, configs with a non-zero dropout or
jitter field); otherwise nothing changes. Not covered: random draws on replicated values
between a split mixer's readers and its writer would be drawn per TP rank (none of the
transformers mixers this was checked on, Llama, Starcoder2 and Mixtral, draws there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

HEAD_TAG, SEQUENCE_TAG, SHARED_TAG, CHUNK_TAG = 1, 2, 3, 4
"""Region kinds, mixed into the low half of a region's seed (:func:`region_seed`)."""

_BASE = 2**31  # region bases: 31 bits, so seeds stay under 2**63


def _mix32(*values: int) -> int:
    """A 32-bit hash of ``values`` (splitmix64's finalizer over their combination)."""
    z = 0
    for v in values:
        z = (z * 0x9E3779B97F4A7C15 + v + 1) % 2**64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        z ^= z >> 31
    return z % 2**32


def region_seed(tag: int, rank: int, base: int) -> int:
    """``base << 32 | mix32(base, tag, rank)``: the CPU generator (mt19937) uses only a
    seed's low 32 bits (a first version put the rank in the high bits, and the TP ranks'
    masks stayed identical), so kind and rank are mixed into them; the high half keeps the
    base every rank of the region shares (:func:`region_base`)."""
    base %= _BASE
    return (base << 32) | _mix32(base, tag, rank)


def region_base(seed: int, tag: int, rank: int) -> int | None:
    """The base of a seed :func:`region_seed` made for ``(tag, rank)``; None for any other
    seed (a user's seed passes this check with probability 2**-32)."""
    base = seed >> 32
    if base >= _BASE or seed % 2**32 != _mix32(base, tag, rank):
        return None
    return base


def draws_randomly(model: nn.Module) -> bool:
    """Whether ``model`` in training mode has a known source of random numbers: a dropout
    module with p > 0 or a config field named like ``*dropout*``, ``*pdrop*`` or
    ``*jitter*`` above 0 (transformers' attention_dropout, resid_pdrop,
    router_jitter_noise), in ``model.config`` or its sub-configs. A source missed here
    keeps the default streams (identical masks over TP shards, never a wrong gradient)."""
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    seen: set[int] = set()

    def scan(config: Any) -> bool:
        if config is None or id(config) in seen or not hasattr(config, "__dict__"):
            return False
        seen.add(id(config))
        for key, value in vars(config).items():
            if isinstance(value, bool):
                continue
            if isinstance(value, (int, float)) and value > 0 and any(
                    word in key.lower() for word in ("dropout", "pdrop", "jitter")):
                return True
            if hasattr(value, "to_dict") and scan(value):  # a sub-config
                return True
        return False

    return any(scan(getattr(m, "config", None)) for m in model.modules())


class Generators:
    """The default CPU generator and, on an accelerator ``device`` (CUDA, NPU, ...), that
    device's default generator: read their states and seed them alike. Shared by the
    regions here and the pipeline stages' streams
    (:meth:`graphopt.parallel.pipeline.DecoderStage.random_stream`). ``meta`` and ``cpu``
    devices have the CPU generator only.

    Attributes:
        module: ``torch.cuda``-like device module, or None on the CPU.
        index: the device's index (its current one when ``device`` has none), or None.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        accel = device.type not in ("cpu", "meta")
        self.module = torch.get_device_module(device.type) if accel else None
        self.index = None if self.module is None else (
            device.index if device.index is not None else self.module.current_device())

    def states(self) -> list[torch.Tensor]:
        """[CPU state, device state]: uint8 tensors on the CPU (``get_rng_state``)."""
        states = [torch.get_rng_state()]
        if self.module is not None:
            states.append(self.module.get_rng_state(self.index))
        return states

    def set_states(self, states: list[torch.Tensor]) -> None:
        """Restore what :meth:`states` read."""
        torch.set_rng_state(states[0])
        if self.module is not None:
            self.module.set_rng_state(states[1], self.index)

    def seed(self, seed: int) -> None:
        """Seed both generators with ``seed`` (an int below 2**64; the CPU's mt19937 uses
        its low 32 bits, CUDA's Philox all 64)."""
        torch.default_generator.manual_seed(seed)
        if self.module is not None:
            self.module.set_rng_state(
                torch.Generator(device=self.device).manual_seed(seed).get_state(), self.index)


def drew(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    """Whether the generators advanced between two :meth:`Generators.states` reads."""
    return any(not torch.equal(a, b) for a, b in zip(before, after))


class RandomRegions:
    """The hooks of :mod:`graphopt.parallel.rng` for one model (module docstring).

    Args:
        device: the model's device: regions fork the CPU generator and, on an
            accelerator, this device's.
        tp_rank: this rank's index in its TP group (0 without TP).
        cp_rank: this rank's index in its CP group (0 without CP).
    """

    def __init__(self, device: torch.device, tp_rank: int = 0, cp_rank: int = 0) -> None:
        self.generators = Generators(device)
        self.tp_rank, self.cp_rank = tp_rank, cp_rank
        self.stack: list[tuple[str, Any]] = []
        """Open regions: (kind, saved states or None for a boundary that changed nothing)."""
        self.split_mixers = 0
        """Split mixers whose head regions are hooked (the report's note)."""

    # -- entering and leaving -------------------------------------------------------------

    @torch._dynamo.disable
    def _enter(self, kind: str, seed_of: Any) -> None:
        saved = self.generators.states()
        self.generators.seed(seed_of(int(torch.randint(0, _BASE, (1,)).item())))
        self.stack.append((kind, (saved, self.generators.states())))

    @torch._dynamo.disable
    def _leave(self) -> None:
        _, state = self.stack.pop()
        if state is None:
            return
        saved, seeded = state
        advanced = drew(seeded, self.generators.states())
        self.generators.set_states(saved)
        if advanced:  # the next region entered from here draws another base
            torch.randint(0, _BASE, (1,))

    def _top(self) -> str | None:
        return self.stack[-1][0] if self.stack else None

    # -- hooks: in eval mode they do nothing (no graph break under torch.compile); in
    # training their bodies run outside Dynamo's tracing, which would read the generators
    # and the open regions at compile time ------------------------------------------------

    def head_enter(self, module: nn.Module, args: Any, output: Any) -> None:
        """A split mixer's reader, after its forward: enter its head region (once)."""
        if module.training:
            self._head_enter()

    @torch._dynamo.disable
    def _head_enter(self) -> None:
        if self._top() != "head":
            self._enter("head", lambda base: region_seed(HEAD_TAG, self.tp_rank, base))

    def head_leave(self, module: nn.Module, args: Any) -> None:
        """A split mixer's writer, before its forward: leave the head region."""
        if module.training:
            self._close("head", inner=False)

    def tail_enter(self, module: nn.Module, args: Any, output: Any) -> None:
        """A split mixer's writer under SP, after its forward: the rest of the mixer
        (Starcoder2's residual dropout) runs on this rank's sequence shard of the writer's
        output."""
        if module.training:
            self._enter("tail", lambda base: region_seed(SEQUENCE_TAG, self.tp_rank, base))

    def sequence_enter(self, module: nn.Module, args: Any) -> None:
        """A decoder layer under SP, before its forward."""
        if module.training:
            self._enter("sequence", lambda base: region_seed(SEQUENCE_TAG, self.tp_rank, base))

    def shared_enter(self, index: int) -> Any:
        """Forward pre-hook of a mixer or replicated module under SP (number ``index``):
        inside a sequence region, switch to the stream every TP rank shares."""
        def hook(module: nn.Module, args: Any) -> None:
            if module.training:
                self._shared_enter(index)
        return hook

    @torch._dynamo.disable
    def _shared_enter(self, index: int) -> None:
        # (read from the seed, which activation checkpointing restores, so a recomputed
        # module takes the stream it took in the forward)
        base = region_base(torch.initial_seed(), SEQUENCE_TAG, self.tp_rank)
        if base is not None:
            self._enter("shared", lambda _: region_seed(SHARED_TAG, 0,
                                                        _mix32(base, index)))
        else:
            self.stack.append(("shared", None))

    def close(self, kind: str) -> Any:
        """Forward hook (always called, also when the forward raises): close the head and
        tail regions left open inside the module, then the region of ``kind`` its pre-hook
        opened."""
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if module.training:
                self._close(kind, inner=True)
        return hook

    @torch._dynamo.disable
    def _close(self, kind: str, inner: bool) -> None:
        while inner and self._top() in ("head", "tail"):  # the module's own, left open
            self._leave()
        if self._top() == kind:
            self._leave()

    def chunk_enter(self, module: nn.Module, args: Any) -> None:
        """The model under CP, before its forward."""
        if module.training:
            self._enter("chunk", lambda base: region_seed(CHUNK_TAG, self.cp_rank, base))


def _model_device(model: nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def install_tp_regions(model: nn.Module, layout: Any, tp_rank: int, sp: bool
                       ) -> RandomRegions | None:
    """Hook the head regions of every split mixer of ``layout`` (a TPLayout) and, with
    ``sp``, the sequence regions of its decoder layers (module docstring). Returns the
    RandomRegions, or None when ``model`` draws no random numbers (:func:`draws_randomly`)."""
    split = {m for m in layout.mixers if any(p.startswith(m + ".") for p in layout.colwise)}
    if not draws_randomly(model) or not (split or sp):
        return None
    regions = RandomRegions(_model_device(model), tp_rank=tp_rank)
    regions.split_mixers = len(split)
    modules = dict(model.named_modules())
    for path in layout.colwise:
        if path in modules and any(path.startswith(m + ".") for m in layout.mixers):
            modules[path].register_forward_hook(regions.head_enter)
    for path in layout.rowwise:
        if path in modules and any(path.startswith(m + ".") for m in layout.mixers):
            modules[path].register_forward_pre_hook(regions.head_leave)
    for mixer in layout.mixers:
        if mixer in modules:
            modules[mixer].register_forward_hook(regions.close("head"), always_call=True)
    if sp:
        nested = {m for m in layout.mixers if any(m.startswith(r + ".")
                                                   for r in layout.replicated)}
        for path in layout.rowwise:  # (a mixer inside a replicated module keeps the whole
            # sequence: its writer's output is replicated there)
            if path in modules and any(path.startswith(m + ".") for m in layout.mixers
                                       if m not in nested):
                modules[path].register_forward_hook(regions.tail_enter)
        for path in layout.layers:
            modules[path].register_forward_pre_hook(regions.sequence_enter)
            modules[path].register_forward_hook(regions.close("sequence"), always_call=True)
        for index, path in enumerate(sorted({*layout.mixers, *layout.replicated})):
            if path in modules:
                modules[path].register_forward_pre_hook(regions.shared_enter(index))
                modules[path].register_forward_hook(regions.close("shared"), always_call=True)
    return regions


def install_cp_region(model: nn.Module, cp_rank: int) -> RandomRegions | None:
    """Hook the chunk region around ``model``'s forward (module docstring): its pre-hook
    runs after the pre-hooks registered so far, its forward hook before the forward hooks
    (TP's random-state check compares the states outside). None when ``model`` draws no
    random numbers."""
    if not draws_randomly(model):
        return None
    regions = RandomRegions(_model_device(model), cp_rank=cp_rank)
    model.register_forward_pre_hook(regions.chunk_enter)
    model.register_forward_hook(regions.close("chunk"), prepend=True, always_call=True)
    return regions
