"""The exported module's text: readable Python that lays a model out with torch's APIs only.

Each part of the layout is one function of the written module (``tensor_parallel``,
``recompute``, ``data_parallel``; a pipeline's ``Stage`` and ``pipeline``), composed by
``parallelize``. Repeated layers laid out alike are written once, as a loop over the layers.
What torch's APIs cannot say as the plan does is a comment at the module it concerns,
beginning ``Not as planned:``.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

from torch.distributed.tensor import Placement, Shard

from autopar.costmodels.schedules import Schedule
from autopar.costmodels.units import gib_text
from autopar.passes.export.data_parallel import DataParallel
from autopar.passes.export.reading import Reading
from autopar.passes.export.snippets import (DISTRIBUTE_AS_PLANNED, LOCAL_BATCH, SPLIT_ON_ENTRY, STAGE_CLASSES,
                                             SUM_TIED)
from autopar.passes.export.stages import Stages
from autopar.passes.export.tensor_parallel import Style, TensorParallel

WIDTH = 100
NOT_PLANNED = "Not as planned: "


@dataclass
class Layout:
    """Everything the written module lays out, decided."""

    plan: object
    model_name: str
    reading: Reading
    input_name: str
    tp: TensorParallel | None
    dp: DataParallel | None
    stages: Stages | None
    recomputed: list[int]  # indices into the layers' container
    container: str | None
    notes: list[str]  # about the whole layout (the module docstring)


def write(layout: Layout) -> str:
    """The module's source text."""
    parts = [_docstring(layout), _imports(layout), _constants(layout)]
    if layout.tp is not None:
        parts.append(_tensor_parallel(layout))
        if any(s.kind == "distribute" for s in layout.tp.styles.values()):
            parts.append(DISTRIBUTE_AS_PLANNED)
        if any(s.kind == "entry" for s in layout.tp.styles.values()):
            parts.append(SPLIT_ON_ENTRY)
    if layout.recomputed:
        parts.append(_recompute(layout))
    if layout.dp is not None:
        parts.append(_data_parallel(layout))
    parts.append(_parallelize(layout))
    parts.append(LOCAL_BATCH)
    if layout.stages is not None:
        parts.append(_pipeline(layout))
    return "\n\n\n".join(p.strip("\n") for p in parts if p) + "\n"


# --- the module's head ----------------------------------------------------------------


def _axis_words(layout: Layout) -> str:
    axes = layout.reading.axes
    words = {"pp": "pipeline stages", "tp": "tensor parallel", "fsdp": "the batch, weights stored split (FSDP)",
             "dp": "the batch (data parallel)", "replica": "nothing (every rank the same work)"}
    return "; ".join(f"{axes.names[a]} ({axes.shape[a]}): {words[axes.role(a)]}" for a in range(len(axes.shape)))


