"""What the written module's layout costs, priced by the cost model that priced the plan.

Where torch's APIs express every choice of the plan, the written module is the plan, and its
predicted step is the plan's. Where they do not (``Exported.notes``: the nearest layout is
used), the exported layout is priced as pins (``autopar.passes.planner.constraints``): every
parameter stored as the written module stores it (its tensor-parallel style's placement on the
tensor axes, FSDP2's shard along its dim on the sharded axes, whole elsewhere), each FSDP group's
ZeRO level as torch runs it (``reshard_after_forward=True``: 3; ``False``: 2, the nearest; DDP: 0),
the plan's recomputed layers and its pipeline; the planner finds the fastest plan of the
rest under them, on the plan's mesh and hardware, with no memory limit (the written module runs
whatever memory it needs: the price says how much). The planner sits on a floor above the
export, so it hands its pricer in (``use_pricer``: ``autopar.passes.planner.export_price``,
which ``autopar`` loads); the pins are plain data here (``Constraints.to_dict``'s form).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard

from autopar.costmodels.presets import PRESETS
from autopar.passes.placements import spec_str

# (plan, captured, pins as Constraints.to_dict writes them) -> (step seconds, bytes on the fullest
# device); raises ValueError where no plan honours them. Set by the planner (``use_pricer``).
Pricer = Callable[[Any, Any, dict], tuple[float, float]]
_pricer: list[Pricer] = []


def use_pricer(pricer: Pricer) -> None:
    """Price written layouts with ``pricer`` (the planner's, ``autopar.passes.planner.export_price``)."""
    _pricer[:] = [pricer]


@dataclass(frozen=True)
class ExportedCost:
    """The written module's predicted step beside the plan's (seconds, bytes on the fullest
    device); ``step_time`` None where it could not be priced (``why``)."""

    plan_step_time: float
    plan_memory: float
    step_time: float | None
    memory: float | None
    why: str = ""

    def line(self) -> str:
        plan = f"{self.plan_step_time * 1e3:.4g} ms, {self.plan_memory / 2**30:.3g} GiB per device"
        if self.step_time is None:
            return f"predicted: the plan {plan}; the written module not priced ({self.why})"
        change = 100 * (self.step_time / self.plan_step_time - 1) if self.plan_step_time else 0.0
        return (f"predicted: the written module {self.step_time * 1e3:.4g} ms, {self.memory / 2**30:.3g} GiB per "
                f"device; the plan {plan} ({change:+.3g}% step time"
                + (": torch expresses every choice" if not self.why else f": {self.why}") + ")")


def exported_cost(plan, captured, model: nn.Module, reading, tp, dp, notes: list[str]) -> ExportedCost:
    """The written module's predicted step (module docstring); ``tp``, ``dp``: the export's
    tensor-parallel styles and batch layout (None where it has none), ``notes``: what differs."""
    plan_step, plan_memory = plan.predicted.step_time, sum(plan.predicted.memory.values())
    if not notes:
        return ExportedCost(plan_step, plan_memory, plan_step, plan_memory)
    if plan.hardware not in PRESETS:
        why = f"the plan's hardware {plan.hardware!r} is no preset this can price again"
        return ExportedCost(plan_step, plan_memory, None, None, why)
    if plan.mp_policy or plan.includes_loss:
        why = "a plan under a mixed-precision policy or with its loss is captured otherwise than here"
        return ExportedCost(plan_step, plan_memory, None, None, why)
    if not _pricer:
        return ExportedCost(plan_step, plan_memory, None, None, "no pricer: import autopar (its planner prices it)")
    try:
        step, memory = _pricer[0](plan, captured, exported_pins(plan, model, reading, tp, dp))
    except ValueError as exc:
        return ExportedCost(plan_step, plan_memory, None, None, str(exc).removeprefix("autopar: ")[:200])
    return ExportedCost(plan_step, plan_memory, step, memory, f"{len(notes)} choices as torch expresses them")


def exported_pins(plan, model: nn.Module, reading, tp, dp) -> dict[str, Any]:
    """The written module's layout as pins (``Constraints.from_dict``'s form): each parameter's
    storage and ZeRO level, each axis's role, the plan's recomputation and pipeline."""
    axes = reading.axes
    styles = tp.styles if tp is not None else {}
    params, zero = [], []
    for fqn, _ in model.named_parameters():
        module, _, name = fqn.rpartition(".")
        spec: list[Placement] = [Replicate()] * len(axes.shape)
        style = styles.get(module)
        for a in axes.tensor:
            spec[a] = style.params.get(name, Replicate()) if style is not None else Replicate()
        level = 0
        if dp is not None and dp.kind == "fsdp":
            level = 3 if _group_reshards(dp, fqn) else 2
            if level == 3:
                for a in dp.shard_axes:
                    spec[a] = Shard(dp.shard_dims.get(fqn, 0))
        params.append((fqn, "".join(spec_str((p,)) for p in spec)))
        zero.append((fqn, level))
    pipeline = plan.pipeline
    recompute = tuple(int(entry.split()[-1]) for entry in plan.recompute) or "none"
    # each axis's role as the written module runs it: DDP and FSDP2 split the batch and compute
    # with whole weights, parallelize_module's styles keep the batch whole
    roles = tuple({"pp": "pp", "tp": "tp", "fsdp": "dp", "dp": "dp"}.get(axes.role(a)) for a in range(len(axes.shape)))
    laid: dict[str, Any] = {"params": dict(params), "zero_by_name": dict(zero), "recompute": list(recompute)
                            if isinstance(recompute, tuple) else recompute}
    if any(roles):
        laid["axes"] = [r or "*" for r in roles]
    if pipeline is not None:
        laid.update(pp=pipeline.stages, micro_batches=pipeline.micro_batches, schedule=pipeline.schedule)
        if pipeline.chunks_per_rank > 1:
            laid["chunks"] = pipeline.chunks_per_rank
    return laid


def _group_reshards(dp, fqn: str) -> bool:
    """Whether the FSDP2 group holding ``fqn`` (its innermost wrapped module) reshards after forward."""
    holders = [path for path in dp.groups if not path or fqn.startswith(path + ".")]
    return dp.groups[max(holders, key=len)] if holders else True
