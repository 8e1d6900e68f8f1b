"""Derive a model's tensor-parallel layout from how it computes, not from a per-model table.

Contract: :func:`derive_tp_layout` runs the model once (no gradients) with hooks that record
which tensor each module reads and returns, and classifies from that data flow alone:

- a *reader* is an ``nn.Linear`` whose input is the output of a normalization module (the
  residual stream, normalized): column-parallel (Megatron-LM's first GEMM, "ColwiseParallel");
- its *mixer* is the reader's parent module (attention, MLP); the mixer's other Linears
  write back into the residual stream: exactly one is required, row-parallel
  ("RowwiseParallel"). A mixer whose readers have no such partner (an MoE router next to
  grouped experts) stays replicated, and the layout says why;
- the *LM head* is a reader whose output size is the vocabulary: column-parallel over the
  vocabulary; the token embedding (``nn.Embedding`` of the same vocabulary) is row-parallel
  over the vocabulary (Megatron's vocab-parallel embedding). Tied weights keep both
  replicated (reported);
- with SP (sequence parallelism, Korthikanti et al. 2022) the residual stream inside the
  decoder layers is split over the sequence: each normalization module of a layer, and the
  final one, runs on its sequence shard (``SequenceParallel``), each mixer all-gathers its
  input (``PrepareModuleInput``: Shard(1) -> Replicate), each writer reduce-scatters
  (``RowwiseParallel(output_layouts=Shard(1))``), the first decoder layer takes its
  sequence shard of the replicated embedding output, and the LM head all-gathers.

Checked before anything is sharded (``ConfigError`` naming the fix): tp divides the
attention heads and the KV heads, the readers' output sizes, the writers' input sizes, and
the vocabulary.

Pseudo-code::

    record(module -> (input tensor ids, output tensor ids, how the input was passed))
    readers = [lin for lin in linears if input(lin) in outputs(norms)]
    for mixer in {parent(r) for r in readers}:
        writers = mixer's linears - readers
        colwise += readers if len(writers) == 1 else kept(mixer, why)
        rowwise += writers
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from graphopt.errors import ConfigError
from graphopt.models import eval_mode, rope_state_kept


@dataclass(frozen=True)
class CallSite:
    """How a module received its hidden-state input: positional index or keyword name."""

    position: int | None = None
    keyword: str | None = None


@dataclass
class TPLayout:
    """Module paths by role (see the module docstring)."""

    colwise: list[str] = field(default_factory=list)
    rowwise: list[str] = field(default_factory=list)
    mixers: dict[str, CallSite] = field(default_factory=dict)
    """Mixer path -> how it receives the normalized hidden states (SP all-gathers there)."""
    norms: list[str] = field(default_factory=list)
    """Normalization modules inside decoder layers and the final one (SP runs them split)."""
    layers: dict[str, CallSite] = field(default_factory=dict)
    """Decoder layer path -> how it receives the residual stream (the first takes its shard)."""
    embedding: str | None = None
    lm_head: str | None = None
    vocab: int | None = None
    kept: dict[str, str] = field(default_factory=dict)
    """Module path -> why it stays replicated."""
    head_norms: dict[str, int] = field(default_factory=dict)
    """Normalization modules inside a split mixer, between its readers and its writer (Qwen3's
    q_norm/k_norm over each head) -> the dim their input is split on (heads). They run on
    this rank's heads with a replicated weight whose gradient is summed over TP
    (``SequenceParallel(sequence_dim=dim)``, as torchtitan does for Qwen3)."""
    written_in_place: list[str] = field(default_factory=list)
    """Replicated readers whose output the caller writes in place (Falcon's ``mlp_output +=
    attention_output``): SP would hand the caller a view from DTensor's ``to_local``, which
    autograd forbids writing, so they refuse SP."""
    sp_problems: list[str] = field(default_factory=list)
    """Why SP would change what this model computes (:func:`_sp_problems`); SP refuses to
    run with the first one. TP without SP is not affected."""
    indivisible: list[str] = field(default_factory=list)
    """Mixers kept whole because tp does not divide a projection's size ("path: sizes"). The
    probe's uneven split "changed the output" was the reason given before, and
    parallel='auto' ran such a tp priced as split (0.72 of the parameters per rank where
    0.5 was priced, a review): auto now refuses such plans, and parallelize notes and warns.
    Not an error: a mixer the probe or its own parameters keep whole at every tp (Phi-3's
    fused gate_up_proj, Mamba2's A_log) ran before and still does (a re-review)."""
    after_writer: list[str] = field(default_factory=list)
    """Parameters of split mixers that run after the writer (a LayerScale gain): they see
    the reduced output, whole without SP, one sequence shard per rank with it."""
    replicated: dict[str, tuple[CallSite, int]] = field(default_factory=dict)
    """Decoder-layer modules that read the normalized residual stream and stay replicated
    (an MoE block, a mixer that cannot split) -> (call site, outputs: 0 for one tensor, n
    for an n-tuple whose first item is the hidden states). With SP they all-gather their
    input and keep their sequence shard of the output."""
    unchecked: list[str] = field(default_factory=list)
    """On a meta-device model: modules the value checks (the mixer probe, SP's per-position
    run) could not run on, being larger than ``PROBE_PARAMETERS``: split, or run under SP,
    on a shape-only check (parallelize warns)."""


PROBE_PARAMETERS = 1 << 28
"""The largest module (parameters) a meta-device model's value checks materialize: one
copy in float64 on the CPU (2 GiB at the bound) and its shards. 2^26 left Phi-3-mini's
MLP (75.5M, a fused gate_up_proj a split pairs wrongly) to the shape-only check, which
split it: gradients 3.5e-2 off (a re-review); 2^28 covers 8B-class MLPs and 70B-class
attention."""


@contextlib.contextmanager
def _outside_trace() -> Iterator[None]:
    """Real tensors inside :func:`derive_tp_layout`'s fake trace of a meta-device model."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing(), unset_fake_temporarily():
        yield


def _with_values(tree: Any, gen: torch.Generator) -> Any:
    """``tree`` with each tensor replaced by a CPU tensor of its shape holding values: float
    ones standard normal in float64, booleans True (a mask that
    masks nothing), integers 0 (an index in any range)."""
    def fill(t: torch.Tensor) -> torch.Tensor:
        dtype = torch.float64 if t.is_floating_point() else t.dtype
        if t.is_floating_point() or t.is_complex():
            return torch.randn(tuple(t.shape), generator=gen, dtype=dtype)
        return torch.ones(tuple(t.shape), dtype=t.dtype) if t.dtype == torch.bool else \
            torch.zeros(tuple(t.shape), dtype=t.dtype)
    with _outside_trace():
        return torch.utils._pytree.tree_map_only(torch.Tensor, fill, tree)


def _materialized(module: nn.Module) -> nn.Module | None:
    """A CPU copy of the meta-device ``module`` with random values (seeded: weights
    N(0, 1/fan_in), 1-D parameters 1 + N(0, 0.01), buffers as :func:`_with_values`), its
    floating tensors in float64, for the value checks; None above ``PROBE_PARAMETERS``.
    The checks are structural (does a split compute what the whole does), so any values
    that keep the computation finite serve."""
    if sum(p.numel() for p in module.parameters()) > PROBE_PARAMETERS:
        return None
    gen = torch.Generator().manual_seed(0)
    with _outside_trace():
        copy_ = copy.deepcopy(module).to_empty(device="cpu").double()
        with torch.no_grad():
            for p in copy_.parameters():
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype)
                            / math.sqrt(p.shape[-1]))
                else:
                    p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            for sub in copy_.modules():
                for name, b in sub._buffers.items():
                    if b is not None:
                        sub._buffers[name] = _with_values(b, gen)
    return copy_


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or name.endswith(("norm", "rmsnorm"))


class _Recorder:
    """Forward hooks recording tensor identities in and out of every module."""

    def __init__(self, model: nn.Module) -> None:
        self.inputs: dict[str, tuple[list[int], dict[str, int]]] = {}
        self.order: list[str] = []
        """Module paths in the order their forwards finished."""
        self.started: list[str] = []
        """Module paths in the order their forwards started (one entry per call)."""
        self.calls: dict[str, tuple[tuple, dict]] = {}
        """First call's real arguments (the probe replays a mixer with them)."""
        self.outputs: dict[str, list[int]] = {}
        self.returned: dict[str, tuple[list[Any], Any]] = {}
        """Module path -> its first call's output, flattened (leaves, tree spec)."""
        self.arity: dict[str, int] = {}
        """Module path -> items of its output tuple (0: not a tuple)."""
        self.versions: dict[str, list[tuple[torch.Tensor, int]]] = {}
        """Module path -> its first call's output tensors and their version counters then
        (a later in-place write raises the counter)."""
        self.alive: list[torch.Tensor] = []  # ids stay unique while the tensors live
        self.handles = []
        for path, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(
                self._pre(path), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(path)))

    def _pre(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.started.append(path)
            self.alive += [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            if path not in self.inputs:  # first call decides (the same module reused: same)
                self.calls[path] = (args, dict(kwargs))
                self.inputs[path] = ([id(a) if isinstance(a, torch.Tensor) else 0
                                      for a in args],
                                     {k: id(v) for k, v in kwargs.items()
                                      if isinstance(v, torch.Tensor)})
        return hook

    def _post(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            leaves = torch.utils._pytree.tree_leaves(output)
            self.alive += [t for t in leaves if isinstance(t, torch.Tensor)]
            self.outputs.setdefault(path, [id(t) for t in leaves if isinstance(t, torch.Tensor)])
            self.versions.setdefault(path, [(t, t._version) for t in leaves
                                            if isinstance(t, torch.Tensor)])
            self.arity.setdefault(path, len(output) if isinstance(output, tuple) else 0)
            self.returned.setdefault(path, torch.utils._pytree.tree_flatten(output))
            self.order.append(path)
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def uses(self, path: str, tensor_ids: set[int]) -> int:
        """How many of ``path``'s first call's arguments are one of ``tensor_ids``."""
        args, kwargs = self.inputs.get(path, ([], {}))
        return sum(a in tensor_ids for a in (*args, *kwargs.values()))

    def call_site(self, path: str, tensor_ids: set[int]) -> CallSite | None:
        """Where ``path``'s first call received one of ``tensor_ids`` (position or keyword)."""
        args, kwargs = self.inputs.get(path, ([], {}))
        for i, a in enumerate(args):
            if a in tensor_ids:
                return CallSite(position=i)
        for key, a in kwargs.items():
            if a in tensor_ids:
                return CallSite(keyword=key)
        return None


def derive_tp_layout(model: nn.Module, sample: Callable[[], Any], tp: int) -> TPLayout:
    """The TP(+SP) layout of ``model`` for degree ``tp`` (module docstring).

    Args:
        model: the model (any device; it is run once under ``torch.no_grad``).
        sample: a callable running one forward of ``model`` on a small input.
        tp: the TP degree the divisibility checks use.

    Raises:
        ConfigError: heads, KV heads or the vocabulary not divisible by tp (a mixer
            whose projection sizes tp does not divide is kept whole instead:
            ``TPLayout.indivisible``).
    """
    if any(p.is_meta for p in model.parameters()):
        # a dry run (large model on the meta device): transformers' mask code reads values,
        # which a fake trace lets it skip (is_tracing), so derive inside one
        from torch.fx.experimental.proxy_tensor import make_fx

        from graphopt.models import experts_implementation

        box: dict[str, TPLayout] = {}

        def traced() -> torch.Tensor:
            box["layout"] = _derive(model, sample, tp)
            return torch.zeros(())

        # transformers' per-expert loop ("eager") reads routing values: its same function
        # as batched GEMMs traces (a review: GuardOnDataDependentSymNode from Mixtral)
        with experts_implementation(model, "batched_mm", lambda kind: kind == "eager"):
            try:
                make_fx(traced, tracing_mode="fake", _allow_non_fake_inputs=True)()
            except Exception as exc:
                if "data-dependent" in str(exc).lower():
                    raise ConfigError(
                        "TP's layout of this meta-device model needs a forward, and its fake "
                        f"trace hit data-dependent code ({str(exc).splitlines()[0][:120]}): "
                        "parallelize the model with real weights (a smaller copy of it "
                        "shows the same layout), or make the code shape-static (MoE experts: "
                        "experts_implementation='batched_mm')") from exc
                raise
        layout = box["layout"]
    else:
        layout = _derive(model, sample, tp)
    _check_divisible(layout, model, tp)
    return layout


def _derive(model: nn.Module, sample: Callable[[], Any], tp: int) -> TPLayout:
    recorder = _Recorder(model)
    try:
        with torch.no_grad(), eval_mode(model), rope_state_kept(model):  # one deterministic
            # forward (no dropout)
            sample()
    finally:
        recorder.remove()
    modules = dict(model.named_modules())
    norm_out = {t for p, m in modules.items() if _is_norm(m) for t in recorder.outputs.get(p, [])}
    readers = [p for p, m in modules.items() if isinstance(m, nn.Linear)
               and set(recorder.inputs.get(p, ([], {}))[0][:1]) & norm_out]
    layout = TPLayout()
    try:
        _classify_mixers(layout, modules, readers, recorder, norm_out, tp)
        _vocab_parallel(layout, modules, recorder)
        _replicated_readers(layout, modules, recorder, norm_out)
        _layers_and_norms(layout, modules, recorder)
        layout.sp_problems = _sp_problems(layout, modules, recorder, norm_out, tp)
    finally:
        recorder.alive.clear()
        recorder.calls.clear()
        recorder.versions.clear()
        recorder.returned.clear()
    return layout


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _classify_mixers(layout: TPLayout, modules: dict[str, nn.Module], readers: list[str],
                     recorder: _Recorder, norm_out: set[int], tp: int) -> None:
    vocab_readers = {p for p in readers if p == _lm_head(modules, recorder)}
    for mixer in sorted({_parent(p) for p in readers if p not in vocab_readers}):
        mine = [p for p in readers if _parent(p) == mixer]
        writers = [p for p, m in modules.items() if isinstance(m, nn.Linear)
                   and _parent(p) == mixer and p not in mine]
        if len(writers) != 1:
            layout.kept[mixer] = (f"{len(mine)} Linear(s) read the normalized residual stream "
                                  f"but {len(writers)} write back (a row-parallel partner is "
                                  "needed; e.g. an MoE router next to grouped experts)")
            continue
        site = recorder.call_site(mixer, norm_out)
        if site is None:
            layout.kept[mixer] = "its hidden-state input could not be located in its call"
            continue
        if any(t._version != v for p in (mixer, writers[0])
               for t, v in recorder.versions.get(p, [])):
            layout.kept[mixer] = ("its output is written in place after it returns (Falcon's "
                                  "mlp_output += attention_output), which autograd forbids on "
                                  "TP's row-parallel outputs (views made by DTensor's "
                                  "to_local); kept replicated")
            continue
        uneven = [f"{p}.out_features ({modules[p].out_features})" for p in mine
                  if int(getattr(modules[p], "out_features", 0)) % tp] + \
                 [f"{p}.in_features ({modules[p].in_features})" for p in writers
                  if int(getattr(modules[p], "in_features", 0)) % tp]
        if uneven:
            layout.indivisible.append(f"{mixer}: {', '.join(uneven)}")
            layout.kept[mixer] = (f"{', '.join(uneven)} not divisible by tp ({tp}): kept "
                                  "whole on every TP rank")
            continue
        # every instance: one class's instances may differ (a review: only layer 1's
        # attention rolled its heads, and the probe of layer 0 split both)
        why = _probe(layout, modules[mixer], mixer, mine, writers[0], recorder.calls[mixer],
                     tp)
        if why:
            layout.kept[mixer] = why
            continue
        why = _inner_params(layout, modules, mixer, mine, writers[0], recorder)
        if why:
            layout.kept[mixer] = why
            continue
        layout.colwise += mine
        layout.rowwise += writers
        layout.mixers[mixer] = site


def _inner_params(layout: TPLayout, modules: dict[str, nn.Module], mixer: str,
                  readers: list[str], writer: str, recorder: _Recorder) -> str:
    """Classify the split mixer's parameters outside its readers and writer: a norm module
    that runs between the readers and the writer computes on this rank's heads (its weight
    gradient is partial: recorded in ``layout.head_norms``); one that runs after the writer
    sees the reduced output (replicated, nothing to do). Anything else (a parameter of the
    mixer itself, a non-norm module between readers and writer) -> the reason to keep the
    mixer replicated; "" when all are handled."""
    first: dict[str, int] = {}
    for i, p in enumerate(recorder.order):
        first.setdefault(p, i)
    start = min(first.get(r, -1) for r in readers)
    end = first.get(writer, -1)
    found: dict[str, int] = {}
    for name, _ in modules[mixer].named_parameters():
        if "." not in name:  # held by the mixer itself: where its forward uses it is unknown
            # (the recorder's order is when forwards finish, the mixer's after its writer)
            return (f"its own parameter {name} may act on this rank's heads (a per-head or "
                    "scalar gain would get a partial gradient): TP cannot tell how it "
                    "splits; kept replicated")
        owner = f"{mixer}.{name.rsplit('.', 1)[0]}"
        if owner in readers or owner == writer:
            continue
        if first.get(owner, end + 1) > end:
            layout.after_writer.append(f"{mixer}.{name}")
            continue
        call = recorder.calls.get(owner)
        if not _is_norm(modules[owner]) or not call or \
                not isinstance(call[0][:1] and call[0][0], torch.Tensor) or \
                not start < first[owner] < end:
            return (f"its parameter {name} is used between the split projections outside a "
                    "normalization module: TP cannot tell how it splits; kept replicated")
        found[owner] = call[0][0].dim() - 2
    layout.head_norms.update(found)
    return ""


def _probe(layout: TPLayout, mixer: nn.Module, path: str, readers: list[str], writer: str,
           call: tuple[tuple, dict], tp: int) -> str:
    """:func:`probe_mixer`; a meta-device mixer on a materialized copy with random values
    and inputs of the recorded shapes (a review: on the meta device only the output shape
    was checked, and a mixer that mixes heads was split, gradients 8e-2 off one process,
    silently), or above ``PROBE_PARAMETERS`` on the shape-only check, noted in
    ``layout.unchecked``."""
    if not any(p.is_meta for p in mixer.parameters()):
        return probe_mixer(mixer, path, readers, writer, call, tp)
    real = _materialized(mixer)
    if real is None:  # shapes only, on meta tensors outside the trace (in it, deep-copying
        # MiniMax's meta decay buffers failed: a re-review)
        layout.unchecked.append(path)
        with _outside_trace():
            meta = torch.utils._pytree.tree_map_only(
                torch.Tensor, lambda t: torch.empty(tuple(t.shape), dtype=t.dtype,
                                                    device="meta"), call)
            return probe_mixer(mixer, path, readers, writer, meta, tp)
    with _outside_trace():
        return probe_mixer(real, path, readers, writer,
                           _with_values(call, torch.Generator().manual_seed(1)), tp)


def probe_mixer(mixer: nn.Module, path: str, readers: list[str], writer: str,
                call: tuple[tuple, dict], tp: int) -> str:
    """"" when ``mixer`` computes the same output with its readers split by output rows and
    its writer by input columns into ``tp`` shards, summing the writer's partial outputs
    (what column -> row parallelism computes), on its recorded real input; else why not
    (e.g. the code reshapes by a configured head count, or mixes heads).

    Each shard runs on a copy of the mixer with sliced weights; float64 on the inputs'
    device; relative error 1e-6 (the check is structural, not about rounding)."""
    import copy

    args, kwargs = call
    dry = any(p.is_meta for p in mixer.parameters())  # shapes only, dtypes as they are

    def to64(t: Any) -> Any:
        return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() and \
            not dry else t

    args = tuple(to64(a) for a in args)
    kwargs = _no_cache(kwargs, to64)
    reference = copy.deepcopy(mixer) if dry else copy.deepcopy(mixer).double()
    # in eval mode: with attention dropout on (a model in train mode, the usual order in a
    # training script) the reference and each shard drew other masks, and the attention
    # was kept replicated as "a split changes its output" (a review)
    reference.eval()
    try:
        shards = _shards(reference, path, readers, writer, tp)
        wants, got, others = _split_outputs(reference, shards, args, kwargs)
    except Exception as exc:  # the sharded code cannot even run: not head-parallel
        # projections wrapped by another module (LoRA-style adapters around nn.Linear) are
        # not split: the reason is the wrapper, not the error it caused (a review)
        wrapped = [f"{name} ({type(child).__name__})" for name, child in mixer.named_children()
                   if not isinstance(child, nn.Linear) and any(
                       isinstance(m, nn.Linear) for m in child.modules())]
        why = (f"; its projection(s) {', '.join(wrapped[:4])} wrap nn.Linear modules "
               "(adapters?), which TP does not split: merge them into the linear weights "
               "first to split this module") if wrapped else ""
        return (f"a {tp}-way column/row split of it fails to run "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]}){why}; kept "
                "replicated")
    try:
        _run_with_local_views(shards[-1], path, readers, args, kwargs)
    except RuntimeError as exc:
        return ("it writes a column-parallel output in place (e.g. OLMo's clip_qkv clamp_), "
                "which autograd forbids on TP's sharded outputs (views made by DTensor's "
                f"to_local: {str(exc).splitlines()[0][:80]}); kept replicated")
    if wants[0].is_meta:  # no data (a dry run of a large model): the split must still run
        return "" if got.shape == wants[0].shape else \
            f"a {tp}-way split changes its output shape"
    why = _split_changes(wants, got, others, tp, "")
    if why:
        return why
    # and in training mode, where its code may take another path (a review: a head-mixing
    # step under `if self.training` was split, gradients 0.33 off); a mixer that draws
    # random numbers there (dropout: another draw per run) is checked in eval mode only
    # (one run when training computes what eval does: the eval-mode check stands)
    evaluated = wants
    reference.train()
    try:
        trained = _split_outputs(reference, [], args, kwargs)[0]
        if len(trained) == len(evaluated) and all(
                a.shape == b.shape and torch.equal(a, b) for a, b in zip(trained, evaluated)):
            return ""
        wants, got, others = _split_outputs(reference, shards, args, kwargs)
        why = _split_changes(wants, got, others, tp, " in training mode")
        if why and not torch.equal(_split_outputs(reference, [], args, kwargs, seed=1)[0][0],
                                   wants[0]):
            return ""  # another draw per run: a random mixer (dropout) is checked in eval only
    except Exception as exc:
        return (f"in training mode a {tp}-way column/row split of it fails to run "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); kept replicated")
    return why


