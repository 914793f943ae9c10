"""The search's independent plans made in forked worker processes (``passes.planner.workers``):
the same plan as one process makes, what the jobs warn and raise seen here, a worker that dies
an ``autopar:`` error rather than a hang."""

import os
import warnings

import pytest
import torch

import autopar
from autopar.models import GPT, GPTConfig
from autopar.passes.planner import search
from autopar.passes.planner.request import PlanningError, PlanRequest
from autopar.passes.planner.workers import run_forked, worker_count

FORK = pytest.mark.skipif(worker_count(2, 2) < 2, reason="no fork here: the search runs in one process")


def _without_timings(value):
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if "seconds" not in k}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def _planned(mesh, workers):
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=512, max_seq_len=128, dim=128, n_heads=4, n_layers=4))
    x = torch.zeros(16, 128, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, mesh, (x,), hardware="h100", time_limit_s=10, workers=workers)


def _forks_seen(monkeypatch) -> list[tuple[int, int]]:
    """(jobs, workers) of every ``run_forked`` call the search makes."""
    seen, real = [], search.run_forked
    monkeypatch.setattr(search, "run_forked",
                        lambda jobs, workers: seen.append((len(jobs), workers)) or real(jobs, workers))
    return seen


@FORK
def test_workers_make_the_plan_one_process_makes(monkeypatch):
    """Four layers on a 4 x 2 mesh: the plan without a pipeline and depths 2 and 4, made in two
    worker processes, give the plan made in this process alone (its JSON, timings aside)."""
    seen = _forks_seen(monkeypatch)
    alone = _planned((4, 2), 1)
    assert seen == []
    forked = _planned((4, 2), 2)
    assert seen == [(3, 2)]  # no pipeline, depths 2 and 4
    assert alone.solver["searched"]["pipeline_depths"]["tried"] == [1, 2, 4], alone.solver["searched"]
    assert _without_timings(forked.to_dict()) == _without_timings(alone.to_dict())
    assert forked.solver["planning_cpu_seconds"] > 0


@FORK
def test_a_budget_of_fewer_depths_plans_its_seeds_ahead_and_the_rest_in_turn(monkeypatch):
    """Four layers on an 8-device line (depths 2 and 4; 8 would leave stages empty), a budget of
    one depth: its seed (depth 4) planned in a worker beside the plan without a pipeline, the
    same plan as alone."""
    monkeypatch.setattr(search, "factorisation_budget", lambda captured, limit: 1)
    seen = _forks_seen(monkeypatch)
    alone, forked = _planned((8,), 1), _planned((8,), 2)
    assert seen == [(2, 2)]  # no pipeline and the seed
    assert alone.solver["searched"]["pipeline_depths"]["tried"] == [1, 4], alone.solver["searched"]
    assert search.seed_factorisations(2)[:1] == [1]  # depth 4, the option planned ahead
    assert _without_timings(forked.to_dict()) == _without_timings(alone.to_dict())


def _value(x):
    return lambda: x


def _warns():
    warnings.warn("autopar: a warning made in a worker", UserWarning)
    return "warned"


def _fails():
    raise PlanningError("autopar: an error raised in a worker")


def _dies():
    os._exit(3)


@FORK
def test_results_come_back_in_order_with_their_warnings_and_errors():
    done, cpu = run_forked([_value(1), _warns, _fails, _value(4)], workers=2)
    assert [d.value for d in done] == [1, "warned", None, 4]
    assert cpu >= 0.0
    with pytest.warns(UserWarning, match="a warning made in a worker"):
        assert done[1].result() == "warned"
    with pytest.raises(PlanningError, match="^autopar: an error raised in a worker$"):
        done[2].result()


@FORK
def test_a_worker_that_dies_is_an_error_not_a_hang():
    with pytest.raises(RuntimeError, match="^autopar: a planning worker process died"):
        run_forked([_value(1), _dies], workers=2)


def test_one_worker_runs_the_jobs_here_and_a_bad_count_is_refused():
    done, cpu = run_forked([_value(1), _warns], workers=1)
    assert [d.value for d in done] == [1, "warned"] and cpu == 0.0
    assert worker_count(None, 1) == 1 and worker_count(8, 3) <= 3
    for bad in (0, -1, 1.5):
        with pytest.raises(PlanningError, match="^autopar: expected workers= a count of processes"):
            PlanRequest(mesh_shape=(2, 2), hardware="h100", workers=bad)


def _count_here(_):
    return worker_count(None, 4)


@FORK
def test_a_daemonic_process_plans_alone():
    """A ``multiprocessing.Pool`` worker may start no process: its search runs in it."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.map(_count_here, [0]) == [1]