def _docstring(layout: Layout) -> str:
    plan = layout.plan
    predicted = plan.predicted
    head = (f'{layout.model_name} laid out as autopar\'s plan "{plan.kind}" lays it out, with torch\'s own APIs '
            "only: this file imports no autopar.")
    about = (f"The plan's mesh: {_axis_words(layout)}. Predicted by autopar"
             f"{' for ' + plan.hardware if plan.hardware else ''}: {predicted.step_time * 1e3:.3g} ms per step, "
             f"{gib_text(sum(predicted.memory.values()))} per device.")
    mesh = 'mesh = init_device_mesh("cuda", MESH_SHAPE, mesh_dim_names=AXIS_NAMES)  # "cpu" under gloo'
    x = layout.input_name
    if layout.stages is None:
        loop = [mesh, "model = parallelize(model, mesh)", "optimizer = torch.optim.AdamW(model.parameters())",
                f"{x}, target = local_batch({x}, mesh), local_batch(target, mesh)  # this rank's rows"]
        step = [f"loss = loss_fn(model({x}), target)", "loss.backward()"]
        if layout.tp is not None and layout.tp.loss_parallel:
            loop.append("with loss_parallel():  # the output stays split over the tensor axis (LOSS_PARALLEL)")
            loop += ["    " + s for s in step]
        else:
            loop += step
        loop += ["optimizer.step()", "optimizer.zero_grad()"]
    else:
        loop = [mesh, "stages, schedule = pipeline(model, mesh, MICROBATCHES, loss_fn)",
                "optimizer = torch.optim.AdamW([p for s in stages for p in s.submod.parameters() if p.requires_grad])",
                f"{x}, target = local_batch({x}, mesh), local_batch(target, mesh)  # this rank's rows",
                "losses = []",
                f"schedule.step({x}={x}, target=target, losses=losses)  # the same call on every rank"]
        if layout.stages.tied:
            loop.append("sum_tied_gradients(stages, mesh)")
        loop += ["optimizer.step()", "optimizer.zero_grad()"]
    lines = [*_wrap(head), "", *_wrap(about), "", "Run it on every rank, the model built the same way on each:", "",
             *("    " + s for s in loop), ""]
    if layout.tp is not None and layout.tp.loss_parallel and layout.stages is not None:
        lines += ["(run the schedule under loss_parallel(): the output stays split over the tensor axis)", ""]
    lines += _wrap("Where torch's APIs cannot say what the plan chose, a comment beginning "
                   f'"{NOT_PLANNED.strip()}" says so at the module it concerns, and the nearest layout '
                   "torch can express is used.")
    for note in layout.notes:
        lines += ["", *_wrap(NOT_PLANNED + note)]
    return '"""' + "\n".join(lines).rstrip() + '\n"""'


def _imports(layout: Layout) -> str:
    lines = ["from __future__ import annotations", ""]
    if layout.stages is not None:
        lines.append("import copy")
        lines.append("")
    lines.append("import torch")
    if layout.stages is not None and layout.stages.tied:
        lines.append("import torch.distributed as dist")
    lines.append("from torch import nn")
    lines.append("from torch.distributed.device_mesh import DeviceMesh")
    tp, dp = layout.tp, layout.dp
    if layout.recomputed:
        lines.append("from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper")
    if dp is not None and dp.kind == "fsdp":
        lines.append("from torch.distributed.fsdp import fully_shard")
    if layout.stages is not None:
        lines.append(f"from torch.distributed.pipelining import PipelineStage, {layout.stages.schedule}")
    tensor_names = set()
    if dp is not None and dp.kind == "fsdp" and dp.shard_dims:
        tensor_names.add("Shard")
    if tp is not None:
        tensor_names |= {"Replicate", "Shard"}
        if any(s.kind == "distribute" for s in tp.styles.values()):
            tensor_names |= {"DTensor", "distribute_module", "distribute_tensor"}
        if any(s.kind == "entry" for s in tp.styles.values()):
            tensor_names.add("DTensor")
    if layout.stages is not None and layout.stages.tied:
        tensor_names.add("DTensor")
    if tensor_names:
        lines.append(f"from torch.distributed.tensor import {', '.join(sorted(tensor_names))}")
    if tp is not None:
        kinds = {s.kind for s in tp.styles.values()}
        names = {"parallelize_module"} | {c for k, c in (("colwise", "ColwiseParallel"), ("rowwise", "RowwiseParallel"),
                                                         ("sequence", "SequenceParallel")) if k in kinds}
        if any(s.kind == "sequence" and s.output_layout != s.input_layout for s in tp.styles.values()):
            names.add("PrepareModuleOutput")
        if tp.loss_parallel:
            names.add("loss_parallel")  # for the training loop (the module docstring)
        lines.append(f"from torch.distributed.tensor.parallel import {', '.join(sorted(names))}")
    if dp is not None and dp.kind == "ddp":
        lines.append("from torch.nn.parallel import DistributedDataParallel")
    return "\n".join(lines)


