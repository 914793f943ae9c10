"""One rank's failure ends every rank at once: an error injected on one rank of 4 during
capture, planning, the plan broadcast, a training step and a pipeline stage's step.

    python -m tests.distributed.failure_check <folder>

One launch: this process imports torch and autopar and makes the plans once, then forks
``WORLD`` ranks per scenario (every scenario at once, each its own gloo group on its own
port, the default 30-minute timeout). In each scenario one rank raises an injected
``InjectedFailure`` and then stays alive for ``LINGER_S`` with its connections open, as a
process that does not exit would: its peers must end on the side channel
(``autopar.runtime.faults``), not on closed connections. Each rank's stderr goes to
``<folder>/<scenario>.<rank>.err``; ``<folder>/results.json`` holds, per scenario, the
failing rank, when it failed, and each rank's exit code and exit time.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autopar
import autopar.compiler
import autopar.planning
from autopar.runtime.pipeline import PipelineModule
from tests.distributed.plans import layout_plan, pipeline_plan
from tests.distributed.train_check import MODELS, adamw

WORLD = 4
LINGER_S = 15.0  # the failing rank's process stays this long after raising
WAIT_S = 240.0  # the most this launch waits for every rank to exit


class InjectedFailure(RuntimeError):
    pass


@dataclass
class Injection:
    """One rank's side of a scenario: ``fail()`` records the time, then raises."""

    folder: Path
    scenario: str
    rank: int

    def mark(self) -> None:
        (self.folder / f"{self.scenario}.failed_at").write_text(repr(time.time()))

    def fail(self) -> None:
        self.mark()
        raise InjectedFailure(f"autopar-test: injected failure in {self.scenario} on rank {self.rank}")

    def failing(self, original: Callable) -> Callable:
        """``original``, whose calls raise ``fail()``'s error."""
        def call(*args, **kwargs):
            self.fail()
            return original(*args, **kwargs)
        return call


def _mesh(shape: tuple[int, ...]):
    return init_device_mesh("cpu", shape, mesh_dim_names=tuple(f"a{i}" for i in range(len(shape))))


def _train(pm, batches) -> None:
    for inputs, target in batches:
        pm.train_step((inputs,), target)


# --- the scenarios: (failing rank, run(rank, injection, plans)) ----------------------------
def capture_scenario(rank: int, injection: Injection, plans: dict) -> None:
    """Rank 2's capture in ``autopar.compile`` fails; the others go on to train."""
    model, loss_fn, batches = MODELS["mlp"]()
    if rank == 2:
        autopar.compiler.capture = injection.failing(autopar.compiler.capture)
    pm = autopar.compile(model, _mesh((WORLD,)), (batches[0][0],), loss_fn=loss_fn, optimizer=adamw,
                         plan=autopar.Plan.from_json(plans["dp"]))
    _train(pm, batches)


def planning_scenario(rank: int, injection: Injection, plans: dict) -> None:
    """Every rank plans (``autopar.plan`` under the process group); rank 2's planning fails."""
    model, loss_fn, batches = MODELS["mlp"]()
    mesh = _mesh((WORLD,))
    if rank == 2:
        autopar.planning.plan_captured = injection.failing(autopar.planning.plan_captured)
    plan = autopar.plan(model, mesh, (batches[0][0],), layout="dp", hardware="h100")
    pm = autopar.compile(model, mesh, (batches[0][0],), loss_fn=loss_fn, optimizer=adamw, plan=plan)
    _train(pm, batches)


def broadcast_scenario(rank: int, injection: Injection, plans: dict) -> None:
    """``autopar.compile`` plans on rank 0, which fails; the others wait in the plan's broadcast."""
    model, loss_fn, batches = MODELS["mlp"]()
    if rank == 0:
        autopar.planning.plan_captured = injection.failing(autopar.planning.plan_captured)
    pm = autopar.compile(model, _mesh((WORLD,)), (batches[0][0],), loss_fn=loss_fn, optimizer=adamw,
                         hardware="h100")
    _train(pm, batches)


def step_scenario(rank: int, injection: Injection, plans: dict) -> None:
    """Data parallel on 4; rank 2's second training step fails before its first collective."""
    model, loss_fn, batches = MODELS["mlp"]()
    pm = autopar.compile(model, _mesh((WORLD,)), (batches[0][0],), loss_fn=loss_fn, optimizer=adamw,
                         plan=autopar.Plan.from_json(plans["dp"]))
    _train(pm, batches[:1])
    if rank == 2:
        pm._run_model = injection.failing(pm._run_model)
    _train(pm, batches[1:])


