"""The profiler's timing primitives (single process, no process group)."""

import dataclasses

import pytest
import torch

from autopar.costmodels import profiler
from autopar.costmodels.timing import (MAX_COPIES, POINTWISE_CALLS, OperandPool, matmul_views, median_time,
                                       median_times, pointwise_call, rotating)


def test_rotating_spans_the_working_set():
    made = []
    nxt = rotating(lambda: made.append(1) or len(made), set_bytes=1000, working_set_bytes=10_000)
    assert len(made) == 10
    assert [nxt() for _ in range(12)] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2]
    made.clear()
    rotating(lambda: made.append(1), set_bytes=1, working_set_bytes=1 << 30)
    assert len(made) == MAX_COPIES


def test_matmul_views_layouts():
    for layout in ("nn", "nt", "tn"):
        a, b = matmul_views(torch.zeros(32), torch.zeros(24), 8, 4, 6, layout)
        assert a.shape == (8, 4) and b.shape == (4, 6)
        assert a.is_contiguous() == (layout != "tn") and b.is_contiguous() == (layout != "nt")
    with pytest.raises(ValueError, match="autopar: matmul layout must be one of"):
        matmul_views(torch.zeros(4), torch.zeros(4), 2, 2, 2, "tt")


def test_median_time_is_per_call():
    calls = []
    t = median_time(lambda: calls.append(1), torch.device("cpu"), repeats=3, warmup=1, min_batch_s=0.001)
    assert 0 < t < 0.001 and len(calls) > 3


def test_median_times_take_turns_batch_by_batch():
    order = []
    times = median_times(
        [lambda: order.append("a"), lambda: order.append("b")], torch.device("cpu"), repeats=3, warmup=0,
        min_batch_s=0.0,
    )
    assert len(times) == 2 and all(t > 0 for t in times)
    assert order[-6:] == ["a", "b"] * 3  # one call per batch (min_batch_s=0), a and b in turns


def test_operand_pool_slices_one_buffer_into_disjoint_sets():
    pool = OperandPool(torch.device("cpu"), working_set_bytes=4096 * 4)
    sets = pool.sets((100, 200), "fp32")
    assert len(sets) == 4096 // 300
    assert all(a.numel() == 100 and b.numel() == 200 for a, b in sets)
    starts = sorted(t.storage_offset() for s in sets for t in s)
    assert starts == sorted(set(starts))  # disjoint
    buffer = pool.pools["fp32"].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == buffer for s in sets for t in s)  # one buffer
    big = pool.sets((5000,), "fp32")  # larger than the working set: one set, the pool grows
    assert len(big) == 1 and big[0][0].numel() == 5000
    pool.release("fp32")
    assert "fp32" not in pool.pools


def test_every_pointwise_kind_runs_in_every_dtype():
    pool = OperandPool(torch.device("cpu"), working_set_bytes=1 << 16)
    for kind in POINTWISE_CALLS:
        for dtype in ("fp32", "bf16", "fp16"):
            out = pointwise_call(kind, 1024, dtype, pool)()
            assert isinstance(out, (torch.Tensor, tuple))


def _axis_from_fake_times(monkeypatch, sweep, after_compute):
    """``_Measure.axis`` on 2 ranks with every timing faked: back to back, alpha 100 us and
    1 ns per byte; the compute alone 5 ms, and each size after it ``after_compute(X)``.
    Returns the axis and the repeats each timed sweep asked for."""

    seen = []

    def fake_timed(calls, device, repeats, warmup, **kw):
        seen.append(repeats)
        if len(calls) == len(sweep.comm_bytes):
            return [1e-4 + 1e-9 * b for b in sweep.comm_bytes]
        return [5e-3] + [5e-3 + after_compute(b) for b in sweep.in_step_bytes]

    class Bar:  # the progress bar's two methods the profiler calls
        def set_postfix_str(self, *a, **k):
            pass

        def update(self, *a):
            pass

    monkeypatch.setattr(profiler, "timed", fake_timed)
    monkeypatch.setattr(profiler, "collective_call", lambda kind, group, nbytes, device: None)
    monkeypatch.setattr(profiler, "matmul_call", lambda *a: None)
    run = profiler._Measure(torch.device("cpu"), sweep, Bar(), lambda what, key: None)
    return run.axis(0, "dp", 2, group=None, link="intra_node"), seen


def test_collectives_are_fitted_over_more_batches_than_compute(monkeypatch):
    """A collective's batch time is bimodal under time sharing: its fit takes the median of
    ``Sweep.comm_repeats`` batches per size, compute fits ``Sweep.repeats``; so does the fit
    of each collective timed after compute (the compute alone timed in turns with it)."""

    sweep = dataclasses.replace(profiler.Sweep.quick(), comm_repeats=11, in_step_bytes=(1 << 12, 1 << 16, 1 << 18, 1 << 20))
    # after compute: alpha 300 us, 2 ns per byte
    axis, seen = _axis_from_fake_times(monkeypatch, sweep, lambda b: 3e-4 + 2e-9 * b)
    assert seen == [11] * 10  # every collective kind back to back and after compute, 11 batches
    fit = axis.collectives["all_reduce"]
    assert fit.alpha_s == pytest.approx(1e-4) and "median of 11 batches" in fit.source
    step = axis.in_step["all_reduce"]  # bus factor 2 (N - 1) / N = 1 on 2 ranks
    assert step.alpha_s == pytest.approx(3e-4) and step.beta_bytes_per_s == pytest.approx(5e8)
    assert step.source.startswith("after 2 matmuls 64x64x64") and "median of 11 batches" in step.source
    assert profiler.Sweep().comm_repeats > profiler.Sweep().repeats


def test_collectives_after_compute_that_cannot_be_fitted_keep_the_back_to_back_fit(monkeypatch):
    """Times after compute that do not grow with size are measured again with 3x the
    batches, then the back-to-back fit stands in, saying why."""

    sweep = dataclasses.replace(profiler.Sweep.quick(), comm_repeats=5, in_step_bytes=(1 << 12, 1 << 16, 1 << 18, 1 << 20))
    axis, seen = _axis_from_fake_times(monkeypatch, sweep, lambda b: 2e-3 - 1e-9 * b)  # shrinking
    assert seen == [5] * 5 + [5, 15] * 5  # back to back; then after compute, and again with 3x
    for kind, step in axis.in_step.items():
        back_to_back = axis.collectives[kind]
        assert (step.alpha_s, step.beta_bytes_per_s) == (back_to_back.alpha_s, back_to_back.beta_bytes_per_s)
        assert step.source.startswith("back to back (after compute:") and "do not grow with size" in step.source
