"""The plan's data parallelism and ZeRO levels as torch's DDP and FSDP2.

A plan whose batch axes keep every weight whole (ZeRO-0) is DDP over them, where DDP runs (not
beside tensor parallelism or in a pipeline stage: ``WHY_NOT_DDP``; there FSDP2 gathering once per
step is the nearest, and the export says so). One that stores
weights split there is FSDP2 ``fully_shard``, one group per repeated layer and the root,
sharded along the dim the plan splits (``shard_placement_fn``), with ``reshard_after_forward``
by the group's ZeRO level: ZeRO-3 gathers at each use and frees after forward (True); ZeRO-2
gathers once per step (False). ZeRO-1 keeps weights whole and steps the optimizer on a slice,
which FSDP2 does not do: the nearest is ZeRO-2's layout, and the export says so. Batch axes
that keep weights whole beside sharded ones are FSDP2's replicate axis (HSDP).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import Shard

from autopar.passes.capture import Captured
from autopar.passes.export.reading import Reading, outputs, planned_strategies
from autopar.passes.export.tensor_parallel import canonical_names
from autopar.passes.placements import parse_spec

RESHARD = {3: True, 2: False, 1: False, 0: True}  # ZeRO level -> reshard_after_forward
LEVEL_NOTES = {
    1: "ZeRO-1 in the plan (weights whole, the optimizer stepping this rank's slice, slices gathered after the "
       "step); FSDP2 has no such mode: the nearest is reshard_after_forward=False (ZeRO-2: weights stored split, "
       "gathered once per step, gradients reduce-scattered)",
    0: "the plan uses these weights split on a batch axis (ZeRO-0 storage, split compute); FSDP2 gathers them "
       "whole for use, as ZeRO-3",
}


@dataclass
class DataParallel:
    """How the batch axes are laid out: ``kind`` "ddp" or "fsdp"."""

    kind: str
    shard_axes: tuple[int, ...]  # FSDP2's shard axes (flattened into one when several)
    replicate_axes: tuple[int, ...]  # DDP's axes, or HSDP's replicate axis
    groups: dict[str, bool] = field(default_factory=dict)  # module path ("" the root) -> reshard_after_forward
    levels: dict[str, int] = field(default_factory=dict)  # module path -> the plan's ZeRO level for its group
    shard_dims: dict[str, int] = field(default_factory=dict)  # qualified name -> dim sharded along, when not 0
    notes: dict[str, list[str]] = field(default_factory=dict)


WHY_NOT_DDP = {
    "pipeline": "torch's DDP does not run a pipeline stage's micro-batches (its reducer's first-step bucket "
                "rebuild fails)",
    "tensor": "torch's DDP takes tensor-parallel DTensor weights only through a private transform that drops them "
              "from model.parameters() after the first forward and unties tied weights",
}


def data_parallel(reading: Reading, model: nn.Module, pipelined: bool) -> DataParallel | None:
    """DDP or FSDP2 over the plan's batch axes; None when nothing splits the batch."""
    axes = reading.axes
    if not axes.batch:
        return None
    blocked = "pipeline" if pipelined else "tensor" if axes.tensor else None
    if not axes.sharded and blocked is None:
        return DataParallel("ddp", (), axes.batch)
    notes: dict[str, list[str]] = {}
    shard, replicate = axes.sharded, tuple(a for a in axes.batch if a not in axes.sharded)
    if not shard:  # ZeRO-0 where DDP cannot run
        shard, replicate = axes.batch, ()
        notes[""] = [f"the plan keeps weights whole over the batch axes (ZeRO-0); {WHY_NOT_DDP[blocked]}, so FSDP2 "
                     "with reshard_after_forward=False is the nearest: weights stored split between steps, "
                     "gathered once per step, gradients reduce-scattered"]
    elif replicate and not (len(replicate) == 1 and len(shard) == 1 and replicate[0] < shard[0]):
        notes[""] = ["the plan keeps weights whole on " + ", ".join(axes.names[a] for a in replicate) +
                     "; FSDP2's replicate axis (HSDP) must be one axis outside the shard axis: sharded over all "
                     "batch axes instead"]
        shard, replicate = axes.batch, ()
    dims = _shard_dims(reading, model, shard, notes)
    groups, levels = _groups(reading, model, not axes.sharded, notes)
    return DataParallel("fsdp", shard, replicate, groups, levels, dims, notes)


