"""Every sharding rule checked on torch's own op database, and the op coverage table.

The calls come from OpInfo samples (``torch.testing._internal.common_methods_invocations.op_db``,
the samples DTensor checks its rules on): each OpInfo's first samples run under a dispatch
mode that records every ATen call they make, so an OpInfo is mapped to the overloads it
really reaches (``torch.roll`` to ``aten.roll.default``, ``F.softplus`` to
``aten.softplus.default``); each sample is also passed straight to the overloads of the
OpInfo's ATen name, for the composite ops export keeps and the dispatcher decomposes.
Every call of an op that has a rule has its strategies simulated
(``autopar.passes.simulate.check_strategy``) on a 1-, 2- and 3-axis mesh sized to the
call's shapes (OpInfo's dims are 5, 10 and 20: a mesh of 2s would split none of the 5s):
every strategy on one axis, a random draw of the combinations on two and three. Ops that
no OpInfo reaches are checked on the hand samples of ``tests/op_samples`` on one axis
(``tests/test_rules_property.py`` runs those on 2- and 3-axis meshes).

``docs/op_coverage.md`` is generated from the same walk: every op of torch's core ATen set
and every op with a rule, as checked, covered but not checked, or missing. The test fails
when the file is stale; ``python -m tests.test_rules_opinfo --write-table`` rewrites it.
"""

from __future__ import annotations

import argparse
import functools
import random
import warnings
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.passes import rules
from autopar.passes.op_strategies import OpInfo
from autopar.passes.simulate import check_strategy
from tests.op_samples import SAMPLERS

TABLE = Path(__file__).resolve().parent.parent / "docs" / "op_coverage.md"
SAMPLES_PER_OPINFO = 3  # the first samples of each OpInfo: enough shapes, and the walk stays short
CALLS_PER_OP = 2  # distinct recorded calls checked per ATen op
SAMPLE_MULTI = 12  # strategies drawn per call on the 2- and 3-axis meshes (every one on the 1-axis mesh)
HAND_DRAWS = 2  # draws of each hand sampler, for the ops no OpInfo reaches


class _Recorder(TorchDispatchMode):
    """Every ATen call made under it, with copies of its arguments taken before it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "aten":
            self.calls.append((func, _copy(args), _copy(kwargs)))
        return func(*args, **kwargs)


def _copy(tree):
    return pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, tree)


def _dtype(opinfo) -> torch.dtype | None:
    """float64 where the op takes it (the simulator's sums then add no rounding of their own)."""
    supported = opinfo.supported_dtypes("cpu")
    return next((d for d in (torch.float64, torch.float32, torch.int64, torch.bool) if d in supported), None)


def _tensors(args, kwargs) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]


def _checkable(op, args, kwargs) -> bool:
    """Dense, real, non-empty tensors, and an op that draws no random numbers."""
    if torch.Tag.nondeterministic_seeded in op.tags:
        return False
    tensors = _tensors(args, kwargs)
    return bool(tensors) and all(
        t.layout == torch.strided and not t.is_complex() and t.numel() > 0 for t in tensors
    )


