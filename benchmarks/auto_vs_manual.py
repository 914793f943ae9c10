"""Auto versus manual layouts, predicted and measured: the whole benchmark in one command.

    python -m benchmarks.auto_vs_manual                         # every model and mesh, 10-15 minutes here
    python -m benchmarks.auto_vs_manual --models gpt2 llama --meshes gloo-4 h100-64
    python -m benchmarks.auto_vs_manual --quick                 # a tiny subset, under a minute

Writes the model x mesh table of auto ÷ best manual layout to
``benchmarks/results/auto_vs_manual_<hardware>_<yyyymmdd>.md`` (``--out``), and the full report
(``table.md``, ``results.json``, PNG charts; see ``autopar.bench``) to ``results/bench`` (``--out-dir``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from autopar import bench
from benchmarks.results_file import add_out_argument, write_results


def grid(report: dict) -> list[str]:
    """One row per model, one column per mesh: auto ÷ best manual predicted; after ``;`` measured."""
    meshes = report["meta"]["meshes"]
    cells = {}
    for row in report["rows"]:
        if row["layout"] == "auto":
            predicted, measured = row.get("vs_best_manual_predicted"), row.get("vs_best_manual_measured")
            cell = "–" if predicted is None else f"{predicted:.2f}"
            cells[row["model"], row["mesh"]] = cell + ("" if measured is None else f"; {measured:.2f}")
    lines = ["Each cell: auto plan ÷ best manual layout, predicted step time; after `;` the same ratio measured "
             "(gloo meshes only).", "",
             "| model | " + " | ".join(meshes) + " |", "|---" * (len(meshes) + 1) + "|"]
    lines += [f"| {model} | " + " | ".join(cells.get((model, mesh), "–") for mesh in meshes) + " |"
              for model in report["meta"]["models"]]
    return lines


def hardware(meshes: list[str]) -> str:
    """The meshes' kinds, as the results file names them: ``gloo``, ``h100`` or ``gloo-h100``."""
    return "-".join(sorted({mesh.split("-")[0] for mesh in meshes}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=None, help=f"some of {', '.join(bench.MODELS)}")
    parser.add_argument("--meshes", nargs="+", default=None, help=f"some of {', '.join(bench.MESHES)}")
    parser.add_argument("--out-dir", default="results/bench", help="folder of the full report, JSON and charts")
    add_out_argument(parser)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--time-limit", type=float, default=20.0, help="planner time limit per plan (s)")
    args = parser.parse_args(argv)
    table = bench.run(args.models, args.meshes, out_dir=args.out_dir, quick=args.quick, time_limit_s=args.time_limit)
    print(table.read_text())
    print(f"written: {table} (and results.json, charts, beside it)")
    report = json.loads((Path(table).parent / "results.json").read_text())
    title = "Auto versus manual layouts: auto plan ÷ best manual layout, step time"
    write_results("auto_vs_manual", hardware(report["meta"]["meshes"]), title, grid(report), args.out, argv)


if __name__ == "__main__":
    main()
