"""Shared lowering machinery: the callbacks into graphopt and the AOTAutograd driver."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import fx
from torch._dynamo.backends.common import aot_autograd

from graphopt.config import GraphoptConfig

GraphCompiler = Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]]


@dataclass
class AOTHooks:
    """What a lowering calls back: joint passes, and "this graph is final" for dumps/report."""

    run_joint: Callable[[fx.GraphModule, str], fx.GraphModule]
    """Run the joint-stage passes on a graph of kind "joint" or "inference"."""
    graph_ready: Callable[[str, fx.GraphModule], None]
    """Called with kind "joint" | "forward" | "backward" | "inference" before compiling it."""
    add_time: Callable[[str, float], None]
    note: Callable[[str], None] = lambda _: None
    """Add a note to the compile report."""
    timed_done: Callable[[str], None] = lambda _: None
    """Called with the key once a :meth:`timed` step's time is added (the pipeline writes
    the dumped report again after the lazy backward's compile)."""

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add_time(key, time.perf_counter() - start)
            self.timed_done(key)


def lowering_key(kind: str) -> str:
    """The report's timing key for compiling a graph of ``kind``: "lowering_backward" for
    the backward, which AOTAutograd compiles lazily at the first backward, after the
    report's "total" (the forward side) was taken (added into "lowering" it made lowering
    exceed total, a review), else "lowering"."""
    return "lowering_backward" if kind == "backward" else "lowering"


class Lowering(ABC):
    """Compiles the model-pass output (a pre-autograd ATen graph) into a callable."""

    name: ClassVar[str]

    @abstractmethod
    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], hooks: AOTHooks,
                config: GraphoptConfig) -> Callable[..., Any]:
        """Return the compiled callable (Dynamo calls it with the flat inputs)."""