def _split_outputs(reference: nn.Module, shards: list[nn.Module], args: tuple, kwargs: dict,
                   seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor,
                                           list[tuple[int, torch.Tensor]]]:
    """(``reference``'s output tensors, the sum of the ``shards``' first outputs, the
    shards' other outputs by position), every run from RNG seed ``seed``, in the reference's
    mode (train / eval)."""
    def run(module: nn.Module) -> list[torch.Tensor]:
        module.train(reference.training)
        device = next((t.device for t in (*args, *kwargs.values())
                       if isinstance(t, torch.Tensor)), torch.device("cpu"))
        with _forked_rng(device), torch.no_grad():
            torch.manual_seed(seed)
            return _tensors(module(*args, **kwargs))

    wants = run(reference)
    got = torch.zeros_like(wants[0])
    others: list[tuple[int, torch.Tensor]] = []
    for shard in shards:
        outs = run(shard)
        got += outs[0]
        others += list(enumerate(outs[1:], 1))
    return wants, got, others


def _shards(reference: nn.Module, path: str, readers: list[str], writer: str,
            tp: int) -> list[nn.Module]:
    """``tp`` copies of ``reference``, each with its rank's slice of the readers and writer."""
    import copy

    shards = []
    for rank in range(tp):
        shard = copy.deepcopy(reference)
        _slice_shard(shard, path, readers, writer, rank, tp)
        shards.append(shard)
    return shards


