"""Pipeline-parallel training: the plan's stages run by torch.distributed.pipelining.

The graph, captured at micro-batch size, is cut into the plan's stages and each stage this
rank holds is lowered on the intra-op mesh (``autopar.runtime.stages``), so a stage can
itself be tensor or data parallel. GPipe, 1F1B, interleaved 1F1B, interleaved zero bubble,
ZB-V and DualPipe-V come from torch's schedules (``Schedule.torch_class``), each rank's stages
where the schedule places them (``Schedule.stages_of``: looped, or V-shaped, the first and the
last stage on rank 0); ``PipelineModule`` drives
them: the schedule runs, the loss, the gradients' sums once per step, the optimizer step,
and a hand-written loop's held gradients (``loss``).

Other micro-batch shapes (``train_step(accumulate=k)``: k schedule runs on 1/k of the
batch each, one gradient sum and one optimizer step) and eval mode run stages of their
own (``Stages``), captured again and cut and laid out by the same plan, on the same state.

ZeRO-1/2 (``Plan.zero``, stored as ``Plan.params`` says on the intra-op mesh), as
Megatron's distributed optimizer runs with pipelines: stages hold parameters as their ops
use them, and the optimizer steps this rank's slices of them (``autopar.runtime.zero1``). The
gradients accumulate whole over every micro-batch and schedule run of a step, and are
summed once per step: all-reduced (ZeRO-1), or reduce-scattered into the slices over the
data-parallel axes and then dropped whole (ZeRO-2); the updated slices are all-gathered
into the whole parameters after the optimizer step (``step``).

Mixed precision (``mp_policy``, as ``autopar.runtime.precision`` applies it): the stages
are cut from the model as it computes under the policy and run on the float32 masters,
each stage casting its own parameters once per call; the activations a stage sends and
the gradients it sends back are therefore in ``param_dtype``; the gradients accumulate in
the masters' dtype and are summed over the intra-op mesh in ``reduce_dtype`` (all-reduced,
or at ZeRO-2 reduce-scattered into the slices); floating
inputs are cast as ``cast_forward_inputs`` says and outputs (the loss's inputs) to
``output_dtype``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (PipelineScheduleMulti, ScheduleGPipe, ScheduleLoopedBFS, _Action,
                                                   _ComputationType)
from torch.distributed.tensor import DTensor, Partial
from torch.utils import _pytree as pytree

from autopar.costmodels import Schedule
from autopar.runtime.contract import Held, TrainingModule
from autopar.runtime.draws import Draws
from autopar.runtime.gradsync import GradientSync, Rider, sync_gradients
from autopar.runtime.batch import DataParallel, IndexBounds, check_dims, split_batch
from autopar.runtime.loss import build_loss_program
from autopar.runtime.meshes import mesh_device, require_live, whole
from autopar.runtime.precision import Precision, capture_cast, masters_reduce_dtype, output_under, warn_under_autocast
from autopar.runtime.state_dicts import in_state_dict_order
from autopar.runtime.stages import StagePlace, Stages, lower_stages
from autopar.runtime.variants import Variants, backward_order, stored_layouts, synced_by_fqn
from autopar.runtime.zero1 import OptimizerSlices, slice_axes
from autopar.passes.capture import Captured, capture
from autopar.passes.lowering.codegen import Part, RankProgram
from autopar.passes.placements import Spec, local_slice
from autopar.passes.plan import Plan
from autopar.passes.planner.relayout import relayout
from autopar.passes.strategy_graph import StrategyGraph, build_strategy_graph


class _HeldGradients(torch.autograd.Function):
    """A pipelined loss for a hand-written loop: its value as computed; its backward hands
    the gradient it receives to ``add`` (the schedule has run backward already)."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, anchor: torch.Tensor, add: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.add = add
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.add(grad)
        return None, None, None


def _owned_outputs(module: nn.Module, args: tuple, outputs: tuple) -> tuple:
    """A stage's outputs that carry a gradient, as copies of their own (``split_backward_stages``)."""
    return tuple(t.clone(memory_format=torch.contiguous_format) if t.requires_grad else t for t in outputs)


