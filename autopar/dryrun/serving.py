"""The dry run of a serving plan: every distinct rank's prefill and decode step at the plan's
full world size, on one machine, no devices.

As the training dry run (``autopar.dryrun``) does: each distinct rank (``distinct_ranks``:
without a pipeline the first and the last; with one, a rank per stage) builds its own
``InferenceModule`` on torch's ``"fake"`` process group under ``FakeTensorMode`` (its weights
and cache shards fake tensors: nothing allocated), so every shape and collective of both
programs is checked, and runs one prefill and one decode step under torch's ``MemTracker``:
its weights (parameters), its key-value cache and the step's activations at the peak,
beside the plan's prediction for that rank. One process holds one rank at a time, so a
pipeline stage receives fake values of the shapes the stage before sends (``Relay.dry``).
"""

from __future__ import annotations

import dataclasses
import math
import time
import traceback
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar.dryrun.results import DryRunResult, RankResult
from autopar.runtime.inference import InferenceModule
from autopar.passes.generation import example_inputs, is_cache, meta_twin
from autopar.passes.plan import Plan

CPU = torch.device("cpu")
# MemTracker's reference types -> a serving plan's kinds: the model's weights and buffers
# are the held module's parameters, the cache its buffers, the rest what a step makes and frees
_KIND_OF = {_MemRefType.PARAM: "parameters", _MemRefType.BUFFER: "kv_cache", _MemRefType.ACT: "activations",
            _MemRefType.TEMP: "activations", _MemRefType.OTH: "activations"}


def dry_run_serving(plan: Plan, model: nn.Module, ranks: list[int], coordinates: list[tuple[int, ...]],
                    predicted: list[dict[str, float]]) -> DryRunResult:
    """Each of ``ranks`` (at ``coordinates``, with its ``predicted`` memory by kind) built and
    stepped (the module docstring), one after another in this process."""
    started = time.perf_counter()
    results = [RankResult(r, c, predicted=p) for r, c, p in zip(ranks, coordinates, predicted)]
    model = meta_twin(model)  # built here, not under the ranks' fake tensor mode: weights are not read
    for result in results:
        _run_rank(plan, model, result)
    return DryRunResult(plan.kind, tuple(plan.mesh_shape), results, dict(plan.predicted.memory),
                        seconds=time.perf_counter() - started)


def _run_rank(plan: Plan, model: nn.Module, result: RankResult) -> None:
    started = time.perf_counter()
    dist.init_process_group("fake", rank=result.rank, world_size=math.prod(plan.mesh_shape), store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", tuple(plan.mesh_shape), mesh_dim_names=tuple(plan.axis_names))
        with FakeTensorMode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = InferenceModule(model, plan, mesh)
            module.place = dataclasses.replace(module.place, dry=True)
            if plan.pipeline is not None:
                result.stages = (module.place.stage,)
            held = nn.Module()  # the model's state as parameters, the cache as buffers: the tracker's kinds
            for i, (fqn, t) in enumerate(module.state.items()):
                if not is_cache(fqn):
                    held.register_parameter(f"w{i}", nn.Parameter(t, requires_grad=False))
                else:
                    held.register_buffer(f"b{i}", t)
            work = module.workload
            tracker = MemTracker()
            tracker.track_external(held)
            with tracker:
                module._run(module.prefill, example_inputs(module.rows, work.prompt_len, work.max_len, CPU))
                module._run(module.decode, example_inputs(module.rows, 1, work.max_len, CPU))
        peak = tracker.get_tracker_snapshot("peak").get(CPU, {})
        result.memory = {kind: 0 for kind in dict.fromkeys(_KIND_OF.values())}
        for ref, kind in _KIND_OF.items():
            result.memory[kind] += int(peak.get(ref, 0))
        result.peak = int(peak.get(_TOTAL_KEY, 0))
        result.ok = True
    except Exception as e:  # noqa: BLE001  (any failure is the finding: reported with its rank)
        result.error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        result.traceback = traceback.format_exc()
    finally:
        dist.destroy_process_group()
        result.seconds = time.perf_counter() - started
