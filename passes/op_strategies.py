"""Sharding strategies of one op: what placements its inputs need, what its outputs get.

Rules describe an op on ONE mesh axis (:class:`AxisOption`); :func:`expand_to_mesh`
takes the product over the N axes of the mesh and keeps the combinations whose shards
divide evenly. Axis-wise options compose because each one is a valid way to split the
op's work, and splitting a piece again along another axis is again valid — the
simulator (``autopar.passes.simulate``) checks every combination on 1-, 2- and 3-axis meshes.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.distributed.tensor import Placement, Replicate
from torch.utils import _pytree as pytree

from autopar.passes.placements import Spec, fits, is_partial, spec_str


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a tensor argument; stands in for the tensor inside OpInfo.args."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @staticmethod
    def of(t: torch.Tensor) -> "TensorMeta":
        return TensorMeta(tuple(int(s) for s in t.shape), t.dtype)


@dataclass
class OpInfo:
    """One call of an op, with every tensor argument replaced by its TensorMeta.

    ``inputs`` lists the tensor arguments in pytree order of ``(args, kwargs)``; a
    strategy's input placements follow that order. ``outputs`` lists the tensor outputs
    (pytree order; a non-tensor output such as None is skipped).
    """

    op: Any
    args: tuple
    kwargs: dict
    outputs: tuple[TensorMeta, ...]
    inputs: tuple[TensorMeta, ...] = field(init=False)

    def __post_init__(self) -> None:
        leaves = pytree.tree_leaves((self.args, self.kwargs))
        self.inputs = tuple(x for x in leaves if isinstance(x, TensorMeta))

    @property
    def name(self) -> str:
        return str(self.op)

    def fill(self, tensors: Sequence[Any]) -> tuple[tuple, dict]:
        """(args, kwargs) with the tensor arguments replaced, in order, by ``tensors``."""
        it = iter(tensors)
        leaves, spec = pytree.tree_flatten((self.args, self.kwargs))
        filled = [next(it) if isinstance(x, TensorMeta) else x for x in leaves]
        args, kwargs = pytree.tree_unflatten(filled, spec)
        return tuple(args), dict(kwargs)

    @staticmethod
    def from_call(op: Any, args: tuple, kwargs: dict | None = None) -> "OpInfo":
        """Build from real tensors (runs the op once to learn its outputs)."""
        kwargs = kwargs or {}
        out = op(*pytree.tree_map(_clone_tensor, args), **pytree.tree_map(_clone_tensor, kwargs))
        to_meta = lambda x: TensorMeta.of(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
        outs = tuple(
            TensorMeta.of(x) for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)
        )
        return OpInfo(op, pytree.tree_map(to_meta, tuple(args)), pytree.tree_map(to_meta, kwargs), outs)


def _clone_tensor(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


@dataclass(frozen=True)
class AxisOption:
    """One way to split an op along a single mesh axis.

    ``inputs``: a placement per tensor input, or None when the op never reads that
    input's values (``empty_like``'s argument). ``outputs``: a placement per output.
    ``kernel``: name of a local kernel that replaces the op on each device when running
    the op on local shards is not enough (a vocabulary-sharded embedding must mask ids
    outside its shard); None runs the op itself.
    """

    inputs: tuple[Placement | None, ...]
    outputs: tuple[Placement, ...]
    kernel: str | None = None


@dataclass(frozen=True)
class ShardingStrategy:
    """Placements of every input and output on the whole mesh, for one node.

    Prints as ``(S(0)R, RS(1)) -> S(0)S(1)``.
    """

    inputs: tuple[Spec | None, ...]
    outputs: tuple[Spec, ...]
    kernel: str | None = None

    def __str__(self) -> str:
        return self._text

    @functools.cached_property
    def _text(self) -> str:  # computed once: plans name strategies by it, every rank's build reads them all
        ins = ", ".join(spec_str(s) for s in self.inputs)
        outs = ", ".join(spec_str(s) for s in self.outputs)
        if len(self.outputs) != 1:
            outs = f"({outs})"
        text = f"({ins}) -> {outs}"
        return f"{text} [{self.kernel}]" if self.kernel else text

    @property
    def output(self) -> Spec:
        return self.outputs[0]


def _valid(meta: TensorMeta, spec: Spec | None, mesh_shape: Sequence[int]) -> bool:
    """Shards divide evenly, and no boolean tensor is a Partial (a sum of bools means nothing)."""
    if spec is None:
        return True
    if meta.dtype == torch.bool and is_partial(spec):
        return False
    return fits(meta.shape, spec, mesh_shape)


def _partial_crosses_to_integer(info: OpInfo, inputs, outputs) -> bool:
    """A pending sum of floats cannot become integers: rounding each part is not linear."""
    float_partial_in = any(
        is_partial(s) and m.dtype.is_floating_point for m, s in zip(info.inputs, inputs)
    )
    return float_partial_in and any(
        is_partial(s) and not m.dtype.is_floating_point for m, s in zip(info.outputs, outputs)
    )


def expand_to_mesh(
    info: OpInfo, options: Sequence[AxisOption], mesh_shape: Sequence[int]
) -> list[ShardingStrategy]:
    """All combinations of per-axis options whose shards divide evenly.

    A combination may use at most one distinct local kernel (kernels know how to act
    on every axis that shards their operand, but not how to compose with another
    kernel). The all-replicate strategy is always first.
    """
    # An input the rule never reads (None in every option) stays None when replicated too.
    unread = [bool(options) and all(o.inputs[i] is None for o in options) for i in range(len(info.inputs))]
    # A rule whose every option names the same kernel (``empty``) uses it when replicated too.
    kernels = {o.kernel for o in options}
    base = AxisOption(
        tuple(None if u else Replicate() for u in unread),
        tuple(Replicate() for _ in info.outputs),
        kernels.pop() if len(kernels) == 1 else None,
    )
    options = [base] + [o for o in options if o != base]
    seen: set[ShardingStrategy] = set()
    result: list[ShardingStrategy] = []
    for combo in itertools.product(options, repeat=len(mesh_shape)):
        kernels = {o.kernel for o in combo if o.kernel}
        if len(kernels) > 1:
            continue
        inputs = tuple(
            None if any(o.inputs[i] is None for o in combo) else tuple(o.inputs[i] for o in combo)
            for i in range(len(info.inputs))
        )
        outputs = tuple(tuple(o.outputs[j] for o in combo) for j in range(len(info.outputs)))
        if not all(_valid(m, s, mesh_shape) for m, s in zip(info.inputs, inputs)):
            continue
        if not all(_valid(m, s, mesh_shape) for m, s in zip(info.outputs, outputs)):
            continue
        if _partial_crosses_to_integer(info, inputs, outputs):
            continue
        # no axis (a single device) runs the rule's kernel too, where every option names it
        kernel = kernels.pop() if kernels else None if combo else base.kernel
        strategy = ShardingStrategy(inputs, outputs, kernel)
        if strategy not in seen:
            seen.add(strategy)
            result.append(strategy)
    return result
