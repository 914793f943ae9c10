"""The demo: autopar on this machine, then on 64 H100s, in about two minutes.

    python -m autopar.demo

1. Launches 4 gloo ranks (``torchrun``) on this machine. They measure its hardware
   profile (once; cached), and rank 0 plans a small GPT for them: the plan, explained,
   and how its predicted step time compares with the manual layouts.
2. The ranks train the planned model a few AdamW steps, printing each step's loss next
   to a single-process model's (they must agree) and the measured step time next to the
   predicted one; then the best manual layouts train too, measured alike.
3. Back in one process: a Llama-3-70B-shaped model (built on the meta device, no weights)
   planned for 64 H100s (8 nodes x 8), and that plan explained.

Everything runs as large models train: mixed precision (``POLICY``: bf16 compute, fp32
master weights, gradients and AdamW state, gradients reduced in fp32), planned, priced and
run under ``mp_policy=``; the single-process model applies the same policy.
"""

from __future__ import annotations

import logging
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import autopar
from autopar.compiler import plan_once
from autopar.costmodels.profiler import Sweep, profile_mesh
from autopar.models import MODELS
from autopar.runtime.precision import POLICIES

RANKS = 4
STEPS = 6  # the first is warm-up (and builds the loss program); the rest are timed
GPT_FAMILY, GPT_SIZE = MODELS["gpt"], "demo"  # the registry's small GPT, for the 4 ranks
LLAMA_FAMILY, LLAMA_SIZE = MODELS["llama"], "70b"  # the Llama-3 shape planned for 64 H100s
POLICY = POLICIES["bf16"]  # bf16 compute, fp32 master weights and AdamW state, fp32 gradient reductions


def _small_gpt():
    torch.manual_seed(0)
    return GPT_FAMILY.build(GPT_SIZE)