def _constants(layout: Layout) -> str:
    axes = layout.reading.axes
    lines = [f"MESH_SHAPE = {tuple(axes.shape)!r}",
             f"AXIS_NAMES = {_strings(axes.names)}",
             f"BATCH_AXES = {_strings(axes.names[a] for a in axes.batch)}  # each batch split by rows over these, "
             "outermost first"]
    if layout.tp is not None:
        lines.append(f"LOSS_PARALLEL = {layout.tp.loss_parallel}  # the output split over the tensor axis: compute "
                     "the loss under loss_parallel()")
    if layout.container is not None and (layout.recomputed or layout.stages is not None or layout.dp is not None
                                         or layout.tp is not None):
        lines.append(f'LAYERS = "{layout.container}"  # the repeated layers')
    return "\n".join(lines)


# --- tensor parallelism -----------------------------------------------------------------


def _placement(p: Placement, ndim: int = 0) -> str:
    if isinstance(p, Shard):
        return "Shard(-1)" if ndim and p.dim == ndim - 1 else f"Shard({p.dim})"
    return "Replicate()"


def _style_code(style: Style) -> str:
    """The ParallelStyle of a module, with only the arguments that differ from torch's defaults."""
    args = []
    out = _placement(style.output_layout, style.output_ndim)
    given = _placement(style.input_layout, style.input_ndim)
    if style.kind == "colwise":
        if given != "Replicate()":
            args.append(f"input_layouts={given}")
        if out != "Shard(-1)":
            args.append(f"output_layouts={out}")
        if not style.local_output:
            args.append("use_local_output=False")
        return f"ColwiseParallel({', '.join(args)})"
    if style.kind == "rowwise":
        if given != "Shard(-1)":
            args.append(f"input_layouts={given}")
        if out != "Replicate()":
            args.append(f"output_layouts={out}")
        return f"RowwiseParallel({', '.join(args)})"
    dim = style.input_layout.dim
    regathered = style.output_layout != style.input_layout  # then PrepareModuleOutput hands it on (_outputs_moved)
    return f"SequenceParallel({'' if dim == 1 else f'sequence_dim={dim}, '}use_local_output={not regathered})"


def _outputs_moved(styles: dict[str, Style], indent: str, target: str) -> list[str]:
    """``PrepareModuleOutput`` after each sequence-parallel module whose output leaves otherwise placed."""
    moved = {path: s for path, s in styles.items() if s.kind == "sequence" and s.output_layout != s.input_layout}
    if not moved:
        return []
    lines = [f"{indent}parallelize_module({target}, mesh, {{  # then handed on as the next ops read it"]
    for path, style in moved.items():
        line = f'{indent}    "{path}": PrepareModuleOutput(output_layouts={_placement(style.input_layout)}, '
        wanted = f"desired_output_layouts={_placement(style.output_layout, style.output_ndim)}),"
        lines += [line + wanted] if len(line + wanted) <= WIDTH else [line.rstrip(), f"{indent}        {wanted}"]
    lines.append(f"{indent}}})")
    return lines


def _style_comment(style: Style) -> str | None:
    if style.kind == "rowwise" and style.type_name == "Embedding":
        return "the table split by rows (vocabulary parallel)"
    if style.kind == "colwise" and not style.local_output:
        return "the output stays a DTensor split over the tensor axis (LOSS_PARALLEL)"
    if style.kind == "sequence":
        return "whole weights on split activations: run on DTensors, their gradients summed"
    return None


def _distribute_code(style: Style, module_expr: str) -> list[str]:
    params = ", ".join(f'"{n}": {_placement(p)}' for n, p in style.params.items())
    return [f"distribute_as_planned({module_expr}, mesh, {{{params}}},",
            f"                      arrives={_placement(style.input_layout)}, "
            f"reads={_placement(style.wanted_input)}, leaves={_placement(style.output_layout)})"]


