"""Plan: the layout autopar chose (or a person wrote), as plain data.

A plan names, for a captured model on a mesh of a given shape: the strategy of every
graph node (its printed form, ``(S(0)R, RS(1)) -> S(0)S(1)``, so a plan reads like the
strategy graph and survives re-capture: node names are stable for the same model and
input shapes), the placement of every parameter by qualified name, the ZeRO level of
every parameter, the pipeline, and what the cost model predicts. It round-trips
through JSON exactly; ``Plan.load(path)`` replays a saved plan.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import fx

from autopar.costmodels.profile import default_axis_names
from autopar.costmodels.schedules import Schedule
from autopar.passes.capture import Captured
from autopar.passes.explain import diff as plan_diff, explain as explain_plan
from autopar.passes.export import Exported, export as export_plan
from autopar.passes.node_keys import node_keys
from autopar.passes.placements import spec_str
from autopar.passes.strategy_graph import StrategyGraph

FORMAT_VERSION = 2
# Plans of format 1 name their nodes only (no ``node_keys``): read, and matched by node name.
READABLE_VERSIONS = (1, 2)


@dataclass(kw_only=True)
class Pipeline:
    """Pipeline parallelism along one mesh axis (``axis``), with ``stages`` stages."""

    axis: int
    stages: int
    micro_batches: int
    schedule: str  # torch's schedule class less "Schedule" (``Schedule.display``): "GPipe", "1F1B", ...
    stage_of: dict[str, int] = field(default_factory=dict)  # node name -> stage
    chunks_per_rank: int = 1
    # The whole batch (sequences per schedule run: a step's, or under ``Plan.accumulate`` each of
    # its accumulated micro-batches') and the number every micro-batch's sequence count
    # must be a multiple of: the devices the plan's strategies split the batch over
    # (``autopar.passes.planner.microbatch.batch_split``); 0 = not recorded (a hand-written plan), not checked.
    batch_size: int = 0
    batch_split: int = 1

    def __post_init__(self) -> None:
        if self.stages < 1 or self.micro_batches < 1 or self.chunks_per_rank < 1 or self.batch_split < 1:
            raise ValueError(
                f"autopar: a pipeline expects positive stages, micro-batches, chunks per rank and batch split; "
                f"found {self.stages}, {self.micro_batches}, {self.chunks_per_rank}, {self.batch_split}")
        self.check_micro_batches(self.micro_batches)
        Schedule.parse(self.schedule).check(self.stages, self.micro_batches, self.chunks_per_rank)
        if problem := Schedule.parse(self.schedule).micro_batch_problem(self.stages, self.micro_batches):
            raise ValueError(f"autopar: {problem}; found {self.micro_batches} micro-batches over {self.stages} "
                             "stages. Re-plan, or pick another micro-batch count or schedule")

    def check_micro_batches(self, micro_batches: int) -> None:
        """Raise unless ``micro_batches`` splits the batch into micro-batches that each divide
        over the ``batch_split`` devices the plan splits the batch over."""
        if not self.batch_size:
            return
        if self.batch_size % (micro_batches * self.batch_split):
            whole = self.batch_size // self.batch_split if self.batch_size % self.batch_split == 0 else 0
            fix = (f"use a micro-batch count that divides {whole}" if whole else
                   f"use a batch that is a multiple of {self.batch_split}")
            raise ValueError(
                f"autopar: a pipeline of {micro_batches} micro-batches over a batch of {self.batch_size} gives "
                f"{self.batch_size / micro_batches:g} sequences per micro-batch, and the plan splits the batch over "
                f"{self.batch_split} devices; expected a multiple of {self.batch_split} sequences per micro-batch. "
                f"Re-plan, or {fix}")


@dataclass(kw_only=True)
class Prediction:
    """What the cost model predicts for one training step, broken down."""

    step_time: float = 0.0  # seconds
    compute: float = 0.0
    communication: float = 0.0  # exposed: what the step waits for
    # run beside compute and hidden behind it (``autopar.costmodels.overlap``): not in step_time
    hidden_communication: float = 0.0
    bubble: float = 0.0
    memory: dict[str, float] = field(default_factory=dict)  # bytes per device by kind
    # e.g. {"parameters": .., "gradients": .., "optimizer": .., "activations": ..}
    # a pipeline's: ``memory`` of each pipeline rank at its peak (``memory`` is the fullest's)
    memory_by_rank: list[dict[str, float]] = field(default_factory=list)
    # a serving plan's (``Plan.inference``): ``step_time`` is one whole generation, the prefill
    # (time to first token) and every decode step after it (time per output token)
    time_to_first_token: float = 0.0
    time_per_output_token: float = 0.0
    tokens_per_second_per_device: float = 0.0


@dataclass(kw_only=True)
class Program:
    """Another program of the model that the plan lays out beside the one it was made from
    (a serving plan's decode step): its nodes' strategies and identities, as ``Plan`` keeps them."""

    strategies: dict[str, str]
    node_keys: dict[str, str] = field(default_factory=dict)


@dataclass(kw_only=True)
class Plan:
    model: str
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    strategies: dict[str, str]  # node name -> printed ShardingStrategy
    # node name -> its identity across captures (``autopar.passes.node_keys``); empty: match by name
    node_keys: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)  # qualified name -> short spec, e.g. "S(0)R"
    # qualified name -> ZeRO level. ``params`` gives where a parameter is STORED (and its
    # optimizer state with it). Level 1 uses it whole, as its ops need it (gradients
    # all-reduced), steps the stored slice and gathers the slices after the step
    # (``autopar.runtime.zero1``); level 2 gathers it once per step, shared by every use
    # (gradients reduce-scattered); level 3 at each use. Level 0 stores it as the ops use it.
    zero: dict[str, int] = field(default_factory=dict)
    pipeline: Pipeline | None = None
    recompute: list[str] = field(default_factory=list)  # layers recomputed in backward
    predicted: Prediction = field(default_factory=Prediction)
    kind: str = "auto"  # "auto", or the manual layout's name ("dp", "fsdp", "megatron-tp", ...)
    # what it was priced on: a preset's name ("h100"), or a measured profile's machine; "" unknown
    hardware: str = ""
    # The plan covers the model followed by its loss (``autopar.plan(..., loss_fn=, target=)``):
    # the planned graph takes the target as its last input and outputs the loss.
    includes_loss: bool = False
    # The micro-batches a training step accumulates (``autopar.plan(..., accumulate=k)``): the plan
    # lays out the program of one of them (1/k of the batch given), ``predicted`` is the whole
    # step's, and ``train_step`` runs k of them by default
    accumulate: int = 1
    # The mixed-precision policy the plan is priced for (None: the model's own dtypes), as
    # dtype names: {"param_dtype": "bfloat16", "reduce_dtype": "float32", "output_dtype": ...,
    # "cast_forward_inputs": true, "priced": "bf16 compute, fp32 master, fp32 reduce"};
    # ``autopar.compile(..., mp_policy=)`` runs it
    mp_policy: dict[str, Any] | None = None
    # A serving plan: the workload (``autopar.Inference`` as a dict, its batch resolved) and
    # its other programs by name ("decode"); ``strategies`` are the prefill's. None: training.
    inference: dict[str, Any] | None = None
    programs: dict[str, Program] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # For explain(): per node {"compute": s, "comm": s, "memory": bytes, "layer": i (if in a layer)}
    breakdown: dict[str, dict[str, float]] = field(default_factory=dict)
    param_layers: dict[str, int] = field(default_factory=dict)  # qualified name -> repeated-layer number
    candidates: dict[str, float] = field(default_factory=dict)  # layout name -> predicted step time (fits)
    solver: dict[str, Any] = field(default_factory=dict)  # status, method, gap, seconds, decisions
    reasons: list[str] = field(default_factory=list)  # why this plan: comparisons made while planning
    # Made under pins (``autopar.Constraints``): {"pins": ["tp=8", ...], "constraints": {...},
    # "layout": words, "unpinned": {"step_time": s, "memory": bytes, "layout": words} or None,
    # "broken": the pins the unpinned plan breaks}; {} for none (``autopar.passes.planner.
    # pin_price.price_record``), priced by ``explain()``
    pins: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.mesh_shape = tuple(int(s) for s in self.mesh_shape)
        self.axis_names = tuple(self.axis_names)
        if len(self.axis_names) != len(self.mesh_shape):
            raise ValueError(
                f"autopar: Plan expected one axis name per mesh axis; mesh {self.mesh_shape} has "
                f"{len(self.mesh_shape)} axes, found names {self.axis_names}"
            )
        bad = {k: v for k, v in self.zero.items() if v not in (0, 1, 2, 3)}
        if bad:
            raise ValueError(f"autopar: ZeRO levels must be 0, 1, 2 or 3; found {bad}")
        check_accumulate(self.accumulate)

    def memory_over_limit(self) -> float:
        """Bytes per device the predicted peak needs beyond the memory it was planned for (0: it
        fits; a manual layout as written is priced as given, fitting or not)."""
        limit = self.solver.get("memory_limit")
        return max(0.0, sum(self.predicted.memory.values()) - limit) if limit else 0.0

    # --- inspection (passes/explain.py) -----------------------------------------
    def explain(self) -> str:
        """A table per layer and a summary of why this layout was chosen."""
        return explain_plan(self)

    def diff(self, other: "Plan") -> str:
        """What differs between this plan and ``other``: placements, ZeRO, pipeline, prediction."""
        return plan_diff(self, other)

    def export(self, model_or_factory, path: str | Path, example_inputs: tuple | None = None) -> Exported:
        """Write this plan as a Python module that lays the model out with torch's own APIs
        (``parallelize(model, mesh)``; a pipeline's ``pipeline(model, mesh, microbatches,
        loss_fn)``), importing no autopar; ``model_or_factory``: the model with its
        ``example_inputs``, or ``"package.module:factory"``. What torch cannot express as
        planned is said in the file and in the result's ``notes`` (``autopar.passes.export``)."""
        return export_plan(self, model_or_factory, path, example_inputs)

    # --- JSON ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, **asdict(self)}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "Plan":
        data = dict(data)
        version = data.pop("format", None)
        if version not in READABLE_VERSIONS:
            raise ValueError(
                f"autopar: plan format {version!r} is not one this autopar reads "
                f"({', '.join(map(str, READABLE_VERSIONS))}); re-plan with this version"
            )
        pipeline = data.pop("pipeline", None)
        predicted = data.pop("predicted", {})
        programs = {name: Program(**program) for name, program in data.pop("programs", {}).items()}
        # Plans saved before ``includes_loss`` existed said so by the module planned: the
        # runtime's model-and-loss wrapper, ``autopar.runtime.loss.WithLoss``.
        data.setdefault("includes_loss", data.get("model") == "WithLoss")
        return Plan(
            **data,
            pipeline=Pipeline(**pipeline) if pipeline else None,
            predicted=Prediction(**predicted),
            programs=programs,
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Plan":
        return Plan.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def load(path: str | Path) -> "Plan":
        try:
            return Plan.from_json(Path(path).read_text())
        except (OSError, json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"autopar: cannot read a plan from {path}: {exc}") from exc


def check_accumulate(accumulate: Any) -> None:
    """Raise unless ``accumulate`` is a count of micro-batches per step (a positive int)."""
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"autopar: expected accumulate to be a positive int (micro-batches per step); found "
                         f"{accumulate!r}; pass e.g. accumulate=4, or 1 for none")


