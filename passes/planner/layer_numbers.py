"""Per-layer numbers of one intra-op assignment (``layer_numbers``): what the pipeline search
(``autopar.passes.planner.pipeline``) cuts into stages.

- activation-side time (op compute, resharding of activations) scales as 1 / M per
  micro-batch; parameter-side time (gathers and gradient syncs on parameter edges, the
  optimizer step, ZeRO traffic) is paid once per step;
- static memory (parameter, gradient, optimizer state, buffers) per layer, and saved
  activations per micro-batch (``1 / M`` of the whole batch's), with what exists per
  micro-batch whatever its size (working copies; under a split backward, ZeRO-3 weights
  gathered again) and what a backward rebuilds (a recomputed layer);
- the point-to-point send of the activation leaving each layer, on the pipeline axis.

Nodes outside repeated layers go to the first layer (before it in graph order) or the last
(``node_layers``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from torch.distributed.tensor import Replicate

from autopar import costmodels
from autopar.passes.costing import Costs, carrying_gradient
from autopar.passes.placements import local_shape
from autopar.passes.planner.microbatch import batch_dims, batch_size
from autopar.passes.planner.stage_io import StageIO, no_stage_io, output_bytes, stage_io
from autopar.passes.saved import weight_gradient_starts
from autopar.passes.state_costs import state_breakdown
from autopar.passes.zero3_memory import ZeroThreeBucket, forward_gather_memory, gathered_over


@dataclass
class LayerNumbers:
    """Whole-batch per-layer numbers of one intra-op assignment (see module docstring)."""

    act_time: np.ndarray  # seconds, forward + backward, whole batch
    compute: np.ndarray  # the compute part of act_time
    param_time: np.ndarray  # seconds once per step
    optimizer: np.ndarray  # the optimizer-step (compute) part of param_time
    static: np.ndarray  # bytes
    kinds: np.ndarray  # [layers, 3]: parameters, gradients, optimizer bytes (``static`` = their sum)
    activation: np.ndarray  # bytes, whole batch
    boundary: np.ndarray  # bytes crossing after each layer (what a stage ending there sends), whole batch
    layer_of_node: dict  # graph node -> layer number
    forward: np.ndarray  # the forward compute of the repeated layer's own nodes (what recomputing it runs again)
    recomputable: np.ndarray  # bytes, whole batch: the part of ``activation`` a repeated layer's own nodes keep
    inputs: np.ndarray  # bytes, whole batch: what a recomputed repeated layer keeps (its inputs)
    # bytes, whole batch: alive only while a backward runs (the default loss's); None: none
    temporary: np.ndarray | None = None
    # bytes: the largest gradient of a layer, made whole before a backward adds it to the
    # accumulated one; None: none
    largest_gradient: np.ndarray | None = None
    # bytes: what the layer's ZeRO-3 gathers (the next one's in flight beside its own,
    # ``zero3_memory.forward_gather_memory``), and its gradients' reduce-scatter, hold while
    # they run; None: none
    gather: np.ndarray | None = None
    scatter: np.ndarray | None = None
    # what the stages receive and send (``stage_io.StageIO``: per stage of layers [a, b), what
    # it holds per micro-batch beyond its layers' activations); None: nothing
    io: StageIO | None = None
    # bytes, whole batch: the gradients a split backward keeps from its input-gradient part
    # until its weight-gradient part starts from them (``saved.weight_gradient_starts``' outputs);
    # None: none
    weight_grads: np.ndarray | None = None
    # bytes per micro-batch awaiting its weight gradients: the layer's ZeRO-3 buckets gathered
    # again for its input-gradient part, kept until its weight-gradient part reduces their
    # gradients (``autopar.passes.lowering.buckets``: a gather's copy is released by its own
    # backward, which runs with the weight gradients); None: none
    regathered: np.ndarray | None = None
    # bytes per micro-batch in flight: the working copies of parameters (a mixed-precision
    # policy's cast) that the layer's consumers keep for backward. A stage casts once per call,
    # so each micro-batch in flight keeps its own; and of them, ``recomputable_copies`` those
    # the layer's recomputation does not keep (read inside the repeated layer, cast again when
    # it reruns). None: none
    copies: np.ndarray | None = None
    recomputable_copies: np.ndarray | None = None
    # a layer the costs recompute (pinned): what its backward rebuilds, its activations whole
    # (bytes, whole batch; the costs charge each such layer 1/R of them) and its working copies
    # cast again (per call); ``rebuilt_per_micro_batch``. None: none
    rebuilt: np.ndarray | None = None
    rebuilt_copies: np.ndarray | None = None
    # the micro-batches a step accumulates (``Costs.runs``): the times above are of all of them,
    # and each runs the schedule, its sends included
    runs: int = 1

    def __post_init__(self) -> None:
        for name in ("temporary", "largest_gradient", "gather", "scatter", "weight_grads", "regathered",
                     "copies", "recomputable_copies", "rebuilt", "rebuilt_copies"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(len(self.static)))
        if self.io is None:
            self.io = no_stage_io(len(self.static))

    def send_times(self, profile: costmodels.HardwareProfile, micro_batches: int) -> list[float]:
        """Seconds to send what crosses after each layer (one micro-batch of it) to the next
        stage, point to point on ``profile``'s axis 0 (after the last layer, nothing), as many
        times as the step accumulates (``runs``)."""
        return [self.runs * costmodels.collective_time("send_recv", b / micro_batches + fixed, 0, profile, in_step=True)
                for b, fixed in zip(self.boundary[:-1], self.io.crossing_fixed[:-1])]

    def stage_held(self, micro_batches: int) -> np.ndarray:
        """Per stage of layers [a, b): bytes per micro-batch it holds of the values it receives
        and sends beyond its layers' activations (``stage_io``)."""
        return self.io.held / micro_batches + self.io.held_fixed

    def step_overhead(self, stages: int) -> float:
        """Seconds once per step outside the schedule: each stage syncs and steps its own
        share of the parameters (``param_time``, spread evenly over ``stages``)."""
        return float(self.param_time.sum()) / stages

    @property
    def gradients(self) -> np.ndarray:
        """Bytes per layer of the gradients, accumulated whole over a step's micro-batches."""
        return self.kinds[:, 1]

    def held_once(self, micro_batches: int) -> np.ndarray:
        """Bytes per layer a stage holds once, whatever is in flight: its state, and one
        micro-batch's temporaries (the loss's backward on the last stage)."""
        return self.static + self.temporary / micro_batches

    @property
    def recompute_saving(self) -> np.ndarray:
        """Bytes (whole batch) a layer keeps less when recomputed: its own activations less its inputs."""
        return np.maximum(self.recomputable - self.inputs, 0.0)

    def rebuilt_per_micro_batch(self, micro_batches: int) -> np.ndarray:
        """Bytes a layer the costs recompute rebuilds in one micro-batch's backward (none else)."""
        return self.rebuilt / micro_batches + self.rebuilt_copies

    def per_micro_batch(self, micro_batches: int) -> tuple[np.ndarray, np.ndarray]:
        """(bytes each layer keeps per micro-batch in flight, bytes of them its recomputation
        does not keep): its share of the batch's activations and its working copies whole."""
        return (self.activation / micro_batches + self.copies,
                self.recompute_saving / micro_batches + self.recomputable_copies)