def _tensor_parallel(layout: Layout) -> str:
    tp = layout.tp
    axes = layout.reading.axes
    names = ", ".join(axes.names[a] for a in axes.tensor)
    per_layer, rest, layer_notes = _fold_layers(layout.container, layout.reading.layers, tp.styles, tp.notes)
    body = ['def tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:',
            f'    """Megatron tensor parallelism over {names}: each split module\'s weights and what it hands on,',
            '    as the plan places them (the model\'s own Python runs between them on local tensors)."""']
    elsewhere = {k: v for k, v in tp.notes.items() if k not in tp.styles}
    body += _notes_comment(elsewhere, indent="    ")
    skip = ["        if isinstance(layer, SkippedLayer):  # another stage's", "            continue"]
    styled = _plan_dict(per_layer, layer_notes, indent="        ", target="layer")
    styled += _outputs_moved(per_layer, indent="        ", target="layer")
    if styled:
        body.append("    for layer in model.get_submodule(LAYERS):")
        body += skip if layout.stages is not None else []
        body += styled
    if rest:
        body += _plan_dict(rest, tp.notes, indent="    ", target="model")
        body += _outputs_moved(rest, indent="    ", target="model")
    spread = {p: s for p, s in per_layer.items() if s.kind == "distribute"}
    alone = {p: s for p, s in rest.items() if s.kind == "distribute"}
    if spread or alone:
        kinds = sorted({s.type_name for s in [*spread.values(), *alone.values()]})
        body += _said([f"{' and '.join(kinds)} modules are not what torch's ColwiseParallel and RowwiseParallel "
                       "take (nn.Linear, nn.Embedding as they store their weights): distribute_module places their "
                       "weights as the plan does"], "    ")
    if spread:
        body.append("    for layer in model.get_submodule(LAYERS):")
        body += skip if layout.stages is not None else []
        for path, style in spread.items():
            body += _said([n for n in layer_notes.get(path, []) if n not in style.notes], "        ")
            body += ["        " + line for line in _distribute_code(style, f'layer.get_submodule("{path}")')]
    for path, style in alone.items():
        body += _said([n for n in tp.notes.get(path, []) if n not in style.notes], "    ")
        body += ["    " + line for line in _distribute_code(style, f'model.get_submodule("{path}")')]
    for path, style in tp.styles.items():
        if style.kind == "entry":
            body += ["    # the hidden state split as the plan splits it from the first layer on (see split_on_entry)",
                     f'    split_on_entry(model.get_submodule("{path}"), mesh, {_placement(style.output_layout)})']
    for alias, canonical in tp.ties:
        owner, _, name = alias.rpartition(".")
        source, _, source_name = canonical.rpartition(".")
        body.append(f"    # {alias} is tied to {canonical}: parallelize_module placed each module's copy")
        body.append(f'    model.get_submodule("{owner}").{name} = model.get_submodule("{source}").{source_name}')
    return "\n".join(body)


def _plan_dict(styles: dict[str, Style], notes: dict[str, list[str]], indent: str, target: str) -> list[str]:
    entries = [(path, style) for path, style in styles.items() if style.kind not in ("distribute", "entry")]
    if not entries:
        return []
    lines = [f"{indent}parallelize_module({target}, mesh, {{"]
    for path, style in entries:
        lines += _said(notes.get(path, []), indent + "    ")
        comment = _style_comment(style)
        line = f'{indent}    "{path}": {_style_code(style)},'
        if comment and len(line) + len(comment) + 4 > WIDTH:
            lines.append(f"{indent}    # {comment}")
        lines.append(line + (f"  # {comment}" if comment and len(line) + len(comment) + 4 <= WIDTH else ""))
    lines.append(f"{indent}}})")
    return lines


def _said(notes: list[str], indent: str) -> list[str]:
    return [f"{indent}# {line}" for note in notes for line in _wrap(NOT_PLANNED + note, WIDTH - len(indent) - 2)]


