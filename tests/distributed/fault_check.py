"""A rank that dies or hangs in the middle of a step; launched without torchrun (one
process per rank, ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set by the caller).

    python -m tests.distributed.fault_check <die|hang> <rank that fails> <deadline seconds>

Every rank trains a data-parallel MLP under ``autopar.runtime.faults.deadline``; at step 2 the
failing rank either kills itself (SIGKILL) or sleeps for an hour before its step. The
others must exit with an ``autopar:`` message on stderr; each prints ``STEP <n>`` as it
enters a step, so the caller can time the exit from the failing step's start.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings

import torch.distributed as dist

from autopar.runtime.faults import deadline
from tests.distributed.train_check import MODELS, compiled_for

FAILING_STEP = 2


def main(mode: str, failing_rank: int, seconds: float) -> None:
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    model, loss_fn, batches = MODELS["mlp"]()
    pm = compiled_for(["dp"], model, (dist.get_world_size(),), batches[0][0], loss_fn)
    for step, (inputs, target) in enumerate(batches):
        print(f"STEP {step} {time.time():.3f}", flush=True)
        if step == FAILING_STEP and dist.get_rank() == failing_rank:
            if mode == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        with deadline(seconds):
            pm.train_step((inputs,), target)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
