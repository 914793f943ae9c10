"""The last pipeline rank's memory when the loss dominates it (a big vocabulary: the logits,
what the loss's backward keeps of them and the gradients it makes), against the full-scale
dry run. Interleaved 1F1B gives that rank other chunks too: the chunk holding the loss runs
each micro-batch's backward right after its forward, while the rank's other chunks fill,
so the rank's peak is one loss micro-batch plus the others' in flight at that instant, not
each chunk's own peak added up (``autopar.passes.solve.rank_replay.rank_peaks``)."""

import warnings

import pytest
import torch

import autopar
from autopar import layouts
from autopar.costmodels.memory import schedule_order
from autopar.models import GPT, GPTConfig
from autopar.passes.capture import capture
from autopar.passes.planner.pipeline import pipeline_plan
from autopar.passes.planner.request import PlanRequest
from autopar.passes.solve.rank_replay import rank_peaks
from autopar.passes.solve.stages import InFlight, LayerCosts, StageCut, cut_stages


def test_the_loss_ranks_interleaved_peak_is_predicted_within_ten_percent():
    """A 4-layer GPT with a 32k vocabulary (the loss's stage holds most of the rank), PP2 x 2
    chunks, 4 micro-batches: the last pipeline rank's peak, its activations and temporaries
    each within 10% of the dry run's (~6 s with the machine to itself). (Rank 0 of this tiny
    plan peaks in the optimizer step's re-gather of its ZeRO-2 embedding, which no prediction
    prices yet.)"""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layers=4, vocab_size=32768))
    inputs = (torch.zeros(16, 64, dtype=torch.long, device="meta"),)
    request = PlanRequest(mesh_shape=(2, 4), hardware="h100", memory_limit=80e9, layouts=("dp",),
                          hint_fn=layouts.hints)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan, why = pipeline_plan(capture(model, inputs), 2, (4,), request, solver_time_s=2,
                                  schedules=("interleaved_1f1b",))
        assert plan is not None, why
        assert plan.pipeline.chunks_per_rank == 2 and plan.pipeline.micro_batches > 2
        last_rank = 7  # the world's last rank: the last pipeline rank (stages 1 and 3), its last intra-op rank
        result = autopar.dry_run(plan, model, inputs, ranks=[last_rank], workers=1)
    assert result.ok, result.table()
    (last,) = result.ranks
    assert last.memory["temporary"] > last.peak / 4  # the loss's backward is what this rank peaks in
    predicted = plan.predicted.memory_by_rank[last.coordinate[0]]
    assert sum(predicted.values()) / last.peak == pytest.approx(1.0, abs=0.10), result.table()
    for kind in ("activations", "temporary"):
        assert predicted[kind] / last.memory[kind] == pytest.approx(1.0, abs=0.10), (kind, result.table())


def _cut(per_micro_batch: list[float], in_backward: list[float]) -> StageCut:
    n = len(per_micro_batch)
    zeros = [0.0] * n
    return StageCut(list(range(n)), zeros, zeros, n, [0] * n, zeros, zeros, held_always=zeros, gradient_bytes=zeros,
                    per_micro_batch=per_micro_batch, in_backward=in_backward, rebuilt=zeros, adding=zeros)


def test_rank_peaks_replay_torchs_order():
    """On torch's interleaved order (2 ranks, 2 chunks, 4 micro-batches), rank 1 runs chunk 1
    twice forward, then chunk 3 (the last) forward and backward: its peak is during that
    backward, with 2 micro-batches of chunk 1 and 1 of chunk 3 in flight plus chunk 3's
    temporaries; 1F1B's last rank holds one micro-batch."""
    order = schedule_order("interleaved_1f1b", 2, 4, 2)[1]
    assert [(f, s) for f, s in order[:4]] == [(True, 1), (True, 1), (True, 3), (False, 3)]
    peak = rank_peaks(_cut([0.0, 10.0, 0.0, 100.0], [0.0, 0.0, 0.0, 1000.0]), "interleaved_1f1b", 4, 2)[1]
    assert peak.total == pytest.approx(2 * 10.0 + 100.0 + 1000.0) and peak.temporary == pytest.approx(1000.0)
    one = rank_peaks(_cut([5.0, 7.0], [0.0, 3.0]), "1f1b", 4)
    assert [p.total for p in one] == pytest.approx([2 * 5.0, 7.0 + 3.0])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_stage_per_rank_replays_to_the_stage_formula(schedule):
    """With one stage per rank the replay of torch's order is the cut's own stage peak
    (``stage_peak``'s two instants), recomputation, gradients and temporaries included."""

    layers = 6
    costs = LayerCosts(time=[1.0] * layers, static_memory=[10.0] * layers, activation_memory=[4.0, 5.0] * 3,
                       gradient_memory=[3.0] * layers, accumulating=[2.0] * layers,
                       temporary_memory=[0.0] * (layers - 1) + [6.0], recompute_saving=[3.0] * layers,
                       recompute_time=[0.5] * layers)
    in_flight = InFlight.of(schedule, 3, 4)
    assert in_flight.peak.tolist() == ([4, 4, 4] if schedule == "gpipe" else [3, 2, 1])
    cut = cut_stages(costs, 3, in_flight, memory_limit=44.0)
    assert cut is not None and any(cut.recomputed)
    assert [p.total for p in rank_peaks(cut, schedule, 4)] == pytest.approx(cut.stage_memory)
