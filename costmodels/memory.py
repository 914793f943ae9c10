"""Memory per device and pipeline-schedule quantities.

Parameters, gradients and AdamW state under ZeRO 0-3 (``formulas.ZERO_MEMORY``),
activations alive under GPipe, 1F1B and interleaved 1F1B (``formulas.IN_FLIGHT``), and
the pipeline bubble (``formulas.BUBBLE_FRACTION``).
"""

from __future__ import annotations

from functools import lru_cache

from autopar.costmodels.formulas import BYTES_PER_PARAM, IN_FLIGHT, compiled

SCHEDULES = tuple(IN_FLIGHT)


@lru_cache(maxsize=None)
def _fn(name: str):
    return compiled(name)


def _precision(precision: str) -> tuple[int, int, int]:
    if precision not in BYTES_PER_PARAM:
        raise ValueError(f"autopar: precision must be one of {list(BYTES_PER_PARAM)}; found {precision!r}.")
    return BYTES_PER_PARAM[precision]


def model_state_bytes(n_params: float, zero: int, n_shards: int, precision: str = "mixed") -> float:
    """Bytes per device of parameters + gradients + AdamW state for ``n_params``
    parameters at ZeRO stage ``zero`` sharded over ``n_shards`` ranks.

    ``precision="mixed"`` is the ZeRO paper's 2+2+12 bytes per parameter (16Psi,
    4Psi+12Psi/N, 2Psi+14Psi/N, 16Psi/N); ``"fp32"`` is 4+4+8.
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"autopar: ZeRO stage must be 0, 1, 2 or 3; found {zero!r}.")
    if n_shards < 1:
        raise ValueError(f"autopar: n_shards must be >= 1; found {n_shards}.")
    p, g, o = _precision(precision)
    return _fn(f"zero{zero}")(n_params, p, g, o, n_shards)


def _check_schedule(schedule: str, stages: int, micro_batches: int, chunks: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"autopar: schedule must be one of {list(SCHEDULES)}; found {schedule!r}.")
    if stages < 1 or micro_batches < 1 or chunks < 1:
        raise ValueError(
            f"autopar: stages, micro_batches and chunks must be >= 1; found {stages}, "
            f"{micro_batches}, {chunks}."
        )
    if schedule != "interleaved_1f1b" and chunks != 1:
        raise ValueError(
            f"autopar: only interleaved_1f1b runs several chunks per rank; {schedule} got chunks={chunks}."
        )


def micro_batches_in_flight(schedule: str, stages: int, micro_batches: int, chunks: int = 1,
                            rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at its peak, in units
    of one micro-batch through the rank's whole stage (all its chunks); rank 0, the
    first, is the fullest."""
    _check_schedule(schedule, stages, micro_batches, chunks)
    if not 0 <= rank < stages:
        raise ValueError(f"autopar: rank must be in 0..{stages - 1} for {stages} stages; found {rank}.")
    return _fn(f"in_flight.{schedule}")(micro_batches, stages, chunks, rank)


def activation_bytes(
    per_micro_batch: float, schedule: str, stages: int, micro_batches: int, chunks: int = 1
) -> float:
    """Peak activation bytes of a stage that keeps ``per_micro_batch`` bytes per micro-batch."""
    return per_micro_batch * micro_batches_in_flight(schedule, stages, micro_batches, chunks)


def layer_activation_bytes(
    seq: int, batch: int, hidden: int, heads: int, tp: int = 1, sequence_parallel: bool = False
) -> float:
    """Bytes one transformer layer keeps for backward per micro-batch (16-bit
    activations, no recomputation; Korthikanti et al. 2022): 34sbh + 5as^2b without
    tensor parallelism, fewer with it. For graphs, sum the saved tensors instead."""
    kind = "none" if tp == 1 else "tensor_sequence_parallel" if sequence_parallel else "tensor_parallel"
    return _fn(f"layer_activations.{kind}")(seq, batch, hidden, heads, tp)


def bubble_fraction(schedule: str, stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Fraction of the step a stage sits idle: (P-1)/(M+P-1), or (P-1)/(vM+P-1) interleaved."""
    _check_schedule(schedule, stages, micro_batches, chunks)
    return _fn(f"bubble.{schedule}")(micro_batches, stages, chunks)


def pipeline_time(
    schedule: str, stages: int, micro_batches: int, t_forward: float, t_backward: float, chunks: int = 1
) -> float:
    """Step time of a pipeline whose slowest stage takes ``t_forward + t_backward`` per
    micro-batch (its whole stage; with chunks, all v chunks together)."""
    _check_schedule(schedule, stages, micro_batches, chunks)
    return _fn(f"pipeline.{schedule}")(micro_batches, stages, chunks, t_forward, t_backward)
