"""Communication hidden behind compute (``autopar.costmodels.overlap``): the critical path of a
step, checked against hand-computed numbers on small cases; what the runtime does not overlap
stays exposed; the profile's figures (presets with their source, measured by the profiler)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar import costmodels
from autopar.costmodels import overlap, profiler
from autopar.costmodels.profile import HardwareProfile, ProfileError
from autopar.passes.solve import Overlap, SolveProblem, evaluate_time, plan_costs


class Blocks(nn.Module):
    def __init__(self, width: int = 256, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def _without_overlap(profile: HardwareProfile) -> HardwareProfile:
    return dataclasses.replace(profile, overlap={})


def test_overlap_from_times_is_the_part_of_the_shorter_hidden():
    assert overlap.overlap_from_times(2.0, 5.0, 5.0) == 1.0  # the collective ran wholly beside compute
    assert overlap.overlap_from_times(2.0, 5.0, 7.0) == 0.0  # one after the other
    assert overlap.overlap_from_times(2.0, 5.0, 5.5) == pytest.approx(0.75)
    assert overlap.overlap_from_times(5.0, 2.0, 5.5) == pytest.approx(0.75)  # the shorter is the compute
    assert overlap.overlap_from_times(2.0, 5.0, 8.0) == 0.0  # slower than serial: clamped
    assert overlap.overlap_from_times(0.0, 5.0, 5.0) == 0.0


def test_only_what_the_runtime_overlaps_is_hidden():
    full = {kind: 0.8 for kind in overlap.KINDS}
    assert overlap.hidden_share(full, "gradient_all_reduce") == 0.8
    for kind in set(overlap.KINDS) - overlap.RUNTIME_OVERLAPS:
        assert overlap.hidden_share(full, kind) == 0.0, kind
    assert overlap.hidden_share(full, None) == 0.0
    assert overlap.kind_of("all_reduce", backward=True) == "gradient_all_reduce"
    assert overlap.kind_of("all_gather", backward=False) == "parameter_gather"
    assert overlap.kind_of("all_gather", backward=False, regather=True) == "parameter_regather"
    assert overlap.kind_of("all_to_all", backward=True) is None
    assert overlap.kind_of("reduce_scatter", backward=True) == "gradient_reduce_scatter"
    # HSDP: a gradient reduce-scattered and all-reduced is reduce-scattered on the spot
    assert overlap.kind_of("reduce_scatter", backward=True, summed=True) is None
    assert overlap.kind_of("all_reduce", backward=True, summed=True) == "gradient_all_reduce"


def test_a_stream_busier_than_its_window_hides_only_the_window():
    """Two nodes and one edge, by hand: the edge's table leaves 3 s of 4 s hidden; the second
    stream is busy 5 s beside a window of 2 s + 0.5 s of compute, so hiding scales by 2.5 / 5
    and 1.5 s come back onto the critical path."""
    problem = SolveProblem(
        node_time=[np.array([1.0]), np.array([2.0])], node_memory=[np.array([0.0]), np.array([0.0])],
        edges=[(0, 1, np.array([[7.0]]))],  # 10 s of communication, 3 s of it left out
        overlaps=[Overlap(window=[np.array([2.0]), np.array([0.5])], busy={0: np.array([[5.0]])},
                          hidden={0: np.array([[3.0]])})])
    costs = plan_costs(problem, [0, 0])
    assert costs.excess == pytest.approx(3.0 * (1 - 2.5 / 5.0))
    assert costs.hidden == pytest.approx(1.5)
    assert costs.total_time == pytest.approx(1.0 + 2.0 + 7.0 + 1.5)
    assert evaluate_time(problem, [0, 0]) == pytest.approx(costs.total_time)
    # a window as long as the stream: everything left out stays hidden
    problem.overlaps[0].window[1] = np.array([3.0])
    assert plan_costs(problem, [0, 0]).total_time == pytest.approx(10.0)


def _dp_all_reduce_by_hand(model: nn.Module, profile: HardwareProfile) -> tuple[float, float]:
    """(seconds of every parameter's gradient all-reduce, seconds of them hidden), as the
    module docstring of ``costmodels.overlap`` says: bucketed as DDP buckets them, each
    parameter hiding the profile's share of all but its share of the last bucket."""
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    total = sum(sizes)
    buckets = costmodels.gradient_buckets(total)
    seconds = [costmodels.collective_time("all_reduce", b, 0, profile, min(1.0, buckets * b / total))
               for b in sizes]
    share = profile.overlap["gradient_all_reduce"]
    return sum(seconds), sum(share * (1 - 1 / buckets) * t for t in seconds)


def test_data_parallel_gradients_hide_behind_backward_as_computed_by_hand():
    model, x = Blocks(), torch.randn(64, 128, 256)
    h100 = costmodels.h100((4,))
    with_overlap = autopar.plan(model, h100.mesh_shape, (x,), hardware=h100, pipeline=False, layout="dp")
    without = autopar.plan(model, h100.mesh_shape, (x,), hardware=_without_overlap(h100), pipeline=False,
                           layout="dp")
    sync, hidden = _dp_all_reduce_by_hand(model, h100)
    assert hidden > 0
    p, q = with_overlap.predicted, without.predicted
    assert p.hidden_communication == pytest.approx(hidden, rel=1e-9)
    assert q.hidden_communication == 0.0
    assert p.compute == pytest.approx(q.compute, rel=1e-12)
    assert q.step_time - p.step_time == pytest.approx(hidden, rel=1e-9)
    # the critical path: compute, then what of the communication stays exposed
    assert p.step_time == pytest.approx(p.compute + p.communication, rel=1e-12)
    assert q.communication - p.communication == pytest.approx(hidden, rel=1e-9)
    assert q.communication >= sync * (1 - 1e-9)  # the all-reduces, and their bucket copies if any
    assert "more ran beside compute and hid behind it" in with_overlap.explain()
    assert "hid behind it" not in without.explain()


def test_a_short_backward_hides_only_its_own_length():
    """Eight sequences of 2 tokens on 8 devices through wide layers: backward's compute is far shorter than the
    gradients' all-reduce, so only backward's length of it can hide, not the profile's share."""
    model, x = Blocks(width=1024, layers=2), torch.randn(8, 2, 1024)
    h100 = costmodels.h100((8,))
    plan = autopar.plan(model, h100.mesh_shape, (x,), hardware=h100, pipeline=False, layout="dp")
    without = autopar.plan(model, h100.mesh_shape, (x,), hardware=_without_overlap(h100), pipeline=False,
                           layout="dp")
    _, hidden = _dp_all_reduce_by_hand(model, h100)
    p = plan.predicted
    assert 0 < p.hidden_communication < 0.5 * hidden
    assert p.hidden_communication < p.compute  # hidden behind backward, a part of the compute
    assert without.predicted.step_time - p.step_time == pytest.approx(p.hidden_communication, rel=1e-9)


def _fsdp_by_hand(model: nn.Module, plan, profile: HardwareProfile) -> float:
    """Seconds of FSDP's collectives hidden, as the module docstring of ``costmodels.overlap``
    says: each parameter's gather in forward, its gather again in backward and its gradient's
    reduce-scatter, packed per layer (a parameter pays its share of one call's latency) and each
    hiding the profile's share of all but the first layer's (the tail: one of four layers)."""
    by_layer: dict[str, float] = {}
    for name, p in model.named_parameters():
        by_layer[name.split(".")[1]] = by_layer.get(name.split(".")[1], 0.0) + p.numel() * p.element_size()
    hidden = 0.0
    for name, p in model.named_parameters():
        spec = (Shard(int(plan.params[name][2])),)  # "S(d)"
        share = p.numel() * p.element_size() / by_layer[name.split(".")[1]]
        gather = costmodels.reshard_plan(tuple(p.shape), 4, spec, (Replicate(),), profile.mesh_shape)
        scatter = costmodels.backward_reshard_plan(tuple(p.shape), 4, spec, (Replicate(),), profile.mesh_shape,
                                                   (Partial(),))
        assert [s.collective for s in gather] == ["all_gather"] and [s.collective for s in scatter] == ["reduce_scatter"]
        for step, kind in ((gather[0], "parameter_gather"), (gather[0], "parameter_regather"),
                           (scatter[0], "gradient_reduce_scatter")):
            seconds = costmodels.collective_time(step.collective, step.bytes, 0, profile, share)
            hidden += profile.overlap[kind] * (1 - 1 / len(by_layer)) * seconds
    return hidden


def test_fsdp_gathers_and_reduce_scatters_hide_as_computed_by_hand():
    """The runtime prefetches ZeRO-3 gathers and runs gradient reduce-scatters beside backward
    (``autopar.passes.lowering.buckets.Overlap``); forward and backward are long enough here to
    hide the profile's share of all but the first layer's."""
    model, x = Blocks(), torch.randn(64, 128, 256)
    h100 = costmodels.h100((4,))
    fsdp = autopar.plan(model, h100.mesh_shape, (x,), hardware=h100, pipeline=False, layout="fsdp")
    plain = autopar.plan(model, h100.mesh_shape, (x,), hardware=_without_overlap(h100), pipeline=False,
                         layout="fsdp")
    hidden = _fsdp_by_hand(model, fsdp, h100)
    p, q = fsdp.predicted, plain.predicted
    assert set(fsdp.zero.values()) == {3}
    assert p.hidden_communication == pytest.approx(hidden, rel=1e-9)
    assert q.step_time - p.step_time == pytest.approx(hidden, rel=1e-9)
    assert q.communication - p.communication == pytest.approx(hidden, rel=1e-9)


def test_what_the_runtime_runs_on_the_spot_stays_exposed():
    """Tensor-parallel collectives wait on the spot, and a pipeline's gradient sums run after
    its schedule: nothing of theirs is hidden, whatever the profile says."""
    model, x = Blocks(), torch.randn(64, 128, 256)
    h100 = costmodels.h100((4,))
    tp = autopar.plan(model, h100.mesh_shape, (x,), hardware=h100, pipeline=False, layout="tp")
    plain = autopar.plan(model, h100.mesh_shape, (x,), hardware=_without_overlap(h100), pipeline=False,
                         layout="tp")
    assert tp.predicted.communication > 0 and tp.predicted.hidden_communication == 0.0
    assert tp.predicted.step_time == pytest.approx(plain.predicted.step_time, rel=1e-12)
    piped = autopar.plan(model, (2, 2), (x,), hardware="h100",
                         constraints=autopar.Constraints(pp=2))
    assert piped.pipeline is not None and piped.predicted.hidden_communication == 0.0


def test_presets_hide_what_a_collective_leaves_of_the_streaming_multiprocessors():
    for build, sms in ((costmodels.h100, 132), (costmodels.a100, 108)):
        profile = build((8, 2))
        assert set(profile.overlap) == set(overlap.KINDS)
        assert all(v == pytest.approx(1 - 24 / sms) for v in profile.overlap.values())
        assert HardwareProfile.from_json(profile.to_json()).overlap == profile.overlap


def test_a_profile_with_an_unknown_overlap_is_refused():
    profile = costmodels.h100((2,))
    with pytest.raises(ProfileError, match="^autopar: profile overlap .*'tensor_parallel'.* expected kinds among"):
        dataclasses.replace(profile, overlap={"tensor_parallel": 0.5})
    with pytest.raises(ProfileError, match=r"in \[0, 1\]"):
        dataclasses.replace(profile, overlap={"gradient_all_reduce": 1.5})


def test_the_profiler_times_each_collective_alone_and_beside_compute(monkeypatch):
    """With every timing faked (the collective 2 ms alone, the compute 5 ms, together 5.5 ms
    for an all-reduce and 7 ms for the others), the profile hides 75% of an all-reduce and
    nothing of the others; one timing per collective, gathers in forward and backward alike."""
    seen = []

    def fake_timed(calls, device, repeats, warmup, **kw):
        seen.append(len(calls))
        return [2e-3, 5e-3, 5.5e-3 if kind[0] == "all_reduce" else 7e-3]

    kind = [None]

    def fake_call(collective, group, nbytes, device, async_op=False):
        kind[0] = collective
        assert async_op
        return None

    class Bar:
        def set_postfix_str(self, *a, **k):
            pass

        def update(self, *a):
            pass

    monkeypatch.setattr(profiler, "timed", fake_timed)
    monkeypatch.setattr(profiler, "collective_call", fake_call)
    monkeypatch.setattr(profiler, "matmul_call", lambda *a: None)
    run = profiler._Measure(torch.device("cpu"), profiler.Sweep.quick(), Bar(), lambda what, key: None)
    measured = run.overlap("dp", group=None)
    assert seen == [3] * len(profiler.OVERLAP_COLLECTIVES)
    assert measured["gradient_all_reduce"] == pytest.approx(0.75)
    assert measured["gradient_reduce_scatter"] == 0.0
    assert measured["parameter_gather"] == measured["parameter_regather"] == 0.0
    assert set(measured) == set(overlap.KINDS)
    assert not math.isnan(sum(measured.values()))
