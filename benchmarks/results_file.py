"""A benchmark's results file: ``benchmarks/results/<benchmark>_<hardware>_<yyyymmdd>.md``.

Each file holds the benchmark's tables under a header that says how to make them again: the
exact command, the commit (and whether the tree had uncommitted changes), the machine and the
date. ``benchmarks.summary`` reads the newest file of each benchmark into the README's table.
Raw artefacts (JSON, charts) stay in the gitignored ``results/``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = RESULTS_DIR.parents[1]


def add_out_argument(parser: argparse.ArgumentParser, flag: str = "--out") -> None:
    """The option naming the folder the results file goes to (default ``benchmarks/results``)."""
    parser.add_argument(flag, type=Path, default=RESULTS_DIR, metavar="DIR",
                        help="folder of the dated results file <benchmark>_<hardware>_<yyyymmdd>.md "
                             "(default: benchmarks/results)")


def results_name(benchmark: str, hardware: str, date: datetime.date) -> str:
    if not re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", hardware):
        raise ValueError(f"autopar: expected a hardware name of lower-case letters, digits, '.', '+' and '-' "
                         f"(e.g. 'gloo', 'h100-a100'); found {hardware!r}; pass one without '_' or spaces")
    return f"{benchmark}_{hardware}_{date:%Y%m%d}.md"


def command(benchmark: str, argv: list[str] | None = None, launcher: str = "python") -> str:
    """The command line that ran the benchmark: ``argv`` (default ``sys.argv[1:]``) after its module."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join([launcher, "-m", shlex.join([f"benchmarks.{benchmark}", *map(str, args)])])


def torchrun(ranks: int) -> str:
    """The launcher of a benchmark started on its gloo ranks by torchrun."""
    return f"OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node {ranks}"


def commit() -> str:
    """The short commit hash, with a note when the working tree differs from it."""
    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO)
        return run.stdout.strip() if run.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown (not a git checkout)"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"{head} (with uncommitted changes)" if dirty else head


def machine() -> str:
    """Platform, CPU cores, torch version and GPUs (if any) of this machine."""
    import torch

    parts = [f"{platform.system()} {platform.machine()}", f"{os.cpu_count()} CPU cores", f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        parts.append(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    else:
        parts.append("no GPU")
    if os.environ.get("OMP_NUM_THREADS"):
        parts.append(f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    return ", ".join(parts)


def write_results(benchmark: str, hardware: str, title: str, lines: list[str], out_dir: Path | str = RESULTS_DIR,
                  argv: list[str] | None = None, date: datetime.date | None = None, launcher: str = "python") -> Path:
    """Write ``lines`` (the tables) under the header to ``out_dir``; returns the file's path.

    ``benchmark`` is the module's name in ``benchmarks/``; ``hardware`` what the numbers are of
    (``gloo``: ranks of this machine; ``h100``: the preset; ``cpu``: this machine's wall time);
    ``launcher`` what ran the module (``torchrun ...`` for a benchmark started on its ranks).
    """
    date = date or datetime.date.today()
    header = [f"# {title}", "",
              f"- Command: `{command(benchmark, argv, launcher)}`",
              f"- Commit: {commit()}",
              f"- Machine: {machine()}",
              f"- Date: {date:%Y-%m-%d}", ""]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / results_name(benchmark, hardware, date)
    path.write_text("\n".join(header + list(lines)).rstrip("\n") + "\n")
    print(f"written: {path}", file=sys.stderr)
    return path
