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
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils import _pytree as pytree

from autopar.gradsync import GradientSync, Rider, sync_gradients
from autopar.zero1 import OptimizerSlices, slice_axes
from passes.capture import Captured, capture
from passes.recompute import layers_to_recompute, plan_layers, recompute_layers
from passes.codegen import RankProgram, lower
from passes.placements import Spec, fits, is_partial, local_shape, local_slice, parse_spec, shard_offset, spec_str
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
        stored = storage_specs(captured, plan)
        choice = choice_from_plan(graph, plan)
        # ZeRO-1 parameters are held as their ops use them (autopar.zero1); ZeRO-2 ones
        # (and ZeRO-1 ones read in several layouts) gathered from storage once per step
        level1 = zero1_layouts(graph, choice, {ph: stored[ph] for ph, fqn in captured.params.items()
                                               if plan.zero.get(fqn, 0) == 1 and ph in stored})
        self.program: RankProgram = lower(
            graph, choice, mesh, per_use, storage={ph: spec for ph, spec in stored.items() if ph not in level1},
        )
        if plan.recompute:  # activation checkpointing of the plan's layers
            self.program.gm = recompute_layers(self.program.gm, plan_layers(plan), layers_to_recompute(plan.recompute))
        self.coord = tuple(mesh.get_coordinate())
        self.input_shapes = {
            n.name: tuple(n.meta["val"].shape) for n in captured.nodes("placeholder") if n.name in captured.user_inputs
        }
        # this rank's cut of each whole input, worked out once (a step only compares shapes and narrows)
        self._cuts = {name: Cut.of(shape, self.program.input_specs[name], tuple(mesh.shape), self.coord)
                      for name, shape in self.input_shapes.items()}
        self._target_cuts: dict[tuple[int, ...], Cut] = {}  # target shape -> its cut (the loss laid out)
        self.device = mesh_device(mesh)  # shards live where the mesh's collectives run (nccl: this GPU)
        self.local: dict[str, torch.Tensor] = {}
        for name, value in captured.state_values(model).items():
            spec = self.program.input_specs.get(name)
            local = value.detach() if spec is None else local_slice(value.detach(), spec, mesh.shape, self.coord)
            local = local.to(self.device, copy=True)
            self.local[name] = nn.Parameter(local, value.requires_grad) if name in captured.params else local
        order = backward_order(self.program.gm)
        self.zero1 = OptimizerSlices({ph: self.local[ph] for ph in level1}, self.program.input_specs, stored,
                                     mesh, order)
        self._stored = {ph: stored[ph] for ph in level1}  # where the optimizer's slices lie
        # what the optimizer steps: the parameters, or (ZeRO-1) this rank's slices of them
        self.shards = nn.ParameterList()
        self.shard_names: list[str] = []  # qualified parameter name per entry of ``shards``
        for ph in [ph for ph in self.local if ph in captured.params]:
            self.shards.append(self.zero1.slices.get(ph, self.local[ph]))
            self.shard_names.append(captured.params[ph])
        self.optimizer = optimizer(list(self.shards)) if optimizer is not None else None
        self.grads = GradientSync(self.program.grad_sync, self.local, order, mesh)
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
            cut = self._cuts[name]
            expected = cut.local if local else cut.whole
            if value.shape != expected:
                raise ValueError(
                    f"autopar: expected input {i} of shape {expected} "
                    f"({'this rank' + chr(39) + 's shard' if local else 'the whole batch, as at compile time'}), "
                    f"found {tuple(value.shape)}; the plan is made for the example inputs' shapes — "
                    "re-compile for other shapes"
                )
            values[name] = (value if local else cut.take(value)).to(self.device)
        return values

    def _run_model(self, inputs: tuple, local: bool, observe: Callable | None = None) -> list[torch.Tensor]:
        values = dict(self.local)
        values.update(self._local_inputs(inputs, local))
        with self.program.saving(observe):
            outs = self.gm(*[values[n] for n in self.captured.placeholders])
        return pytree.tree_leaves(outs)

    def forward(self, *inputs: Any) -> Any:
        """Inference: the model's outputs, whole, on every rank."""
        flat = self._run_model(inputs, local=False)
        user = [flat[i] for i in self.captured.user_outputs]
        specs = [self.program.output_specs[i] for i in self.captured.user_outputs]
        wholes = [whole(t, s, self.mesh) if s is not None else t for t, s in zip(user, specs)]
        return pytree.tree_unflatten(wholes, self.captured.out_spec)

    def loss(self, inputs: tuple, target: torch.Tensor, local: bool = False, *,
             observe: Callable[[torch.Tensor, bool], None] | None = None) -> torch.Tensor:
        """The global loss, replicated on every rank, differentiable. ``observe(tensor,
        is_weight)`` is called with every tensor autograd keeps for backward, ``is_weight``
        for gathered weights kept for backward (to measure memory)."""
        check = self._check(inputs, target, local)
        if check is not None:
            sync_gradients({}, {}, self.mesh, [check.rider])
            check.confirm()
        value, spec = self._local_loss(inputs, target, local, observe)
        return whole(value, spec, self.mesh)

    def train_step(self, inputs: tuple, target: torch.Tensor, local: bool = False, *,
                   observe: Callable[[torch.Tensor, bool], None] | None = None) -> torch.Tensor:
        """Forward, backward and optimizer step; returns the global mean loss on every rank.

        ``inputs`` and ``target`` are the whole batch, the same on every rank; with
        ``local=True`` each rank passes only its shard, laid out as ``input_specs()``
        (and ``target_spec()`` once known) say. The check that every rank was given the
        same batch (``check_inputs``) runs alongside the step and raises before the
        optimizer changes anything.
        """
        if self.optimizer is None:
            raise ValueError("autopar: this ParallelModule was compiled without an optimizer factory")
        self.optimizer.zero_grad(set_to_none=True)
        self.zero1.zero_grad()
        check = self._check(inputs, target, local)
        value, spec = self._local_loss(inputs, target, local, observe)
        # the loss may still be this rank's share of a sum: backward from the share is
        # backward from the sum (its all-reduce's backward is the identity), and the value
        # is summed with the gradients, in the same all-reduce; so is the input check
        loss = value.detach().clone()
        riders = [Rider(loss, tuple(a for a, p in enumerate(spec) if isinstance(p, Partial)))]
        self.grads.begin(riders + ([check.rider] if check is not None else []))
        value.backward()
        self.grads.finish()
        if check is not None:
            check.confirm()
        self.zero1.take_gradients()
        self.optimizer.step()
        self.parameters_updated()
        return loss

    def parameters_updated(self) -> None:
        """After ``shards`` were written (by the optimizer, or a checkpoint's load): ZeRO-1's
        whole parameters gathered from the updated slices. Every rank calls it."""
        self.zero1.gather()

    def measure_memory(self, inputs: tuple, target: torch.Tensor, local: bool = False) -> dict[str, int]:
        """Run one ``train_step`` and return this rank's bytes by kind, as measured on any
        device (no allocator statistics needed), in ``Plan.predicted.memory``'s kinds:

        - parameters: the parameter shards and buffers this rank holds (ZeRO-1: whole),
          plus gathered whole copies kept for backward (ZeRO-2; ZeRO-3 frees its copies
          and gathers again in backward, so keeps none);
        - gradients: the shards' ``.grad`` after the step (ZeRO-1: the whole gradients);
        - optimizer: the optimizer's state tensors (the 0-d step counters left out);
        - activations: the distinct storages autograd keeps for backward at the end of
          forward, the loss's included, the parameters' own storages left out.

        Transient buffers (a bucket being gathered, gradients in flight) are not counted.
        """
        own = {p.untyped_storage().data_ptr() for p in self.shards}
        kept: dict[bool, dict[int, int]] = {True: {}, False: {}}

        def observe(t: torch.Tensor, is_weight: bool) -> None:
            storage = t.untyped_storage()
            if storage.data_ptr() not in own:
                kept[is_weight][storage.data_ptr()] = storage.nbytes()

        self.train_step(inputs, target, local, observe=observe)
        # ZeRO-1 keeps whole gradients: count those rather than the slices' views of them
        slices = {id(s) for s in self.zero1.slices.values()}
        grads = [p.grad for p in (*self.shards, *self.zero1.wholes.values())
                 if p.grad is not None and id(p) not in slices]
        state = [t for s in self.optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0]
        return {
            "parameters": sum(t.numel() * t.element_size() for t in self.local.values()) + sum(kept[True].values()),
            "gradients": sum(g.numel() * g.element_size() for g in grads),
            "optimizer": sum(t.numel() * t.element_size() for t in state),
            "activations": sum(kept[False].values()),
        }

    def _check(self, inputs: tuple, target: torch.Tensor, local: bool) -> "SameInputs | None":
        if not self.check_inputs or local:
            return None
        return SameInputs((*inputs, target), self.mesh, self.coord)

    def _local_loss(self, inputs: tuple, target: torch.Tensor, local: bool,
                    observe: Callable | None) -> tuple[torch.Tensor, Spec]:
        """This rank's loss, and its placement (a Partial axis: a share of the sum)."""
        if self.loss_fn is None:
            raise ValueError("autopar: this ParallelModule was compiled without loss_fn; pass loss_fn to compile")
        flat = self._run_model(inputs, local, observe)
        user = [flat[i] for i in self.captured.user_outputs]
        program, loss_cap = self._loss_program_for(target, local)
        values = dict(zip(loss_cap.user_inputs, [*user, self._local_target(program, loss_cap, target, local)]))
        with program.saving(observe):
            out = pytree.tree_leaves(program.gm(*[values[n] for n in loss_cap.placeholders]))
        index = loss_cap.user_outputs[0]
        return out[index], program.output_specs[index]

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
                self.loss_fn, self.captured.out_spec, out_metas, out_specs, target, self.mesh, reduce_output=False
            )
        return self._loss_program, self._loss_captured

    def _output_meta(self, index: int) -> torch.Tensor:
        output_node = next(iter(self.captured.nodes("output")))
        node = pytree.tree_leaves(output_node.args[0])[index]
        return node.meta["val"]

    def _local_target(self, program: RankProgram, cap: Captured, target: torch.Tensor, local: bool) -> torch.Tensor:
        shape = tuple(target.shape)
        cut = self._target_cuts.get(shape)
        if cut is None:
            spec = program.input_specs[cap.user_inputs[-1]]
            if not fits(shape, spec, self.mesh.shape):
                raise ValueError(
                    f"autopar: target of shape {shape} cannot be split as {spec_str(spec)} "
                    f"on mesh {tuple(self.mesh.shape)}; give a target shaped as at the first step"
                )
            cut = self._target_cuts[shape] = Cut.of(shape, spec, tuple(self.mesh.shape), self.coord)
        return target if local else cut.take(target)

    def target_spec(self) -> Spec | None:
        if self._loss_program is None:
            return None
        return self._loss_program.input_specs[self._loss_captured.user_inputs[-1]]

    # --- state ----------------------------------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter reassembled whole (a collective: call it on every rank)."""
        specs = self.parameter_specs()
        return {name: whole(shard.detach(), specs[name], self.mesh) for name, shard in zip(self.shard_names, self.shards)}

    def parameter_specs(self) -> dict[str, Spec]:
        """Qualified name -> the placement of its entry in ``shards`` (ZeRO-1: of the slice)."""
        by_name = {fqn: ph for ph, fqn in self.captured.params.items()}
        return {name: self._stored.get(by_name[name]) or self.program.input_specs[by_name[name]]
                for name in self.shard_names}


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
    target: torch.Tensor, mesh: DeviceMesh | None, reduce_output: bool = True,
) -> tuple[RankProgram, Captured]:
    """Capture ``loss_fn(outputs, target)`` and lay it out from the outputs' placements.
    ``reduce_output`` False: a loss that is a pending sum is returned as this rank's share."""
    example = (*[torch.empty(v.shape, dtype=v.dtype, device="meta") for v in out_metas],
               torch.empty(target.shape, dtype=target.dtype, device="meta"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(_LossOf(loss_fn, out_spec), example)
    graph = build_strategy_graph(cap, tuple(mesh.shape) if mesh is not None else ())
    placeholders = {n.name: n for n in cap.nodes("placeholder")}
    fixed = {placeholders[name]: spec for name, spec in zip(cap.user_inputs, out_specs)}
    choice = _best_target_layout(graph, fixed, placeholders[cap.user_inputs[-1]])
    return lower(graph, choice, mesh, reduce_outputs=reduce_output), cap


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


def zero1_layouts(graph: StrategyGraph, choice: dict[fx.Node, int], stored: dict[str, Spec]) -> set[str]:
    """The ZeRO-1 parameters (placeholder -> stored layout) that can be held as their ops
    use them: every op reads them in one layout, of which the stored one is a further
    split. Their placeholders' strategies are set to that layout in ``choice``."""
    held = set()
    for node, ns in graph.nodes.items():
        if node.name not in stored:
            continue
        needs = set()
        for user in node.users:
            user_ns = graph.nodes.get(user)
            if user_ns is None or user_ns.info is None:
                needs.add(None)  # returned as it is: no op's layout to follow
                continue
            chosen = user_ns.strategies[choice[user]]
            needs.update(need for src, need in zip(tensor_inputs(user), chosen.inputs) if src is node)
        if len(needs) != 1 or None in needs:
            continue
        need = needs.pop()
        outputs = [s.output for s in ns.strategies]
        shape = local_shape(tuple(node.meta["val"].shape), need, graph.mesh_shape)
        if need in outputs and slice_axes(shape, need, stored[node.name], graph.mesh_shape):
            choice[node] = outputs.index(need)
            held.add(node.name)
    return held


def backward_order(gm: fx.GraphModule) -> list[str]:
    """Placeholders in the order backward reaches them: the reverse of their first use."""
    first_use: dict[str, None] = {}
    for node in gm.graph.nodes:
        for x in node.all_input_nodes:
            if x.op == "placeholder":
                first_use.setdefault(x.name, None)
    return list(reversed(first_use))


@dataclass(frozen=True)
class Cut:
    """One rank's shard of a whole tensor of one shape: the shape it has whole and here,
    and the ``narrow`` calls that take it (``local_slice``, worked out once)."""

    whole: tuple[int, ...]
    local: tuple[int, ...]
    narrows: tuple[tuple[int, int, int], ...]  # (dim, start, length)

    @staticmethod
    def of(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int], coord: Sequence[int]) -> Cut:
        if is_partial(spec):
            raise ValueError(f"autopar: cannot cut a whole tensor into a Partial ({spec_str(spec)}); "
                             "expected Shard/Replicate")
        narrows = []
        for dim in sorted({p.dim for p in spec if isinstance(p, Shard)}):
            start, stop = shard_offset(shape, spec, mesh_shape, coord, dim)
            narrows.append((dim, start, stop - start))
        return Cut(tuple(shape), local_shape(shape, spec, mesh_shape), tuple(narrows))

    def take(self, value: torch.Tensor) -> torch.Tensor:
        for dim, start, length in self.narrows:
            value = value.narrow(dim, start, length)
        return value


def whole(local: torch.Tensor, spec: Spec, mesh: DeviceMesh) -> torch.Tensor:
    if all(isinstance(p, Replicate) for p in spec):
        return local
    return DTensor.from_local(local, mesh, spec, run_check=False).full_tensor()


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device a mesh's collectives run on: this rank's GPU under nccl, else the CPU."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


class SameInputs:
    """The check that every rank was given the same batch: a checksum per input tensor,
    written in this rank's row of a table that is summed over the mesh (``rider``: it
    rides along with the gradients' all-reduce); every row must then be the same."""

    def __init__(self, tensors: tuple, mesh: DeviceMesh, coord: Sequence[int] | None = None):
        flat = [t.double() for t in pytree.tree_leaves(tensors) if isinstance(t, torch.Tensor)]
        sums = torch.stack([d.sum() + d.abs().sum() for d in flat])
        high = sums.float().double()  # two float32 parts: exact enough to ride in a float32 bucket
        shape = tuple(mesh.shape)
        self.table = torch.zeros(math.prod(shape), 2, len(flat), dtype=torch.float64, device=sums.device)
        row = 0
        for size, index in zip(shape, coord if coord is not None else mesh.get_coordinate()):
            row = row * size + index
        self.table[row, 0] = high
        self.table[row, 1] = sums - high
        self.rider = Rider(self.table, tuple(range(len(shape))), castable=True)

    def confirm(self) -> None:
        differs = (self.table != self.table[0]).flatten(0, 1).any(dim=0)
        if differs.any():
            bad = int(differs.nonzero()[0])
            raise ValueError(
                f"autopar: the ranks were given different values for input {bad} (expected the same whole "
                "batch on every rank); give every rank the same batch, or pass each rank's shard with "
                "local=True"
            )
