"""A mixture-of-experts layer's experts as one op, ``autopar::moe_experts``, and its rule.

``moe_experts(hidden[T, H], topk_ids[T, k], topk_weights[T, k], w_gate_up[E, H, 2I],
w_down[E, I, H], grouped_mm) -> out[T, H]``: every token's k routed rows through their
experts' gated MLP (``silu(gate) * up``, then down), weighted and summed per token. It is
the region of transformers' grouped-matmul experts (sort by expert, histc, cumsum, two
grouped matmuls, scatter back), recognised after capture by ``autopar.passes.capture_moe``;
``grouped_mm`` names the grouped matmul that region called, so the op computes what the
model did. Its implementation is that math (CompositeImplicitAutograd: autograd, meta and
fake tensors come with the ops it calls).

Along one mesh axis (inputs: hidden, ids, weights, w_gate_up, w_down):

- ``(S(0), S(0), S(0), R, R) -> S(0)``: data parallel, the op on this device's tokens;
- ``(R, R, R, S(2), S(1)) -> P``: tensor-parallel experts (Megatron's column then row):
  each device's gate and up columns are gathered inside the op (they are stored as one
  [gate; up] tensor, so a device's block is not a pair), the activation's own slice goes
  through its rows of ``w_down``, the output is a pending sum;
- ``(R, R, R, S(0), S(0)) -> P``: expert parallel with whole tokens (Megatron-Core's
  "allgather" dispatcher): each device runs the rows routed to its experts, zeros elsewhere;
- ``(S(0), S(0), S(0), S(0), S(0)) -> S(0)``: expert parallel with all-to-all dispatch
  (Megatron-Core's "alltoall" dispatcher): each device sorts its tokens' rows by the rank
  that holds their expert, trades counts then rows with ``all_to_all_single``, runs its
  experts, and the reverse exchange brings the results home to be combined.

All but the first run the ``moe_experts`` kernel (:func:`experts_on_mesh`), which reads the
strategy axis by axis, so any combination over the mesh is one kernel. Row counts are read
on the host (``tolist``) to size the exchange: uneven counts are run as they are, no
capacity padding, so a fake-tensor dry run cannot size them (it raises).

Beside the strategies the rule tells the registry what the passes after it need, so none
of them names the op: its work per strategy (:func:`experts_work`, priced by costing), that
a layout's ``ep`` axes keep it to all-to-all dispatch, its weights per expert (Megatron's
column for ``w_gate_up``, row for ``w_down``), and how explain() words the dispatch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar import costmodels
from autopar.costmodels.comm import Step
from autopar.passes.op_strategies import AxisOption, OpInfo
from autopar.passes.placements import local_shape, shard_offset
from autopar.passes.roles import AxisRole
from autopar.passes.rules.registry import ExpertWeight, KernelExplain, OpWork, kernel, register

R = Replicate()
OP_NAME = "autopar.moe_experts.default"
KERNEL = "moe_experts"  # named on strategies: plans and explain() read it
IDS, WEIGHTS, W_GATE_UP, W_DOWN = 1, 2, 3, 4  # tensor input positions, argument positions too (0: hidden)

_LIB = torch.library.Library("autopar", "DEF")
_LIB.define("moe_experts(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, "
            "Tensor w_down, str grouped_mm) -> Tensor")


def grouped_mm_op(name: str) -> Callable:
    """The grouped matmul named by its printed form (``aten._grouped_mm.default``, ...)."""
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def moe_experts_reference(hidden, topk_ids, topk_weights, w_gate_up, w_down, grouped_mm: str):
    """The experts as transformers' grouped-matmul path computes them, op for op."""
    mm = grouped_mm_op(grouped_mm)
    experts, k = w_gate_up.shape[0], topk_ids.shape[-1]
    sorted_ids, perm = torch.sort(topk_ids.reshape(-1))
    x = hidden[perm // k]
    row_weights = topk_weights.reshape(-1)[perm]
    counts = torch.histc(sorted_ids.to(torch.float32), bins=experts, min=0, max=experts - 1)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gate, up = mm(x.to(w_gate_up.dtype), w_gate_up, offs).chunk(2, dim=-1)
    y = mm((F.silu(gate) * up).to(w_down.dtype), w_down, offs) * row_weights.unsqueeze(-1)
    back = torch.empty_like(perm).index_put_((perm,), torch.arange(perm.numel(), device=perm.device))
    return y[back].view(*topk_ids.shape, -1).sum(1).to(hidden.dtype)


_LIB.impl("moe_experts", moe_experts_reference, "CompositeImplicitAutograd")
MOE_EXPERTS = torch.ops.autopar.moe_experts.default


def _work(info: OpInfo, strategy, mesh_shape: Sequence[int], dtype: str) -> OpWork:
    """The registry's ``work``: the grouped matmuls by the roofline that prices every matmul,
    the rest as one bandwidth-bound op, the exchanges as ``experts_work`` counts them."""
    work = experts_work(info, strategy, mesh_shape)
    ops = [costmodels.Op(flops, moved, dtype, work.grouped_mm) for flops, moved in work.matmuls]
    ops.append(costmodels.Op(0.0, work.elementwise_bytes, dtype, ""))  # "": a bandwidth-bound op
    return OpWork(tuple(ops), work.forward)


def _restrict(strategies, roles: Sequence[AxisRole]) -> np.ndarray | None:
    """A layout with expert-parallel axes (``AxisRole.EP``: they split the batch and the
    experts) keeps the op to the strategies that dispatch all-to-all over every one of them
    (Megatron-Core's "alltoall" dispatcher); 0 allowed, inf not."""
    axes = {a for a, role in enumerate(roles) if role is AxisRole.EP}
    if not axes:
        return None
    return np.array([0.0 if axes <= set(axis_kinds(s)["all_to_all"]) else np.inf for s in strategies])


_DISPATCH_WORDS = {
    "all_to_all": "all-to-all dispatch over {axis} (each rank sends its tokens' rows to the ranks of their experts "
                  "and gets the results back)",
    "allgather": "allgather dispatch over {axis} (tokens whole, outputs reduced after)",
}


def _phrases(inputs: tuple) -> list[tuple[str, int]]:
    """explain()'s phrases of a strategy running the kernel: how tokens reach the experts on each axis."""
    kinds = _axis_kinds(inputs)
    return [(f"expert layers: {_DISPATCH_WORDS[kind]}", a) for kind in _DISPATCH_WORDS for a in kinds[kind]]


@register(OP_NAME, work=_work, restrict=_restrict,
          expert_weights=(ExpertWeight(W_GATE_UP, "column"), ExpertWeight(W_DOWN, "row")))
def moe_experts(info: OpInfo) -> list[AxisOption]:
    S0 = Shard(0)
    return [
        AxisOption((S0, S0, S0, R, R), (S0,)),
        AxisOption((R, R, R, Shard(2), Shard(1)), (Partial(),), kernel=KERNEL),
        AxisOption((R, R, R, S0, S0), (Partial(),), kernel=KERNEL),
        AxisOption((S0, S0, S0, S0, S0), (S0,), kernel=KERNEL),
    ]


def axis_kinds(strategy) -> dict[str, tuple[int, ...]]:
    """The mesh axes of a strategy by what the experts do there: ``all_to_all`` (tokens and
    experts split: rows exchanged), ``allgather`` (experts split, tokens whole), ``tp``
    (each expert's MLP split), the rest data parallel or replicated."""
    return _axis_kinds(strategy.inputs)


def _axis_kinds(inputs: Sequence) -> dict[str, tuple[int, ...]]:
    """``axis_kinds`` from the strategy's input placements alone (what a plan's text gives back)."""
    tokens, w = inputs[0], inputs[W_GATE_UP]
    kinds: dict[str, list[int]] = {"all_to_all": [], "allgather": [], "tp": []}
    for a, (t, p) in enumerate(zip(tokens, w)):
        if p == Shard(0):
            kinds["all_to_all" if t == Shard(0) else "allgather"].append(a)
        elif p == Shard(2):
            kinds["tp"].append(a)
    return {kind: tuple(axes) for kind, axes in kinds.items()}


@kernel(KERNEL, communicates=True, explain=KernelExplain(W_GATE_UP, _phrases))
def experts_on_mesh(info: OpInfo, strategy, args: tuple, kwargs: dict, ctx) -> torch.Tensor:
    """This device's share of the experts: rows sent over the all-to-all axes to the ranks of
    their experts, run on this device's experts (rows of experts held elsewhere on an
    allgather axis are zeros), gate and up columns gathered over the tensor-parallel axes,
    results sent back and combined per token."""
    hidden, ids, weights, w_gate_up, w_down, grouped_mm = args
    kinds = axis_kinds(strategy)
    owner = _ExpertOwners(info.inputs[W_GATE_UP].shape, strategy.inputs[W_GATE_UP], ctx)
    tokens, k = ids.shape
    rows = hidden[torch.arange(tokens * k, device=hidden.device) // k]
    row_ids = ids.reshape(-1)
    routes = []
    for axis in kinds["all_to_all"]:
        rows, row_ids, route = _dispatch(rows, row_ids, owner.coord_along(row_ids, axis), axis, ctx.exchange,
                                         owner.experts)
        routes.append(route)
    local = row_ids - owner.first
    held = (local >= 0) & (local < owner.count)  # on allgather axes, other devices' experts are not here
    out = _local_experts(rows, torch.where(held, local, owner.count), w_gate_up, w_down, grouped_mm,
                         _TensorParallel(info, strategy, kinds["tp"], ctx))
    for route in reversed(routes):
        out = _combine(out, route, ctx.exchange)
    out = out * weights.reshape(-1).unsqueeze(-1)
    return out.view(tokens, k, -1).sum(1).to(hidden.dtype)


class _ExpertOwners:
    """Which device of an axis holds an expert, and this device's experts [first, first + count)."""

    def __init__(self, shape: Sequence[int], spec, ctx):
        self.spec, self.mesh_shape, self.experts = spec, ctx.mesh_shape, shape[0]
        start, stop = shard_offset(shape, spec, ctx.mesh_shape, ctx.coord, 0)
        self.first, self.count = start, stop - start

    def coord_along(self, expert: torch.Tensor, axis: int) -> torch.Tensor:
        """The coordinate along ``axis`` of the device holding each expert (splits nest with
        axis 0 outermost, as ``autopar.passes.placements.shard_offset`` cuts them)."""
        block = self.experts
        for a, p in enumerate(self.spec[:axis + 1]):
            if p == Shard(0):
                block //= self.mesh_shape[a]
        return (expert // block) % self.mesh_shape[axis]


def _dispatch(rows, row_ids, dest, axis: int, exchange, experts: int):
    """Rows sorted by destination, then expert; counts per (peer, expert) traded, then the
    rows. A receiver reads each row's expert off the counts (Megatron-Core's alltoall
    dispatcher does the same), so the ids need no exchange of their own."""
    peers = exchange.mesh_shape[axis]
    order = torch.argsort(dest * experts + row_ids, stable=True)
    if is_fake(dest):  # a dry run has no values: routing taken as balanced
        even = [dest.shape[0] // peers + (j < dest.shape[0] % peers) for j in range(peers)]
        return exchange.rows(rows[order], even, even, axis), row_ids.new_zeros(sum(even)), (order, even, even, axis)
    per_expert = torch.bincount(dest * experts + row_ids, minlength=peers * experts).view(peers, experts)
    received = exchange.counts(per_expert, axis)  # [peers, experts]: rows of each expert from each peer
    send, recv = per_expert.sum(1).tolist(), received.sum(1).tolist()
    ids = torch.arange(experts, device=row_ids.device).repeat(peers).repeat_interleave(received.flatten())
    return exchange.rows(rows[order], recv, send, axis), ids, (order, send, recv, axis)


def _combine(out, route, exchange):
    """The reverse of :func:`_dispatch`: results home, back in their rows' original order."""
    order, send, recv, axis = route
    out = exchange.rows(out, send, recv, axis)
    return out[torch.argsort(order)]


class _TensorParallel:
    """Gate and up columns gathered over the tensor-parallel axes, and this device's slice of
    the activation (the rows of ``w_down`` it holds)."""

    def __init__(self, info: OpInfo, strategy, axes: tuple[int, ...], ctx):
        self.axes, self.exchange = axes, ctx.exchange
        self.cols = shard_offset(info.inputs[W_DOWN].shape, strategy.inputs[W_DOWN], ctx.mesh_shape, ctx.coord, 1)

    def gather(self, h: torch.Tensor) -> torch.Tensor:
        for axis in reversed(self.axes):  # the inner split first: blocks nest with axis 0 outermost
            n = self.exchange.mesh_shape[axis]
            got = self.exchange.rows(torch.cat([h] * n), [h.shape[0]] * n, [h.shape[0]] * n, axis)
            h = torch.cat(got.chunk(n), dim=1)
        return h

    def mine(self, a: torch.Tensor) -> torch.Tensor:
        return a[:, self.cols[0]:self.cols[1]] if self.axes else a


def _local_experts(rows, local_ids, w_gate_up, w_down, grouped_mm: str, tp: _TensorParallel) -> torch.Tensor:
    """Each row through its expert on this device, in the rows' order; rows whose id is
    ``count`` (not held here) come out zero, and so does their gradient."""
    mm = grouped_mm_op(grouped_mm)
    count = w_gate_up.shape[0]
    sorted_ids, perm = torch.sort(local_ids, stable=True)
    # rows per expert; id ``count`` falls in none (histc with one bin, min = max = 0, would count it)
    counts = (sorted_ids.unsqueeze(-1) == torch.arange(count, device=rows.device)).sum(0)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    run = (torch.arange(rows.shape[0], device=rows.device) < offs[-1]).unsqueeze(-1)
    zero = torch.zeros((), dtype=rows.dtype, device=rows.device)
    x = torch.where(run, rows[perm], zero)  # rows past the experts' are left unwritten by the op
    h = tp.gather(mm(x.to(w_gate_up.dtype), w_gate_up, offs)) if tp.axes else mm(x.to(w_gate_up.dtype), w_gate_up, offs)
    gate, up = h.chunk(2, dim=-1)
    y = mm(tp.mine(F.silu(gate) * up).to(w_down.dtype), w_down, offs)
    y = torch.where(run, y, torch.zeros((), dtype=y.dtype, device=y.device))
    return y[torch.argsort(perm)]


@dataclass(frozen=True)
class ExpertsWork:
    """What one device does for a ``moe_experts`` strategy, for pricing: its two grouped
    matmuls (FLOPs, bytes moved) and the collectives inside the op, in forward (backward runs
    their duals: ``autopar.costmodels.step.dual_steps``). Routing is taken as balanced (the
    router's load-balancing loss aims at it): an all-to-all sends and receives as many rows
    as the device's tokens pick, an allgather axis runs 1/n of the rows."""

    grouped_mm: str
    matmuls: tuple[tuple[float, float], ...]
    forward: tuple[Step, ...]
    # bytes read and written by the rest, bandwidth-bound: rows gathered from the tokens,
    # silu(gate) * up, rows weighted and summed back per token
    elementwise_bytes: float = 0.0

    @property
    def flops(self) -> float:
        return sum(f for f, _ in self.matmuls)


def experts_work(info: OpInfo, strategy, mesh_shape: Sequence[int]) -> ExpertsWork:
    kinds = axis_kinds(strategy)
    hidden, ids = info.inputs[0], info.inputs[IDS]
    rows = local_shape(hidden.shape, strategy.inputs[0], mesh_shape)[0] * ids.shape[-1]
    width = hidden.shape[-1]
    itemsize = hidden.dtype.itemsize
    steps = []
    experts = info.inputs[W_GATE_UP].shape[0]
    for axis in kinds["all_to_all"]:  # counts per (peer, expert) and rows out; results back
        steps += [Step("all_to_all", axis, mesh_shape[axis] * experts * ids.dtype.itemsize, True),
                  Step("all_to_all", axis, rows * width * itemsize, True),
                  Step("all_to_all", axis, rows * width * itemsize, True)]
    run = rows / math.prod(mesh_shape[a] for a in kinds["allgather"])
    gate_up = local_shape(info.inputs[W_GATE_UP].shape, strategy.inputs[W_GATE_UP], mesh_shape)[-1]
    inner = local_shape(info.inputs[W_DOWN].shape, strategy.inputs[W_DOWN], mesh_shape)[1]
    cols = gate_up
    for axis in reversed(kinds["tp"]):  # gate and up columns gathered, the inner split first
        cols *= mesh_shape[axis]
        steps.append(Step("all_gather", axis, int(run * cols * itemsize), True))
    held = local_shape(info.inputs[W_GATE_UP].shape, strategy.inputs[W_GATE_UP], mesh_shape)[0]
    w_item = info.inputs[W_GATE_UP].dtype.itemsize
    up = (2.0 * run * width * gate_up, (run * width + run * gate_up) * itemsize + held * width * gate_up * w_item)
    down = (2.0 * run * inner * width, (run * inner + run * width) * itemsize + held * inner * width * w_item)
    elementwise = (5 * rows * width + run * (cols + inner)) * itemsize
    return ExpertsWork(str(info.args[5]), (up, down), tuple(steps), elementwise)