def plan_from_choice(graph: StrategyGraph, choice: dict[fx.Node, int], *, kind: str,
                     axis_names: tuple[str, ...] | None = None) -> Plan:
    """The Plan of one strategy index per node (what the solver or a layout returns)."""
    captured = graph.captured
    axis_names = axis_names or default_axis_names(len(graph.mesh_shape))
    strategies, params = {}, {}
    for node, ns in graph.nodes.items():
        strategy = ns.strategies[choice[node]]
        strategies[node.name] = str(strategy)
        if node.name in captured.params:
            params[captured.params[node.name]] = spec_str(strategy.output)
    zero = {fqn: 0 for fqn in params}
    return Plan(model=captured.model_name, mesh_shape=graph.mesh_shape, axis_names=axis_names,
                strategies=strategies, node_keys=node_keys(captured), params=params, zero=zero, kind=kind)


def planned_names(captured: Captured, plan: Plan, program: str | None = None) -> dict[str, str | None]:
    """Each node of ``captured`` (by name) -> the plan's node of the same identity (its name in
    ``plan.strategies``, or in ``plan.programs[program].strategies``), or None where the plan
    names none. A plan that records no identities (format 1, or written by hand) is matched
    by node name."""
    laid = plan if program is None else plan.programs[program]
    if not laid.node_keys:
        return {n.name: n.name if n.name in laid.strategies else None for n in captured.nodes()}
    by_key = {key: name for name, key in laid.node_keys.items()}
    return {name: by_key.get(key) for name, key in node_keys(captured).items()}


