"""Timing primitives of the profiler: closures that run one collective, matmul,
pointwise op or attention on fresh operands (``collective_call``, ``matmul_call``,
``pointwise_call``, ``attention_calls``), and ``timed``, which times a list of them the
way the profile and the accuracy benchmark both time them.

``timed`` runs on every rank of an initialised process group, all ranks at once (as in
training). Times are per call, the median over batches of back-to-back calls, the calls
of a sweep taking turns, and then the slowest rank's: an SPMD step waits for its slowest
rank, so that is the rate a plan gets where ranks share a machine unevenly.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from autopar.costmodels.profile import COLLECTIVES

TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The three products of a linear layer in a training step: forward x @ W.T ("nt"), input
# gradient g @ W ("nn"), weight gradient g.T @ x ("tn"). CPU GEMMs run them at rates up
# to 2x apart, so the profile's matmul rate is fitted over all three.
MATMUL_LAYOUTS = ("nn", "nt", "tn")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_times(
    calls: Sequence[Callable[[], object]],
    device: torch.device,
    repeats: int,
    warmup: int,
    *,
    min_batch_s: float = 0.02,
    group: dist.ProcessGroup | None = None,
) -> list[float]:
    """Seconds per call of each of ``calls`` on this rank: the median over ``repeats``
    batches of back-to-back calls, each batch long enough (``min_batch_s``) to span
    several scheduler time slices, so ranks that share cores are timed at the rate they
    really get. The calls take turns, batch by batch, so the points of one sweep see the
    same load even where it drifts (a fit's latency and rate come from the same moments).
    With ``group`` (collectives), every rank of the group runs the same batch lengths."""
    counts = []
    for fn in calls:
        for _ in range(warmup):
            fn()
        _sync(device)
        once = math.inf
        for _ in range(3):  # the fastest of three: one call that lost the core to another
            t0 = time.perf_counter()  # process would make every batch a single call
            fn()
            _sync(device)
            once = min(once, time.perf_counter() - t0)
        counts.append(max(1, int(min_batch_s / max(once, 1e-7))))
    if group is not None:
        counts = [int(c) for c in _reduce(counts, dist.ReduceOp.MAX, device, group)]
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for fn, n, out in zip(calls, counts, times):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            _sync(device)
            out.append((time.perf_counter() - t0) / n)
    return [sorted(t)[len(t) // 2] for t in times]


def median_time(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int, **kw) -> float:
    """``median_times`` of one call."""
    return median_times([fn], device, repeats, warmup, **kw)[0]


def timed(calls: Sequence[Callable[[], object]], device: torch.device, repeats: int, warmup: int, **kw) -> list[float]:
    """``median_times`` of ``calls`` (in turns; ``kw``: its ``min_batch_s`` and ``group``),
    each the slowest rank's: every rank gets the same numbers, the ones an SPMD step waits
    for. Every rank must call it."""
    return _reduce(median_times(calls, device, repeats, warmup, **kw), dist.ReduceOp.MAX, device)


def collective_call(
    kind: str, group: dist.ProcessGroup, nbytes: int, device: torch.device, async_op: bool = False
) -> Callable[[], object]:
    """A closure running one ``kind`` collective on ``group`` with an X = ``nbytes`` buffer
    (X as in ``formulas.COLLECTIVE_BUFFER``), fp32 elements; ``async_op`` (not send_recv):
    it starts the collective and returns its work handle."""
    n = dist.get_world_size(group)
    numel = max(n, nbytes // 4 // n * n)
    if kind == "all_reduce":
        buf = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(buf, group=group, async_op=async_op)
    if kind == "all_gather":
        out, inp = torch.empty(numel, device=device), torch.ones(numel // n, device=device)
        return lambda: dist.all_gather_single(out, inp, group=group, async_op=async_op)
    if kind == "reduce_scatter":
        inp, out = torch.ones(numel, device=device), torch.empty(numel // n, device=device)
        return lambda: dist.reduce_scatter_single(out, inp, group=group, async_op=async_op)
    if kind == "all_to_all":
        inp, out = torch.ones(numel, device=device), torch.empty(numel, device=device)
        return lambda: dist.all_to_all_single(out, inp, group=group, async_op=async_op)
    if kind == "send_recv":
        ranks = dist.get_process_group_ranks(group)
        me = ranks.index(dist.get_rank())
        nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
        send, recv = torch.ones(numel, device=device), torch.empty(numel, device=device)

        def ring_step() -> None:
            reqs = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
            )
            for r in reqs:
                r.wait()

        return ring_step
    raise ValueError(f"autopar: unknown collective {kind!r}; expected one of {list(COLLECTIVES)}.")


def _reduce(values: Sequence[float], op: dist.ReduceOp, device: torch.device, group=None) -> list[float]:
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def matmul_views(a: torch.Tensor, b: torch.Tensor, m: int, k: int, n: int, layout: str = "nn"):
    """Flat buffers ``a`` (m*k elements) and ``b`` (k*n) as an (m,k) and a (k,n) operand
    stored as ``layout`` says: "nn" both row-major, "nt" the second transposed
    (nn.Linear's forward, x @ W.T), "tn" the first transposed (a weight gradient, g.T @ x)."""
    if layout not in MATMUL_LAYOUTS:
        raise ValueError(f"autopar: matmul layout must be one of {MATMUL_LAYOUTS}; found {layout!r}.")
    a = a.view(k, m).t() if layout == "tn" else a.view(m, k)
    b = b.view(n, k).t() if layout == "nt" else b.view(k, n)
    return a, b


# Operands rotate through at least this many bytes, more than the last-level cache of
# the machines planned for (32 MiB L3 on this host's EPYC per lscpu; 50 MB L2 on an
# H100), so each call reads them from memory as the ops of a training step mostly do.
# Flushing caches between timed GEMMs is standard practice (e.g. mamf-finder).
WORKING_SET_BYTES = 64 << 20
MAX_COPIES = 512  # tiny operands: enough copies to leave L2, not so many as to waste memory


def rotating(make: Callable[[], object], set_bytes: int, working_set_bytes: int) -> Callable[[], object]:
    """A function returning, call after call, one of enough copies of ``make()`` (each
    ``set_bytes``) to span ``working_set_bytes``, so no call finds its operands cached."""
    copies = max(1, min(MAX_COPIES, -(-working_set_bytes // max(set_bytes, 1))))
    sets = [make() for _ in range(copies)]
    it = itertools.cycle(sets)
    return lambda: next(it)


class OperandPool:
    """One buffer of random values per dtype, spanning the working set; operands are
    slices of it at rotating offsets, so no call finds them cached, every point of a
    sweep shares the one buffer, and no point pays for filling a working set of its own.
    Outputs are allocated by the ops themselves, as in training."""

    def __init__(self, device: torch.device, working_set_bytes: int = WORKING_SET_BYTES):
        self.device, self.bytes = device, working_set_bytes
        self.pools: dict[str, torch.Tensor] = {}

    def sets(self, sizes: Sequence[int], dtype: str) -> list[list[torch.Tensor]]:
        """Sets of disjoint flat operands of these sizes (elements), together spanning
        the working set (at most ``MAX_COPIES`` sets)."""
        per_set = sum(sizes)
        if dtype not in self.pools or self.pools[dtype].numel() < per_set:
            n = max(self.bytes // TORCH_DTYPE[dtype].itemsize, per_set)
            self.pools[dtype] = torch.randn(n, device=self.device, dtype=TORCH_DTYPE[dtype])
        pool = self.pools[dtype]
        out = []
        for s in range(min(MAX_COPIES, pool.numel() // per_set)):
            offsets = itertools.accumulate(sizes, initial=s * per_set)
            out.append([pool[o:o + size] for o, size in zip(offsets, sizes)])
        return out

    def release(self, dtype: str) -> None:
        self.pools.pop(dtype, None)


def matmul_call(m: int, k: int, n: int, dtype: str, layout: str, pool: OperandPool) -> Callable[[], object]:
    """A closure running one (m,k)@(k,n) matmul in ``layout`` on the next cold operands."""
    sets = itertools.cycle([matmul_views(a, b, m, k, n, layout) for a, b in pool.sets((m * k, k * n), dtype)])

    def call():
        a, b = next(sets)
        return torch.mm(a, b)

    return call


# Rows of the softmax and norm kinds' timed tensors: a typical hidden size / vocabulary
# shard; the sweep's sizes are multiples of it.
ROW = 512


def _layer_norm_backward(g, x):
    w = torch.ones(ROW, dtype=x.dtype, device=x.device)
    x2 = x.view(-1, ROW)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x2, (ROW,), w, w, 1e-5)
    return lambda: torch.ops.aten.native_layer_norm_backward(
        g.view(-1, ROW), x2, (ROW,), mean, rstd, w, w, (True, True, True)
    )


# kind -> (number of operands, a call on operands of ``numel`` elements, tensors of that
# size the op reads plus writes); autopar.costmodels.opkinds.POINTWISE_KINDS says which ops each
# kind prices.
POINTWISE_CALLS: dict[str, tuple[int, Callable, int]] = {
    "memory": (2, lambda a, b: (lambda: torch.add(a, b)), 3),
    "gelu": (1, lambda a: (lambda: torch.nn.functional.gelu(a)), 2),
    "gelu_backward": (2, lambda g, a: (lambda: torch.ops.aten.gelu_backward(g, a)), 3),
    "exp": (1, lambda a: (lambda: torch.exp(a)), 2),
    "tanh": (1, lambda a: (lambda: torch.tanh(a)), 2),
    "silu": (1, lambda a: (lambda: torch.nn.functional.silu(a)), 2),
    "softmax": (1, lambda a: (lambda: torch.softmax(a.view(-1, ROW), -1)), 2),
    "layer_norm": (1, lambda a: (lambda: torch.nn.functional.layer_norm(a.view(-1, ROW), (ROW,))), 2),
    "layer_norm_backward": (2, _layer_norm_backward, 3),
}


def pointwise_call(kind: str, numel: int, dtype: str, pool: OperandPool) -> Callable[[], object]:
    """A closure running one ``kind`` op on the next set of cache-cold operands."""
    count, make, _ = POINTWISE_CALLS[kind]
    calls = itertools.cycle([make(*ops) for ops in pool.sets((numel,) * count, dtype)])
    return lambda: next(calls)()


def pointwise_bytes_moved(kind: str, numel: int, dtype: str) -> int:
    """Bytes the timed ``kind`` op moves, counted as the cost model counts an op's bytes."""
    return POINTWISE_CALLS[kind][2] * numel * TORCH_DTYPE[dtype].itemsize


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> int:
    """Forward FLOPs of self-attention as torch.utils.flop_counter counts them: QK^T and
    PV, 2 * 2 * B H S^2 D (the whole score matrix, causal or not)."""
    return 4 * batch * heads * seq * seq * head_dim


def attention_calls(
    shape: tuple[int, int, int, int], dtype: str, device: torch.device, working_set_bytes: int
) -> tuple[Callable[[], object], Callable[[], object]]:
    """Closures running causal ``scaled_dot_product_attention`` on q, k, v of ``shape``
    (batch, heads, seq, head_dim): its forward, and its backward alone (autograd.grad
    over a kept graph, so autograd's dispatch is included), on rotating copies."""
    dt = TORCH_DTYPE[dtype]

    def make():
        q, k, v = (torch.randn(shape, device=device, dtype=dt, requires_grad=True) for _ in range(3))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return q, k, v, out, torch.randn_like(out)

    nxt = rotating(make, 5 * math.prod(shape) * dt.itemsize, working_set_bytes)

    def forward():
        q, k, v, _, _ = nxt()
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def backward():
        q, k, v, out, g = nxt()
        return torch.autograd.grad(out, (q, k, v), g, retain_graph=True)

    return forward, backward
