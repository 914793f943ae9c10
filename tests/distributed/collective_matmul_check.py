"""The pipelined collective linears (``autopar.passes.collective_matmul``) against one process:
forward and every gradient, on each rank's shards.

Run under torchrun on gloo (``tests/test_collective_matmul.py`` launches 2 and 4 ranks):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 -m tests.distributed.collective_matmul_check

and, through ``check_rank``, on the simulator's threads (``VirtualExchange``) in one process.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from autopar.passes.collective_matmul import AxisLink, gather_linear, linear_scatter
from autopar.passes.exchange import MeshExchange
from tests.distributed import ending

DTYPE = torch.float64
# (x shape, rows dim, output features, bias): rows by batch and by sequence; 12 rows a rank
# at 2 ranks (2 chunks), 6 at 4 (3 chunks: fewer chunks than ranks where rows do not divide)
CASES = [((2, 24, 8), 1, 12, True), ((24, 2, 8), 0, 12, False), ((24, 8), 0, 4, True)]


def whole_values(shape, dim, n_out, bias):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=gen, dtype=DTYPE)
    w = torch.randn(n_out, shape[-1], generator=gen, dtype=DTYPE)
    b = torch.randn(n_out, generator=gen, dtype=DTYPE) if bias else None
    gy = torch.randn(*shape[:-1], n_out, generator=gen, dtype=DTYPE)  # the output's gradient
    return x, w, b, gy


def reference(x, w, b, gy):
    """Output and gradients of the linear on one process."""
    leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
    y = F.linear(*leaves)
    y.backward(gy)
    return y.detach(), [t.grad for t in leaves]


def check_rank(link: AxisLink, rank: int) -> dict[str, float]:
    """This rank's largest difference from one process, per case and kernel."""
    n, diffs = link.size, {}
    for shape, dim, n_out, bias in CASES:
        x, w, b, gy = whole_values(shape, dim, n_out, bias)
        y, grads = reference(x, w, b, gy)
        name = f"{tuple(shape)} rows dim {dim}"
        # column-parallel: rows gathered, weight and bias split by output feature
        local = [x.chunk(n, dim)[rank], w.chunk(n, 0)[rank]] + ([b.chunk(n, 0)[rank]] if bias else [])
        local = [t.clone().requires_grad_() for t in local]
        out = gather_linear(local[0], local[1], local[2] if bias else None, link, dim)
        out.backward(gy.chunk(n, -1)[rank])
        want = [y.chunk(n, -1)[rank], grads[0].chunk(n, dim)[rank], grads[1].chunk(n, 0)[rank]]
        want += [grads[2].chunk(n, 0)[rank]] if bias else []
        diffs[f"gather {name}"] = _largest(want, [out.detach()] + [t.grad for t in local])
        # row-parallel: the input and weight split by input feature, the sum reduce-scattered
        # by rows; the bias whole, its gradient this rank's share of the sum
        local = [x.chunk(n, -1)[rank], w.chunk(n, 1)[rank]] + ([b.clone()] if bias else [])
        local = [t.clone().requires_grad_() for t in local]
        out = linear_scatter(local[0], local[1], local[2] if bias else None, link, dim)
        out.backward(gy.chunk(n, dim)[rank])
        want = [y.chunk(n, dim)[rank], grads[0].chunk(n, -1)[rank], grads[1].chunk(n, 1)[rank]]
        want += [_bias_grad(gy.chunk(n, dim)[rank])] if bias else []
        diffs[f"scatter {name}"] = _largest(want, [out.detach()] + [t.grad for t in local])
    return diffs


def _bias_grad(gy):
    return gy.reshape(-1, gy.shape[-1]).sum(0)


def _largest(want, got) -> float:
    assert [tuple(t.shape) for t in want] == [tuple(t.shape) for t in got], (
        [tuple(t.shape) for t in want], [tuple(t.shape) for t in got])
    return max((a - b).abs().max().item() for a, b in zip(want, got))


def main() -> None:
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    diffs = check_rank(AxisLink(MeshExchange(mesh), 0, n), rank)
    everyone = [None] * n
    dist.all_gather_object(everyone, diffs)
    if rank == 0:
        print("RESULT " + json.dumps({k: max(d[k] for d in everyone) for k in diffs}), flush=True)
    ending.leave()


if __name__ == "__main__":
    main()