def _split_changes(wants: list[torch.Tensor], got: torch.Tensor,
                   others: list[tuple[int, torch.Tensor]], tp: int, when: str) -> str:
    want = wants[0]
    scale = float(want.abs().max()) or 1.0
    error = float((got - want).abs().max()) / scale if got.shape == want.shape else math.inf
    if not error <= 1e-6:
        return (f"a {tp}-way column/row split of it changes its output{when} (relative error "
                f"{error:.2g}): it mixes what the split separates; kept replicated")
    for k, out in others:
        # TP reduces the writer's output only: another output of the same shape (an
        # activation penalty, a review: every gradient 0.047 off) must come out whole on
        # every rank; per-head ones (attention weights: another shape) hold this rank's heads
        if k < len(wants) and out.shape == wants[k].shape and out.dtype == wants[k].dtype \
                and not torch.allclose(out, wants[k], rtol=1e-6, atol=1e-12, equal_nan=True):
            return (f"a {tp}-way column/row split changes its output {k}{when} (TP reduces "
                    "only the first, the writer's); kept replicated")
    return ""


class _LocalView(torch.autograd.Function):
    """What a ColwiseParallel Linear hands its caller: a view made by a custom autograd
    Function (DTensor's ``to_local``); writing it in place raises in autograd."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _run_with_local_views(shard: nn.Module, path: str, readers: list[str], args: tuple,
                          kwargs: dict) -> None:
    """Run ``shard`` with grad enabled and its readers' outputs made views as TP makes
    them (:class:`_LocalView`): RuntimeError when the mixer writes one in place."""
    handles = [module.register_forward_hook(lambda m, a, out: _LocalView.apply(out))
               for name, module in shard.named_modules()
               if (f"{path}.{name}" if name else path) in readers]
    try:
        with torch.enable_grad():
            shard(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()


def _tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _slice_shard(shard: nn.Module, path: str, readers: list[str], writer: str, rank: int,
                 tp: int) -> None:
    """Keep ``rank``'s rows of each reader and columns of the writer (bias once, rank 0)."""
    for name, module in shard.named_modules():
        full = f"{path}.{name}" if name else path
        if full in readers:
            rows = module.out_features // tp
            part = slice(rank * rows, (rank + 1) * rows)
            module.weight = nn.Parameter(module.weight[part].clone())
            if module.bias is not None:
                module.bias = nn.Parameter(module.bias[part].clone())
            module.out_features = rows
        elif full == writer:
            cols = module.in_features // tp
            module.weight = nn.Parameter(module.weight[:, rank * cols:(rank + 1) * cols].clone())
            if module.bias is not None and rank:
                module.bias = nn.Parameter(torch.zeros_like(module.bias))
            module.in_features = cols


