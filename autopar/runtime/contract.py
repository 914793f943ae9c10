"""The contract of every module ``autopar.compile`` returns, and the training step they share.

``CompiledModule`` is what a module offers whatever runs inside it (one program on the
whole mesh, a pipeline's stages, a serving plan's prefill and decode): its plan and mesh,
how it splits the batch, the shards of the model's state it holds, the model whole again.
Checkpoints, faults and the dry run read modules through it, never their concrete class.
The calls every rank makes together (``COLLECTIVE_CALLS``) are wrapped once, here, for every
subclass: an exception inside one on any rank reaches every rank
(``autopar.runtime.faults.shared_failures``).

``TrainingModule`` is the training half, written once, as torchtitan's ``Trainer.train_step``
is: a step is ``forward_backward`` (the only part a pipeline runs otherwise: its schedule
over micro-batches), then clipping, then the optimizer step. What the optimizer steps
(the shards, or ZeRO-1/2 slices of them: ``optimizer_slices``), ``no_sync``, clipping and
zeroing are the same code for every layout.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import inspect
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.runtime.batch import DataParallel
from autopar.runtime.faults import failures_shared
from autopar.runtime.clipping import clip_grad_norm_, replicas
from autopar.runtime.draws import Draws
from autopar.runtime.zero1 import OptimizerSlices
from autopar.passes.placements import Spec
from autopar.passes.plan import Plan

# One state tensor this rank holds: its local shard, its placement (None: whole) and the mesh
# the placement is on (a pipeline's intra-op mesh; None: no mesh).
Held = tuple[torch.Tensor, Spec | None, DeviceMesh | None]

# What every rank calls together, by method name -> what a failure message calls it.
COLLECTIVE_CALLS = {
    "forward": "forward", "loss": "loss", "forward_backward": "forward and backward",
    "train_step": "training step", "step": "optimizer step", "clip_grad_norm_": "gradient clipping",
    "full_state_dict": "whole state dict", "generate": "generation",
}


class CompiledModule(nn.Module, abc.ABC):
    """One rank's share of a model laid out by a plan (the module docstring)."""

    plan: Plan
    mesh: DeviceMesh

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """The ``COLLECTIVE_CALLS`` a subclass defines, each wrapped to share its failures."""
        super().__init_subclass__(**kwargs)
        for name, what in COLLECTIVE_CALLS.items():
            method = cls.__dict__.get(name)
            if callable(method) and not getattr(method, "__isabstractmethod__", False):
                setattr(cls, name, failures_shared(what)(method))

    @property
    @abc.abstractmethod
    def data_parallel(self) -> DataParallel:
        """How the plan splits the batch: a ``DistributedSampler``'s ``num_replicas`` and ``rank``."""

    @property
    def pipeline_rank(self) -> int:
        """This rank's place along the pipeline axis (0 without a pipeline)."""
        return 0

    @abc.abstractmethod
    def held_parameters(self) -> dict[str, Held]:
        """Qualified name -> what this rank holds of each parameter (a training module: what
        its optimizer steps, ZeRO-1/2 slices included)."""

    @abc.abstractmethod
    def held_buffers(self) -> dict[str, Held]:
        """Qualified name -> this rank's shard of each buffer of the model."""

    @abc.abstractmethod
    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the model's state this rank holds, as its programs use them
        (parameter shards, buffers, a serving plan's cache): what the dry run measures."""

    @abc.abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's ``state_dict()`` with every tensor whole, in its names; a collective."""

    def generate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise ValueError(
            f"autopar: generate() needs a module compiled to serve; this {type(self).__name__} was compiled to "
            "train (a training plan); compile with a serving plan: autopar.compile(model, mesh, "
            "inference=autopar.Inference(batch=, prompt_len=, max_len=))")


class TrainingModule(CompiledModule):
    """The training step every training layout shares (the module docstring). A subclass
    sets ``optimizer`` (None: compiled without a factory), ``optimizer_slices``, ``draws`` and
    ``_sync`` (True outside ``no_sync()``), and implements ``forward_backward``."""

    optimizer: torch.optim.Optimizer | None
    optimizer_slices: OptimizerSlices
    draws: Draws  # the random stream dropout draws from (checkpoints save it)

    @abc.abstractmethod
    def forward_backward(self, inputs: Any, target: torch.Tensor | None, local: bool, accumulate: int,
                         **options: Any) -> torch.Tensor:
        """Forward and backward of the batch (``accumulate`` micro-batches of it), the
        gradients summed over the ranks that share them; the global mean loss on every rank."""

    def train_step(self, inputs: Any, target: torch.Tensor | None, local: bool = False, *,
                   max_norm: float | None = None, norm_type: float = 2.0, accumulate: int | None = None,
                   **options: Any) -> torch.Tensor:
        """Forward, backward and the optimizer step; returns the global mean loss on every rank.
        ``max_norm``: the summed gradients are clipped first (``clip_grad_norm_``);
        ``accumulate=k``: the batch runs as k micro-batches, their gradients summed once (None:
        the plan's, ``Plan.accumulate``, as it was priced).
        ``local=True``: each rank passes its rows of the batch (``data_parallel``)."""
        self._require_optimizer()
        unknown = sorted(set(options) - _step_options(type(self)))
        if unknown:
            raise TypeError(
                f"autopar: train_step expected the model's inputs in its first argument and the step's options "
                f"(max_norm, norm_type, accumulate, local); found keyword(s) {unknown}; pass them inside the "
                "inputs tuple in the model's order, or, for keyword inputs, compile with example_kwargs= and "
                "give the inputs as a dict")
        self.zero_grad()
        accumulate = self.plan.accumulate if accumulate is None else accumulate
        loss = self.forward_backward(inputs, target, local, accumulate, **options)
        # --- the gradients are summed; clipping goes here, before the optimizer step ---
        if max_norm is not None:
            self.clip_grad_norm_(max_norm, norm_type)
        self.step()
        return loss

    def _require_optimizer(self) -> None:
        if self.optimizer is None:
            raise ValueError(f"autopar: this {type(self).__name__} was compiled without an optimizer factory; pass "
                             "optimizer=lambda params: torch.optim.AdamW(params, lr=...) to autopar.compile")

    def step(self) -> None:
        """The optimizer step on the summed gradients, then what the layout needs after it
        (ZeRO-1/2: the whole parameters gathered from the updated slices). Every rank calls it."""
        self._require_optimizer()
        self.optimizer_slices.take_gradients()  # ZeRO-1: views of the whole gradients as they are now
        self.optimizer.step()
        self.parameters_updated()

    def parameters_updated(self) -> None:
        """After what the optimizer steps was written (by it, or a checkpoint's load):
        ZeRO-1/2's whole parameters gathered from the updated slices. Every rank calls it."""
        self.optimizer_slices.gather()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients: the shards', the optimizer's (ZeRO slices) and the whole
        parameters' they are views of."""
        super().zero_grad(set_to_none)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        self.optimizer_slices.zero_grad()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """As DDP's ``no_sync``: the backward of a loss computed inside (``loss``) leaves this
        rank's gradient shares unsummed, accumulated across backwards; the backward of the
        next loss computed outside sums everything accumulated, once. Then
        ``clip_grad_norm_``, ``step()``, ``zero_grad()``."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the whole model: the norm of every
        parameter's summed gradient, each element counted once over all shards and ranks,
        returned (the same on every rank); this rank's gradient shards scaled in place.
        A collective: every rank calls it, after backward (outside ``no_sync``)."""
        if not self._sync:
            raise ValueError(
                "autopar: clip_grad_norm_ was called inside no_sync(), where the gradients are this rank's unsummed "
                "shares; expected it after the last backward, outside no_sync() (DDP's order), before step()"
            )
        self.optimizer_slices.take_gradients()  # ZeRO-1: the optimizer's slices of the summed gradients (views)
        held = list(self.held_parameters().values())
        copies = [replicas(spec, tuple(mesh.shape) if mesh is not None else ()) for _, spec, mesh in held]
        return clip_grad_norm_([t for t, _, _ in held], copies, self.mesh, max_norm, norm_type, self.device)


@functools.cache
def _step_options(cls: type) -> frozenset[str]:
    """The keyword options a class's ``forward_backward`` takes (read once per class)."""
    return frozenset(inspect.signature(cls.forward_backward).parameters)
