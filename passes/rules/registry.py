"""The one table of sharding rules, and how a chosen strategy runs on one device.

A rule is registered for one or more ops (by their printed name, e.g. ``aten.mm.default``,
so custom ops of libraries not yet imported can have rules too). It lists the ways to
split the op along one mesh axis; ``localize`` rewrites shape-valued arguments for the
local shards (a ``view`` to ``[B, S, H]`` becomes a view to ``[B/2, S, H]``); a named
*kernel* replaces the op on each device where running it on local shards is not enough.
Codegen and the simulator both run a strategy through :func:`run_local`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from autopar.passes.placements import local_shape
from autopar.passes.op_strategies import AxisOption, OpInfo, ShardingStrategy, expand_to_mesh


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
class Rule:
    options: OptionsFn
    localize: LocalizeFn | None = None
    values_unspecified: bool = False  # ``empty``: only shape and dtype are defined


_RULES: dict[str, Rule] = {}
_KERNELS: dict[str, KernelFn] = {}
_COMMUNICATING: set[str] = set()


def op_name(op: Any) -> str:
    return str(op)


def register(
    *ops: Any, localize: LocalizeFn | None = None, values_unspecified: bool = False
) -> Callable[[OptionsFn], OptionsFn]:
    """Register ``fn(info) -> list[AxisOption]`` as the rule of every op in ``ops``."""

    def wrap(fn: OptionsFn) -> OptionsFn:
        for op in ops:
            name = op if isinstance(op, str) else op_name(op)
            if name in _RULES:
                raise ValueError(f"autopar: two sharding rules registered for {name}")
            _RULES[name] = Rule(fn, localize, values_unspecified)
        return fn

    return wrap


def kernel(name: str, communicates: bool = False) -> Callable[[KernelFn], KernelFn]:
    """Register a local kernel; ``communicates``: it trades data with its peers through
    ``LocalContext.exchange`` (the simulator then runs the devices side by side)."""
    def wrap(fn: KernelFn) -> KernelFn:
        _KERNELS[name] = fn
        if communicates:
            _COMMUNICATING.add(name)
        return fn

    return wrap


def communicates(kernel_name: str | None) -> bool:
    return kernel_name in _COMMUNICATING


def rule_for(op: Any) -> Rule | None:
    return _RULES.get(op_name(op))


def registered_ops() -> list[str]:
    return sorted(_RULES)


def strategies_for(info: OpInfo, mesh_shape: Sequence[int]) -> list[ShardingStrategy]:
    """Every valid strategy of this call on this mesh; replicate-only if no rule exists."""
    rule = rule_for(info.op)
    options = rule.options(info) if rule else []
    return expand_to_mesh(info, options, tuple(mesh_shape))


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
