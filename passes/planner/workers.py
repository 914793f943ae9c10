"""The search's independent plans in forked worker processes, one per core (``worker_count``,
which the dry run's ranks use too).

The plan without a pipeline and the plan of each pipeline depth share the capture and the
strategy graphs and nothing else: each prices and solves its own mesh. ``ForkedJobs`` runs such
jobs in processes forked from the planning process, so they inherit the capture and the graphs
without pickling them and send back only what they return (plans are plain dataclasses).
The caller takes each result when it asks for it, whatever order the workers finish in, so it
takes them as it would have made them: the same call gives the same plan with any number of
workers. A worker that would idle may run a guess of what the caller asks for next (the next
pipeline depth, before the depths it depends on are known): a guess not asked for is stopped,
and changes nothing.

What a job warns is recorded in its worker and warned again here, and an error it raises is
raised here, so a job run in a worker reads as one run in this process. A worker that dies
(killed, out of memory) raises an ``autopar:`` error rather than waiting forever.
"""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Sequence


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


@dataclass(eq=False)
class _Worker:
    process: Any  # a forked multiprocessing.Process, serving jobs in turn (``_serve``)
    end: Any  # this process's end of the pipe to it


class ForkedJobs:
    """Jobs by key, each run in a worker process forked from this one once started (at most
    ``workers`` at a time, the rest queued in the order started) and taken when asked for
    (``result``). A worker runs jobs in turn, keeping what they cache, as one process would.

    A job asked for and never started starts then, ahead of the queue; with one worker it runs
    here, and nothing is forked. A guess (``start(..., guess=True)``: a job the caller may ask
    for next) starts only on a worker that would otherwise idle and gives its worker up (the
    worker is stopped) to a job asked for: guesses change what runs when, never what the caller
    is given. Leaving stops every worker, and with it any guess nobody asked for."""

    def __init__(self, jobs: Mapping[Hashable, Callable[[], Any]], workers: int):
        self.jobs, self.workers = dict(jobs), workers
        self.queued: list[Hashable] = []  # started, waiting for a worker
        self.running: dict[Hashable, _Worker] = {}  # the workers' jobs; a worker in none idles
        self.guessed: set[Hashable] = set()  # started as guesses, not asked for yet
        self.finished: dict[Hashable, Done] = {}
        self.cpu = 0.0  # CPU seconds the worker processes used (on leaving)
        self._cpu_before = 0.0  # this process's children's CPU seconds on entering
        self._forked: list[_Worker] = []

    def __enter__(self) -> ForkedJobs:
        if self.workers > 1:
            # A fork copies one thread: an object the workers inherit and collect could wait in
            # its finaliser on a thread left behind (a gloo process group). What this process
            # tracks is frozen while workers are forked, garbage included, so no worker ever
            # collects it. A collection here would walk the whole heap (torch, transformers, the
            # captured model: a fifth of a second per plan) and keep no worker safer.
            gc.freeze()
        self._cpu_before = _children_cpu()
        return self

    def __exit__(self, *exc) -> None:
        for worker in self._forked:
            worker.process.kill()
        for worker in self._forked:
            worker.process.join()
            worker.end.close()
        self._forked, self.running, self.queued = [], {}, []
        if self.workers > 1:
            gc.unfreeze()
            self.cpu = _children_cpu() - self._cpu_before

    def start(self, *keys: Hashable, guess: bool = False) -> None:
        """Queue ``keys`` not started yet; a guess only while a worker would idle. Nothing
        with one worker: each job then runs when asked for."""
        if self.workers <= 1:
            return
        for key in keys:
            if self.started(key) or (guess and self.idle() == 0):
                continue
            self.queued.append(key)
            if guess:
                self.guessed.add(key)
        self._launch()

    def idle(self) -> int:
        """Workers with nothing to run."""
        return max(0, self.workers - len(self.running) - len(self.queued))

    def pending(self) -> list[Hashable]:
        """Jobs started and not guesses, whose results are not taken yet."""
        return [k for k in [*self.running, *self.queued, *self.finished] if k not in self.guessed]

    def peek(self, key: Hashable) -> Done | None:
        """Job ``key``'s ``Done`` where it has finished and is not taken yet, else None."""
        return self.finished.get(key)

    def started(self, key: Hashable) -> bool:
        """Whether ``key`` is queued, running or done (never, with one worker)."""
        return key in self.queued or key in self.running or key in self.finished

    def result(self, key: Hashable, guesses: Callable[[], Sequence[Hashable]] = lambda: ()) -> Done:
        """Job ``key``'s ``Done``, waited for; ``guesses()`` (keys) started on each worker that
        idles meanwhile."""
        if self.workers <= 1:  # run here as the caller would run it: its warnings and errors raised now
            return Done(value=self.jobs[key]())
        self.guessed.discard(key)
        if not self.started(key):
            if len(self.running) >= self.workers and (guessing := [k for k in self.running if k in self.guessed]):
                self._stop(guessing[-1])  # a guess gives its worker up to a job asked for
            self.queued.insert(0, key)
        elif key in self.queued:  # ahead of the queue
            self.queued.remove(key)
            self.queued.insert(0, key)
        self._launch()
        while key not in self.finished:
            ends = {worker.end: k for k, worker in self.running.items()}
            for end in multiprocessing.connection.wait(list(ends)):
                self._receive(ends[end])
            self._launch()
            if self.idle():
                self.start(*guesses(), guess=True)
        return self.finished.pop(key)

    def _launch(self) -> None:
        while self.queued and len(self.running) < self.workers:
            busy = set(self.running.values())
            worker = next((w for w in self._forked if w not in busy), None) or self._fork()
            key = self.queued.pop(0)
            worker.end.send(key)
            self.running[key] = worker

    def _fork(self) -> _Worker:
        context = multiprocessing.get_context("fork")
        mine, theirs = context.Pipe()
        process = context.Process(target=_serve, args=(self.jobs, theirs), daemon=True)
        process.start()
        theirs.close()
        self._forked.append(_Worker(process, mine))
        return self._forked[-1]

    def _receive(self, key: Hashable) -> None:
        worker = self.running.pop(key)
        try:
            self.finished[key] = worker.end.recv()
            return
        except EOFError:
            self._end(worker)
        if key in self.guessed:  # a guess that died is dropped: asked for, it runs again
            self.guessed.discard(key)
            return
        raise RuntimeError(
            f"autopar: a planning worker process died before returning its plan (exit code "
            f"{worker.process.exitcode}, {len(self.jobs)} jobs on {self.workers} processes); expected each to "
            "return one. Plan with workers=1 to run the search in this process and see the failure")

    def _stop(self, key: Hashable) -> None:
        worker = self.running.pop(key)
        worker.process.kill()
        self._end(worker)
        self.guessed.discard(key)

    def _end(self, worker: _Worker) -> None:
        worker.process.join()
        worker.end.close()
        self._forked.remove(worker)


def _serve(jobs: Mapping[Hashable, Callable[[], Any]], end) -> None:
    """A worker: each job whose key arrives run, its ``Done`` sent back (an error that cannot
    travel: its type and message), until this process is stopped."""
    while True:
        done = _run(jobs[end.recv()])
        try:
            pickle.loads(pickle.dumps(done.error))
        except Exception:
            done.error = RuntimeError(f"{type(done.error).__name__}: {done.error}")
        end.send(done)


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