def _lm_head(modules: dict[str, nn.Module], recorder: _Recorder) -> str | None:
    """The output projection: the last Linear to run, if it maps to the vocabulary (the
    size of an nn.Embedding)."""
    vocab = {m.num_embeddings for m in modules.values() if isinstance(m, nn.Embedding)}
    linears = [p for p in recorder.order if isinstance(modules.get(p), nn.Linear)]
    if linears and getattr(modules[linears[-1]], "out_features", None) in vocab:
        return linears[-1]
    return None


def _vocab_parallel(layout: TPLayout, modules: dict[str, nn.Module],
                    recorder: _Recorder) -> None:
    head_path = _lm_head(modules, recorder)
    if head_path is None:
        return
    head = modules[head_path]
    embeds = [p for p, m in modules.items() if isinstance(m, nn.Embedding)
              and m.num_embeddings == getattr(head, "out_features", -1)]
    if len(embeds) != 1:
        return
    if modules[embeds[0]].weight is head.weight:
        layout.kept[head_path] = "tied to the token embedding: both stay replicated"
        return
    extra = [n for n, _ in modules[embeds[0]].named_parameters() if n != "weight"]
    if extra:  # DTensor's vocab-parallel embedding shards every parameter it holds
        layout.kept[embeds[0]] = (f"an embedding holding more than its table ({extra[0]}, "
                                  "e.g. Inkling's normed embedding): it and the LM head "
                                  "stay replicated")
        return
    layout.lm_head, layout.embedding = head_path, embeds[0]
    layout.vocab = int(getattr(head, "out_features", 0))