def _loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _reference_loss(model: torch.nn.Module, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """One process under ``POLICY``: bf16 copies of the fp32 parameters (autograd casts their
    gradients back into the masters' .grad), the logits cast to ``output_dtype``."""
    working = {name: p.to(POLICY.param_dtype) for name, p in model.named_parameters()}
    logits = torch.func.functional_call(model, working, (tokens,)).to(POLICY.output_dtype)
    return _loss_fn(logits, target)


def _batches():
    """(tokens, target) per step, drawn in turn from one generator."""
    gen = torch.Generator().manual_seed(1)

    def tokens() -> torch.Tensor:
        (ids,), _ = GPT_FAMILY.inputs(GPT_SIZE, generator=gen)
        return ids

    return [(tokens(), tokens()) for _ in range(STEPS)]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


# --- part 1 and 2: under torchrun --------------------------------------------------------
def worker() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    logging.disable(logging.WARNING)  # torch's notes on gloo's missing all_to_all and DTensor's hops
    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    started = time.perf_counter()
    profile, path, measured = profile_mesh((2, 2), ("dp", "tp"), sweep=Sweep.quick(), progress=rank == 0)
    say(f"Hardware profile of this machine as a 2x2 gloo mesh: {'measured' if measured else 'cached'} "
        f"({time.perf_counter() - started:.1f} s) -> {path}\n")

    model = _small_gpt()  # every rank builds the same weights (seed 0)
    batches = _batches()
    tokens = batches[0][0]

    started = time.perf_counter()
    auto = plan_once(model, mesh, (tokens,), profile, time_limit_s=10, mp_policy=POLICY)
    planned_in = time.perf_counter() - started
    n_params = sum(p.numel() for p in model.parameters())
    batch = "x".join(map(str, tokens.shape))
    say(f"== The plan for a small GPT ({n_params:,} parameters, batch {batch}) on 2x2 gloo ranks "
        f"({planned_in:.1f} s) ==\n")
    say(auto.explain())
    say("\nPredicted step time, auto against the manual layouts (same cost model):")
    for name, t in sorted(auto.candidates.items(), key=lambda kv: kv[1]):
        say(f"  {name:<24} {_ms(t):>10}   auto / {name} = {auto.predicted.step_time / t:.2f}")

    # the auto plan and the best manual layouts train side by side, step by step, so that
    # load on this shared machine hits them alike
    manual = [name for name, _ in sorted(auto.candidates.items(), key=lambda kv: kv[1])
              if name in ("dp", "fsdp", "tp+dp", "tp")][:3]
    plans = {"auto": auto}
    plans.update({name: plan_once(_small_gpt(), mesh, (tokens,), profile, layout=name, mp_policy=POLICY)
                  for name in manual})
    modules = {name: autopar.compile(_small_gpt(), mesh, (tokens,), loss_fn=_loss_fn, optimizer=_adamw, plan=p,
                                     mp_policy=POLICY)
               for name, p in plans.items()}
    reference = _small_gpt()
    ref_opt = _adamw(reference.parameters())
    times = {name: [] for name in plans}

    say(f"\n== Training {STEPS} AdamW steps on 4 ranks: the plan against one process "
        f"(and {', '.join(manual)} alongside) ==\n")
    say(f"{'step':>4}  {'autopar loss':>13}  {'1-process loss':>14}  {'measured':>10}  {'predicted':>10}"
        "   (both bf16 compute, fp32 master: equal within bf16 rounding)")
    for step, (x, y) in enumerate(batches):
        for name, pm in modules.items():
            dist.barrier()
            started = time.perf_counter()
            loss = pm.train_step((x,), y)
            elapsed = time.perf_counter() - started
            if step > 0:
                times[name].append(elapsed)
            if name == "auto":
                auto_loss, auto_time = float(loss), elapsed
        ref_opt.zero_grad()
        ref_loss = _reference_loss(reference, x, y)
        ref_loss.backward()
        ref_opt.step()
        say(f"{step:>4}  {auto_loss:>13.6f}  {float(ref_loss.detach()):>14.6f}  {_ms(auto_time):>10}  "
            f"{_ms(auto.predicted.step_time):>10}" + ("  (warm-up)" if step == 0 else ""))
    median = {name: statistics.median(t) for name, t in times.items()}
    say(f"\n{'layout':<10} {'measured':>10} {'predicted':>10} {'measured/predicted':>19} {'auto/this measured':>19}"
        f" {'auto/this predicted':>20}")
    for name, p in plans.items():
        say(f"{name:<10} {_ms(median[name]):>10} {_ms(p.predicted.step_time):>10} "
            f"{median[name] / p.predicted.step_time:>19.2f} {median['auto'] / median[name]:>19.2f} "
            f"{auto.predicted.step_time / p.predicted.step_time:>20.2f}")
    say("(measured: median of the last {} steps; this machine is shared, so ratios measured side by side "
        "are the result)".format(STEPS - 1))
    dist.barrier()
    dist.destroy_process_group()


# --- part 3 and the launcher ---------------------------------------------------------------
def plan_70b() -> None:
    with torch.device("meta"):
        model = LLAMA_FAMILY.build(LLAMA_SIZE).float()  # the fp32 master copy; the policy computes in bf16
        (tokens,), _ = LLAMA_FAMILY.inputs(LLAMA_SIZE)
    print("\n== Llama-3-70B shape (80 layers, hidden 8192, 70.6 B parameters, bf16 compute, fp32 master, meta "
          f"device) on 64 H100s (8 nodes x 8 GPUs), global batch {'x'.join(map(str, tokens.shape))} ==\n")
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (8, 8), (tokens,), hardware="h100", time_limit_s=20, mp_policy=POLICY)
    print(f"planned in {time.perf_counter() - started:.1f} s on this {os.cpu_count()}-core machine\n")
    print(plan.explain())


def main() -> None:
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
               "-m", "autopar.demo", "--worker"]
    print(f"$ {' '.join(['torchrun'] + command[3:])}\n", flush=True)
    done = subprocess.run(command, env=env)
    if done.returncode != 0:
        sys.exit(f"autopar: the demo's {RANKS}-rank run failed (exit {done.returncode}); see the output above")
    plan_70b()
    print(f"\ndemo finished in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        main()
