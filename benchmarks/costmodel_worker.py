"""One world size of the cost-model accuracy benchmark (run by costmodel_accuracy.py).

    torchrun --standalone --nproc_per_node N benchmarks/costmodel_worker.py --out rows.json

On N gloo ranks: measure a fresh profile (1-D mesh), then predict and measure
(1) every collective at message sizes the fit did not use, (2) matmuls and pointwise
ops of the benchmark GPT's shapes, (3) a whole training step of that GPT under DP
(DDP), TP (parallelize_module, Megatron MLP) and ZeRO-3 (FSDP2 fully_shard).
Rank 0 writes the rows (predicted and measured seconds), the profiles and the load
average along the way as JSON. Collectives and ops are predicted from the first
profile; the steps from the same profile measured again just before them (the load on
a shared machine drifts within minutes); the difference between the two profiles is
the machine's own noise floor.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from costmodel_ops import OpRecorder  # noqa: E402

from autopar.models import GPT, GPTConfig  # noqa: E402
from costmodels import collective_time, compute_time  # noqa: E402
from costmodels.comm import Step  # noqa: E402
from costmodels.profile import COLLECTIVES  # noqa: E402
from costmodels.profiler import Sweep, measure_profile, profile_mesh  # noqa: E402
from costmodels.step import adamw_ops, step_time  # noqa: E402
from costmodels.timing import (  # noqa: E402
    WORKING_SET_BYTES,
    median_time,
    rotating,
    time_collective,
    time_matmul,
    time_pointwise,
)

CFG = GPTConfig(vocab_size=256, max_seq_len=128, dim=256, n_heads=8, n_layers=2)
GLOBAL_BATCH = 16
# between the profiler's fitted sizes (4 KiB .. 4 MiB, powers of 4): none was fitted
HELD_OUT_BYTES = (1 << 13, 1 << 15, 1 << 17, 1 << 19, 1 << 21)
# DDP's bucket caps (torch/nn/parallel/distributed.py): first bucket 1 MiB, then 25 MiB
DDP_FIRST_BUCKET, DDP_BUCKET = dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 1024 * 1024


def _max_over_ranks(t: float) -> float:
    x = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return float(x)


def bench_collectives(profile, group, rows: list, repeats: int) -> None:
    n = dist.get_world_size()
    if n == 1:  # nothing to communicate: a 1-rank run checks compute and steps only
        return
    for kind in COLLECTIVES:
        for nbytes in HELD_OUT_BYTES:
            actual = max(n, nbytes // 4 // n * n) * 4  # the buffer collective_call builds
            measured = time_collective(kind, group, nbytes, torch.device("cpu"), repeats, 2)
            rows.append(
                dict(
                    kind="collective",
                    name=f"{kind} {actual} B",
                    group=kind,
                    predicted=collective_time(kind, actual, 0, profile),
                    measured=measured,
                )
            )


def bench_ops(profile, rows: list, repeats: int) -> None:
    n = dist.get_world_size()
    d, v = CFG.dim, CFG.vocab_size
    h = CFG.mlp_ratio * d
    t_dp = GLOBAL_BATCH // n * CFG.max_seq_len  # tokens per rank under DP / ZeRO-3
    t_all = GLOBAL_BATCH * CFG.max_seq_len  # tokens per rank under TP
    mm = [(t_dp, d, d), (t_dp, d, h), (t_dp, h, d), (t_dp, d, v), (t_all, d, h // n), (t_all, h // n, d)]
    for m, k, nn in mm:
        for dtype, layout in (("fp32", "nn"), ("fp32", "nt"), ("fp32", "tn"), ("bf16", "nt")):
            # timed as the profiler times its sweep (cold operands, slowest rank), at shapes
            # the sweep did not use
            meas = time_matmul(m, k, nn, dtype, torch.device("cpu"), repeats, 2, layout=layout)
            nb = (m * k + k * nn + m * nn) * (4 if dtype == "fp32" else 2)
            rows.append(
                dict(
                    kind="op",
                    name=f"matmul {dtype} {layout} {m}x{k}x{nn}",
                    group="matmul",
                    predicted=compute_time(2 * m * k * nn, nb, dtype, profile),
                    measured=meas,
                )
            )
    for name, numel, tensors in (
        ("gelu", t_dp * h, 2),
        ("add", t_dp * d, 3),
        ("gelu", t_all * h // n, 2),
        ("add", t_all * d, 3),
    ):
        if name == "add":
            meas = time_pointwise(numel, "fp32", torch.device("cpu"), repeats, 2)
        else:
            nxt = rotating(lambda: torch.randn(numel), 2 * numel * 4, WORKING_SET_BYTES)
            meas = _max_over_ranks(median_time(lambda: F.gelu(nxt()), torch.device("cpu"), repeats, 2))
        rows.append(
            dict(
                kind="op",
                name=f"{name} fp32 {numel}",
                group="pointwise",
                predicted=compute_time(0, numel * tensors * 4, "fp32", profile),
                measured=meas,
            )
        )


def _loss(model, tokens):
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1))


def _numel_local(p) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def _padded_shard_bytes(params, n: int) -> int:
    """FSDP2 pads each parameter's dim 0 to a multiple of N before sharding it."""
    return sum(math.ceil(p.shape[0] / n) * n * (p.numel() // p.shape[0]) * 4 for p in params)


def build(layout: str, mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = GPT(CFG)
    n = dist.get_world_size()
    fwd, extra = [], []
    if layout == "DP":
        sizes = [p.numel() * 4 for p in reversed(list(model.parameters()))]
        bucket, cap = 0, DDP_FIRST_BUCKET
        for s in sizes:  # DDP fills buckets in reverse parameter order
            if bucket and bucket + s > cap:
                extra.append(Step("all_reduce", 0, bucket))
                bucket, cap = 0, DDP_BUCKET
            bucket += s
        extra.append(Step("all_reduce", 0, bucket))
        wrapped = DDP(model)
    elif layout == "TP":
        for blk in model.blocks:
            parallelize_module(blk.mlp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            # Megatron's g: all-reduce of the (batch, seq, dim) output of the row-parallel
            # layer; its dual (f: all-reduce of the input gradient) comes in backward
            fwd.append(Step("all_reduce", 0, GLOBAL_BATCH * CFG.max_seq_len * CFG.dim * 4))
        wrapped = model
    elif layout == "ZeRO-3":
        for blk in model.blocks:
            fwd.append(Step("all_gather", 0, _padded_shard_bytes(list(blk.parameters()), n)))
            extra.append(Step("all_gather", 0, _padded_shard_bytes(list(blk.parameters()), n)))
            fully_shard(blk, mesh=mesh)
        rest = [p for name, p in model.named_parameters() if not name.startswith("blocks.")]
        fwd.append(Step("all_gather", 0, _padded_shard_bytes(rest, n)))  # root: not resharded
        fully_shard(model, mesh=mesh)
        wrapped = model
    else:
        raise ValueError(layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return wrapped, model, opt, fwd, extra


def _timed(fn, steps: int) -> float:
    """Median seconds of ``fn`` after a barrier, the slowest rank's."""
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return _max_over_ranks(times[len(times) // 2])


def bench_step(layout: str, profile, mesh, steps: int) -> dict:
    """Predict, then measure, one training step of the GPT under ``layout``."""
    n = dist.get_world_size()
    wrapped, model, opt, fwd, extra = build(layout, mesh)
    batch = GLOBAL_BATCH if layout == "TP" else GLOBAL_BATCH // n
    g = torch.Generator().manual_seed(1 + (0 if layout == "TP" else dist.get_rank()))
    tokens = torch.randint(0, CFG.vocab_size, (batch, CFG.max_seq_len), generator=g)

    def one_step() -> None:
        opt.zero_grad(set_to_none=True)
        _loss(wrapped, tokens).backward()
        opt.step()

    def forward_only() -> None:
        with torch.no_grad():
            _loss(wrapped, tokens)

    for _ in range(2):
        one_step()
    with OpRecorder() as rec:
        forward_only()
    pred = step_time(
        rec.ops,
        profile,
        forward_comm=fwd,
        backward_extra=extra,
        optimizer_ops=adamw_ops([_numel_local(p) for p in model.parameters()]),
    )
    measured = _timed(one_step, steps)
    forward = _timed(forward_only, steps)
    dist.barrier()
    return dict(
        kind="step",
        name=f"GPT step {layout}",
        group=layout,
        predicted=pred.total,
        measured=measured,
        breakdown=pred.to_dict(),
        forward_ops=len(rec.ops),
        measured_forward=forward,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=7)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    with tempfile.TemporaryDirectory() as tmp:
        profile, _, _ = profile_mesh(
            None,
            ("world",),
            cache_dir=args.cache_dir or tmp,
            force=args.cache_dir is None,
            sweep=Sweep(),
            progress=False,
        )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("world",))
    rows: list = []
    load = {"after profile": os.getloadavg()[0]}
    bench_collectives(profile, mesh.get_group(0), rows, args.repeats)
    bench_ops(profile, rows, args.repeats)
    # The load on a shared machine drifts within minutes, so the steps are predicted from
    # the same profile measured again just before them; the drift between the two
    # profiles is reported as the machine's noise floor.
    again = measure_profile(mesh, Sweep(), progress=False)
    load["before steps"] = os.getloadavg()[0]
    rows += [bench_step(layout, again, mesh, args.steps) for layout in ("DP", "TP", "ZeRO-3")]
    load["after steps"] = os.getloadavg()[0]
    if dist.get_rank() == 0:
        Path(args.out).write_text(
            json.dumps(
                {
                    "ranks": dist.get_world_size(),
                    "rows": rows,
                    "load": load,
                    "profile": profile.to_dict(),
                    "profile_again": again.to_dict(),
                },
                indent=1,
            )
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
