"""One plan run two ways: autopar's runtime against the plan exported as plain PyTorch.

    python -m benchmarks.export_vs_runtime                       # launches 4 gloo ranks itself
    python -m benchmarks.export_vs_runtime --layouts dp tp+dp --steps 20

For a small Hugging Face Llama and one batch on a 2x2 gloo mesh, each plan (a manual layout as
``autopar.layouts.build`` writes it, or ``auto``: ``autopar.plan``'s own; made for these ranks'
measured profile, or ``--hardware h100``) is run by
``autopar.compile(..., plan=)`` (``train_step``) and by the module ``Plan.export`` writes
(``parallelize(model, mesh)``, then a plain loop: forward, the loss under ``loss_parallel``
where the module says so, backward, ``torch.optim.AdamW``), both from the same weights. The two
run interleaved, step by step, in alternating order (ABBA), so that load on this shared machine
hits both alike. The table gives each side's median step time, the median of the per-step
ratios, the largest difference of their losses over the steps (both train the same model on the
same batch, so it stays at float rounding), and the state each rank holds (parameters and
AdamW's moments, bytes of this rank's shards; activations are not counted: on a CPU there is no
allocator peak to read). Ratios, not absolute times, are the result.

The table goes to ``benchmarks/results/export_vs_runtime_gloo_<yyyymmdd>.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import os
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

import autopar
from autopar.models import MODELS
from autopar.costmodels.profiler import profile_mesh
from benchmarks.results_file import RESULTS_DIR, add_out_argument, torchrun, write_results
from benchmarks.runtime_vs_manual import launch, measure

CONFIG = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, max_position_embeddings=64)
BATCH, SEQ, MESH = 16, 64, (2, 2)
LAYOUTS = ("dp", "fsdp", "tp+dp", "fsdp+tp", "auto")
STEPS = 30


def lm_loss(output, target):
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def model_and_batch():
    """The benchmark's model (seeded, so every rank builds the same) and one batch."""
    torch.manual_seed(0)
    model = MODELS["llama"].build(CONFIG, CONFIG["max_position_embeddings"])
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=gen)
    target = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=gen)
    return model, tokens, target


def plan_for(model, tokens, layout: str, hardware) -> autopar.Plan:
    if layout == "auto":
        return autopar.plan(model, MESH, (tokens,), hardware=hardware, time_limit_s=10)
    return autopar.layouts.build(layout, model, MESH, (tokens,), hardware=hardware)


def exported_and_plans(model, tokens, layouts: list[str], hardware) -> tuple[str, dict[str, tuple[str, list[str]]]]:
    """Rank 0 plans each layout and exports it into one folder; every rank gets the folder, the
    plans (as JSON) and what each export notes it could not express, so both sides run the same
    plan everywhere."""
    shared: list[object] = [None, None]
    if dist.get_rank() == 0:
        folder, plans = tempfile.mkdtemp(prefix="autopar-export-"), {}
        for layout in layouts:
            plan = plan_for(model, tokens, layout, hardware)
            exported = plan.export(copy.deepcopy(model), os.path.join(folder, _stem(layout) + ".py"),
                                   example_inputs=(tokens,))
            plans[layout] = (plan.to_json(), list(exported.notes))
        shared = [folder, plans]
    dist.broadcast_object_list(shared)
    return shared[0], shared[1]


def _stem(layout: str) -> str:
    return "export_" + layout.replace("+", "_")


