"""A linear overlapped with the collective of its tensor-parallel axis, as async TP runs it.

Under sequence (or batch) parallelism a column-parallel linear reads its input whole along
the rows, so the rows are all-gathered first; a row-parallel linear makes a pending sum,
reduce-scattered over the rows after. Split into chunks, the collective of one chunk runs
while the matmul of another computes (torchtitan's async TP; Wang et al. 2023, "Overlap
Communication with Dependent Computation via Decomposition"):

- :func:`gather_linear`: ``linear(all_gather(x), w, b)`` — each rank's rows cut into
  ``chunks`` pieces, piece j+1 gathered while the matmul of piece j runs. Backward
  gathers the input again, the same way, for the weight's gradient (the rows are kept as a
  shard, not gathered: what backward keeps is what the strategy reads, as the cost model
  charges it, and Megatron's sequence parallelism does the same), and reduce-scatters the
  input's gradient chunk by chunk behind its matmuls;
- :func:`linear_scatter`: ``reduce_scatter(linear(x, w)) + b`` over the rows — the matmul of
  chunk j+1 runs while chunk j's sum is reduce-scattered. Backward gathers the output's
  gradient chunk by chunk, each piece's input and weight gradients computed while the next
  is in flight.

The rows are those of dim ``dim``; rank r's rows of chunk j are its j-th piece, so a
gathered chunk holds every rank's piece j and the outputs are put back in rank order. The
collectives are torch.distributed's own asynchronous ones, reached through an exchange
(``autopar.passes.exchange``: the mesh in codegen, threads in the simulator), so the
simulator runs the very kernel that trains. ``chunk_count`` is the one place the number of
chunks is chosen; ``autopar.costmodels.formulas``'s ``pipelined`` prices the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AxisLink:
    """One mesh axis of an exchange: whom the kernel trades with."""

    exchange: Any  # autopar.passes.exchange.MeshExchange or VirtualExchange
    axis: int
    size: int

    def gather(self, t: torch.Tensor):
        return self.exchange.gather(t, self.axis)

    def reduce_scatter(self, pieces: list[torch.Tensor]):
        return self.exchange.reduce_scatter(pieces, self.axis)


def chunk_count(rows: int, ranks: int) -> int:
    """Chunks a rank's ``rows`` are cut into over an axis of ``ranks``: one per rank, as async
    TP runs it, or the most that divide the rows evenly."""
    return max(c for c in range(1, max(1, min(rows, ranks)) + 1) if rows % c == 0)


def gathered(link: AxisLink, parts: list[torch.Tensor], fn: Callable[[int, list[torch.Tensor]], Any]) -> list[Any]:
    """``fn(j, every rank's parts[j])`` for each chunk j, the gather of chunk j + 1 in flight
    while ``fn`` runs on chunk j."""
    pending, out = link.gather(parts[0]), []
    for j in range(len(parts)):
        peers = pending.wait()
        if j + 1 < len(parts):
            pending = link.gather(parts[j + 1])
        out.append(fn(j, peers))
    return out


def scattered(link: AxisLink, chunks: int, fn: Callable[[int], list[torch.Tensor]]) -> list[torch.Tensor]:
    """This rank's sum of ``fn(j)[rank]`` over the ranks, for each chunk j; chunk j's
    reduce-scatter in flight while ``fn`` computes chunk j + 1."""
    pending, out = None, []
    for j in range(chunks):
        started = link.reduce_scatter(fn(j))
        if pending is not None:
            out.append(pending.wait())
        pending = started
    out.append(pending.wait())
    return out


def _blocks(t: torch.Tensor, dim: int, ranks: int, chunks: int) -> list[list[torch.Tensor]]:
    """``t``'s rows as [rank][chunk] pieces (rank-major, as a whole tensor's rows are split)."""
    pieces = t.chunk(ranks * chunks, dim)
    return [[pieces[r * chunks + j] for j in range(chunks)] for r in range(ranks)]


def _chunk_rows(blocks: list[list[torch.Tensor]], j: int, dim: int) -> torch.Tensor:
    """Every rank's piece j, in rank order: the rows a gathered chunk j holds."""
    return torch.cat([b[j] for b in blocks], dim)


def _rank_order(per_chunk: list[torch.Tensor], dim: int, ranks: int) -> torch.Tensor:
    """Chunks' results (each every rank's piece, rank order) put back as the whole rows."""
    split = [c.chunk(ranks, dim) for c in per_chunk]
    return torch.cat([split[j][r] for r in range(ranks) for j in range(len(per_chunk))], dim)


def _weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A linear's weight gradient from its output's gradient and its input, rows alike."""
    return grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


def _bias_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.reshape(-1, grad.shape[-1]).sum(0)


class _GatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, link: AxisLink, dim: int, chunks: int):
        ctx.save_for_backward(x, w)
        ctx.link, ctx.dim, ctx.chunks, ctx.has_bias = link, dim, chunks, b is not None
        parts = list(x.chunk(chunks, dim))
        outs = gathered(link, parts, lambda j, peers: F.linear(torch.cat(peers, dim), w, b))
        return _rank_order(outs, dim, link.size)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        link, dim, chunks = ctx.link, ctx.dim, ctx.chunks
        blocks = _blocks(grad, dim, link.size, chunks)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[1]:  # the input gathered again, chunk by chunk
            parts = list(x.chunk(chunks, dim))
            grad_w = sum(gathered(link, parts, lambda j, peers: _weight_grad(
                _chunk_rows(blocks, j, dim), torch.cat(peers, dim))))
        if ctx.needs_input_grad[0]:  # each rank's rows of the input's gradient, summed over the columns' ranks
            grad_x = torch.cat(scattered(link, chunks, lambda j: list(
                (_chunk_rows(blocks, j, dim) @ w).chunk(link.size, dim))), dim)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = _bias_grad(grad)
        return grad_x, grad_w, grad_b, None, None, None


class _LinearScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, link: AxisLink, dim: int, chunks: int):
        ctx.save_for_backward(x, w)
        ctx.link, ctx.dim, ctx.chunks, ctx.has_bias = link, dim, chunks, b is not None
        blocks = _blocks(x, dim, link.size, chunks)
        out = torch.cat(scattered(link, chunks, lambda j: list(
            F.linear(_chunk_rows(blocks, j, dim), w).chunk(link.size, dim))), dim)
        return out if b is None else out + b

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        link, dim, chunks = ctx.link, ctx.dim, ctx.chunks
        blocks = _blocks(x, dim, link.size, chunks)

        def step(j: int, peers: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            whole = torch.cat(peers, dim)  # the output's gradient for every rank's piece j
            return whole @ w, _weight_grad(whole, _chunk_rows(blocks, j, dim))

        grad_xs, grad_ws = zip(*gathered(link, list(grad.chunk(chunks, dim)), step))
        grad_x = _rank_order(list(grad_xs), dim, link.size) if ctx.needs_input_grad[0] else None
        grad_w = sum(grad_ws) if ctx.needs_input_grad[1] else None
        grad_b = _bias_grad(grad) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None


def gather_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, link: AxisLink, dim: int) -> torch.Tensor:
    """``linear(x gathered along dim over link's axis, w, b)``, the gather pipelined with the matmul."""
    return _GatherLinear.apply(x, w, b, link, dim, chunk_count(x.shape[dim], link.size))


def linear_scatter(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, link: AxisLink, dim: int) -> torch.Tensor:
    """``reduce_scatter(linear(x, w)) + b`` along dim over link's axis, pipelined with the matmul."""
    return _LinearScatter.apply(x, w, b, link, dim, chunk_count(x.shape[dim] // link.size, link.size))