def _replicated_readers(layout: TPLayout, modules: dict[str, nn.Module],
                        recorder: _Recorder, norm_out: set[int]) -> None:
    """Modules of a layer that holds norms, reading a norm's output, not split by TP: an
    MoE block (its router is no nn.Linear), a mixer kept replicated. The outermost one of
    a nest counts (a child reading the same tensor is inside it)."""
    norm_parents = {_parent(p) for p, m in modules.items() if _is_norm(m)}
    found: dict[str, tuple[CallSite, int]] = {}
    for path, module in modules.items():
        if isinstance(module, nn.Linear) or _is_norm(module) or path in layout.mixers \
                or _parent(path) not in norm_parents or not path:
            continue
        site = recorder.call_site(path, norm_out)
        if site is not None and not any(path.startswith(f + ".") for f in found):
            found[path] = (site, recorder.arity.get(path, 0))
    layout.replicated = found
    layout.written_in_place = [p for p in found if any(
        t._version != v for t, v in recorder.versions.get(p, []))]


def _layers_and_norms(layout: TPLayout, modules: dict[str, nn.Module],
                      recorder: _Recorder) -> None:
    """Decoder layers = parents of the sharded mixers and of the replicated readers; SP
    norms = their norms + final norm."""
    layers = sorted({_parent(m) for m in (*layout.mixers, *layout.replicated)}, key=_natural)
    for layer in layers:
        args, kwargs = recorder.inputs.get(layer, ([], {}))
        if args and args[0]:
            layout.layers[layer] = CallSite(position=0)
        elif "hidden_states" in kwargs:
            layout.layers[layer] = CallSite(keyword="hidden_states")
        layout.norms += [p for p, m in modules.items() if _is_norm(m) and _parent(p) == layer]
    stacks = {_parent(layer) for layer in layers}  # e.g. model.layers
    outer = {_parent(stack) for stack in stacks}  # e.g. model: its norm is the final one
    layout.norms += [p for p, m in modules.items() if _is_norm(m) and _parent(p) in outer
                     and p in recorder.outputs]


