"""Every layout on every model trains like one process (issue #18): the full model x layout
matrix of ``tests.distributed.layout_matrix_check`` in one 4-rank gloo launch (a 2x2 mesh,
3 AdamW steps), as a markdown table of the largest loss and parameter difference from the
one-process reference per cell (or the error). The suite runs a listed subset
(``tests/test_layout_matrix.py``).

    python -m benchmarks.layout_matrix [--models vit,resnet] [--layouts dp,tp] [--out results/layout_matrix]
                                       [--table-dir benchmarks/results]

Writes the table to ``benchmarks/results/layout_matrix_gloo_<yyyymmdd>.md`` (``--table-dir``), and
the table with every cell's raw results (``table.md``, ``results.json``) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results_file import add_out_argument, write_results
from tests.distributed.layout_matrix_check import LAYOUTS, dtype_of
from tests.layout_models import LAYOUT_MODELS

WORKER = "tests.distributed.layout_matrix_check"


def launch(cases: list[str]) -> tuple[dict[str, dict], str]:
    """Results by case of one 4-rank launch (each printed as it comes), and the launch's
    stderr tail (for a launch that stops)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "-m", WORKER,
           *cases]
    results = {}
    with tempfile.TemporaryFile("w+") as err:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env) as run:
            for line in run.stdout:
                if line.startswith("RESULT "):
                    r, _ = json.JSONDecoder().raw_decode(line.removeprefix("RESULT "))
                    results[r["case"]] = r
                    print(f"{r['case']}: {cell(r)} ({r['seconds']:.0f} s)", flush=True)
        err.seek(0)
        return results, err.read()[-3000:]


def cell(result: dict | None) -> str:
    if result is None:
        return "not run (the launch stopped)"
    if "error" in result:
        return "ERROR " + result["error"].split(" (at ")[0][:120]
    return f"{result['loss_err']:.1e} / {result['param_err']:.1e}"


def table(models: list[str], layouts: list[str], results: dict[str, dict]) -> str:
    lines = ["| model (dtype) | " + " | ".join(layouts) + " |", "|---" * (len(layouts) + 1) + "|"]
    for m in models:
        dtype = str(dtype_of(m)).removeprefix("torch.")
        lines.append(f"| {m} ({dtype}) | " + " | ".join(cell(results.get(f"{m}:{lay}")) for lay in layouts) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(LAYOUT_MODELS))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--out", default="results/layout_matrix", help="folder of table.md and results.json")
    add_out_argument(parser, "--table-dir")
    args = parser.parse_args(argv)
    models, layouts = args.models.split(","), args.layouts.split(",")
    started = time.perf_counter()
    results, stderr = launch([f"{m}:{lay}" for m in models for lay in layouts])
    seconds = time.perf_counter() - started
    text = (f"Largest |loss - one process| / |parameter - one process| after 3 AdamW steps, 2x2 gloo mesh "
            f"(one launch, {seconds:.0f} s):\n\n{table(models, layouts, results)}\n")
    print(text)
    write_results("layout_matrix", "gloo", "Every layout on every model against one process", text.splitlines(),
                  args.table_dir, argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if len(results) < len(models) * len(layouts):
        print(stderr)
    return 0 if all("error" not in r for r in results.values()) and len(results) == len(models) * len(layouts) \
        else 1


if __name__ == "__main__":
    raise SystemExit(main())
