"""A rank's decode step replayed as a CUDA graph.

Decode runs a few hundred small kernels per token (one token per sequence: each matmul reads
its weights once and is done in microseconds), so run eagerly it is bound by the host: every
ATen op pays Python and dispatch before its kernel is queued, and the GPU waits (on one H200,
a 16-layer Llama's decode step took 21 ms eagerly and 6.6 ms as a graph,
``benchmarks/results/gpu_one_device_h200_20261129.md``). A CUDA graph records the step's
kernels once and replays them with one launch, as vLLM and Hugging Face's static-cache path
do. What makes it possible here: the step's shapes never change (a static cache of
``max_len`` slots, the planned batch) and its state lies at fixed addresses (the weights and
the cache shards, written in place), so only the step's inputs are copied into the graph's
own input buffers before each replay.

Checked, not assumed: the first call runs the step eagerly (its result is the one returned),
records it, replays it, and keeps the graph only where every rank recorded it and every
replay gave the eager result; else every rank warns and runs the step eagerly from then on
(all ranks alike: they must issue the same collectives). The replay of that first call
writes the cache slots the eager run wrote, with the same values.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


class GraphFallbackWarning(UserWarning):
    """A decode step that could not be replayed as a CUDA graph runs eagerly (slower, exact)."""


class GraphedStep:
    """One program (``fn`` of positional tensors) replayed as a CUDA graph. ``fixed``: which
    positions hold state at a fixed address (weights, cache shards, constants): read in place;
    every other argument is copied into the graph's input buffer before each replay. ``fn``
    must write its state the same way however often it runs on the same inputs (decode writes
    its new keys and values at their slots): its first call runs it twice (the module docstring)."""

    def __init__(self, fn, fixed: list[bool], what: str):
        self.fn, self.fixed, self.what = fn, fixed, what
        self.graph: torch.cuda.CUDAGraph | None = None
        self.eager = False  # True: recording or checking failed; runs ``fn`` as is
        self.inputs: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []

    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        if self.eager:
            return _listed(self.fn(*args))
        if self.graph is None:
            return self._record(args)
        for buffer, arg, fixed in zip(self.inputs, args, self.fixed):
            if fixed:
                if arg.data_ptr() != buffer.data_ptr():  # state moved: the graph would read stale memory
                    raise RuntimeError(f"autopar: the CUDA graph of {self.what} expected its state at the address "
                                       "it was recorded with; found it moved; do not replace the module's state "
                                       "tensors between steps")
            else:
                buffer.copy_(arg)
        self.graph.replay()
        return [out.clone() for out in self.outputs]  # the next replay overwrites the graph's outputs

    def _record(self, args) -> list[torch.Tensor]:
        self.inputs = [arg if fixed else arg.clone() for arg, fixed in zip(args, self.fixed)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as CUDA graph capture asks
            eager = _listed(self.fn(*self.inputs))
        torch.cuda.current_stream().wait_stream(side)
        graph, reason = torch.cuda.CUDAGraph(), None
        try:
            with torch.cuda.graph(graph):
                self.outputs = _listed(self.fn(*self.inputs))
        except Exception as exc:  # noqa: BLE001 - an op that cannot be recorded: run eagerly, said below
            reason = f"recording failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        if _everywhere(reason is None, eager[0].device):
            graph.replay()
            same = all(torch.equal(a, b) for a, b in zip(self.outputs, eager))
            if _everywhere(same, eager[0].device):
                self.graph = graph
                return eager
            reason = "its replay differed from the eager step on some rank"
            self.fn(*self.inputs)  # write the cache slots again as the eager step does
        else:
            reason = reason or "recording failed on another rank"
        warnings.warn(f"autopar: {self.what} runs eagerly, not as a CUDA graph: {reason}; generation stays exact, "
                      "only slower (host-bound)", GraphFallbackWarning, stacklevel=3)
        self.eager, self.outputs = True, []
        return eager


def _listed(outs) -> list[torch.Tensor]:
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def _everywhere(ok: bool, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank (one all-reduce of a flag)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