def _sp_problems(layout: TPLayout, modules: dict[str, nn.Module], recorder: _Recorder,
                 norm_out: set[int], tp: int) -> list[str]:
    """Why SP (the residual stream split over the sequence from the first decoder layer's
    input to the LM head's) would change what the model computes; [] when nothing does.
    Each case is a review's silent wrong result or crash on a hand-written model:

    - a decoder layer object that runs more than once per forward (ALBERT-style sharing):
      its input hook shards the shard (8 logits for 16 tokens);
    - the normalized stream passed to one mixer twice (``attn(h, xkv=h)``): only one
      argument is gathered (logits 0.53 off) or torch's hook fails;
    - a split mixer's parameter after its writer (a LayerScale gain,
      :attr:`TPLayout.after_writer`), or a module with parameters between the layers or
      between the final norm and the LM head (a projection): each rank's gradient covers its
      sequence shard only (0.66-0.76 off, the loss exact);
    - a layer whose code outside its mixers is not per position (positions computed from
      the shard's length, a convolution over the sequence): :func:`_sequence_local`."""
    problems = []
    for layer in layout.layers:
        runs = recorder.started.count(layer)
        if runs > 1:
            problems.append(f"decoder layer {layer} runs {runs} times per forward (one module "
                            "shared across depth): SP's input hook would split its input at "
                            "every call")
    for path in (*layout.mixers, *layout.replicated):
        if recorder.uses(path, norm_out) > 1:
            problems.append(f"{path} takes the normalized hidden states in more than one "
                            "argument: SP gathers one of them")
    problems += [f"{name} runs after its mixer's row-parallel output, which SP leaves split "
                 "over the sequence: its gradient would cover one shard per rank"
                 for name in layout.after_writer]
    layers = list(layout.layers)
    if layers and layout.lm_head is not None:
        index = {p: i for i, p in reversed(list(enumerate(recorder.started)))}  # first call
        begin, end = index.get(layers[0], 0), index.get(layout.lm_head, len(index))
        inside = (*layers, layout.lm_head, *layout.norms)
        for path, i in index.items():
            if begin < i < end and not any(path == h or path.startswith(h + ".")
                                           for h in inside) \
                    and any(True for _ in modules[path].parameters(recurse=False)):
                problems.append(f"{path} has parameters and runs on the residual stream "
                                "between the decoder layers and the LM head, which SP splits "
                                "over the sequence: its gradient would cover one shard per "
                                "rank")
    problems += _inputs_written_in_training(layout, modules, recorder)
    if not problems:
        problems += _sequence_local(layout, modules, recorder, tp)
    return problems


