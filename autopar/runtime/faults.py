"""Bounded exits: any rank's failure ends every rank at once; a peer that dies or hangs ends the step.

A collective waits for every rank of its group, and a wait blocked in C++ cannot be
interrupted from Python: gloo's ``abort`` and ``shutdown`` leave a pending collective
waiting (torch 2.13), and only the peer's process exiting closes its connections. When a
rank fails, its peers wait for the group's timeout: ``dist.init_process_group(timeout=)``
sets it for the default group only, and the groups a ``DeviceMesh`` makes keep torch's
default (30 minutes). Under torchrun the agent tears the others down when one exits;
launched any other way, or when the failing process does not exit, nothing does.

Two bounds, one exit (``_exit_with``: the ``autopar:`` message to stderr, then
``os._exit(EXIT_CODE)``, which ends a wait nothing else can):

``shared_failures(what)`` (``autopar.compile``, ``autopar.plan`` under a process group,
every compiled module's steps, checkpoint saves and loads, the dry run): an exception
raised inside on one rank is published in the default group's store (the c10d store: a
key set once, read without a collective, so the side channel cannot hang), with that
rank's number and message, before it propagates there. A watcher thread on each rank
polls the key (``POLL_S``, one store read; a step costs no collective). A rank inside a
guarded call ``GRACE_S`` after it saw the key (or after it entered the call, if later),
that has not left the call with an exception and whose thread has not moved for
``STUCK_S`` (it waits in a collective), exits with the failing rank's message; one still
moving may be about to raise the same error (a check every rank makes), and is ended once
it waits. A wait that ends by itself
(the failing process exited and closed its connections, or ``autopar.compile``'s plan
broadcast carried the error) raises ``PeerFailure``, with the same message. The failing
rank raises its own exception, noted as told to the others, once they have read it (at
most ``ACK_S``: a store hosted in that process goes when it exits).

An error every rank raises (a check they make together, a plan broadcast that carried
the error) leaves the group sound: nobody waits. Each rank counts itself out of the
failing call; when all have, the next guarded call starts afresh (a generation of keys).
Until then, the rank that failed raises the failure again at its next guarded call
instead of waiting for peers that are gone.

``deadline(seconds)`` bounds a block from the outside: a timer armed on entry and
disarmed on exit. If the block has not finished ``seconds`` after entry, the process
exits with an ``autopar:`` message. A distributed failure raised inside the block
(``torch.distributed.DistError``, or gloo's or nccl's ``RuntimeError``: a peer closed its
connection, a group timed out) becomes a ``RuntimeError`` with an ``autopar:`` message
(the failing rank's, when one was published). So every surviving rank exits, within
``seconds`` of entering its step; a relaunch resumes from the last complete checkpoint.

    for step in range(start, steps):
        with autopar.runtime.faults.deadline(60):   # well above one step's time
            loss = pm.train_step(inputs, target)
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator, TypeVar

import torch.distributed as dist
from torch.distributed import distributed_c10d

EXIT_CODE = 124  # as timeout(1) exits when its command ran past the limit
POLL_S = 0.2  # how often each rank's watcher reads the store
GRACE_S = 2.0  # a call not left this long after a peer's failure is ended by the exit ...
STUCK_S = 1.0  # ... once its thread has not moved for this long (a rank that fails too moves on to its error)
JOIN_S = 10.0  # the most a rank that left a failing call waits, at its next call, for the others to leave it
ACK_S = 3.0  # the most a failing rank waits for its peers to have read its failure

_KEY = "autopar/failure"  # in the default group's store: the first failing rank's report
_SEEN = "autopar/failure_seen"  # a counter: how many peers have read it
_LEFT = "autopar/failure_left"  # a counter: how many ranks left the failing call with an exception

F = TypeVar("F", bound=Callable[..., Any])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _exit_with(message: str) -> None:
    """The one exit of this module: the message to stderr, then the process ends with
    ``EXIT_CODE`` (from any thread: a collective blocked in C++ included)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.stderr.flush()
    os._exit(EXIT_CODE)


class PeerFailure(RuntimeError):
    """Another rank's failure, raised on this one: the rank, what it was doing, its error."""

    def __init__(self, rank: int, what: str, error: str, here: int):
        self.rank, self.what, self.error, self.here = rank, what, error, here
        earlier = "this rank failed there earlier" if rank == here else f"rank {here} stops too"
        super().__init__(
            f"autopar: rank {rank} failed during the {what}: {error}\n"
            f"Expected every rank of the mesh to finish the {what}; {earlier}. Fix the error rank {rank} raised "
            "(its log has the traceback) and relaunch")

    def __reduce__(self) -> tuple:  # sent whole (autopar.compile's plan broadcast)
        return PeerFailure, (self.rank, self.what, self.error, self.here)

    @staticmethod
    def of(report: bytes | str, here: int) -> PeerFailure:
        r = json.loads(report)
        return PeerFailure(r["rank"], r["what"], r["error"], here)


