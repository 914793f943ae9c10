"""The profiler and `autopar profile`: cache reuse, bad caches, bad arguments, and one
2-rank gloo smoke run under torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopar.cli import main
from autopar.costmodels import HardwareProfile
from autopar.costmodels.profiler import Sweep, profile_mesh

REPO = Path(__file__).resolve().parents[1]
TINY = Sweep(
    comm_bytes=(1 << 10, 1 << 16),
    matmul_shapes=((16, 16, 16), (96, 96, 96)),
    low_precision_shapes=((16, 16, 16), (64, 64, 64)),
    pointwise_numel=(1 << 8, 1 << 17),
    kind_numel=(1 << 10, 1 << 16),
    attention_shapes=((1, 2, 32, 16), (2, 4, 128, 32)),
    working_set_bytes=4 << 20,
    repeats=3,
    comm_repeats=3,
    warmup=2,
    min_batch_s=0.001,
)


@pytest.fixture
def one_thread_rank(one_rank):
    """One gloo rank with one intra-op thread, as torchrun runs each rank: on a shared
    2-core machine, intra-op threads left spinning after a parallel op take the core
    from the next timed op (milliseconds instead of microseconds) and break the fits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_profile_is_cached_reused_and_remeasured_when_bad(one_thread_rank, tmp_path, capsys):
    cache = tmp_path / "cache"
    p1, path, measured = profile_mesh((1,), ("dp",), cache_dir=cache, sweep=TINY, progress=False)
    assert measured and path.is_file() and path.parent == cache
    assert p1.backend == "gloo" and p1.mesh_shape == (1,) and p1.axes[0].link == "intra_node"
    assert all(r.rate > 0 for r in p1.device.matmul.values())
    assert p1.axes[0].in_step == {}  # a collective over one rank is free wherever it is called
    p2, _, measured = profile_mesh((1,), ("dp",), cache_dir=cache, sweep=TINY, progress=False)
    assert not measured and p2 == p1
    # a corrupt cache entry is re-measured, with a message saying why
    path.write_text("{oops")
    _, _, measured = profile_mesh((1,), ("dp",), cache_dir=cache, sweep=TINY, progress=False)
    assert measured and "must be JSON" in capsys.readouterr().out
    # a profile written by an older autopar (format version 1) is re-measured
    old = p1.to_dict()
    old["version"] = 1
    path.write_text(json.dumps(old))
    _, _, measured = profile_mesh((1,), ("dp",), cache_dir=cache, sweep=TINY, progress=False)
    assert measured and "format version 1" in capsys.readouterr().out
    # a profile of another machine under this key is re-measured too
    other = HardwareProfile.load(path)
    other.machine = "another-host|cpu"
    other.save(path)
    _, _, measured = profile_mesh((1,), ("dp",), cache_dir=cache, sweep=TINY, progress=False)
    assert measured and "another-host" in capsys.readouterr().out
    # force always measures
    assert profile_mesh((1,), ("dp",), cache_dir=cache, sweep=TINY, progress=False, force=True)[2]


def test_profile_mesh_rejects_a_mesh_of_the_wrong_size(one_thread_rank, tmp_path):
    with pytest.raises(ValueError, match="autopar: mesh \\(2, 2\\) has 4 ranks but 1 processes"):
        profile_mesh((2, 2), cache_dir=tmp_path, sweep=TINY)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["profile", "--mesh", "2y2"], "expected a mesh shape like 4 or 2x2"),
        (["profile", "--bogus"], "unrecognized arguments: --bogus"),
        (["frobnicate"], "invalid choice"),
        ([], "required: COMMAND"),
    ],
)
def test_bad_arguments_give_one_line(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: ") and match in err and err.count("\n") == 1


def test_profile_outside_torchrun_says_how_to_run(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["profile"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: ") and "torchrun" in err and err.count("\n") == 1


def test_two_rank_gloo_profile_under_torchrun(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "autopar.cli",
        "profile",
        "--mesh",
        "2",
        "--names",
        "dp",
        "--quick",
        "--cache-dir",
        str(tmp_path),
        "--out",
        str(tmp_path / "out.json"),
        "--no-progress",
    ]
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "measured and saved" in run.stdout and "| dp | 2 |" in run.stdout and "after compute" in run.stdout
    p = HardwareProfile.load(tmp_path / "out.json")
    assert p.mesh_shape == (2,) and p.backend == "gloo"
    # every collective also timed after compute: fitted, or where the times would not fit
    # the back-to-back fit, saying so
    assert set(p.axes[0].in_step) == set(p.axes[0].collectives)
    for kind, fit in p.axes[0].in_step.items():
        assert fit.source.startswith(("after 2 matmuls 64x64x64", "back to back (after compute")), (kind, fit.source)
        assert fit.alpha_s >= 0 and 0 < fit.beta_bytes_per_s < float("inf")
    for fit in p.axes[0].collectives.values():
        assert fit.alpha_s >= 0 and 0 < fit.beta_bytes_per_s < float("inf")
    assert len(list(tmp_path.glob("*-gloo-2-dp.json"))) == 1
