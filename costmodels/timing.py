"""Timing primitives of the profiler: one collective, matmul or pointwise op, timed the
way the profile and the accuracy benchmark both time them.

Every function here runs on every rank of an initialised process group, all ranks at
once (as in training). Times are per call, the median over batches of back-to-back
calls, and then the slowest rank's: an SPMD step waits for its slowest rank, so that is
the rate a plan gets where ranks share a machine unevenly.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

import torch
import torch.distributed as dist

from costmodels.profile import COLLECTIVES

TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The three products of a linear layer in a training step: forward x @ W.T ("nt"), input
# gradient g @ W ("nn"), weight gradient g.T @ x ("tn"). CPU GEMMs run them at rates up
# to 2x apart, so the profile's matmul rate is fitted over all three.
MATMUL_LAYOUTS = ("nn", "nt", "tn")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(
    fn: Callable[[], object],
    device: torch.device,
    repeats: int,
    warmup: int,
    *,
    min_batch_s: float = 0.02,
    group: dist.ProcessGroup | None = None,
) -> float:
    """Seconds per call of ``fn``: the median over ``repeats`` batches of back-to-back
    calls, each batch long enough (``min_batch_s``) to span several scheduler time
    slices, so ranks that share cores are timed at the rate they really get. With
    ``group`` (a collective), every rank of the group runs the same batch length."""
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    calls = max(1, int(min_batch_s / max(time.perf_counter() - t0, 1e-7)))
    if group is not None:
        calls = int(_reduce(calls, dist.ReduceOp.MAX, device, group))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / calls)
    times.sort()
    return times[len(times) // 2]


def collective_call(
    kind: str, group: dist.ProcessGroup, nbytes: int, device: torch.device
) -> Callable[[], object]:
    """A closure running one ``kind`` collective on ``group`` with an X = ``nbytes`` buffer
    (X as in ``formulas.COLLECTIVE_BUFFER``), fp32 elements."""
    n = dist.get_world_size(group)
    numel = max(n, nbytes // 4 // n * n)
    if kind == "all_reduce":
        buf = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if kind == "all_gather":
        out, inp = torch.empty(numel, device=device), torch.ones(numel // n, device=device)
        return lambda: dist.all_gather_single(out, inp, group=group)
    if kind == "reduce_scatter":
        inp, out = torch.ones(numel, device=device), torch.empty(numel // n, device=device)
        return lambda: dist.reduce_scatter_single(out, inp, group=group)
    if kind == "all_to_all":
        inp, out = torch.ones(numel, device=device), torch.empty(numel, device=device)
        return lambda: dist.all_to_all_single(out, inp, group=group)
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


def _reduce(value: float, op: dist.ReduceOp, device: torch.device, group=None) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return float(t.item())


def time_collective(
    kind: str, group, nbytes: int, device: torch.device, repeats: int, warmup: int, min_batch_s: float = 0.02
) -> float:
    """Seconds per call, the slowest rank's median (every rank gets the same number)."""
    t = median_time(
        collective_call(kind, group, nbytes, device),
        device,
        repeats,
        warmup,
        min_batch_s=min_batch_s,
        group=group,
    )
    return _reduce(t, dist.ReduceOp.MAX, device)


def matmul_operands(m: int, k: int, n: int, dtype: str, device: torch.device, layout: str = "nn"):
    """An (m,k) and a (k,n) operand stored as ``layout`` says: "nn" both row-major, "nt"
    the second transposed (nn.Linear's forward, x @ W.T), "tn" the first transposed
    (a weight gradient, g.T @ x)."""
    if layout not in MATMUL_LAYOUTS:
        raise ValueError(f"autopar: matmul layout must be one of {MATMUL_LAYOUTS}; found {layout!r}.")
    dt = TORCH_DTYPE[dtype]
    a = (
        torch.randn(k, m, device=device, dtype=dt).t()
        if layout == "tn"
        else torch.randn(m, k, device=device, dtype=dt)
    )
    b = (
        torch.randn(n, k, device=device, dtype=dt).t()
        if layout == "nt"
        else torch.randn(k, n, device=device, dtype=dt)
    )
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


def time_matmul(
    m: int,
    k: int,
    n: int,
    dtype: str,
    device: torch.device,
    repeats: int,
    warmup: int,
    min_batch_s: float = 0.02,
    layout: str = "nn",
    working_set_bytes: int = WORKING_SET_BYTES,
) -> float:
    """Seconds per (m,k)@(k,n) matmul on cache-cold operands, the slowest rank's median."""
    itemsize = TORCH_DTYPE[dtype].itemsize
    nxt = rotating(
        lambda: matmul_operands(m, k, n, dtype, device, layout),
        (m * k + k * n + m * n) * itemsize,
        working_set_bytes,
    )

    def call():
        a, b = nxt()
        return torch.mm(a, b)

    t = median_time(call, device, repeats, warmup, min_batch_s=min_batch_s)
    return _reduce(t, dist.ReduceOp.MAX, device)


def time_pointwise(
    numel: int,
    dtype: str,
    device: torch.device,
    repeats: int,
    warmup: int,
    min_batch_s: float = 0.02,
    working_set_bytes: int = WORKING_SET_BYTES,
) -> float:
    """Seconds per out-of-place add of two ``numel`` tensors (3 tensors moved), on
    cache-cold operands, the slowest rank's median."""
    dt = TORCH_DTYPE[dtype]
    nxt = rotating(
        lambda: (torch.randn(numel, device=device, dtype=dt), torch.randn(numel, device=device, dtype=dt)),
        3 * numel * dt.itemsize,
        working_set_bytes,
    )

    def call():
        a, b = nxt()
        return torch.add(a, b)

    t = median_time(call, device, repeats, warmup, min_batch_s=min_batch_s)
    return _reduce(t, dist.ReduceOp.MAX, device)