def splits_nothing(layout: TPLayout | None, tp: int) -> str:
    """Why TP of degree ``tp`` splits nothing of a model ("" when it splits something):
    ``layout`` (None: a model whose decoder layers hold no nn.Linear, known without
    deriving one) has no split mixer and no vocabulary-parallel head, so every TP rank
    computes and holds the whole model (a review: GPT-2's Conv1D projections; tp=2 ran the
    whole model on both ranks, and "auto" picked it priced as split)."""
    if layout is not None and (layout.mixers or layout.lm_head is not None):
        return ""
    kept = next(iter(layout.kept.items()), None) if layout is not None else None
    why = (f"{kept[0]} is kept whole: {kept[1]}" + (
        f" ({len(layout.kept) - 1} more in derive_tp_layout(...).kept)"
        if layout is not None and len(layout.kept) > 1 else "") + "; ") if kept else ""
    return (f"TP={tp} splits nothing in this model: {why}TP splits an nn.Linear pair reading "
            "a normalization module's output (projections that are no nn.Linear, e.g. "
            "GPT-2's Conv1D, are not split), so every TP rank computes the whole model; use "
            "tp=1")


def _no_cache(kwargs: dict[str, Any], value: Callable[[Any], Any] = lambda v: v
              ) -> dict[str, Any]:
    """Recorded keyword arguments for a replay: a KV cache dropped (a replay must not
    update it), every other value through ``value``."""
    return {k: None if "cache" in type(v).__name__.lower() else value(v)
            for k, v in kwargs.items()}


def _forked_rng(device: torch.device) -> Any:
    """``torch.random.fork_rng`` of the CPU and, on CUDA, ``device``'s generator."""
    return torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda"
                                 else [])


def _inputs_written_in_training(layout: TPLayout, modules: dict[str, nn.Module],
                                recorder: _Recorder) -> list[str]:
    """The mixers and replicated readers (what SP hands a gathered sequence) that write an
    input in place in training mode: autograd forbids that on the view SP's gather returns
    (a review: Mixtral's ``router_jitter_noise``, ``hidden_states *= noise`` under
    ``self.training``, crashed every training step under SP, while the layout, derived in
    eval mode, saw nothing). Each is run once on copies of its recorded inputs, in training
    mode, without gradients, its random state and buffers put back afterwards."""
    found = []
    for path in (*layout.mixers, *layout.replicated):
        call = recorder.calls.get(path)
        module = modules[path]
        if call is None:  # (a meta-device model runs in the fake trace: versions count there)
            continue
        args, kwargs = call
        copies = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
        kw = _no_cache(kwargs, lambda v: v.detach().clone() if isinstance(v, torch.Tensor)
                       else v)
        tensors = [t for t in (*copies, *kw.values()) if isinstance(t, torch.Tensor)]
        versions = [t._version for t in tensors]
        buffers = [(b, b.detach().clone()) for b in module.buffers()]
        modes = [(m, m.training) for m in module.modules()]
        device = next((t.device for t in tensors), torch.device("cpu"))
        try:
            module.train()
            with _forked_rng(device), torch.no_grad():
                module(*copies, **kw)
        except Exception:  # noqa: BLE001 - its training path is the probes' business
            continue
        finally:
            for m, mode in modes:
                m.training = mode
            with torch.no_grad():
                for b, value in buffers:
                    b.copy_(value)
        if any(t._version != v for t, v in zip(tensors, versions)):
            found.append(f"{path} writes its input in place in training mode (e.g. Mixtral's "
                         "router_jitter_noise), which autograd forbids on the sequence SP "
                         "gathers for it")
    return found


def _sequence_local(layout: TPLayout, modules: dict[str, nn.Module], recorder: _Recorder,
                    tp: int) -> list[str]:
    """Run each decoder layer on its recorded input, whole and split into ``tp`` sequence
    shards, with its mixers and replicated readers (what SP gathers for) replaced by one
    per-position function of their input: SP is right only if the shards' outputs are the
    whole's. A review's layer added sinusoidal positions computed from ``x.shape[1]``
    outside its mixers: under SP rank 1 labelled positions 8..15 as 0..7 (loss 2e-3 and
    every gradient up to 0.19 off, silently). The check is structural (float inputs as
    recorded, relative error 1e-6; 16-bit models 1e-2). A layer of a meta-device model
    runs as a materialized copy with random values (:func:`_materialized`), or not at all
    above ``PROBE_PARAMETERS`` (``layout.unchecked``)."""
    gathered = {**layout.mixers, **{p: site for p, (site, _) in layout.replicated.items()}}
    problems = []
    for layer, site in layout.layers.items():
        call = recorder.calls.get(layer)
        if call is None:
            continue
        module = modules[layer]
        returned = recorder.returned
        context: Any = contextlib.nullcontext()
        if any(p.is_meta for p in module.parameters()):
            real = _materialized(module)
            if real is None:
                layout.unchecked.append(layer)
                continue
            module = real
            gen = torch.Generator().manual_seed(2)
            call = _with_values(call, gen)
            returned = {p: (_with_values(leaves, gen), spec)
                        for p, (leaves, spec) in returned.items() if p.startswith(layer + ".")}
            context = _outside_trace()
        args, kwargs = call
        x = args[site.position] if site.position is not None else kwargs.get(site.keyword or "")
        if not isinstance(x, torch.Tensor) or x.dim() < 3 or x.shape[1] % tp \
                or not x.is_floating_point():
            continue
        kwargs = _no_cache(kwargs)
        mine = [p for p in gathered if p.startswith(layer + ".") and p in returned]
        subs = {p: module.get_submodule(p[len(layer) + 1:]) for p in mine}
        for p in mine:  # instead of its forward (which reads full-length position tables)
            subs[p].forward = _per_position(gathered[p], *returned[p])
        try:
            with context, torch.no_grad(), eval_mode(module):
                whole = _run_layer(module, site, args, kwargs, x)
                parts = torch.cat([_run_layer(module, site, args, kwargs,
                                              c.contiguous())  # as SP hands it over
                                   for c in x.chunk(tp, dim=1)], dim=1)
                tol = 1e-2 if whole.element_size() < 4 else 1e-6
                scale = float(whole.abs().max()) or 1.0
                error = float((parts - whole).abs().max()) / scale \
                    if parts.shape == whole.shape else math.inf
        except Exception as exc:  # noqa: BLE001 - a layer that cannot run on a shard
            problems.append(f"decoder layer {layer} does not run on a sequence shard "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0][:100]})")
            continue
        finally:
            for p in mine:
                del subs[p].forward
        if not error <= tol:
            problems.append(f"decoder layer {layer} computes something else on a sequence "
                            f"shard outside its mixers (relative error {error:.2g}): its "
                            "code mixes positions or depends on where they are (e.g. "
                            "positions from the shard's length)")
    return problems


