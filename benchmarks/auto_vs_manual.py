"""Auto versus manual layouts, predicted and measured: the whole benchmark in one command.

    python -m benchmarks.auto_vs_manual                         # every model and mesh, 10-15 minutes here
    python -m benchmarks.auto_vs_manual --models gpt2 llama --meshes gloo-4 h100-64
    python -m benchmarks.auto_vs_manual --quick                 # a tiny subset, under a minute

Writes results/bench/table.md, results.json and PNG charts (see ``autopar.bench``).
"""

from __future__ import annotations

import argparse


from autopar import bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=None, help=f"some of {', '.join(bench.MODELS)}")
    parser.add_argument("--meshes", nargs="+", default=None, help=f"some of {', '.join(bench.MESHES)}")
    parser.add_argument("--out-dir", default="results/bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--time-limit", type=float, default=20.0, help="planner time limit per plan (s)")
    args = parser.parse_args()
    table = bench.run(args.models, args.meshes, out_dir=args.out_dir, quick=args.quick, time_limit_s=args.time_limit)
    print(table.read_text())
    print(f"written: {table} (and results.json, charts, beside it)")


if __name__ == "__main__":
    main()
