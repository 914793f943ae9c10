"""HardwareProfile: the measured (or sourced) numbers every cost function reads.

Plain dataclasses with an exact JSON round-trip. One profile describes one device
kind on one mesh: the device's compute and memory rates, and for every mesh axis the
latency alpha and bandwidth beta of each collective on that axis, fitted to

    t = alpha + factor(N) * X / beta          (see ``formulas.COLLECTIVE_TIME``)

where X is the collective's buffer size in bytes and beta is the *bus* bandwidth in
nccl-tests' sense (so published nccl-tests ``busbw`` figures drop straight in).
Compute follows the same fixed-cost-plus-rate form: ``t = latency + amount / rate``,
with one rate per kind of op (``autopar.costmodels.opkinds``): matmuls and fused attention in
FLOP/s, pointwise kinds in effective bytes/s. Fused attention is priced head by head:
its rates keep measured points per head (batch x heads of them in an op), since a CPU
kernel runs a bigger head at a higher FLOP rate.

An axis also keeps each collective as a training step meets it (``AxisProfile.in_step``):
called right after compute, where the ranks arrive apart and the buffers and the
communication threads are cold, a collective takes longer than back to back (on 2 or 4
gloo ranks sharing 2 cores, a 2 MiB all-reduce 1.4-1.9x). The profiler fits those the
same way from collectives timed after a burst of matmuls. Plans and steps price an
activation's moves by them (``collective_time(..., in_step=True)``); a parameter's
bucketed collectives, and single collectives timed back to back, by the others. A
profile without them (the presets) prices both alike.

JSON is strict (no ``Infinity``): the bandwidth of an axis of size 1, where nothing
moves and a collective is free, is infinite in memory and ``null`` on disk.
Format version 2 added the per-kind pointwise and the attention rates, version 3 the
attention's measured points per head, version 4 the collectives after compute; an older file is
refused with a clear error, and the profile cache re-measures it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autopar.costmodels.opkinds import ATTENTION_DIRECTIONS, POINTWISE_KINDS
from autopar.costmodels.overlap import KINDS


def default_axis_names(ndim: int) -> tuple[str, ...]:
    """The names of a mesh's axes when none are given: ``axis0``, ``axis1``, ... Printed
    beside what the axis does in a plan (``autopar.passes.roles.label_axes``)."""
    return tuple(f"axis{i}" for i in range(ndim))


def is_default_axis_name(name: str) -> bool:
    """Whether ``name`` is one ``default_axis_names`` gives (a pipeline's stage mesh keeps
    its axes' names from the whole mesh: ``axis1``, ``axis2``)."""
    return re.fullmatch(r"axis\d+", name) is not None

PROFILE_VERSION = 4

DTYPES = ("fp32", "bf16", "fp16")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
LINKS = ("intra_node", "inter_node")


class ProfileError(ValueError):
    """A profile that is missing, corrupt, or does not match the machine or mesh."""


class MissingRates(ProfileError):
    """A price asked of a profile in a dtype it did not measure."""

    def __init__(self, dtype: str, measured: tuple[str, ...]):
        self.dtype, self.measured = dtype, tuple(measured)
        super().__init__(
            f"autopar: this hardware profile has no {dtype} rates (it measured {', '.join(measured)}); a model "
            f"that computes in {dtype} needs them: measure them with `autopar profile --dtypes "
            f"{' '.join((*measured, dtype))}` under torchrun (autopar.compile measures them itself)."
        )

    def __reduce__(self):  # raised in a worker process, re-raised in the planner's
        return MissingRates, (self.dtype, self.measured)


@dataclass(kw_only=True)
class Rate:
    """``t = latency_s + amount / rate``: a fixed cost and a sustained rate.

    ``rate`` is FLOP/s for matmuls and attention, effective bytes/s for pointwise ops.
    ``points``, where measured, are (amount, seconds) pairs: between them the time is
    interpolated (``segment``). Pointwise kinds keep the sizes their fit came from, since
    a CPU moves bytes faster while an op's tensors fit in its caches than when they
    stream from memory, a curve no single line follows within 15%. Attention keeps them
    per head (FLOPs of one head, seconds of one head beyond the op's fixed cost), since a
    CPU kernel runs a bigger head at a higher FLOP rate (1.4x from 2 to 17 MFLOP heads
    here).
    """

    latency_s: float
    rate: float
    points: list[list[float]] = field(default_factory=list)
    # matmul rates only, 0 where not known (measured profiles): ``rate`` is then the rate
    # of large matmuls, and a smaller one runs slower (``compute.matmul_efficiency``): at
    # half the rate for a square one of ``work_half`` FLOPs (too few tiles to fill the
    # GPU), and by d / (d + ``dim_half``) where d is its size (3 / (1/m + 1/n + 1/k)).
    work_half: float = 0.0
    dim_half: float = 0.0

    def __post_init__(self) -> None:
        if not (self.rate > 0 and self.latency_s >= 0 and self.work_half >= 0 and self.dim_half >= 0):
            raise ProfileError(
                f"autopar: a Rate needs rate > 0 and latency_s, work_half, dim_half >= 0; found "
                f"rate={self.rate}, latency_s={self.latency_s}, work_half={self.work_half}, "
                f"dim_half={self.dim_half}. Re-measure with `autopar profile --force`."
            )
        self.points = sorted([float(x), float(t)] for x, t in self.points)
        if any(not (x > 0 and t > 0) for x, t in self.points):
            raise ProfileError(
                f"autopar: a Rate's measured points need positive amounts and times; found {self.points}. "
                f"Re-measure with `autopar profile --force`."
            )

    def segment(self, amount: float, start: float | None = None) -> tuple[float, float]:
        """(fixed cost, rate) of the straight piece that prices ``amount``: through the
        measured points (made non-decreasing, from (0, ``start``), by default (0,
        latency_s)), and beyond the last one at the fitted rate; without points, the
        fitted line itself. Continuous and non-decreasing in ``amount``."""
        if not self.points:
            return self.latency_s, self.rate
        x0, t0 = 0.0, self.latency_s if start is None else start
        for x1, t1 in self.points:
            t1 = max(t1, t0)
            if amount <= x1:
                if t1 == t0:
                    return t0, math.inf
                slope = (t1 - t0) / (x1 - x0)
                return t0 - slope * x0, 1.0 / slope
            x0, t0 = x1, t1
        return t0 - x0 / self.rate, self.rate

@dataclass(kw_only=True)
class CollectiveFit:
    """alpha (s) and bus bandwidth beta (bytes/s) of one collective on one axis."""

    alpha_s: float
    beta_bytes_per_s: float
    source: str = ""  # where the numbers came from (fit residual, or citation)

    def __post_init__(self) -> None:
        if not (self.beta_bytes_per_s > 0 and self.alpha_s >= 0):
            raise ProfileError(
                f"autopar: a CollectiveFit needs beta > 0 and alpha >= 0; found "
                f"alpha={self.alpha_s}, beta={self.beta_bytes_per_s}. Re-measure with "
                f"`autopar profile --force`."
            )


def _fit(d: dict) -> CollectiveFit:
    """A CollectiveFit from JSON, where a null bandwidth means no link (an axis of size 1)."""
    beta = d["beta_bytes_per_s"]
    return CollectiveFit(**{**d, "beta_bytes_per_s": math.inf if beta is None else beta})


@dataclass(kw_only=True)
class AxisProfile:
    name: str
    size: int
    link: str  # one of LINKS: the link this axis's groups ride
    collectives: dict[str, CollectiveFit]  # timed back to back
    # timed right after compute, as a training step calls them; empty: as back to back
    in_step: dict[str, CollectiveFit] = field(default_factory=dict)
    # a low-latency protocol the library switches to for small buffers (NCCL's LL: less
    # latency per step, a quarter of the bandwidth); a collective costs the faster of the
    # two. Empty: one protocol (a measured profile's fits are what was measured)
    low_latency: dict[str, CollectiveFit] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.link not in LINKS:
            raise ProfileError(
                f"autopar: mesh axis {self.name!r} has link {self.link!r}; expected one of " f"{list(LINKS)}."
            )
        unknown = [c for c in (*self.in_step, *self.low_latency) if c not in COLLECTIVES]
        if unknown:
            raise ProfileError(
                f"autopar: mesh axis {self.name!r} has in-step fits for unknown collectives {unknown}; "
                f"expected some of {list(COLLECTIVES)}. Re-measure with `autopar profile --force`."
            )
        missing = [c for c in COLLECTIVES if c not in self.collectives]
        if missing:
            raise ProfileError(
                f"autopar: mesh axis {self.name!r} has no fit for {missing}; every axis needs "
                f"{list(COLLECTIVES)}. Re-measure with `autopar profile --force`."
            )


@dataclass(kw_only=True)
class DeviceProfile:
    name: str
    memory_bytes: int
    matmul: dict[str, Rate]  # dtype -> achieved matmul (latency, FLOP/s)
    # pointwise kind (opkinds.POINTWISE_KINDS) -> dtype -> achieved (latency, effective
    # bytes/s, every input and output counted once); "memory" is the memory bandwidth
    pointwise: dict[str, dict[str, Rate]]
    # "forward" / "backward" -> dtype -> fused attention (latency, FLOP/s as
    # torch.utils.flop_counter counts them: the whole score matrix, causal or not, and
    # where measured the points per head: (FLOPs of a head, seconds of a head))
    attention: dict[str, dict[str, Rate]]
    peak_matmul_flops: dict[str, float]  # dtype -> datasheet peak (dense)
    peak_memory_bandwidth: float  # bytes/s, datasheet
    peak_source: str = ""

    def __post_init__(self) -> None:
        tables = [("matmul", self.matmul)]
        for group, keys in (("pointwise", POINTWISE_KINDS), ("attention", ATTENTION_DIRECTIONS)):
            have = getattr(self, group)
            missing = [k for k in keys if k not in have]
            if missing:
                raise ProfileError(
                    f"autopar: device {self.name!r} has no {group} rates for {missing}; expected all "
                    f"of {list(keys)}. Re-measure with `autopar profile --force`."
                )
            tables += [(f"{group} {k}", have[k]) for k in keys]
        if DTYPES[0] not in self.matmul or any(d not in DTYPES for d in self.matmul):
            raise ProfileError(
                f"autopar: device {self.name!r} has matmul rates for {list(self.matmul)}; expected "
                f"{DTYPES[0]!r} and any of {list(DTYPES[1:])}. Re-measure with `autopar profile --force`."
            )
        for what, table in tables:
            missing = [d for d in self.matmul if d not in table]
            if missing:
                raise ProfileError(
                    f"autopar: device {self.name!r} has no {what} rate for {missing}; "
                    f"expected all of {list(self.matmul)}. Re-measure with `autopar profile --force`."
                )

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtypes this device's rates were measured (or published) for."""
        return tuple(d for d in DTYPES if d in self.matmul)

    def require(self, dtype: str) -> None:
        """Raise ``MissingRates`` where ``dtype`` was not measured (a profile measures the
        dtypes its model computes in: ``profiler.profile_mesh(dtypes=)``)."""
        if dtype not in self.matmul:
            raise MissingRates(dtype, self.dtypes)

    def bandwidth(self, dtype: str) -> Rate:
        """The memory-bound pointwise rate (an add): bytes/s and fixed cost."""
        return self.pointwise["memory"][dtype]


@dataclass(kw_only=True)
class HardwareProfile:
    machine: str  # fingerprint of the machine it was measured on, or "preset:<name>"
    backend: str  # "nccl", "gloo" or "preset"
    mesh_shape: tuple[int, ...]
    device: DeviceProfile
    axes: list[AxisProfile]
    source: str = ""  # how it was made: command, date, preset citation
    # collective kind (``overlap.KINDS``) -> the part of its time hidden when it runs beside
    # compute (``costmodels.overlap``); a kind not here hides nothing
    overlap: dict[str, float] = field(default_factory=dict)
    version: int = PROFILE_VERSION
    _axis_index: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.mesh_shape = tuple(int(n) for n in self.mesh_shape)
        sizes = tuple(a.size for a in self.axes)
        if sizes != self.mesh_shape:
            raise ProfileError(
                f"autopar: profile axes have sizes {sizes} but mesh_shape is {self.mesh_shape}; "
                f"they must agree. Re-measure with `autopar profile --force`."
            )
        self._axis_index = {a.name: i for i, a in enumerate(self.axes)}
        bad = {k: v for k, v in self.overlap.items() if k not in KINDS or not 0.0 <= v <= 1.0}
        if bad:
            raise ProfileError(
                f"autopar: profile overlap {bad} is not understood; expected kinds among {list(KINDS)}, "
                f"each a share of its time hidden, in [0, 1]. Re-measure with `autopar profile --force`."
            )

    # -- lookup -------------------------------------------------------------------------
    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    def axis(self, axis: int | str) -> AxisProfile:
        """The profile of a mesh axis, by index or by name."""
        if isinstance(axis, str):
            if axis not in self._axis_index:
                raise ProfileError(
                    f"autopar: no mesh axis named {axis!r} in this profile; it has "
                    f"{list(self.axis_names)}."
                )
            return self.axes[self._axis_index[axis]]
        if not 0 <= axis < len(self.axes):
            raise ProfileError(
                f"autopar: mesh axis {axis} is out of range for a profile of mesh "
                f"{self.mesh_shape} (axes 0..{len(self.axes) - 1})."
            )
        return self.axes[axis]

    def fit(self, collective: str, axis: int | str) -> CollectiveFit:
        fits = self.axis(axis).collectives
        if collective not in fits:
            raise ProfileError(
                f"autopar: unknown collective {collective!r}; expected one of {list(COLLECTIVES)}."
            )
        return fits[collective]

    def check_mesh(self, mesh_shape: tuple[int, ...]) -> None:
        """Raise unless this profile was made for ``mesh_shape``."""
        if tuple(mesh_shape) != self.mesh_shape:
            raise ProfileError(
                f"autopar: this hardware profile was made for mesh {self.mesh_shape}, but the "
                f"plan uses mesh {tuple(mesh_shape)}. Profile that mesh (`autopar profile "
                f"--mesh {'x'.join(map(str, mesh_shape))}`) or build a preset for it "
                f"(`autopar.costmodels.preset(name, mesh_shape)`)."
            )

    # -- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("_axis_index")
        d["mesh_shape"] = list(self.mesh_shape)
        for axis in d["axes"]:  # strict JSON has no Infinity: a size-1 axis has no link
            for fit in [*axis["collectives"].values(), *axis["in_step"].values(), *axis["low_latency"].values()]:
                if fit["beta_bytes_per_s"] == math.inf:
                    fit["beta_bytes_per_s"] = None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> HardwareProfile:
        try:
            if d.get("version") != PROFILE_VERSION:
                raise ProfileError(
                    f"autopar: profile format version {d.get('version')!r}; this autopar reads "
                    f"version {PROFILE_VERSION}. Re-measure with `autopar profile --force`."
                )
            dev = dict(d["device"])
            dev["matmul"] = {k: Rate(**v) for k, v in dev["matmul"].items()}
            for group in ("pointwise", "attention"):
                dev[group] = {k: {t: Rate(**r) for t, r in v.items()} for k, v in dev[group].items()}
            axes = [
                AxisProfile(**{**a, "collectives": {k: _fit(v) for k, v in a["collectives"].items()},
                               "in_step": {k: _fit(v) for k, v in a.get("in_step", {}).items()},
                               "low_latency": {k: _fit(v) for k, v in a.get("low_latency", {}).items()}})
                for a in d["axes"]
            ]
            rest = {k: v for k, v in d.items() if k not in ("device", "axes", "mesh_shape")}
            return cls(**rest, mesh_shape=tuple(d["mesh_shape"]), device=DeviceProfile(**dev), axes=axes)
        except ProfileError:
            raise
        except (KeyError, TypeError, AttributeError) as e:
            raise ProfileError(
                f"autopar: a hardware profile must hold machine, backend, mesh_shape, device "
                f"and axes (format version {PROFILE_VERSION}); this one does not ({type(e).__name__}: "
                f"{e}). Delete it or re-measure with `autopar profile --force`."
            ) from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> HardwareProfile:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(
                f"autopar: a hardware profile must be JSON; this is not ({e}). Delete it or "
                f"re-measure with `autopar profile --force`."
            ) from None
        if not isinstance(d, dict):
            raise ProfileError(
                f"autopar: a hardware profile must be a JSON object; found {type(d).__name__}. "
                f"Delete it or re-measure with `autopar profile --force`."
            )
        return cls.from_dict(d)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")  # one per writer: two may save at once
        tmp.write_text(self.to_json())
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        path = Path(path)
        if not path.is_file():
            raise ProfileError(
                f"autopar: expected a hardware profile at {path}, found nothing. Measure one "
                f"with `torchrun --nproc_per_node N -m autopar.cli profile` or use a preset "
                f"(hardware='h100')."
            )
        return cls.from_json(path.read_text())