class _ForwardOnly(ScheduleLoopedBFS):
    """torch's breadth-first order, forward only (no loss: eval and ``forward``), over the plan's
    placement: each rank runs every micro-batch through its stages (``placed(rank)``, ascending),
    looped or V-shaped; torch reads which rank holds a stage from these actions."""

    def __init__(self, stages: list[PipelineStage], micro_batches: int, placed: Callable[[int], list[int]]):
        self._placed = placed
        super().__init__(stages, micro_batches)
        # the backwards were listed for torch's check alone: without a loss none runs, and across
        # a V's turn (two stages on one rank) a backward would read the gradient it hands on
        self.pipeline_order_with_comms = {
            rank: [a for a in actions if a.computation_type not in _BACKWARD_ACTIONS]
            for rank, actions in self.pipeline_order_with_comms.items()}

    def _calculate_single_rank_operations(self, rank: int) -> list[_Action]:
        placed, micro_batches = self._placed(rank), range(self._n_microbatches)
        return ([_Action(s, _ComputationType.FORWARD, mb) for s in placed for mb in micro_batches]
                + [_Action(s, _ComputationType.FULL_BACKWARD, mb) for s in reversed(placed) for mb in reversed(micro_batches)])


_BACKWARD_ACTIONS = (_ComputationType.FULL_BACKWARD, _ComputationType.SEND_B, _ComputationType.RECV_B)