class _Watcher:
    """One per process and default process group: where this rank stands (guarded calls it
    is inside, the failure of this generation) and the thread that reads the store.

    A generation ends when every rank has left the failing call with an exception (its own,
    or the failure it received: ``left``): nobody waits in a collective, so the group is
    sound and the next guarded call starts the next generation. Until then the group is
    broken: this rank's next guarded call raises the failure."""

    def __init__(self, store: dist.Store, rank: int, world: int):
        self.store, self.rank, self.world, self.pid = store, rank, world, os.getpid()
        self.lock = threading.Lock()
        self.generation = 0
        self.failure: PeerFailure | None = None  # this generation's first, once seen
        self.seen_at = 0.0
        self.left = False  # this rank left a guarded call with an exception in this generation
        self.depth = 0  # guarded calls the calling thread is inside
        self.entered_at = 0.0  # of the outermost
        self.caller = threading.get_ident()  # the thread inside them
        self.at: tuple | None = None  # where it was at the last poll, since ``moved_at``
        self.moved_at = 0.0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="autopar-failures", daemon=True)
        self.thread.start()
        # joined before the interpreter shuts down: a daemon thread inside a store call then
        # aborts the process ("terminate called without an active exception")
        atexit.register(self.stop)

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5 * POLL_S)

    def key(self, name: str) -> str:
        return f"{name}/{self.generation}"

    def current(self) -> bool:
        return self.pid == os.getpid() and dist.is_initialized() and distributed_c10d._get_default_store() is self.store

    def _watch(self) -> None:
        try:
            while self.current():  # else the group was destroyed or replaced: this watcher's job is over
                if self.stopping.wait(POLL_S):
                    return
                if self.failure is None:
                    self.look()
                elif self.failure.rank != self.rank and not self.left and self.depth > 0 and self.stuck():
                    # inside a call this rank did not leave, not moving: blocked in a collective
                    _exit_with(f"{self.failure}\n(rank {self.rank} was inside a call that waits for rank "
                               f"{self.failure.rank}; exiting with code {EXIT_CODE})")
        except Exception:  # noqa: BLE001  (the store is gone with its host: the job is over, collectives fail by themselves)
            return

    def stuck(self) -> bool:
        """``GRACE_S`` since the failure was seen (or the call entered), and the calling
        thread at the same instruction for ``STUCK_S``."""
        now = time.monotonic()
        frame = sys._current_frames().get(self.caller)
        at = (id(frame.f_code), frame.f_lasti) if frame is not None else None
        if at != self.at:
            self.at, self.moved_at = at, now
        return now - max(self.seen_at, self.entered_at) >= GRACE_S and now - self.moved_at >= STUCK_S

    def look(self) -> PeerFailure | None:
        """This generation's failure, read from the store if it is there."""
        generation, key = self.generation, self.key(_KEY)
        if self.store.check([key]):
            self.seen(self.store.get(key), generation)
        return self.failure

    def seen(self, report: bytes | str, generation: int) -> None:
        with self.lock:
            if self.failure is not None or generation != self.generation:
                return
            self.failure, self.seen_at = PeerFailure.of(report, self.rank), time.monotonic()
        if self.failure.rank != self.rank:
            self.store.add(self.key(_SEEN), 1)

    def publish(self, what: str, exc: BaseException) -> None:
        """This rank's failure, for every peer: the first published stays (a later one is
        most likely caused by it); then, briefly, until they have read it."""
        report = json.dumps({"rank": self.rank, "what": what, "error": f"{type(exc).__name__}: {exc}"[:8000]})
        try:
            self.seen(self.store.compare_set(self.key(_KEY), "", report), self.generation)
            if self.failure is None or self.failure.rank != self.rank:
                return
            end = time.monotonic() + ACK_S
            while self.store.add(self.key(_SEEN), 0) < self.world - 1 and time.monotonic() < end:
                time.sleep(POLL_S / 4)
        except Exception:  # noqa: BLE001  (no store to tell: the peers' collectives fail by themselves)
            return
        exc.add_note(f"autopar: rank {self.rank} failed during the {what}; every other rank was told")

    def leave(self, failure: PeerFailure) -> None:
        """This rank leaves a guarded call with an exception: ``failure``, its own or a peer's."""
        if self.left:
            return
        with self.lock:
            if self.failure is None:
                self.failure, self.seen_at = failure, time.monotonic()
            self.left = True
        with contextlib.suppress(Exception):
            self.store.add(self.key(_LEFT), 1)

    def enter(self) -> None:
        """Before a guarded call: a generation every rank left starts the next one; a
        failure this rank left while others did not (they wait, or have exited) is raised."""
        if not self.left:
            return  # no failure, or a peer's this rank has not met: the call ends by it, or fails by itself
        end = time.monotonic() + JOIN_S
        while not self._all_left():
            if time.monotonic() >= end:
                raise self.failure
            time.sleep(POLL_S / 4)
        with self.lock:
            self.generation, self.failure, self.left = self.generation + 1, None, False

    def _all_left(self) -> bool:
        try:
            return self.store.add(self.key(_LEFT), 0) >= self.world
        except Exception:  # noqa: BLE001  (the store is gone with its host: the group is broken)
            return False

    def read(self, wait_s: float) -> PeerFailure | None:
        """A published failure, waiting at most ``wait_s`` for one to appear."""
        end = time.monotonic() + wait_s
        with contextlib.suppress(Exception):
            while self.look() is None and time.monotonic() < end:
                time.sleep(POLL_S / 4)
        return self.failure


