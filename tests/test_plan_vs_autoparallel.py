"""``benchmarks/plan_vs_autoparallel.py`` without autoparallel: without it the benchmark stops with
an ``autopar:`` message naming the pinned install command and a non-zero exit status, and its
tables give the medians' ratios autoparallel ÷ autopar. About 2 s (no planning)."""

import subprocess
import sys

from benchmarks import plan_vs_autoparallel as bench
from benchmarks.results_file import REPO
from benchmarks.summary import tables


def test_without_autoparallel_it_fails_saying_how_to_install_the_pinned_commit():
    hide = "import sys; sys.modules['autoparallel'] = None; from benchmarks.plan_vs_autoparallel import main; main([])"
    run = subprocess.run([sys.executable, "-c", hide], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert run.stderr.startswith("autopar:") and "not a dependency" in run.stderr
    assert bench.INSTALL in run.stderr and bench.AUTOPARALLEL_COMMIT in bench.INSTALL
    assert bench.INSTALL in bench.__doc__  # the docstring names the same command
    assert run.stdout == ""  # nothing planned


def _run(planner, solver, wall, cpu, rss):
    return {"planner": planner, "solver": solver, "wall": wall, "cpu": cpu, "rss_gib": rss, "planning_s": wall - 5,
            "plan": "x"}


def test_table_gives_each_run_and_the_medians_ratios(tmp_path):
    runs = [_run("autopar", "—", 10, 12, 4), _run("autoparallel", "ilp", 40, 50, 6),
            _run("autoparallel", "approximate", 20, 25, 3), _run("autopar", "—", 30, 28, 6),
            _run("autoparallel", "ilp", 80, 90, 10), _run("autoparallel", "approximate", 30, 35, 5)]
    path = tmp_path / "t.md"
    path.write_text("\n".join(bench.table(runs)) + "\n")
    each, medians = tables(path)
    assert [r["planner"] for r in each] == ["autopar", "autoparallel", "autoparallel"] * 2
    assert each[4]["wall s"] == "80.0" and each[4]["solver"] == "ilp"
    ratios = {(r["autoparallel solver"], r["quantity (median)"]): r for r in medians}
    assert ratios["ilp", "wall s"]["autopar"] == "20.0" and ratios["ilp", "wall s"]["autoparallel"] == "60.0"
    assert ratios["ilp", "wall s"]["autoparallel ÷ autopar"] == "3.00"  # 60 / 20
    assert ratios["ilp", "CPU s"]["autoparallel ÷ autopar"] == "3.50"  # 70 / 20
    assert ratios["approximate", "peak RSS GiB"]["autoparallel ÷ autopar"] == "0.80"  # 4 / 5
    assert ratios["approximate", "wall s"]["runs"] == "2 + 2"
