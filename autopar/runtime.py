"""ParallelModule: one rank's share of a model, trained with torch.distributed.

The model's captured graph runs as this rank's program (``passes.codegen``) on local
shards of the parameters, laid out as the plan says. The loss is a second, small
program, captured at the first training step (when a target is first seen) and laid
out by propagation from the model's output placements, so that a data-parallel loss is
computed on local shards and only its sum and count are reduced.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from passes.capture import Captured, capture
from passes.codegen import RankProgram, lower
from passes.placements import Spec, fits, local_shape, local_slice, parse_spec, spec_str
from passes.plan import Plan, choice_from_plan
from passes.propagate import choose_by_propagation, reshard_bytes
from passes.strategies import StrategyGraph, build_strategy_graph, tensor_inputs
from passes.strategy import TensorMeta


class ParallelModule(nn.Module):
    def __init__(
        self,
        model: nn.Module,
        captured: Captured,
        graph: StrategyGraph,
        plan: Plan,
        mesh: DeviceMesh,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None,
        check_inputs: bool = True,
    ):
        super().__init__()
        self.plan = plan
        self.mesh = mesh
        self.captured = captured
        self.loss_fn = loss_fn
        self.check_inputs = check_inputs
        per_use = frozenset(ph for ph, fqn in captured.params.items() if plan.zero.get(fqn, 0) == 3)
        self.program: RankProgram = lower(
            graph, choice_from_plan(graph, plan), mesh, per_use, storage=storage_specs(captured, plan)
        )
        self.coord = tuple(mesh.get_coordinate())
        self.input_shapes = {
            n.name: tuple(n.meta["val"].shape) for n in captured.nodes("placeholder") if n.name in captured.user_inputs
        }
        self.local: dict[str, torch.Tensor] = {}
        self.shards = nn.ParameterList()
        self.shard_names: list[str] = []  # qualified parameter name per entry of ``shards``
        for name, value in captured.state_values(model).items():
            spec = self.program.input_specs.get(name)
            local = value.detach() if spec is None else local_slice(value.detach(), spec, mesh.shape, self.coord)
            if name in captured.params:
                param = nn.Parameter(local.clone(), requires_grad=value.requires_grad)
                self.shards.append(param)
                self.shard_names.append(captured.params[name])
                self.local[name] = param
            else:
                self.local[name] = local.clone()
        self.optimizer = optimizer(list(self.shards)) if optimizer is not None else None
        self._loss_program: RankProgram | None = None
        self._loss_captured: Captured | None = None

    # --- running ------------------------------------------------------------------
    @property
    def gm(self) -> fx.GraphModule:
        return self.program.gm

    def input_specs(self) -> list[Spec]:
        """Placement of each user input: what to pass per rank with ``local=True``."""
        return [self.program.input_specs[n] for n in self.captured.user_inputs]

    def _local_inputs(self, inputs: tuple, local: bool) -> dict[str, torch.Tensor]:
        flat = pytree.tree_leaves(inputs)
        names = self.captured.user_inputs
        if len(flat) != len(names):
            raise ValueError(
                f"autopar: expected {len(names)} input tensor(s), as in the example inputs; found {len(flat)}"
            )
        values = {}
        for i, (name, value) in enumerate(zip(names, flat)):
            spec = self.program.input_specs[name]
            whole_shape = self.input_shapes[name]
            expected = local_shape(whole_shape, spec, self.mesh.shape) if local else whole_shape
            if tuple(value.shape) != tuple(expected):
                raise ValueError(
                    f"autopar: expected input {i} of shape {tuple(expected)} "
                    f"({'this rank' + chr(39) + 's shard' if local else 'the whole batch, as at compile time'}), "
                    f"found {tuple(value.shape)}; the plan is made for the example inputs' shapes — "
                    "re-compile for other shapes"
                )
            values[name] = value if local else local_slice(value, spec, self.mesh.shape, self.coord)
        return values

    def _run_model(self, inputs: tuple, local: bool) -> list[torch.Tensor]:
        values = dict(self.local)
        values.update(self._local_inputs(inputs, local))
        outs = self.gm(*[values[n] for n in self.captured.placeholders])
        return pytree.tree_leaves(outs)

    def forward(self, *inputs: Any) -> Any:
        """Inference: the model's outputs, whole, on every rank."""
        flat = self._run_model(inputs, local=False)
        user = [flat[i] for i in self.captured.user_outputs]
        specs = [self.program.output_specs[i] for i in self.captured.user_outputs]
        wholes = [whole(t, s, self.mesh) if s is not None else t for t, s in zip(user, specs)]
        return pytree.tree_unflatten(wholes, self.captured.out_spec)

    def loss(self, inputs: tuple, target: torch.Tensor, local: bool = False) -> torch.Tensor:
        """The global loss, replicated on every rank, differentiable."""
        if self.loss_fn is None:
            raise ValueError("autopar: this ParallelModule was compiled without loss_fn; pass loss_fn to compile")
        if self.check_inputs:
            same_on_every_rank((*inputs, target), self.mesh, local)
        flat = self._run_model(inputs, local)
        user = [flat[i] for i in self.captured.user_outputs]
        program, loss_cap = self._loss_program_for(target, local)
        values = dict(zip(loss_cap.user_inputs, [*user, self._local_target(program, loss_cap, target, local)]))
        out = pytree.tree_leaves(program.gm(*[values[n] for n in loss_cap.placeholders]))
        index = loss_cap.user_outputs[0]
        return whole(out[index], program.output_specs[index], self.mesh)

    def train_step(self, inputs: tuple, target: torch.Tensor, local: bool = False) -> torch.Tensor:
        """Forward, backward and optimizer step; returns the global mean loss on every rank.

        ``inputs`` and ``target`` are the whole batch, the same on every rank; with
        ``local=True`` each rank passes only its shard, laid out as ``input_specs()``
        (and ``target_spec()`` once known) say.
        """
        if self.optimizer is None:
            raise ValueError("autopar: this ParallelModule was compiled without an optimizer factory")
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(inputs, target, local)
        loss.backward()
        sync_gradients(self.program.grad_sync, self.local, self.mesh)
        self.optimizer.step()
        return loss.detach()

    # --- the loss program ---------------------------------------------------------
    def _loss_program_for(self, target: torch.Tensor, local: bool) -> tuple[RankProgram, Captured]:
        if self._loss_program is None:
            if local:
                raise ValueError(
                    "autopar: call train_step once with the whole batch (local=False) before passing "
                    "per-rank shards, so that the loss can be laid out"
                )
            out_specs = [self.program.output_specs[i] for i in self.captured.user_outputs]
            out_metas = [self._output_meta(i) for i in self.captured.user_outputs]
            self._loss_program, self._loss_captured = build_loss_program(
                self.loss_fn, self.captured.out_spec, out_metas, out_specs, target, self.mesh
            )
        return self._loss_program, self._loss_captured

    def _output_meta(self, index: int) -> torch.Tensor:
        output_node = next(iter(self.captured.nodes("output")))
        node = pytree.tree_leaves(output_node.args[0])[index]
        return node.meta["val"]

    def _local_target(self, program: RankProgram, cap: Captured, target: torch.Tensor, local: bool) -> torch.Tensor:
        spec = program.input_specs[cap.user_inputs[-1]]
        if not fits(target.shape, spec, self.mesh.shape):
            raise ValueError(
                f"autopar: target of shape {tuple(target.shape)} cannot be split as {spec_str(spec)} "
                f"on mesh {tuple(self.mesh.shape)}; give a target shaped as at the first step"
            )
        return target if local else local_slice(target, spec, self.mesh.shape, self.coord)

    def target_spec(self) -> Spec | None:
        if self._loss_program is None:
            return None
        return self._loss_program.input_specs[self._loss_captured.user_inputs[-1]]

    # --- state ----------------------------------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter reassembled whole (a collective: call it on every rank)."""
        by_name = {fqn: ph for ph, fqn in self.captured.params.items()}
        return {
            name: whole(shard.detach(), self.program.input_specs[by_name[name]], self.mesh)
            for name, shard in zip(self.shard_names, self.shards)
        }

    def parameter_specs(self) -> dict[str, Spec]:
        by_name = {fqn: ph for ph, fqn in self.captured.params.items()}
        return {name: self.program.input_specs[by_name[name]] for name in self.shard_names}


