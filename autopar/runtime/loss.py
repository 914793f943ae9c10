"""The loss as autopar trains it: a second, small program beside the model's.

``build_loss_program`` captures ``loss_fn(outputs, target)`` and lays it out from the
model's output placements (the target however makes the loss cheapest), so that a
data-parallel loss runs on local shards and only its sum is reduced. ``WithLoss`` is the
model and its loss as one module, how the planner sees them together.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from autopar.passes.capture import Captured, capture
from autopar.passes.lowering.codegen import RankProgram, lower
from autopar.passes.loss_memory import best_target_layout
from autopar.passes.placements import Spec
from autopar.passes.propagate import choose_by_propagation
from autopar.passes.strategy_graph import build_strategy_graph


class WithLoss(nn.Module):
    """``loss_fn(model(*inputs), target)`` as one module: how the planner sees a model and
    its loss together (``autopar.plan(..., loss_fn=, target=)``)."""

    capture_subject = "the model or its loss_fn"  # who an error raised while capturing came from

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs_and_target: Any) -> torch.Tensor:
        *inputs, target = inputs_and_target
        return self.loss_fn(self.model(*inputs), target)


class _LossOf(nn.Module):
    """``loss_fn(model_output, target)``, or ``loss_fn(model_output)`` with no target."""

    capture_subject = "the loss function (loss_fn)"

    def __init__(self, loss_fn: Callable, out_spec: Any, takes_target: bool = True):
        super().__init__()
        self.loss_fn = loss_fn
        self.out_spec = out_spec
        self.takes_target = takes_target

    def forward(self, *outputs_and_target: Any) -> torch.Tensor:
        outputs, target = (outputs_and_target[:-1], outputs_and_target[-1:]) if self.takes_target else (
            outputs_and_target, ())
        model_output = pytree.tree_unflatten(list(outputs), self.out_spec) if self.out_spec else outputs
        return self.loss_fn(model_output, *target)


def model_loss(output: Any) -> torch.Tensor:
    """``loss_fn=None``: the model's own loss (a Hugging Face output's ``.loss``, computed
    when ``labels=`` is among the inputs)."""
    loss = getattr(output, "loss", None)
    if loss is None:
        raise ValueError(
            f"autopar: with loss_fn=None the model's own loss is trained, expected an output with .loss (Hugging "
            f"Face: pass labels= among the inputs); found {type(output).__name__} without one; pass labels or loss_fn"
        )
    return loss


def build_loss_program(
    loss_fn: Callable, out_spec: Any, out_metas: list[torch.Tensor], out_specs: list[Spec],
    target: torch.Tensor | None, mesh: DeviceMesh | None, reduce_output: bool = True,
) -> tuple[RankProgram, Captured]:
    """Capture ``loss_fn(outputs, target)`` (``loss_fn(outputs)`` with target None) and lay
    it out from the outputs' placements; only ``target``'s shape and dtype are read.
    ``reduce_output`` False: a loss that is a pending sum is returned as this rank's share."""
    require_arguments(loss_fn, target)
    example = tuple(torch.empty(v.shape, dtype=v.dtype, device="meta") for v in out_metas)
    if target is not None:
        example += (torch.empty(target.shape, dtype=target.dtype, device="meta"),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(_LossOf(loss_fn, out_spec, takes_target=target is not None), example)
    _require_scalar_loss(cap)
    graph = build_strategy_graph(cap, tuple(mesh.shape) if mesh is not None else ())
    placeholders = {n.name: n for n in cap.nodes("placeholder")}
    fixed = {placeholders[name]: spec for name, spec in zip(cap.user_inputs, out_specs)}
    if target is None:
        choice = choose_by_propagation(graph, fixed)
    else:
        choice = best_target_layout(graph, fixed, placeholders[cap.user_inputs[-1]])
    return lower(graph, choice, mesh, reduce_outputs=reduce_output), cap


def require_arguments(loss_fn: Callable | None, target: torch.Tensor | None) -> None:
    """``loss_fn(outputs, target)`` given a target, ``loss_fn(outputs)`` without: a call the
    function cannot take is refused before it is traced or run (where it would read as a
    capture problem, or a missing input of the loss program laid out for the other call)."""
    if loss_fn is None or loss_fn is model_loss:
        return
    with_target = target is not None
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a callable without a signature: the call itself will tell
        return
    try:
        signature.bind(*(("outputs", "target") if with_target else ("outputs",)))
    except TypeError:
        if not with_target:
            raise ValueError(
                f"autopar: expected a target for loss_fn{signature}; found target None; pass it as "
                "train_step(inputs, target) (or loss(inputs, target)), or compile with loss_fn=None to train the "
                "model's own loss"
            ) from None
        raise ValueError(
            f"autopar: expected loss_fn to take (outputs, target); found loss_fn{signature}; give it a second "
            "parameter for the target, or pass target None"
        ) from None


def _require_scalar_loss(cap: Captured) -> None:
    """Backward starts from one number: a loss of any other shape, or a Python number (no
    gradient reaches the model through it), is refused here, at capture."""
    output_node = next(iter(cap.nodes("output")))
    leaves = pytree.tree_leaves(output_node.args[0])
    leaf = leaves[cap.user_outputs[0]] if len(cap.user_outputs) == 1 else None
    value = leaf.meta.get("val") if isinstance(leaf, fx.Node) else leaf
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return
    if len(cap.user_outputs) != 1:
        found = f"{len(cap.user_outputs)} outputs"
    elif isinstance(value, torch.Tensor):
        found = f"a tensor of shape {tuple(value.shape)}"
    else:
        found = f"a Python {type(value).__name__} ({value!r}), which carries no gradient"
    raise ValueError(
        f"autopar: expected loss_fn to return one scalar loss tensor (0-d) computed from the outputs; found "
        f"{found}; return a tensor reduced to one number (reduction='mean', or .mean()), not a Python number "
        "(.item() detaches it)"
    )

