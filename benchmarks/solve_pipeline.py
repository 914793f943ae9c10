"""Time of the pipeline search on a synthetic 80-layer model (made-up costs).

    python -m benchmarks.solve_pipeline

64 devices; P pipeline ranks leave 64 / P devices for intra-op parallelism, and M
micro-batches split a batch of 512 sequences. Per layer and micro-batch: compute
scales as 1 / (devices per stage) / M, and tensor-parallel collectives are cheap
within 8 devices (a node) and dear across nodes;
parameters and optimizer state are sharded over the stage's devices; activations
scale with the micro-batch. Layers 0 and 79 (embedding, head) are heavier. Prints
the best few options and the search time, and writes them to
``benchmarks/results/solve_pipeline_cpu_<yyyymmdd>.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from autopar.costmodels.units import GIB
from autopar.passes.solve.pipeline_search import search_pipeline
from autopar.passes.solve.stages import LayerCosts
from benchmarks.results_file import add_out_argument, write_results

DEVICES, BATCH, LAYERS = 64, 512, 80


def tensor_parallel_cost(intra: int) -> float:
    """Seconds a layer spends in collectives per batch: cheap within 8 devices (one node), dear across."""
    return (0.002 if intra <= 8 else 0.05) * np.log2(intra)


def layer_costs(stages: int, micro_batches: int) -> LayerCosts:
    intra = DEVICES // stages
    weight = np.ones(LAYERS)
    weight[[0, -1]] = 3.0  # embedding and head
    return LayerCosts(
        time=weight * (2.0 / intra + tensor_parallel_cost(intra)) / micro_batches,
        static_memory=weight * 16 * 0.2 * GIB / intra,  # 0.2 G parameters a layer, 16 bytes each (Adam)
        activation_memory=weight * 2.0 * GIB * (BATCH / micro_batches / 64) / intra,
        boundary_time=np.full(LAYERS - 1, 1e-4 * BATCH / micro_batches / 64),
        step_overhead=0.05 * np.log2(intra),  # gradient reduction across the intra-op group
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    result = search_pipeline(
        layer_costs, stage_counts=[1, 2, 4, 8, 16], micro_batch_counts=[1, 2, 4, 8, 16, 32, 64],
        schedules=("gpipe", "1f1b", "interleaved_1f1b"), chunks_per_rank=(2, 4), memory_limit=80 * GIB,
    )
    elapsed = time.perf_counter() - started
    valid = [o for o in result.options if not o.rejected]
    searched = f"{len(result.options)} options ({len(valid)} fit in 80 GiB) searched in {elapsed:.2f} s"
    print(searched)
    lines = [searched, "", "| P | M | schedule | v | step s | peak GiB | stage starts (first 6) |",
             "|---|---|---|---|---|---|---|"]
    for option in valid[:5]:
        print(
            f"  P={option.stages:<3} M={option.micro_batches:<3} {option.schedule:<17} "
            f"v={option.chunks_per_rank}  step {option.step_time:.3f} s  "
            f"peak {max(option.rank_memory) / GIB:.1f} GiB  starts {option.cut.starts[:6]}"
        )
        lines.append(f"| {option.stages} | {option.micro_batches} | {option.schedule} | {option.chunks_per_rank} | "
                     f"{option.step_time:.3f} | {max(option.rank_memory) / GIB:.1f} | {option.cut.starts[:6]} |")
    write_results("solve_pipeline", "cpu", "Time of the pipeline search on a synthetic 80-layer model", lines, args.out)


if __name__ == "__main__":
    main()