def _run_layer(layer: nn.Module, site: CallSite, args: tuple, kwargs: dict,
               hidden: torch.Tensor) -> torch.Tensor:
    """``layer``'s first output with ``hidden`` as its hidden-state argument (``site``)."""
    a, k = list(args), dict(kwargs)
    if site.position is not None:
        a[site.position] = hidden
    else:
        k[site.keyword or ""] = hidden
    return _tensors(layer(*a, **k))[0]


def _per_position(site: CallSite, leaves: list[Any], spec: Any) -> Callable[..., Any]:
    """A forward returning, in place of the module's first output (recorded as ``leaves`` /
    ``spec``), tanh(x @ R) of its hidden-state input x (argument ``site``), R fixed, and its
    other outputs as recorded: a per-position stand-in for what SP computes there on the
    gathered sequence and hands back split."""
    k = next(i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor))

    def forward(*args: Any, **kwargs: Any) -> Any:
        x = args[site.position] if site.position is not None else kwargs[site.keyword or ""]
        gen = torch.Generator(device="cpu").manual_seed(0)
        r = torch.randn(x.shape[-1], leaves[k].shape[-1], generator=gen, dtype=torch.float64)
        out = list(leaves)
        out[k] = torch.tanh(x.double() @ r.to(x.device)).to(leaves[k].dtype)
        return torch.utils._pytree.tree_unflatten(out, spec)
    return forward


def sequence_sharded_params(model: nn.Module, layout: TPLayout) -> list[str]:
    """Parameters of SP's decoder layers that act on the sequence-split residual stream
    outside the modules SP handles (mixers, norms, replicated readers): Doge's
    ``input_residual`` (``param * residual``), a convolution over the stream. Each TP rank
    would compute their gradient from its sequence shard alone, and nothing sums the shards
    (a review: relative gradient errors 0.8-0.96 on Doge with tp=2 + SP, no error)."""
    handled = (*layout.mixers, *layout.norms, *layout.replicated, *layout.head_norms)
    modules = dict(model.named_modules())
    return [f"{layer}.{name}" if layer else name for layer in layout.layers
            for name, _ in modules[layer].named_parameters()
            if not any(f"{layer}.{name}".startswith(h + ".") for h in handled)]


def sequence_reducing_modules(model: nn.Module, layout: TPLayout) -> list[str]:
    """Modules of SP's decoder layers outside the modules SP handles that compute
    statistics over their input's batch or sequence (BatchNorm, InstanceNorm, GroupNorm on
    a [B, C, S] view): under SP each TP rank would normalize by its sequence shard (a
    review: a parameter-free BatchNorm on the residual stream, gradients 2.9e-2 off one
    process; with parameters :func:`sequence_sharded_params` refused it)."""
    handled = (*layout.mixers, *layout.norms, *layout.replicated, *layout.head_norms)
    modules = dict(model.named_modules())
    reducing = (nn.modules.batchnorm._NormBase, nn.GroupNorm)
    return [f"{layer}.{name}" if layer else name for layer in layout.layers
            for name, m in modules[layer].named_modules()
            if name and isinstance(m, reducing) and
            not any(f"{layer}.{name}".startswith(h + ".") or f"{layer}.{name}" == h
                    for h in handled)]


def _natural(path: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in path.split(".")]


def _check_divisible(layout: TPLayout, model: nn.Module, tp: int) -> None:
    """Heads, KV heads and the vocabulary (a mixer's projection sizes tp does not divide are
    kept whole: ``TPLayout.indivisible``)."""
    config = getattr(model, "config", None)
    problems = []
    for name in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value % tp:
            problems.append(f"{name} ({value}) is not divisible by tp ({tp})")
    if layout.vocab is not None and layout.vocab % tp:
        problems.append(f"the vocabulary ({layout.vocab}) is not divisible by tp ({tp}); pad "
                        "the embedding to a multiple of tp")
    if problems:
        raise ConfigError("tensor parallelism cannot split this model: " + "; ".join(problems)
                          + ". Choose a tp that divides them (graphopt plan checks the "
                          "heads only; parallel='auto' checks the KV heads and vocabulary "
                          "too), or tp=1")
