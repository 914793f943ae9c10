"""The one table of sharding rules, and how a chosen strategy runs on one device.

A rule is registered for one or more ops (by their printed name, e.g. ``aten.mm.default``,
so custom ops of libraries not yet imported can have rules too). It lists the ways to
split the op along one mesh axis; ``localize`` rewrites shape-valued arguments for the
local shards (a ``view`` to ``[B, S, H]`` becomes a view to ``[B/2, S, H]``); a named
*kernel* replaces the op on each device where running it on local shards is not enough.
Codegen and the simulator both run a strategy through :func:`run_local`.

Beside its strategies a rule may say what the passes after it would otherwise have to
know about the op by name: its ``work`` per strategy (``OpWork``: FLOPs and bytes as
``costmodels.Op``, collectives it runs inside itself; ``autopar.passes.costing`` prices
it), a ``restrict`` of its strategies under a manual layout's axis roles
(``autopar.passes.planner.intra_op``), and its ``expert_weights`` (``ExpertWeight``: the
arguments a manual layout splits by expert or, Megatron's way, by column or row:
``autopar.passes.planner.layouts``). A kernel may say how ``explain()`` reads a strategy that
runs it (``KernelExplain``), from the plan's text alone, its own ``work`` in place of its op's
rule's, and which of the mesh's combinations naming it it can run (``fits``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Sequence

import numpy as np

from autopar import costmodels
from autopar.costmodels.comm import Step
from autopar.costmodels.pipelined import Pipelined
from autopar.passes.placements import Spec, local_shape
from autopar.passes.op_strategies import AxisOption, OpInfo, ShardingStrategy, expand_to_mesh
from autopar.passes.roles import AxisRole


@dataclass(frozen=True)
class LocalContext:
    """Where on the mesh a local computation runs."""

    mesh_shape: tuple[int, ...]
    coord: tuple[int, ...]
    exchange: Any = None  # for kernels that communicate: autopar.passes.exchange (codegen's or the simulator's)


OptionsFn = Callable[[OpInfo], list[AxisOption]]
LocalizeFn = Callable[[OpInfo, ShardingStrategy, tuple, dict, LocalContext], tuple[tuple, dict]]
KernelFn = Callable[[OpInfo, ShardingStrategy, tuple, dict, LocalContext], Any]


@dataclass(frozen=True)
class OpWork:
    """What one device does for one strategy of an op: its compute as ops (each priced by
    the roofline that prices every op, its backward by ``costmodels.backward_time``) and the
    collectives it runs inside itself in forward (backward runs their duals); or a matmul
    ``pipelined`` with its collective in chunks, priced by its critical path
    (``costmodels.pipelined``)."""

    ops: tuple[costmodels.Op, ...]
    collectives: tuple[Step, ...] = ()
    pipelined: Pipelined | None = None


# (info, strategy, mesh shape, dtype kind of its output: "fp32", "bf16", ...) -> one device's work
WorkFn = Callable[[OpInfo, ShardingStrategy, tuple[int, ...], str], OpWork]
# (the op's strategies, the roles of the mesh axes under a manual layout) -> per strategy 0
# (the layout allows it) or inf; None: the layout leaves the op free
RestrictFn = Callable[[Sequence[ShardingStrategy], tuple[AxisRole, ...]], np.ndarray | None]


@dataclass(frozen=True)
class ExpertWeight:
    """An argument of an op that is a weight per expert, [E, K, N] (K contracted, N output
    features), as the op reads it. Manual layouts split it by expert (dim 0) or, Megatron's
    way, by ``megatron``: "column" (N), "row" (K), or None: as a linear would be, by column
    unless the op's first argument arrives split by column already."""

    arg: int
    megatron: Literal["column", "row"] | None = None


@dataclass(frozen=True)
class KernelExplain:
    """How ``explain()`` reads a strategy that runs a kernel, from its printed input placements.
    ``experts``: the input holding the weights per expert; mesh axes that split its dim 0
    split experts by expert. ``phrases(inputs)``: what the strategy does, each phrase with
    the strategy's mesh axis it is about (its name replaces ``{axis}``) or None; explain()
    counts each over the plan's strategies ("2 expert layers: all-to-all dispatch over ep")."""

    experts: int
    phrases: Callable[[tuple[Spec, ...]], Iterable[tuple[str, int | None]]]


@dataclass(frozen=True)
class Rule:
    options: OptionsFn
    localize: LocalizeFn | None = None
    values_unspecified: bool = False  # ``empty``: only shape and dtype are defined
    work: WorkFn | None = None  # None: costing's default (FLOPs of its matmul or attention kind, bytes streamed)
    restrict: RestrictFn | None = None
    expert_weights: tuple[ExpertWeight, ...] = ()


