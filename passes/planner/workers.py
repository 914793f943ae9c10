"""The search's independent plans in forked worker processes, one per core (``worker_count``,
which the dry run's ranks use too).

The plan without a pipeline and the plan of each pipeline depth share the capture and the
strategy graphs and nothing else: each prices and solves its own mesh. ``run_forked`` runs such
jobs in processes forked from the planning process, so they inherit the capture and the graphs
without pickling them and send back only what they return (plans are plain dataclasses).
Results come back in the jobs' order, whatever order the workers finish in, so the caller takes
them as it would have made them: the same call gives the same plan with any number of workers.

What a job warns is recorded in its worker and warned again here, and an error it raises is
raised here, so a job run in a worker reads as one run in this process. A worker that dies
(killed, out of memory) raises an ``autopar:`` error rather than waiting forever.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import warnings
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

_JOBS: Sequence[Callable[[], Any]] = ()  # what the forked workers run, by index: inherited, not pickled


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_count(asked: int | None, jobs: int) -> int:
    """How many processes ``jobs`` independent jobs run in: ``asked`` (None: one per core), at
    most one per job; 1 (this process) where processes cannot be forked, or where this process
    may have none (a daemonic one: a ``multiprocessing.Pool``'s worker)."""
    if "fork" not in multiprocessing.get_all_start_methods() or multiprocessing.current_process().daemon:
        return 1
    return max(1, min(asked or cores(), jobs))


@dataclass
class Done:
    """What one job came to: its value or its error, and the warnings it raised."""

    value: Any = None
    error: BaseException | None = None
    warned: list[tuple[str, type]] = field(default_factory=list)

    def result(self) -> Any:
        """The job's value, its warnings warned again here; its error raised here."""
        for message, category in self.warned:
            warnings.warn(message, category, stacklevel=2)
        if self.error is not None:
            raise self.error
        return self.value


def run_forked(jobs: Sequence[Callable[[], Any]], workers: int) -> tuple[list[Done], float]:
    """(each job's ``Done``, in the jobs' order; CPU seconds the worker processes used). With one
    worker the jobs run here, one after another."""
    if workers <= 1 or len(jobs) <= 1:
        return [_run(job) for job in jobs], 0.0
    global _JOBS
    _JOBS = jobs
    before = _children_cpu()
    try:
        # A fork copies one thread: an object the workers inherit and collect could wait in its
        # finaliser on a thread left behind (a gloo process group). Garbage is collected here and
        # the rest frozen while the workers are forked, never collected by one.
        gc.collect()
        gc.freeze()
        try:
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
                futures = [pool.submit(_run_index, i) for i in range(len(jobs))]
                done = [f.result() for f in futures]
        finally:
            gc.unfreeze()
    except BrokenProcessPool:
        raise RuntimeError(
            f"autopar: a planning worker process died before returning its plan ({len(jobs)} jobs on {workers} "
            "processes); expected each to return one. Plan with workers=1 to run the search in this process "
            "and see the failure") from None
    finally:
        _JOBS = ()
    return done, _children_cpu() - before


def _run_index(i: int) -> Done:
    done = _run(_JOBS[i])
    try:
        pickle.loads(pickle.dumps(done.error))
    except Exception:  # an error that cannot travel back (nor be rebuilt there): its type and message do
        done.error = RuntimeError(f"{type(done.error).__name__}: {done.error}")
    return done


def _run(job: Callable[[], Any]) -> Done:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            done = Done(value=job())
        except Exception as exc:
            done = Done(error=exc)
    done.warned = [(str(w.message), w.category) for w in caught]
    return done


def _children_cpu() -> float:
    """CPU seconds of this process's waited-for children (``os.times``)."""
    t = os.times()
    return t.children_user + t.children_system
