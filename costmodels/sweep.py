"""What the profiler measures: the sizes, shapes and batch counts of a ``Sweep``.

The default sweep is sized for a first ``autopar.compile`` (a CPU mesh in about 22 s);
``thorough`` measures more of each, ``gpu`` at sizes where a datacenter GPU reaches its
rates, ``quick`` a few seconds' worth for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.costmodels.opkinds import POINTWISE_KINDS
from autopar.costmodels.profile import DTYPES
from autopar.costmodels.timing import MATMUL_LAYOUTS, WORKING_SET_BYTES


@dataclass(frozen=True, kw_only=True)
class Sweep:
    """What the profiler measures. The defaults take about 22 s at 4 CPU ranks on a 2x2
    mesh of 2 cores (fp32; bf16 and fp16 add about 8 s each); ``thorough`` measures more
    sizes, more often, in three times that (``benchmarks.profile_speed``)."""

    comm_bytes: tuple[int, ...] = (1 << 12, 1 << 16, 1 << 20, 1 << 22)
    matmul_shapes: tuple[tuple[int, int, int], ...] = (
        (32, 32, 32),
        (128, 128, 128),
        (256, 128, 512),
        (512, 256, 512),
        (512, 512, 512),
    )
    pointwise_numel: tuple[int, ...] = (1 << 10, 3 << 14, 3 << 18, 3 << 20)
    # the other pointwise kinds (multiples of timing.ROW); bf16 / fp16 time the two ends.
    # Between sizes a pointwise op is priced by interpolation (``Rate.segment``), so the
    # sweep spans tensors in cache (12 Ki elements) to tensors streamed from memory (3 Mi).
    kind_numel: tuple[int, ...] = (3 << 12, 3 << 16, 3 << 20)
    # (batch, heads, seq, head_dim) of causal attention; bf16 / fp16 (slow on a CPU) time
    # the first two. An op is priced per head (batch x heads of them) by its FLOPs between
    # the measured head sizes, so fp32 times four head sizes (both head dims at both
    # sequence lengths), one of them at two batches (which tells the op's fixed cost apart)
    attention_shapes: tuple[tuple[int, int, int, int], ...] = (
        (1, 8, 128, 32), (4, 8, 128, 32), (2, 8, 256, 64), (2, 8, 128, 64), (1, 8, 256, 32))
    repeats: int = 5
    # Collectives take more batches: under time sharing one batch's time per collective is
    # bimodal (measured on this 2-core machine, 2 gloo ranks, 30 batches of all_reduce at 4 KiB:
    # 0.34 ms to 3.8 ms, median 1.3 ms), and the 10-90% spread of a median of 5 batches was
    # 70-80% of the value at 4 KiB-1 MiB, of a median of 15 20-40%; 9 here, 15 ``thorough``.
    comm_repeats: int = 9
    warmup: int = 2
    # bf16 / fp16 time fewer, smaller shapes (fp16 matmul on CPU runs at ~1 GFLOP/s)
    low_precision_shapes: tuple[tuple[int, int, int], ...] = (
        (64, 64, 64),
        (128, 128, 128),
        (128, 128, 256),
        (256, 256, 256),
    )
    min_batch_s: float = 0.01  # each timed batch of calls lasts at least this long
    working_set_bytes: int = WORKING_SET_BYTES  # compute operands rotate through this much
    # collectives after compute: these sizes, each after this many "nt" matmuls of this
    # (m, k, n) (3 ms on one of 2 ranks here, about half a transformer layer's forward)
    in_step_bytes: tuple[int, ...] = (1 << 14, 1 << 18, 1 << 22)
    in_step_units: int = 8
    in_step_matmul: tuple[int, int, int] = (256, 256, 256)

    def matmuls(self, dtype: str) -> tuple[tuple[int, int, int], ...]:
        """The (m, k, n) timed in ``dtype``."""
        return self.matmul_shapes if dtype == DTYPES[0] else self.low_precision_shapes

    def pointwise_sizes(self, kind: str, dtype: str) -> tuple[int, ...]:
        """The element counts a pointwise ``kind`` is timed at in ``dtype``: bf16 / fp16 time
        the two ends of the other kinds' sizes, to save time."""
        if kind == "memory":
            return self.pointwise_numel
        sizes = self.kind_numel
        return sizes if dtype == DTYPES[0] or len(sizes) <= 2 else (sizes[0], sizes[-1])

    def attentions(self, dtype: str) -> tuple[tuple[int, int, int, int], ...]:
        """The attention shapes timed in ``dtype`` (bf16 / fp16, slow on a CPU: the first two)."""
        return self.attention_shapes if dtype == DTYPES[0] else self.attention_shapes[:2]

    def compute_calls(self, dtype: str) -> int:
        """How many timed calls measuring ``dtype``'s compute makes (a progress bar's share):
        each matmul in every layout, each pointwise size, each attention forward and backward."""
        return (len(MATMUL_LAYOUTS) * len(self.matmuls(dtype))
                + sum(len(self.pointwise_sizes(kind, dtype)) for kind in POINTWISE_KINDS)
                + 2 * len(self.attentions(dtype)))

    @classmethod
    def thorough(cls) -> Sweep:
        """More sizes, more batches (about three times the default's time)."""
        return cls(
            comm_bytes=(1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22),
            matmul_shapes=((32, 32, 32), (64, 64, 64), (128, 128, 128), (256, 128, 512), (256, 256, 256),
                           (512, 256, 512), (512, 512, 512)),
            pointwise_numel=(1 << 10, 3 << 12, 3 << 14, 3 << 16, 3 << 18, 3 << 20),
            kind_numel=(3 << 12, 3 << 14, 3 << 16, 3 << 18, 3 << 20),
            comm_repeats=15,
            min_batch_s=0.02,
            in_step_units=16,
        )

    @classmethod
    def gpu(cls) -> Sweep:
        """Sizes where a datacenter GPU reaches its rates (not yet run on one)."""
        return cls(
            comm_bytes=tuple(1 << p for p in range(16, 31, 2)),  # 64 KiB .. 1 GiB
            matmul_shapes=tuple((n, n, n) for n in (512, 1024, 2048, 4096, 8192)),
            low_precision_shapes=tuple((n, n, n) for n in (1024, 2048, 4096, 8192)),
            pointwise_numel=tuple(1 << p for p in range(16, 29, 3)),
            kind_numel=tuple(1 << p for p in range(18, 29, 5)),
            attention_shapes=((4, 16, 1024, 128), (8, 16, 2048, 128), (8, 32, 4096, 128)),
            repeats=5,
            comm_repeats=5,
            warmup=3,
            min_batch_s=0.02,
            working_set_bytes=256 << 20,
            in_step_bytes=(1 << 16, 1 << 22, 1 << 28),
            in_step_matmul=(4096, 4096, 4096),
        )

    @classmethod
    def quick(cls) -> Sweep:
        """A small sweep for tests and smoke runs (a few seconds)."""
        return cls(
            comm_bytes=(1 << 12, 1 << 18, 1 << 22),
            matmul_shapes=((32, 32, 32), (64, 64, 64), (128, 128, 128)),
            pointwise_numel=(1 << 10, 1 << 14, 1 << 17),
            kind_numel=(1 << 10, 1 << 14),
            attention_shapes=((1, 2, 32, 16), (1, 4, 64, 32)),
            repeats=3,
            comm_repeats=3,
            warmup=1,
            min_batch_s=0.005,
            working_set_bytes=4 << 20,
            low_precision_shapes=((32, 32, 32), (64, 64, 64)),
            in_step_bytes=(1 << 12, 1 << 18),
            in_step_units=2,
            in_step_matmul=(64, 64, 64),
        )
