"""The profiler and `autopar profile`: cache reuse, bad caches, bad arguments, and one
4-rank gloo smoke run under torchrun."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopar.cli import main
from autopar.costmodels import HardwareProfile, MissingRates, ProfileError
from autopar.costmodels.compute import rates
from autopar.costmodels.profiler import Sweep, _twin, profile_mesh

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


def test_a_profile_measures_the_dtypes_asked_and_adds_others_when_asked(one_thread_rank, tmp_path):
    cache = tmp_path / "cache"
    p1, path, measured = profile_mesh((1,), ("dp",), cache_dir=cache, sweep=TINY, progress=False, dtypes=["fp32"])
    assert measured and p1.device.dtypes == ("fp32",) and "bf16" not in p1.device.attention["forward"]
    assert rates("aten.mm.default", "fp32", p1)[0].rate > 0
    with pytest.raises(MissingRates, match="no bf16 rates \\(it measured fp32\\).*--dtypes fp32 bf16") as err:
        rates("aten.mm.default", "bf16", p1)
    assert pickle.loads(pickle.dumps(err.value)).dtype == "bf16"  # a planning worker's error reaches the planner
    # fp32 is measured whatever is asked: optimizers step in it
    assert profile_mesh((1,), ("dp",), cache_dir=cache, sweep=TINY, progress=False, dtypes=[])[2] is False
    p2, _, measured = profile_mesh((1,), ("dp",), cache_dir=cache, sweep=TINY, progress=False, dtypes=["bf16"])
    assert measured and p2.device.dtypes == ("fp32", "bf16") and rates("aten.mm.default", "bf16", p2)[0].rate > 0
    assert p2.device.matmul["fp32"] == p1.device.matmul["fp32"] and p2.axes == p1.axes  # only bf16 measured
    assert "bf16 added" in p2.source and HardwareProfile.load(path) == p2
    p3, _, measured = profile_mesh((1,), ("dp",), cache_dir=cache, sweep=TINY, progress=False, dtypes=["bf16"])
    assert not measured and p3 == p2
    with pytest.raises(ProfileError, match="cannot profile dtypes \\['fp64'\\]"):
        profile_mesh((1,), ("dp",), cache_dir=cache, sweep=TINY, progress=False, dtypes=["fp64"])


def test_only_cpu_axes_of_one_host_and_one_size_share_their_fits():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    links = ["intra_node", "intra_node", "intra_node"]
    assert [_twin(i, (2, 2, 4), links, cpu) for i in range(3)] == [None, 0, None]
    assert [_twin(i, (2, 2, 4), links, gpu) for i in range(3)] == [None, None, None]
    assert _twin(1, (2, 2), ["intra_node", "inter_node"], cpu) is None
    assert _twin(1, (1, 1), links[:2], cpu) is None  # nothing to measure on an axis of one rank


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


def test_four_rank_gloo_profile_under_torchrun(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "4",
        "-m",
        "autopar.cli",
        "profile",
        "--mesh",
        "2x2",
        "--names",
        "dp,tp",
        "--quick",
        "--dtypes",
        "fp32",
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
    assert p.mesh_shape == (2, 2) and p.backend == "gloo" and p.device.dtypes == ("fp32",)
    # the second axis rides the same host's memory as the first: its fits are the first's
    dp, tp = p.axes
    for kind in dp.collectives:
        assert tp.collectives[kind].alpha_s == dp.collectives[kind].alpha_s
        assert tp.collectives[kind].source == f"as mesh axis 'dp' (same size, same host): {dp.collectives[kind].source}"
        assert tp.in_step[kind].beta_bytes_per_s == dp.in_step[kind].beta_bytes_per_s
    # every collective also timed after compute: fitted, or where the times would not fit
    # the back-to-back fit, saying so
    assert set(p.axes[0].in_step) == set(p.axes[0].collectives)
    for kind, fit in p.axes[0].in_step.items():
        assert fit.source.startswith(("after 2 matmuls 64x64x64", "back to back (after compute")), (kind, fit.source)
        assert fit.alpha_s >= 0 and 0 < fit.beta_bytes_per_s < float("inf")
    for fit in p.axes[0].collectives.values():
        assert fit.alpha_s >= 0 and 0 < fit.beta_bytes_per_s < float("inf")
    assert len(list(tmp_path.glob("*-gloo-2x2-dp-tp.json"))) == 1


class _CastsInside(torch.nn.Module):
    """fp32 weights whose matmul runs in bf16: only planning finds that dtype."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.nn.functional.linear(x.to(torch.bfloat16), self.lin.weight.to(torch.bfloat16)).float()


def test_a_compile_measures_the_dtypes_its_model_computes_in(one_thread_rank, one_rank, tmp_path, monkeypatch):
    import autopar.compiler as compiler
    from torch.distributed.fsdp import MixedPrecisionPolicy

    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    assert compiler.compute_dtypes(lin, (x,)) == ("fp32",)
    assert compiler.compute_dtypes(lin, (x,), MixedPrecisionPolicy(param_dtype=torch.bfloat16)) == ("fp32", "bf16")
    assert compiler.compute_dtypes(lin.to(torch.float16), (x.long(),)) == ("fp32", "fp16")

    asked = []

    def tiny_profile(*args, **kw):
        asked.append(tuple(kw["dtypes"]))
        return profile_mesh(*args, **kw, cache_dir=tmp_path / "cache", sweep=TINY)

    monkeypatch.setattr(compiler, "profile_mesh", tiny_profile)
    plan = compiler.plan_once(_CastsInside(), one_rank, (torch.randn(8, 16),), time_limit_s=5)
    assert asked == [("fp32",), ("fp32", "bf16")]  # bf16 found by planning, measured, then planned again
    assert tuple(plan.mesh_shape) == (1,)