def _fold_layers(container, layers, styles: dict[str, Style], notes: dict[str, list[str]]):
    """(the styles of every layer, keyed by their path inside a layer; the other styles; the
    layers' notes, keyed alike), when every repeated layer of the container is laid out alike and
    noted alike; else ({}, all styles, {})."""
    if container is None or not layers:
        return {}, dict(styles), {}
    paths = [p for _, p in sorted(layers.items())]
    inside, said = {}, {}
    for path in paths:
        inside[path] = {k[len(path) + 1:]: s for k, s in styles.items() if k.startswith(path + ".")}
        said[path] = {k[len(path) + 1:]: v for k, v in notes.items() if k.startswith(path + ".")}
    first = inside[paths[0]]
    alike = all(set(v) == set(first) and all(_same(v[k], first[k]) for k in first) for v in inside.values())
    if not alike or not first or any(v != said[paths[0]] for v in said.values()):
        return {}, dict(styles), {}
    rest = {k: s for k, s in styles.items() if not any(k.startswith(p + ".") for p in paths)}
    return first, rest, said[paths[0]]


def _same(a: Style, b: Style) -> bool:
    return (a.kind, _style_code(a) if a.kind != "distribute" else None, a.params, a.input_layout, a.output_layout,
            a.wanted_input, a.notes) == (b.kind, _style_code(b) if b.kind != "distribute" else None, b.params,
                                         b.input_layout, b.output_layout, b.wanted_input, b.notes)


def _notes_comment(notes: dict[str, list[str]], indent: str) -> list[str]:
    """The notes, one comment per module, layers' alike notes once (``model.layers.*.mlp``)."""
    lines = []
    for path, said in fold_notes(notes).items():
        for note in said:
            where = path or "the model"
            lines += [f"{indent}# {line}" for line in _wrap(f"{NOT_PLANNED}{where}: {note}", WIDTH - len(indent) - 2)]
    return lines


def fold_notes(notes: dict[str, list[str]]) -> dict[str, list[str]]:
    """Notes by module, with the same note on every numbered sibling (``layers.0``, ``layers.1``) written once,
    the number as ``*``."""
    groups: dict[tuple[str, str], list[str]] = {}
    for path, said in notes.items():
        for note in said:
            key = (re.sub(r"\.\d+(\.|$)", r".*\1", path), note)
            groups.setdefault(key, []).append(path)
    out: dict[str, list[str]] = {}
    for (pattern, note), paths in groups.items():
        if len(paths) > 1:
            out.setdefault(pattern, []).append(note)
        else:
            out.setdefault(paths[0], []).append(note)
    return out


# --- recomputation, data parallelism ------------------------------------------------------


def _recompute(layout: Layout) -> str:
    lines = [f"RECOMPUTED = {tuple(layout.recomputed)!r}  # the layers the plan recomputes in backward",
             "", "",
             "def recompute(model: nn.Module) -> None:",
             '    """Activation checkpointing of the plan\'s recomputed layers: their activations are rebuilt in',
             '    backward instead of kept."""',
             "    layers = model.get_submodule(LAYERS)",
             "    for index in RECOMPUTED:"]
    if layout.stages is not None:
        lines += ["        if isinstance(layers[index], SkippedLayer):", "            continue"]
    lines.append("        layers[index] = checkpoint_wrapper(layers[index])")
    return "\n".join(lines)


def _mesh_expr(axes, indices, name: str) -> str:
    """The DeviceMesh over ``indices`` (several axes flattened into one, as torchtitan does)."""
    names = [axes.names[a] for a in indices]
    if len(names) == 1:
        return f'mesh["{names[0]}"]'
    return f'mesh[{", ".join(repr(n) for n in names)}]._flatten("{name}")'.replace("'", '"')


def _dp_mesh(layout: Layout) -> str:
    dp, axes = layout.dp, layout.reading.axes
    if dp.kind == "ddp":
        return _mesh_expr(axes, dp.replicate_axes, "batch")
    if dp.replicate_axes:  # HSDP: (replicate, shard)
        return f'mesh[("{axes.names[dp.replicate_axes[0]]}", "{axes.names[dp.shard_axes[0]]}")]'
    return _mesh_expr(axes, dp.shard_axes, "batch")


