"""The ``autopar`` command line.

    torchrun --standalone --nproc_per_node 4 -m autopar.cli profile --mesh 2x2 --names dp,tp

Each subcommand is a function ``_cmd_<name>(args) -> int`` registered in ``_build``;
add one by adding a parser there. Wrong arguments and ``autopar:`` errors print one
line, ``autopar: ...``, and exit with status 2 (usage) or 1 (run-time).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence


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


def _cmd_profile(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from costmodels.profiler import Sweep, profile_mesh
    from costmodels.report import profile_table

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
    p.add_argument(
        "--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with CUDA, else gloo"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_profile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except _UsageError as e:
        sys.stderr.write(f"autopar: {e}\n")
        return 2
    except ValueError as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        sys.stderr.write(msg if msg.startswith("autopar:") else f"autopar: {msg}")
        sys.stderr.write("\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
