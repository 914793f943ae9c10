"""ZeRO memory, activations in flight, pipeline bubble: the published forms."""

import pytest

from autopar.costmodels import (
    activation_bytes,
    bubble_fraction,
    layer_activation_bytes,
    micro_batches_in_flight,
    model_state_bytes,
    pipeline_time,
)

PSI, N = 7.5e9, 64


@pytest.mark.parametrize(
    "zero, want",
    [(0, 16 * PSI), (1, 4 * PSI + 12 * PSI / N), (2, 2 * PSI + 14 * PSI / N), (3, 16 * PSI / N)],
)
def test_zero_mixed_precision_matches_the_zero_paper(zero, want):
    assert model_state_bytes(PSI, zero, N) == pytest.approx(want)


def test_zero_paper_example_7_5b_on_64_gpus():
    # ZeRO paper Fig. 1: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB
    got = [model_state_bytes(PSI, z, N) / 1e9 for z in range(4)]
    assert got == pytest.approx([120, 31.4, 16.6, 1.88], rel=0.01)


@pytest.mark.parametrize(
    "zero, want",
    [(0, 16 * PSI), (1, 8 * PSI + 8 * PSI / N), (2, 4 * PSI + 12 * PSI / N), (3, 16 * PSI / N)],
)
def test_zero_fp32(zero, want):
    assert model_state_bytes(PSI, zero, N, precision="fp32") == pytest.approx(want)


def test_zero_stages_are_ordered_and_no_sharding_changes_nothing():
    mem = [model_state_bytes(1e9, z, 8) for z in range(4)]
    assert mem == sorted(mem, reverse=True)
    assert len({model_state_bytes(1e9, z, 1) for z in range(4)}) == 1


def test_bad_memory_arguments():
    with pytest.raises(ValueError, match="autopar: ZeRO stage"):
        model_state_bytes(1, 4, 2)
    with pytest.raises(ValueError, match="autopar: precision"):
        model_state_bytes(1, 1, 2, precision="fp8")


def test_micro_batches_in_flight():
    assert micro_batches_in_flight("gpipe", 4, 16) == 16
    assert micro_batches_in_flight("1f1b", 4, 16) == 4
    assert micro_batches_in_flight("1f1b", 4, 2) == 2
    assert micro_batches_in_flight("interleaved_1f1b", 4, 16, chunks=2) == pytest.approx(4 + 3 / 2)
    assert activation_bytes(1e6, "1f1b", 4, 16) == pytest.approx(4e6)
    assert (
        activation_bytes(1e6, "gpipe", 4, 16)
        > activation_bytes(1e6, "interleaved_1f1b", 4, 16, 2)
        > activation_bytes(1e6, "1f1b", 4, 16)
    )


def test_bubble():
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved_1f1b", 4, 8, chunks=2) == pytest.approx(3 / 19)
    assert bubble_fraction("interleaved_1f1b", 4, 8, 2) < bubble_fraction("1f1b", 4, 8)
    assert bubble_fraction("1f1b", 1, 8) == 0


def test_pipeline_time_matches_the_bubble():
    t = pipeline_time("1f1b", 4, 8, 1.0, 2.0)
    assert t == pytest.approx((8 + 3) * 3.0)
    assert 1 - 8 * 3.0 / t == pytest.approx(bubble_fraction("1f1b", 4, 8))
    ti = pipeline_time("interleaved_1f1b", 4, 8, 1.0, 2.0, chunks=2)
    assert 1 - 8 * 3.0 / ti == pytest.approx(bubble_fraction("interleaved_1f1b", 4, 8, 2))


def test_bad_schedule_arguments():
    with pytest.raises(ValueError, match="autopar: expected a schedule"):
        bubble_fraction("zb", 4, 8)
    with pytest.raises(ValueError, match="autopar: only interleaved_1f1b"):
        bubble_fraction("1f1b", 4, 8, chunks=2)
    with pytest.raises(ValueError, match="autopar: expected positive stages"):
        bubble_fraction("1f1b", 0, 8)


def test_layer_activations_match_korthikanti():
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B's layer
    assert layer_activation_bytes(s, b, h, a) == pytest.approx(s * b * h * 34 + 5 * a * s * s * b)
    tp = layer_activation_bytes(s, b, h, a, tp=8)
    assert tp == pytest.approx(s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    sp = layer_activation_bytes(s, b, h, a, tp=8, sequence_parallel=True)
    assert sp == pytest.approx(layer_activation_bytes(s, b, h, a) / 8)
    assert sp < tp < layer_activation_bytes(s, b, h, a)
