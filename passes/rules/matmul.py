"""Contractions, described by einsum equations.

For an equation such as ``"bsk,nk->bsn"`` (``linear``) each index letter gives one way
to split the op along a mesh axis:

- a letter kept in the output (``b``, ``s``, ``n``): shard it in every operand that has
  it and in the output — data, sequence or column (output-feature) parallelism;
- a contracted letter (``k``): shard it in every operand that has it; each device then
  holds a partial sum of the output (Partial) — row parallelism;
- and, the op being linear in each operand, one Partial operand (others replicated)
  gives a Partial output.

A bias added to the product follows the output: sharded with it, replicated where it
broadcasts, and a Partial when the output is a Partial (so that it is added once).

``linear`` has two options more, whose kernels run the tensor-parallel collective inside
the op, pipelined with the matmul (``autopar.passes.rules.overlapped``).
"""

from __future__ import annotations

import string

from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.ops import aten

from autopar.passes.rules import overlapped
from autopar.passes.rules.registry import register
from autopar.passes.op_strategies import AxisOption, OpInfo, TensorMeta

R = Replicate()


def einsum_options(equation: str, operands: list[TensorMeta], n_outputs: int = 1) -> list[AxisOption]:
    lhs, out = equation.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != len(operands):
        raise ValueError(f"autopar: einsum {equation!r} names {len(terms)} operands, found {len(operands)}")
    sizes: dict[str, set[int]] = {}
    for term, m in zip(terms, operands):
        for letter, size in zip(term, m.shape):
            sizes.setdefault(letter, set()).add(size)
    options = []
    for letter in dict.fromkeys(lhs.replace(",", "")):
        if len(sizes[letter]) != 1 or any(t.count(letter) > 1 for t in terms + [out]):
            continue  # broadcast (size 1 against n) or a diagonal: cannot shard
        ins = tuple(Shard(t.index(letter)) if letter in t else R for t in terms)
        result: Placement = Shard(out.index(letter)) if letter in out else Partial()
        options.append(AxisOption(ins, (result,) * n_outputs))
    for i in range(len(terms)):
        ins = tuple(Partial() if j == i else R for j in range(len(terms)))
        options.append(AxisOption(ins, (Partial(),) * n_outputs))
    return options


def with_bias(options: list[AxisOption], bias: TensorMeta, out: TensorMeta, at: int) -> list[AxisOption]:
    """Insert the placement of a bias (added to the product) at input position ``at``."""
    result = []
    for o in options:
        placement = o.outputs[0]
        if isinstance(placement, Shard):
            k = placement.dim - (out.ndim - bias.ndim)
            b = Shard(k) if k >= 0 and bias.shape[k] == out.shape[placement.dim] and bias.shape[k] > 1 else R
        elif isinstance(placement, Partial):
            b = Partial()
        else:
            b = R
        result.append(AxisOption(o.inputs[:at] + (b,) + o.inputs[at:], o.outputs))
    return result


def _letters(n: int, skip: str = "") -> str:
    return "".join(c for c in string.ascii_lowercase if c not in skip)[:n]


@register(aten.mm.default)
def mm(info: OpInfo) -> list[AxisOption]:
    return einsum_options("mk,kn->mn", list(info.inputs))


@register(aten.bmm.default)
def bmm(info: OpInfo) -> list[AxisOption]:
    return einsum_options("bmk,bkn->bmn", list(info.inputs))


@register(aten.addmm.default)
def addmm(info: OpInfo) -> list[AxisOption]:
    bias, a, b = info.inputs
    return with_bias(einsum_options("mk,kn->mn", [a, b]), bias, info.outputs[0], at=0)


@register(aten.baddbmm.default)
def baddbmm(info: OpInfo) -> list[AxisOption]:
    bias, a, b = info.inputs
    return with_bias(einsum_options("bmk,bkn->bmn", [a, b]), bias, info.outputs[0], at=0)


@register(aten.linear.default)
def linear(info: OpInfo) -> list[AxisOption]:
    x, w = info.inputs[0], info.inputs[1]
    batch = _letters(x.ndim - 1, skip="kn")
    options = einsum_options(f"{batch}k,nk->{batch}n", [x, w])
    if len(info.inputs) == 3:
        options = with_bias(options, info.inputs[2], info.outputs[0], at=2)
    return options + overlapped.options(info)


@register(aten.matmul.default)
def matmul(info: OpInfo) -> list[AxisOption]:
    a, b = info.inputs
    if a.ndim < 2 or b.ndim < 2:
        return []  # vector forms: rare in models, left replicated
    if b.ndim == 2:
        batch = _letters(a.ndim - 2, skip="mkn")
        return einsum_options(f"{batch}mk,kn->{batch}mn", [a, b])
    if a.ndim == b.ndim and a.shape[:-2] == b.shape[:-2]:
        batch = _letters(a.ndim - 2, skip="mkn")
        return einsum_options(f"{batch}mk,{batch}kn->{batch}mn", [a, b])
    return []  # broadcast batch dims: left replicated


@register(aten.einsum.default)
def einsum(info: OpInfo) -> list[AxisOption]:
    equation = info.args[0]
    if "..." in equation or "->" not in equation:
        return []  # implicit output or ellipsis: left replicated
    return einsum_options(equation, list(info.inputs))