def _call_key(op, args, kwargs) -> str:
    shaped = pytree.tree_map(lambda x: ("T", tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x,
                             (args, kwargs))
    return f"{op}{shaped}"


def _overloads_named(opinfo) -> list:
    """The ATen overloads with a rule of the OpInfo's ATen name (``nn.functional.softplus``:
    ``aten.softplus.*``)."""
    packet = getattr(torch.ops.aten, opinfo.aten_name or opinfo.name.rsplit(".", 1)[-1], None)
    overloads = [getattr(packet, o) for o in packet.overloads()] if packet is not None else []
    return [op for op in overloads if rules.rule_for(op)]


def _direct_calls(opinfo, sample) -> list[tuple]:
    """The sample passed straight to each of those overloads whose schema takes it: export
    keeps composite ops (``repeat_interleave.self_int``, ``layer_norm``) that the dispatcher
    decomposes before a dispatch mode sees them."""
    calls = []
    for op in _overloads_named(opinfo):
        args = (sample.input, *sample.args) if isinstance(sample.input, torch.Tensor) else (*sample.input, *sample.args)
        try:
            op(*_copy(args), **_copy(sample.kwargs))
        except Exception:  # noqa: BLE001 - this overload's schema does not take the sample
            continue
        calls.append((op, _copy(args), _copy(sample.kwargs)))
    return calls


def opinfo_calls() -> dict[str, list[tuple]]:
    """ATen op -> up to CALLS_PER_OP distinct (op, args, kwargs) recorded from OpInfo samples."""
    from torch.testing._internal.common_methods_invocations import op_db  # heavy: imported when walked

    calls: dict[str, dict[str, tuple]] = defaultdict(dict)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for opinfo in op_db:
            dtype = _dtype(opinfo)
            if dtype is None:
                continue
            try:
                samples = iter(opinfo.sample_inputs("cpu", dtype))
                for _, sample in zip(range(SAMPLES_PER_OPINFO), samples):
                    with _Recorder() as recorder:
                        try:
                            opinfo.op(sample.input, *sample.args, **sample.kwargs)
                        except Exception:  # noqa: BLE001 - a sample that errors is an error-input sample
                            pass
                    for op, args, kwargs in recorder.calls + _direct_calls(opinfo, sample):
                        seen = calls[str(op)]
                        if rules.rule_for(op) and len(seen) < CALLS_PER_OP and _checkable(op, args, kwargs):
                            seen.setdefault(_call_key(op, args, kwargs), (op, args, kwargs))
            except Exception:  # noqa: BLE001 - an OpInfo whose samples cannot be built on this machine
                continue
    return {name: list(found.values()) for name, found in calls.items() if found}


def hand_calls(skip: set[str]) -> dict[str, list[tuple]]:
    """Calls of the hand samplers (``tests/op_samples``) for ops not in ``skip``."""
    calls: dict[str, list[tuple]] = defaultdict(list)
    for family in sorted(SAMPLERS):
        rng = random.Random(f"opinfo-{family}")
        for _ in range(HAND_DRAWS):
            op, args, kwargs = SAMPLERS[family](rng)
            if str(op) not in skip and _checkable(op, args, kwargs):
                calls[str(op)].append((op, args, kwargs))
    return dict(calls)


def meshes_for(info: OpInfo) -> list[tuple[int, ...]]:
    """1-, 2- and 3-axis meshes whose first axis is the prime (2, 3 or 5) that divides the
    most of the call's dims, so that shards of OpInfo's odd sizes are exercised."""
    dims = [s for m in (*info.inputs, *info.outputs) for s in m.shape if s > 1]
    p = max((2, 3, 5), key=lambda q: (sum(1 for s in dims if s % q == 0), -q))
    return [(p,), (p, 2), (p, 2, 2)]


@dataclass
class Checked:
    """What the walk found: strategies simulated per op, by source, and the failures."""

    strategies: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    source: dict[str, str] = field(default_factory=dict)  # op -> "OpInfo" or "hand sample"
    failures: list[str] = field(default_factory=list)


def check_calls(calls: dict[str, list[tuple]], source: str, found: Checked, axes: int = 3) -> None:
    """Simulate the strategies of every call on its meshes of up to ``axes`` axes."""
    for name in sorted(calls):
        for i, (op, args, kwargs) in enumerate(calls[name]):
            rng = random.Random(f"{name}{i}")
            inputs = _tensors(args, kwargs)
            try:
                info = OpInfo.from_call(op, args, kwargs)
            except Exception:  # noqa: BLE001 - the op itself refuses these arguments
                continue
            for mesh in meshes_for(info)[:axes]:
                try:
                    strategies = rules.strategies_for(info, mesh)
                except Exception as exc:  # noqa: BLE001 - a rule that crashes on a valid call is wrong
                    found.failures.append(f"{name} on mesh {mesh}: the rule raised {type(exc).__name__}: {exc}")
                    break
                if len(mesh) > 1 and len(strategies) > SAMPLE_MULTI:
                    strategies = [strategies[0], *rng.sample(strategies[1:], SAMPLE_MULTI - 1)]
                for strategy in strategies:
                    try:
                        check_strategy(info, strategy, inputs, mesh, rng)
                    except Exception as exc:  # noqa: BLE001 - shards that cannot be put back are wrong too
                        found.failures.append(f"{name} {strategy} on mesh {mesh}: {type(exc).__name__}: {exc} "
                                              f"[{_call_key(op, args, kwargs)[:300]}]")
                    found.strategies[name] += 1
                    found.source[name] = source


@functools.cache
def walk() -> Checked:
    found = Checked()
    torch.manual_seed(0)  # OpInfo's sample values: the same walk every run
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a thread pool only spins (5x the time on a busy machine)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # OpInfo's sample makers look for the running unittest by inspect.stack(): on a
            # thread of its own the stack is a few frames, not pytest's hundred (minutes saved)
            with ThreadPoolExecutor(1) as pool:
                calls = pool.submit(opinfo_calls).result()
            check_calls(calls, "OpInfo", found)
            # every option on one axis: tests/test_rules_property.py composes them on 2 and 3 axes
            check_calls(hand_calls(set(found.source)), "hand sample", found, axes=1)
    finally:
        torch.set_num_threads(threads)
    return found


def core_aten_ops() -> set[str]:
    """The overloads torch tags ``core``: the ATen set export's core decomposition ends in.
    Listed from the dispatcher's registry (``dir(torch.ops.aten)`` lists only the ops
    touched so far)."""
    core = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, full = qualified.partition("::")
        name, _, overload = full.partition(".")
        if namespace != "aten" or name.startswith("sym_"):  # sym_*: shapes, not tensors
            continue
        try:
            op = getattr(getattr(torch.ops.aten, name), overload or "default")
        except AttributeError:  # registered in the dispatcher but not exposed to Python
            continue
        if torch.Tag.core in op.tags:
            core.add(str(op))
    return core


def coverage_table(found: Checked) -> str:
    core = core_aten_ops()
    ruled = set(rules.registered_ops())
    rows = []
    for op in sorted(core | ruled):
        if op not in ruled:
            status = "missing"
        elif found.strategies.get(op):
            status = f"checked ({found.source[op]})"
        else:
            status = "covered, not checked (no sample)"
        rows.append(f"| `{op}` | {'yes' if op in core else ''} | {status} |")
    counts = {s: sum(1 for r in rows if f"| {s}" in r) for s in ("checked", "covered", "missing")}
    core_missing = sorted(core - ruled)
    return "\n".join([
        "# Op coverage",
        "",
        "Generated by `python -m tests.test_rules_opinfo --write-table` (checked by",
        "`tests/test_rules_opinfo.py`; do not edit by hand). Every op of torch's core ATen set",
        "(`torch.Tag.core`) and every op with a sharding rule (`passes/rules/`). *checked*: every",
        "strategy of its rule simulated on calls from torch's OpInfo samples (on 1-, 2- and",
        "3-axis meshes) or, where none reaches it, from the hand samples of `tests/op_samples.py`.",
        "*missing*: no rule; the op runs replicated, with a warning.",
        "",
        f"{counts['checked']} checked, {counts['covered']} covered but not checked, "
        f"{counts['missing']} missing; core ATen: {len(core) - len(core_missing)} of {len(core)} have a rule.",
        "",
        "| op | core ATen | status |",
        "| --- | --- | --- |",
        *rows,
        "",
    ])


def test_every_strategy_of_every_rule_reproduces_the_op_on_opinfo_samples():
    found = walk()
    assert not found.failures, f"{len(found.failures)} wrong strategies:\n" + "\n".join(found.failures[:30])
    assert sum(found.strategies.values()) > 5000, "the walk checked too few strategies to mean anything"


def test_the_op_coverage_table_is_current():
    expected = coverage_table(walk())
    assert TABLE.exists() and TABLE.read_text() == expected, (
        "autopar: docs/op_coverage.md is stale (the rules or their checks changed); "
        "rewrite it with `python -m tests.test_rules_opinfo --write-table`"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-table", action="store_true", help=f"rewrite {TABLE.name}")
    opts = parser.parse_args()
    result = walk()
    for line in result.failures:
        print(line)
    print(f"{sum(result.strategies.values())} strategies checked on {len(result.strategies)} ops; "
          f"{len(result.failures)} wrong")
    if opts.write_table:
        TABLE.write_text(coverage_table(result))
        print(f"wrote {TABLE}")
