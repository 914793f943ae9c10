"""Run under torchrun: autopar.runtime.checkpoint.Checkpointer on 4 gloo ranks. Prints one JSON
line per case on rank 0 ("RESULT {...}").

    torchrun --standalone --nproc_per_node 4 -m tests.distributed.checkpoint_check <root> resume:4:dp ...

Cases (a GPT with dropout 0.1, an LR warm-up by LambdaLR, AdamW):
- ``resume:<mesh>:<layout...>``: train STEPS steps saving after steps 1-4 (even steps
  asynchronously, keep=2) with the scheduler and a per-rank data position as ``extra``; a
  fresh module (RNG reseeded elsewhere) loads the newest and trains the rest: its losses
  must equal the uninterrupted run's exactly. Every rank seeded alike, as users do
  (``resume-seeded``: each rank its own seed, a data-parallel plan).
- ``rng:<mesh>:<layout...>``: ranks seeded one by one under tensor parallelism: the save
  warns, a load gives every rank the RNG state of the first rank running the same rows.
- ``reshard:<mesh>:<layout...>:<mesh>:<layout...>``: a checkpoint of one layout loaded into
  another (dropout 0: other layouts draw other masks); the losses agree to rounding.
- ``export:<mesh>:<layout...>``: ``full_state_dict`` and ``export`` against the model's own
  state_dict; a persistent buffer travels in checkpoints.
- ``async``: an asynchronous save returns while the disk writes are held back.
- ``errors``: another model's checkpoint, corrupted ones (shard, metadata, marker; with and
  without a marker), a folder without its marker, extra state under other names: the
  messages of every rank.
- ``train:<steps>:<kill step>``: the fault test's run (``AUTOPAR_KILL_RANK`` set: that rank
  kills itself with SIGKILL inside the save of ``<kill step>``, once its shard is written).
- ``after-kill:<steps>``: resumes from ``root``, then trains an uninterrupted run from
  scratch in the same launch; the losses from the resumed step on must be equal.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn

from autopar.runtime import checkpoint
from autopar.runtime.checkpoint import Checkpointer
from autopar.models import GPT, GPTConfig
from tests.distributed import ending, train_check
from tests.distributed.train_check import DTYPE, lm_loss

STEPS = 6
WARMUP = 8
DROPOUT = 0.1
PROBE = True
HELD_S = 60.0  # how long the asynchronous case's writer waits at most for its release


def gpt(dropout: float) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, max_seq_len=8, dim=32, n_heads=4, n_layers=2, dropout=dropout)).to(DTYPE)


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (8, 8), generator=gen), torch.randint(0, 64, (8, 8), generator=gen))
            for _ in range(steps)]


def warmup(optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP))


def mesh_of(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("x"))


_PLANS: dict[tuple, object] = {}  # (model class, mesh, layout) -> its plan, made once


def compiled_for(parts: list[str], model: nn.Module, mesh: tuple[int, ...], tokens, loss_fn):
    """train_check.compiled_for, its plans kept per model class (its own cache is per layout)."""
    key = (type(model).__name__, mesh, tuple(parts))
    train_check._PLANS.clear()
    if key in _PLANS:
        train_check._PLANS[(mesh, tuple(parts))] = _PLANS[key]
    pm = train_check.compiled_for(parts, model, mesh, tokens, loss_fn)
    _PLANS[key] = pm.plan
    return pm


def module(parts: list[str], mesh: tuple[int, ...], dropout: float, seed_per_rank: bool = False):
    """A compiled GPT, every rank seeded alike (``gpt``) as users do; ``seed_per_rank``: then
    each rank reseeded on its own (draws its own dropout masks: right where every rank runs
    rows of its own, a data-parallel plan; tensor-parallel peers must draw alike)."""
    pm = compiled_for(parts, gpt(dropout), mesh, batches(1)[0][0], lm_loss)
    if seed_per_rank:
        torch.manual_seed(100 + dist.get_rank())
    return pm


class Position:
    """A data loader's position, per rank (each reads its own shard of the data): a Stateful."""

    def __init__(self, consumed: int = 0):
        self.consumed = consumed

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = state["consumed"]


def position_at(step: int) -> int:
    return 1000 * dist.get_rank() + step