_RULES: dict[str, Rule] = {}
_KERNELS: dict[str, KernelFn] = {}
_COMMUNICATING: set[str] = set()
_EXPLAINED: dict[str, KernelExplain] = {}
_KERNEL_WORK: dict[str, WorkFn] = {}
_KERNEL_FITS: dict[str, Callable[[ShardingStrategy], bool]] = {}


def op_name(op: Any) -> str:
    return str(op)


def register(
    *ops: Any, localize: LocalizeFn | None = None, values_unspecified: bool = False, work: WorkFn | None = None,
    restrict: RestrictFn | None = None, expert_weights: Sequence[ExpertWeight] = (),
) -> Callable[[OptionsFn], OptionsFn]:
    """Register ``fn(info) -> list[AxisOption]`` as the rule of every op in ``ops`` (the
    other hooks: the module docstring)."""

    def wrap(fn: OptionsFn) -> OptionsFn:
        for op in ops:
            name = op if isinstance(op, str) else op_name(op)
            if name in _RULES:
                raise ValueError(f"autopar: two sharding rules registered for {name}")
            _RULES[name] = Rule(fn, localize, values_unspecified, work, restrict, tuple(expert_weights))
        return fn

    return wrap


def kernel(name: str, communicates: bool = False, explain: KernelExplain | None = None,
           work: WorkFn | None = None,
           fits: Callable[[ShardingStrategy], bool] | None = None) -> Callable[[KernelFn], KernelFn]:
    """Register a local kernel; ``communicates``: it trades data with its peers through
    ``LocalContext.exchange`` (the simulator then runs the devices side by side);
    ``explain``: how ``explain()`` reads the strategies that run it; ``work``: what a
    strategy running it does, in its op's rule's place (``work_of``); ``fits``: which of the
    mesh's combinations naming it the kernel can run (``strategies_for`` keeps those)."""
    def wrap(fn: KernelFn) -> KernelFn:
        _KERNELS[name] = fn
        if communicates:
            _COMMUNICATING.add(name)
        if explain is not None:
            _EXPLAINED[name] = explain
        if work is not None:
            _KERNEL_WORK[name] = work
        if fits is not None:
            _KERNEL_FITS[name] = fits
        return fn

    return wrap


def communicates(kernel_name: str | None) -> bool:
    return kernel_name in _COMMUNICATING


def kernel_explain(kernel_name: str | None) -> KernelExplain | None:
    return _EXPLAINED.get(kernel_name)


def rule_for(op: Any) -> Rule | None:
    return _RULES.get(op_name(op))


def work_of(op: Any, kernel_name: str | None = None) -> WorkFn | None:
    """The ``work`` of ``op`` run by a strategy of ``kernel_name``: the kernel's where it says
    it, else the rule's; None: priced by costing's default."""
    if kernel_name in _KERNEL_WORK:
        return _KERNEL_WORK[kernel_name]
    rule = rule_for(op)
    return None if rule is None else rule.work


def restriction_of(op: Any) -> RestrictFn | None:
    rule = rule_for(op)
    return None if rule is None else rule.restrict


def expert_weights_of(op: Any) -> tuple[ExpertWeight, ...]:
    rule = rule_for(op)
    return () if rule is None else rule.expert_weights


def registered_ops() -> list[str]:
    return sorted(_RULES)


def strategies_for(info: OpInfo, mesh_shape: Sequence[int]) -> list[ShardingStrategy]:
    """Every valid strategy of this call on this mesh; replicate-only if no rule exists."""
    rule = rule_for(info.op)
    options = rule.options(info) if rule else []
    return [s for s in expand_to_mesh(info, options, tuple(mesh_shape))
            if s.kernel not in _KERNEL_FITS or _KERNEL_FITS[s.kernel](s)]


def run_local(
    info: OpInfo, strategy: ShardingStrategy, local_tensors: Sequence[Any], ctx: LocalContext
) -> Any:
    """Run the op on one device's shards (tensor inputs in ``info.inputs`` order)."""
    args, kwargs = info.fill(local_tensors)
    rule = rule_for(info.op)
    if rule is not None and rule.localize is not None:
        args, kwargs = rule.localize(info, strategy, args, kwargs, ctx)
    if strategy.kernel is not None:
        return _KERNELS[strategy.kernel](info, strategy, args, kwargs, ctx)
    return info.op(*args, **kwargs)


def local_out_shape(info: OpInfo, strategy: ShardingStrategy, ctx: LocalContext, i: int = 0) -> list[int]:
    """The local shape of output ``i``: what shape-valued arguments must become."""
    return list(local_shape(info.outputs[i].shape, strategy.outputs[i], ctx.mesh_shape))


def with_arg(args: tuple, index: int, value: Any) -> tuple:
    return args[:index] + (value,) + args[index + 1 :]