class AOTLowering(Lowering):
    """Runs graphopt's own AOTAutograd call; subclasses give the graph compiler."""

    @abstractmethod
    def graph_compiler(self, config: GraphoptConfig) -> GraphCompiler:
        """Compiles one forward, backward or inference graph (boxed-callable convention)."""

    def partition(self, joint: fx.GraphModule, joint_inputs: Sequence[Any],
                  **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Split the joint graph with AOTAutograd's min-cut partitioner, as
        ``backend="aot_eager"`` and Inductor do: cheap ops (views, pointwise, index
        arithmetic) the backward reads are recomputed there rather than saved, so the eager
        lowering keeps what aot_eager keeps and the two compare like for like. After the
        remat pass tagged the nodes (``CheckpointPolicy`` MUST_SAVE / MUST_RECOMPUTE) the
        same partitioner applies the tags."""
        return min_cut_partition(joint, joint_inputs, **kwargs)

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], hooks: AOTHooks,
                config: GraphoptConfig) -> Callable[..., Any]:
        compiler = self.graph_compiler(config)

        def for_kind(kind: str) -> GraphCompiler:
            def compile_one(g: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
                if kind == "inference":
                    g = hooks.run_joint(g, "inference")
                hooks.graph_ready(kind, g)
                with hooks.timed(lowering_key(kind)):
                    return compiler(g, inputs)
            return compile_one

        mark_mutated = mutated_input_marker(gm)
        mark_inputs = input_marker(example_inputs)

        def partition(joint: fx.GraphModule, joint_inputs: Sequence[Any],
                      **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
            mark_mutated(joint)
            mark_inputs(joint)
            joint.meta[PARTITION_ARGS] = (joint_inputs, kwargs)
            joint = hooks.run_joint(joint, "joint")
            hooks.graph_ready("joint", joint)
            forward, backward = self.partition(joint, joint_inputs, **kwargs)
            from graphopt.passes.remat import offloads_kept_on_device, partition_claim_note

            for note in (offloads_kept_on_device(joint, forward), pre_mutation_note(forward),
                         partition_claim_note(joint, forward, kwargs.get("num_fwd_outputs"))):
                if note:
                    hooks.note(note)
            return forward, backward

        # Dynamo's own AOTAutograd backend wrapper, as aot_eager uses it: it counts the call
        # (DDPOptimizer reads that count to consume the fake outputs AOTAutograd returns on a
        # split graph's first call; without it the first real call of a DDP model returned
        # FakeTensors), keeps Dynamo out of the backward compiler, and flattens compiled
        # autograd's list inputs (the primals then no longer match gm's placeholders one to
        # one, so the mutation marker marks every primal: safe)
        try:
            return aot_autograd(  # type: ignore[no-any-return]
                fw_compiler=for_kind("forward"), bw_compiler=for_kind("backward"),
                inference_compiler=for_kind("inference"), partition_fn=partition,
                # as aot_eager and compile_fx: an input mutation (BatchNorm's running
                # stats) stays in the graph; in the runtime epilogue it ran after a
                # checkpoint region had saved the inputs, and the backward refused their
                # versions
                keep_inference_input_mutations=True,
            )(gm, list(example_inputs))
        except RecursionError as exc:
            if dtensor_with_symbolic_shapes(example_inputs):
                raise RuntimeError(
                    "torch's AOTAutograd recursed without end tracing a graph of DTensors "
                    "with dynamic shapes (a known torch limitation: pytorch/pytorch#152954, "
                    "#152963; backend='aot_eager' fails the same way): compile with "
                    "dynamic=False (graphopt.compile does so for tp > 1 unless 'dynamic' is "
                    "given), or pad batches to a fixed sequence length") from exc
            raise


def dtensor_with_symbolic_shapes(inputs: Sequence[Any]) -> bool:
    """Whether some input is a DTensor and some input's shape (or an input itself) is
    symbolic."""
    import torch
    from torch.distributed.tensor import DTensor

    def symbolic(x: Any) -> bool:
        if isinstance(x, torch.SymInt):
            return True
        return isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt)
                                                   for d in x.shape)

    return any(isinstance(x, DTensor) for x in inputs) and any(map(symbolic, inputs))


PARTITION_ARGS = "graphopt_partition_args"
"""Joint-graph meta set before the joint passes run: (joint_inputs, kwargs) of the
partitioner call that follows, so a pass can partition a copy (the remat pass measures what
the partitioner saves without it: :func:`partitioner_saved`)."""


def partitioner_saved(joint: fx.GraphModule, cse_done: bool = False
                      ) -> list[fx.Node] | None:
    """The values (activations and primal inputs) that :func:`min_cut_partition` saves for the
    backward of an untagged copy of ``joint``: what compiling without the remat pass saves
    (PyTorch recomputes cheap ops itself); None without :data:`PARTITION_ARGS`.
    ``cse_done``: ``joint`` went through the partitioner's CSE already (the remat pass runs
    it first), so the partition of the copy skips it (1.4 of 7 s on a 32-layer Llama)."""
    import torch._functorch.partitioners as partitioners
    from torch._functorch import config as functorch_config

    from graphopt.pipeline import copy_graph_module

    args = joint.meta.get(PARTITION_ARGS)
    if args is None:
        return None
    joint_inputs, kwargs = args
    choose = getattr(partitioners, "choose_saved_values_set", None)
    rng = getattr(partitioners, "has_recomputable_rng_ops", None)
    copy = copy_graph_module(joint)
    if choose is not None and rng is not None and not rng(copy):
        # stop at the min-cut's choice: extracting and recompiling the forward and backward
        # graphs took more than half the time (5 of 9 s on a 32-layer Llama joint graph),
        # and only the choice is needed. Not when random ops are recomputed (dropout in a
        # user checkpoint region): the extraction then adds the RNG states it saves
        chosen: list[Any] = []

        def record(*a: Any, **k: Any) -> Any:
            chosen.extend(choose(*a, **k))
            raise _Chosen

        partitioners.choose_saved_values_set = record
        try:
            with functorch_config.patch(cse=functorch_config.cse and not cse_done):
                forward, _ = min_cut_partition(copy, joint_inputs, **kwargs)
        except _Chosen:
            return [n for n in chosen if isinstance(n, fx.Node)]
        finally:
            partitioners.choose_saved_values_set = choose
    else:  # the whole partition
        forward, _ = min_cut_partition(copy, joint_inputs, **kwargs)
    outputs: Any = forward.graph.output_node().args[0]
    return [n for n in outputs[kwargs.get("num_fwd_outputs", 0):] if isinstance(n, fx.Node)]


class _Chosen(Exception):
    """Stops :func:`partitioner_saved`'s partition once the min-cut chose what to save."""