def on_every_rank(value) -> list:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def rng_crc() -> int:
    return zlib.crc32(torch.get_rng_state().numpy().tobytes())


def train(pm, scheduler, data, first: int, last: int, saving=None) -> list[float]:
    """Steps ``first``..``last - 1``; ``saving(step)`` after each (steps counted from 1)."""
    losses = []
    for step in range(first, last):
        inputs, target = data[step]
        losses.append(pm.train_step((inputs,), target).item())
        scheduler.step()
        if saving is not None:
            saving(step + 1)
    return losses


def folder(root: Path, name: str) -> Path:
    path = root / name
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    return path


def resume_case(root: Path, spec: str) -> dict:
    """``resume``: every rank seeded alike; ``resume-seeded``: each rank its own seed. The
    scheduler is saved once (the same on every rank), the data position per rank."""
    kind, mesh_text, *parts = spec.split(":")
    mesh, data, path = mesh_of(mesh_text), batches(STEPS), folder(root, spec.replace(":", "_"))
    seed_per_rank = kind == "resume-seeded"
    pm = module(parts, mesh, dropout=DROPOUT, seed_per_rank=seed_per_rank)
    scheduler = warmup(pm.optimizer)
    saver = Checkpointer(pm, path, keep=2)

    def saving(step: int) -> None:
        if step <= 4:
            extra = {"scheduler": scheduler, "data": Position(position_at(step))}
            saver.save(step, extra=extra, asynchronous=step % 2 == 0)

    uninterrupted = train(pm, scheduler, data, 0, STEPS, saving)
    saver.wait()
    second = module(parts, mesh, dropout=DROPOUT, seed_per_rank=seed_per_rank)
    dropout_active = None
    if parts[0] != "pp" and PROBE:  # two forwards in train mode: dropout draws different masks
        with torch.no_grad():
            dropout_active = not torch.equal(second(data[0][0]), second(data[0][0]))
    torch.manual_seed(12345)  # another stream: only the checkpoint's RNG states give the saved run's masks
    scheduler2 = warmup(second.optimizer)
    loader = Checkpointer(second, path, keep=2)
    position = Position()
    start = loader.load(extra={"scheduler": scheduler2, "data": position})
    lr_at_load = second.optimizer.param_groups[0]["lr"]
    positions = on_every_rank((position.consumed, position_at(start)))
    resumed = train(second, scheduler2, data, start, STEPS)
    saved = dcp.FileSystemReader(str(loader.folder(start))).read_metadata().state_dict_metadata
    plan_saved = (loader.folder(start) / checkpoint.PLAN_FILE).read_text() == second.plan.to_json()
    return {"plan_saved": plan_saved, "case": spec, "start": start, "kept": saver.complete_steps(), "dropout_active": dropout_active,
            "uninterrupted": uninterrupted[start:], "resumed": resumed, "exact": uninterrupted[start:] == resumed,
            "lr_at_load": lr_at_load, "lr_expected": min(1.0, (start + 1) / WARMUP) * 1e-2,
            "positions": positions, "extra_entries": sorted(k for k in saved if k.startswith("extra"))}


