"""Measure a HardwareProfile on the real mesh (run on every rank, e.g. under torchrun).

For each mesh axis, every collective runs on every group of that axis at once (as in
training), over a sweep of message sizes; alpha and beta come from a least-squares fit
of ``t = alpha + factor(N) X / beta``. Matmuls and pointwise ops run on all ranks at
once too, so a profile of ranks sharing cores measures the rate each rank really gets.
Times are per call medians on each rank, then the slowest rank's, so every rank builds
the identical profile.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from costmodels.cache import cache_path, check_profile, machine_fingerprint
from costmodels.fit import LinearFit, fit_linear
from costmodels.formulas import BUS_FACTOR
from costmodels.formulas import N as N_SYM
from costmodels.profile import (
    COLLECTIVES,
    DTYPES,
    AxisProfile,
    CollectiveFit,
    DeviceProfile,
    HardwareProfile,
    ProfileError,
    Rate,
)
from costmodels.timing import (
    MATMUL_LAYOUTS,
    TORCH_DTYPE,
    WORKING_SET_BYTES,
    time_collective,
    time_matmul,
    time_pointwise,
)


@dataclass(frozen=True, kw_only=True)
class Sweep:
    """What the profiler measures. The defaults take about a minute at 4 CPU ranks."""

    comm_bytes: tuple[int, ...] = (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
    matmul_shapes: tuple[tuple[int, int, int], ...] = (
        (32, 32, 32),
        (64, 64, 64),
        (128, 128, 128),
        (256, 128, 512),
        (256, 256, 256),
        (512, 256, 512),
        (512, 512, 512),
    )
    pointwise_numel: tuple[int, ...] = (1 << 10, 1 << 13, 1 << 16, 1 << 18, 1 << 20)
    repeats: int = 5
    warmup: int = 2
    # bf16 / fp16 time fewer, smaller shapes (fp16 matmul on CPU runs at ~1 GFLOP/s)
    low_precision_shapes: tuple[tuple[int, int, int], ...] = (
        (64, 64, 64),
        (128, 128, 128),
        (128, 128, 256),
        (256, 256, 256),
    )
    min_batch_s: float = 0.02  # each timed batch of calls lasts at least this long
    working_set_bytes: int = WORKING_SET_BYTES  # compute operands rotate through this much

    @classmethod
    def gpu(cls) -> Sweep:
        """Sizes where a datacenter GPU reaches its rates (not yet run on one)."""
        return cls(
            comm_bytes=tuple(1 << p for p in range(16, 31, 2)),  # 64 KiB .. 1 GiB
            matmul_shapes=tuple((n, n, n) for n in (512, 1024, 2048, 4096, 8192)),
            low_precision_shapes=tuple((n, n, n) for n in (1024, 2048, 4096, 8192)),
            pointwise_numel=tuple(1 << p for p in range(16, 29, 3)),
            repeats=5,
            warmup=3,
            min_batch_s=0.02,
            working_set_bytes=256 << 20,
        )

    @classmethod
    def quick(cls) -> Sweep:
        """A small sweep for tests and smoke runs (a few seconds)."""
        return cls(
            comm_bytes=(1 << 12, 1 << 18, 1 << 22),
            matmul_shapes=((32, 32, 32), (64, 64, 64), (128, 128, 128)),
            pointwise_numel=(1 << 10, 1 << 14, 1 << 17),
            repeats=3,
            warmup=1,
            min_batch_s=0.005,
            working_set_bytes=4 << 20,
            low_precision_shapes=((32, 32, 32), (64, 64, 64)),
        )


def _axis_link(group, device: torch.device) -> str:
    hosts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, os.uname().nodename, group=group)
    return "intra_node" if len(set(hosts)) == 1 else "inter_node"


def _device_info(device: torch.device) -> tuple[str, int]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.name, int(props.total_memory)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"cpu ({local} ranks per host)", int(total // max(local, 1))


def _peaks(dev_name: str, matmul: dict, pointwise: dict) -> dict:
    """Datasheet peaks for a device a preset knows (by name), else the measured rates."""
    from costmodels.presets import PRESETS

    for key, build in PRESETS.items():
        if key in dev_name.lower():
            dev = build((1,)).device
            return dict(
                peak_matmul_flops=dict(dev.peak_matmul_flops),
                peak_memory_bandwidth=dev.peak_memory_bandwidth,
                peak_source=dev.peak_source,
            )
    return dict(
        peak_matmul_flops={d: r.rate for d, r in matmul.items()},
        peak_memory_bandwidth=max(r.rate for r in pointwise.values()),
        peak_source="measured: no datasheet known for this device, the fitted rates stand in",
    )


def _step(bar, label: str, value: float) -> float:
    bar.set_postfix_str(label, refresh=False)
    bar.update()
    return value


def _measure_and_fit(measure: Callable[[int], list[float]], sizes, repeats: int, what: str) -> LinearFit:
    """Measure a sweep and fit it; on a noisy machine the times may not grow with size,
    so a failed fit is measured once more with three times the repeats before giving up.
    Every rank sees the same (all-reduced) times, so every rank takes the same branch."""
    try:
        return fit_linear(sizes, measure(repeats))
    except ValueError:
        try:
            return fit_linear(sizes, measure(3 * repeats))
        except ValueError as e:
            raise ProfileError(f"{e} (while profiling {what}, measured twice)") from None


def measure_profile(mesh, sweep: Sweep = Sweep(), *, progress: bool = True) -> HardwareProfile:
    """Measure a profile of ``mesh`` (a DeviceMesh); every rank must call it."""
    device = (
        torch.device(mesh.device_type, torch.cuda.current_device())
        if mesh.device_type == "cuda"
        else torch.device("cpu")
    )
    names = tuple(mesh.mesh_dim_names or (f"axis{i}" for i in range(mesh.ndim)))
    shape = tuple(mesh.shape)
    lp = sweep.low_precision_shapes
    total = (
        sum(len(COLLECTIVES) * len(sweep.comm_bytes) for n in shape if n > 1)
        + len(MATMUL_LAYOUTS) * (len(sweep.matmul_shapes) + 2 * len(lp))
        + len(DTYPES) * len(sweep.pointwise_numel)
    )
    from tqdm import tqdm

    bar = tqdm(total=total, desc="autopar profile", disable=not progress or dist.get_rank() != 0, leave=False)
    axes = []
    for i, (name, size) in enumerate(zip(names, shape)):
        group = mesh.get_group(i)
        fits = {}
        for kind in COLLECTIVES:
            if size == 1:  # nothing to measure: a collective over one rank is free
                fits[kind] = CollectiveFit(
                    alpha_s=0.0, beta_bytes_per_s=float("inf"), source="axis of size 1"
                )
                continue
            fit = _measure_and_fit(
                lambda repeats: [
                    _step(
                        bar,
                        f"{name} {kind} {nbytes} B",
                        time_collective(
                            kind, group, nbytes, device, repeats, sweep.warmup, sweep.min_batch_s
                        ),
                    )
                    for nbytes in sweep.comm_bytes
                ],
                sweep.comm_bytes,
                sweep.repeats,
                f"{kind} on mesh axis {name!r}",
            )
            factor = float(BUS_FACTOR[kind].subs(N_SYM, size))
            fits[kind] = CollectiveFit(
                alpha_s=fit.intercept,
                beta_bytes_per_s=factor / fit.slope,
                source=f"fit over {fit.points} sizes {min(sweep.comm_bytes)}-{max(sweep.comm_bytes)} B, "
                f"median residual {100 * fit.median_rel_error:.1f}%",
            )
        axes.append(AxisProfile(name=name, size=size, link=_axis_link(group, device), collectives=fits))

    matmul, pointwise = {}, {}
    for dtype in DTYPES:
        shapes = sweep.matmul_shapes if dtype == "fp32" else lp
        fit = _measure_and_fit(
            lambda repeats: [
                _step(
                    bar,
                    f"matmul {dtype} {layout} {m}x{k}x{n}",
                    time_matmul(
                        m,
                        k,
                        n,
                        dtype,
                        device,
                        repeats,
                        sweep.warmup,
                        sweep.min_batch_s,
                        layout,
                        sweep.working_set_bytes,
                    ),
                )
                for m, k, n in shapes
                for layout in MATMUL_LAYOUTS
            ],
            [2 * m * k * n for m, k, n in shapes for _ in MATMUL_LAYOUTS],
            sweep.repeats,
            f"{dtype} matmul",
        )
        matmul[dtype] = Rate(latency_s=fit.intercept, rate=1.0 / fit.slope)
        itemsize = torch.empty((), dtype=TORCH_DTYPE[dtype]).element_size()
        fit = _measure_and_fit(
            lambda repeats: [
                _step(
                    bar,
                    f"pointwise {dtype} {numel}",
                    time_pointwise(
                        numel,
                        dtype,
                        device,
                        repeats,
                        sweep.warmup,
                        sweep.min_batch_s,
                        sweep.working_set_bytes,
                    ),
                )
                for numel in sweep.pointwise_numel
            ],
            [3 * n * itemsize for n in sweep.pointwise_numel],
            sweep.repeats,
            f"{dtype} pointwise",
        )
        pointwise[dtype] = Rate(latency_s=fit.intercept, rate=1.0 / fit.slope)
    bar.close()

    dev_name, mem = _device_info(device)
    device_profile = DeviceProfile(
        name=dev_name,
        memory_bytes=mem,
        matmul=matmul,
        pointwise=pointwise,
        **_peaks(dev_name, matmul, pointwise),
    )
    backend = dist.get_backend()
    return HardwareProfile(
        machine=machine_fingerprint(dev_name),
        backend=str(backend),
        mesh_shape=shape,
        device=device_profile,
        axes=axes,
        source=f"measured by costmodels.profiler on {dist.get_world_size()} ranks, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, torch {torch.__version__}",
    )


def profile_mesh(
    mesh_shape: Sequence[int] | None = None,
    axis_names: Sequence[str] | None = None,
    *,
    cache_dir: str | Path | None = None,
    force: bool = False,
    sweep: Sweep | None = None,
    progress: bool = True,
) -> tuple[HardwareProfile, Path, bool]:
    """The profile of this machine on this mesh: from the cache when a matching one is
    there, else measured (and cached). Every rank must call it, inside an initialised
    process group. Returns ``(profile, cache path, measured)``."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise ProfileError(
            "autopar: profiling needs an initialised process group; found none. Run under "
            "torchrun (`torchrun --nproc_per_node N -m autopar.cli profile`) or call "
            "torch.distributed.init_process_group first."
        )
    world = dist.get_world_size()
    shape = tuple(mesh_shape) if mesh_shape else (world,)
    if any(n < 1 for n in shape) or _prod(shape) != world:
        raise ProfileError(
            f"autopar: mesh {shape} has {_prod(shape)} ranks but {world} processes are running; "
            f"give a mesh whose sizes multiply to {world} (e.g. --mesh {world})."
        )
    names = tuple(axis_names) if axis_names else tuple(f"axis{i}" for i in range(len(shape)))
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise ProfileError(
            f"autopar: expected {len(shape)} distinct axis names for mesh {shape}; found {names}."
        )
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    dev_name, _ = _device_info(torch.device(device_type))
    machine = machine_fingerprint(dev_name)
    backend = str(dist.get_backend())
    path = cache_path(machine, backend, shape, names, cache_dir)

    cached: list[object] = [None]
    if dist.get_rank() == 0 and not force and path.is_file():
        try:
            profile = HardwareProfile.load(path)
            check_profile(
                profile, machine=machine, backend=backend, mesh_shape=shape, axis_names=names, path=path
            )
            cached[0] = profile.to_json()
        except ProfileError as e:
            print(f"{e} Re-measuring.", flush=True)
    dist.broadcast_object_list(cached, src=0)
    if cached[0] is not None:
        return HardwareProfile.from_json(cached[0]), path, False
    default = Sweep.gpu() if device_type == "cuda" else Sweep()
    profile = measure_profile(mesh, sweep or default, progress=progress)
    if dist.get_rank() == 0:
        profile.save(path)
    dist.barrier()
    return profile, path, True


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out
