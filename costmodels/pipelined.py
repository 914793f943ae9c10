"""A matmul pipelined with its tensor-parallel collective in chunks: its critical path.

Async tensor parallelism (torchtitan's; ``autopar.passes.collective_matmul`` runs it) cuts
an all-gather -> matmul, or a matmul -> reduce-scatter, into ``chunks`` pieces and runs one
piece's collective beside another's matmul. With one chunk's matmul taking ``t_mm`` and its
collective ``t_cc``, and ``h`` the part of the shorter hidden when both run at once (the
profile's overlap figure of that collective beside compute, ``costmodels.overlap``), the
critical path is ``formulas.PIPELINED``:

    t_mm + t_cc + (chunks - 1) (t_mm + t_cc - h min(t_mm, t_cc))

Forward, an all-gather first runs that once; a reduce-scatter last likewise. Backward:

- gather first (a column-parallel linear reading rows gathered): the input is gathered
  again beside the weight gradient's chunks (``dW``), then the input gradient's chunks
  (``dX``) are reduce-scattered behind their matmuls: two pipelines, one after the other;
- scatter last (a row-parallel linear whose sum is reduce-scattered): the output's gradient
  is gathered beside both gradients' chunks (``dX + dW`` per chunk): one pipeline.

A bias's gradient (a sum over the rows) runs after, alone. ``chunks`` = 1 is an
all-gather and a matmul one after the other: the split prices its every chunk's latency
and kernel launch. ``PipelinedTimes.apart`` is the same op unsplit: the whole matmul and its
collective one after the other, forward and backward (a plain strategy and its resharding
edge); the pipelined op is offered to the solver only where it is shorter (``pays``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from autopar.costmodels.comm import Step, collective_time
from autopar.costmodels.formulas import compiled
from autopar.costmodels.opkinds import Op, backward_ops
from autopar.costmodels.overlap import hidden_share
from autopar.costmodels.profile import HardwareProfile
from autopar.costmodels.step import ops_time

# the kind the profile times running each collective beside compute (``overlap.COLLECTIVE``)
BESIDE = {"all_gather": "parameter_gather", "reduce_scatter": "gradient_reduce_scatter"}


@dataclass(frozen=True)
class Pipelined:
    """One device's share of a pipelined collective matmul: ``chunks`` pieces, each a
    forward ``matmul`` (its backward: ``opkinds.backward_ops``), an all-gather ``gather``
    and a reduce-scatter ``scatter`` (their buffers: one chunk's); ``gathers_first``: the
    all-gather feeds the matmul in forward, else the reduce-scatter follows it; ``whole``:
    the matmul unsplit."""

    chunks: int
    matmul: Op
    gather: Step
    scatter: Step
    gathers_first: bool
    whole: Op

    def __post_init__(self) -> None:
        if self.chunks < 1 or (self.gather.collective, self.scatter.collective) != ("all_gather", "reduce_scatter"):
            raise ValueError(f"autopar: expected chunks >= 1, an all_gather and a reduce_scatter; found {self}")


@dataclass(frozen=True)
class PipelinedTimes:
    """Seconds of a pipelined collective matmul: its critical path forward and backward, and
    the matmuls alone (every chunk's, forward and backward): the rest is exposed communication."""

    forward: float
    backward: float
    compute_forward: float
    compute_backward: float
    apart: float  # the whole matmul and its collective one after the other, forward and backward

    @property
    def pays(self) -> bool:
        return self.forward + self.backward < self.apart


def pipelined_time(chunks: int, matmul_s: float, collective_s: float, hidden: float) -> float:
    """The critical path of ``chunks`` chunks (``formulas.PIPELINED``)."""
    return _pipelined_fn()(chunks, matmul_s, collective_s, hidden)


@lru_cache(maxsize=1)
def _pipelined_fn():
    return compiled("pipelined")


def pipelined_times(p: Pipelined, profile: HardwareProfile, on_grad_path: bool = True) -> PipelinedTimes:
    """Forward and backward critical paths of ``p`` on ``profile`` (the module docstring)."""

    def collective(step: Step) -> tuple[float, float]:
        seconds = collective_time(step.collective, step.bytes, step.axis, profile, in_step=step.in_step)
        return seconds, hidden_share(profile.overlap, BESIDE[step.collective])

    gather, scatter = collective(p.gather), collective(p.scatter)
    mm = ops_time([p.matmul], profile)
    forward = pipelined_time(p.chunks, mm, *(gather if p.gathers_first else scatter))
    # unsplit: one gather (forward or backward) and one reduce-scatter, each of every chunk's bytes
    whole = [collective_time(s.collective, s.bytes * p.chunks, s.axis, profile, in_step=s.in_step)
             for s in (p.gather, p.scatter)]
    if not on_grad_path:
        apart = ops_time([p.whole], profile) + whole[0 if p.gathers_first else 1]
        return PipelinedTimes(forward, 0.0, p.chunks * mm, 0.0, apart)
    grads = backward_ops(p.matmul)
    d_x, d_w = (ops_time([op], profile) for op in grads[:2])  # dX = dY W^T, dW = X^T dY
    # a bias's gradient, after: one sum over every chunk's rows
    rest = ops_time(backward_ops(p.matmul._replace(out_bytes=p.matmul.out_bytes * p.chunks))[2:], profile)
    if p.gathers_first:
        backward = pipelined_time(p.chunks, d_w, *gather) + pipelined_time(p.chunks, d_x, *scatter)
    else:
        backward = pipelined_time(p.chunks, d_x + d_w, *gather)
    apart = ops_time([p.whole], profile) + ops_time(backward_ops(p.whole), profile) + sum(whole)
    return PipelinedTimes(forward, backward + rest, p.chunks * mm, p.chunks * (d_x + d_w) + rest, apart)