def _data_parallel(layout: Layout) -> str:
    dp, axes = layout.dp, layout.reading.axes
    if dp.kind == "ddp":
        names = ", ".join(axes.names[a] for a in dp.replicate_axes)
        lines = ["def data_parallel(model: nn.Module, mesh: DeviceMesh, root: nn.Module | None = None) -> nn.Module:",
                 f'    """Data parallel over {names}: weights whole on every rank (ZeRO-0), gradients averaged."""',
                 "    return DistributedDataParallel(root or model, device_mesh=mesh)"]
        return "\n".join(lines)
    shard = ", ".join(axes.names[a] for a in dp.shard_axes)
    hsdp = f", whole over {axes.names[dp.replicate_axes[0]]} (HSDP)" if dp.replicate_axes else ""
    layer_paths = [p for _, p in sorted(layout.reading.layers.items())]
    layer_values = {dp.groups[p] for p in layer_paths if p in dp.groups}
    lines = []
    if dp.shard_dims:
        lines.append("SHARD_DIMS = {  # the plan splits these along another dim than FSDP2's 0")
        lines += [f'    "{name}": {dim},' for name, dim in dp.shard_dims.items()]
        lines += ["}", "", ""]
    lines += ["def data_parallel(model: nn.Module, mesh: DeviceMesh, root: nn.Module | None = None) -> nn.Module:",
              f'    """FSDP2 over {shard}{hsdp}: one group per repeated layer, then the root (``root``, or the',
              "    model). reshard_after_forward by the plan's ZeRO level: ZeRO-3 gathers the weights at each use",
              '    and frees them after forward (True); ZeRO-2 gathers them once per step (False)."""']
    lines += _notes_comment(dp.notes, indent="    ")
    if dp.shard_dims:
        lines += ['    dims = {id(p): SHARD_DIMS[n.replace("_checkpoint_wrapped_module.", "")]',
                  "            for n, p in model.named_parameters() if n.replace(\"_checkpoint_wrapped_module.\", \"\") "
                  "in SHARD_DIMS}",
                  "    placed = dict(shard_placement_fn=lambda param: Shard(dims.get(id(param), 0)))"]
    else:
        lines.append("    placed = {}")
    if layer_paths and layout.container is not None:
        levels = {dp.levels[p] for p in layer_paths if p in dp.levels}
        if len(layer_values) == 1:
            value = layer_values.pop()
            level = f"  # the plan's ZeRO-{levels.pop()}" if len(levels) == 1 else ""
            lines += ["    for layer in model.get_submodule(LAYERS):",
                      "        if any(True for _ in layer.parameters()):",
                      f"            fully_shard(layer, mesh=mesh, reshard_after_forward={value}, **placed){level}"]
        else:
            values = [dp.groups[p] for p in layer_paths]
            lines += [f"    reshard = {tuple(values)!r}  # per layer, by the plan's ZeRO levels "
                      + ", ".join(str(dp.levels[p]) for p in layer_paths),
                      "    for index, layer in enumerate(model.get_submodule(LAYERS)):",
                      "        if any(True for _ in layer.parameters()):",
                      "            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard[index], **placed)"]
    lines.append(f"    return fully_shard(root or model, mesh=mesh, reshard_after_forward={dp.groups['']}, **placed)"
                 f"  # the plan's ZeRO-{dp.levels['']}")
    return "\n".join(lines)


def _parallelize(layout: Layout) -> str:
    axes = layout.reading.axes
    lines = ["def parallelize(model: nn.Module, mesh: DeviceMesh, root: nn.Module | None = None) -> nn.Module:",
             '    """Lay ``model`` out as the plan does on ``mesh`` (MESH_SHAPE, axes named AXIS_NAMES) and return',
             "    the module to train (``root``, a pipeline stage holding ``model``, when given)."
             + ('"""' if layout.stages is None else ""),
             ]
    if layout.stages is not None:
        lines += ["    A pipeline's stages are laid out by ``pipeline``, which calls this on each.\"\"\""]
    if layout.tp is not None:
        lines.append(f"    tensor_parallel(model, {_mesh_expr(axes, axes.tensor, 'tensor')})")
    if layout.recomputed:
        lines.append("    recompute(model)")
    if layout.dp is not None:
        lines.append(f"    return data_parallel(model, {_dp_mesh(layout)}, root)")
    else:
        lines.append("    return root or model")
    return "\n".join(lines)


