"""ParallelModule: one rank's share of a model, trained with torch.distributed.

Built from a captured model-plus-loss graph and one strategy per node: the rank keeps
only its local shards of the parameters (the placements the choice gives them), runs
the lowered program (``passes.codegen``), and steps its optimizer on those shards.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from passes.capture import Captured
from passes.codegen import RankProgram, lower
from passes.placements import Spec, local_slice
from passes.strategies import StrategyGraph


class WithLoss(nn.Module):
    """``loss_fn(model(*inputs), target)`` as one module, so the loss is captured too."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs_and_target: Any) -> torch.Tensor:
        *inputs, target = inputs_and_target
        return self.loss_fn(self.model(*inputs), target)


class ParallelModule(nn.Module):
    def __init__(
        self,
        wrapped: WithLoss,
        captured: Captured,
        graph: StrategyGraph,
        choice: dict[fx.Node, int],
        mesh: DeviceMesh,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    ):
        super().__init__()
        self.mesh = mesh
        self.captured = captured
        self.program: RankProgram = lower(graph, choice, mesh)
        self.coord = tuple(mesh.get_coordinate())
        state = captured.state_values(wrapped)
        self.local: dict[str, torch.Tensor] = {}
        self.shards = nn.ParameterList()
        self.shard_names: list[str] = []  # qualified parameter name per entry of self.shards
        for name, value in state.items():
            spec = self.program.input_specs.get(name)
            local = value.detach() if spec is None else local_slice(value.detach(), spec, mesh.shape, self.coord)
            local = local.clone()
            if name in captured.params:
                param = nn.Parameter(local, requires_grad=value.requires_grad)
                self.shards.append(param)
                self.shard_names.append(captured.params[name].removeprefix("model."))
                self.local[name] = param
            else:
                self.local[name] = local
        self.optimizer = optimizer(list(self.shards))

    @property
    def gm(self) -> fx.GraphModule:
        return self.program.gm

    def _placeholder_values(self, inputs: tuple, target: torch.Tensor) -> list[Any]:
        flat = pytree.tree_leaves((*inputs, target))
        if len(flat) != len(self.captured.user_inputs):
            raise ValueError(
                f"autopar: expected {len(self.captured.user_inputs) - 1} input tensor(s) and a "
                f"target, as in the example inputs; found {len(flat)} tensors in all"
            )
        values = dict(self.local)
        for name, value in zip(self.captured.user_inputs, flat):
            spec = self.program.input_specs.get(name)
            values[name] = value if spec is None else local_slice(value, spec, self.mesh.shape, self.coord)
        return [values[name] for name in self.captured.placeholders]

    def loss(self, inputs: tuple, target: torch.Tensor) -> torch.Tensor:
        """The global loss (replicated on every rank), differentiable."""
        outs = self.gm(*self._placeholder_values(inputs, target))
        flat = pytree.tree_leaves(outs)
        local, spec = flat[self.captured.user_outputs[0]], self.program.output_specs[self.captured.user_outputs[0]]
        return whole(local, spec, self.mesh)

    def train_step(self, inputs: tuple, target: torch.Tensor) -> torch.Tensor:
        """Forward, backward and optimizer step; returns the global loss on every rank."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(inputs, target)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter reassembled whole (a collective: call it on every rank)."""
        specs = self.program.input_specs
        by_name = {fqn: ph for ph, fqn in self.captured.params.items()}
        out = {}
        for name, shard in zip(self.shard_names, self.shards):
            spec = specs[by_name["model." + name]]
            out[name] = whole(shard.detach(), spec, self.mesh)
        return out


def whole(local: torch.Tensor, spec: Spec, mesh: DeviceMesh) -> torch.Tensor:
    return DTensor.from_local(local, mesh, spec, run_check=False).full_tensor()
