"""Measure a HardwareProfile on the real mesh (run on every rank, e.g. under torchrun).

For each mesh axis, every collective runs on every group of that axis at once (as in
training), over a sweep of message sizes; alpha and beta come from a least-squares fit
of ``t = alpha + factor(N) X / beta``. Matmuls, fused attention (forward and backward)
and one representative op of every pointwise kind (``timing.POINTWISE_CALLS``: an add
for the bandwidth-bound kind, gelu, gelu's backward, exp, tanh, silu, softmax, layer
norm and its backward) run on all ranks at once too, so a profile of ranks sharing
cores measures the rate each rank really gets.
Times are per call medians on each rank, then the slowest rank's, so every rank builds
the identical profile.

Each collective is also timed as a training step calls it (``AxisProfile.in_step``): right
after a burst of matmuls on every rank, the burst's own time (timed alone, in turns with
them) taken off. Ranks then arrive apart and buffers and communication threads are cold;
on a host whose cores the ranks share, the ones that wait also free cores for the others.
The same least-squares fit gives the in-step alpha and beta; where the times after
compute are too noisy to fit, the back-to-back fit stands in (said in its ``source``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from autopar.costmodels.cache import cache_path, check_profile, machine_fingerprint
from autopar.costmodels.fit import fit_linear, fit_per_item
from autopar.costmodels.formulas import BUS_FACTOR
from autopar.costmodels.formulas import N as N_SYM
from autopar.costmodels.opkinds import POINTWISE_KINDS
from autopar.costmodels.overlap import COLLECTIVE as OVERLAP_COLLECTIVE
from autopar.costmodels.overlap import overlap_from_times
from autopar.costmodels.presets import PRESETS
from autopar.costmodels.profile import (
    COLLECTIVES,
    DTYPES,
    AxisProfile,
    CollectiveFit,
    DeviceProfile,
    HardwareProfile,
    ProfileError,
    Rate,
    default_axis_names,
)
from autopar.costmodels.sweep import Sweep
from autopar.costmodels.timing import (
    MATMUL_LAYOUTS,
    OperandPool,
    attention_calls,
    attention_flops,
    collective_call,
    matmul_call,
    pointwise_bytes_moved,
    pointwise_call,
    timed,
)

ATTENTION_BACKWARD_FLOPS = 2.5  # flop_counter's sdpa_backward_flop_count: 5 products vs 2

# the collectives the overlap kinds run, each timed beside compute once
OVERLAP_COLLECTIVES = tuple(sorted(set(OVERLAP_COLLECTIVE.values())))


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


def _peaks(dev_name: str, matmul: dict, bandwidth: dict) -> dict:
    """Datasheet peaks for a device a preset knows (by name), else the measured rates."""

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
        peak_memory_bandwidth=max(r.rate for r in bandwidth.values()),
        peak_source="measured: no datasheet known for this device, the fitted rates stand in",
    )


def _fit(sizes, times, every: int):
    """A fit of times against sizes (``fit_linear``; ``fit_per_item`` where a size is a
    pair (items, size of one)); with ``every`` > 1 (quantities timed together, e.g.
    attention's forward and backward in turns), one fit per quantity: positions i::every."""
    def one(x, t):
        return fit_per_item(*zip(*x), t) if isinstance(x[0], tuple) else fit_linear(x, t)

    if every == 1:
        return one(sizes, times)
    return tuple(one(sizes[i::every], times[i::every]) for i in range(every))


def _measure_and_fit(measure: Callable[[int], list], sizes, repeats: int, what: str, every: int = 1):
    """Measure a sweep and fit it (``_fit``); on a noisy machine the times may not grow
    with size, so a failed fit is measured once more with three times the repeats before
    giving up. Every rank sees the same (all-reduced) times, so every rank takes the same
    branch."""
    try:
        return _fit(sizes, measure(repeats), every)
    except ValueError:
        try:
            return _fit(sizes, measure(3 * repeats), every)
        except ValueError as e:
            raise ProfileError(f"{e} (while profiling {what}, measured twice)") from None


def _collective_fit(kind: str, size: int, fit, sizes, repeats: int, how: str = "") -> CollectiveFit:
    """alpha and bus bandwidth beta from a fit of seconds against X over ``size`` ranks."""
    return CollectiveFit(
        alpha_s=fit.intercept,
        beta_bytes_per_s=float(BUS_FACTOR[kind].subs(N_SYM, size)) / fit.slope,
        source=f"{how}fit over {fit.points} sizes {min(sizes)}-{max(sizes)} B (median of {repeats} batches each), "
        f"median residual {100 * fit.median_rel_error:.1f}%",
    )


class _Measure:
    """One profiling run's state: where it runs, what it sweeps, its progress bar, and
    the hook it notifies after each fit (see ``measure_profile``)."""

    def __init__(self, device: torch.device, sweep: Sweep, bar, notify: Callable[[str, tuple], None],
                 dtypes: tuple[str, ...] = DTYPES):
        self.device, self.sweep, self.bar, self.notify, self.dtypes = device, sweep, bar, notify, dtypes
        self.pool = OperandPool(device, sweep.working_set_bytes)
        self.matmul: dict[str, Rate] = {}
        self.pointwise: dict[str, dict[str, Rate]] = {kind: {} for kind in POINTWISE_KINDS}
        self.attention: dict[str, dict[str, Rate]] = {"forward": {}, "backward": {}}
        self.overlaps: dict[str, float] = {}

    def _timed(self, label: str, calls: list, repeats: int, group=None) -> list[float]:
        sw = self.sweep
        times = timed(calls, self.device, repeats, sw.warmup, min_batch_s=sw.min_batch_s, group=group)
        self.bar.set_postfix_str(label, refresh=False)
        self.bar.update(len(times))
        return times

    def axis(self, i: int, name: str, size: int, group, link: str) -> AxisProfile:
        """Every collective on mesh axis ``i``, all its groups at once."""
        sw, fits = self.sweep, {}
        for kind in COLLECTIVES:
            if size == 1:  # nothing to measure: a collective over one rank is free
                fits[kind] = CollectiveFit(alpha_s=0.0, beta_bytes_per_s=math.inf, source="axis of size 1")
                continue
            fit = _measure_and_fit(
                lambda repeats: self._timed(
                    f"{name} {kind}", [collective_call(kind, group, b, self.device) for b in sw.comm_bytes],
                    repeats, group,
                ),
                sw.comm_bytes,
                sw.comm_repeats,
                f"{kind} on mesh axis {name!r}",
            )
            fits[kind] = _collective_fit(kind, size, fit, sw.comm_bytes, sw.comm_repeats)
            self.notify("collective", (i, kind))
        in_step = self.in_step(name, size, group, fits) if size > 1 else {}
        return AxisProfile(name=name, size=size, link=link, collectives=fits, in_step=in_step)

    def in_step(self, name: str, size: int, group, fits: dict[str, CollectiveFit]) -> dict[str, CollectiveFit]:
        """Every collective on the axis timed right after ``in_step_units`` matmuls on every
        rank, less the matmuls' time alone, and fitted as back to back; where that fails
        (times that do not grow with size, or not positive), the back-to-back fit."""
        sw, out = self.sweep, {}
        m, k, n = sw.in_step_matmul
        compute = self._step_compute()

        def after_compute(call: Callable[[], object]) -> Callable[[], None]:
            def run() -> None:
                compute()
                call()
            return run

        for kind in COLLECTIVES:
            calls = [after_compute(collective_call(kind, group, b, self.device)) for b in sw.in_step_bytes]

            def measure(repeats: int) -> list[float]:
                alone, *after = self._timed(f"{name} {kind} after compute", [compute, *calls], repeats, group)
                return [t - alone for t in after]

            try:
                fit = _measure_and_fit(measure, sw.in_step_bytes, sw.comm_repeats, f"{kind} after compute on {name!r}")
            except ProfileError as e:
                out[kind] = dataclasses.replace(fits[kind], source=f"back to back (after compute: {e})")
                continue
            out[kind] = _collective_fit(kind, size, fit, sw.in_step_bytes, sw.comm_repeats,
                                        f"after {sw.in_step_units} matmuls {m}x{k}x{n}: ")
        self.pool.release("fp32")
        return out

    def _step_compute(self) -> Callable[[], None]:
        """``in_step_units`` fp32 "nt" matmuls of ``in_step_matmul``: about a layer's forward."""
        m, k, n = self.sweep.in_step_matmul
        unit = matmul_call(m, k, n, "fp32", "nt", self.pool)

        def compute() -> None:
            for _ in range(self.sweep.in_step_units):
                unit()
        return compute

    def overlap(self, name: str, group) -> dict[str, float]:
        """Per overlap kind (``costmodels.overlap``): its collective, at the largest in-step size,
        timed alone, ``in_step_units`` matmuls timed alone, and the two issued together (the
        collective started asynchronously, the matmuls run, then waited for): the part of the
        shorter hidden (``overlap_from_times``). Gathers in forward and again in backward are
        one measurement."""
        sw, out = self.sweep, {}
        compute = self._step_compute()
        for collective in OVERLAP_COLLECTIVES:
            start = collective_call(collective, group, sw.in_step_bytes[-1], self.device, async_op=True)

            def alone() -> None:
                start().wait()

            def together() -> None:
                work = start()
                compute()
                work.wait()

            comm, work, both = self._timed(f"{name} {collective} beside compute", [alone, compute, together],
                                           sw.repeats, group)
            hidden = overlap_from_times(comm, work, both)
            out |= {kind: hidden for kind, c in OVERLAP_COLLECTIVE.items() if c == collective}
        self.pool.release("fp32")
        return out

    def compute(self, dtype: str) -> None:
        """Every pointwise kind, attention and matmul in ``dtype`` (one operand pool alive).
        Matmuls come last: they are most of a training step's time, and a step timed right
        after the profile (the accuracy benchmark) then follows its rate closest."""
        self._pointwise(dtype)
        self._attention(dtype)
        self._matmul(dtype)
        self.pool.release(dtype)

    def _matmul(self, dtype: str) -> None:
        sw, pool = self.sweep, self.pool
        shapes = [(m, k, n, lay) for m, k, n in sw.matmuls(dtype) for lay in MATMUL_LAYOUTS]
        fit = _measure_and_fit(
            lambda repeats: self._timed(
                f"matmul {dtype}", [matmul_call(m, k, n, dtype, lay, pool) for m, k, n, lay in shapes], repeats
            ),
            [2 * m * k * n for m, k, n, _ in shapes],
            sw.repeats,
            f"{dtype} matmul",
        )
        self.matmul[dtype] = Rate(latency_s=fit.intercept, rate=1.0 / fit.slope)
        self.notify("matmul", (dtype,))

    def _pointwise(self, dtype: str) -> None:
        sw, pool = self.sweep, self.pool
        for kind in POINTWISE_KINDS:
            sizes = sw.pointwise_sizes(kind, dtype)
            fit = _measure_and_fit(
                lambda repeats: self._timed(
                    f"{kind} {dtype}", [pointwise_call(kind, n, dtype, pool) for n in sizes], repeats
                ),
                [pointwise_bytes_moved(kind, n, dtype) for n in sizes],
                sw.repeats,
                f"{dtype} {kind}",
            )
            self.pointwise[kind][dtype] = Rate(
                latency_s=fit.intercept, rate=1.0 / fit.slope, points=[list(p) for p in fit.data]
            )
            self.notify("pointwise", (kind, dtype))

    def _attention(self, dtype: str) -> None:
        sw = self.sweep
        shapes = sw.attentions(dtype)
        # (heads, FLOPs of one head) of each: backward does 2.5x the FLOPs on the same heads
        amounts = [(b * h, attention_flops(b, h, s, d) / (b * h)) for b, h, s, d in shapes]
        rotation = sw.working_set_bytes // 4  # compute-bound: a smaller rotation (its graphs hold memory)
        fits = _measure_and_fit(
            lambda repeats: self._timed(
                f"attention {dtype}",
                [c for shape in shapes for c in attention_calls(shape, dtype, self.device, rotation)],
                repeats,
            ),
            [x for n, f in amounts for x in ((n, f), (n, ATTENTION_BACKWARD_FLOPS * f))],
            sw.repeats,
            f"{dtype} attention",
            every=2,
        )
        for direction, fit in zip(("forward", "backward"), fits):
            biggest, seconds = fit.points[-1]  # beyond the biggest head measured: its rate
            self.attention[direction][dtype] = Rate(latency_s=fit.intercept, rate=biggest / seconds,
                                                    points=[list(p) for p in fit.points])
        self.notify("attention", (dtype,))

    def profile(self, shape: tuple[int, ...], axes: list[AxisProfile], provisional: bool = False) -> HardwareProfile:
        """The profile measured so far. ``provisional``: dtypes not yet measured take the
        first dtype's rates (said in ``source``), so that the profile is complete enough to
        plan an fp32 model with while the rest is measured."""
        first = DTYPES[0]

        def filled(table: dict[str, Rate]) -> dict[str, Rate]:
            return {d: table.get(d, table[first]) for d in self.dtypes} if provisional else table

        dev_name, mem = _device_info(self.device)
        matmul = filled(self.matmul)
        device_profile = DeviceProfile(
            name=dev_name,
            memory_bytes=mem,
            matmul=matmul,
            pointwise={k: filled(v) for k, v in self.pointwise.items()},
            attention={k: filled(v) for k, v in self.attention.items()},
            **_peaks(dev_name, matmul, filled(self.pointwise["memory"])),
        )
        missing = [d for d in self.dtypes if d not in self.matmul]
        return HardwareProfile(
            machine=machine_fingerprint(dev_name),
            backend=str(dist.get_backend()),
            mesh_shape=shape,
            device=device_profile,
            axes=axes,
            overlap=dict(self.overlaps),
            source=f"measured by autopar.costmodels.profiler on {dist.get_world_size()} ranks, "
            f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, torch {torch.__version__}"
            + (f"; provisional: {', '.join(missing)} not yet measured, {first}'s rates stand in" if missing else ""),
        )


def _device_of(mesh) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")


def _twin(i: int, shape: tuple[int, ...], links: list[str], device: torch.device) -> int | None:
    """An earlier axis that axis ``i`` rides like: on a CPU host every group of a size
    reaches its peers through the same memory, whichever ranks it holds (on GPUs the
    links between pairs differ, so each axis is measured)."""
    if device.type != "cpu" or links[i] != "intra_node" or shape[i] == 1:
        return None
    return next((j for j in range(i) if shape[j] == shape[i] and links[j] == links[i]), None)


def _as_twin(twin: AxisProfile, name: str) -> AxisProfile:
    def told(fits: dict[str, CollectiveFit]) -> dict[str, CollectiveFit]:
        return {k: dataclasses.replace(f, source=f"as mesh axis {twin.name!r} (same size, same host): {f.source}")
                for k, f in fits.items()}

    return dataclasses.replace(twin, name=name, collectives=told(twin.collectives), in_step=told(twin.in_step))


def _chosen_dtypes(dtypes: Sequence[str]) -> tuple[str, ...]:
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise ProfileError(f"autopar: cannot profile dtypes {unknown}; expected some of {list(DTYPES)}.")
    return tuple(d for d in DTYPES if d == DTYPES[0] or d in dtypes)  # fp32 always: optimizers step in it


def measure_profile(
    mesh, sweep: Sweep = Sweep(), *, dtypes: Sequence[str] = DTYPES, progress: bool = True,
    on_fit: Callable[[str, tuple], None] | None = None
) -> HardwareProfile:
    """Measure a profile of ``mesh`` (a DeviceMesh); every rank must call it.

    ``dtypes``: the compute dtypes to measure (fp32 always; ``add_dtypes`` adds others to
    the profile later). An axis of a CPU host with the size of one measured already takes
    its fits (``_twin``). Order: the collectives of every axis, then fp32 compute (matmuls
    last), then bf16 and fp16 compute, so that what an fp32 training step uses is measured
    together, its largest part last. ``on_fit(what, key)``, if given, is called on every rank right
    after each fit: ``("collective", (axis, kind))``, ``("pointwise", (kind, dtype))``,
    ``("attention", (dtype,))``, ``("matmul", (dtype,))``, and ``("fp32", (profile,))``
    once every axis and fp32 compute are measured, with the profile so far
    (``_Measure.profile``: fp32's rates standing in for the dtypes not yet measured) --
    e.g. to time other sizes of the same quantity, or plan and time a training step,
    while the machine is in the state the fits saw (the accuracy benchmark)."""
    device = _device_of(mesh)
    names = tuple(mesh.mesh_dim_names or default_axis_names(mesh.ndim))
    shape = tuple(mesh.shape)
    dtypes = _chosen_dtypes(dtypes)
    links = [_axis_link(mesh.get_group(i), device) for i in range(mesh.ndim)]
    twins = [_twin(i, shape, links, device) for i in range(mesh.ndim)]
    measured = [i for i in range(mesh.ndim) if shape[i] > 1 and twins[i] is None]
    total = (
        len(measured) * len(COLLECTIVES) * (len(sweep.comm_bytes) + 1 + len(sweep.in_step_bytes))
        + (3 * len(OVERLAP_COLLECTIVES) if max(shape) > 1 else 0)
        + sum(sweep.compute_calls(d) for d in dtypes)
    )
    from tqdm import tqdm

    bar = tqdm(total=total, desc="autopar profile", disable=not progress or dist.get_rank() != 0, leave=False)
    run = _Measure(device, sweep, bar, on_fit or (lambda what, key: None), dtypes)
    axes: list[AxisProfile] = []
    for i, (name, size) in enumerate(zip(names, shape)):
        twin = twins[i]
        axes.append(_as_twin(axes[twin], name) if twin is not None else
                    run.axis(i, name, size, mesh.get_group(i), links[i]))
    if max(shape) > 1:  # on the largest axis: where data parallelism runs its gradient buckets
        widest = shape.index(max(shape))
        run.overlaps = run.overlap(names[widest], mesh.get_group(widest))
    run.compute(dtypes[0])
    run.notify("fp32", (run.profile(shape, axes, provisional=True),))
    for dtype in dtypes[1:]:
        run.compute(dtype)
    bar.close()
    return run.profile(shape, axes)


def add_dtypes(profile: HardwareProfile, mesh, dtypes: Sequence[str], sweep: Sweep = Sweep(), *,
               progress: bool = True) -> HardwareProfile:
    """``profile`` (measured on ``mesh``) with the compute of ``dtypes`` it lacks measured and
    added; the mesh's collectives stand. Every rank must call it."""
    device = _device_of(mesh)
    have = profile.device.dtypes
    wanted = tuple(d for d in _chosen_dtypes((*have, *dtypes)) if d not in have)
    if not wanted:
        return profile
    from tqdm import tqdm

    bar = tqdm(total=sum(sweep.compute_calls(d) for d in wanted), desc=f"autopar profile {' '.join(wanted)}",
               disable=not progress or dist.get_rank() != 0, leave=False)
    run = _Measure(device, sweep, bar, lambda what, key: None, wanted)
    for dtype in wanted:
        run.compute(dtype)
    bar.close()
    dev = profile.device
    matmul = dev.matmul | run.matmul
    pointwise = {k: v | run.pointwise[k] for k, v in dev.pointwise.items()}
    device_profile = dataclasses.replace(
        dev, matmul=matmul, pointwise=pointwise,
        attention={k: v | run.attention[k] for k, v in dev.attention.items()},
        **_peaks(dev.name, matmul, pointwise["memory"]))
    return dataclasses.replace(profile, device=device_profile,
                               source=f"{profile.source}; {', '.join(wanted)} added "
                                      f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}")


def profile_mesh(
    mesh_shape: Sequence[int] | None = None,
    axis_names: Sequence[str] | None = None,
    *,
    cache_dir: str | Path | None = None,
    force: bool = False,
    sweep: Sweep | None = None,
    progress: bool = True,
    dtypes: Sequence[str] = DTYPES,
) -> tuple[HardwareProfile, Path, bool]:
    """The profile of this machine on this mesh with the compute of ``dtypes`` (fp32
    always): from the cache when a matching one is there (a cached one lacking some of
    ``dtypes`` has them measured and added), else measured (and cached). Every rank must
    call it, inside an initialised process group. Returns ``(profile, cache path, measured)``."""
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
    names = tuple(axis_names) if axis_names else default_axis_names(len(shape))
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
    sweep = sweep or (Sweep.gpu() if device_type == "cuda" else Sweep())
    dtypes = _chosen_dtypes(dtypes)
    if cached[0] is not None:
        profile = HardwareProfile.from_json(cached[0])
        if set(dtypes) <= set(profile.device.dtypes):
            return profile, path, False
        profile = add_dtypes(profile, mesh, dtypes, sweep, progress=progress)
    else:
        profile = measure_profile(mesh, sweep, dtypes=dtypes, progress=progress)
    if dist.get_rank() == 0:
        profile.save(path)
    dist.barrier()
    return profile, path, True


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out
