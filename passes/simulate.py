"""Single-process SPMD simulation on a virtual mesh.

The reference for every sharding rule: split each input by its placement over the mesh,
run the op on each virtual device (:func:`autopar.passes.rules.run_local`, as codegen will),
then put the output back together by its placement — concatenate shards, sum (or max)
Partials, and check that replicated copies agree — and compare with the unsharded op.

Partial inputs are split into random parts that add up to the value, so a rule that
wrongly accepts a pending sum is caught.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import random
import threading
from typing import Any, Sequence

import torch
from torch import fx
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.utils import _pytree as pytree

from autopar.passes import randomness, rules
from autopar.passes.exchange import VirtualExchange
from autopar.passes.rules import registry
from autopar.passes.rules.random import draws, random_ordinals
from autopar.passes.placements import Spec
from autopar.passes.strategy_graph import StrategyGraph, tensor_inputs
from autopar.passes.op_strategies import OpInfo, ShardingStrategy

Coord = tuple[int, ...]
Pieces = dict[Coord, Any]


class SimulationMismatch(AssertionError):
    """A simulated strategy did not reproduce the unsharded result."""


def split(value: torch.Tensor, spec: Spec | None, mesh_shape: Sequence[int], rng: random.Random) -> Pieces:
    """The local tensor of every mesh coordinate. ``None`` (value not read): the whole."""
    spec = spec if spec is not None else (Replicate(),) * len(mesh_shape)
    seed = rng.randrange(2**31)
    pieces: Pieces = {(): value}
    for axis, p in enumerate(spec):
        n = mesh_shape[axis]
        new: Pieces = {}
        for prefix, piece in pieces.items():
            # Devices that differ only along replicated axes must get the same parts.
            same = tuple(0 if isinstance(spec[a], Replicate) else c for a, c in enumerate(prefix))
            for i, part in enumerate(_split_axis(piece, p, n, hash((seed, axis, same)))):
                new[prefix + (i,)] = part
        pieces = new
    return {c: t.clone() for c, t in pieces.items()}


def _split_axis(t: torch.Tensor, p: Placement, n: int, seed: int) -> list[torch.Tensor]:
    if isinstance(p, Shard):
        return list(torch.chunk(t, n, dim=p.dim))
    if isinstance(p, Replicate):
        return [t] * n
    if isinstance(p, Partial):
        return _partial_parts(t, p.reduce_op, n, seed)
    raise TypeError(f"autopar: unknown placement {p!r}")


def _partial_parts(t: torch.Tensor, op: str, n: int, seed: int) -> list[torch.Tensor]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))

    # Parts on the scale of the value, so that splitting adds no more rounding than
    # the computation itself would.
    scale = t.abs().mean().item() if t.is_floating_point() and t.numel() else 1.0

    def noise() -> torch.Tensor:
        if t.is_floating_point():
            return torch.randn(t.shape, generator=gen, dtype=t.dtype) * (scale or 1.0)
        return torch.randint(-3, 4, t.shape, generator=gen, dtype=t.dtype)

    if op == "sum":
        parts = [noise() for _ in range(n - 1)]
        rest = t - sum(parts) if parts else t
        return parts + [rest]
    if op == "avg":
        parts = [noise() for _ in range(n - 1)]
        return parts + [t * n - sum(parts)] if parts else [t]
    if op in ("max", "min"):
        holder = rng.randrange(n)
        sign = -1 if op == "max" else 1
        return [t if i == holder else t + sign * noise().abs() for i in range(n)]
    raise ValueError(f"autopar: unknown Partial reduce op {op!r}")


def assemble(pieces: Pieces, spec: Spec, mesh_shape: Sequence[int], what: str = "output") -> torch.Tensor:
    """Inverse of :func:`split`; raises SimulationMismatch if replicated copies differ."""
    for axis in reversed(range(len(mesh_shape))):
        n, p = mesh_shape[axis], spec[axis]
        prefixes = dict.fromkeys(c[:axis] for c in pieces)
        pieces = {pre: _combine([pieces[pre + (i,)] for i in range(n)], p, what, axis) for pre in prefixes}
    return pieces[()]


def _combine(parts: list[torch.Tensor], p: Placement, what: str, axis: int) -> torch.Tensor:
    if isinstance(p, Shard):
        return torch.cat(parts, dim=p.dim)
    if isinstance(p, Partial):
        stacked = torch.stack(parts)
        return {
            "sum": lambda: stacked.sum(0, dtype=stacked.dtype),  # int32 stays int32, as in an all-reduce
            "avg": lambda: stacked.to(torch.float64).mean(0).to(stacked.dtype),
            "max": lambda: stacked.amax(0),
            "min": lambda: stacked.amin(0),
        }[p.reduce_op]()
    for other in parts[1:]:
        if not _close(parts[0], other):
            raise SimulationMismatch(
                f"{what}: placement says replicated on mesh axis {axis}, but the devices hold different values"
            )
    return parts[0]


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    return torch.equal(a, b)


def run_strategy(
    info: OpInfo,
    strategy: ShardingStrategy,
    inputs: Sequence[Any],
    mesh_shape: Sequence[int],
    rng: random.Random,
) -> list[torch.Tensor]:
    """Run one strategy of one op on the virtual mesh; returns the reassembled outputs."""
    local_inputs = [split(t, spec, mesh_shape, rng) for t, spec in zip(inputs, strategy.inputs)]
    per_device = run_on_devices(info, strategy, local_inputs, mesh_shape)
    return [
        assemble({c: outs[j] for c, outs in per_device.items()}, spec, mesh_shape, f"{info.name} output {j}")
        for j, spec in enumerate(strategy.outputs)
    ]


def run_on_devices(
    info: OpInfo, strategy: ShardingStrategy, local_inputs: list[Pieces], mesh_shape: Sequence[int]
) -> dict[Coord, list[torch.Tensor]]:
    coords = list(itertools.product(*(range(n) for n in mesh_shape)))
    if registry.communicates(strategy.kernel):  # the devices trade data: run them side by side
        return _run_threaded(info, strategy, local_inputs, tuple(mesh_shape), coords)
    results = {}
    for c in coords:
        ctx = rules.LocalContext(tuple(mesh_shape), c)
        results[c] = _run_device(info, strategy, local_inputs, ctx)
    return results


def _run_device(info: OpInfo, strategy: ShardingStrategy, local_inputs: list[Pieces], ctx) -> list[torch.Tensor]:
    try:
        out = rules.run_local(info, strategy, [pieces[ctx.coord] for pieces in local_inputs], ctx)
    except Exception as exc:  # a strategy whose local op cannot even run is wrong too
        raise SimulationMismatch(
            f"{info.name} {strategy}: the local op failed on device {ctx.coord}: {type(exc).__name__}: {exc}"
        ) from exc
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


def _run_threaded(info, strategy, local_inputs, mesh_shape, coords) -> dict[Coord, list[torch.Tensor]]:
    """One thread per virtual device, trading through a ``VirtualExchange``; the first failure is raised."""
    exchange = VirtualExchange(mesh_shape)
    results: dict[Coord, list[torch.Tensor]] = {}
    failures: list[BaseException] = []

    def device(c: Coord) -> None:
        try:
            results[c] = _run_device(info, strategy, local_inputs,
                                     rules.LocalContext(mesh_shape, c, exchange.bind(c)))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
            failures.append(exc)
            exchange.abort()

    threads = [threading.Thread(target=device, args=(c,)) for c in coords]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise next((f for f in failures if "BrokenBarrierError" not in str(f)), failures[0])
    return results


def reference(info: OpInfo, inputs: Sequence[Any]) -> list[torch.Tensor]:
    """The unsharded op on copies of the inputs (in-place ops must not touch them); a random
    op draws the whole tensor from the running key (``autopar.passes.randomness``)."""
    copies = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    if draws(info.op, info.args, info.kwargs):  # on no mesh axis: one device holds the whole
        out = rules.run_local(info, rules.strategies_for(info, ())[0], copies, rules.LocalContext((), ()))
        return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    args, kwargs = info.fill(copies)
    out = info.op(*args, **kwargs)
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


def check_strategy(
    info: OpInfo,
    strategy: ShardingStrategy,
    inputs: Sequence[Any],
    mesh_shape: Sequence[int],
    rng: random.Random,
    expected: list[torch.Tensor] | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-4,
) -> None:
    """Raise SimulationMismatch unless the strategy reproduces the unsharded op (a random op:
    the whole tensor drawn from the running key, or from a fixed one outside a run)."""
    if draws(info.op, info.args, info.kwargs) and randomness.current_key() is None:
        with randomness.drawing(randomness.run_key(0, 0)):
            return check_strategy(info, strategy, inputs, mesh_shape, rng, expected, rtol, atol)
    expected = reference(info, inputs) if expected is None else expected
    try:
        got = run_strategy(info, strategy, inputs, mesh_shape, rng)
    except SimulationMismatch as exc:
        raise SimulationMismatch(f"{info.name} {strategy} on mesh {tuple(mesh_shape)}: {exc}") from None
    rule = rules.rule_for(info.op)
    values_defined = rule is None or not rule.values_unspecified
    for j, (e, g) in enumerate(zip(expected, got)):
        if e.shape != g.shape or e.dtype != g.dtype or (values_defined and not _close(e, g, rtol, atol)):
            diff = (e.double() - g.double()).abs().max().item() if e.shape == g.shape else "shape"
            raise SimulationMismatch(
                f"{info.name} {strategy} on mesh {tuple(mesh_shape)}: output {j} differs "
                f"(max abs diff {diff}; expected shape {tuple(e.shape)}, got {tuple(g.shape)})"
            )


def simulate_graph(
    graph: StrategyGraph,
    choice: dict[fx.Node, int],
    placeholder_values: Sequence[Any],
    rng: random.Random,
) -> list[torch.Tensor]:
    """Run a whole captured graph with one chosen strategy per node on the virtual mesh.

    Between a producer and a consumer that want different placements, the value is
    resharded (here: reassembled and split again — what a collective achieves). Returns
    the graph's outputs, reassembled.
    """
    mesh = graph.mesh_shape
    env: dict[fx.Node, tuple[list[Pieces], tuple[Spec, ...]]] = {}
    values = iter(placeholder_values)

    def needed(node: fx.Node, spec: Spec | None) -> Pieces:
        (pieces, specs) = env[node]
        if spec is not None and spec == specs[0]:
            return pieces[0]
        whole = assemble(pieces[0], specs[0], mesh, node.name)
        return split(whole, spec, mesh, rng)

    outputs: list[torch.Tensor] = []
    streams = random_ordinals(graph.captured.gm.graph)  # each random op's stream, as codegen numbers them
    for node in graph.captured.nodes():
        if node.op == "placeholder":
            value = next(values)
            if node in graph.nodes:
                spec = graph[node].strategies[choice[node]].output
                env[node] = ([split(value, spec, mesh, rng)], (spec,))
        elif node.op == "call_function" and node.target is operator.getitem:
            producer, index = node.args
            pieces, specs = env[producer]
            env[node] = ([pieces[index]], (specs[index],))
        elif node.op == "call_function":
            ns = graph[node]
            strategy = ns.strategies[choice[node]]
            local_inputs = [needed(src, spec) for src, spec in zip(tensor_inputs(node), strategy.inputs)]
            with randomness.op(streams[node]) if node in streams else contextlib.nullcontext():
                per_device = run_on_devices(ns.info, strategy, local_inputs, mesh)
            n_out = len(strategy.outputs)
            env[node] = (
                [{c: outs[j] for c, outs in per_device.items()} for j in range(n_out)],
                strategy.outputs,
            )
        elif node.op == "output":
            for src in pytree.tree_leaves(node.args[0]):
                if isinstance(src, fx.Node) and src in env:
                    pieces, specs = env[src]
                    outputs.append(assemble(pieces[0], specs[0], mesh, src.name))
                else:
                    outputs.append(src)
    return outputs
