"""A bounded exit when another rank dies or hangs in the middle of a step.

A collective waits for every rank of its group. When a rank is killed, gloo usually
raises at once on its peers (the connection closes); when it hangs, or the connection
stays open, the peers wait for the group's timeout: ``dist.init_process_group(timeout=)``
sets it for the default group only, and the groups a ``DeviceMesh`` makes keep torch's
default (30 minutes). Under torchrun the agent tears the others down when one exits;
launched any other way, nothing does.

``deadline(seconds)`` bounds that wait from the outside: a timer armed on entry and
disarmed on exit. If the block has not finished ``seconds`` after entry, the timer's
thread writes an ``autopar:`` message to stderr and ends the process with ``EXIT_CODE``
(a thread cannot interrupt a collective blocked in C++; ``os._exit`` can). A
distributed failure raised inside the block (``torch.distributed.DistError``, or gloo's or
nccl's ``RuntimeError``: a peer closed its connection, a group timed out) becomes a ``RuntimeError`` with an ``autopar:``
message. So every surviving rank exits, within ``seconds`` of entering its step, with
an ``autopar:`` message; a relaunch resumes from the last complete checkpoint.

    for step in range(start, steps):
        with autopar.runtime.faults.deadline(60):   # well above one step's time
            loss = pm.train_step(inputs, target)
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator

import torch.distributed as dist

EXIT_CODE = 124  # as timeout(1) exits when its command ran past the limit


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _expired(seconds: float, what: str) -> None:
    sys.stderr.write(
        f"autopar: rank {_rank()}: the {what} did not finish within {seconds:g} s; expected every rank to reach "
        "each collective, so another rank has probably died or hangs. Exiting with code "
        f"{EXIT_CODE}; relaunch the job to resume from the last complete checkpoint\n")
    sys.stderr.flush()
    os._exit(EXIT_CODE)


def _distributed_failure(exc: RuntimeError) -> bool:
    """torch's own distributed errors, and gloo's and nccl's (raised as plain RuntimeErrors)."""
    return isinstance(exc, dist.DistError) or any(mark in str(exc) for mark in ("gloo", "NCCL", "Connection closed"))


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
        if not _distributed_failure(exc):
            raise
        raise RuntimeError(
            f"autopar: rank {_rank()}: a collective failed during the {what} ({type(exc).__name__}: {exc}); "
            "another rank has probably died. Relaunch the job to resume from the last complete checkpoint"
        ) from exc
    finally:
        timer.cancel()
