"""A pipeline plan's stages as torch.distributed.pipelining builds them.

torch runs a stage as a module (``PipelineStage``); the plan cuts the graph, node by node
(``Pipeline.stage_of``). The export cuts the model at its repeated layers: each stage runs a
contiguous run of them (a layer whose nodes the plan puts on two stages runs on the one
holding most of them, and the export says so), the first stage the model's ops before the
layers, the last those after. A stage trains the parameters of the modules whose ops the plan
runs on it; a parameter two stages use (a tied embedding and head) has a copy on each, whose
gradients must be summed over the pipeline axis (torch's pipelining does not).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from autopar.costmodels.schedules import Schedule
from autopar.passes.export.reading import Reading, container_of
from autopar.passes.export.tensor_parallel import canonical_names


@dataclass
class Stages:
    """Each stage's layers and trained modules, the schedule and the micro-batches."""

    container: str  # the module holding the repeated layers ("model.layers")
    layers: list[tuple[int, int]]  # per stage: [first, last) indices into the container
    trains: list[tuple[str, ...]]  # per stage: the modules outside the layers whose parameters it trains
    schedule: str  # torch's schedule class
    micro_batches: int
    pipeline_ranks: int
    tied: list[str] = field(default_factory=list)  # parameters used on several stages
    notes: dict[str, list[str]] = field(default_factory=dict)


def stages(plan, reading: Reading, model: nn.Module) -> Stages | None:
    """The plan's pipeline cut at layer boundaries; None for a plan without one."""
    pp = plan.pipeline
    if pp is None:
        return None
    container = container_of(reading.layers)
    if container is None:
        raise ValueError("autopar: export cuts pipeline stages at the model's repeated layers (one container, like "
                         "model.layers); found none in this plan's model. Export a plan without a pipeline")
    count = len(model.get_submodule(container))
    n_stages = pp.stages * pp.chunks_per_rank
    ops: dict[str, Counter] = {}
    for name, stage in pp.stage_of.items():
        key = plan.node_keys.get(name, "")
        if ":" in key and not key.startswith(("param:", "buffer:", "input:")):
            ops.setdefault(key.split(":", 1)[0], Counter())[stage] += 1
    notes: dict[str, list[str]] = {}
    layer_stage = []
    for i in range(count):
        path = f"{container}.{i}"
        found = sum((c for m, c in ops.items() if m == path or m.startswith(path + ".")), Counter())
        if not found:
            raise ValueError(f"autopar: the plan's pipeline places no op of {path}; re-plan for this model")
        stage, _ = found.most_common(1)[0]
        if len(found) > 1:
            notes.setdefault(path, []).append(
                f"the plan cuts this layer between stages {sorted(found)}; torch's stages here cut between layers: "
                f"it runs whole on stage {stage}")
        layer_stage.append(max(stage, layer_stage[-1]) if layer_stage else stage)
    layers = []
    for s in range(n_stages):
        mine = [i for i, st in enumerate(layer_stage) if st == s]
        if not mine:
            raise ValueError(f"autopar: export expected every pipeline stage to run a repeated layer; the plan's "
                             f"stage {s} runs none of {container}. Re-plan with fewer stages")
        layers.append((mine[0], mine[-1] + 1))
    trains, tied = _trained(model, ops, n_stages, container)
    schedule = "Schedule" + Schedule.parse(pp.schedule).display
    return Stages(container, layers, trains, schedule, pp.micro_batches, pp.stages, tied, notes)


def _trained(model: nn.Module, ops: dict[str, Counter], n_stages: int, container: str) -> tuple[list[tuple[str, ...]], list[str]]:
    """Per stage, the modules outside the layers whose parameters it trains (those whose ops it
    runs); the parameters two stages use."""
    trains: list[list[str]] = [[] for _ in range(n_stages)]
    used: dict[str, set[int]] = {}
    canonical = canonical_names(model)
    for path, module in model.named_modules():
        own = [name for name, _ in module.named_parameters(recurse=False)]
        if not own:
            continue
        on = {s for m, c in ops.items() if m == path or m.startswith(path + ".") for s in c}
        if not (path == container or path.startswith(container + ".")):  # a stage trains its own layers
            for s in on:
                trains[s].append(path)
        for name in own:
            used.setdefault(canonical[f"{path}.{name}" if path else name], set()).update(on)
    tied = [name for name, on in used.items() if len(on) > 1]
    return [tuple(t) for t in trains], tied
