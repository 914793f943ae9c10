"""How long a first ``autopar.compile`` on a fresh machine spends measuring the mesh.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 -m benchmarks.profile_speed \
        [--mesh 2x2] [--dtypes fp32 ...] [--rounds 2] [--out DIR]

Runs on the gloo ranks torchrun starts. Each round measures the profile into an empty cache
twice, the default sweep and ``Sweep.thorough()`` in turns (A B A B), with the compute dtypes
given (``autopar.compile`` measures those its model is seen to use: fp32 for an fp32 model,
and ``param_dtype`` under a mixed-precision policy); then one whole ``autopar.compile`` of the
demo's GPT on an empty cache, the share of it spent profiling apart. The cost model's accuracy
under each sweep is ``benchmarks.costmodel_accuracy --sweep``'s to tell. ``--out DIR`` writes
the table to ``profile_speed_gloo_<yyyymmdd>.md`` there (``benchmarks.results_file``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.costmodels.profile import DTYPES
from autopar.costmodels.profiler import Sweep, profile_mesh
from benchmarks.results_file import torchrun, write_results

SWEEPS = {"default": Sweep, "thorough": Sweep.thorough}


def _profile_seconds(shape: tuple[int, ...], names: tuple[str, ...], sweep: str, dtypes: list[str]) -> float:
    with tempfile.TemporaryDirectory() as cache:
        dist.barrier()
        started = time.perf_counter()
        profile_mesh(shape, names, cache_dir=cache, sweep=SWEEPS[sweep](), dtypes=dtypes, progress=False)
        return time.perf_counter() - started


def _compile_seconds(shape: tuple[int, ...], names: tuple[str, ...]) -> tuple[float, float]:
    """A whole first ``autopar.compile`` of the demo GPT (fp32) on an empty cache: its
    seconds and those of the profile it measured."""
    import autopar
    from autopar import compiler
    from autopar.demo import GPT_FAMILY, GPT_SIZE
    from torch.distributed.device_mesh import init_device_mesh

    profiled = [0.0]
    real = compiler.profile_mesh

    def timed(*args, **kw):
        started = time.perf_counter()
        out = real(*args, **kw)
        profiled[0] += time.perf_counter() - started
        return out

    torch.manual_seed(0)
    model = GPT_FAMILY.build(GPT_SIZE)
    (tokens,), _ = GPT_FAMILY.inputs(GPT_SIZE, generator=torch.Generator().manual_seed(0))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["AUTOPAR_CACHE_DIR"] = cache
        compiler.profile_mesh = timed
        try:
            dist.barrier()
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                autopar.compile(model, mesh, (tokens,), loss_fn=lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten()),
                                optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
            return time.perf_counter() - started, profiled[0]
        finally:
            compiler.profile_mesh = real
            del os.environ["AUTOPAR_CACHE_DIR"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="2x2", help="mesh shape, e.g. 2x2 (its sizes multiply to the ranks)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32"], choices=DTYPES)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, metavar="DIR", help="folder of the dated results file")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("autopar: benchmarks.profile_speed runs on gloo ranks; start it with "
                         f"`{torchrun(4)} -m benchmarks.profile_speed`")
    dist.init_process_group("gloo")
    shape = tuple(int(n) for n in args.mesh.split("x"))
    names = ("dp", "tp", "pp")[:len(shape)]
    seconds: dict[str, list[float]] = {name: [] for name in SWEEPS}
    for _ in range(args.rounds):
        for name in SWEEPS:
            seconds[name].append(_profile_seconds(shape, names, name, args.dtypes))
    whole, profiled = _compile_seconds(shape, names)
    if dist.get_rank() == 0:
        fast, slow = (statistics.median(seconds[n]) for n in SWEEPS)
        lines = [f"{dist.get_world_size()} gloo ranks on {os.cpu_count()} cores, mesh {args.mesh}, compute dtypes "
                 f"{' '.join(args.dtypes)}, {args.rounds} rounds in turns; load average at the end "
                 f"{os.getloadavg()[0]:.1f}.", "",
                 "| sweep | profile s, each round | median s |", "|---|---|---|"]
        lines += [f"| {n} | {', '.join(f'{t:.1f}' for t in seconds[n])} | {statistics.median(seconds[n]):.1f} |"
                  for n in SWEEPS]
        lines += ["", f"Thorough / default: {slow / fast:.2f}.", "",
                  f"A first `autopar.compile` of the demo GPT (fp32) on an empty cache: {whole:.1f} s, of which "
                  f"the profile {profiled:.1f} s."]
        print("\n".join(lines))
        if args.out:
            write_results("profile_speed", "gloo", "Profiling speed", lines, args.out,
                          sys.argv[1:] if argv is None else argv, launcher=torchrun(dist.get_world_size()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
