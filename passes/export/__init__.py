"""A Plan written out as plain PyTorch (``Plan.export``, ``autopar export``).

The written module has ``parallelize(model, mesh) -> model`` (and, for a pipeline plan,
``pipeline(model, mesh, microbatches, loss_fn) -> (stages, schedule)``) and lays the model
out with torch's own APIs only, importing no autopar: ``parallelize_module`` with
``ColwiseParallel``, ``RowwiseParallel`` and ``SequenceParallel`` for tensor parallelism
(``autopar.passes.export.tensor_parallel``), ``DistributedDataParallel`` or FSDP2's
``fully_shard`` by ZeRO level for the batch axes (``autopar.passes.export.data_parallel``),
``checkpoint_wrapper`` for the recomputed layers, and ``torch.distributed.pipelining`` for
the stages (``autopar.passes.export.stages``). The model is captured once to follow the
plan's placements from op to op, so that what each style hands on is what the plan's next op
reads; where torch's APIs cannot say what the plan chose, the written module says so at the
module concerned and uses the nearest layout they can express (``Exported.notes``), and the
written layout is priced beside the plan by the same cost model (``Exported.cost``:
``autopar.passes.export.price``), so what the export gives up is a number.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from autopar.passes.capture import capture
from autopar.passes.export.data_parallel import batch_notes, data_parallel
from autopar.passes.export.price import ExportedCost, exported_cost
from autopar.passes.export.reading import container_of, output_specs, read_plan
from autopar.passes.export.source import Layout, fold_notes, write
from autopar.passes.export.stages import stages
from autopar.passes.export.tensor_parallel import tensor_parallel
from autopar.passes.export.torchtitan import fragment


@dataclass
class Exported:
    """What ``export`` wrote: the file, its text, and the plan's choices it could not express."""

    path: Path
    source: str
    notes: list[str] = field(default_factory=list)  # "module: what differs from the plan there"
    # the written module's predicted step and memory beside the plan's (``autopar.passes.export.price``)
    cost: ExportedCost | None = None
    # the plan as a torchtitan job-config fragment (TOML), for a Llama-family model; None otherwise
    torchtitan: str | None = None

    def write_torchtitan(self, path: str | Path) -> Path:
        """Write ``torchtitan`` (the job-config fragment) to ``path``."""
        if self.torchtitan is None:
            raise ValueError("autopar: no torchtitan job config for this model: torchtitan trains Llama-family "
                             "models only; found another. Use the written module instead")
        out = Path(path)
        out.write_text(self.torchtitan)
        return out

    def summary(self) -> str:
        lines = [f"wrote {self.path}: parallelize(model, mesh) with torch's own APIs"
                 + (" and pipeline(model, mesh, microbatches, loss_fn)" if "def pipeline(" in self.source else "")]
        if self.notes:
            lines.append(f"{len(self.notes)} choices of the plan torch's APIs cannot express (the nearest is used; "
                         "each is a comment in the file):")
            lines += [f"  {note}" for note in self.notes]
        else:
            lines.append("torch's APIs express every choice of the plan")
        if self.cost is not None:
            lines.append(self.cost.line())
        return "\n".join(lines)


def export(plan, model_or_factory, path: str | Path, example_inputs: tuple | None = None) -> Exported:
    """Write ``plan`` for ``model_or_factory`` (an ``nn.Module`` with its ``example_inputs``, or
    ``"package.module:factory"`` returning ``(model, example_inputs)``) to ``path`` as a Python
    module that lays the model out with torch's APIs only."""
    if plan.inference is not None:
        raise ValueError("autopar: export writes training layouts; found a serving plan (Plan.inference). "
                         "Export a plan made without inference=")
    model, inputs = _model_and_inputs(model_or_factory, example_inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the planner reported them already
        captured = capture(model, inputs)
    reading = read_plan(plan, output_specs(plan, captured), [n for n, _ in model.named_parameters()])
    tp = tensor_parallel(plan, reading, model, captured)
    cut = stages(plan, reading, model)
    dp = data_parallel(reading, model, pipelined=cut is not None)
    if dp is not None:
        for path_, said in batch_notes(plan, reading, captured, inputs[0]).items():
            dp.notes.setdefault(path_, []).extend(said)
    container = container_of(reading.layers)
    recomputed, notes = _recomputed(plan, reading, container), list(reading.axes.notes)
    user_input = next(iter(reading.inputs))
    layout = Layout(plan, type(model).__name__, reading, user_input, tp, dp, cut, recomputed, container, notes)
    text = write(layout)
    out = Path(path)
    out.write_text(text)
    found = list(notes)
    for part in (tp.notes if tp else {}, dp.notes if dp else {}, cut.notes if cut else {}):
        found += [f"{where or 'the model'}: {note}" for where, said in fold_notes(part).items() for note in said]
    titan = fragment(plan, type(model).__name__, reading, dp, cut, int(inputs[0].shape[0]), found)
    return Exported(out, text, found, exported_cost(plan, captured, model, reading, tp, dp, found), titan)


def _model_and_inputs(model_or_factory, example_inputs) -> tuple[torch.nn.Module, tuple]:
    if isinstance(model_or_factory, torch.nn.Module):
        if example_inputs is None:
            raise ValueError("autopar: export expected example_inputs with a model (it captures the model to follow "
                             "the plan op by op); found none. Pass plan.export(model, path, example_inputs=(...))")
        return model_or_factory, tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not isinstance(model_or_factory, str) or ":" not in model_or_factory:
        raise ValueError(f"autopar: export expected an nn.Module or 'package.module:factory'; found "
                         f"{model_or_factory!r}")
    module_name, _, attr = model_or_factory.partition(":")
    try:
        made = getattr(importlib.import_module(module_name), attr)()
    except (ImportError, AttributeError) as e:
        raise ValueError(f"autopar: cannot load the model factory {model_or_factory!r}: {e}") from None
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise ValueError(f"autopar: model factory {model_or_factory!r} must return (model, example_inputs); found "
                         f"{type(made).__name__}")
    return _model_and_inputs(made[0], made[1] if example_inputs is None else example_inputs)


def _recomputed(plan, reading, container: str | None) -> list[int]:
    """The plan's recomputed layers (``"layer 3"``) as indices into the layers' container."""
    out = []
    for entry in plan.recompute:
        number = int(entry.split()[-1])
        path = reading.layers.get(number)
        if path is None or container is None or path.rsplit(".", 1)[0] != container:
            raise ValueError(f"autopar: the plan recomputes {entry!r}, which export finds in no repeated layer of "
                             "the model; re-plan, or clear plan.recompute")
        out.append(int(path.rsplit(".", 1)[1]))
    return sorted(out)