def rng_case(root: Path, spec: str) -> dict:
    """``rng:<mesh>:<layout>``: ranks seeded one by one. Dropout reads none of their generators
    (``autopar.runtime.draws``), so the save does not warn; a load gives each rank back its own
    generator state and the module its random stream (seed and count), whatever either held."""
    _, mesh_text, *parts = spec.split(":")
    path = folder(root, spec.replace(":", "_"))
    pm = module(parts, mesh_of(mesh_text), dropout=DROPOUT, seed_per_rank=True)
    train(pm, warmup(pm.optimizer), batches(1), 0, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Checkpointer(pm, path).save(1)
    saved, draws_saved = on_every_rank(rng_crc()), pm.draws.state_dict()
    torch.manual_seed(5)
    pm.draws.load_state_dict({"seed": 5, "count": 0})
    Checkpointer(pm, path).load()
    return {"case": spec, "warned": [str(w.message) for w in caught if "RNG" in str(w.message)],
            "saved": saved, "loaded": on_every_rank(rng_crc()), "draws_saved": draws_saved,
            "draws_loaded": pm.draws.state_dict()}


def reshard_case(root: Path, spec: str) -> dict:
    _, mesh_a, *rest = spec.split(":")
    split = next(i for i, p in enumerate(rest) if p[0].isdigit())
    parts_a, mesh_b, parts_b = rest[:split], rest[split], rest[split + 1:]
    data, path = batches(STEPS), folder(root, spec.replace(":", "_"))
    pm = module(parts_a, mesh_of(mesh_a), dropout=0.0)
    scheduler = warmup(pm.optimizer)
    saver = Checkpointer(pm, path)
    uninterrupted = train(pm, scheduler, data, 0, STEPS,
                          lambda step: saver.save(step, extra={"scheduler": scheduler}) if step == 3 else None)
    second = module(parts_b, mesh_of(mesh_b), dropout=0.0)
    scheduler2 = warmup(second.optimizer)
    start = Checkpointer(second, path).load(extra={"scheduler": scheduler2})
    resumed = train(second, scheduler2, data, start, STEPS)
    return {"case": spec, "start": start, "uninterrupted": uninterrupted[start:], "resumed": resumed,
            "loss_err": max(abs(a - b) for a, b in zip(uninterrupted[start:], resumed))}


class Scaled(nn.Module):
    """A persistent buffer in the forward: checkpoints and state dicts must carry it."""

    def __init__(self, scale: float):
        super().__init__()
        self.inner = gpt(0.0)
        self.register_buffer("scale", torch.tensor(scale, dtype=DTYPE))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(tokens) * self.scale


def export_case(root: Path, spec: str) -> dict:
    _, mesh_text, *parts = spec.split(":")
    mesh, data, path = mesh_of(mesh_text), batches(2), folder(root, spec.replace(":", "_"))
    pm = compiled_for(parts, Scaled(2.0), mesh, data[0][0], lm_loss)
    for inputs, target in data:
        pm.train_step((inputs,), target)
    full = pm.full_state_dict()
    params = pm.full_parameters()
    reference = Scaled(0.0)
    names_match = list(full) == list(reference.state_dict())
    params_match = all(torch.equal(full[name], value) for name, value in params.items())
    checkpoint.export(pm, path / "model.safetensors")
    Checkpointer(pm, path / "ckpt").save(2)
    other = compiled_for(parts, Scaled(3.0), mesh, data[0][0], lm_loss)
    Checkpointer(other, path / "ckpt").load()
    buffer_loaded = other.full_state_dict()["scale"].item()
    result = {"case": spec, "names_match": names_match, "params_match": params_match,
              "buffer": full["scale"].item(), "buffer_loaded": buffer_loaded}
    if dist.get_rank() == 0:
        missing, unexpected = reference.load_state_dict(load_file(path / "model.safetensors"))
        result["load_state_dict"] = {"missing": missing, "unexpected": unexpected}
        result["exported_equal"] = all(torch.equal(reference.state_dict()[k], v) for k, v in full.items())
    dist.barrier()
    return result


def hf_export_case(root: Path) -> dict:
    """GPT-2 (tied embedding and head) exported, read back by from_pretrained."""
    from tests.models import gpt2
    from transformers import GPT2LMHeadModel

    model, (tokens,) = gpt2()
    model = model.to(DTYPE)
    path = folder(root, "hf")
    pm = compiled_for(["dp"], model, (4,), tokens, lambda out, target: lm_loss(out.logits, target))
    pm.train_step((tokens,), tokens)
    checkpoint.export(pm, path / "model.safetensors")
    full = pm.full_state_dict()
    result = {"case": "hf-export"}
    if dist.get_rank() == 0:
        model.config.save_pretrained(path)
        loaded = GPT2LMHeadModel.from_pretrained(path, dtype=DTYPE)
        result["from_pretrained_equal"] = all(torch.equal(loaded.state_dict()[k], v) for k, v in full.items())
        result["tied"] = loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    dist.barrier()
    return result


def errors_case(root: Path) -> dict:
    """Wrong or damaged checkpoints: an autopar: error on every rank, the module untouched."""
    path = folder(root, "errors")
    data = batches(1)
    pm = module(["dp"], (4,), dropout=0.0)
    scheduler = warmup(pm.optimizer)
    pm.train_step((data[0][0],), data[0][1])
    Checkpointer(pm, path).save(1, extra={"scheduler": scheduler})
    messages, untouched = {}, {}
    nothing_yet = Checkpointer(pm, path / "empty").load()

    def expect(name: str, target, load) -> None:
        before = {k: v.clone() for k, v in target.full_state_dict().items()}
        try:
            load()
            messages[name] = "no error"
        except ValueError as exc:
            messages[name] = str(exc)
        after = target.full_state_dict()
        untouched[name] = all(torch.equal(before[k], after[k]) for k in before)

    other = compiled_for(["dp"], Scaled(1.0), (4,), data[0][0], lm_loss)  # other names (inner.*, scale)
    expect("other model", other, lambda: Checkpointer(other, path).load(extra={"scheduler": warmup(other.optimizer)}))
    fresh = module(["dp"], (4,), dropout=0.0)
    expect("extra names", fresh, lambda: Checkpointer(fresh, path).load(extra={"schedule": warmup(fresh.optimizer)}))
    # a folder of a later step without its completion marker is never loaded
    if dist.get_rank() == 0:
        shutil.copytree(path / "step_00000001", path / "step_00000009")
        (path / "step_00000009" / checkpoint.MARKER).unlink()
    dist.barrier()
    found = Checkpointer(fresh, path).load(extra={"scheduler": warmup(fresh.optimizer)})
    # damage the complete one: a shard file cut short
    shard = sorted((path / "step_00000001").glob("*.distcp"))[-1]
    shard_length = shard.stat().st_size
    dist.barrier()
    if dist.get_rank() == 0:
        shard.write_bytes(shard.read_bytes()[:100])
    dist.barrier()
    damaged = module(["dp"], (4,), dropout=0.0)
    expect("truncated shard", damaged,
           lambda: Checkpointer(damaged, path).load(extra={"scheduler": warmup(damaged.optimizer)}))
    if dist.get_rank() == 0:  # a shard file of the right length whose bytes are garbage
        shard.write_bytes(bytes(shard_length))
    dist.barrier()
    expect("garbled shard", damaged,
           lambda: Checkpointer(damaged, path).load(extra={"scheduler": warmup(damaged.optimizer)}))
    if dist.get_rank() == 0:
        (path / "step_00000001" / ".metadata").write_bytes(b"not a checkpoint")
    dist.barrier()
    expect("garbled metadata", damaged,
           lambda: Checkpointer(damaged, path).load(extra={"scheduler": warmup(damaged.optimizer)}))
    if dist.get_rank() == 0:  # the marker itself unreadable
        (path / "step_00000001" / checkpoint.MARKER).write_text("{not json")
    dist.barrier()
    expect("garbled marker", damaged,
           lambda: Checkpointer(damaged, path).load(extra={"scheduler": warmup(damaged.optimizer)}))
    # a folder of checkpoint.save (a marker with checksums): a shard's bytes garbled, its length kept
    checkpoint.save(pm, path / "plain")
    plain_shard = sorted((path / "plain").glob("*.distcp"))[-1]
    plain_bytes = plain_shard.read_bytes()
    dist.barrier()
    if dist.get_rank() == 0:
        plain_shard.write_bytes(bytes(len(plain_bytes)))
    dist.barrier()
    expect("garbled, plain", damaged, lambda: checkpoint.load(damaged, path / "plain"))
    if dist.get_rank() == 0:  # without the marker (a folder DCP wrote alone): DCP reads, fails on every rank
        (path / "plain" / checkpoint.MARKER).unlink()
    dist.barrier()
    expect("garbled, no marker", damaged, lambda: checkpoint.load(damaged, path / "plain"))
    if dist.get_rank() == 0:  # and cut short: DCP's metadata names the short file before reading
        plain_shard.write_bytes(plain_bytes[:100])
    dist.barrier()
    expect("truncated, no marker", damaged, lambda: checkpoint.load(damaged, path / "plain"))
    return {"case": "errors", "messages": messages, "untouched": untouched, "without_marker_ignored": found == 1,
            "nothing_yet": nothing_yet,
            "every_rank": on_every_rank(messages)}


def async_case(root: Path) -> dict:
    """``save(asynchronous=True)`` returns while every rank's disk write is held back (a
    writer that waits for an event): the step is not blocked on the disk; the checkpoint
    becomes complete only once written."""
    path = folder(root, "async")
    pm = module(["dp"], (4,), dropout=0.0)
    train(pm, warmup(pm.optimizer), batches(1), 0, 1)
    released = threading.Event()
    writer = dcp.FileSystemWriter
    write_data = writer.write_data

    def held_back(self, plan, planner):
        released.wait(HELD_S)
        return write_data(self, plan, planner)

    writer.write_data = held_back
    try:
        saver = Checkpointer(pm, path)
        began = time.perf_counter()
        saver.save(1, asynchronous=True)
        returned_s = time.perf_counter() - began
        complete_while_held = saver.complete_steps()
        released.set()
        saver.wait()
    finally:
        writer.write_data = write_data
    return {"case": "async", "returned_s": max(on_every_rank(returned_s)), "held_s": HELD_S,
            "complete_while_held": complete_while_held, "complete_after": saver.complete_steps()}


def kill_inside_save(step_to_kill: int, rank_to_kill: int) -> None:
    """That rank dies by SIGKILL inside the save of that step, just after writing its shard."""
    writer = torch.distributed.checkpoint.FileSystemWriter
    write_data = writer.write_data

    def write_then_die(self, plan, planner):
        done = write_data(self, plan, planner)
        if f"step_{step_to_kill:08d}" in str(self.path) and dist.get_rank() == rank_to_kill:
            done.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return done

    writer.write_data = write_then_die


def train_run(root: Path, steps: int, kill_step: int) -> dict:
    """Checkpoints after every second step (the 4th asynchronously); see AUTOPAR_KILL_RANK."""
    if "AUTOPAR_KILL_RANK" in os.environ:
        kill_inside_save(kill_step, int(os.environ["AUTOPAR_KILL_RANK"]))
    pm = module(["dp"], (4,), dropout=0.1)
    scheduler = warmup(pm.optimizer)
    saver = Checkpointer(pm, root / "run", keep=2)

    def saving(step: int) -> None:
        if step % 2 == 0:
            saver.save(step, extra={"scheduler": scheduler}, asynchronous=step == 4)

    losses = train(pm, scheduler, batches(steps), 0, steps, saving)
    saver.wait()
    return {"case": "train", "losses": losses}


def after_kill(root: Path, steps: int) -> dict:
    data = batches(steps)
    pm = module(["dp"], (4,), dropout=0.1)
    torch.manual_seed(777)
    scheduler = warmup(pm.optimizer)
    saver = Checkpointer(pm, root / "run", keep=2)
    found = saver.complete_steps()
    start = saver.load(extra={"scheduler": scheduler})
    resumed = train(pm, scheduler, data, start, steps,
                    lambda step: saver.save(step, extra={"scheduler": scheduler}) if step % 2 == 0 else None)
    reference = module(["dp"], (4,), dropout=0.1)
    uninterrupted = train(reference, warmup(reference.optimizer), data, 0, steps)
    return {"case": "after-kill", "found": found, "start": start, "resumed": resumed,
            "uninterrupted": uninterrupted[start:], "exact": resumed == uninterrupted[start:]}


def main(root: str, cases: list[str]) -> None:
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    root_path = Path(root)
    for spec in cases:
        kind, *rest = spec.split(":")
        try:
            if kind in ("resume", "resume-seeded"):
                result = resume_case(root_path, spec)
            elif kind == "async":
                result = async_case(root_path)
            elif kind == "rng":
                result = rng_case(root_path, spec)
            elif kind == "reshard":
                result = reshard_case(root_path, spec)
            elif kind == "export":
                result = export_case(root_path, spec)
            elif kind == "hf-export":
                result = hf_export_case(root_path)
            elif kind == "errors":
                result = errors_case(root_path)
            elif kind == "train":
                result = train_run(root_path, int(rest[0]), int(rest[1]))
            elif kind == "after-kill":
                result = after_kill(root_path, int(rest[0]))
            else:
                raise ValueError(f"unknown case {spec}")
        except Exception as exc:  # reported, then the launch ends: other ranks may be stuck
            print("RESULT " + json.dumps({"case": spec, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
            os._exit(1)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result, default=str), flush=True)
    ending.leave()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