def load(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def local_bytes(tensors) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return local_bytes(v for state in optimizer.state.values() for v in state.values()
                       if isinstance(v, torch.Tensor) and v.dim() > 0)


def exported_step(written, model, mesh, tokens, target):
    """The exported module's training step, as a user's plain loop runs it; returns (step,
    losses seen, optimizer, parameters)."""
    laid = written.parallelize(model, mesh)
    params = list(laid.parameters())
    optimizer = adamw(params)
    x, y = written.local_batch(tokens, mesh), written.local_batch(target, mesh)
    region = loss_parallel if getattr(written, "LOSS_PARALLEL", False) else contextlib.nullcontext
    losses: list[float] = []

    def step() -> None:
        with region():
            loss = lm_loss(laid(x), y)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = torch.tensor([(loss.full_tensor() if isinstance(loss, DTensor) else loss).item()], dtype=torch.float64)
        dist.all_reduce(value)  # each rank's loss is the mean of its rows, and every rank holds as many
        losses.append(value.item() / dist.get_world_size())

    return step, losses, optimizer, params


def main(layouts: list[str], steps: int, hardware: str, out: Path = RESULTS_DIR) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    warnings.filterwarnings("ignore")  # torch's notes on gloo and DTensor
    model, tokens, target = model_and_batch()
    if hardware == "measured":  # the plans made for these ranks (measured once, then cached)
        hardware = profile_mesh(MESH, ("a0", "a1"))[0]
    folder, plans = exported_and_plans(model, tokens, layouts, hardware)
    rows, notes = [], []
    for layout in layouts:
        plan = autopar.Plan.from_json(plans[layout][0])
        notes += [f"- {layout}: {note}" for note in plans[layout][1]]
        written = load(os.path.join(folder, _stem(layout) + ".py"))
        pm = autopar.compile(copy.deepcopy(model), init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=plan.axis_names),
                             (tokens,), loss_fn=lm_loss, optimizer=adamw, plan=plan)
        mesh = init_device_mesh("cpu", written.MESH_SHAPE, mesh_dim_names=written.AXIS_NAMES)
        step, exported_losses, optimizer, params = exported_step(written, copy.deepcopy(model), mesh, tokens, target)
        runtime_losses: list[float] = []
        times = measure({"autopar": lambda: runtime_losses.append(float(pm.train_step((tokens,), target))),
                         "exported": step}, steps)
        a, e = statistics.median(times["autopar"]), statistics.median(times["exported"])
        paired = statistics.median(x / y for x, y in zip(times["autopar"], times["exported"]))
        differs = max(abs(x - y) for x, y in zip(runtime_losses, exported_losses))
        state = torch.tensor([local_bytes(pm.state_tensors()) + optimizer_bytes(pm.optimizer),
                              local_bytes(params) + optimizer_bytes(optimizer)], dtype=torch.float64)
        dist.all_reduce(state, op=dist.ReduceOp.MAX)
        rows.append((layout, a, e, paired, differs, state[0].item(), state[1].item(), len(plans[layout][1])))
    if dist.get_rank() == 0:
        lines = [f"Hugging Face Llama, hidden {CONFIG['hidden_size']}, {CONFIG['num_hidden_layers']} layers, vocab "
                 f"{CONFIG['vocab_size']}, batch {BATCH} x {SEQ}, float32, {dist.get_world_size()} gloo ranks on a "
                 f"{'x'.join(map(str, MESH))} mesh, plans for {hardware_name(hardware)}, median of {steps} steps each, "
                 "interleaved ABBA", "",
                 "| plan | autopar runtime (ms) | exported (ms) | runtime / exported | median of step ratios | "
                 "largest loss difference | state per rank, runtime / exported (KiB) | export notes |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {name} | {a * 1e3:.1f} | {e * 1e3:.1f} | {a / e:.2f} | {paired:.2f} | {differs:.1e} | "
                  f"{s_a / 1024:.0f} / {s_e / 1024:.0f} | {n} |" for name, a, e, paired, differs, s_a, s_e, n in rows]
        lines += ["", "Where the export departs from the plan (torch's APIs cannot express the choice; it runs the "
                      "nearest expressible one, so the two sides differ there):", ""] + (notes or ["- nowhere"])
        print("\n".join(lines))
        write_results("export_vs_runtime", "gloo", "One plan, autopar's runtime against its plain-PyTorch export",
                      lines, out, launcher=torchrun(dist.get_world_size()))
    dist.barrier()
    dist.destroy_process_group()


def hardware_name(hardware) -> str:
    return hardware if isinstance(hardware, str) else "these ranks' measured profile"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS), metavar="LAYOUT",
                        help=f"which plans to run (default: all of {', '.join(LAYOUTS)})")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"timed steps per side (default {STEPS})")
    parser.add_argument("--hardware", default="measured",
                        help="what the plans are made for: 'measured' (these gloo ranks' profile) or a preset (h100)")
    add_out_argument(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":
    options = parse(sys.argv[1:])
    if "RANK" in os.environ:
        sys.exit(main(options.layouts, options.steps, options.hardware, options.out))
    sys.exit(launch("benchmarks.export_vs_runtime", ["--layouts", *options.layouts, "--steps", str(options.steps),
                                                     "--hardware", options.hardware, "--out", str(options.out.resolve())]))
