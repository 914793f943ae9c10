"""How a communicating local kernel trades rows with its peers along one mesh axis.

Most strategies run each device's op on its shards alone and leave data movement to the
resharding edges. A kernel whose traffic depends on the values (an MoE layer's tokens sent
to the ranks that hold their experts: all-to-all with counts known only at run time) asks
the context's exchange instead (``LocalContext.exchange``). Two exchanges share one
interface, so the simulator checks the very kernel that runs:

- :class:`MeshExchange`: torch.distributed on a ``DeviceMesh`` (codegen); the rows move by
  ``all_to_all_single_autograd``, whose backward is the reverse all-to-all, the exact
  dual of a permutation of rows (no sum over ranks that would scale a gradient);
- :class:`VirtualExchange`: the single-process simulator's virtual devices, each run in
  its own thread, trading tensors through a shared mailbox at barriers.

Both also start an all-gather or a reduce-scatter and hand back a :class:`Pending` to wait
on (``gather``, ``reduce_scatter``), so that a kernel can compute while a collective is in
flight (``autopar.passes.collective_matmul``); torch.distributed's own asynchronous calls on
the mesh, done at once in the simulator. Neither is differentiable: the kernel's autograd
Function says what backward runs.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh


class Pending:
    """A collective in flight; ``wait()`` returns its result once (``keep``: the buffers it
    reads and writes, alive until then)."""

    def __init__(self, work: Any, result: Callable[[], Any], keep: tuple = ()):
        self.work, self.result, self.keep = work, result, keep

    def wait(self) -> Any:
        if self.work is not None:
            self.work.wait()
        return self.result()


class MeshExchange:
    """Rows traded over one axis of a real ``DeviceMesh`` (this rank's process groups)."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh, self.mesh_shape = mesh, tuple(mesh.shape)

    def counts(self, send: torch.Tensor, axis: int) -> torch.Tensor:
        """``send[j]`` (counts, a row per peer) goes to peer j along ``axis``; returns what
        each peer sent this one, a row per peer."""
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=self.mesh.get_group(axis))
        return recv

    def rows(self, t: torch.Tensor, recv: Sequence[int], send: Sequence[int], axis: int) -> torch.Tensor:
        """The first ``send[0]`` rows of ``t`` to peer 0, the next ``send[1]`` to peer 1, ...;
        returns the rows received, peer by peer (``recv[j]`` from peer j). Differentiable."""
        out = funcol.all_to_all_single_autograd(t.contiguous(), list(recv), list(send), self.mesh.get_group(axis))
        return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out

    def gather(self, t: torch.Tensor, axis: int) -> Pending:
        """Start gathering ``t`` from every peer along ``axis``; ``wait()``: their tensors, in peer order."""
        t = t.contiguous()
        out = t.new_empty((self.mesh_shape[axis], *t.shape))
        work = dist.all_gather_single(out.view(-1), t.view(-1), group=self.mesh.get_group(axis), async_op=True)
        return Pending(work, lambda: list(out.unbind(0)), (t,))

    def reduce_scatter(self, pieces: Sequence[torch.Tensor], axis: int) -> Pending:
        """Start summing ``pieces[j]`` over the peers into peer j along ``axis`` (pieces alike in
        shape); ``wait()``: this device's sum."""
        stacked = torch.stack(list(pieces))
        out = torch.empty_like(pieces[0])
        work = dist.reduce_scatter_single(out.view(-1), stacked.view(-1), group=self.mesh.get_group(axis),
                                          async_op=True)
        return Pending(work, lambda: out, (stacked,))


class VirtualExchange:
    """The simulator's mesh: one thread per virtual device, tensors traded in memory.

    Every device makes the same sequence of calls (SPMD), so a call is: deposit, wait for
    every device, collect this device's share from its peers, wait again before the
    mailbox is reused. A device that fails breaks the barrier, so its peers fail too
    instead of waiting forever."""

    TIMEOUT_S = 60.0

    def __init__(self, mesh_shape: Sequence[int]):
        self.mesh_shape = tuple(mesh_shape)
        devices = len(list(itertools.product(*(range(n) for n in self.mesh_shape))))
        self.barrier = threading.Barrier(devices, timeout=self.TIMEOUT_S)
        self.mailbox: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self.local = threading.local()  # this thread's coordinate

    def bind(self, coord: tuple[int, ...]) -> "VirtualExchange":
        self.local.coord = coord
        return self

    def abort(self) -> None:
        self.barrier.abort()

    def _trade(self, pieces: list[torch.Tensor], axis: int) -> list[torch.Tensor]:
        """``pieces[j]`` to peer j along ``axis``; returns what each peer sent this device."""
        me = self.local.coord
        self.mailbox[me] = pieces
        self.barrier.wait()
        peers = [me[:axis] + (j,) + me[axis + 1:] for j in range(self.mesh_shape[axis])]
        got = [self.mailbox[p][me[axis]] for p in peers]
        self.barrier.wait()
        return got

    def counts(self, send: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.stack(self._trade(list(send), axis))

    def gather(self, t: torch.Tensor, axis: int) -> Pending:
        got = self._trade([t] * self.mesh_shape[axis], axis)
        return Pending(None, lambda: got)

    def reduce_scatter(self, pieces: Sequence[torch.Tensor], axis: int) -> Pending:
        got = self._trade(list(pieces), axis)
        return Pending(None, lambda: torch.stack(got).sum(0))

    def rows(self, t: torch.Tensor, recv: Sequence[int], send: Sequence[int], axis: int) -> torch.Tensor:
        got = self._trade(list(t.split(list(send))), axis)
        if [g.shape[0] for g in got] != list(recv):
            raise RuntimeError(f"autopar: expected {list(recv)} rows from the peers, found {[g.shape[0] for g in got]}")
        return torch.cat(got)
