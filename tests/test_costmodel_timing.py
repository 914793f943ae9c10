"""The profiler's timing primitives (single process, no process group)."""

import pytest
import torch

from costmodels.timing import MAX_COPIES, matmul_operands, median_time, rotating


def test_rotating_spans_the_working_set():
    made = []
    nxt = rotating(lambda: made.append(1) or len(made), set_bytes=1000, working_set_bytes=10_000)
    assert len(made) == 10
    assert [nxt() for _ in range(12)] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2]
    made.clear()
    rotating(lambda: made.append(1), set_bytes=1, working_set_bytes=1 << 30)
    assert len(made) == MAX_COPIES


def test_matmul_operands_layouts():
    for layout in ("nn", "nt", "tn"):
        a, b = matmul_operands(8, 4, 6, "fp32", torch.device("cpu"), layout)
        assert a.shape == (8, 4) and b.shape == (4, 6)
        assert a.is_contiguous() == (layout != "tn") and b.is_contiguous() == (layout != "nt")
    with pytest.raises(ValueError, match="autopar: matmul layout must be one of"):
        matmul_operands(2, 2, 2, "fp32", torch.device("cpu"), "tt")


def test_median_time_is_per_call():
    calls = []
    t = median_time(lambda: calls.append(1), torch.device("cpu"), repeats=3, warmup=1, min_batch_s=0.001)
    assert 0 < t < 0.001 and len(calls) > 3
