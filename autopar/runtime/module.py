"""ParallelModule: one rank's share of a model, trained with torch.distributed.

The model's captured graph runs as this rank's program (``autopar.passes.lowering.codegen``) on local
shards of the parameters, laid out as the plan says. The loss is a second, small
program, captured at the first training step (when a target is first seen) and laid
out by propagation from the model's output placements, so that a data-parallel loss is
computed on local shards and only its sum and count are reduced.

A batch of another size, and eval mode (``pm.eval()``: dropout off), run programs of
their own (``Variant``): the model captured again at those shapes or in eval mode and laid
out by the same plan (its nodes found by identity, what it does not lay out re-solved with
the weights fixed: ``autopar.passes.planner.relayout``), on the same shards. So
``train_step(accumulate=k)`` runs the program for 1/k of the batch k times and sums the
gradients once, and ``pm(x)`` runs at any batch size.

With a mixed-precision policy (``mp_policy``, FSDP2's ``MixedPrecisionPolicy``) every
program is captured as the model computes in ``param_dtype`` and runs on the float32
master shards, cast once per call (``autopar.runtime.precision``).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from functools import cached_property
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from torch.utils import _pytree as pytree

from autopar.runtime.batch import Cut, DataParallel, IndexBounds, SameInputs, check_dims, rows_text, split_batch
from autopar.runtime.contract import Held, TrainingModule
from autopar.runtime.draws import Draws
from autopar.runtime.gradsync import GradientSync, Rider, sync_gradients
from autopar.runtime.loss import build_loss_program, model_loss, require_arguments
from autopar.runtime.meshes import mesh_device, require_live, whole
from autopar.runtime.precision import (Precision, apply_precision, capture_cast, captured_under_policy,
                                       masters_reduce_dtype, output_under, warn_under_autocast)
from autopar.runtime.state_dicts import in_state_dict_order
from autopar.runtime.variants import (Variant, Variants, backward_order, lower_plan, recompute_plan, settings_key,
                                      settings_of, stored_layouts, synced_by_fqn)
from autopar.runtime.zero1 import OptimizerSlices
from autopar.passes.capture import Captured, capture
from autopar.passes.lowering.codegen import RankProgram
from autopar.passes.placements import Spec, fits, local_slice, spec_str
from autopar.passes.plan import Plan
from autopar.passes.strategy_graph import StrategyGraph, build_strategy_graph


class ParallelModule(TrainingModule):
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
        mp_policy: Any = None,
    ):
        super().__init__()
        self.plan = plan
        self.mesh = mesh
        self.loss_fn = loss_fn
        self.check_inputs = check_inputs
        self.precision = Precision.of(mp_policy)
        # the model is captured again for other input shapes and for eval (a partial, not a submodule:
        # its whole parameters are neither this module's parameters nor in its state_dict)
        self._capture = functools.partial(capture, model)
        self._in_state_dict_order = functools.partial(in_state_dict_order, model)
        if self.precision is not None:  # the program a param_dtype model runs, on the float32 masters
            self._capture = capture_cast(capture, model, self.precision)
            if not captured_under_policy(captured):  # (compile and the dry run capture under it themselves)
                captured = self._recapture(captured)
                graph = build_strategy_graph(captured, tuple(mesh.shape))
        stored = stored_layouts(captured, plan)
        program, level1 = lower_plan(graph, captured, plan, mesh)
        self.coord = tuple(mesh.get_coordinate())
        self.device = mesh_device(mesh)  # shards live where the mesh's collectives run (nccl: this GPU)
        self.local: dict[str, torch.Tensor] = {}
        for name, value in captured.state_values(model).items():
            spec = program.input_specs.get(name)
            local = value.detach() if spec is None else local_slice(value.detach(), spec, mesh.shape, self.coord)
            local = local.to(self.device, copy=True)
            self.local[name] = nn.Parameter(local, value.requires_grad) if name in captured.params else local
        self._reduce_dtype = masters_reduce_dtype(
            self.precision, [t for t in self.local.values() if isinstance(t, nn.Parameter)])
        self._apply_policy_then_recompute(program, captured)
        order = backward_order(program.gm)
        self.optimizer_slices = OptimizerSlices({ph: self.local[ph] for ph in level1}, program.input_specs, stored,
                                                mesh, order)
        self._stored = {ph: stored[ph] for ph in level1}  # where the optimizer's slices lie
        # what the optimizer steps: the parameters, or (ZeRO-1) this rank's slices of them
        self.shards = nn.ParameterList()
        self.shard_names: list[str] = []  # qualified parameter name per entry of ``shards``
        for ph in [ph for ph in self.local if ph in captured.params]:
            self.shards.append(self.optimizer_slices.slices.get(ph, self.local[ph]))
            self.shard_names.append(captured.params[ph])
        self.optimizer = optimizer(list(self.shards)) if optimizer is not None else None
        self._level1 = level1
        # the compiled program, and those for other input shapes and for eval (``_variant_for``);
        # the one a call runs is ``_variant``, which the properties below read
        self._compiled = Variant.of(captured, program, GradientSync(program.grad_sync, self.local, order, mesh,
                                                                    reduce_dtype=self._reduce_dtype),
                                    tuple(mesh.shape), self.coord, self.device)
        self._variants = Variants((self._compiled.shapes, self._compiled.setting_key, True), self._compiled)
        self._variant = self._compiled
        self._sync = True  # False inside ``no_sync()``
        self.draws = Draws.agreed(self.mesh, self.device)  # what random ops draw (dropout): one count per program run

    # --- mixed precision ------------------------------------------------------------
    def _recapture(self, captured: Captured) -> Captured:
        """The model captured again (train mode, as compiled), as it computes under the policy,
        with inputs of the same shapes."""
        settings = settings_of(captured)
        tensors = [n.meta["val"] for n in captured.nodes("placeholder")
                   if n.name in captured.user_inputs and n.name not in settings]
        args, kwargs = self._examples(captured, [tuple(t.shape) for t in tensors], [t.dtype for t in tensors],
                                      settings)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self._capture(tuple(args), kwargs, train=True)

    def _apply_policy_then_recompute(self, program: RankProgram, captured: Captured) -> None:
        """The policy's casts, then the plan's recomputation (``recompute_plan``: in that order)."""
        if self.precision is not None:
            apply_precision(program, captured, self.local, self.precision)
        recompute_plan(program, self.plan)

    # --- programs per input shapes and mode -------------------------------------------
    # A call runs the program for its inputs' whole shapes in this module's mode (train, or
    # eval after ``pm.eval()``: captured with the model in eval mode, dropout off), chosen by
    # ``_running``; the methods below read it through these properties. Every program runs
    # on the same shards (``local``), laid out by the same plan.
    @property
    def captured(self) -> Captured:
        return self._variant.captured

    @property
    def program(self) -> RankProgram:
        return self._variant.program

    @property
    def grads(self) -> GradientSync:
        return self._variant.grads

    @property
    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        return self._variant.input_shapes

    @property
    def _cuts(self) -> dict[str, Cut]:
        return self._variant.cuts

    @property
    def _target_cuts(self) -> dict[tuple[int, ...], Cut]:
        return self._variant.target_cuts

    @property
    def _loss_program(self) -> RankProgram | None:
        return self._variant.loss_program

    @_loss_program.setter
    def _loss_program(self, program: RankProgram) -> None:
        self._variant.loss_program = program

    @property
    def _loss_captured(self) -> Captured | None:
        return self._variant.loss_captured

    @_loss_captured.setter
    def _loss_captured(self, captured: Captured) -> None:
        self._variant.loss_captured = captured

    @contextlib.contextmanager
    def _running(self, inputs: Any, local: bool) -> Iterator[Variant]:
        """Inside: the program for ``inputs`` (whole, or this rank's rows with ``local``) in this mode."""
        previous, self._variant = self._variant, self._variant_for(inputs, local)
        try:
            with self.draws.next_run():
                yield self._variant
        finally:
            self._variant = previous

    def _variant_for(self, inputs: Any, local: bool) -> Variant:
        flat = self._flat_inputs(inputs)
        names = self._compiled.captured.user_inputs
        _check_count(flat, names)
        settings = self._settings(dict(zip(names, flat)))
        tensors = [t for name, t in zip(names, flat) if name not in settings]
        shapes = tuple(self._whole_shape(name, tuple(t.shape), local)
                       for name, t in zip(self._compiled.tensor_names, tensors))
        train = self.training

        def build() -> Variant:
            check_dims(shapes, [self._compiled.input_shapes[n] for n in self._compiled.tensor_names])
            return self._build_variant(shapes, [t.dtype for t in tensors], settings, train=train)

        return self._variants.get((shapes, settings_key(settings), train), build)

    def _settings(self, given: dict[str, Any]) -> dict[str, Any]:
        """The non-tensor inputs among ``given`` (by name), where the compiled example had them:
        each value runs the program captured with it (a variant)."""
        compiled = self._compiled.settings
        for i, (name, value) in enumerate(given.items()):
            if (name in compiled) == isinstance(value, torch.Tensor):
                expected = f"a {type(compiled[name]).__name__}" if name in compiled else "a tensor"
                raise ValueError(
                    f"autopar: expected input {i} ({name}) to be {expected}, as in the example inputs; found a "
                    f"{type(value).__name__}; give each input the kind it was compiled with")
        return {name: value for name, value in given.items() if name in compiled}

    def _whole_shape(self, name: str, shape: tuple[int, ...], local: bool) -> tuple[int, ...]:
        """The whole batch's shape of an input given as it is (``local``: this rank's rows)."""
        if not local or name not in self._batch_inputs:
            return shape
        return (shape[0] * self.data_parallel.num_replicas, *shape[1:])

    def _build_variant(self, shapes: tuple[tuple[int, ...], ...], dtypes: list[torch.dtype],
                       settings: dict[str, Any], train: bool) -> Variant:
        """The model captured at ``shapes`` with the non-tensor inputs ``settings`` (in train
        or eval mode) and laid out by the plan (``lower_plan``) on the same shards (checked)."""
        args, kwargs = self._examples(self._compiled.captured, shapes, dtypes, settings)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            captured = self._capture(tuple(args), kwargs, train=train)
        try:
            graph = build_strategy_graph(captured, tuple(self.mesh.shape))
            # gradients summed as the compiled program sums them: any variant's backward adds to
            # the same .grad, and one sum per step covers them all
            program, level1 = lower_plan(graph, captured, self.plan, self.mesh,
                                         synced_by_fqn(self._compiled.captured, [self._compiled.program]))
        except ValueError as exc:
            raise ValueError(f"autopar: the plan does not lay the model out for inputs of shapes {list(shapes)} "
                             f"({'train' if train else 'eval'} mode): {exc}") from exc
        state = [n for n in captured.placeholders if n in captured.params or n in captured.buffers]
        compiled = self._compiled.program.input_specs
        differs = [n for n in state if n not in self.local or program.input_specs.get(n) != compiled.get(n)]
        if differs or level1 != self._level1:
            raise ValueError(
                f"autopar: the model captured for inputs of shapes {list(shapes)} ({'train' if train else 'eval'} "
                f"mode) holds {differs or sorted(level1 ^ self._level1)} otherwise than the compiled program; "
                "expected the same parameters in the same layouts. Compile for these shapes instead"
            )
        self._apply_policy_then_recompute(program, captured)
        grads = self._compiled.grads
        if program.grad_sync != self._compiled.program.grad_sync:
            grads = GradientSync(program.grad_sync, self.local, backward_order(program.gm), self.mesh,
                                 reduce_dtype=self._reduce_dtype)
        return Variant.of(captured, program, grads, tuple(self.mesh.shape), self.coord, self.device)

    @staticmethod
    def _examples(captured: Captured, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype],
                  settings: dict[str, Any]) -> tuple[tuple, dict]:
        """Example inputs in ``captured``'s input structure: tensors of ``shapes`` and ``dtypes``,
        and the non-tensor inputs' values (``settings``, by name)."""
        device = next(n.meta["val"].device for n in captured.nodes("placeholder")
                      if isinstance(n.meta.get("val"), torch.Tensor))
        tensors = iter([torch.zeros(s, dtype=t, device=device) for s, t in zip(shapes, dtypes)])
        examples = [settings[n] if n in settings else next(tensors) for n in captured.user_inputs]
        in_spec = captured.in_spec
        return ((tuple(examples), {}) if in_spec is None or in_spec.num_leaves != len(examples)
                else pytree.tree_unflatten(examples, in_spec))

    # --- running ------------------------------------------------------------------
    @property
    def gm(self) -> fx.GraphModule:
        return self.program.gm

    def input_specs(self) -> list[Spec | None]:
        """Placement of each user input in this rank's program (``local=True`` takes this
        rank's rows of the batch instead: ``data_parallel``); None for a non-tensor input."""
        return [self.program.input_specs.get(n) for n in self.captured.user_inputs]

    def _local_inputs(self, inputs: Any, local: bool) -> dict[str, Any]:
        """This rank's shard of each input, from the whole batch or (``local``) from this
        rank's rows of it (``data_parallel``): any further split is cut here. Non-tensor
        inputs are passed as given (the variant running was captured with them)."""
        warn_under_autocast("running the compiled model", stacklevel=4)
        require_live()
        flat = self._flat_inputs(inputs)
        names = self.captured.user_inputs
        _check_count(flat, names)
        values = {}
        for i, (name, value) in enumerate(zip(names, flat)):
            if name in self._variant.settings:
                values[name] = value
                continue
            cut = self._cuts[name]
            rows = self._rows(cut.whole) if local and name in self._batch_inputs else None
            expected = rows.local if rows is not None else cut.whole
            if value.shape != expected:
                raise ValueError(
                    f"autopar: expected input {i} of shape {expected} "
                    f"({rows_text(self.data_parallel) if rows is not None else 'the whole batch, as at compile time'}), "
                    f"found {tuple(value.shape)}; the plan is made for the example inputs' shapes — "
                    "re-compile for other shapes"
                )
            if self.precision is not None:
                value = self.precision.input(value)
            want = self._input_dtypes[name]
            if value.dtype != want:
                raise ValueError(
                    f"autopar: expected input {i} of dtype {want}, as in the example inputs; found {value.dtype}; "
                    f"convert it (x.to({want})) or compile with an example of that dtype"
                )
            self._index_bounds.check(i, name, value)
            values[name] = self._cut_from(cut, rows, value.to(self.device))
        return values

    @cached_property
    def _index_bounds(self) -> IndexBounds:
        return IndexBounds.of(self.captured)

    def _flat_inputs(self, inputs: Any) -> list:
        """The input tensors in the captured graph's order. ``inputs``: a tuple of positional
        inputs; for a model compiled with ``example_kwargs``, a dict of keyword inputs, or a
        pair (positional tuple, keyword dict) when it was compiled with both."""
        keywords = self.captured.keyword_names()
        if not keywords:
            return pytree.tree_leaves(inputs)
        if isinstance(inputs, dict):
            return self.captured.flatten_inputs((), inputs)
        if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict):
            return self.captured.flatten_inputs(inputs[0], inputs[1])
        raise ValueError(
            f"autopar: this model was compiled with keyword inputs {keywords}: expected them as a dict "
            f"(or a pair (positional tuple, keyword dict)); found {type(inputs).__name__}"
        )

    def _cut_from(self, cut: Cut, rows: Cut | None, value: torch.Tensor) -> torch.Tensor:
        """The plan's shard of a whole tensor (``rows`` None) or of this rank's batch rows."""
        if rows is None:
            return cut.take(value)
        inner = cut.within(rows)
        if inner is not None:
            return inner.take(value)
        # the plan splits this tensor's batch in an order that is not this rank's rows
        # (over other axes first): put the batch together, then cut
        spec = self.data_parallel.spec(self.mesh.ndim)
        return cut.take(DTensor.from_local(value, self.mesh, spec, run_check=False).full_tensor())

    # --- per-rank data ----------------------------------------------------------------
    @cached_property
    def _batch_inputs(self) -> frozenset[str]:
        """Inputs that carry the batch: their first dim is the first input's (the batch size)."""
        names = self._variant.tensor_names
        shapes = [self.input_shapes[n] for n in names]
        if not shapes or not shapes[0]:
            return frozenset()
        return frozenset(n for n, shape in zip(names, shapes) if shape and shape[0] == shapes[0][0])

    @cached_property
    def _input_dtypes(self) -> dict[str, torch.dtype]:
        return {n.name: n.meta["val"].dtype for n in self.captured.nodes("placeholder")
                if n.name in self._variant.tensor_names}

    @cached_property
    def data_parallel(self) -> DataParallel:
        """How this plan splits the batch: give ``num_replicas`` and ``rank`` to a
        ``DistributedSampler`` and pass ``train_step(..., local=True)`` this rank's rows
        (``global batch / num_replicas`` of them) of every input and of the target."""
        specs = [self.program.input_specs[n] for n in self.captured.user_inputs if n in self._batch_inputs]
        return DataParallel.of([s for s in specs if s is not None], tuple(self.mesh.shape), self.coord)

    def _rows(self, shape: Sequence[int]) -> Cut:
        """This rank's rows of a whole batch tensor of ``shape``."""
        return Cut.of(shape, self.data_parallel.spec(self.mesh.ndim), tuple(self.mesh.shape), self.coord)

    def _run_model(self, inputs: tuple, local: bool, observe: Callable | None = None) -> list[torch.Tensor]:
        values = {**self.local, **self._variant.constants}
        values.update(self._local_inputs(inputs, local))
        with self.program.saving(observe, overlap_backward=True):  # its backward is a backward(): .grad
            outs = self.gm(*[values[n] for n in self.captured.placeholders])
        return pytree.tree_leaves(outs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The model's outputs, whole, on every rank, for a batch of any size (a program
        is captured and laid out for each new size, once). In eval
        mode (``pm.eval()``; ``pm.train()`` to go back) the program captured with the model
        in eval mode runs (dropout off), under ``torch.no_grad()``: nothing is kept for backward.
        Keyword inputs as compiled (``example_kwargs``) are passed as keywords."""
        inputs = (inputs, kwargs) if kwargs else inputs
        with torch.no_grad() if not self.training else contextlib.nullcontext(), self._running(inputs, False):
            flat = self._run_model(inputs, local=False)
            user = [output_under(self.precision, flat[i]) for i in self.captured.user_outputs]
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
        with self._running(inputs, local) as variant:
            value, spec = self._local_loss(inputs, target, local, observe)
        if value.requires_grad:  # its backward sums the gradients, unless inside no_sync() (decided here, as DDP does)
            value = _AtBackward.apply(value, functools.partial(self._at_backward, variant, self._sync))
        return whole(value, spec, self.mesh)

    def forward_backward(self, inputs: tuple, target: torch.Tensor, local: bool = False, accumulate: int = 1, *,
                         observe: Callable[[torch.Tensor, bool], None] | None = None) -> torch.Tensor:
        """``train_step``'s forward and backward (``TrainingModule``): the global mean loss,
        the gradients summed.

        ``inputs`` and ``target`` are the whole batch, the same on every rank; with
        ``local=True`` each rank passes its rows of the batch (``data_parallel``: a
        ``DistributedSampler``'s share), of the inputs and of the target alike. The check that every rank was given the
        same batch (``check_inputs``) runs alongside the step and raises before the
        optimizer changes anything.

        ``accumulate=k``: the batch runs as k micro-batches (dim 0 of every input and of the
        target cut into k equal parts, each run by the program for that batch size), their
        gradients summed in place and synchronised once, after the last backward. Each
        backward starts from its micro-batch's loss / k and the loss returned is the mean of
        the micro-batches' losses: for a mean loss over equal micro-batches (and equal counts
        of counted targets) that is the whole batch's mean, and the step is the whole-batch step.
        """
        check = self._check(inputs, target, local)
        micro = split_batch(inputs, target, accumulate)
        loss = None
        for i, (micro_inputs, micro_target) in enumerate(micro):
            with self._running(micro_inputs, local) as variant:
                value, spec = self._local_loss(micro_inputs, micro_target, local, observe)
            value = value / accumulate if accumulate > 1 else value
            loss = value.detach().clone() if loss is None else loss + value.detach()
            if i == len(micro) - 1:
                # the loss may still be this rank's share of a sum: backward from the share is
                # backward from the sum (its all-reduce's backward is the identity), and the value
                # is summed with the gradients, in the same all-reduce; so is the input check
                riders = [Rider(loss, tuple(a for a, p in enumerate(spec) if isinstance(p, Partial)))]
                variant.grads.begin(riders + ([check.rider] if check is not None else []))
            value.backward()  # before the last: the shares sum in .grad, nothing is sent
        self._gradients_synced(variant)
        if check is not None:
            check.confirm()
        return loss

    def _at_backward(self, variant: Variant, sync: bool) -> None:
        """As a loss's backward starts: outside ``no_sync()``, start summing the gradients as
        backward makes them, and finish when it is done (queued, as DDP's reducer does); inside,
        check that no gradient holds a sum already."""
        if not sync:
            variant.grads.check_local()
            return
        variant.grads.begin()
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._gradients_synced(variant))

    def _gradients_synced(self, variant: Variant) -> None:
        """After the last backward: the data-parallel shares summed, and (ZeRO-1) the
        optimizer's slices of the summed gradients taken (views)."""
        variant.grads.finish()
        self.optimizer_slices.take_gradients()

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
        slices = {id(s) for s in self.optimizer_slices.slices.values()}
        grads = [p.grad for p in (*self.shards, *self.optimizer_slices.wholes.values())
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
        return SameInputs((inputs, target), self.mesh, self.coord)

    def _local_loss(self, inputs: tuple, target: torch.Tensor, local: bool,
                    observe: Callable | None) -> tuple[torch.Tensor, Spec]:
        """This rank's loss, and its placement (a Partial axis: a share of the sum)."""
        if self.loss_fn is None and target is not None:
            raise ValueError(
                "autopar: this ParallelModule was compiled without loss_fn but was given a target; pass loss_fn "
                "to compile, or give target None to train on the model's own loss (Hugging Face: labels= input)"
            )
        require_arguments(self.loss_fn, target)
        flat = self._run_model(inputs, local, observe)
        user = [output_under(self.precision, flat[i]) for i in self.captured.user_outputs]
        program, loss_cap = self._loss_program_for(target, local)
        targets = [] if target is None else [self._local_target(program, loss_cap, target, local)]
        values = dict(zip(loss_cap.user_inputs, [*user, *targets]))
        with program.saving(observe):
            out = pytree.tree_leaves(program.gm(*[values[n] for n in loss_cap.placeholders]))
        index = loss_cap.user_outputs[0]
        return out[index], program.output_specs[index]

    # --- the loss program ---------------------------------------------------------
    def _loss_program_for(self, target: torch.Tensor | None, local: bool) -> tuple[RankProgram, Captured]:
        """The loss laid out at the first step, for the whole target's shape (from this
        rank's rows with ``local``); with no loss_fn and no target, the model's own loss."""
        if self._loss_program is None:
            out_specs = [self.program.output_specs[i] for i in self.captured.user_outputs]
            out_metas = [self._output_meta(i) for i in self.captured.user_outputs]
            example = None if target is None else torch.empty(
                self._whole_target_shape(target, local), dtype=target.dtype, device="meta")
            self._loss_program, self._loss_captured = build_loss_program(
                self.loss_fn or model_loss, self.captured.out_spec, out_metas, out_specs, example, self.mesh,
                reduce_output=False,
            )
        return self._loss_program, self._loss_captured

    def _whole_target_shape(self, target: torch.Tensor, local: bool) -> tuple[int, ...]:
        shape = tuple(target.shape)
        if not local:
            return shape
        if not shape:
            raise ValueError("autopar: with local=True the target is this rank's rows of the batch; found a 0-d target")
        return (shape[0] * self.data_parallel.num_replicas, *shape[1:])

    def _output_meta(self, index: int) -> torch.Tensor:
        output_node = next(iter(self.captured.nodes("output")))
        value = pytree.tree_leaves(output_node.args[0])[index].meta["val"]
        dtype = output_under(self.precision, torch.empty((), dtype=value.dtype, device="meta")).dtype
        return value if dtype == value.dtype else torch.empty(value.shape, dtype=dtype, device="meta")

    def _local_target(self, program: RankProgram, cap: Captured, target: torch.Tensor, local: bool) -> torch.Tensor:
        """This rank's shard of the target, from the whole target or (``local``) its rows."""
        shape = self._whole_target_shape(target, local)
        cut = self._target_cuts.get(shape)
        if cut is None:
            spec = program.input_specs[cap.user_inputs[-1]]
            if not fits(shape, spec, self.mesh.shape):
                raise ValueError(
                    f"autopar: target of shape {shape}{' (whole batch)' if local else ''} cannot be split as "
                    f"{spec_str(spec)} on mesh {tuple(self.mesh.shape)}; give a target shaped as at the first step"
                )
            cut = self._target_cuts[shape] = Cut.of(shape, spec, tuple(self.mesh.shape), self.coord)
        return self._cut_from(cut, self._rows(shape) if local else None, target.to(self.device))

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

    def held_parameters(self) -> dict[str, Held]:
        specs = self.parameter_specs()
        return {name: (shard, specs[name], self.mesh) for name, shard in zip(self.shard_names, self.shards)}

    def held_buffers(self) -> dict[str, Held]:
        compiled = self._compiled
        return {fqn: (self.local[ph], compiled.program.input_specs.get(ph), self.mesh)
                for ph, fqn in compiled.captured.buffers.items()}

    def state_tensors(self) -> list[torch.Tensor]:
        return list(self.local.values())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's ``state_dict()`` with every tensor whole: its parameter and persistent
        buffer names, in its order (a tied weight's names share one tensor). A collective:
        every rank calls it, and every rank gets the same dict."""
        held = self.full_parameters()
        compiled = self._compiled
        for ph, fqn in compiled.captured.buffers.items():
            held[fqn] = whole(self.local[ph], compiled.program.input_specs.get(ph) or (), self.mesh)
        return self._in_state_dict_order(held)


class _AtBackward(torch.autograd.Function):
    """The identity; ``at_backward()`` runs when backward reaches it: on a loss, before any
    gradient of the parameters is made."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, at_backward: Callable[[], None]) -> torch.Tensor:
        ctx.at_backward = at_backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.at_backward()
        return grad, None


def _check_count(flat: list, names: list[str]) -> None:
    if len(flat) != len(names):
        raise ValueError(
            f"autopar: expected {len(names)} input(s), as in the example inputs; found {len(flat)}; pass the "
            "inputs the model was compiled with, or compile with the new ones in the example inputs"
        )
