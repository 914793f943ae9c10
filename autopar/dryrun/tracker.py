"""A dry-run rank's memory, measured: its state as fake tensors (``FakeState``, nothing
allocated), the optimizer's state made before the measured step, and torch's MemTracker
(``PeakTracker``) keeping the rank's peak by kind -- parameters, gradients, optimizer state,
activations, and the temporary memory the plan does not predict."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
from torch.distributed._tools.mod_tracker import ModTracker

from autopar.runtime.contract import TrainingModule
from autopar.passes.capture import Captured

KINDS = ("parameters", "gradients", "optimizer", "activations", "temporary")
# MemTracker's reference types -> the plan's kinds. Buffers and constants are held state,
# as the plan counts them; "temporary" is what the plan does not predict: gradients of
# activations in backward, gradient buckets being summed, the optimizer's scratch.
_KIND_OF = {
    _MemRefType.PARAM: "parameters", _MemRefType.BUFFER: "parameters", _MemRefType.GRAD: "gradients",
    _MemRefType.OPT: "optimizer", _MemRefType.ACT: "activations", _MemRefType.TEMP: "temporary",
    _MemRefType.OTH: "temporary",
}
CPU = torch.device("cpu")  # the fake tensors' device (the ranks' real device does not matter to shapes)
# a real run's host memory (a pipeline's whole batch): a fake device apart, whose bytes
# ``peak_memory`` does not count, and views of it charge no device the whole batch's storage
HOST = torch.device("meta")


class FakeState:
    """The model's parameters, buffers and lifted constants as fake tensors of the same shapes,
    dtypes and ``requires_grad`` (read from the model: a meta one allocates nothing), served
    as the runtime reads a model's state (by qualified name)."""

    def __init__(self, captured: Captured, model: nn.Module):
        values = captured.state_values(model)
        self._params = {fqn: nn.Parameter(fake_like(values[ph]), requires_grad=values[ph].requires_grad)
                        for ph, fqn in captured.params.items()}
        self._buffers = {fqn: fake_like(values[ph]) for ph, fqn in captured.buffers.items()}
        self.constants = {name: fake_like(v) for name, v in captured.constant_values.items()}

    def named_parameters(self, remove_duplicate: bool = False):
        return iter(self._params.items())

    def named_buffers(self, remove_duplicate: bool = False):
        return iter(self._buffers.items())


def fake_like(v: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(v.shape), dtype=v.dtype, device=CPU)


def create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state made as its first step makes it (a step from zero gradients),
    so that the tracked step holds it from the start, as every step after the first does
    (torchtitan's estimation runs two steps for this; one optimizer step is cheaper)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def tracker_for(module: TrainingModule) -> "PeakTracker":
    """A MemTracker that knows the rank's state (parameters as parameters, buffers and
    constants as buffers) and optimizer state, and sees its gradients as gradients."""
    tracker = PeakTracker()
    params = list(module.parameters())
    seen = {id(p) for p in params}
    held = nn.Module()
    for i, t in enumerate(module.state_tensors()):
        if id(t) not in seen:
            seen.add(id(t))
            held.register_buffer(f"b{i}", t)
    tracker.track_external(held, module, module.optimizer)
    tracker.watch_gradients(params)
    return tracker


class _ModulesHoldingNoGradients(ModTracker):
    """ModTracker, less the backward hook it puts on a module's inputs (``register_multi_grad_hook``,
    mode "all"), which holds every input's gradient until the last one arrives: the runtime's
    programs take parameters as inputs, so that hook alone held a whole stage's parameter
    gradients to the end of each micro-batch's backward (twice the gradients at GPipe's
    peak), which no real step does. A module's backward is marked ended when the backward
    ends instead, as ModTracker marks it for a module none of whose inputs needs a gradient
    (the dry run reads no per-module statistics)."""

    def _fw_pre_hook(self, mod: nn.Module, input: Any) -> None:
        if torch._dynamo.eval_frame._is_in_optimized_module():
            return
        name, w_mod = self._get_mod_name(mod), weakref.ref(mod)
        self._get_append_fn(w_mod, name, False)()
        if self._user_pre_fw_hook is not None:
            self._user_pre_fw_hook(mod, input)
        if not self.is_bw:
            self._post_bw_callbacks_to_enqueue.append(self._get_pop_fn(w_mod, name, True))


class PeakTracker(MemTracker):
    """MemTracker, with gradients that autograd accumulates into parameters the module does
    not call as submodules (the runtime's programs take them as inputs) counted as gradients,
    as MemTracker's own per-module gradient hook does; and a pipeline stage's program called
    once per micro-batch in one step (MemTracker takes a second forward call of a module for
    the next step: its per-module statistics, which the dry run does not read, keep the first);
    and no module holding its inputs' gradients (``_ModulesHoldingNoGradients``)."""

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = _ModulesHoldingNoGradients()

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            return
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        """The whole rank's peak only. MemTracker's own also updates the peak of every module
        it has seen, looping over all of them after every op: a cost per op that grows with
        the model's depth (most of a 70B dry run's time), for statistics the dry run does not read."""
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = dict(snapshot)

    def watch_gradients(self, params: list[nn.Parameter]) -> None:
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._as_gradient)

    def _as_gradient(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._update_and_maybe_create_winfos(p.grad, _MemRefType.GRAD)


def peak_memory(tracker: PeakTracker) -> tuple[int, dict[str, int]]:
    """The rank's peak in bytes, and its bytes by kind (``KINDS``) at the peak."""
    peak = tracker.get_tracker_snapshot("peak").get(CPU, {})
    memory = {k: 0 for k in KINDS}
    for ref, kind in _KIND_OF.items():
        memory[kind] += int(peak.get(ref, 0))
    return int(peak.get(_TOTAL_KEY, 0)), memory
