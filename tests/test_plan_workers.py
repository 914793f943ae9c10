"""The search's independent plans made in forked worker processes (``passes.planner.workers``):
the same plan as one process makes, guesses of the next depth included; what the jobs warn and
raise seen here, a worker that dies an ``autopar:`` error rather than a hang, a guess not asked
for stopped."""

import math
import os
import signal
import time
import warnings

import pytest
import torch

import autopar
from autopar.models import GPT, GPTConfig
from autopar.passes.planner import search
from autopar.passes.planner.request import PlanningError, PlanRequest
from autopar.passes.planner.workers import ForkedJobs, worker_count

FORK = pytest.mark.skipif(worker_count(2, 2) < 2, reason="no fork here: the search runs in one process")


def _without_timings(value):
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if "seconds" not in k}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def _planned(mesh, workers, layers=4):
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=512, max_seq_len=128, dim=128, n_heads=4, n_layers=layers))
    x = torch.zeros(16, 128, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, mesh, (x,), hardware="h100", time_limit_s=10, workers=workers)


def _starts_seen(monkeypatch) -> list[tuple[tuple, bool, int]]:
    """(keys started, guess, workers) of every ``ForkedJobs.start`` that starts a job."""
    seen, real = [], ForkedJobs.start

    def spy(self, *keys, guess=False):
        before = {k for k in keys if self.started(k)}
        real(self, *keys, guess=guess)
        if started := tuple(k for k in keys if k not in before and self.started(k)):
            seen.append((started, guess, self.workers))
    monkeypatch.setattr(ForkedJobs, "start", spy)
    return seen


@FORK
def test_workers_make_the_plan_one_process_makes(monkeypatch):
    """Four layers on a 4 x 2 mesh: the plan without a pipeline and depths 2 and 4, made in two
    worker processes, give the plan made in this process alone (its JSON, timings aside)."""
    seen = _starts_seen(monkeypatch)
    alone = _planned((4, 2), 1)
    assert seen == []
    forked = _planned((4, 2), 2)
    assert seen == [((None, 0, 1), False, 2)]  # no pipeline, depths 2 and 4: nothing left to guess
    assert alone.solver["searched"]["pipeline_depths"]["tried"] == [1, 2, 4], alone.solver["searched"]
    assert _without_timings(forked.to_dict()) == _without_timings(alone.to_dict())
    assert forked.solver["planning_cpu_seconds"] > 0


@FORK
def test_a_budget_of_fewer_depths_plans_its_seeds_ahead_and_the_rest_in_turn(monkeypatch):
    """Four layers on an 8-device line (depths 2 and 4; 8 would leave stages empty), a budget of
    one depth: its seed (depth 4) planned in a worker beside the plan without a pipeline, the
    same plan as alone."""
    monkeypatch.setattr(search, "factorisation_budget", lambda captured, limit: 1)
    seen = _starts_seen(monkeypatch)
    alone, forked = _planned((8,), 1), _planned((8,), 2)
    assert seen == [((None, 1), False, 2)]  # no pipeline and the seed, the whole budget
    assert alone.solver["searched"]["pipeline_depths"]["tried"] == [1, 4], alone.solver["searched"]
    assert search.seed_factorisations(2)[:1] == [1]  # depth 4, the option planned ahead
    assert _without_timings(forked.to_dict()) == _without_timings(alone.to_dict())