def check_mesh(graph: StrategyGraph, plan: Plan) -> None:
    """A clear error unless ``graph`` is on the mesh the plan's strategies are for (a
    pipeline's: the mesh without its pipeline axis)."""
    expected = tuple(plan.mesh_shape)
    if plan.pipeline is not None:  # stages' strategies live on the mesh without the pipeline axis
        expected = tuple(s for i, s in enumerate(expected) if i != plan.pipeline.axis)
    if expected != graph.mesh_shape:
        raise ValueError(
            f"autopar: the plan's strategies are for a mesh of shape {expected}, found {graph.mesh_shape}; "
            "re-plan for this mesh, or run on the mesh the plan was made for"
        )


def choice_from_plan(graph: StrategyGraph, plan: Plan) -> dict[fx.Node, int]:
    """Find each node's strategy by its identity; a clear error unless the plan lays out every
    node of ``graph`` as it is (the dry run's check: the plan was made from this capture)."""
    check_mesh(graph, plan)
    choice = {}
    names = planned_names(graph.captured, plan)
    for node, ns in graph.nodes.items():
        wanted = plan.strategies.get(names[node.name] or "")
        if wanted is None and plan.includes_loss:
            raise ValueError(
                "autopar: this plan was made for the model and its loss together (autopar.plan(..., "
                f"loss_fn=...)), found the model alone (no strategy for {node.name}); to train with it, "
                "plan without loss_fn (autopar.compile lays the loss out itself)"
            )
        if wanted is None:
            raise ValueError(
                f"autopar: the plan has no strategy for node {node.name}; it was made for another "
                "model or other input shapes. Re-plan, or capture with the plan's example inputs"
            )
        texts = [str(s) for s in ns.strategies]
        if wanted not in texts:
            raise ValueError(
                f"autopar: the plan's strategy {wanted} for {node.name} is not valid here "
                f"(valid: {texts[:6]}{' ...' if len(texts) > 6 else ''}); re-plan for this model"
            )
        choice[node] = texts.index(wanted)
    return choice
