"""Pins: the parts of a layout the user fixes, the rest searched (``autopar.Constraints``).

``Constraints`` is any subset of:

- a whole manual layout: ``layout`` (``"fsdp+tp"``, ``"pp+fsdp+tp"``, ``"pp4+tp+sp"``, ``"3d"``:
  ``layout_placements.layout_parts``): its placements of every parameter and input and its
  ZeRO levels, as ``autopar.passes.planner.layouts`` lays them on the intra-op mesh, with no
  pipeline for an intra-op layout, and with one (its depth searched, or named, or ``pp=``) for a
  pipelined one; what ``autopar.plan(..., layout=)`` pins;
- the mesh: a degree per role (``tp=8``: tensor parallel over mesh axes whose sizes multiply
  to 8; ``dp=8``: data parallel so; ``pp=4``: four pipeline stages) and which axis plays which
  role (``axes=("dp", "tp")``, one role or None per axis of the mesh as given; ``"pp"`` only
  on the outermost axis, which the pipeline takes whole); degrees no whole axes multiply to
  (``tp=2, dp=2`` on a mesh of 4) split an axis (``autopar.passes.planner.mesh_split``);
- the pipeline: ``micro_batches``, ``schedule`` (``"1f1b"``, ``"gpipe"``,
  ``"interleaved_1f1b"``), ``chunks`` (chunks per rank of the interleaved schedule),
  ``stage_starts`` (the repeated layers, by module name, where stages 2, 3, ... begin: as many
  stages as names and one; P ranks of v chunks each run P * v stages, v as ``chunks``, a V-shaped
  schedule (2) or ``pp`` say, else 1: ``Constraints.starts_chunks``; ``autopar.passes.planner.stage_starts``);
- ZeRO: ``zero`` (0-3 for every parameter) and ``zero_by_name`` (fully-qualified-name
  patterns -> level; the first pattern that matches wins, over ``zero``);
- recomputation: ``recompute`` ``"none"``, ``"all"`` or the repeated layers' numbers;
- parameters: ``params`` (fully-qualified-name patterns -> placement): stored as ``"S(0)R"``
  says, one placement per axis of the mesh as given, or as Megatron's ``"colwise"`` /
  ``"rowwise"`` on the tensor-parallel axes (a linear's weight by output or input features);
- module outputs: ``outputs`` (module-name patterns -> placement): the value a module's forward
  returns placed as ``"S(1)R"`` says, or on the tensor-parallel axes as DTensor's plans leave
  it: ``"sequence"`` split along the sequence dim (dim 1, ``SequenceParallel``'s), ``"colwise"``
  split along the last dim (``ColwiseParallel``'s ``Shard(-1)``). Not ``"rowwise"``: a row-split
  linear makes partial sums, which the plan reduces on the way to each reader (all-reduce or
  reduce-scatter, as priced), so its output has no one placement to pin; pin the placement of
  a module after the sum (a block's output, ``R`` on the tensor-parallel axis) instead.
  An output is the value as the module's last op makes it: a pin never holds a partial sum.

A role is what the axis does to the batch and to the weights (``AxisPin``): a tensor-parallel
axis keeps the batch whole and uses every weight where it is stored (Megatron: no gather);
a data-parallel axis splits the inputs' batch and reads every weight whole (stored whole, or
split and gathered: FSDP); with ``tp`` pinned the other axes use weights whole, with ``dp``
pinned they keep the batch whole, so a degree is exact. ZeRO levels 0-2 store a parameter as
its ops use it (the ZeRO node's level: the optimizer state, gradients split); level 3 stores
it split where a reader gathers it. The planner turns these into restrictions of its one
integer program and of the pipeline search (``autopar.passes.planner.pin_restrictions``,
``autopar.passes.planner.pipeline``), and checks a plan against them (``honours``).

Written as the command line takes them: ``layout=pp+fsdp+tp tp=8 pp=4 micro_batches=16 schedule=1f1b chunks=2
zero=1 zero:embed_tokens=0 recompute=none axes=pp,dp,tp layers.*.mlp.down_proj=rowwise
stage_starts=model.layers.16,model.layers.32 output:layers.*.input_layernorm=sequence``
(``Constraints.from_pins``); as JSON, the fields (``Constraints.from_dict``).
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterable, Mapping, Sequence

from autopar.costmodels.schedules import Schedule
from autopar.passes.placements import parse_spec
from autopar.passes.planner.layout_placements import axis_roles, layout_parts
from autopar.passes.roles import AxisRole

ROLES = ("pp", "dp", "tp")
RECOMPUTE = ("none", "all")
ZERO_LEVELS = (0, 1, 2, 3)
MEGATRON_ROLES = ("colwise", "rowwise")  # as DTensor's parallelize_module names them
OUTPUT_ROLES = ("sequence", "colwise")  # a module's output as DTensor's plans leave it (module docstring)
# the command line's other spellings of a field's name
_ALIASES = {"microbatches": "micro_batches", "micro-batches": "micro_batches", "chunks_per_rank": "chunks",
            "interleave": "chunks"}


@dataclass(frozen=True, kw_only=True)
class Constraints:
    """Pins on the layout (module docstring); a field left None is searched."""

    layout: str | None = None  # a whole manual layout's placements and ZeRO levels (``layout_parts``)
    tp: int | None = None
    dp: int | None = None
    pp: int | None = None
    axes: tuple[str | None, ...] | None = None  # a role per mesh axis as given ("pp", "dp", "tp" or None)
    micro_batches: int | None = None
    schedule: Schedule | None = None
    chunks: int | None = None  # chunks per rank (1: not interleaved)
    # where stages 2, 3, ... begin: a repeated layer's module name each ("model.layers.16"), in
    # order; a comma-separated string is accepted
    stage_starts: tuple[str, ...] = ()
    zero: int | None = None
    zero_by_name: tuple[tuple[str, int], ...] = ()  # (pattern, level); a mapping is accepted
    recompute: str | tuple[int, ...] | None = None  # "none", "all" or layer numbers
    # (pattern, placement): parameters stored as "S(0)R" says (one placement per mesh axis as
    # given), or as Megatron's "colwise" / "rowwise" on the tensor-parallel axes; a mapping is
    # accepted; the first pattern that matches wins
    params: tuple[tuple[str, str], ...] = ()
    # (pattern, placement): the output of each module named placed as "S(1)R" says, or as one of
    # OUTPUT_ROLES on the tensor-parallel axes; a mapping is accepted; the first pattern that matches wins
    outputs: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp", "micro_batches", "chunks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"autopar: pin {name} expected a positive whole number, found {value!r}; "
                                 f"pin e.g. {name}=2, or leave it out to search it")
        if self.axes is not None:
            axes = tuple(None if a in (None, "*", "") else str(a) for a in self.axes)
            bad = [a for a in axes if a is not None and a not in ROLES]
            if bad or not axes:
                raise ValueError(f"autopar: pin axes expected one role per mesh axis from {ROLES} (or * for "
                                 f"searched), found {self.axes!r}; pin e.g. axes=pp,dp,tp")
            if any(a == "pp" for a in axes[1:]):
                raise ValueError(f"autopar: pin axes={','.join(a or '*' for a in axes)} puts the pipeline on an "
                                 "inner axis; expected pp on the outermost axis (axis 0, the slow links) only; "
                                 "order the mesh with its pipeline axis first")
            object.__setattr__(self, "axes", axes)
        if self.schedule is not None:
            try:
                object.__setattr__(self, "schedule", Schedule.parse(self.schedule))
            except ValueError:
                raise ValueError(f"autopar: pin schedule={self.schedule!r} names no schedule; expected one of "
                                 f"{[s.value for s in Schedule]}") from None
        if self.chunks is not None and self.schedule is not None and (
                problem := self.schedule.chunks_problem(self.chunks)):
            runs = 2 if self.schedule.v_shaped else 1
            raise ValueError(f"autopar: pin schedule={self.schedule}: {problem}, and chunks={self.chunks} says "
                             f"otherwise; pin chunks={runs} with it, or another schedule")
        if self.chunks == 1 and self.schedule is Schedule.INTERLEAVED_1F1B:
            raise ValueError(f"autopar: pin schedule={self.schedule} runs several chunks per rank, and chunks=1 says "
                             "one; pin chunks of at least 2 with it, or another schedule")
        if self.zero is not None and self.zero not in ZERO_LEVELS:
            raise ValueError(f"autopar: pin zero expected a ZeRO level in {ZERO_LEVELS}, found {self.zero!r}")
        pairs = tuple(self.zero_by_name.items()) if isinstance(self.zero_by_name, Mapping) else tuple(
            tuple(p) for p in self.zero_by_name)
        for pattern, level in pairs:
            if not isinstance(pattern, str) or not pattern or level not in ZERO_LEVELS:
                raise ValueError(f"autopar: pin zero:{pattern}={level!r} expected a parameter-name pattern and a "
                                 f"ZeRO level in {ZERO_LEVELS}; pin e.g. zero:embed_tokens=0")
        object.__setattr__(self, "zero_by_name", pairs)
        object.__setattr__(self, "recompute", _recompute(self.recompute))
        placed = tuple(self.params.items()) if isinstance(self.params, Mapping) else tuple(tuple(p) for p in self.params)
        for pattern, placement in placed:
            if not isinstance(pattern, str) or not pattern or not _placement(placement):
                raise ValueError(f"autopar: pin {pattern}={placement!r} expected a parameter-name pattern and a "
                                 f"placement per mesh axis such as S(0)R, or one of {MEGATRON_ROLES}")
        object.__setattr__(self, "params", placed)
        outputs = tuple(self.outputs.items()) if isinstance(self.outputs, Mapping) else tuple(
            tuple(p) for p in self.outputs)
        for pattern, placement in outputs:
            if not isinstance(pattern, str) or not pattern or not _placement(placement, OUTPUT_ROLES):
                raise ValueError(f"autopar: pin output:{pattern}={placement!r} expected a module-name pattern and a "
                                 f"placement per mesh axis such as S(1)R, or one of {OUTPUT_ROLES}")
        object.__setattr__(self, "outputs", outputs)
        names = self.stage_starts.split(",") if isinstance(self.stage_starts, str) else self.stage_starts
        object.__setattr__(self, "stage_starts", tuple(str(n).strip() for n in names))
        if self.layout is not None:
            self._check_layout()
        self._check_stage_starts()
        if self.pp == 1 and self.pipelined_by_settings:
            raise ValueError(f"autopar: pins {', '.join(self.pipeline_pins())} set a pipeline, and pp=1 says none; "
                             "expected pp of at least 2 with them, or leave pp out")

    def _check_stage_starts(self) -> None:
        names = self.stage_starts
        if not names:
            return
        pin = self.pin("stage_starts")
        if not all(names) or len(set(names)) != len(names):
            raise ValueError(f"autopar: pin {pin} expected distinct module names of repeated layers, in order, "
                             "e.g. stage_starts=model.layers.16,model.layers.32")
        count = len(names) + 1
        chunks, why = self._starts_chunks(self.pp)
        if self.pp is not None and (self.pp < 2 or self.pp * chunks != count):
            raise ValueError(f"autopar: pin {pin} starts {count} pipeline stages, and pp={self.pp} cannot run them at "
                             f"{chunks} per rank ({why}); expected pp={count // chunks}, or pp left out")
        if count % chunks or count // chunks < 2:
            raise ValueError(f"autopar: pin {pin} starts {count} pipeline stages, which {chunks} per rank ({why}) "
                             f"cannot share among 2 or more pipeline ranks; expected a multiple of {chunks} stages "
                             f"of at least {2 * chunks} ({2 * chunks - 1}, {3 * chunks - 1}, ... stage starts), or "
                             "another chunk count")
        if self.schedule is not None and (problem := self.schedule.chunks_problem(chunks) or (
                chunks == 1 and self.schedule is Schedule.INTERLEAVED_1F1B and "it runs several chunks per rank")):
            raise ValueError(f"autopar: pin {pin} runs {count} stages at {chunks} per rank ({why}), and schedule="
                             f"{self.schedule} cannot: {problem}; expected chunks=, pp= or stage starts that give it "
                             "as many as it runs, or another schedule")

    def _starts_chunks(self, pp: int | None) -> tuple[int, str]:
        """(chunks per rank of the stages ``stage_starts`` names, the pin that says so): ``chunks``;
        else a V-shaped schedule's 2; else what ``pp`` ranks leave of them (their count over pp);
        else one per rank."""
        count = len(self.stage_starts) + 1
        if self.chunks is not None:
            return self.chunks, self.pin("chunks")
        if self.schedule is not None and self.schedule.v_shaped:
            return 2, self.pin("schedule")
        if pp is not None and pp > 1 and count % pp == 0:
            return count // pp, f"pp={pp}"
        return 1, "the default, with neither chunks, pp nor a V-shaped schedule pinned"

    def _check_layout(self) -> None:
        pipelined, depth, _ = layout_parts(self.layout)
        if depth is not None and self.pp not in (None, depth):
            raise ValueError(f"autopar: pin layout={self.layout} names {depth} pipeline stages, and pp={self.pp} "
                             "another; expected one depth: leave pp out, or name the layout without it")
        count = len(self.stage_starts) + 1
        if depth is not None and self.stage_starts and depth * self._starts_chunks(depth)[0] != count:
            raise ValueError(f"autopar: pin layout={self.layout} names {depth} pipeline stages, and "
                             f"{self.pin('stage_starts')} starts {count}; expected one depth: "
                             "name the layout without it")
        if depth is not None:
            object.__setattr__(self, "pp", depth)
        if pipelined and self.pp == 1:
            raise ValueError(f"autopar: pin layout={self.layout} is pipelined, and pp=1 says no pipeline; expected "
                             f"pp of at least 2, or the layout {layout_parts(self.layout)[2]} without a pipeline")
        settings = [f"pp={self.pp}"] if (self.pp or 1) > 1 else []
        settings += self.pipeline_pins()
        if not pipelined and settings:
            raise ValueError(f"autopar: pin layout={self.layout} has no pipeline, and {', '.join(settings)} "
                             f"pins one; expected the pipelined layout pp+{self.layout} (pp4+{self.layout} for "
                             "4 stages) with them, or leave them out")

    # --- reading -------------------------------------------------------------------
    @property
    def intra_layout(self) -> str | None:
        """The intra-op layout the ``layout`` pin lays on every stage's mesh (``"fsdp+tp"`` of
        ``"pp+fsdp+tp"``), or None."""
        return layout_parts(self.layout)[2] if self.layout is not None else None

    @property
    def stages(self) -> int | None:
        """The pipeline stages pinned: ``pp``; else 1 for an intra-op ``layout`` (no pipeline); else
        None (searched; a pipelined layout's at least 2)."""
        if self.pp is not None:
            return self.pp
        if self.stage_starts:
            return (len(self.stage_starts) + 1) // self.starts_chunks
        return 1 if self.layout is not None and not layout_parts(self.layout)[0] else None

    @property
    def starts_chunks(self) -> int | None:
        """Chunks per rank of the stages ``stage_starts`` names (P ranks of v chunks: P * v - 1
        starts): ``chunks``; else a V-shaped schedule's 2; else their count over ``pp``; else 1.
        None without ``stage_starts``."""
        return self._starts_chunks(self.pp)[0] if self.stage_starts else None

    @property
    def wants_pipeline(self) -> bool:
        """Whether the pins ask for a pipeline (a depth of 2 or more, a pipeline setting, a
        pipelined layout, the outermost axis's role)."""
        return ((self.stages or 1) > 1 or self.pipelined_by_settings or (self.axes or (None,))[0] == "pp"
                or self.layout is not None and layout_parts(self.layout)[0])

    @property
    def pipelined_by_settings(self) -> bool:
        """Whether a pipeline setting is pinned (micro-batches, schedule, chunks): then a plan
        without a pipeline does not honour the pins."""
        return bool(self.pipeline_pins())

    def pipeline_pins(self) -> list[str]:
        """The pipeline settings pinned, as written (``["micro_batches=16"]``)."""
        return [p for p in self.pins() if p.partition("=")[0] in ("micro_batches", "schedule", "chunks",
                                                                  "stage_starts")]

    @property
    def empty(self) -> bool:
        return not self.pins()

    def zero_of(self, fqn: str) -> int | None:
        """The ZeRO level pinned for parameter ``fqn`` (its first matching pattern, else ``zero``)."""
        for pattern, level in self.zero_by_name:
            if name_matches(pattern, fqn):
                return level
        return self.zero

    def placement_of(self, fqn: str) -> tuple[str, str] | None:
        """(pattern, placement) pinned for parameter ``fqn``: its first matching pattern, or None."""
        return next(((p, placed) for p, placed in self.params if name_matches(p, fqn)), None)

    def output_of(self, module: str) -> tuple[str, str] | None:
        """(pattern, placement) pinned for the output of the module named ``module``: its first
        matching pattern (``module_matches``), or None."""
        return next(((p, placed) for p, placed in self.outputs if module_matches(p, module)), None)

    def pin(self, name: str) -> str:
        """The pin of field ``name`` as the command line writes it (``"recompute=0,2"``)."""
        return next(p for p in self.pins() if p.partition("=")[0] == name)

    def pins(self) -> list[str]:
        """Each pin as the command line writes it: ``["tp=8", "pp=4", "zero:embed*=0"]``."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or value == ():
                continue
            if f.name == "zero_by_name":
                out += [f"zero:{pattern}={level}" for pattern, level in value]
            elif f.name == "params":
                out += [f"{pattern}={placement}" for pattern, placement in value]
            elif f.name == "outputs":
                out += [f"output:{pattern}={placement}" for pattern, placement in value]
            elif f.name == "axes":
                out.append("axes=" + ",".join(a or "*" for a in value))
            elif f.name == "stage_starts":
                out.append("stage_starts=" + ",".join(value))
            elif f.name == "recompute" and not isinstance(value, str):
                out.append("recompute=" + ",".join(map(str, value)))
            else:
                out.append(f"{f.name}={value}")
        return out

    def __str__(self) -> str:
        return ", ".join(self.pins()) or "no pins"

    # --- JSON and the command line ---------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The pinned fields only, as JSON writes them (``from_dict`` reads it back)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or value == ():
                continue
            if f.name in ("zero_by_name", "params", "outputs"):
                value = dict(value)
            elif f.name == "schedule":
                value = value.value
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Constraints:
        known = {f.name for f in fields(cls)}
        given = {_ALIASES.get(k, k): v for k, v in data.items()}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"autopar: constraints name no field {unknown}; expected some of {sorted(known)}")
        if isinstance(given.get("axes"), str):
            given["axes"] = tuple(given["axes"].split(","))
        elif given.get("axes") is not None:
            given["axes"] = tuple(given["axes"])
        if isinstance(given.get("stage_starts"), list):
            given["stage_starts"] = tuple(given["stage_starts"])
        if isinstance(given.get("recompute"), list):
            given["recompute"] = tuple(given["recompute"])
        return cls(**given)

    @classmethod
    def from_pins(cls, pins: Iterable[str]) -> Constraints:
        """``["tp=8", "pp=4", "zero:embed*=0", "dp=*"]`` (the command line's ``--pin``) as Constraints."""
        data: dict[str, Any] = {}
        by_name: list[tuple[str, int]] = []
        placed: list[tuple[str, str]] = []
        outputs: list[tuple[str, str]] = []
        for text in pins:
            key, sep, value = text.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not key or not value:
                raise ValueError(f"autopar: a pin is written KEY=VALUE (tp=8, pp=4, micro_batches=16, zero=1, "
                                 f"zero:PATTERN=LEVEL, recompute=none, axes=pp,dp,tp); found {text!r}")
            if key.startswith("zero:"):
                by_name.append((key[len("zero:"):], _whole(text, value)))
                continue
            if key.startswith("output:"):
                outputs.append((key[len("output:"):], value))
                continue
            key = _ALIASES.get(key, key)
            if key in ("tp", "dp", "pp", "micro_batches", "chunks", "zero"):
                data[key] = None if value == "*" else _whole(text, value)
            elif key in ("axes", "stage_starts"):
                data[key] = tuple(value.split(","))
            elif key == "recompute":
                data[key] = value if value in RECOMPUTE else tuple(_layer_numbers(text, value))
            elif key in ("schedule", "layout"):
                data[key] = value
            elif _placement(value):
                placed.append((key, value))
            else:
                raise ValueError(f"autopar: pin {text!r} names nothing autopar pins; expected one of layout, tp, dp, pp, "
                                 "axes, micro_batches, schedule, chunks, stage_starts, zero, zero:PATTERN, recompute, "
                                 f"output:PATTERN=PLACEMENT, or PATTERN=PLACEMENT (S(0)R, {', '.join(MEGATRON_ROLES)}) "
                                 "for parameters")
        return cls(**data, zero_by_name=tuple(by_name), params=tuple(placed), outputs=tuple(outputs))


def _placement(text, roles: Sequence[str] = MEGATRON_ROLES) -> bool:
    """Whether ``text`` is a placement pin: one of ``roles``, or placements such as S(0)R."""
    if text in roles:
        return True
    try:
        return isinstance(text, str) and bool(parse_spec(text)) and "P" not in text
    except ValueError:
        return False


def _whole(text: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"autopar: pin {text!r} expected a whole number after '=', found {value!r}") from None


def _layer_numbers(text: str, value: str) -> list[int]:
    """``0,2,5-7`` -> [0, 2, 5, 6, 7]."""
    out = []
    for part in value.split(","):
        first, _, last = part.partition("-")
        try:
            out += range(int(first), int(last or first) + 1)
        except ValueError:
            raise ValueError(f"autopar: pin {text!r} expected recompute=none, all or layer numbers such as "
                             f"0,2,5-7; found {value!r}") from None
    return out


def _recompute(value) -> str | tuple[int, ...] | None:
    if value is None or value in RECOMPUTE:
        return value
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ValueError(f"autopar: pin recompute expected {RECOMPUTE[0]!r}, {RECOMPUTE[1]!r} or the repeated "
                         f"layers' numbers, found {value!r}")
    layers = tuple(sorted(set(value)))
    if any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in layers):
        raise ValueError(f"autopar: pin recompute expected layer numbers from 0, found {value!r}")
    return layers


def name_matches(pattern: str, fqn: str) -> bool:
    """Whether a name pattern (fnmatch, ``*`` for any run of characters) names parameter ``fqn``
    or a module holding it, on dotted boundaries: ``layers.*.mlp`` names
    ``model.layers.0.mlp.up_proj.weight``; ``embed`` names neither ``embed_tokens.weight``
    nor ``model.embedding.weight``."""
    return any(fnmatch.fnmatchcase(fqn, form) for form in (pattern, f"*.{pattern}", f"{pattern}.*",
                                                           f"*.{pattern}.*"))


def module_matches(pattern: str, module: str) -> bool:
    """Whether a name pattern names the module ``module`` itself (not one inside it), whole or
    as its last dotted parts, ``*`` standing for any characters of one part:
    ``layers.*.input_layernorm`` names ``model.layers.0.input_layernorm``; ``layers.*`` names
    ``model.layers.0`` and not ``model.layers.0.mlp``; ``norm`` names neither
    ``model.layers.0.norm.x`` nor ``model.prenorm``."""
    body = "".join("[^.]*" if c == "*" else "[^.]" if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(rf"(?:.*\.)?{body}", module) is not None


# --- mesh roles ------------------------------------------------------------------------


@dataclass(frozen=True)
class AxisPin:
    """What one intra-op mesh axis must do: to the batch (``"split"`` its inputs' batch dim,
    ``"whole"``: the inputs never cut there, ``"unsplit"``: no value's sequences cut there)
    and to the weights (``"whole"``: read whole;
    ``"stored"``: read where they are stored, never moved); None: searched. ``batch_pin`` and
    ``weights_pin``: the pins that ask it (``"tp=8"``), for errors and explanations."""

    batch: str | None = None
    weights: str | None = None
    batch_pin: str = field(default="", compare=False)
    weights_pin: str = field(default="", compare=False)


@dataclass(frozen=True)
class MeshRoles:
    """Pins of one intra-op mesh: per axis (``AxisPin``), and the mesh axis as given each came from."""

    axes: tuple[AxisPin, ...]
    given_axis: tuple[int, ...] = field(default=())


def intra_axes(shape: Sequence[int], stages: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the intra-op mesh of a pipeline of ``stages`` over ``shape``'s outermost axis, the axis
    of ``shape`` each of its axes is a part of), as ``autopar.passes.planner.search.
    factorisations`` splits it (axes of size 1 dropped); ``stages`` 1: ``shape`` itself."""
    if stages == 1:
        return tuple(shape), tuple(range(len(shape)))
    parts = [(0, shape[0] // stages)] + [(i, s) for i, s in enumerate(shape) if i > 0]
    kept = [(i, s) for i, s in parts if s > 1]
    if not kept:
        return (1,), (0,)
    return tuple(s for _, s in kept), tuple(i for i, _ in kept)


def mesh_roles(pins: Constraints, shape: Sequence[int], stages: int) -> list[MeshRoles] | str:
    """Every way to lay the pinned roles on the intra-op mesh of ``stages`` pipeline stages over
    ``shape`` (the mesh as given), preferred first: tensor parallel on the innermost axes (the
    fast links), data parallel on the outermost; or why there is none."""
    if pins.stages is not None and pins.stages != stages:
        return (f"pp={pins.pp} pinned" if pins.pp is not None else
                f"{pins.pin('stage_starts')} pinned: {pins.stages} pipeline ranks" if pins.stage_starts else
                f"layout={pins.layout} pinned: no pipeline")
    if stages == 1 and pins.pipelined_by_settings:
        return f"{', '.join(pins.pipeline_pins())} pinned: a pipeline"
    if stages == 1 and pins.wants_pipeline:
        return f"layout={pins.layout} pinned: a pipeline"
    given = pins.axes
    if given is not None and len(given) != len(shape):
        return (f"axes={','.join(a or '*' for a in given)} gives {len(given)} roles for the {len(shape)} axes of mesh "
                f"{tuple(shape)}")
    if given is not None and given[0] == "pp" and stages != shape[0]:
        return f"axes pins the pipeline on axis 0, the whole of its {shape[0]} devices"
    if given is not None and given[0] in ("dp", "tp") and stages > 1 and stages == shape[0]:
        return f"axes pins axis 0 as {given[0]}, and a pipeline of {stages} stages takes all of it"
    intra, source = intra_axes(shape, stages)
    role = [None if given is None or source[k] == 0 and given[0] == "pp" else given[source[k]]
            for k in range(len(intra))]
    if intra == (1,):
        role = [None]
    fixed_tp = {k for k, r in enumerate(role) if r == "tp"}
    fixed_dp = {k for k, r in enumerate(role) if r == "dp"}
    tp_pin, dp_pin = _pin_text(pins, "tp"), _pin_text(pins, "dp")
    layouts = []
    for tp_axes in _subsets(intra, pins.tp, fixed_tp, exclude=fixed_dp, inner_first=True):
        for dp_axes in _subsets(intra, pins.dp, fixed_dp, exclude=fixed_tp | tp_axes, inner_first=False):
            axes = tuple(AxisPin("whole", "stored", tp_pin, tp_pin) if k in tp_axes else
                         AxisPin("split", "whole", dp_pin, dp_pin) if k in dp_axes else
                         AxisPin("whole" if pins.dp is not None else None, "whole" if pins.tp is not None else None,
                                 dp_pin, tp_pin)
                         for k in range(len(intra)))
            layouts.append(MeshRoles((AxisPin(),) if intra == (1,) else axes, source))
    if layouts and pins.layout is not None and intra != (1,):
        laid = layout_roles(pins, len(intra))
        layouts = [replace(roles, axes=tuple(AxisPin(p.batch or q.batch, p.weights or q.weights,
                                                     p.batch_pin if p.batch else q.batch_pin,
                                                     p.weights_pin if p.weights else q.weights_pin)
                                             for p, q in zip(roles.axes, laid))) for roles in layouts]
    if layouts:
        return layouts
    degrees = ", ".join(f"{r}={getattr(pins, r)}" for r in ("tp", "dp") if getattr(pins, r) is not None)
    return (f"{degrees or 'the axes pinned'} cannot be laid on the intra-op mesh {intra}"
            + (f" of a {stages}-stage pipeline" if stages > 1 else "")
            + ": expected mesh axes whose sizes multiply to each degree")


def layout_roles(pins: Constraints, ndim: int) -> tuple[AxisPin, ...]:
    """What each axis of an intra-op mesh of ``ndim`` axes does under ``pins.layout`` (its axes'
    roles, ``layout_placements.axis_roles``): a tensor-parallel axis keeps the batch whole and
    reads the weights where Megatron stores them; a data-parallel one splits the batch and
    reads every weight whole (FSDP gathers it); a replicated one splits no sequences and reads
    weights whole; an expert-parallel one splits the batch."""
    why = f"layout={pins.layout}"
    pin = {AxisRole.TP: AxisPin("whole", "stored", why, why), AxisRole.DP: AxisPin("split", "whole", why, why),
           AxisRole.REPLICA: AxisPin("unsplit", "whole", why, why), AxisRole.EP: AxisPin("split", None, why, why)}
    return tuple(pin[role] for role in axis_roles(pins.intra_layout, ndim))


def _pin_text(pins: Constraints, role: str) -> str:
    """The pin that gives ``role`` its axes: its degree (``tp=8``), else the axes pin."""
    if getattr(pins, role) is not None:
        return pins.pin(role)
    return pins.pin("axes") if pins.axes is not None else role


def _subsets(sizes: Sequence[int], degree: int | None, fixed: set[int], *, exclude: set[int],
             inner_first: bool) -> list[set[int]]:
    """Sets of axes (holding ``fixed``, none of ``exclude``) whose sizes multiply to ``degree``
    (any: only ``fixed``, when None), preferred first: the innermost or the outermost axes."""
    if degree is None:
        return [set(fixed)]
    free = [k for k in range(len(sizes)) if k not in fixed and k not in exclude and sizes[k] > 1]
    out = []
    for n in range(len(free) + 1):
        for extra in itertools.combinations(free, n):
            chosen = set(fixed) | set(extra)
            if math.prod(sizes[k] for k in chosen) == degree:
                out.append(chosen)
    return sorted(out, key=lambda s: sorted(s, reverse=inner_first), reverse=inner_first)


def check_recompute(pins: Constraints, layers: int) -> None:
    """An ``autopar:`` error for a recomputation pin naming layers the model does not repeat
    (``layers``: how many it repeats, numbered from 0)."""
    policy = pins.recompute
    missing = [k for k in policy if k >= layers] if isinstance(policy, tuple) else []
    if missing or (policy == "all" and not layers):
        have = f"{layers} repeated layers (0-{layers - 1})" if layers else "no repeated layers"
        raise ValueError(f"autopar: pin {pins.pin('recompute')} cannot hold: the model has {have}; expected layer numbers among them")


def check_mesh(pins: Constraints, shape: Sequence[int], pipeline: bool) -> None:
    """Raise an ``autopar:`` error for pins no plan on ``shape`` can honour, whatever it searches."""
    devices = math.prod(shape)
    for name in ("tp", "dp", "pp"):
        degree = getattr(pins, name)
        if degree is not None and devices % degree:
            raise ValueError(f"autopar: pin {name}={degree} cannot hold on mesh {tuple(shape)} of {devices} devices: "
                             f"expected a degree that divides the device count; pin a divisor of {devices}")
    if pins.stage_starts and shape[0] % pins.stages:
        count, chunks = len(pins.stage_starts) + 1, pins.starts_chunks
        ranks = f" ({chunks} per rank: {pins.stages} pipeline ranks)" if chunks > 1 else ""
        raise ValueError(f"autopar: pin {pins.pin('stage_starts')} starts {count} pipeline stages{ranks}, which cannot "
                         f"hold on mesh {tuple(shape)}: a pipeline takes its ranks out of the outermost axis "
                         f"({shape[0]} devices); name {chunks} x a divisor of {shape[0]}, less one, stage starts")
    if pins.pp is not None and pins.pp > 1 and shape[0] % pins.pp:
        raise ValueError(f"autopar: pin pp={pins.pp} cannot hold on mesh {tuple(shape)}: a pipeline takes its "
                         f"stages out of the outermost axis ({shape[0]} devices); pin a divisor of {shape[0]}, or "
                         "order the mesh with the pipeline's axis first")
    if pins.wants_pipeline and not pipeline:
        raise ValueError(f"autopar: pins {pins} set a pipeline, and planning was asked for none (pipeline=False, "
                         "a loss planned with the model, or keyword inputs); plan with pipeline=True and without "
                         "loss_fn, or leave the pipeline pins out")
    placed = [(f"{pattern}={placement}", placement) for pattern, placement in pins.params]
    placed += [(f"output:{pattern}={placement}", placement) for pattern, placement in pins.outputs]
    for pin, placement in placed:
        if placement in MEGATRON_ROLES + OUTPUT_ROLES:
            if not (pins.tp or 1) > 1 and "tp" not in (pins.axes or ()):
                raise ValueError(f"autopar: pin {pin} is a tensor-parallel role, and no axis is "
                                 "tensor parallel; pin tp= (or axes= with tp) too")
        elif len(parse_spec(placement)) != len(shape):
            raise ValueError(f"autopar: pin {pin} gives {len(parse_spec(placement))} placements for "
                             f"the {len(shape)} axes of mesh {tuple(shape)}; expected one per axis, e.g. "
                             f"{'S(0)' + 'R' * (len(shape) - 1)}")
    product = math.prod(getattr(pins, n) for n in ("tp", "dp", "pp") if getattr(pins, n) is not None)
    if devices % product:
        raise ValueError(f"autopar: pins {pins} multiply to {product} devices, which does not divide the mesh "
                         f"{tuple(shape)} of {devices}; expected degrees whose product divides it")


def micro_batch_roles(roles: MeshRoles | None, intra: Sequence[int], batch: int | None,
                      micro_batches: int) -> MeshRoles | str:
    """``roles`` with the batch kept whole on the intra-op axes a micro-batch of ``batch /
    micro_batches`` sequences cannot also be split over (the data-parallel axes pinned first,
    then the outermost free ones: data parallel on the slow links), so the pinned micro-batch
    count is one the plan allows (``microbatch.valid_counts``); or why there is none."""
    pin = f"micro_batches={micro_batches}"
    if not batch or batch % micro_batches or (batch // micro_batches == 1 and batch > 1):
        return (f"{pin} cannot split a batch of {batch or 'no'} sequences: expected a count that divides it into "
                "micro-batches of at least 2 sequences")
    room = batch // micro_batches
    axes = list(roles.axes) if roles is not None else [AxisPin() for _ in intra]
    for a, size in enumerate(intra):
        if axes[a].batch == "split":
            if room % size:
                return (f"{pin} leaves micro-batches of {room} sequences, which the data-parallel axis of {size} "
                        f"devices ({axes[a].batch_pin}) cannot split")
            room //= size
    for a, size in enumerate(intra):  # an axis whose inputs stay whole may still split values inside
        if axes[a].batch != "split" and size > 1:
            if room % size == 0:
                room //= size
            else:
                axes[a] = replace(axes[a], batch="unsplit", batch_pin=pin)
    return MeshRoles(tuple(axes), roles.given_axis if roles is not None else ())


def pinned_schedules(pins: Constraints | None, schedules: Sequence[Schedule]) -> tuple[tuple[Schedule, ...],
                                                                                        tuple[int, ...] | None]:
    """(the schedules the pipeline search may take, the interleaved depths: None to search them)."""
    schedules = tuple(map(Schedule.parse, schedules))
    if pins is None:
        return schedules, None
    if pins.schedule is not None:
        schedules = (pins.schedule,)
    chunks = pins.chunks or pins.starts_chunks  # pinned stages: as many chunks per rank as they leave
    if chunks is not None:  # several chunks: the interleaved schedules; one: any that runs one
        schedules = tuple(s for s in schedules
                          if (s.interleaved and not s.chunks_problem(chunks) if chunks > 1
                              else s is not Schedule.INTERLEAVED_1F1B and not s.v_shaped))
        return schedules, (chunks,)
    return schedules, None
