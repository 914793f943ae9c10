"""Ops that draw random numbers: dropout, ``rand``/``randn``/``randint`` and their
``_like`` forms, ``bernoulli`` (and attention with dropout: ``attention.keyed_attention``).
Every layout is valid, because no op here reads a generator: each element's value comes
from its index in the whole tensor and the running program's key
(``autopar.passes.randomness``), so a shard draws what the whole tensor holds there and
replicated copies agree. Every strategy, replicated ones included, runs the keyed kernel.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.distributed.tensor import Replicate, Shard
from torch.ops import aten

from autopar.passes import randomness
from autopar.passes.op_strategies import AxisOption, OpInfo
from autopar.passes.rules.attention import dropout_p
from autopar.passes.rules.factory import born_sharded
from autopar.passes.rules.pointwise import broadcast_options
from autopar.passes.rules.registry import kernel, register

R = Replicate()
KEYED = "keyed_random"  # the local kernel of every op here

FOLLOW_INPUT = (aten.dropout.default, aten.native_dropout.default, aten.bernoulli.default)
BORN = (aten.rand.default, aten.randn.default, aten.randint.default, aten.randint.low)
SHAPED_LIKE = (aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
               aten.randint_like.low_dtype, aten.bernoulli.p)


def _dropout(args, where, device, dtype):
    x, p, train = args[:3]
    return randomness.dropout(x, float(p), *where) if train else x.clone()


def _native_dropout(args, where, device, dtype):  # (output, mask)
    x, p, train = args[:3]
    if not train or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    keep = randomness.kept(float(p), *where, device)
    return x * (keep.to(x.dtype) * (1.0 / (1.0 - p))), keep


def _bernoulli(args, where, device, dtype):  # each element 1 with the probability its input holds there
    return (randomness.uniform(*where, device, torch.float64) < args[0]).to(dtype)


def _bernoulli_p(args, where, device, dtype):
    return (randomness.uniform(*where, device, torch.float64) < (args[1] if len(args) > 1 else 0.5)).to(dtype)


def _uniform(args, where, device, dtype):
    return randomness.uniform(*where, device, dtype)


def _normal(args, where, device, dtype):
    return randomness.normal(*where, device, dtype)


def _integers(bounds):
    def draw(args, where, device, dtype):
        low, high = bounds(args)
        return randomness.integers(int(low), int(high), *where, device, dtype)

    return draw


# op -> its draw from (positional arguments, where the shard lies, device, dtype)
DRAWS = {
    aten.dropout.default: _dropout,
    aten.native_dropout.default: _native_dropout,
    aten.bernoulli.default: _bernoulli,
    aten.bernoulli.p: _bernoulli_p,
    aten.rand.default: _uniform,
    aten.rand_like.default: _uniform,
    aten.randn.default: _normal,
    aten.randn_like.default: _normal,
    aten.randint.default: _integers(lambda a: (0, a[0])),  # (high, size)
    aten.randint.low: _integers(lambda a: a[:2]),  # (low, high, size)
    aten.randint_like.default: _integers(lambda a: (0, a[1])),  # (self, high)
    aten.randint_like.low_dtype: _integers(lambda a: a[1:3]),  # (self, low, high)
}
RANDOM_OPS = frozenset(DRAWS)


@kernel(KEYED)
def keyed(info: OpInfo, strategy, args: tuple, kwargs: dict, ctx) -> torch.Tensor:
    """The op's draw for this device's shard (located by the whole output's shape, its layout,
    the mesh and this coordinate)."""
    where = (info.outputs[0].shape, strategy.outputs[0], ctx.mesh_shape, ctx.coord)
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    device = first.device if first is not None else torch.device(kwargs.get("device") or "cpu")
    return DRAWS[info.op](args, where, device, info.outputs[0].dtype)


def _keyed(options: list[AxisOption]) -> list[AxisOption]:
    return [AxisOption(o.inputs, o.outputs, KEYED) for o in options]


@register(*FOLLOW_INPUT)
def follows_input(info: OpInfo) -> list[AxisOption]:
    """The outputs laid out as the input they mask (or whose probabilities they draw)."""
    options = _keyed(broadcast_options(info))
    return options + [AxisOption(tuple(R for _ in info.inputs), (R,) * len(info.outputs), KEYED)]


@register(*BORN)
def drawn(info: OpInfo) -> list[AxisOption]:
    return born_sharded(info, input_unread=True, kernel_name=KEYED)


@register(*SHAPED_LIKE)
def drawn_like(info: OpInfo) -> list[AxisOption]:
    """Only the input's shape is read: any layout of the output."""
    out = info.outputs[0]
    ins = tuple(None for _ in info.inputs)
    return [AxisOption(ins, (Shard(d),), KEYED) for d in range(out.ndim)] + [AxisOption(ins, (R,), KEYED)]


def draws(op, args: tuple, kwargs: dict) -> bool:
    """The call draws random numbers (its rule runs a keyed kernel): an op here, or
    attention with dropout (``attention.keyed_attention``)."""
    if op is aten.scaled_dot_product_attention.default:
        return dropout_p(args, kwargs) > 0
    return op in RANDOM_OPS


def random_ordinals(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each random op's ordinal among the graph's random ops, in program order: its stream of
    draws (the same in every program captured from the model, stage or not)."""
    ops = (n for n in graph.nodes if n.op == "call_function" and draws(n.target, n.args, n.kwargs))
    return {n: i for i, n in enumerate(ops)}