def pipeline_scenario(rank: int, injection: Injection, plans: dict) -> None:
    """Two stages of two data-parallel ranks; rank 2 (stage 1) fails inside its stage's
    forward, while stage 0 waits for what it sends back."""
    model, loss_fn, batches = MODELS["mlp"]()
    pm = autopar.compile(model, _mesh((2, 2)), (batches[0][0],), loss_fn=loss_fn, optimizer=adamw,
                         plan=autopar.Plan.from_json(plans["pp"]))
    assert isinstance(pm, PipelineModule)
    _train(pm, batches[:1])
    if rank == 2:
        for stage in pm.stages:
            stage.forward_one_chunk = injection.failing(stage.forward_one_chunk)
    _train(pm, batches[1:])


def disagreement_scenario(rank: int, injection: Injection, plans: dict) -> None:
    """Rank 2 compiles another plan (FSDP where the others have data parallel): before the
    first step runs, every rank finds the programs' collectives differ and raises. Nobody
    waits, so the group is sound: compiled again with one plan, every rank trains on."""
    model, loss_fn, batches = MODELS["mlp"]()
    mesh = _mesh((WORLD,))
    plan = autopar.Plan.from_json(plans["fsdp" if rank == 2 else "dp"])
    pm = autopar.compile(model, mesh, (batches[0][0],), loss_fn=loss_fn, optimizer=adamw, plan=plan)
    injection.mark()  # nothing fails before the step
    try:
        _train(pm, batches[:1])
    except RuntimeError:
        traceback.print_exc()
    else:
        raise AssertionError("the ranks ran programs with different collectives")
    pm = autopar.compile(model, mesh, (batches[0][0],), loss_fn=loss_fn, optimizer=adamw,
                         plan=autopar.Plan.from_json(plans["dp"]))
    _train(pm, batches[:2])
    print("TRAINED ON", file=sys.stderr, flush=True)


SCENARIOS = {
    "capture": (2, capture_scenario),
    "planning": (2, planning_scenario),
    "broadcast": (0, broadcast_scenario),
    "step": (2, step_scenario),
    "pipeline": (2, pipeline_scenario),
    "disagreement": (None, disagreement_scenario),
}


def _plans() -> dict:
    model, _, batches = MODELS["mlp"]()
    tokens = batches[0][0]
    return {"dp": layout_plan(model, (tokens,), "dp", (WORLD,)).to_json(),
            "fsdp": layout_plan(model, (tokens,), "fsdp", (WORLD,)).to_json(),
            "pp": pipeline_plan(model, tokens, (2, 2), "1F1B", 2, 1).to_json()}


def _rank_process(folder: Path, scenario: str, rank: int, port: int, plans: dict) -> None:
    """One rank of one scenario, in a forked child; never returns."""
    code = 1
    try:
        err = os.open(folder / f"{scenario}.{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(err, 1)
        os.dup2(err, 2)
        warnings.simplefilter("ignore")
        failing, run = SCENARIOS[scenario]
        store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
        try:
            run(rank, Injection(folder, scenario, rank), plans)
            code = 0
        except Exception:  # noqa: BLE001  (every rank reports what it raised)
            traceback.print_exc()
            if rank == failing:
                time.sleep(LINGER_S)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(folder: Path) -> None:
    started = time.time()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = _plans()
    forked = time.time()
    children: dict[int, tuple[str, int]] = {}
    for scenario in SCENARIOS:
        port = _free_port()
        for rank in range(WORLD):
            pid = os.fork()
            if pid == 0:
                _rank_process(folder, scenario, rank, port, plans)
            children[pid] = (scenario, rank)
    exits: dict[str, dict[int, tuple[int, float]]] = {s: {} for s in SCENARIOS}
    end = time.time() + WAIT_S
    while children and time.time() < end:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
            continue
        scenario, rank = children.pop(pid)
        exits[scenario][rank] = (os.waitstatus_to_exitcode(status), time.time())
    for pid in children:  # still running: reported as missing
        os.kill(pid, 9)
    results = {"_launch": {"started": started, "forked": forked}}
    for scenario, (failing, _) in SCENARIOS.items():
        failed_at = folder / f"{scenario}.failed_at"
        results[scenario] = {
            "failing": failing,
            "failed_at": float(failed_at.read_text()) if failed_at.exists() else None,
            "exits": {str(rank): exit for rank, exit in sorted(exits[scenario].items())},
        }
    (folder / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
