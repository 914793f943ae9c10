"""Bad inputs that need several ranks, on 2 gloo ranks; each rank prints one line
``RESULT {"rank": r, "messages": {case: message}}`` (``tests/test_bad_inputs.py`` launches it).

    torchrun --standalone --nproc_per_node 2 -m tests.distributed.bad_input_check

- token ids out of range under a vocabulary-parallel embedding (``tp``: each rank holds
  half the rows, so an id no rank holds would give a zero row and a loss): an ``autopar:``
  error on every rank, as one process raises IndexError;
- a rank outside a DeviceMesh smaller than the world compiles nothing: an ``autopar:`` error
  on that rank (shared with the others as a peer's failure);
- a step after ``destroy_process_group()``: an ``autopar:`` error, not a step.
"""

from __future__ import annotations

import json
import warnings

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import autopar
from tests.distributed.plans import case_plan, layout_plan
from tests.distributed.train_check import MODELS, adamw

VOCAB = 64  # train_check's GPT


def main() -> None:
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, loss_fn, batches = MODELS["gpt"]()
    tokens, target = batches[0]
    messages: dict[str, str] = {}

    def expect(name: str, fn) -> None:
        try:
            fn()
            messages[name] = "no error"
        except Exception as exc:  # noqa: BLE001  (what is raised, of any kind, is the result)
            messages[name] = f"{type(exc).__name__}: {exc}"

    mesh = init_device_mesh("cpu", (world,))
    plan = case_plan(model, mesh, tokens, "tp")  # autopar.layouts' tp: the vocabulary split over the ranks
    messages["embedding"] = next(s for s in plan.strategies.values() if s.endswith("[vocab_parallel_embedding]"))
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=loss_fn, optimizer=adamw, plan=plan)
    # the check itself, below train_step: any rank's error in a step ends every rank's job
    # (autopar.runtime.faults), so the launch's one failing call comes last
    for bad in (VOCAB, 600, -1):
        ids = tokens.clone()
        ids[1, 3] = bad
        expect(f"token id {bad}", lambda: pm._local_inputs((ids,), False))
    expect("a step after the checks", lambda: pm.train_step((tokens,), target))  # nothing was left behind

    one_rank_plan = layout_plan(model, (tokens,), "dp", (1,))  # made on rank 0, given to every rank
    if rank == world - 1:  # a mesh of rank 0 alone; this rank is outside it
        alone = DeviceMesh("cpu", [0])
        expect("rank outside the mesh", lambda: autopar.compile(
            model, alone, (tokens,), loss_fn=loss_fn, optimizer=adamw, plan=one_rank_plan))
    dist.barrier()
    dist.destroy_process_group()
    expect("step after destroy_process_group", lambda: pm.train_step((tokens,), target))
    print("RESULT " + json.dumps({"rank": rank, "messages": messages}), flush=True)


if __name__ == "__main__":
    main()
