"""Checkpoints with torch.distributed.checkpoint (DCP), made for long runs.

Each rank writes its shards as DTensors (the placements its plan gives them), so a
checkpoint can be loaded by another plan or another mesh: DCP reshards on load.
Optimizer state tensors shaped like their parameter (AdamW's moments) are laid out like
it; scalar state (the step count) is replicated.

``Checkpointer(pm, root, keep)`` keeps numbered checkpoints under ``root``:

    root/step_00000050/   complete: DCP's files, plan.json and the COMPLETE marker
    root/.staging_step_00000100/   a save under way (or one killed): never loaded

A save writes into its staging folder; when every rank has finished (a barrier) rank 0
renames it to ``step_<n>`` and then writes ``COMPLETE`` (with each file's CRC-32, the
ranks sharing the reading). ``load`` only considers folders with the marker, so a run
killed anywhere in a save resumes from the previous one.
A checkpoint holds the parameters (what the optimizer steps: ZeRO-1 slices), buffers,
the optimizer's state and ``param_groups`` (the learning rate...), the step, each
rank's RNG states (CPU, and CUDA where used), the plan as JSON, and the user's
``Stateful`` objects (``state_dict`` / ``load_state_dict``) given as ``extra``: a state
that is the same on every rank (an LR scheduler) is kept once, one that differs (a
per-rank data position) once per rank.

Randomness: the module's random stream (``autopar.runtime.draws``: the agreed seed and the
count of runs; what dropout draws) is saved once and restored, so a resumed run draws the
masks the uninterrupted one would have. Each rank's own generators (the user's: data
order, say) are saved per rank and restored when the world size is the one that saved.

Loading checks before DCP reads a byte, on every rank, each rank raising alike: the
marker's checksums (every rank reading its share of the files), the names and shapes
against the checkpoint's metadata, the files' lengths, the ``extra`` names. It reads
everything into temporaries and copies only then: a checkpoint of another model, or a
damaged one, raises an ``autopar:`` error naming the entries, and nothing of the module
is changed.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import threading
import warnings
import zlib
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from safetensors.torch import save_file

from autopar.runtime.checkpoint_files import (MARKER, agreed, barrier, check_checksums, file_checksums, gathered,
                                                short, this_rank, world_size, write_marker)
from autopar.runtime.contract import TrainingModule
from autopar.runtime.faults import failures_shared
from autopar.passes.placements import Spec

Module = TrainingModule  # a checkpoint holds a training module's parameters, optimizer and data position

PER_RANK = "extra_per_rank"  # extra states that differ between ranks, under each rank
PLAN_FILE = "plan.json"
_FOLDER = re.compile(r"^step_(\d{8})$")
_STAGING_PREFIX = ".staging_"

# State an elementwise optimizer creates lazily at its first step; made here (zeros) so a
# fresh module can receive a checkpoint before it has taken a step.
_LAZY_STATE = {
    "AdamW": ("exp_avg", "exp_avg_sq"), "Adam": ("exp_avg", "exp_avg_sq"), "SGD": ("momentum_buffer",),
}


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _saved(local: torch.Tensor, spec: Spec | None, mesh: DeviceMesh | None) -> torch.Tensor:
    """As DCP stores it: a DTensor (its placement on the mesh), or a plain tensor where whole."""
    if spec is None or mesh is None:
        return local
    return DTensor.from_local(local, mesh, spec, run_check=False)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


# --- the state dict DCP reads and writes ----------------------------------------------
def _state_dict(pm: Module, temporaries: bool) -> dict[str, Any]:
    """Model and optimizer state as DCP sees it. ``temporaries``: fresh tensors of the same
    layouts (a load fills these, and they are copied in only once all has been read)."""
    fresh = torch.empty_like if temporaries else (lambda t: t)
    model, optim = {}, {}
    for name, (local, spec, mesh) in pm.held_parameters().items():
        model[name] = _saved(fresh(local.detach()), spec, mesh)
        if pm.optimizer is None:
            continue
        state = pm.optimizer.state[local]
        if temporaries and not state:
            state = _lazy_state(pm.optimizer, local)
        optim[name] = {
            key: _saved(fresh(value), spec, mesh) if _shaped_like(value, local)
            else (fresh(value) if isinstance(value, torch.Tensor) else value)
            for key, value in state.items()
        }
    buffers = {name: _saved(fresh(local), spec, mesh) for name, (local, spec, mesh) in pm.held_buffers().items()}
    groups = [] if pm.optimizer is None else [
        {key: value for key, value in group.items() if key != "params"} for group in pm.optimizer.param_groups]
    return {"model": model, "buffers": buffers, "optim": optim, "param_groups": groups}


def _shaped_like(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def _lazy_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    keys = _LAZY_STATE.get(type(optimizer).__name__)
    if keys is None:
        raise ValueError(
            f"autopar: cannot load optimizer state into a {type(optimizer).__name__} that has not "
            f"stepped yet (known: {sorted(_LAZY_STATE)}); take one step first or use one of those"
        )
    return {**{key: torch.zeros_like(param) for key in keys}, "step": torch.tensor(0.0)}


def _rng_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _rng_kinds() -> list[str]:
    """The generators this process can restore (CUDA's whether or not it is in use yet)."""
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def _set_rng_states(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


def _training_state(pm: Module, step: int, extra: dict[str, Stateful] | None) -> dict[str, Any]:
    """Everything a resumed run needs. RNG states are per rank: each under its own rank's key;
    so are the ``extra`` states that differ between ranks (``_extra_states``)."""
    state = _state_dict(pm, temporaries=False)
    state["step"] = step
    state["draws"] = pm.draws.state_dict()
    state["world_size"] = world_size()
    state["rng"] = {str(this_rank()): _rng_states()}
    state["extra"], state[PER_RANK] = _extra_states(extra)
    return state


def _extra_states(extra: dict[str, Stateful] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the states that are the same on every rank: saved once, e.g. an LR scheduler; the
    others, each rank's under its rank: a data-loader position of per-rank data)."""
    states = {name: obj.state_dict() for name, obj in sorted((extra or {}).items())}
    mine = {name: zlib.crc32(pickle.dumps(value)) for name, value in states.items()}
    every = gathered(mine)
    shared = {name for name in states if all(crcs.get(name) == mine[name] for crcs in every)}
    return ({name: value for name, value in states.items() if name in shared},
            {name: {str(this_rank()): value} for name, value in states.items() if name not in shared})


# --- reading: check, read into temporaries, then copy ---------------------------------
def _flat_keys(tree: Any, prefix: str = "") -> dict[str, Any]:
    """DCP's flattened names ("model.wte.weight", "optim.wte.weight.exp_avg") -> leaf."""
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flat_keys(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def _metadata(path: Path):
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001  (any failure to read is reported the same way)
        raise ValueError(f"autopar: checkpoint {path} is unreadable: its metadata could not be read "
                         f"({type(exc).__name__}: {exc}); expected a folder written by autopar.runtime.checkpoint") from exc


def _check_matches(path: Path, wanted: dict[str, Any], metadata) -> None:
    """Every tensor the module needs is in the checkpoint with its whole shape, and the
    checkpoint holds no model or optimizer tensor the module lacks; else an error naming them."""
    saved = metadata.state_dict_metadata
    ours = {k: v for k, v in _flat_keys(wanted).items() if k.split(".")[0] in ("model", "buffers", "optim")}
    theirs = {k for k in saved if k.split(".")[0] in ("model", "buffers", "optim")}
    every = _on_any_rank(set(ours))  # a pipeline rank holds its stages' entries only
    missing = sorted(every - set(saved))
    unexpected = sorted(theirs - every)
    shapes = sorted(_on_any_rank({  # decided alike on every rank: one that raised alone would leave the others waiting
        f"{k}: checkpoint {tuple(saved[k].size)}, module {tuple(v.shape)}" for k, v in ours.items()
        if k in saved and isinstance(v, torch.Tensor) and isinstance(saved[k], TensorStorageMetadata)
        and tuple(saved[k].size) != tuple(v.shape)}))
    if missing or unexpected or shapes:
        raise ValueError(
            f"autopar: checkpoint {path} does not match this module: missing {_listed(missing)}, unexpected "
            f"{_listed(unexpected)}, other shapes {_listed(shapes)}; expected a checkpoint of the same model "
            "(any plan or mesh). Nothing was loaded")


def _check_files(path: Path, metadata) -> None:
    """Every entry's bytes are where the metadata says (a file cut short or gone: named)."""
    sizes: dict[str, int] = {}
    damaged: dict[str, list[str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        file = path / info.relative_path
        if info.relative_path not in sizes:
            sizes[info.relative_path] = file.stat().st_size if file.is_file() else -1
        if sizes[info.relative_path] < info.offset + info.length:
            damaged.setdefault(info.relative_path, []).append(index.fqn)
    if damaged:
        entries = sorted({fqn for fqns in damaged.values() for fqn in fqns})
        raise ValueError(
            f"autopar: checkpoint {path} is unreadable: files {sorted(damaged)} are missing or shorter than its "
            f"metadata says, so entries {_listed(entries)} cannot be read; expected complete DCP files. Nothing "
            "was loaded; use an older checkpoint")


def _failures(exc: BaseException) -> str:
    """One line per failing rank of a DCP exception (its last line: the error itself)."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return short(exc)
    return "; ".join(f"rank {rank}: {short(str(failure).strip().splitlines()[-1] if str(failure).strip() else failure)}"
                     for rank, failure in sorted(failures.items()))


def _on_any_rank(names: set[str]) -> set[str]:
    """The names held by any rank (all ranks call this)."""
    return set().union(*gathered(names))


def _listed(names: list[str], most: int = 8) -> str:
    return f"{names[:most]}{f' and {len(names) - most} more' if len(names) > most else ''}"


def _check_groups(path: Path, pm: Module, metadata) -> None:
    saved = {int(k.split(".")[1]) for k in metadata.state_dict_metadata if k.startswith("param_groups.")}
    ours = 0 if pm.optimizer is None else len(pm.optimizer.param_groups)
    if len(saved) != ours:
        raise ValueError(f"autopar: checkpoint {path} holds {len(saved)} optimizer param_groups, this module's "
                         f"optimizer {ours}; expected the same optimizer grouping. Nothing was loaded")


def _read(pm: Module, path: Path, extra: dict[str, Stateful] | None, training: bool) -> int | None:
    """Load ``path`` into ``pm`` (and ``extra``); with ``training``, also the step and the RNG
    states (when the world size is the one that saved). Returns the step.

    Every check runs on every rank before DCP reads a byte, and every rank raises alike: a
    rank that raised alone would leave the others waiting in DCP's collectives."""
    check_checksums(path)
    metadata = agreed(lambda: _metadata(path))
    state = _state_dict(pm, temporaries=True)
    _check_matches(path, state, metadata)
    saved = metadata.state_dict_metadata
    state.update(agreed(lambda: _checked_request(pm, path, metadata, extra, training)))
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001  (DCP gathers every rank's failure into one)
        raise ValueError(f"autopar: checkpoint {path} is unreadable ({type(exc).__name__}: {_failures(exc)}); "
                         "expected complete DCP files. Nothing was loaded; use an older checkpoint") from exc
    _commit(pm, state)
    if not training:
        return None
    for name, obj in (extra or {}).items():
        obj.load_state_dict(state["extra"][name] if name in state["extra"] else state[PER_RANK][name][str(this_rank())])
    if "draws" in state:
        pm.draws.load_state_dict(state["draws"])
    if "rng" in state:
        _set_rng_states(state["rng"][str(this_rank())])
    else:
        warnings.warn(f"autopar: checkpoint {path} was written by {_saved_ranks(saved, 'rng')} ranks, this run has "
                      f"{world_size()}: each rank's own RNG states (torch's generators: the data order, say) are not "
                      "restored; the module's random stream (dropout) is", stacklevel=3)
    return int(state["step"])


def _checked_request(pm: Module, path: Path, metadata, extra: dict[str, Stateful] | None,
                     training: bool) -> dict[str, Any]:
    """This rank's checks of the files and the names, and (``training``) what a resumed run reads
    besides the module: the step, the random stream, ``extra`` (shared or this rank's), this
    rank's RNG states."""
    _check_files(path, metadata)
    _check_groups(path, pm, metadata)
    if not training:
        return {}
    saved = metadata.state_dict_metadata
    shared, per_rank = _extra_request(path, saved, extra)
    request = {"step": 0, "extra": shared, PER_RANK: per_rank}
    if "draws.seed" in saved:
        request["draws"] = {"seed": 0, "count": 0}
    if _saved_ranks(saved, "rng") == world_size():
        rank = this_rank()
        held = {kind: saved[f"rng.{rank}.{kind}"] for kind in _rng_kinds() if f"rng.{rank}.{kind}" in saved}
        request["rng"] = {str(rank): {kind: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
                                      for kind, meta in held.items()}}
    return request


def _saved_ranks(saved, section: str) -> int:
    """How many ranks wrote entries under ``section.<rank>.``."""
    return len({k.split(".")[1] for k in saved if k.startswith(f"{section}.")})


def _extra_request(path: Path, saved, extra: dict[str, Stateful] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """What ``extra`` asks the checkpoint for: (the shared states, this rank's states of those
    saved per rank). The names must be those it holds, and per-rank states need this rank."""
    shared = {k.split(".")[1] for k in saved if k.startswith("extra.")}
    per_rank = {k.split(".")[1] for k in saved if k.startswith(f"{PER_RANK}.")}
    given = sorted(extra or {})
    if sorted(shared | per_rank) != given:
        raise ValueError(f"autopar: checkpoint {path} holds extra state {sorted(shared | per_rank)}; load was given "
                         f"{given}; expected the same names as at save (e.g. extra={{'scheduler': scheduler}}). "
                         "Nothing was loaded")
    ranks = {name: {k.split(".")[2] for k in saved if k.startswith(f"{PER_RANK}.{name}.")} for name in per_rank}
    wrong = sorted(name for name, held in ranks.items() if len(held) != world_size() or str(this_rank()) not in held)
    if wrong:
        raise ValueError(
            f"autopar: checkpoint {path} holds extra state {wrong} per rank (it differed between the "
            f"{len(ranks[wrong[0]])} ranks that saved), this run has {world_size()} ranks; expected the same number "
            "to give each rank its own. Nothing was loaded; leave it out of extra and set it from the step, or "
            "make it the same on every rank before saving")
    states = {name: obj.state_dict() for name, obj in (extra or {}).items()}
    return ({name: value for name, value in states.items() if name in shared},
            {name: {str(this_rank()): value} for name, value in states.items() if name in per_rank})


def _commit(pm: Module, state: dict[str, Any]) -> None:
    """Copy what was read (all of it, checked) into the module's tensors and optimizer."""
    with torch.no_grad():
        for name, (local, _, _) in pm.held_parameters().items():
            local.copy_(_local(state["model"][name]))
            if pm.optimizer is None:
                continue
            opt_state = pm.optimizer.state[local]
            for key, value in state["optim"][name].items():
                if not isinstance(value, torch.Tensor):
                    opt_state[key] = value
                elif key in opt_state:
                    opt_state[key].copy_(_local(value))
                else:
                    opt_state[key] = _local(value).clone()
        for name, (local, _, _) in pm.held_buffers().items():
            local.copy_(_local(state["buffers"][name]))
    if pm.optimizer is not None:
        for group, saved in zip(pm.optimizer.param_groups, state["param_groups"]):
            group.update(saved)
    pm.parameters_updated()  # ZeRO-1/2: the whole parameters gathered from the loaded slices


# --- one folder -----------------------------------------------------------------------
def save(pm: Module, path: str | Path) -> None:
    """Write parameters, buffers and optimizer state into ``path``, then (every rank done)
    the ``COMPLETE`` marker with the files' checksums; call on every rank. (No staging, no
    step or RNG: ``Checkpointer`` is the one for resuming a run.)"""
    if this_rank() == 0:  # an earlier save's marker: a save cut short here must not look complete
        (Path(path) / MARKER).unlink(missing_ok=True)
    barrier(None)
    dcp.save(_state_dict(pm, temporaries=False), storage_writer=dcp.FileSystemWriter(str(path)))
    barrier(None)
    write_marker(Path(path), None, file_checksums(Path(path)))
    barrier(None)


def load(pm: Module, path: str | Path) -> None:
    """Read a checkpoint into ``pm``'s own layout (any plan or mesh wrote it); every rank."""
    _read(pm, Path(path), None, training=False)


# --- numbered, atomic checkpoints -------------------------------------------------------
class Checkpointer:
    """Numbered checkpoints of ``pm`` under ``root``, the ``keep`` newest complete ones kept.
    Every rank makes one, and calls ``save`` and ``load`` at the same points.

    ``save(step, extra, asynchronous)``: everything a resumed run needs (see the module's
    docstring); ``extra`` maps names to ``Stateful`` objects: one whose state is the same on
    every rank is kept once (an LR scheduler), one whose state differs is kept per rank and
    loads only into as many ranks (a per-rank data position). With
    ``asynchronous=True`` the state is copied to memory now (``dcp.async_save``) and written
    by a thread; the checkpoint becomes visible when every rank has written it. The next
    ``save``, ``load`` or ``wait()`` waits for the previous save first.

    ``load(extra, step=None)``: the newest complete checkpoint (or that of ``step``) into
    ``pm`` and ``extra`` (the same names as saved), the RNG states restored when the world
    size is the one that saved (else a warning); returns its step, or None when there is
    none.
    """

    def __init__(self, pm: Module, root: str | Path, keep: int = 3):
        if keep < 1:
            raise ValueError(f"autopar: Checkpointer keep={keep}; expected at least 1 checkpoint kept")
        self.pm, self.root, self.keep = pm, Path(root), keep
        # DCP's own collectives (and, for an asynchronous save, its writing thread's) run on
        # a group of their own, so they never interleave with the training's collectives
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._pending: threading.Thread | None = None
        self._failure: BaseException | None = None

    def folder(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def complete_steps(self) -> list[int]:
        """Steps of the complete checkpoints under ``root``, oldest first."""
        if not self.root.is_dir():
            return []
        found = (_FOLDER.match(p.name) for p in self.root.iterdir())
        return sorted(int(m.group(1)) for m in found if m and (self.root / m.group(0) / MARKER).is_file())

    @failures_shared("checkpoint save")
    def save(self, step: int, extra: dict[str, Stateful] | None = None, asynchronous: bool = False) -> None:
        self.wait()
        staging = self.root / f"{_STAGING_PREFIX}{self.folder(step).name}"
        if this_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)  # a save of this step that was killed
            staging.mkdir(parents=True)
        self._barrier()
        state = _training_state(self.pm, step, extra)
        writer = dcp.FileSystemWriter(str(staging))
        if not asynchronous:
            dcp.save(state, storage_writer=writer, process_group=self.group)
            self._publish(staging, step)
            return
        future = dcp.async_save(state, storage_writer=writer, process_group=self.group)
        self._pending = threading.Thread(target=self._publish_when_written, args=(future, staging, step),
                                         name=f"autopar-checkpoint-{step}", daemon=True)
        self._pending.start()

    def wait(self) -> None:
        """Until the asynchronous save under way (if any) is complete; raises its failure."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise RuntimeError(f"autopar: the asynchronous checkpoint save failed ({failure}); the previous "
                               "complete checkpoint stays the newest") from failure

    @failures_shared("checkpoint load")
    def load(self, extra: dict[str, Stateful] | None = None, step: int | None = None) -> int | None:
        self.wait()
        steps = [self.complete_steps()] if this_rank() == 0 else [None]
        if dist.is_initialized():  # every rank loads the one rank 0 found
            dist.broadcast_object_list(steps, src=0, group=self.group)
        if step is not None and step not in steps[0]:
            raise ValueError(f"autopar: no complete checkpoint of step {step} under {self.root}; found steps "
                             f"{steps[0]}")
        if not steps[0]:
            return None
        folder = self.folder(steps[0][-1] if step is None else step)
        return _read(self.pm, folder, extra, training=True)

    def _publish_when_written(self, future: Future, staging: Path, step: int) -> None:
        try:
            future.result()
            self._publish(staging, step)
        except BaseException as exc:  # noqa: BLE001  (raised by the next save, load or wait)
            self._failure = exc

    def _publish(self, staging: Path, step: int) -> None:
        """Once every rank has written: rank 0 moves the staging folder into place, then
        marks it complete, then deletes the ones beyond ``keep``."""
        self._barrier()
        final = self.folder(step)
        if this_rank() == 0:
            (staging / PLAN_FILE).write_text(self.pm.plan.to_json())
            shutil.rmtree(final, ignore_errors=True)  # an incomplete one of the same step
            os.replace(staging, final)
        self._barrier()
        checksums = file_checksums(final, self.group)
        if this_rank() == 0:
            write_marker(final, step, checksums)
            self._prune(step)
        self._barrier()

    def _prune(self, newest: int) -> None:
        complete = self.complete_steps()
        for step in complete[:-self.keep]:
            shutil.rmtree(self.folder(step), ignore_errors=True)
        for path in self.root.iterdir():  # incomplete leftovers of older saves
            match = _FOLDER.match(path.name.removeprefix(_STAGING_PREFIX))
            if match and int(match.group(1)) < newest and int(match.group(1)) not in complete:
                shutil.rmtree(path, ignore_errors=True)

    def _barrier(self) -> None:
        barrier(self.group)


# --- export ---------------------------------------------------------------------------
def export(pm: Module, path: str | Path) -> None:
    """Write the whole model's ``state_dict`` (``pm.full_state_dict()``) as one safetensors
    file, read by ``model.load_state_dict(safetensors.torch.load_file(path))`` and, named
    ``model.safetensors`` in a folder with the model's config, by Hugging Face's
    ``from_pretrained``. Tied weights are written once, under their first name, as
    ``save_pretrained`` does. A collective: every rank calls it; rank 0 writes."""
    full = pm.full_state_dict()
    if this_rank() != 0:
        return
    seen: set[int] = set()
    unique = {}
    for name, value in full.items():
        if id(value) not in seen:
            seen.add(id(value))
            unique[name] = value.detach().contiguous().cpu()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(unique, str(path), metadata={"format": "pt"})