@FORK
def test_a_guess_of_the_next_depth_runs_on_an_idle_worker_and_changes_nothing(monkeypatch):
    """Eight layers on an 8-device line (depths 2, 4 and 8), a budget of two depths and one seed
    (depth 4): the worker the plan without a pipeline leaves idle guesses the depth asked for
    next. Right or wrong (a wrong one gives its worker up, or is stopped), the plan is the one
    process's."""
    monkeypatch.setattr(search, "factorisation_budget", lambda captured, limit: 2)
    monkeypatch.setattr(search, "seed_factorisations", lambda n: [n // 2])
    seen = _starts_seen(monkeypatch)
    alone = _planned((8,), 1, layers=8)
    assert seen == []
    forked = _planned((8,), 2, layers=8)
    assert seen[0] == ((None, 1), False, 2)
    # one worker idles: one guess, depth 8 or 2 (which depends on depth 4's time, known if it
    # finished before the plan without a pipeline)
    assert seen[1] in [((2,), True, 2), ((0,), True, 2)], seen
    assert all(guess for _, guess, _ in seen[1:]), seen
    assert len(alone.solver["searched"]["pipeline_depths"]["tried"]) == 3, alone.solver["searched"]
    assert _without_timings(forked.to_dict()) == _without_timings(alone.to_dict())


def test_the_guesses_are_the_next_depth_either_way_and_none_past_the_budget():
    options = [(2 ** k, (1,)) for k in range(1, 10)]  # nine depths, indices 0-8; seeds 4, 2, 6
    assert search.seed_factorisations(9) == [4, 2, 6]
    # a seed not planned yet comes next, whatever the pending one gives
    assert search.next_guesses(options, {4: 1.0}, [2], budget=4) == [6]
    # index 2 is the best so far and index 1 is planned: if 1 is not the best the bisection
    # goes above 2 (to 3), if it is, below 1 (to 0)
    found = {4: 1.0, 2: 0.9, 6: 3.0}
    assert search.next_factorisation(options, found) == 1
    assert search.next_guesses(options, found, [1], budget=6) == [3, 0]
    assert search.next_guesses(options, found, [1], budget=4) == []  # the budget ends with it
    # nothing fits: the deepest untried either way (below 8 if 8 fits and is the best)
    assert search.next_guesses(options, {4: math.inf, 2: math.inf, 6: math.inf}, [8], budget=6) == [7]


def _value(x):
    return lambda: x


def _warns():
    warnings.warn("autopar: a warning made in a worker", UserWarning)
    return "warned"


def _fails():
    raise PlanningError("autopar: an error raised in a worker")


def _dies():
    os._exit(3)


def _sleeps():
    time.sleep(600)


def _naps():
    time.sleep(2)
    return "rested"


@FORK
def test_results_are_taken_in_any_order_with_their_warnings_and_errors():
    with ForkedJobs({0: _value(1), 1: _warns, 2: _fails, 3: _value(4)}, workers=2) as pool:
        pool.start(0, 1, 2, 3)
        assert pool.pending() == [0, 1, 2, 3]
        done = {k: pool.result(k) for k in (3, 1, 2, 0)}
    assert [done[k].value for k in range(4)] == [1, "warned", None, 4]
    assert pool.cpu >= 0.0
    with pytest.warns(UserWarning, match="a warning made in a worker"):
        assert done[1].result() == "warned"
    with pytest.raises(PlanningError, match="^autopar: an error raised in a worker$"):
        done[2].result()


@FORK
def test_a_worker_that_dies_is_an_error_not_a_hang_and_a_guess_that_dies_runs_again_if_asked_for():
    with pytest.raises(RuntimeError, match=r"^autopar: a planning worker process died .*\(exit code 3,"):
        with ForkedJobs({0: _value(1), 1: _dies}, workers=2) as pool:
            pool.start(0, 1)
            pool.result(0), pool.result(1)
    with ForkedJobs({0: _dies, 1: _naps}, workers=2) as pool:
        pool.start(0, guess=True)
        pool.start(1)
        assert pool.result(1).value == "rested"  # the guess died meanwhile: dropped, no error
        assert not pool.started(0)
        with pytest.raises(RuntimeError, match="^autopar: a planning worker process died"):
            pool.result(0)  # asked for, it runs again, and its death is an error


@FORK
def test_a_guess_gives_its_worker_up_to_a_job_asked_for_and_is_stopped_unasked():
    with ForkedJobs({0: _value(1), 1: _sleeps, 2: _sleeps}, workers=2) as pool:
        pool.start(1, 2, guess=True)
        pool.start(0, guess=True)  # no worker idles: not started
        assert set(pool.running) == {1, 2} and not pool.started(0) and pool.pending() == []
        sleeping = pool.running[1].process
        assert pool.result(0).value == 1  # the later guess, 2, stopped for it
        assert not pool.started(2) and pool.started(1)
    assert sleeping.exitcode == -signal.SIGKILL  # leaving stopped the guess nobody asked for


def test_one_worker_runs_the_jobs_here_and_a_bad_count_is_refused():
    with ForkedJobs({0: _value(1), 1: _warns, 2: _fails}, workers=1) as pool:
        pool.start(0, 1)
        assert not pool.started(0)
        assert pool.result(0).value == 1
        with pytest.warns(UserWarning, match="a warning made in a worker"):
            assert pool.result(1).value == "warned"
        with pytest.raises(PlanningError, match="^autopar: an error raised in a worker$"):
            pool.result(2)
    assert pool.cpu == 0.0
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