_watcher: _Watcher | None = None


def _this_watcher() -> _Watcher | None:
    """This process's watcher, started on first use; None outside a real multi-process group."""
    global _watcher
    if _watcher is not None and _watcher.current():
        return _watcher
    if not dist.is_initialized() or dist.get_world_size() < 2 or dist.get_backend() == "fake":
        return None
    _watcher = _Watcher(distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size())
    return _watcher


def _distributed_failure(exc: BaseException) -> bool:
    """torch's own distributed errors, and gloo's and nccl's (raised as plain RuntimeErrors)."""
    return isinstance(exc, dist.DistError) or (
        isinstance(exc, RuntimeError) and any(mark in str(exc) for mark in ("gloo", "NCCL", "Connection closed")))


@contextlib.contextmanager
def shared_failures(what: str) -> Iterator[None]:
    """Inside: an exception on this rank reaches every rank of the default group (the
    module docstring); a peer's failure ends this rank's call."""
    watcher = _this_watcher()
    if watcher is None:
        yield
        return
    watcher.enter()
    if watcher.depth == 0:
        watcher.entered_at, watcher.caller = time.monotonic(), threading.get_ident()
    watcher.depth += 1
    try:
        yield
    except PeerFailure as failure:
        watcher.leave(failure)
        raise
    except (Exception, KeyboardInterrupt) as exc:
        if _distributed_failure(exc):  # a peer's process ended: its report says why, when it wrote one
            failure = watcher.read(wait_s=1.0)
            if failure is not None and failure.rank != watcher.rank:
                watcher.leave(failure)
                raise failure from exc
            raise
        if not getattr(exc, "_autopar_published", False):  # an inner guarded call published it
            exc._autopar_published = True
            watcher.publish(what, exc)
        watcher.leave(PeerFailure(watcher.rank, what, f"{type(exc).__name__}: {exc}", here=watcher.rank))
        raise
    finally:
        watcher.depth -= 1


def failures_shared(what: str) -> Callable[[F], F]:
    """``shared_failures(what)`` around every call of the decorated function."""
    def wrap(function: F) -> F:
        @functools.wraps(function)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            with shared_failures(what):
                return function(*args, **kwargs)
        return guarded  # type: ignore[return-value]
    return wrap


def _expired(seconds: float, what: str) -> None:
    _exit_with(
        f"autopar: rank {_rank()}: the {what} did not finish within {seconds:g} s; expected every rank to reach "
        "each collective, so another rank has probably died or hangs. Exiting with code "
        f"{EXIT_CODE}; relaunch the job to resume from the last complete checkpoint")


@contextlib.contextmanager
def deadline(seconds: float, what: str = "training step") -> Iterator[None]:
    """Inside: at most ``seconds`` before the process exits with an ``autopar:`` message
    (see the module's docstring); a distributed failure raised inside is re-raised as one."""
    if seconds <= 0:
        raise ValueError(f"autopar: deadline of {seconds} s; expected a positive number of seconds")
    timer = threading.Timer(seconds, _expired, args=(seconds, what))
    timer.daemon = True
    timer.start()
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, PeerFailure) or not _distributed_failure(exc):
            raise
        watcher = _this_watcher()
        failure = watcher.read(wait_s=1.0) if watcher is not None else None
        if failure is not None:
            raise failure from exc
        raise RuntimeError(
            f"autopar: rank {_rank()}: a collective failed during the {what} ({type(exc).__name__}: {exc}); "
            "another rank has probably died. Relaunch the job to resume from the last complete checkpoint"
        ) from exc
    finally:
        timer.cancel()