class WithLoss(nn.Module):
    """``loss_fn(model(*inputs), target)`` as one module: how the planner sees a model and
    its loss together (``autopar.plan(..., loss_fn=, target=)``)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs_and_target: Any) -> torch.Tensor:
        *inputs, target = inputs_and_target
        return self.loss_fn(self.model(*inputs), target)


class _LossOf(nn.Module):
    def __init__(self, loss_fn: Callable, out_spec: Any):
        super().__init__()
        self.loss_fn = loss_fn
        self.out_spec = out_spec

    def forward(self, *outputs_and_target: Any) -> torch.Tensor:
        *outputs, target = outputs_and_target
        model_output = pytree.tree_unflatten(list(outputs), self.out_spec) if self.out_spec else outputs
        return self.loss_fn(model_output, target)


def build_loss_program(
    loss_fn: Callable, out_spec: Any, out_metas: list[torch.Tensor], out_specs: list[Spec],
    target: torch.Tensor, mesh: DeviceMesh | None,
) -> tuple[RankProgram, Captured]:
    """Capture ``loss_fn(outputs, target)`` and lay it out from the outputs' placements."""
    example = (*[torch.empty(v.shape, dtype=v.dtype, device="meta") for v in out_metas],
               torch.empty(target.shape, dtype=target.dtype, device="meta"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(_LossOf(loss_fn, out_spec), example)
    graph = build_strategy_graph(cap, tuple(mesh.shape) if mesh is not None else ())
    placeholders = {n.name: n for n in cap.nodes("placeholder")}
    fixed = {placeholders[name]: spec for name, spec in zip(cap.user_inputs, out_specs)}
    choice = _best_target_layout(graph, fixed, placeholders[cap.user_inputs[-1]])
    return lower(graph, choice, mesh), cap


def _best_target_layout(graph: StrategyGraph, fixed: dict, target: fx.Node) -> dict[fx.Node, int]:
    """Lay the target out however makes the loss cheapest (usually: like the outputs' batch)."""
    best, best_cost = None, math.inf
    for strategy in graph[target].strategies:
        choice = choose_by_propagation(graph, {**fixed, target: strategy.output})
        cost = 0.0
        for node, ns in graph.nodes.items():
            if ns.info is None:
                continue
            chosen = ns.strategies[choice[node]]
            for src, need in zip(tensor_inputs(node), chosen.inputs):
                src_ns = graph[src]
                have = src_ns.strategies[choice[src]]
                spec = have.outputs[src_ns.follows[1]] if src_ns.follows else have.output
                cost += reshard_bytes(TensorMeta.of(src.meta["val"]), spec, need, graph.mesh_shape)
        if cost < best_cost:
            best, best_cost = choice, cost
    return best


def storage_specs(captured: Captured, plan: Plan) -> dict[str, Spec]:
    """Placeholder -> where the plan stores it, for parameters stored otherwise than used."""
    out = {}
    for ph, fqn in captured.params.items():
        if fqn in plan.params and plan.zero.get(fqn, 0) in (1, 2):
            out[ph] = parse_spec(plan.params[fqn])
    return out


def sync_gradients(grad_sync: dict[str, tuple[int, ...]], params: dict[str, torch.Tensor], mesh: DeviceMesh) -> None:
    """Sum the gradient shares of data-parallel parameters: one all-reduce per mesh axis
    for all of them together (flattened), as DDP does with its buckets."""
    by_axis: dict[int, list[torch.Tensor]] = {}
    for name, axes in grad_sync.items():
        grad = params[name].grad
        if grad is not None:
            for axis in axes:
                by_axis.setdefault(axis, []).append(grad)
    for axis, grads in sorted(by_axis.items()):
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=mesh.get_group(axis))
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def whole(local: torch.Tensor, spec: Spec, mesh: DeviceMesh) -> torch.Tensor:
    return DTensor.from_local(local, mesh, spec, run_check=False).full_tensor()


def same_on_every_rank(tensors: tuple, mesh: DeviceMesh, local: bool) -> None:
    """Every rank must be given the same batch (unless it passes its own shard)."""
    if local:
        return
    flat = [t for t in pytree.tree_leaves(tensors) if isinstance(t, torch.Tensor)]
    summary = torch.tensor([float(t.double().sum()) + float(t.double().abs().sum()) for t in flat], dtype=torch.float64)
    lo, hi = summary.clone(), summary.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if not torch.equal(lo, hi):
        bad = int((lo != hi).nonzero()[0])
        raise ValueError(
            f"autopar: the ranks were given different values for input {bad} (expected the same whole "
            "batch on every rank); give every rank the same batch, or pass each rank's shard with "
            "local=True"
        )
