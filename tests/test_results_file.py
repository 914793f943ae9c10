"""Benchmarks write dated results files (``benchmarks/results_file.py``) that
``benchmarks.summary`` reads back: the file's name and header, the newest file per benchmark,
and the tables of auto_vs_manual and published as summary parses them."""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

import pytest
import torch

from autopar.models import GPT, GPTConfig
from autopar.passes.planner.pinned import Pinned
from benchmarks import auto_vs_manual, published, summary
from benchmarks.results_file import REPO, torchrun, write_results

TABLE = ["| layout | ms |", "|---|---|", "| tp | 1.5 |"]


def header(text: str) -> dict[str, str]:
    """The ``- Key: value`` lines of a results file's header."""
    return dict(line[2:].split(": ", 1) for line in text.splitlines() if line.startswith("- ") and ": " in line)


def test_the_file_is_named_by_benchmark_hardware_and_date_and_says_how_it_was_made(tmp_path):
    path = write_results("generation_speed", "gloo", "Time per token", TABLE, tmp_path,
                         argv=["--layouts", "tp", "--note", "two words"], date=datetime.date(2026, 3, 7))
    assert path == tmp_path / "generation_speed_gloo_20260307.md"
    text = path.read_text()
    assert text.startswith("# Time per token\n")
    fields = header(text)
    assert fields["Command"] == "`python -m benchmarks.generation_speed --layouts tp --note 'two words'`"
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=REPO).stdout.strip()
    assert fields["Commit"].split()[0] == head
    assert f"{os.cpu_count()} CPU cores" in fields["Machine"] and f"torch {torch.__version__}" in fields["Machine"]
    assert fields["Date"] == "2026-03-07"
    assert summary.tables(path) == [[{"layout": "tp", "ms": "1.5"}]]


def test_a_benchmark_started_by_torchrun_says_so(tmp_path):
    path = write_results("save_times", "gloo", "Save times", TABLE, tmp_path, argv=["--dim", "64"],
                         launcher=torchrun(4))
    assert header(path.read_text())["Command"] == \
        "`OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 -m benchmarks.save_times --dim 64`"


def test_a_hardware_name_that_would_break_the_file_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match="autopar: expected a hardware name"):
        write_results("soak", "h100_a100", "Soak", TABLE, tmp_path)
    assert not list(tmp_path.iterdir())


def test_summary_reads_the_newest_date_of_each_benchmark(tmp_path):
    def write(benchmark: str, hardware: str, day: int):
        return write_results(benchmark, hardware, "t", TABLE, tmp_path, argv=[], date=datetime.date(2026, 11, day))

    write("generation_speed", "gloo", 1)
    newest = write("generation_speed", "gloo", 28)
    write("generation_speed", "cpu", 15)  # another machine, older: the date decides
    only = write("save_times", "gloo", 2)
    assert summary.newest_results(tmp_path) == {"generation_speed": newest, "save_times": only}


def test_the_auto_vs_manual_table_is_what_summary_reads(tmp_path):
    rows = [{"model": "wide-mlp", "mesh": "gloo-4", "layout": "auto", "vs_best_manual_predicted": 0.987,
             "vs_best_manual_measured": 1.4},
            {"model": "wide-mlp", "mesh": "gloo-4", "layout": "dp", "vs_best_manual_predicted": 1.2},
            {"model": "wide-mlp", "mesh": "h100-8", "layout": "auto", "vs_best_manual_predicted": 1.0}]
    report = {"meta": {"meshes": ["gloo-4", "h100-8"], "models": ["wide-mlp", "gpt2"]}, "rows": rows}
    path = write_results("auto_vs_manual", auto_vs_manual.hardware(report["meta"]["meshes"]), "t",
                         auto_vs_manual.grid(report), tmp_path, argv=["--quick"])
    assert path.name.startswith("auto_vs_manual_gloo-h100_")
    assert summary.auto_vs_manual(path) == [
        ["training wide-mlp: gloo-4, h100-8", "0.99, 1.00", "—", "—",
         "`python -m benchmarks.auto_vs_manual --models wide-mlp`"],
        ["training gpt2: gloo-4, h100-8", "–, –", "—", "—", "`python -m benchmarks.auto_vs_manual --models gpt2`"]]
    assert "| training wide-mlp: gloo-4, h100-8 | 0.99, 1.00 |" in summary.render(tmp_path)


def test_the_published_table_is_what_summary_reads(tmp_path):
    def tiny_gpt() -> GPT:
        return GPT(GPTConfig(vocab_size=256, max_seq_len=64, dim=64, n_heads=4, n_layers=4))

    row = published.Row(key="tiny", source="test", build=tiny_gpt, gpus=8, batch=16, seq=64, mesh=(8,),
                        pinned=Pinned(layout="dp"), layout_text="DP 8", tflops_per_gpu=1.0)
    r = published.evaluate(row, time_limit_s=3.0, dry_run=False, auto_plan=False)
    path = write_results("published", "h100", "t", published.table([r]).splitlines(), tmp_path, argv=["--no-auto"])
    assert summary.published(path) == [["training tiny: 8 H100s, DP 8", "—", f"{r['ratio']:.2f}", "—",
                                        "`python -m benchmarks.published --rows tiny`"]]


def test_the_gpu_measurements_are_what_summary_reads():
    """The committed one-GPU file: each training row's measured / predicted and each serving
    row's time to first token and per output token (the decode step as the runtime runs it on
    a GPU: a CUDA graph), one summary row each, on the file's device."""
    path = summary.RESULTS / "gpu_one_device_h200_20261129.md"
    rows = summary.gpu_one_device(path)
    train, serve = [r for r in rows if r[0].startswith("training")], [r for r in rows if r[0].startswith("serving")]
    assert len(train) == 4 and len(serve) == 8 and all("one H200" in r[0] for r in rows)
    graphed = [r for t in summary.tables(path) for r in t if r.get("decode step run") == "CUDA graph"]
    assert [r[3] for r in serve] == [r[f"{what} measured / predicted"] for r in graphed for what in ("TTFT", "TPOT")]
    for r in graphed:
        for what in ("TTFT", "TPOT"):
            ratio = float(r[f"measured {what}"].split()[0]) / float(r[f"predicted {what}"].split()[0])
            assert abs(ratio - float(r[f"{what} measured / predicted"])) <= 0.006
    measured = [r for t in summary.tables(path) for r in t if "measured step" in r]
    assert [r[3] for r in train] == [r["measured / predicted"] for r in measured]
    for r in measured:  # the ratio column is the ratio of the times beside it
        ratio = float(r["measured step"].split()[0]) / float(r["predicted step"].split()[0])
        assert abs(ratio - float(r["measured / predicted"])) <= 0.006


def test_every_benchmark_writes_its_results_file():
    """Every module of benchmarks/ that is a benchmark (it runs as ``python -m``) writes its table
    through ``write_results``; the helpers it imports are not benchmarks."""
    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    helpers = {"__init__.py", "results_file.py", "summary.py", "costmodel_ops.py", "costmodel_worker.py"}
    silent = [f.name for f in sorted(folder.glob("*.py"))
              if f.name not in helpers and "write_results(" not in f.read_text()]
    assert not silent, f"benchmarks that write no dated results file: {silent}"
    assert all((folder / name).is_file() for name in helpers)