def min_cut_partition(joint: fx.GraphModule, joint_inputs: Sequence[Any],
                      **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """AOTAutograd's ``min_cut_rematerialization_partition``, after tagging every forward
    value that reads an input the graph mutates (``fx_utils.readers_of_mutated_inputs``)
    ``CheckpointPolicy.MUST_SAVE`` where nothing tagged it: min-cut otherwise recomputes such
    a value in the backward from the input after its in-place update (e.g. ``shift`` in
    ``sin(x + self.shift); self.shift.add_(1)``), which gives wrong gradients with
    ``backend="aot_eager"`` and Inductor in torch 2.13, or a version-counter error. Such an
    input the backward reads itself is saved as a copy taken before the write
    (:func:`save_pre_mutation_values`). Its CSE leaves every random op unmerged
    (:func:`graphopt.passes.fx_utils.random_ops_kept`)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.utils.checkpoint import CheckpointPolicy

    from graphopt.passes.fx_utils import random_ops_kept, readers_of_mutated_inputs
    from graphopt.passes.remat import split_joint

    readers = readers_of_mutated_inputs(joint.graph)
    if readers:
        for node in split_joint(joint)[0]:
            if node in readers and node.meta.get("recompute") is None:
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    with random_ops_kept(joint.graph):  # its CSE merged identical random draws
        forward, backward = min_cut_rematerialization_partition(joint, joint_inputs,
                                                                **kwargs)
    save_pre_mutation_values(forward, backward, kwargs.get("num_fwd_outputs"))
    return forward, backward


PRE_MUTATION_COPIES = "graphopt_pre_mutation_copies"
"""Partitioned forward meta: {written input's name: bytes of the copy saved for the
backward} (:func:`save_pre_mutation_values`; the report notes them)."""


def pre_mutation_note(forward: fx.GraphModule) -> str:
    """The report's note on the copies :func:`save_pre_mutation_values` added ("" if none):
    memory the remat plan, priced on the joint graph before them, does not count (a review:
    remat claimed 16384 bytes saved where autograd held 16640 under Inductor)."""
    copies = forward.meta.get(PRE_MUTATION_COPIES)
    if not copies:
        return ""
    return (f"the forward saves a copy of {len(copies)} input(s) it writes in place and the "
            f"backward reads ({', '.join(copies)}: {sum(copies.values())} bytes), taken "
            "before the write; not counted in remat's saved bytes")


def save_pre_mutation_values(forward: fx.GraphModule, backward: fx.GraphModule,
                             num_fwd_outputs: Any) -> list[str]:
    """Make the partitioned ``forward`` save a copy (``aten.clone``, taken where the value
    is defined, before the forward's writes) of every value it saves for ``backward`` that
    is a graph input the graph writes in place, or a view of one; returns the names of the
    values replaced.

    Saving such an input saves the tensor the forward then overwrites (its ``copy_``
    epilogue, or the runtime's copy after the graph), so the backward reads the updated
    value: MUST_SAVE on the readers (:func:`min_cut_partition`) does not help when the
    backward reads the input itself, as in ``h * self.ema.clone(); self.ema.mul_(0.5)``
    under Inductor, whose joint-graph ``remove_noop_ops`` drops the ``clone`` before the
    partitioner runs (the backward's ``grad * ema`` then read ``primals_4`` after the
    ``copy_``: l1's gradients 50% off, a review). Done on the partitioned graphs, after
    min-cut chose: a copy made in the joint graph that only the backward reads is
    "unclaimed" there and would be computed in the backward, from the updated input. The
    copy is a forward output next to its input, which Inductor's post-grad
    ``remove_noop_ops`` keeps (it introduces no input/output alias). The number and order
    of the saved values do not change; the backward's placeholder keeps its name.

    Inputs are those the forward writes (:func:`graphopt.passes.fx_utils.mutated_nodes`)
    or the lowering marked ``MUTATED_INPUT`` (a write the runtime does after the graph),
    not those marked only because the marker could not match the inputs
    (``MUTATED_INPUT_GUESSED``: copying every parameter the backward reads would double
    their memory). An input the backward reads only to recompute the user's checkpoint
    region is not copied: eager's recomputation reads it after the write, and graphopt
    matches eager there (:func:`_only_checkpoint_recomputes`)."""
    import torch

    from graphopt.passes.fx_utils import (
        MUTATED_INPUT,
        MUTATED_INPUT_GUESSED,
        alias_classes,
        is_mutating,
        mutated_nodes,
    )

    if not isinstance(num_fwd_outputs, int):
        return []
    graph = forward.graph
    output = graph.output_node()
    outputs = output.args[0]
    if not isinstance(outputs, (list, tuple)):
        return []
    classes = alias_classes(graph)
    written = mutated_nodes(graph, classes)
    placeholders = list(graph.find_nodes(op="placeholder"))
    dirty = {classes[p] for p in placeholders if p in written or (
        p.meta.get(MUTATED_INPUT) and not p.meta.get(MUTATED_INPUT_GUESSED))}
    if not dirty:
        return []
    copies: dict[fx.Node, fx.Node] = {}
    new_outputs = list(outputs)
    held = {p.name: p for p in backward.graph.find_nodes(op="placeholder")}
    for i in range(num_fwd_outputs, len(new_outputs)):
        value = new_outputs[i]
        if not isinstance(value, fx.Node) or classes.get(value) not in dirty or \
                not isinstance(value.meta.get("val"), torch.Tensor) or \
                (value.op != "placeholder" and is_mutating(value)) or \
                _only_checkpoint_recomputes(held.get(value.name)):
            continue
        if value not in copies:
            with graph.inserting_after(placeholders[-1] if value.op == "placeholder"
                                       else value):
                copy = graph.call_function(torch.ops.aten.clone.default, (value,))
            copy.meta["val"] = torch.ops.aten.clone.default(value.meta["val"])
            copies[value] = copy
        new_outputs[i] = copies[value]
    if not copies:
        return []
    output.args = (type(outputs)(new_outputs),)
    forward.recompile()
    from graphopt.passes.remat import _bytes

    forward.meta[PRE_MUTATION_COPIES] = {v.name: _bytes(c) for v, c in copies.items()}
    for value, copy in copies.items():
        ph = held.get(value.name)
        if ph is not None and ph.meta.get("val") is not None and \
                ph.meta["val"].stride() != copy.meta["val"].stride():
            ph.meta = {**ph.meta, "val": copy.meta["val"]}  # (shared with the joint's)
    return [v.name for v in copies]


def _only_checkpoint_recomputes(placeholder: fx.Node | None) -> bool:
    """Whether every backward reader of ``placeholder`` recomputes a node of the user's
    checkpoint region (``ac_graph_id``, set by ``torch.utils.checkpoint`` under
    torch.compile): eager's recomputation reads the input as it is then, after the
    forward's write, and graphopt keeps that (a copy taken before the write made a nested
    region's gradient half eager's: tests/test_pass_regions.py)."""
    return placeholder is not None and bool(placeholder.users) and all(
        user.meta.get("ac_graph_id") is not None for user in placeholder.users)


def mutated_input_marker(gm: fx.GraphModule) -> Callable[[fx.GraphModule], None]:
    """A function that sets ``meta[MUTATED_INPUT]`` on the joint graph's primal
    placeholders whose input ``gm`` (the graph handed to AOTAutograd) writes in place,
    directly or through a view (``fx_utils.mutated_nodes``). AOTAutograd functionalizes
    those writes: the joint graph returns the new value and the runtime copies it into the
    input after the forward, so nothing in the joint graph says which primal changes.
    Primals are matched to ``gm``'s placeholders from the end (AOTAutograd puts lifted
    parameters and effect tokens first), checked by shape and dtype; when the match fails
    or a ``get_attr`` is written, every primal is marked (nothing read from an input is
    recomputed: safe, and only costs memory)."""
    from graphopt.passes.fx_utils import MUTATED_INPUT, MUTATED_INPUT_GUESSED, mutated_nodes

    written = mutated_nodes(gm.graph)
    inputs = list(gm.graph.find_nodes(op="placeholder"))
    flags = [n in written for n in inputs]
    unknown = any(n.op == "get_attr" for n in written)

    def mark(joint: fx.GraphModule) -> None:
        if not any(flags) and not unknown:
            return
        groups = None if unknown else _matching_primals(
            joint, [i.meta.get("example_value", i.meta.get("val")) for i in inputs])
        if groups is None:  # every primal: which one is written is not known
            for p in _primals(joint):
                p.meta[MUTATED_INPUT] = p.meta[MUTATED_INPUT_GUESSED] = True
            return
        for group, flag in zip(groups, flags):
            for p in group if flag else ():
                p.meta[MUTATED_INPUT] = True

    return mark


NOT_A_PARAMETER = "graphopt_input_not_a_parameter"
"""Joint-graph placeholder meta set by :func:`input_marker`: the input is not an
``nn.Parameter`` (the batch, a buffer, or after a graph break the previous graph's
activation), so the backward holding it may keep it alive longer than anything else does."""


def input_marker(example_inputs: Sequence[Any]) -> Callable[[fx.GraphModule], None]:
    """A function that sets ``meta[NOT_A_PARAMETER]`` on the joint graph's primal
    placeholders whose example input is a tensor and not an ``nn.Parameter`` (parameters
    live as long as the model). Whether the input has a ``grad_fn`` (another graph's
    activation) is not used: Dynamo does not guard on it, so a graph compiled for a leaf
    ran on activations unpriced (a review: 98,304 bytes held against a claim of 32,768);
    it guards on the tensor's type. A tensor subclass input (a DTensor activation under
    TP/SP) marks the plain tensors AOTAutograd unwraps it into. Matched as
    :func:`mutated_input_marker` matches; nothing is marked when the match fails (the remat
    pass then prices no input)."""
    import torch

    flags = [isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter)
             for x in example_inputs]

    def mark(joint: fx.GraphModule) -> None:
        groups = _matching_primals(joint, list(example_inputs)) if any(flags) else None
        for group, flag in zip(groups or [], flags):
            for p in group if flag else ():
                p.meta[NOT_A_PARAMETER] = True

    return mark


def _primals(joint: fx.GraphModule) -> list[fx.Node]:
    return [n for n in joint.graph.find_nodes(op="placeholder")
            if not n.name.startswith("tangents")]


def _matching_primals(joint: fx.GraphModule,
                      values: list[Any]) -> list[list[fx.Node]] | None:
    """For each of the graph's inputs ``values``, the joint graph's primal placeholders
    holding its tensors; None when they cannot all be matched.

    AOTAutograd records where each primal comes from (``meta["desc"]``): ``args[i]``
    itself, or an attribute AOTAutograd unwrapped from the tensor subclass ``args[i]``
    (a DTensor becomes its ``_local_tensor``; its device mesh is not a tensor and is left
    out). Each match is checked by dtype and rank. Without descriptors (or when they do
    not match, as after compiled autograd flattened list inputs) the last
    ``len(values)`` primals are matched one to one (AOTAutograd puts lifted parameters
    and effect tokens first)."""
    import torch
    from torch._functorch._aot_autograd.descriptors import (
        PlainAOTInput,
        SubclassGetAttrAOTInput,
    )

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return bool(a.dtype == b.dtype and a.dim() == b.dim())
        return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor)

    def source(desc: Any) -> tuple[int, list[str]] | None:
        attrs: list[str] = []
        while isinstance(desc, SubclassGetAttrAOTInput):
            attrs.insert(0, desc.attr)
            desc = desc.base
        return (desc.idx, attrs) if isinstance(desc, PlainAOTInput) else None

    primals = _primals(joint)
    groups: list[list[fx.Node]] = [[] for _ in values]
    for p in primals:
        where = source(p.meta.get("desc"))
        if where is None or not 0 <= where[0] < len(values):
            continue
        value: Any = values[where[0]]
        for attr in where[1]:
            value = getattr(value, attr, None)
        if not same(p.meta.get("val"), value):
            break
        if isinstance(value, torch.Tensor):
            groups[where[0]].append(p)
    else:
        if all(g or not isinstance(v, torch.Tensor) for g, v in zip(groups, values)):
            return groups
    if len(primals) < len(values):
        return None
    tail = primals[len(primals) - len(values):]
    if not all(same(p.meta.get("val"), v) for p, v in zip(tail, values)):
        return None
    return [[p] if isinstance(v, torch.Tensor) else [] for p, v in zip(tail, values)]