# --- pipelines ----------------------------------------------------------------------------


def _pipeline(layout: Layout) -> str:
    st, axes = layout.stages, layout.reading.axes
    pp = axes.names[axes.pipeline]
    # torch's multi-stage schedules take every stage of the rank, the others its one; the
    # schedule places the stages (looped, or V-shaped: Schedule.rank_of)
    schedule = Schedule.parse(st.schedule.removeprefix("Schedule"))
    interleaved = schedule.interleaved
    placement = tuple(schedule.rank_of(s, st.pipeline_ranks) for s in range(len(st.layers)))
    lines = [f"NUM_STAGES = {len(st.layers)}",
             f"STAGE_LAYERS = {tuple(st.layers)!r}  # per stage: [first, last) of LAYERS",
             f"STAGE_RANKS = {placement!r}  # per stage: the rank on the pipeline axis that runs it",
             "# per stage: the modules around the layers whose weights it trains",
             f"STAGE_TRAINS = ({', '.join(_strings(t) for t in st.trains)}{',' if len(st.trains) == 1 else ''})",
             f"MICROBATCHES = {st.micro_batches}"]
    if st.tied:
        lines.append(f"TIED_ACROSS_STAGES = {_strings(st.tied)}  # used on two stages, a copy on each")
    lines += ["", "", STAGE_CLASSES.strip("\n"), ""]
    notes = _notes_comment(st.notes, indent="    ")
    lines += ["",
              "def pipeline(model: nn.Module, mesh: DeviceMesh, microbatches: int = MICROBATCHES, loss_fn=None):",
              f'    """This rank\'s stages of the plan\'s pipeline over {pp} (stage i on rank STAGE_RANKS[i]),',
              "    each laid out by ``parallelize`` on the other axes, and torch's schedule running them. Train with",
              f"    ``schedule.step({layout.input_name}=..., target=..., losses=...)`` on every rank: each stage runs the "
              "model's",
              "    own forward on the micro-batch, with only its layers; the last hands ``loss_fn`` the model's first",
              '    output (a Hugging Face model\'s logits)."""',
              *notes,
              '    if hasattr(getattr(model, "config", None), "use_cache"):',
              "        model.config.use_cache = False  # a training step keeps no key-value cache (Hugging Face)",
              f'    ranks = mesh["{pp}"]',
              "    indices = [i for i, rank in enumerate(STAGE_RANKS) if rank == ranks.get_local_rank()]",
              '    device = torch.device(mesh.device_type) if mesh.device_type == "cpu" else torch.device(',
              "        mesh.device_type, torch.accelerator.current_device_index())",
              "    stages = []",
              "    for index in indices:",
              "        copied = copy.deepcopy(model) if len(indices) > 1 else model",
              "        stage = parallelize(copied, mesh, root=Stage(copied, index))",
              "        stages.append(PipelineStage(stage, index, NUM_STAGES, device, group=ranks.get_group()))",
              f"    schedule = {st.schedule}({'stages' if interleaved else 'stages[0]'}, n_microbatches=microbatches, "
              "loss_fn=loss_fn)",
              "    return stages, schedule"]
    if st.tied:
        lines += ["", "", SUM_TIED.strip("\n").replace("PIPELINE_AXIS", pp)]
    return "\n".join(lines)


def _strings(items) -> str:
    """A tuple of strings as Python writes it, in double quotes."""
    items = list(items)
    return "(" + ", ".join(f'"{s}"' for s in items) + ("," if len(items) == 1 else "") + ")"


def _wrap(text: str, width: int = WIDTH) -> list[str]:
    return textwrap.wrap(text, width) or [""]

