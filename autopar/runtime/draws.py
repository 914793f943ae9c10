"""The compiled module's random stream: what dropout and every other random op draw.

A program's random ops draw from a key (``autopar.passes.randomness``), not from torch's
generator. The module holds a seed, agreed by every rank when it is built (the mesh's first rank's
``torch.initial_seed()``, broadcast), and counts runs: each run of a program (a
micro-batch's forward) takes the next count, and every rank counts alike because every
rank runs the same steps. So masks do not depend on how each process seeded torch,
nor on the layout: one process seeded as rank 0 draws the same (``passes/randomness``).
A checkpoint saves the seed and the count, and a resumed run draws what the
uninterrupted run would have drawn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.passes import randomness


def agreed_seed(device: torch.device, mesh: DeviceMesh | None = None) -> int:
    """A seed every rank shares: the first rank's, broadcast over the world, or (``mesh``) from
    the mesh's first rank along each of its axes in turn (a mesh may hold some ranks only)."""
    seed = torch.tensor([torch.initial_seed() % (2**62)], dtype=torch.long, device=device)
    if mesh is not None:
        for axis in range(mesh.ndim):
            if mesh.size(axis) > 1:
                dist.broadcast(seed, group=mesh.get_group(axis), group_src=0)
    elif dist.is_initialized():
        dist.broadcast(seed, src=0)
    return int(seed.item())


class Draws:
    """The seed and the count of runs drawn so far (the module docstring)."""

    def __init__(self, seed: int):
        self.seed = seed
        self.count = 0

    @staticmethod
    def agreed(mesh: DeviceMesh, device: torch.device) -> "Draws":
        return Draws(agreed_seed(device, mesh))

    def take(self, runs: int = 1) -> int:
        """The first of ``runs`` consecutive counts, now taken."""
        first, self.count = self.count, self.count + runs
        return first

    @contextlib.contextmanager
    def run(self, count: int) -> Iterator[None]:
        """Inside: random ops draw as the ``count``-th run."""
        with randomness.drawing(randomness.run_key(self.seed, count)):
            yield

    @contextlib.contextmanager
    def next_run(self) -> Iterator[None]:
        with self.run(self.take()):
            yield

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.count = int(state["seed"]), int(state["count"])
