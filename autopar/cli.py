"""The ``autopar`` command line.

    autopar plan llama-70b --mesh 8x8 --hardware h100     # plan, explain, write plan.json + pictures
    autopar plan mypkg.models:build --mesh 2x4 --out plans/run1
    autopar plan gpt-small --mesh 8x8 --dry-run               # and step every distinct rank on fake tensors
    autopar plan llama-70b --mesh 1x8 --inference --batch 1 --prompt 128 --max-len 2048 --objective latency
    autopar explain autopar-plan/plan.json --pictures pics/
    autopar diff a.json b.json
    autopar bench --models gpt-small --meshes gloo-4 --quick
    torchrun --standalone --nproc_per_node 4 -m autopar.cli profile --mesh 2x2 --names dp,tp

Each subcommand is a function ``_cmd_<name>(args) -> int`` registered in ``_build``;
add one by adding a parser there. Wrong arguments and ``autopar:`` errors print one
line, ``autopar: ...``, and exit with status 2 (usage) or 1 (run-time).

``plan``'s MODEL is a built-in name (``BUILTINS``: a size of a family of the model
registry ``autopar.models.MODELS``, built on the meta device: nothing is allocated) or
``package.module:factory``: a callable returning ``(model, example_inputs)``, called with
no arguments, or with ``batch=`` / ``seq=`` keywords when ``--batch`` / ``--seq`` are given.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from autopar.layouts import LAYOUTS
from autopar import pictures
from autopar.costmodels import PRESETS, HardwareProfile
from autopar.costmodels.profile import DTYPES
from autopar.costmodels.profiler import Sweep, profile_mesh
from autopar.costmodels.report import profile_table
from autopar.coverage import coverage
from autopar.dryrun import dry_run
from autopar.models import MODELS
from autopar import op_coverage
from autopar.passes.explain import device_mesh_call
from autopar.passes.generation import OBJECTIVES, Inference
from autopar.passes.plan import Plan
from autopar.passes.planner.constraints import Constraints
from autopar.planning import plan
from autopar.runtime.precision import POLICIES


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        sys.stderr.write(f"autopar: {message} (see `autopar {self._sub_name()}--help`)\n")
        raise SystemExit(2)

    def _sub_name(self) -> str:
        parts = self.prog.split()[1:]
        return "".join(p + " " for p in parts)


def _mesh_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.lower().replace(",", "x").split("x"))
    except ValueError:
        shape = ()
    if not shape or any(n < 1 for n in shape):
        raise argparse.ArgumentTypeError(
            f"expected a mesh shape like 4 or 2x2 (positive sizes joined by 'x'); found {text!r}"
        )
    return shape


def _names(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected axis names like dp,tp; found {text!r}")
    return names


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number; found {text!r}")
    return value


def _csv(text: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list like a,b; found {text!r}")
    return items


# --- models for `autopar plan` --------------------------------------------------------

# The built-in model names: a family of the registry (autopar.models.MODELS) and its size.
BUILTINS = {
    "gpt-small": ("gpt", "small"),
    "gpt2": ("gpt2", "124m"),
    "llama-8b": ("llama", "8b"),
    "llama-70b": ("llama", "70b"),
    "llama-405b": ("llama", "405b"),
    "mixtral": ("mixtral", "small"),
    "wide-mlp": ("wide-mlp", "plan"),
}


def _builtin_help() -> str:
    """One line per built-in name: what it is, its size and its default batch and sequence."""
    lines = []
    for name, (family, size) in BUILTINS.items():
        shape = MODELS[family].size(size)
        lines.append(f"  {name:<11} {MODELS[family].about.split(':')[0]}: {shape.about} "
                     f"(batch {shape.batch}, seq {shape.seq})")
    return "\n".join(lines)


def load_model(spec: str, batch: int | None = None, seq: int | None = None) -> tuple:
    """(model, example_inputs) for a built-in name or ``package.module:factory`` (module docstring)."""
    import torch

    if spec in BUILTINS:
        family, size = MODELS[BUILTINS[spec][0]], BUILTINS[spec][1]
        seq = seq or family.size(size).seq
        try:
            with torch.device("meta"):
                return family.build(size, seq), family.inputs(size, batch, seq)[0]
        except ImportError as e:
            raise _UsageError(f"model {spec!r} needs a package that is not installed ({e}); "
                              "install it, e.g. `pip install transformers`") from None
    if ":" not in spec:
        raise _UsageError(f"unknown model {spec!r}; expected one of {', '.join(BUILTINS)} "
                          "or package.module:factory")
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:  # `autopar plan mymodels:build` finds ./mymodels.py, as `python -m` would
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except ImportError as e:
        raise _UsageError(f"cannot import {module_name!r} for model {spec!r}: {e}") from None
    except AttributeError:
        raise _UsageError(f"module {module_name!r} has no {attr!r} (model {spec!r})") from None
    kwargs = {k: v for k, v in (("batch", batch), ("seq", seq)) if v is not None}
    got = factory(**kwargs) if callable(factory) else factory
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.nn.Module):
        model, inputs = got
        return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    raise _UsageError(f"model factory {spec!r} must return (model, example_inputs) with an nn.Module model; "
                      f"found {type(got).__name__}")


def _cmd_profile(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise _UsageError(
            "`autopar profile` measures the real mesh, so it runs on every rank under torchrun; "
            "found no RANK/WORLD_SIZE in the environment. Run e.g. `torchrun --standalone "
            "--nproc_per_node 4 -m autopar.cli profile --mesh 2x2`."
        )
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend)
    try:
        sweep = Sweep.quick() if args.quick else None  # None: the default for the device
        profile, path, measured = profile_mesh(
            args.mesh,
            args.names,
            cache_dir=args.cache_dir,
            force=args.force,
            sweep=sweep,
            progress=not args.no_progress,
            dtypes=args.dtypes,
        )
        if dist.get_rank() == 0:
            if args.out:
                profile.save(args.out)
            print(profile_table(profile))
            print(f"\n{'measured and saved' if measured else 'reused cached profile'}: {path}")
            if args.out:
                print(f"also written to: {args.out}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


# --- plan, explain, diff, bench -------------------------------------------------------


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.inference:
        if args.pin or args.constraints or args.accumulate != 1:
            raise _UsageError("plan --inference takes no --pin, --constraints or --accumulate (they are for training "
                              "plans)")
        return _plan_serving(args)
    model, inputs = load_model(args.model, args.batch, args.seq)
    hardware = _hardware(args.hardware)
    with _PhaseBar(enabled=not args.no_progress) as bar:
        result = plan(model, args.mesh, inputs, hardware=hardware, time_limit_s=args.time_limit,
                      pipeline=not args.no_pipeline, layout=args.layout, progress=bar.update,
                      mp_policy=POLICIES[args.mp] if args.mp else None, constraints=_constraints(args),
                      accumulate=args.accumulate)
    print(result.explain())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result.save(out / "plan.json")
    print(f"\nplan: {out / 'plan.json'}")
    print(device_mesh_call(result))
    _write_pictures(result, out)
    if args.dry_run:

        print()
        checked = dry_run(result, model, inputs)
        print(checked.table())
        checked.raise_if_failed()  # an autopar: line naming the rank, exit status 1
    return 0


def _constraints(args: argparse.Namespace) -> Constraints | None:
    """``--constraints FILE.json`` (Constraints' fields), then each ``--pin KEY=VALUE`` over it."""
    if args.constraints is None and not args.pin:
        return None
    given = {}
    if args.constraints is not None:
        try:
            given = json.loads(Path(args.constraints).read_text())
        except json.JSONDecodeError as exc:
            raise _UsageError(f"--constraints {args.constraints}: expected JSON of pins such as {{\"tp\": 8, "
                              f"\"pp\": 4}}, found {exc}") from None
        if not isinstance(given, dict):
            raise _UsageError(f"--constraints {args.constraints}: expected a JSON object of pins such as "
                              f"{{\"tp\": 8}}, found {type(given).__name__}")
    merged = Constraints.from_dict(given).to_dict()
    for key, value in Constraints.from_pins(args.pin).to_dict().items():
        merged[key] = {**merged.get(key, {}), **value} if key in ("zero_by_name", "params", "outputs") else value
    return Constraints.from_dict(merged)


def _plan_serving(args: argparse.Namespace) -> int:
    """``autopar plan --inference``: the serving plan, explained and written as plan.json."""
    if args.dry_run or args.mp or args.no_pipeline or args.seq:
        given = [flag for flag, on in (("--dry-run", args.dry_run), ("--mp", args.mp), ("--seq", args.seq),
                                       ("--no-pipeline", args.no_pipeline)) if on]
        raise _UsageError(f"--inference plans serving, which takes no {', '.join(given)} (the prompt and cache "
                          "lengths are --prompt and --max-len); leave them out")
    batch = args.batch if args.batch or args.objective == "throughput" else 1
    workload = Inference(batch=batch, prompt_len=args.prompt, max_len=args.max_len, objective=args.objective)
    model, _ = load_model(args.model)
    result = plan(model, args.mesh, inference=workload, hardware=_hardware(args.hardware),
                  time_limit_s=args.time_limit, layout=args.layout)
    print(result.explain())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result.save(out / "plan.json")
    print(f"\nplan: {out / 'plan.json'}")
    print(device_mesh_call(result))
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:

    plan = Plan.load(_existing(args.plan))
    print(plan.explain())
    if args.pictures:
        print()
        _write_pictures(plan, Path(args.pictures))
    return 0


def _cmd_diff(args: argparse.Namespace) -> int:

    a, b = (Plan.load(_existing(p)) for p in (args.a, args.b))
    print(a.diff(b))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    """``autopar export PLAN.json MODEL --out FILE``: the plan as a plain-PyTorch module."""
    saved = Plan.load(_existing(args.plan))
    model, inputs, *_ = load_model(args.model, args.batch, args.seq)
    exported = saved.export(model, args.out, example_inputs=inputs)
    print(exported.summary())
    if args.torchtitan is not None:
        print(f"torchtitan job config: {exported.write_torchtitan(args.torchtitan)}")
    return 0


def _cmd_coverage(args: argparse.Namespace) -> int:
    if args.ops is not None:
        return _op_coverage(args)
    if args.model is None:
        raise _UsageError("coverage: expected a MODEL, or --ops for the sharding rules' coverage of ATen ops")
    model, inputs, *kwargs = load_model(args.model, args.batch, args.seq)  # kwargs: where the loader gives them
    found = coverage(model, inputs, kwargs[0] if kwargs else None, mesh_shape=args.mesh, hardware=args.hardware)
    print(found.table())
    return 0


def _op_selection(text: str) -> op_coverage.OpSelection:
    try:
        return op_coverage.OpSelection(_csv(text))
    except ValueError as e:  # a name of no ATen op
        raise argparse.ArgumentTypeError(str(e).removeprefix("autopar: ")) from None


def _op_coverage(args: argparse.Namespace) -> int:
    """``coverage --ops``: the rules checked on torch's OpInfo samples, their table, any wrong strategy."""
    if args.model is not None:
        raise _UsageError(f"coverage --ops checks the rules on torch's op samples, not a model; found {args.model!r} "
                          "(run `autopar coverage MODEL` for a model's ops)")
    found = op_coverage.walk(args.ops)
    print(op_coverage.coverage_table(found))
    for line in found.failures:
        print(f"wrong: {line}")
    print(found.summary())
    return 1 if found.failures else 0


def _cmd_bench(args: argparse.Namespace) -> int:
    try:
        bench = importlib.import_module("autopar.bench")
    except ImportError as e:
        raise _UsageError(f"the benchmark module autopar.bench is not available here ({e})") from None
    # bench.run checks the names: an unknown model or mesh is a one-line autopar: error
    table = bench.run(models=args.models, meshes=args.meshes, out_dir=args.out, quick=args.quick,
                      progress=not args.no_progress, time_limit_s=args.time_limit, dry_run=args.dry_run)
    print(Path(table).read_text())
    print(f"table: {table}")
    return 0


def _hardware(text: str):
    """A preset name, or a HardwareProfile read from a JSON file."""

    if text.lower() in PRESETS:
        return text.lower()
    if not Path(text).is_file():
        raise _UsageError(f"--hardware: expected a preset ({', '.join(sorted(PRESETS))}) or a hardware profile "
                          f"JSON file (from `autopar profile --out`); found {text!r}")
    return HardwareProfile.load(text)


def _existing(path: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise _UsageError(f"expected a plan JSON file at {path}, found {'a folder' if p.is_dir() else 'nothing'}; "
                          "make one with `autopar plan MODEL --mesh 2x2`")
    return p


def _write_pictures(plan, out: Path) -> None:

    for name, path in pictures.write_all(plan, out).items():
        print(f"{name}: {path}" if isinstance(path, Path) else f"{name}: not drawn: {path}")


class _PhaseBar:
    """A tqdm bar over the planner's phases (``autopar.plan(progress=...)``), on stderr."""

    def __init__(self, enabled: bool):
        from tqdm import tqdm

        self._bar = tqdm(total=None, desc="plan", unit="step", disable=not enabled or None, leave=False,
                         bar_format="{desc}{bar:20} {n_fmt}/{total_fmt} [{elapsed}]")

    def update(self, phase: str, done: int, total: int | None) -> None:
        if total is not None:  # capture is one step more than the search reports
            self._bar.total = total + 1
            self._bar.n = done + 1
        self._bar.set_description(f"plan: {phase}")

    def __enter__(self) -> "_PhaseBar":
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()


class _UsageError(Exception):
    pass


def _build() -> argparse.ArgumentParser:
    parser = _Parser(prog="autopar", description="autopar: automatic parallelization for PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser(
        "profile",
        help="measure this machine's hardware profile on a mesh (run under torchrun)",
        description="Measure collectives on every mesh axis, matmuls and pointwise ops; fit "
        "alpha/beta; cache the profile by machine and mesh. Run on every rank under torchrun.",
    )
    p.add_argument(
        "--mesh", type=_mesh_shape, default=None, help="mesh shape, e.g. 2x2 (default: all ranks on one axis)"
    )
    p.add_argument(
        "--names", type=_names, default=None, help="axis names, e.g. dp,tp (default: axis0,axis1,...)"
    )
    p.add_argument(
        "--cache-dir", default=None, help="profile cache (default: $AUTOPAR_CACHE_DIR or ~/.cache/autopar)"
    )
    p.add_argument("--out", default=None, help="also write the profile JSON here")
    p.add_argument("--force", action="store_true", help="re-measure even if a matching cached profile exists")
    p.add_argument("--quick", action="store_true", help="a small sweep (seconds; for smoke tests)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES,
                   help="compute dtypes to measure (fp32 always; default: all); a cached profile lacking "
                        "some has them added")
    p.add_argument(
        "--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with CUDA, else gloo"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_profile)

    models = _builtin_help()
    p = sub.add_parser(
        "plan",
        help="plan a model on a mesh (no devices needed); explain it, save plan.json and pictures",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Capture MODEL, search tensor, pipeline, data parallel and ZeRO layouts on the mesh with\n"
        "the hardware's cost model, print the explanation, write DIR/plan.json and the pictures\n"
        "(pipeline.png, memory.png, weights.png).\n\n"
        f"Built-in models (meta device: nothing is allocated):\n{models}\n\n"
        "Or package.module:factory, a callable returning (model, example_inputs); it is called\n"
        "with batch=/seq= keywords when --batch/--seq are given.",
    )
    p.add_argument("model", metavar="MODEL", help=f"one of {', '.join(BUILTINS)}, or package.module:factory")
    p.add_argument("--mesh", type=_mesh_shape, required=True,
                   help="mesh shape, outermost (slowest) axis first, e.g. 8x8")
    p.add_argument("--hardware", default="h100", help="preset h100 or a100, or a profile JSON (default: h100)")
    p.add_argument("--batch", type=_positive, default=None, help="batch size (default: the model's)")
    p.add_argument("--seq", type=_positive, default=None, help="sequence length (default: the model's)")
    p.add_argument("--out", default="autopar-plan", metavar="DIR", help="where plan.json and the pictures go "
                   "(default: ./autopar-plan/)")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S",
                   help="seconds for the search after capture (default: 60)")
    p.add_argument("--layout", choices=LAYOUTS, default=None, metavar="NAME",
                   help=f"cost this manual layout as written (the fewest layers recomputed that fit) instead of "
                   f"searching: {', '.join(LAYOUTS)}")
    p.add_argument("--no-pipeline", action="store_true", help="keep the mesh as given (no pipeline axis)")
    p.add_argument("--accumulate", type=_positive, default=1, metavar="K",
                   help="each step accumulates K micro-batches of the batch, one gradient sync (train_step("
                   "accumulate=K)): the plan lays out one micro-batch and prices the step so (default: 1)")
    p.add_argument("--pin", action="append", default=[], metavar="KEY=VALUE",
                   help="fix part of the layout, search the rest (repeatable): tp=8, dp=8, pp=4, axes=pp,dp,tp, "
                   "micro_batches=16, schedule=1f1b, chunks=2, stage_starts=model.layers.16,model.layers.32, zero=1, "
                   "zero:PATTERN=LEVEL, recompute=none|all|0,2-5, PATTERN=S(0)R|colwise|rowwise (parameters), "
                   "output:PATTERN=S(1)R|sequence|colwise (a module's output); explain() prices the pins against "
                   "the plan without them")
    p.add_argument("--constraints", default=None, metavar="FILE.json",
                   help="pins as JSON, autopar.Constraints' fields (e.g. {\"tp\": 8, \"zero_by_name\": "
                   "{\"embed_tokens\": 0}}); --pin adds to them")
    p.add_argument("--mp", choices=sorted(POLICIES), default=None, help="plan for mixed precision as autopar.compile("
                   "mp_policy=) runs it: bf16 = bf16 compute, fp32 master weights, gradients and AdamW state, "
                   "fp32 reductions (default: the model's own dtypes)")
    p.add_argument("--dry-run", action="store_true", help="then run one training step of every distinct rank at "
                   "the mesh's full size on fake tensors (autopar.dry_run): check it and measure its peak memory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--inference", action="store_true", help="plan serving instead of training: prefill and "
                   "decode with a key-value cache (a Hugging Face causal LM); --batch sequences (default 1; with "
                   "--objective throughput, searched: the one serving the most tokens/s per device)")
    p.add_argument("--prompt", type=_positive, default=128, metavar="N", help="with --inference: prompt tokens "
                   "(default: 128)")
    p.add_argument("--max-len", type=_positive, default=2048, metavar="N", help="with --inference: positions cached, "
                   "prompt and generated tokens (default: 2048)")
    p.add_argument("--objective", choices=OBJECTIVES, default="latency", help="with --inference: latency (time to "
                   "first token + tokens x time per output token) or throughput (tokens/s per device)")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("explain", help="print the explanation of a saved plan (and its pictures)",
                       description="Print what a saved plan chose and why; with --pictures, draw its pictures.")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("--pictures", default=None, metavar="DIR", help="write pipeline.png, memory.png, weights.png here")
    p.set_defaults(func=_cmd_explain)

    p = sub.add_parser("diff", help="what differs between two saved plans",
                       description="Print each difference: mesh, pipeline, placements, ZeRO levels, prediction.")
    p.add_argument("a", metavar="A.json")
    p.add_argument("b", metavar="B.json")
    p.set_defaults(func=_cmd_diff)

    p = sub.add_parser("export", help="write a saved plan as a Python module that applies it with torch's own APIs",
                       description="Write PLAN.json for MODEL (as `autopar plan` takes it; captured to follow the "
                       "plan op by op) as a Python module with parallelize(model, mesh) (and, for a pipeline, "
                       "pipeline(model, mesh, microbatches, loss_fn)) built on torch's parallelize_module, "
                       "fully_shard, DistributedDataParallel, checkpoint_wrapper and torch.distributed.pipelining: "
                       "no autopar import. Prints the plan's choices torch cannot express (the file says so where "
                       "they occur and uses the nearest layout torch can).")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("model", metavar="MODEL", help=f"one of {', '.join(BUILTINS)}, or package.module:factory")
    p.add_argument("--out", default="parallelize.py", metavar="FILE", help="the module to write "
                   "(default: ./parallelize.py)")
    p.add_argument("--torchtitan", default=None, metavar="FILE", help="also write the plan as a torchtitan "
                   "job-config fragment (TOML; Llama-family models)")
    p.add_argument("--batch", type=_positive, default=None, help="batch size of the capture (default: the model's)")
    p.add_argument("--seq", type=_positive, default=None, help="sequence length of the capture (default: the model's)")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("bench", help="auto plan versus manual layouts, predicted and measured (autopar.bench)",
                       description="Run autopar.bench over models and meshes; print its markdown table.")
    p.add_argument("--models", type=_csv, default=None, help="comma-separated, e.g. gpt-small,llama (default: all)")
    p.add_argument("--meshes", type=_csv, default=None, help="comma-separated, e.g. gloo-4,h100-64 (default: all)")
    p.add_argument("--out", default="results/bench", metavar="DIR", help="results folder (default: results/bench)")
    p.add_argument("--quick", action="store_true", help="fewer steps and models (a smoke run)")
    p.add_argument("--time-limit", type=float, default=20.0, metavar="S", help="planning seconds per case "
                   "(default: 20)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--dry-run", action="store_true", help="dry-run every auto plan of an H100 mesh at its full "
                   "world size (autopar.dry_run) and add its verdict, peak memory and seconds to the table")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("coverage", help="the ops of a model without a sharding rule, and the layouts that apply; "
                       "or, with --ops, every rule checked on torch's op samples",
                       description="Capture MODEL (as `autopar plan` takes it), list its ops that have no sharding "
                       "rule (they run replicated) and, for every manual layout, whether it applies on the mesh "
                       "and its predicted step. With --ops instead of MODEL: check every strategy of every rule on "
                       "torch's OpInfo samples (simulated on 1-, 2- and 3-axis meshes) and print which ATen ops are "
                       "checked, covered but not checked, or missing, and the core ATen ops with no rule (exit "
                       "status 1 if a strategy is wrong).")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help=f"one of {', '.join(BUILTINS)}, or package.module:factory")
    p.add_argument("--ops", nargs="?", type=_op_selection, const=op_coverage.OpSelection(), default=None,
                   metavar="OPS",
                   help="the rules' coverage of ATen ops instead of a model: every op (under a minute), or only OPS, "
                   "comma-separated (aten.roll,aten.tril.default: seconds)")
    p.add_argument("--mesh", type=_mesh_shape, default=(2, 2), help="mesh shape (default: 2x2)")
    p.add_argument("--hardware", choices=sorted(PRESETS), default="h100", help="preset (default: h100)")
    p.add_argument("--batch", type=_positive, default=None, help="batch size (default: the model's)")
    p.add_argument("--seq", type=_positive, default=None, help="sequence length (default: the model's)")
    p.set_defaults(func=_cmd_coverage)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except _UsageError as e:
        sys.stderr.write(f"autopar: {e}\n")
        return 2
    except ValueError as e:  # autopar's own errors (PlanningError, ProfileError), bad JSON
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        sys.stderr.write(msg if msg.startswith("autopar:") else f"autopar: {msg}")
        sys.stderr.write("\n")
        return 1
    except OSError as e:  # a file that cannot be read or written
        sys.stderr.write(f"autopar: {e.strerror or e}: {e.filename or ''}".rstrip(": ") + "\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("autopar: interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
