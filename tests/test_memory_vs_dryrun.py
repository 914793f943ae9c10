"""Predicted memory per device against the full-scale dry run's (``autopar.dry_run``,
torch's MemTracker on fake tensors), by kind: a bf16 model's optimizer state as it runs
(pure bf16 AdamW), and the loss a plan made without one trains with (its kept log-softmax
and its backward's gradients), priced by ``autopar.passes.loss_memory``."""

import warnings

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.bench.workloads import lm_loss
from autopar.models import GPT, GPTConfig
from autopar.passes import loss_memory as loss_memory_module
from autopar.passes.capture import capture
from autopar.passes.loss_memory import best_target_layout, loss_memory
from autopar.passes.state_costs import at_peak
from autopar.runtime.loss import WithLoss

GIB = 2**30


def _language_model(vocab: int = 8192, batch: int = 8, seq: int = 256):
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=vocab, max_seq_len=seq, dim=256, n_heads=4, n_layers=2)).to(torch.bfloat16)
    return model, (torch.zeros(batch, seq, dtype=torch.long, device="meta"),)


@pytest.fixture(scope="module")
def planned_alone():
    """A bf16 language model planned without its loss on a (2, 4) mesh, and its dry run."""
    model, inputs = _language_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (2, 4), inputs, hardware="h100", time_limit_s=2, pipeline=False)
        result = autopar.dry_run(plan, model, inputs)
    assert result.ok, result.table()
    return plan, result


def test_a_plan_made_without_its_loss_predicts_the_peak_within_ten_percent(planned_alone):
    plan, result = planned_alone
    assert plan.predicted.memory["temporary"] > 0  # the default loss's backward
    assert result.ratio == pytest.approx(1.0, abs=0.10), result.table()


def test_a_bf16_model_is_priced_as_pure_bf16_adamw(planned_alone):
    plan, result = planned_alone
    measured = max(r.memory["optimizer"] for r in result.ranks)
    assert plan.predicted.memory["optimizer"] == pytest.approx(measured, rel=0.02)
    assert plan.predicted.memory["optimizer"] == pytest.approx(2 * plan.predicted.memory["parameters"], rel=0.05)


def test_the_loss_of_vocab_split_logits_holds_more_than_of_batch_split_ones():
    """A mean cross-entropy is never split over the classes: logits split over the vocabulary
    are gathered whole for it, logits split over the batch are not."""
    model, inputs = _language_model()
    priced = loss_memory(capture(model, inputs), (2, 4))
    vocab_split = priced.of((Shard(2), Shard(2)))
    batch_split = priced.of((Shard(0), Shard(1)))
    whole = priced.of((Replicate(), Replicate()))
    assert batch_split["activations"] < vocab_split["activations"] == pytest.approx(whole["activations"])
    assert batch_split["temporary"] < vocab_split["temporary"]
    logits = 8 * 256 * 8192 * 2  # bytes of the whole bf16 logits: the kept log-softmax is as large
    assert whole["activations"] == pytest.approx(logits, rel=0.01)


def test_placements_alike_in_local_shapes_are_measured_once(monkeypatch):
    """The loss run under placements that mirror each other over two axes of one size
    reads and moves the same local shapes: it is measured once, and each placement's price
    is what measuring it alone gives."""
    model, inputs = _language_model()
    priced = loss_memory(capture(model, inputs), (2, 2))
    measured = []
    measure = loss_memory_module._measure
    monkeypatch.setattr(loss_memory_module, "_measure", lambda graph, choice: measured.append(1) or measure(
        graph, choice))
    specs = [(Shard(0), Replicate()), (Replicate(), Shard(0)), (Shard(2), Replicate())]
    prices = [priced.of(spec) for spec in specs]
    assert len(measured) == 2  # the mirrored batch splits once, the vocabulary split once
    assert prices[0] == prices[1] != prices[2]
    for spec, price in zip(specs, prices):
        alone = measure(priced.graph, best_target_layout(priced.graph, {priced.output: spec}, priced.target))
        assert price == alone, spec


def test_a_whole_output_leaves_its_target_split():
    """Where the output is whole on every device, the loss can read the target split or whole
    with nothing moved either way: it keeps the split one (the whole target on every device
    held wide-mlp's last pipeline stage at 512 GPUs 16 GiB it did not need)."""
    with torch.device("meta"):
        model = torch.nn.Linear(256, 256)
    priced = loss_memory(capture(model, (torch.zeros(64, 256, device="meta"),)), (8,))
    choice = best_target_layout(priced.graph, {priced.output: (Replicate(),)}, priced.target)
    assert priced.graph[priced.target].strategies[choice[priced.target]].output == (Shard(0),)


def test_a_graph_that_ends_in_its_loss_prices_no_default_loss():
    model, inputs = _language_model()

    target = torch.zeros(8, 256, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(WithLoss(model, lm_loss), (*inputs, target))
    assert loss_memory(captured, (2, 4)) is None


def test_the_peak_is_backward_start_or_the_gradient_sum_whichever_holds_more():
    held = {"parameters": 1.0, "gradients": 1.0, "optimizer": 2.0, "activations": 5.0, "temporary": 1.0}
    assert at_peak(held) == {**held, "gradients": 0.0}  # no gradient made yet at backward's start
    small = {**held, "activations": 0.5, "temporary": 0.0}
    assert at_peak(small) == {**small, "activations": 0.0, "temporary": 1.0}  # gradients and their bucket copies
    assert sum(at_peak(held).values()) <= sum(held.values())