class PipelineModule(TrainingModule):
    def __init__(
        self,
        model: nn.Module,
        captured: Captured,
        graph: StrategyGraph,
        plan: Plan,
        mesh: DeviceMesh,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        mp_policy: Any = None,
    ):
        """``captured``: the model at micro-batch size (under ``mp_policy``: as it computes
        under the policy, ``autopar.runtime.precision.capture_cast``)."""
        super().__init__()
        pp = plan.pipeline
        Schedule.parse(pp.schedule).check(pp.stages, pp.micro_batches, pp.chunks_per_rank)  # e.g. ZB-V's 2 chunks
        names = mesh.mesh_dim_names
        if names is None:
            raise ValueError("autopar: a pipeline plan needs a mesh with axis names (init_device_mesh(..., mesh_dim_names=...))")
        self.plan, self.mesh, self.loss_fn = plan, mesh, loss_fn
        intra_names = tuple(n for i, n in enumerate(names) if i != pp.axis)
        self.intra = mesh[intra_names] if intra_names else None
        self.pp_group = mesh.get_group(pp.axis)
        self.pp_rank = mesh.get_coordinate()[pp.axis]
        # the stages' activations travel on the mesh's device (nccl: this rank's GPU)
        self.device = mesh_device(mesh)
        self._coord = tuple(self.intra.get_coordinate()) if self.intra is not None else ()
        self._intra_shape = tuple(self.intra.shape) if self.intra is not None else ()
        # the model is captured again for other micro-batch shapes and for eval (a partial, not a submodule)
        self._capture = functools.partial(capture, model)
        self._in_state_dict_order = functools.partial(in_state_dict_order, model)
        self.precision = Precision.of(mp_policy)
        self._capture_stages = self._capture if self.precision is None else capture_cast(capture, model, self.precision)
        self._check_captured_under_policy(captured)
        self.params = nn.ParameterList()
        self.shard_names: list[str] = []
        # placeholder -> this rank's shard of a state tensor and its placement, shared by every variant
        self.state: dict[str, tuple[torch.Tensor, Any]] = {}
        choice = relayout(graph, plan).choice
        placeholders = {n.name: n for n in captured.nodes("placeholder")}
        self._input_specs = [graph[placeholders[n]].strategies[choice[placeholders[n]]].output
                             for n in captured.user_inputs]  # each micro-batch's split on the intra-op mesh
        values = captured.state_values(model)
        self._place = StagePlace(self.intra, self.pp_rank, self.pp_group, self.device)
        self._compiled = lower_stages(captured, graph, choice, plan, self._place,
                                      functools.partial(self._take_state, values), self.precision)
        self._reduce_dtype = masters_reduce_dtype(
            self.precision, [t for t, _ in self.state.values() if isinstance(t, nn.Parameter)])
        micro = tuple(tuple(placeholders[n].meta["val"].shape) for n in captured.user_inputs)
        self._variants = Variants((micro, plan.pipeline.micro_batches, True), self._compiled)
        self._variant = self._compiled
        self.optimizer_slices, self._stored = self._optimizer_slices()
        # what the optimizer steps: the stages' parameters, or (ZeRO-1/2) this rank's slices of them
        self.optimizer = optimizer([self.optimizer_slices.slices.get(name, t) for name, (t, _) in self.state.items()
                                    if isinstance(t, nn.Parameter)]) if optimizer is not None else None
        self._loss_scale = 1.0 / pp.micro_batches  # of each micro-batch's loss: 1 / micro-batches per step
        self._axes: tuple[int, ...] = ()  # the intra-op axes the loss is a pending sum over
        self._sync = True  # False inside no_sync()
        self._summed = False  # the gradients hold a sum over ranks (until zero_grad())
        self.draws = Draws.agreed(self.mesh, self.device)  # what random ops draw (dropout): one count per micro-batch

    # --- stages per micro-batch shape and mode ------------------------------------------
    # A call runs the stages for its micro-batches' shapes in this module's mode (train, or
    # eval: captured with the model in eval mode), chosen by ``_running``; the methods below
    # read them through these properties. Every variant runs on the same shards (``state``).
    @property
    def captured(self) -> Captured:
        return self._variant.captured

    @property
    def parts(self) -> list[Part]:
        return self._variant.parts

    @property
    def programs(self) -> list[RankProgram]:
        return self._variant.programs

    @property
    def stages(self) -> list[PipelineStage]:
        return self._variant.stages

    @property
    def stage_state(self) -> list[dict[str, torch.Tensor]]:
        return self._variant.stage_state

    @property
    def schedule(self) -> Any:
        return self._variant.schedule

    @schedule.setter
    def schedule(self, schedule: Any) -> None:
        self._variant.schedule = schedule

    @property
    def _loss(self) -> tuple[RankProgram, Captured] | None:
        return self._variant.loss

    @_loss.setter
    def _loss(self, loss: tuple[RankProgram, Captured]) -> None:
        self._variant.loss = loss

    def _take_state(self, values: dict[str, torch.Tensor], captured: Captured, name: str, spec: Any) -> torch.Tensor:
        """This rank's shard of one of the model's state tensors (a parameter: also given to the optimizer)."""
        local = values[name].detach()
        local = (local_slice(local, spec, self._intra_shape, self._coord) if spec else local).to(self.device, copy=True)
        if name in captured.params:
            local = nn.Parameter(local, requires_grad=values[name].requires_grad)
            self.params.append(local)
            self.shard_names.append(captured.params[name])
        self.state[name] = (local, spec)
        return local

    # --- mixed precision ------------------------------------------------------------
    def _check_captured_under_policy(self, captured: Captured) -> None:
        """Under a policy the stages are cut from the model as it computes under it."""
        if self.precision is None:
            return
        values = {n.name: n.meta["val"] for n in captured.nodes("placeholder") if n.name in captured.params}
        wrong = sorted({str(v.dtype) for v in values.values()
                        if v.is_floating_point() and v.dtype != self.precision.param_dtype})
        if self.precision.param_dtype is not None and wrong:
            raise ValueError(
                f"autopar: under mp_policy the pipeline's stages are cut from the model captured with its "
                f"parameters in param_dtype {self.precision.param_dtype}; found parameters in {wrong}; capture "
                "with autopar.runtime.precision.capture_cast (autopar.compile does)"
            )

    def _output_meta(self, value: torch.Tensor) -> torch.Tensor:
        """An output's traced value (the loss is captured from it) as ``output_under`` makes it."""
        dtype = self.precision.output_dtype if self.precision is not None and value.is_floating_point() else None
        return torch.empty(value.shape, dtype=dtype or value.dtype, device="meta")

    def _optimizer_slices(self) -> tuple[OptimizerSlices, dict[str, Spec]]:
        """ZeRO-1/2 as the plan stores them (``Plan.params``, on the intra-op mesh): the
        optimizer steps this rank's slices of the parameters stored split further than the
        stages use them, over axes on which they are replicated (``autopar.runtime.zero1``); ZeRO-2
        reduce-scatters their gradients into the slices, once per step, over the axes on
        which they are data-parallel shares. Also the stored layout of each sliced one."""
        captured = self._compiled.captured
        stored = stored_layouts(captured, self.plan) if self.intra is not None else {}
        summed = {name: axes for program in self.programs for name, axes in program.grad_sync.items()}
        wholes, reduced, whole_state = {}, {}, []
        for name, spec in stored.items():
            if name not in self.state:  # another pipeline rank's
                continue
            local, used = self.state[name]
            axes = slice_axes(local.shape, used, spec, self._intra_shape)
            if axes is None:  # not a further even split of the layout used: its state stays whole
                whole_state += [captured.params[name]] if spec != used else []
                continue
            wholes[name] = local
            if self.plan.zero[captured.params[name]] == 2:
                reduced[name] = tuple(a for a in axes if a in summed.get(name, ()))
        if whole_state:
            warnings.warn(
                f"autopar: the pipeline plan stores {', '.join(whole_state)} at ZeRO 1/2 in layouts that do not "
                "split evenly further what the stages use; their optimizer state is kept whole (memory above "
                "plan.predicted.memory); re-plan, or store them as used", stacklevel=4)
        order = [name for program in reversed(self.programs) for name in backward_order(program.gm)]
        used_specs = {name: self.state[name][1] for name in wholes}
        slices = OptimizerSlices(wholes, used_specs, stored, self.intra, order, reduced, self._reduce_dtype)
        return slices, {name: stored[name] for name in wholes}

    def _shared_state(self, captured: Captured, name: str, spec: Any) -> torch.Tensor:
        """The compiled stages' shard of a state tensor, for a variant (checked: laid out alike);
        a constant export lifted for this capture is its own."""
        if name in captured.constant_values:
            value = captured.constant_values[name]
            return (local_slice(value, spec, self._intra_shape, self._coord) if spec else value).to(self.device)
        if name not in self.state or self.state[name][1] != spec:
            raise ValueError(
                f"autopar: the model captured again (other micro-batch shapes or eval mode) holds {name} otherwise "
                "than the compiled stages; expected the same parameters in the same layouts. Compile for these shapes"
            )
        return self.state[name][0]

    @contextlib.contextmanager
    def _running(self, inputs: Any, trains: bool) -> Iterator[Stages]:
        """Inside: the stages for ``inputs``' (whole batch) micro-batches in this mode; a step
        that trains cuts the batch into the plan's micro-batches, a forward alone into as many
        as the batch allows (``_micro_batches_for``)."""
        previous, self._variant = self._variant, self._variant_for(inputs, trains)
        try:
            yield self._variant
        finally:
            self._variant = previous

    def _micro_batches_for(self, batch: int, trains: bool) -> int:
        m = self.plan.pipeline.micro_batches
        if not trains:  # a forward alone: the most micro-batches up to the plan's that divide the batch
            return max(d for d in range(1, m + 1) if batch % d == 0)
        if batch % m:
            raise ValueError(
                f"autopar: a training step of this pipeline cuts the batch into the plan's {m} micro-batches; found "
                f"a batch of {batch}; pass a batch that is a multiple of {m} (or accumulate=k over k such batches)")
        return m

    def _variant_for(self, inputs: Any, trains: bool) -> Stages:
        flat = pytree.tree_leaves(inputs)
        names = self._compiled.captured.user_inputs
        if len(flat) != len(names):
            raise ValueError(
                f"autopar: expected {len(names)} input tensor(s), as in the example inputs; found {len(flat)}"
            )
        compiled = [tuple(n.meta["val"].shape) for n in self._compiled.captured.nodes("placeholder") if n.name in names]
        shapes = [tuple(t.shape) for t in flat]
        check_dims(shapes, compiled)
        m = self._micro_batches_for(shapes[0][0] if shapes and shapes[0] else 1, trains)
        micro = tuple((s[0] // m, *s[1:]) for s in shapes)
        train = self.training

        def build() -> Stages:
            device = next(iter(self._compiled.captured.nodes("placeholder"))).meta["val"].device
            examples = tuple(torch.zeros(s, dtype=t.dtype, device=device) for s, t in zip(micro, flat))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                captured = self._capture_stages(examples, train=train)
            graph = build_strategy_graph(captured, self._intra_shape)
            # gradients summed as the compiled stages sum them: one sum per step covers every variant
            sync_as = synced_by_fqn(self._compiled.captured, self._compiled.programs)
            return lower_stages(captured, graph, relayout(graph, self.plan).choice, self.plan, self._place,
                                self._shared_state, self.precision, micro_batches=m, sync_as=sync_as)

        return self._variants.get((micro, m, train), build)

    def _build_schedule(self, target_micro: torch.Tensor | None) -> None:
        """The schedule of the running stages; with ``target_micro`` None, one for forward
        only (no loss). Gradients are not scaled by the schedule: each micro-batch's loss is
        (``_loss_scale``), so that several schedule runs can accumulate in ``.grad``."""
        pp = self.plan.pipeline
        if target_micro is None:  # forward only: each micro-batch through every stage, in order
            placed = functools.partial(Schedule.parse(pp.schedule).stages_of, ranks=pp.stages, chunks=pp.chunks_per_rank)
            self.schedule = (_ForwardOnly(self.stages, self._variant.micro_batches, placed) if len(self.stages) > 1
                             else ScheduleGPipe(self.stages[0], self._variant.micro_batches))
            self._variant.trains = False
            return
        self._build_loss(target_micro)
        # torch's class for the plan's schedule; one that splits backward runs each stage's
        # weight gradients apart from its input gradients (PipelineStage's own split, over the
        # stage's parameters), all of them before the schedule's step returns: the sums
        # (``_sum_gradients``) and the optimizer step see every micro-batch's
        schedule = Schedule.parse(pp.schedule)
        if schedule.split_backward:
            self.split_backward_stages()
        stage_arg = self.stages if issubclass(schedule.torch_class, PipelineScheduleMulti) else self.stages[0]
        self.schedule = schedule.torch_class(stage_arg, pp.micro_batches, scale_grads=False, loss_fn=self._micro_loss)
        self._variant.trains = True

    def split_backward_stages(self) -> None:
        """The running stages made ready for a split backward (zero bubble, and its dry run):
        torch detaches a stage's outputs in place once their input gradients are made, which
        fails on a view (a value a stage passes on unchanged) and breaks the weight gradients of
        an output the stage's own ops saved (a residual stream read again inside the stage); so
        each stage sends its own copy of what carries a gradient. A recomputed layer is rebuilt
        for each part (its random draws under the same key each time: ``recompute._Drawing``)."""
        for stage in self.stages:
            if not getattr(stage.submod, "_autopar_owned_outputs", False):
                stage.submod.register_forward_hook(_owned_outputs)
                stage.submod._autopar_owned_outputs = True

    def _build_loss(self, target_micro: torch.Tensor) -> None:
        """The last stage's loss program for one micro-batch's target (this rank holds the
        last stage), apart from the schedule: the dry run replays the schedule's order itself."""
        last = self.programs[-1] if self.stages[-1].is_last else None
        if last is not None:
            out_metas = [self._output_meta(n.meta["val"]) for n in self.parts[-1].outputs]
            # a data-parallel loss stays this rank's share of the sum (backward from a share is
            # backward from the sum); the shares are summed once per step, with the gradients
            self._loss = build_loss_program(self.loss_fn, self.captured.out_spec, out_metas, last.output_specs,
                                            target_micro, self.intra, reduce_output=False)

    def _micro_loss(self, outputs: Any, target: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss: this rank's share of it where the loss is a pending sum."""
        program, cap = self._loss
        outs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        values = dict(zip(cap.user_inputs, [*(output_under(self.precision, o) for o in outs), target]))
        flat = pytree.tree_leaves(program.gm(*[values[n] for n in cap.placeholders]))
        return flat[cap.user_outputs[0]] * self._loss_scale

    def _loss_axes(self) -> tuple[int, ...]:
        """The intra-op axes over which the loss is a pending sum (its shares' axes)."""
        program, cap = self._loss
        spec = program.output_specs[cap.user_outputs[0]] or ()
        return tuple(a for a, p in enumerate(spec) if isinstance(p, Partial))

    def _micro_batched(self, x: torch.Tensor, spec) -> torch.Tensor:
        """This rank's shard of each micro-batch, stacked so the schedule's chunking finds them,
        cut where ``x`` lies (host memory in a real run): the caller moves only these rows."""
        pieces = x.chunk(self._variant.micro_batches)
        if self.intra is None or spec is None:
            return torch.cat(pieces)
        return torch.cat([local_slice(p, spec, self.intra.shape, self.intra.get_coordinate()) for p in pieces])

    @functools.cached_property
    def data_parallel(self) -> DataParallel:
        """As ``ParallelModule.data_parallel``: the intra-op axes that split the batch of
        every micro-batch (ranks of one data-parallel group, all its stages included, share
        a ``rank``); ``axes`` are axes of the whole mesh."""
        if self.intra is None:
            return DataParallel(1, 0, ())
        specs = [spec for name, spec in zip(self._compiled.captured.user_inputs, self._input_specs)
                 if name in self._batch_inputs]
        dp = DataParallel.of(specs, tuple(self.intra.shape), tuple(self.intra.get_coordinate()))
        intra_axes = [a for a in range(self.mesh.ndim) if a != self.plan.pipeline.axis]
        return DataParallel(dp.num_replicas, dp.rank, tuple(intra_axes[a] for a in dp.axes))

    @functools.cached_property
    def _batch_inputs(self) -> list[str]:
        """Inputs that carry the batch: their first dim is the first input's."""
        shapes = {n.name: tuple(n.meta["val"].shape) for n in self.captured.nodes("placeholder")}
        first = shapes[self.captured.user_inputs[0]] if self.captured.user_inputs else ()
        return [n for n in self.captured.user_inputs if first and shapes[n] and shapes[n][0] == first[0]]

    def _whole_batch(self, inputs: tuple, target: torch.Tensor) -> tuple[tuple, torch.Tensor]:
        """Per-rank rows (``local=True``) put together over the data-parallel axes, in host
        memory: the stages cut their rows from the whole batch there and move only those
        (``_micro_batched``), so the device holds the whole batch only while it is gathered."""
        spec = self.data_parallel.spec(self.mesh.ndim)
        batch = set(self._batch_inputs)

        def gathered(x: torch.Tensor, carries_batch: bool = True) -> torch.Tensor:
            if not carries_batch or not self.data_parallel.axes:
                return x  # the whole batch already, or the same on every rank: cut where it lies
            return DTensor.from_local(x.to(self.device), self.mesh, spec, run_check=False).full_tensor().cpu()

        flat, tree = pytree.tree_flatten(inputs)
        flat = [gathered(x, name in batch) for x, name in zip(flat, self.captured.user_inputs)]
        return pytree.tree_unflatten(flat, tree), gathered(target)

    @property
    def pipeline_rank(self) -> int:
        return self.pp_rank

    def forward_backward(self, inputs: tuple, target: torch.Tensor, local: bool = False,
                         accumulate: int = 1) -> torch.Tensor:
        """``train_step``'s forward and backward (``TrainingModule``): every micro-batch's
        through the schedule, the gradients summed once; the global mean loss on every rank.
        ``accumulate=k``: the batch runs as k schedule steps, each on 1/k of it (dim 0 of
        every input and of the target), their gradients summed in place and synchronised
        once: for a mean loss, the whole batch's step. ``local=True``: each rank passes its
        rows of the batch (``data_parallel``)."""
        if local:
            inputs, target = self._whole_batch(inputs, target)
        losses: list[torch.Tensor] = []
        for micro_inputs, micro_target in split_batch(inputs, target, accumulate):
            losses += self._forward_backward(micro_inputs, micro_target, 1.0 / accumulate)
        # each loss is its micro-batch's / (micro-batches in the step): their sum is the mean
        total = self._sum_gradients(self._stacked(losses))
        return self._on_every_rank(total)

    def loss(self, inputs: tuple, target: torch.Tensor, local: bool = False) -> torch.Tensor:
        """For a loop written by hand (``no_sync()``, ``clip_grad_norm_``, ``step()``,
        ``zero_grad()``, as ``ParallelModule``): the global mean loss of the batch, on every
        rank, whose ``backward()`` adds this batch's gradients to ``.grad``.

        A pipeline cannot wait for ``backward()``: its schedule runs every micro-batch's
        forward and backward now, and the gradients it makes are held aside. The loss's
        backward adds them, times the gradient it receives (``(loss / k).backward()`` adds
        1/k of them: gradients are linear in the loss), and outside ``no_sync()`` then sums
        everything accumulated over the data-parallel ranks, once. A loss whose backward is
        never called adds nothing."""
        if local:
            inputs, target = self._whole_batch(inputs, target)
        held = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            losses = self._forward_backward(inputs, target, 1.0)
            made = [p.grad for p in self.params]
        finally:
            for p, grad in zip(self.params, held):
                p.grad = grad
        value = self._stacked(losses)
        if self.intra is not None and losses:  # the last stage's loss shares, summed as train_step sums them
            sync_gradients({}, {}, self.intra, [Rider(value, self._axes)], flatten=False)
        value = self._on_every_rank(value)
        add = functools.partial(self._add_gradients, made, self._sync)
        return _HeldGradients.apply(value, torch.zeros((), requires_grad=True), add)

    def _add_gradients(self, made: list[torch.Tensor | None], sync: bool, scale: torch.Tensor) -> None:
        """A hand-written loop's backward (``loss``): the gradients its schedule run made,
        times ``scale``, added to ``.grad``; outside ``no_sync()``, then summed over ranks."""
        if not sync and self._summed:
            raise ValueError(
                "autopar: a backward inside no_sync() after a backward outside it: the gradients hold a sum over "
                "ranks already, and this rank's share would be added to it unsummed; expected the micro-steps "
                "inside no_sync() first and the last one outside it (DDP's order), then step() and zero_grad()"
            )
        made = [None if grad is None else grad * scale.to(grad) for grad in made]
        if sync and self._summed:  # .grad holds sums already: sum only what this backward adds
            held = [p.grad for p in self.params]
            for p, grad in zip(self.params, made):
                p.grad = grad
            self._sum_gradients(None)
            made = [p.grad for p in self.params]
            for p, grad in zip(self.params, held):
                p.grad = grad
            sync = False
        for p, grad in zip(self.params, made):
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad.add_(grad)
        if sync:  # this rank's shares accumulated since zero_grad(), summed once
            self._sum_gradients(None)

    def _forward_backward(self, inputs: tuple, target: torch.Tensor, scale: float) -> list[torch.Tensor]:
        """One schedule run over ``inputs`` (forward and backward of every micro-batch),
        each micro-batch's loss scaled by ``scale`` / micro-batches; its gradients added to
        ``.grad``; this rank's micro-batch losses (the last stage's)."""
        require_live()
        for i, (name, x) in enumerate(zip(self.captured.user_inputs, pytree.tree_leaves(inputs))):
            self._index_bounds.check(i, name, x)
        pp = self.plan.pipeline
        self._loss_scale = scale / pp.micro_batches
        with self._running(inputs, trains=True):
            if not self._variant.trains:  # none yet, or one made for forward only (a call before training)
                self._build_schedule(target.chunk(pp.micro_batches)[0])
            losses = self._run_schedule(inputs, target)
            self._axes = self._loss_axes() if losses else ()
        return losses

    @functools.cached_property
    def _index_bounds(self) -> IndexBounds:
        return IndexBounds.of(self.captured)

    def _stacked(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """This rank's share of the loss: the sum of its micro-batch losses (zero off the last stage)."""
        if not losses:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.stack(losses).sum().detach()

    def _sum_gradients(self, total: torch.Tensor | None) -> torch.Tensor | None:
        """The gradients' data-parallel shares summed over the intra-op mesh, once per
        step, each stage's own way; ``total`` (the last stage's loss shares) rides along."""
        if self.intra is not None:
            for program, named in zip(self.programs, self.stage_state):
                # the last stage's loss shares are summed along with its gradients
                last = total is not None and self.stages[-1].is_last and program is self.programs[-1]
                riders = [Rider(total, self._axes)] if last else []
                # stages differ in their axes: no group is made for them (flatten=False)
                # (ZeRO-2: not over the axes its reduce-scatter sums, just below)
                grad_sync = self.optimizer_slices.all_reduced(program.grad_sync)
                GradientSync(grad_sync, named, list(grad_sync), self.intra, overlap=False, flatten=False,
                             reduce_dtype=self._reduce_dtype).finish(riders)
            self.optimizer_slices.take_gradients()  # ZeRO-1: the slices' gradients (views); ZeRO-2: reduce-scattered
        self._summed = True
        return total

    def _on_every_rank(self, total: torch.Tensor) -> torch.Tensor:
        """The last stage's loss, on every rank of the pipeline."""
        total = total.to(torch.float64)
        dist.all_reduce(total, group=self.pp_group)  # only the last stage holds it
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._summed = False

    def _run_schedule(self, inputs: tuple, target: torch.Tensor | None) -> list[torch.Tensor]:
        """One run of the running stages' schedule over the batch ``inputs`` (forward only
        when ``target`` is None); this rank's micro-batch losses (the last stage's)."""
        warn_under_autocast("running the compiled pipeline", stacklevel=4)
        kwargs: dict[str, Any] = {}
        losses: list[torch.Tensor] = []
        if self.stages[-1].is_last and target is not None:
            kwargs["target"] = self._stage_target(target)
            kwargs["losses"] = losses
        self.start_draws()
        run = self.schedule.step if target is not None else self.schedule.eval
        if self.stages[0].is_first:
            run(*self._stage_inputs(inputs), **kwargs)
        else:  # no stage here reads the inputs: nothing of them is moved to the device
            run(**kwargs)
        return losses

    def start_draws(self) -> None:
        """Before a schedule run: its micro-batches take the next counts of ``draws``, micro-batch
        j the j-th on every stage (as ``ParallelModule`` takes one per micro-batch it runs)."""
        first = self.draws.take(self._variant.micro_batches)
        for stage in self._variant.stages:
            stage.submod.start(self.draws, first)

    def _stage_inputs(self, inputs: tuple) -> list[torch.Tensor]:
        """The first stage's arguments: this rank's rows of each input, on the device."""
        flat = pytree.tree_leaves(inputs)
        first = self.programs[0]
        rows = [self._micro_batched(x, first.input_specs.get(n.name))
                for x, n in zip(flat, self.parts[0].inputs[-len(flat):])]
        if self.precision is not None:  # cast where the rows lie, as the whole batch was cast before
            rows = [self.precision.input(x) for x in rows]
        return [x.to(self.device) for x in rows]

    def _stage_target(self, target: torch.Tensor) -> torch.Tensor:
        """The last stage's target: this rank's rows of it, on the device (after ``_build_loss``)."""
        program, cap = self._loss
        return self._micro_batched(target, program.input_specs[cap.user_inputs[-1]]).to(self.device)

    def forward(self, *inputs: Any) -> Any:
        """The model's outputs, whole, on every rank (a forward through the pipeline, no
        gradients), for a batch of any size that splits into the plan's micro-batches as
        its splits need. In eval mode (``pm.eval()``; ``pm.train()`` to go back) the stages
        captured with the model in eval mode run (dropout off)."""
        with torch.no_grad(), self._running(inputs, trains=False):
            # a training schedule runs forward alone by its ``eval``, except a V's: its order
            # turns at the last stage, which then waits on the loss (the next step rebuilds it)
            if self.schedule is None or (self._variant.trains and Schedule.parse(self.plan.pipeline.schedule).v_shaped):
                self._build_schedule(None)
            self._run_schedule(inputs, None)
            outputs = self._gathered_outputs() if self.stages[-1].is_last else None
            pp = self.plan.pipeline
            last = Schedule.parse(pp.schedule).rank_of(pp.stages * pp.chunks_per_rank - 1, pp.stages)  # holds the loss
            box = [outputs]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.pp_group, last), group=self.pp_group)
            user = [box[0][i] for i in self.captured.user_outputs]
            return pytree.tree_unflatten(user, self.captured.out_spec)

    def _gathered_outputs(self) -> list[torch.Tensor]:
        """The last stage's outputs of the schedule run just now, whole: each micro-batch's
        gathered over the intra-op mesh, then the micro-batches put together along dim 0."""
        chunks = self.stages[-1].output_chunks
        specs = self.programs[-1].output_specs
        wholes = []
        for j, spec in enumerate(specs):
            pieces = [chunk[j] if isinstance(chunk, tuple) else chunk for chunk in chunks]
            if self.intra is not None and spec is not None:
                pieces = [whole(p, spec, self.intra) for p in pieces]
            wholes.append(output_under(self.precision, torch.cat(pieces).cpu()))
        return wholes

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, on every rank (collectives over the whole mesh)."""
        mine = {}
        for stage_program, stage in zip(self.programs, self.stages):
            module = stage.submod
            for node, local in zip([n for n in self.parts[stage.stage_index].inputs if n.name in self.captured.params],
                                   module.params):
                spec = stage_program.input_specs.get(node.name)
                value = whole(local.detach(), spec, self.intra) if self.intra is not None and spec else local.detach()
                mine[self.captured.params[node.name]] = value
        gathered: list[dict] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(gathered, mine, group=self.pp_group)
        return {k: v for d in gathered for k, v in d.items()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """As ``ParallelModule.full_state_dict``: the model's ``state_dict()`` whole, in its
        names and order, on every rank (collectives over the whole mesh)."""
        buffers = self._compiled.captured.buffers
        mine = {buffers[ph]: whole(t.detach(), spec, self.intra) if self.intra is not None and spec else t.detach()
                for ph, (t, spec) in self.state.items() if ph in buffers}
        gathered: list[dict] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(gathered, mine, group=self.pp_group)
        held = self.full_parameters() | {k: v for d in gathered for k, v in d.items()}
        return self._in_state_dict_order(held)

    def held_parameters(self) -> dict[str, Held]:
        """Qualified name -> what the optimizer steps of each of this rank's parameters
        (ZeRO-1/2: its slice), its placement on the intra-op mesh (None: whole) and that mesh."""
        params = self._compiled.captured.params
        return {params[name]: (self.optimizer_slices.slices.get(name, shard), self._stored.get(name, spec), self.intra)
                for name, (shard, spec) in self.state.items() if isinstance(shard, nn.Parameter)}

    def held_buffers(self) -> dict[str, Held]:
        buffers = self._compiled.captured.buffers
        return {buffers[ph]: (t, spec, self.intra) for ph, (t, spec) in self.state.items() if ph in buffers}

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for named in self.stage_state for t in named.values()] + [
            t for stage in self.stages for t in stage.submod.state]
