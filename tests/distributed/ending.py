"""How a check process ends once its results are printed.

``leave()`` destroys the process group, then exits without the interpreter's teardown. A
gloo worker thread can hold the last reference to an async collective's tensor a moment
after ``wait()`` returns; if it drops it while Python finalizes, it takes the GIL after
shutdown and the process aborts ("terminate called without an active exception"), after
every result was right. That race is torch's, not what these checks check; the checks of
how ranks fail and exit (``fault_check``, ``failure_check``) keep the ordinary exit."""

import os
import sys

import torch.distributed as dist


def leave() -> None:
    dist.barrier()  # no rank ends the group under another's last collective
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
