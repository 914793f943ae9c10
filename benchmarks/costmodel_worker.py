"""One world size of the cost-model accuracy benchmark (run by costmodel_accuracy.py).

    torchrun --standalone --nproc_per_node N -m benchmarks.costmodel_worker --out rows.json

On N gloo ranks: measure a fresh profile (1-D mesh) and, right after each of its fits,
time the same quantity where the fit did not: (1) every collective at message sizes
between the fitted ones, (2) matmuls, pointwise kinds and attention at the benchmark
GPT's shapes. A shared machine's load drifts within minutes, so each held-out row is
timed seconds after its fit, not minutes. Then (3) a whole training step of that GPT,
right after the collectives and fp32 compute are fitted: autopar's own compiled step
(``autopar.compile``) of its DP, Megatron TP and ZeRO-3 plans (``autopar.plan(...,
layout=)``, planned against the profile just measured, predicted by the planner's own
cost tables: ``plan.predicted``), DP and ZeRO-3 again with steps accumulating 2
micro-batches (``accumulate=2``), and the three layouts written by hand with
torch's tools (DDP; parallelize_module on the MLPs; FSDP2 fully_shard), predicted by
``autopar.costmodels.step_time`` from their op inventory; all take turns, step by step, so
that all see the same load. Last, the fp32 matmul and all-reduce fits are measured
again: their drift over the run is the noise floor. Rank 0 writes the rows (predicted
and measured seconds), the profile, the drift and the load average along the way as
JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F


from benchmarks.costmodel_ops import OpRecorder

import autopar
from autopar.models import GPT, GPTConfig
from autopar.passes.plan import Plan
from autopar.costmodels import collective_time, compute_time
from autopar.costmodels.comm import FIRST_GRADIENT_BUCKET_BYTES, GRADIENT_BUCKET_BYTES
from autopar.costmodels.comm import Step
from autopar.costmodels.fit import fit_linear
from autopar.costmodels.formulas import BUS_FACTOR, N
from autopar.costmodels.profiler import ATTENTION_BACKWARD_FLOPS, Sweep, measure_profile
from autopar.costmodels.step import adamw_ops, step_time
from autopar.costmodels.timing import (
    MATMUL_LAYOUTS,
    WORKING_SET_BYTES,
    OperandPool,
    attention_calls,
    attention_flops,
    collective_call,
    matmul_call,
    pointwise_bytes_moved,
    pointwise_call,
    timed,
)

CFG = GPTConfig(vocab_size=256, max_seq_len=128, dim=256, n_heads=8, n_layers=2)
GLOBAL_BATCH = 16
LAYOUTS = ("DP", "TP", "ZeRO-3")
# autopar's layouts (autopar.layouts) of the same three, and two of them with steps accumulating
# 2 micro-batches of the batch (``autopar.plan(..., accumulate=2)``): label -> (layout name, accumulate)
COMPILED = {"DP": ("dp", 1), "TP": ("tp", 1), "ZeRO-3": ("fsdp", 1), "DP, 2 accumulated": ("dp", 2),
            "ZeRO-3, 2 accumulated": ("fsdp", 2)}
# between the profiler's fitted sizes (4 KiB .. 4 MiB, powers of 4): none was fitted
HELD_OUT_BYTES = (1 << 13, 1 << 15, 1 << 17, 1 << 19, 1 << 21)
# DDP's bucket caps (torch/nn/parallel/distributed.py): first bucket 1 MiB, then 25 MiB
DDP_FIRST_BUCKET, DDP_BUCKET = FIRST_GRADIENT_BUCKET_BYTES, GRADIENT_BUCKET_BYTES  # DDP's defaults (costmodels.comm)
CPU = torch.device("cpu")


def _max_over_ranks(t: float) -> float:
    x = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return float(x)


class HeldOut:
    """``measure_profile``'s ``on_fit`` hook: right after a fit, time the same quantity at
    sizes the fit did not use; ``rows(profile)`` then predicts them from the profile."""

    def __init__(self, mesh, repeats: int, steps: int, collective_repeats: int):
        self.mesh, self.group, self.repeats, self.steps = mesh, mesh.get_group(0), repeats, steps
        self.collective_repeats = collective_repeats
        self.measured_steps: dict = {}
        self.loads: dict[str, float] = {}
        self.steps_s = 0.0
        self.timed: list[dict] = []  # name, group, what to predict, measured
        n = dist.get_world_size()
        d, v, h = CFG.dim, CFG.vocab_size, CFG.mlp_ratio * CFG.dim
        self.t_dp = GLOBAL_BATCH // n * CFG.max_seq_len  # tokens per rank under DP / ZeRO-3
        self.t_all = GLOBAL_BATCH * CFG.max_seq_len  # tokens per rank under TP
        t_dp, t_all = self.t_dp, self.t_all
        self.matmuls = [(t_dp, d, d), (t_dp, d, h), (t_dp, h, d), (t_dp, d, v), (t_all, d, h // n),
                        (t_all, h // n, d)]
        self.pointwise = {  # kind -> the GPT's sizes of it, per rank (the sweep's are not these)
            "gelu": sorted({t_dp * h, t_all * h // n}),
            "gelu_backward": sorted({t_dp * h, t_all * h // n}),
            "memory": sorted({t_dp * d, t_all * d}),  # the residual add
            "layer_norm": (t_dp * d,),
            "layer_norm_backward": (t_dp * d,),
            "softmax": (t_dp * v,),  # the loss's log_softmax over the vocabulary
        }
        self.pool = OperandPool(CPU)

    def __call__(self, what: str, key: tuple) -> None:
        handler = getattr(self, f"_{what}", None)  # the sync stretch has no held-out row: the steps test it
        if handler is not None:
            handler(*key)

    def _fp32(self, profile) -> None:
        """Every collective and fp32 compute are fitted: plan, compile and time the training
        steps now (``profile``: what is measured so far, enough for an fp32 model)."""
        self.pool.release("fp32")
        self.loads["before steps"] = os.getloadavg()[0]
        started = time.perf_counter()
        self.measured_steps = measure_steps(self.mesh, self.steps, profile)
        self.loads["after steps"] = os.getloadavg()[0]
        self.steps_s = time.perf_counter() - started

    def _add(self, name: str, group: str, predict: tuple, measured: float) -> None:
        self.timed.append(dict(name=name, group=group, predict=predict, measured=measured))

    def _collective(self, axis: int, kind: str) -> None:
        n = dist.get_world_size()
        calls = [collective_call(kind, self.group, nbytes, CPU) for nbytes in HELD_OUT_BYTES]
        # more batches than the fit took: under time sharing one collective's time moves
        # with the scheduler; the median of many is the held-out value
        times = timed(calls, CPU, self.collective_repeats, 2, group=self.group)
        for nbytes, meas in zip(HELD_OUT_BYTES, times):
            actual = max(n, nbytes // 4 // n * n) * 4  # the buffer collective_call builds
            self._add(f"{kind} {actual} B", kind, ("collective", kind, actual), meas)

    def _matmul(self, dtype: str) -> None:
        for other in [d for d in self.pool.pools if d != dtype]:  # the profiler moved on to this dtype
            self.pool.release(other)
        layouts = {"fp32": MATMUL_LAYOUTS, "bf16": ("nt",)}.get(dtype, ())
        shapes = [(m, k, nn, layout) for m, k, nn in self.matmuls for layout in layouts]
        times = timed([matmul_call(m, k, n, dtype, lay, self.pool) for m, k, n, lay in shapes], CPU, self.repeats, 2)
        for (m, k, nn, layout), meas in zip(shapes, times):
            nb = (m * k + k * nn + m * nn) * (4 if dtype == "fp32" else 2)
            self._add(f"matmul {dtype} {layout} {m}x{k}x{nn}", "matmul",
                      ("compute", 2 * m * k * nn, nb, dtype, "matmul"), meas)

    def _pointwise(self, kind: str, dtype: str) -> None:
        sizes = self.pointwise.get(kind, ()) if dtype == "fp32" else ()
        if not sizes:
            return
        times = timed([pointwise_call(kind, numel, dtype, self.pool) for numel in sizes], CPU, self.repeats, 2)
        for numel, meas in zip(sizes, times):
            self._add(f"{kind} {dtype} {numel}", "pointwise",
                      ("compute", 0, pointwise_bytes_moved(kind, numel, dtype), dtype, kind), meas)

    def _attention(self, dtype: str) -> None:
        if dtype != "fp32":
            return
        hd = CFG.dim // CFG.n_heads
        shapes = [(b, CFG.n_heads, CFG.max_seq_len, hd) for b in sorted({GLOBAL_BATCH // dist.get_world_size(),
                                                                           GLOBAL_BATCH})]  # DP, TP (replicated)
        calls = [c for shape in shapes for c in attention_calls(shape, dtype, CPU, WORKING_SET_BYTES // 4)]
        times = timed(calls, CPU, self.repeats, 2)
        for shape, fwd, bwd in zip(shapes, times[0::2], times[1::2]):
            flops, nbytes, heads = attention_flops(*shape), 4 * math.prod(shape) * 4, shape[0] * shape[1]
            name = "x".join(map(str, shape))
            self._add(f"attention forward {dtype} {name}", "attention",
                      ("compute", flops, nbytes, dtype, "attention", heads), fwd)
            self._add(f"attention backward {dtype} {name}", "attention",
                      ("compute", ATTENTION_BACKWARD_FLOPS * flops, 2 * nbytes, dtype, "attention_backward", heads),
                      bwd)

    def rows(self, profile) -> list[dict]:
        out = []
        for t in self.timed:
            how, *args = t["predict"]
            pred = collective_time(args[0], args[1], 0, profile) if how == "collective" else compute_time(
                *args[:3], profile, *args[3:])
            kind = "collective" if how == "collective" else "op"
            out.append(dict(kind=kind, name=t["name"], group=t["group"], predicted=pred, measured=t["measured"]))
        return out


def _loss(model, tokens):
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1))


def _numel_local(p) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def _padded_shard_bytes(params, n: int) -> int:
    """FSDP2 pads each parameter's dim 0 to a multiple of N before sharding it."""
    return sum(math.ceil(p.shape[0] / n) * n * (p.numel() // p.shape[0]) * 4 for p in params)


def _loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def build_compiled(label: str, mesh, profile):
    """autopar's plan of layout ``COMPILED[label]`` (with its accumulation) for the GPT, planned on rank 0 against
    ``profile`` (the planner's own cost tables price it), and the compiled module. The
    batch is the whole one, the same on every rank; the input check (a small all-reduce
    per step that the plan does not price) is off, as the hand-written side has none."""
    torch.manual_seed(0)
    model = GPT(CFG)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.max_seq_len), generator=gen)
    text = [None]
    if dist.get_rank() == 0:
        layout, accumulate = COMPILED[label]
        text[0] = autopar.plan(model, mesh, (tokens,), hardware=profile, layout=layout,
                               accumulate=accumulate).to_json()
    dist.broadcast_object_list(text, src=0)
    plan = Plan.from_json(text[0])
    # compiled on one micro-batch: the program each of the step's micro-batches runs (and its loss's)
    micro = tokens[:GLOBAL_BATCH // plan.accumulate]
    pm = autopar.compile(model, mesh, (micro,), loss_fn=_loss_fn, optimizer=_adamw, plan=plan, check_inputs=False)
    return pm, plan, tokens


def loss_prediction(pm, profile) -> float:
    """The compiled step's loss program priced by the planner's own cost tables (the plan
    covers the model alone; the runtime lays the loss out from the model's output
    placements, ``autopar.runtime.loss.build_loss_program``): its forward, its backward (the
    model's outputs carry the gradient back) and its collectives, as the runtime lays it."""
    from autopar.runtime.loss import best_target_layout
    from autopar.passes.costing import build_costs
    from autopar.passes.solve import plan_costs
    from autopar.passes.strategy_graph import build_strategy_graph

    cap = pm._loss_captured
    graph = build_strategy_graph(cap, tuple(pm.mesh.shape))
    placeholders = {n.name: n for n in cap.nodes("placeholder")}
    out_specs = [pm.program.output_specs[i] for i in pm.captured.user_outputs]
    fixed = {placeholders[name]: spec for name, spec in zip(cap.user_inputs, out_specs)}
    choice = best_target_layout(graph, fixed, placeholders[cap.user_inputs[-1]])
    costs = build_costs(graph, profile, grad_inputs=cap.user_inputs[:-1])
    return float(plan_costs(costs.problem, costs.assignment(choice)).total_time)


class CollectiveClock:
    """Seconds this thread spends blocked in the torch.distributed collectives autopar's
    runtime calls (``autopar.passes.lowering.collectives``, ``autopar.passes.lowering.buckets``, ``autopar.runtime.gradsync``), while
    active: each call timed, and an asynchronous one's ``wait()``; and each call's kind and
    buffer X (``formulas.COLLECTIVE_BUFFER``) in ``calls``. The module functions are wrapped
    for the duration of a ``with`` block and restored after."""

    # function -> (kind, which argument is X: the tensor reduced, the gathered output, the
    # scattered input, the sent buffer)
    NAMES = {"all_reduce": ("all_reduce", 0), "all_gather_single": ("all_gather", 0),
             "all_gather_into_tensor": ("all_gather", 0), "reduce_scatter_single": ("reduce_scatter", 1),
             "reduce_scatter_tensor": ("reduce_scatter", 1), "all_to_all_single": ("all_to_all", 1),
             "broadcast": ("broadcast", 0)}

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls: list[tuple[str, int]] = []

    def __enter__(self) -> "CollectiveClock":
        self._saved = {name: getattr(dist, name) for name in self.NAMES if hasattr(dist, name)}
        for name, fn in self._saved.items():
            setattr(dist, name, self._timed(fn, *self.NAMES[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def _timed(self, fn, kind: str, position: int):
        clock = self

        class _Work:
            def __init__(self, work):
                self._work = work

            def wait(self, *args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return self._work.wait(*args, **kwargs)
                finally:
                    clock.seconds += time.perf_counter() - t0

            def __getattr__(self, name):
                return getattr(self._work, name)

        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - t0
                x = args[position]
                clock.calls.append((kind, x.numel() * x.element_size()))
            return _Work(out) if kwargs.get("async_op") and out is not None else out

        return call


class _CompiledRun:
    """autopar's compiled step of one layout, timed whole, with its blocked collective time."""

    def __init__(self, pm, plan, tokens):
        self.pm, self.plan, self.tokens = pm, plan, tokens
        self.inventory: dict = {}

    def step(self) -> None:
        self.pm.train_step((self.tokens,), self.tokens)

    def record(self) -> None:
        """One step's ops (forward, backward, optimizer: what autograd and the runtime ran)
        and collectives, for the cost model to price op by op (``step_rows``)."""
        with OpRecorder() as rec, CollectiveClock() as clock:
            self.step()
        self.inventory = dict(ops=rec.ops, collectives=clock.calls + rec.collectives)

    def timed_step(self) -> list[float]:
        """Seconds of the step, and of it blocked in collectives."""
        dist.barrier()
        with CollectiveClock() as clock:
            t0 = time.perf_counter()
            self.step()
            total = time.perf_counter() - t0
        return [total, clock.seconds]


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
            fwd.append(Step("all_reduce", 0, GLOBAL_BATCH * CFG.max_seq_len * CFG.dim * 4, in_step=True))
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


def measure_steps(mesh, steps: int, profile) -> dict:
    """Time one training step of the GPT under each layout, autopar's compiled ones (planned
    against ``profile``) and the hand-written ones, and record what their predictions need:
    the plan for a compiled one; for a hand-written one the forward op inventory, the
    collectives and the parameters. All take turns step by step, so a change of the
    machine's load hits all alike."""
    runs, compiled = {}, {}
    for label in COMPILED:
        pm, plan, tokens = build_compiled(label, mesh, profile)
        run = compiled[label] = _CompiledRun(pm, plan, tokens)
        for _ in range(2):
            run.step()
        run.record()
        run.inventory["loss"] = loss_prediction(pm, profile)  # the loss program exists after a step
    for layout in LAYOUTS:
        wrapped, model, opt, fwd, extra = build(layout, mesh)
        batch = GLOBAL_BATCH if layout == "TP" else GLOBAL_BATCH // dist.get_world_size()
        g = torch.Generator().manual_seed(1 + (0 if layout == "TP" else dist.get_rank()))
        tokens = torch.randint(0, CFG.vocab_size, (batch, CFG.max_seq_len), generator=g)
        run = runs[layout] = _Run(wrapped, opt, tokens)
        for _ in range(2):
            run.step()
        with OpRecorder() as rec:
            run.forward_only()
        params = [_numel_local(p) for p in model.parameters()]
        run.inventory = dict(ops=rec.ops, fwd=fwd, extra=extra, params=params)
    times: dict[str, list[list[float]]] = {layout: [] for layout in LAYOUTS}
    compiled_times: dict[str, list[list[float]]] = {label: [] for label in COMPILED}
    for _ in range(steps):
        for label in COMPILED:
            compiled_times[label].append(compiled[label].timed_step())
        for layout in LAYOUTS:
            times[layout].append(runs[layout].timed_step())
    out = {"by hand": {}, "autopar": {}}
    for layout in LAYOUTS:
        fwd, bwd, opt, total, no_grad = (_max_over_ranks(sorted(c)[len(c) // 2]) for c in zip(*times[layout]))
        phases = dict(forward=fwd, backward=bwd, optimizer=opt, forward_no_grad=no_grad)
        out["by hand"][layout] = dict(runs[layout].inventory, measured=total, phases=phases)
    for label, run in compiled.items():
        total, blocked = (sorted(c)[len(c) // 2] for c in zip(*compiled_times[label]))
        # blocked: the rank that waited least in collectives (the others also wait for it)
        total, least = _max_over_ranks(total), -_max_over_ranks(-blocked)
        out["autopar"][label] = dict(run.inventory, plan=run.plan.to_dict(), measured=total,
                                     phases=dict(communication=least, compute=total - least,
                                                 communication_most=_max_over_ranks(blocked)))
    return out


def step_rows(measured: dict, profile) -> list[dict]:
    """Each layout's step, predicted beside its measurement: autopar's compiled step by
    its plan's prediction (the planner's cost tables, planned against the profile); the
    hand-written one by ``autopar.costmodels.step_time`` from ``profile``."""
    rows = []
    for layout, m in measured["autopar"].items():
        pred = m["plan"]["predicted"]
        # the same profile applied op by op to what the runtime ran: where the plan's tables
        # and this differ, the planner's inventory (not a rate) is off
        ops = sum(compute_time(op.flops, op.bytes, op.dtype, profile, op.name, op.heads) for op in m["ops"])
        calls = [c for c in m["collectives"] if c[0] in BUS_FACTOR]
        comm = sum(collective_time(kind, nbytes, 0, profile) for kind, nbytes in calls)  # as timed back to back
        rows.append(
            dict(
                kind="step",
                name=f"GPT step {layout} (autopar)",
                group=layout,
                # the loss program runs once per accumulated micro-batch, on its rows
                predicted=pred["step_time"] + m["plan"]["accumulate"] * m["loss"],
                measured=m["measured"],
                # hidden: what the plan counts as hidden behind compute (the step priced
                # without overlap is the step plus it)
                breakdown=dict(compute=pred["compute"], communication=pred["communication"], loss=m["loss"],
                               plan=pred["step_time"], hidden=pred.get("hidden_communication", 0.0)),
                measured_phases=m["phases"],
                runtime_priced=dict(compute=ops, communication=comm, ops=len(m["ops"]), collectives=len(calls)),
                plan_kind=m["plan"]["kind"],
                params=m["plan"]["params"],
            )
        )
    for layout, m in measured["by hand"].items():
        pred = step_time(m["ops"], profile, forward_comm=m["fwd"], backward_extra=m["extra"],
                         optimizer_ops=adamw_ops(m["params"]))
        rows.append(
            dict(
                kind="step by hand",
                name=f"GPT step {layout} (by hand)",
                group=layout,
                predicted=pred.total,
                measured=m["measured"],
                breakdown=pred.to_dict(),
                measured_phases=m["phases"],
                forward_ops=len(m["ops"]),
            )
        )
    return rows


class _Run:
    """One layout's model, optimizer and batch, timed phase by phase."""

    def __init__(self, wrapped, opt, tokens):
        self.wrapped, self.opt, self.tokens = wrapped, opt, tokens
        self.inventory: dict = {}  # what the prediction needs (measure_steps)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        _loss(self.wrapped, self.tokens).backward()
        self.opt.step()

    def forward_only(self) -> None:
        with torch.no_grad():
            _loss(self.wrapped, self.tokens)

    def timed_step(self) -> list[float]:
        """Seconds of forward, backward, optimizer step, their sum, and a no_grad forward."""
        dist.barrier()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = _loss(self.wrapped, self.tokens)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        dist.barrier()
        t4 = time.perf_counter()
        self.forward_only()
        return [t1 - t0, t2 - t1, t3 - t2, t3 - t0, time.perf_counter() - t4]


def drift(profile, group, sweep: Sweep, repeats: int) -> dict:
    """The fp32 matmul rate and (on more than one rank) the all-reduce fit, measured
    again at the end of the run: how far the machine moved since the profile."""
    shapes = [(m, k, n, layout) for m, k, n in sweep.matmul_shapes for layout in MATMUL_LAYOUTS]
    pool = OperandPool(CPU)
    times = timed([matmul_call(m, k, n, "fp32", lay, pool) for m, k, n, lay in shapes], CPU, repeats, 2)
    fit = fit_linear([2 * m * k * n for m, k, n, _ in shapes], times)
    out = {"matmul fp32 rate (GFLOP/s)": (profile.device.matmul["fp32"].rate / 1e9, 1e-9 / fit.slope)}
    n = dist.get_world_size()
    if n > 1:
        times = timed([collective_call("all_reduce", group, b, CPU) for b in sweep.comm_bytes], CPU, repeats, 2,
                      group=group)
        fit = fit_linear(sweep.comm_bytes, times)
        ar = profile.fit("all_reduce", 0)
        factor = float(BUS_FACTOR["all_reduce"].subs(N, n))
        out["all_reduce beta (MB/s)"] = (ar.beta_bytes_per_s / 1e6, factor / fit.slope / 1e6)
        out["all_reduce alpha (us)"] = (ar.alpha_s * 1e6, fit.intercept * 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=7, help="timed batches per held-out op (median)")
    ap.add_argument("--collective-repeats", type=int, default=21, help="timed batches per held-out collective")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--sweep", choices=("default", "thorough"), default="default", help="the profiler's sweep")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("world",))
    started = time.perf_counter()
    wall: dict[str, float] = {}

    def lap(what: str) -> None:
        wall[what] = time.perf_counter() - started - sum(v for k, v in wall.items() if not k.startswith("of which"))

    held_out = HeldOut(mesh, args.repeats, args.steps, args.collective_repeats)
    load = {"start": os.getloadavg()[0]}
    sweep = Sweep.thorough() if args.sweep == "thorough" else Sweep()
    profile = measure_profile(mesh, sweep, progress=False, on_fit=held_out)
    load.update(held_out.loads)
    load["after profile"] = os.getloadavg()[0]
    rows = held_out.rows(profile) + step_rows(held_out.measured_steps, profile)
    lap("profile, held-out rows and steps")
    wall["of which steps"] = held_out.steps_s
    moved = drift(profile, mesh.get_group(0), sweep, args.repeats)
    lap("drift")
    if dist.get_rank() == 0:
        Path(args.out).write_text(
            json.dumps(
                {
                    "ranks": dist.get_world_size(),
                    "rows": rows,
                    "load": load,
                    "wall_s_by_phase": wall,
                    "profile": profile.to_dict(),
                    "drift": moved,
                    "repeats": {"ops": args.repeats, "collectives": args.collective_repeats,
                                "steps": args.steps},
                },
                indent=1,
            )
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