def _shard_dims(reading: Reading, model: nn.Module, shard: tuple[int, ...], notes) -> dict[str, int]:
    """Each parameter's dim as the plan splits it over the shard axes (when not 0)."""
    out, whole = {}, []
    index = [reading.axes.intra.index(a) for a in shard]
    for name in dict.fromkeys(canonical_names(model).values()):
        spec = reading.params.get(name)
        if spec is None:
            continue
        found = {spec[i].dim for i in index if isinstance(spec[i], Shard)}
        if not found:
            whole.append(name)
        elif min(found) != 0:
            out[name] = min(found)
        if len(found) > 1:
            notes.setdefault(name.rsplit(".", 1)[0], []).append(
                f"the plan splits {name} along dims {sorted(found)} on different batch axes; FSDP2 splits one "
                f"dim over them all: {min(found)}")
    if whole and reading.axes.sharded:
        shown = ", ".join(whole[:3]) + (f" and {len(whole) - 3} more" if len(whole) > 3 else "")
        notes.setdefault("", []).append(f"the plan keeps {shown} whole on the batch axes; FSDP2 shards every "
                                        "parameter of a group (dim 0)")
    return out


def _groups(reading: Reading, model: nn.Module, whole_weights: bool, notes) -> tuple[dict[str, bool], dict[str, int]]:
    """One FSDP2 group per repeated layer, then the root; each group's reshard_after_forward."""
    names = dict.fromkeys(canonical_names(model).values())
    groups, levels = {}, {}
    layer_paths = [p for _, p in sorted(reading.layers.items())]
    for path in [*layer_paths, ""]:
        mine = [n for n in names if (path == "" and not any(n.startswith(p + ".") for p in layer_paths))
                or (path and n.startswith(path + "."))]
        split = [n for n in mine if any(isinstance(p, Shard) for i, p in enumerate(reading.params.get(n, ()))
                                        if reading.axes.intra[i] in reading.axes.batch)]
        found = sorted({reading.zero.get(n, 0) for n in split}) if not whole_weights else [2]
        level = 2 if whole_weights else (found[-1] if found else 3)
        if len(found) > 1:
            notes.setdefault(path, []).append(f"the plan mixes ZeRO levels {found} in this group; FSDP2 runs one "
                                              f"per group: {level}")
        if level in LEVEL_NOTES and split and not whole_weights:
            notes.setdefault(path, []).append(LEVEL_NOTES[level])
        groups[path], levels[path] = RESHARD[level], 0 if whole_weights else level
    return groups, levels


def batch_notes(plan, reading: Reading, captured: Captured, example: torch.Tensor) -> dict[str, list[str]]:
    """Per module, the ops the plan does not run on each rank's rows of a batch axis: on the
    whole batch, or split along another dim; torch's data parallelism runs every op on the
    rank's rows."""
    if not reading.axes.batch:
        return {}
    strategy, module = planned_strategies(plan, captured)
    rows = int(example.shape[0]) if example.dim() else -1
    carries = set(captured.user_inputs)  # values computed from the inputs: the ones with rows
    counts: dict[tuple[str, str], int] = {}
    for node, text in strategy.items():
        if node.op == "call_function" and any(a.name in carries for a in node.all_input_nodes):
            carries.add(node.name)
        val = node.meta.get("val")
        if text is None or node.name not in carries or node.op != "call_function" or \
                not isinstance(val, torch.Tensor) or val.dim() == 0 or val.shape[0] != rows:
            continue
        spec = parse_spec(outputs(text)[0])
        for axis in reading.axes.batch:
            p = reading.axes.on(spec, axis)
            what = ("runs {n} of its ops on the whole batch on every rank of " if not isinstance(p, Shard) else
                    "splits {n} of its ops along another dim than the batch over " if p.dim != 0 else None)
            if what:
                key = (module[node], what + reading.axes.names[axis])
                counts[key] = counts.get(key, 0) + 1
    notes: dict[str, list[str]] = {}
    for (path, what), n in counts.items():
        notes.setdefault(path, []).append("the plan " + what.format(n=n) + "; here every op runs on the rank's rows")
    return notes