def node_layers(costs: Costs) -> tuple[dict, int]:
    """(graph node -> the layer it runs with, the number of layers): its own layer, else the
    layer of the last layered op before it in graph order (the first layer for nodes before
    any), so a node between two layers (a residual add outside the repeated block) runs with
    the layer that made its input and every value flows to the same or a later stage; a
    placeholder outside the layers sits with its first reader."""
    nodes = list(costs.graph.nodes)
    layered = [costs.layer_of[n] for n in nodes if n in costs.layer_of and n.op != "placeholder"]
    count = max(layered) + 1 if layered else 1
    where: dict = {}
    current = 0
    for n in nodes:
        if n.op != "placeholder":
            current = costs.layer_of.get(n, current)
            where[n] = current
    for n in nodes:  # a placeholder sits with its layer, or with its first reader
        if n.op == "placeholder":
            where[n] = costs.layer_of.get(n, min((where[u] for u in n.users if u in where), default=0))
    return where, count


def layer_numbers(costs: Costs, assignment, layers: tuple[dict, int] | None = None,
                  dims: dict | None = None) -> LayerNumbers:
    """``layers``: ``node_layers(costs)``, and ``dims``: the graph's batch dims
    (``microbatch.batch_dims``; empty: no batch), when the caller has them."""
    graph, mesh = costs.graph, costs.graph.mesh_shape
    where, count = node_layers(costs) if layers is None else layers
    if dims is None:
        dims = batch_dims(graph, batch) if (batch := batch_size(graph)) else {}
    # sums in Python floats (numpy element updates cost ten times more), arrays at the end
    act, compute, param, optimizer = [0.0] * count, [0.0] * count, [0.0] * count, [0.0] * count
    forward = [0.0] * count
    static, activation = [0.0] * count, [0.0] * count
    recomputable, inputs, temporary, largest = [0.0] * count, [0.0] * count, [0.0] * count, [0.0] * count
    # per layer: its ZeRO-3 parameters, gathered per use as codegen buckets them: the repeated
    # layer's apart from those of the stretch around it (an embedding, a head)
    gathered = [{"layer": ZeroThreeBucket(), "between": ZeroThreeBucket()} for _ in range(count)]
    repeated = costs.layer_of
    kinds = [[0.0, 0.0, 0.0] for _ in range(count)]
    weight_grads, copied, recomputable_copies = [0.0] * count, [0.0] * count, [0.0] * count
    rebuilt, rebuilt_copies = [0.0] * count, [0.0] * count  # layers the costs recompute (pinned)
    starts = weight_gradient_starts_of(graph)
    choice, zero = costs.choice(assignment)
    saved_twice = costs.read_copy_bytes(choice)  # a value its readers save in two placements
    leads = {zi: ph for ph, zi in costs.zero_node.items()}
    node_time, costs_compute = costs.problem.node_time, costs.compute
    state_memory, activation_memory = costs.state_memory, costs.activation_memory
    for v, node in enumerate(costs.nodes):
        s = assignment[v]
        layer = where[node]
        if v in leads:
            param[layer] += float(node_time[v][s])
            optimizer[layer] += float(costs_compute[v][s])
            spec = graph.nodes[node].strategies[choice[node]].output
            numel = math.prod(local_shape(tuple(node.meta["val"].shape), spec, mesh))
            shards = math.prod(mesh[a] for a, p in enumerate(spec) if isinstance(p, Replicate))
            held = stage_state(numel, zero[node], shards, costs.precision)
            copy = float(activation_memory[v][s])  # a working copy its ZeRO node holds (edge_costs.copy_readers)
            static[layer] += sum(held.values()) + copy
            row = kinds[layer]
            row[0] += held["parameters"] + held["activations"] + copy
            row[1] += held["gradients"]
            row[2] += held["optimizer"]
            largest[layer] = max(largest[layer], held["gradients"])
            bucket = gathered[layer]["layer" if node in repeated else "between"]
            bucket.add(numel, gathered_over(graph, node, spec, choice, mesh), node.meta["val"].dtype)
            continue
        act[layer] += float(node_time[v][s])
        compute[layer] += float(costs_compute[v][s])
        held = float(state_memory[v][s])
        static[layer] += held
        kinds[layer][0] += held
        kept = float(activation_memory[v][s]) + saved_twice.get(v, 0.0)
        if (share := costs.rebuilt_share.get(v)) is not None:
            # a pipeline stage rebuilds a recomputed layer in each of its backwards: charged
            # there whole (``rebuilt``), not a share of it per micro-batch in flight
            rebuilt[layer] += float(activation_memory[v][s]) / share
            kept -= float(activation_memory[v][s])
        activation[layer] += kept
        temporary[layer] += float(costs.temporary_memory[v][s])
        if node in starts:
            weight_grads[layer] += output_bytes(costs, node, choice)
        if node in repeated and node.op != "placeholder":  # what recomputing the repeated layer reruns
            forward[layer] += float(costs.forward[v][s])
            recomputable[layer] += kept
    params = graph.captured.params
    kept_by: dict = {}  # a tensor read by recomputed layers is kept once, by its first reader's layer
    user_inputs = set(graph.captured.user_inputs)
    copies = costs.problem.edge_memory  # working copies of parameters, kept per call (``LayerNumbers.copies``)
    for e, ((src, dst, _), (u, v, table)) in enumerate(zip(costs.edge_inputs, costs.problem.edges)):
        if e in copies and repeated.get(dst) in costs.recompute:  # a recomputed layer casts again
            rebuilt_copies[where[dst]] += float(copies[e][assignment[u], assignment[v]])
        elif e in copies:
            copy = float(copies[e][assignment[u], assignment[v]])
            copied[where[dst]] += copy
            if dst in repeated:
                recomputable_copies[where[dst]] += copy
        t = float(table[assignment[u], assignment[v]])
        if src.name in params:
            param[where[dst]] += t
        else:
            act[where[dst]] += t
        entering = repeated.get(dst)
        state = src.op == "placeholder" and src.name not in user_inputs  # weights, buffers, constants
        if entering is not None and repeated.get(src) != entering and not state and src not in kept_by:
            kept_by[src] = entering
            inputs[entering] += output_bytes(costs, src, choice)
    io = stage_io(costs, choice, where, count, kept_by, dims)
    array = np.array
    return LayerNumbers(array(act), array(compute), array(param), array(optimizer), array(static), array(kinds),
                        array(activation), io.crossing, where, array(forward),
                        array(recomputable), array(inputs), array(temporary), array(largest),
                        forward_gather_memory([g.values() for g in gathered], costs.precision),
                        array([max(b.working(costs.precision)[1] for b in g.values()) for g in gathered]), io=io,
                        weight_grads=array(weight_grads),
                        regathered=array([sum(b.wholes(costs.precision) for b in g.values()) for g in gathered]),
                        copies=array(copied),
                        recomputable_copies=array(recomputable_copies), rebuilt=array(rebuilt),
                        rebuilt_copies=array(rebuilt_copies), runs=costs.runs)


def weight_gradient_starts_of(graph) -> set:
    """``saved.weight_gradient_starts`` of ``graph``'s capture, once per capture."""
    captured = graph.captured

    def find() -> set:
        trainable = carrying_gradient(captured) & set(captured.nodes("placeholder"))
        state = [n for n in captured.nodes("placeholder") if n.name not in captured.user_inputs and n not in trainable]
        return weight_gradient_starts(captured.graph.nodes, trainable, state)
    return graph.once(("weight gradient starts",), find)


def stage_state(numel: float, level: int, shards: int, precision: str) -> dict[str, float]:
    """Bytes by kind a pipeline stage holds for a parameter at its peak: ZeRO-2 in a stage runs
    as ZeRO-1 until the step (``autopar.runtime.pipeline``): the parameter whole as its ops use
    it, its gradient accumulated whole over the micro-batches, reduce-scattered into the
    optimizer's slice only after the last backward; the optimizer state split."""
    return state_breakdown(numel, min(level, 1), shards, precision)
