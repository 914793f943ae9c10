"""Every sharding rule checked on torch's own op database, and the op coverage table
(``autopar coverage --ops``; ``tests/test_rules_opinfo.py`` runs the whole walk and keeps
``docs/op_coverage.md`` current).

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
no OpInfo reaches are checked on hand samplers (``autopar/op_samples.py``) on
one axis.

OpInfo's database ships with torch but needs its test extras (``expecttest``): install
autopar with ``[test]``.
"""

from __future__ import annotations

import random
import warnings
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.op_samples import SAMPLERS
from autopar.passes import rules
from autopar.passes.op_strategies import OpInfo
from autopar.passes.rules.random import draws
from autopar.passes.simulate import check_strategy

SAMPLES_PER_OPINFO = 3  # the first samples of each OpInfo: enough shapes, and the walk stays short
CALLS_PER_OP = 2  # distinct recorded calls checked per ATen op
SAMPLE_MULTI = 12  # strategies drawn per call on the 2- and 3-axis meshes (every one on the 1-axis mesh)
HAND_DRAWS = 2  # draws of each hand sampler, for the ops no OpInfo reaches

Call = tuple[Any, tuple, dict]  # (ATen overload, args, kwargs)
Sampler = Callable[[random.Random], Call]


class OpSelection:
    """The ops a walk is limited to, named as ``aten.roll`` (every overload), ``roll`` or
    ``aten.roll.default``; ``None`` names select every op."""

    def __init__(self, names: Iterable[str] | None = None):
        self.names = None if names is None else sorted({_full_name(n) for n in names})

    def __contains__(self, op: Any) -> bool:
        return self.names is None or any(str(op) == n or str(op).startswith(n + ".") for n in self.names)

    def unmatched(self, ops: Iterable[str]) -> list[str]:
        """The selected names that match none of ``ops``."""
        ops = list(ops)
        return [n for n in self.names or () if not any(o == n or o.startswith(n + ".") for o in ops)]


def _full_name(name: str) -> str:
    """``roll`` / ``aten.roll`` / ``aten.roll.default`` -> the ATen name, checked to exist."""
    parts = name.strip().removeprefix("aten.").split(".")
    packet = getattr(torch.ops.aten, parts[0], None) if len(parts) <= 2 and parts[0] else None
    if packet is None or not isinstance(packet, torch._ops.OpOverloadPacket) or (
            len(parts) == 2 and parts[1] not in packet.overloads()):
        raise ValueError(f"autopar: expected ATen op names like aten.roll or aten.roll.default; found {name!r}, "
                         "which names no ATen op (see torch.ops.aten)")
    return "aten." + ".".join(parts)


class _Recorder(TorchDispatchMode):
    """Every ATen call made under it, with copies of its arguments taken before it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

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
    """Dense, real, non-empty tensors, and an op that draws no random numbers unless its rule
    draws them from a key (``autopar.passes.rules.random``: the simulator checks those, the
    tensor-making ``rand`` too)."""
    keyed = draws(op, args, kwargs)
    if torch.Tag.nondeterministic_seeded in op.tags and not keyed:
        return False
    tensors = _tensors(args, kwargs)
    return (bool(tensors) or keyed) and all(
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


def _direct_calls(opinfo, sample) -> list[Call]:
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


def opinfo_calls(selection: OpSelection) -> dict[str, list[Call]]:
    """Selected ATen op -> up to CALLS_PER_OP distinct calls recorded from OpInfo samples."""
    try:  # heavy (seconds), and it needs the test extras: imported when walked
        from torch.testing._internal.common_methods_invocations import op_db
    except ImportError as exc:
        raise ValueError(f"autopar: expected torch's OpInfo database to import; found {exc}; "
                         "install the test extras (pip install -e '.[test]')") from exc

    calls: dict[str, dict[str, Call]] = defaultdict(dict)
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
                        if (op in selection and rules.rule_for(op) and len(seen) < CALLS_PER_OP
                                and _checkable(op, args, kwargs)):
                            seen.setdefault(_call_key(op, args, kwargs), (op, args, kwargs))
            except Exception:  # noqa: BLE001 - an OpInfo whose samples cannot be built on this machine
                continue
    return {name: list(found.values()) for name, found in calls.items() if found}


def hand_calls(samplers: Mapping[str, Sampler], skip: set[str], selection: OpSelection) -> dict[str, list[Call]]:
    """Calls of the hand samplers for selected ops not in ``skip``."""
    calls: dict[str, list[Call]] = defaultdict(list)
    for family in sorted(samplers):
        rng = random.Random(f"opinfo-{family}")
        for _ in range(HAND_DRAWS):
            op, args, kwargs = samplers[family](rng)
            if str(op) not in skip and op in selection and _checkable(op, args, kwargs):
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

    selection: OpSelection = field(default_factory=OpSelection)
    strategies: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    source: dict[str, str] = field(default_factory=dict)  # op -> "OpInfo" or "hand sample"
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{sum(self.strategies.values())} strategies checked on {len(self.strategies)} ops; "
                f"{len(self.failures)} wrong")


def check_calls(calls: dict[str, list[Call]], source: str, found: Checked, axes: int = 3) -> None:
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


def walk(selection: OpSelection | None = None, samplers: Mapping[str, Sampler] | None = None) -> Checked:
    """Check the rules of the selected ops (every op by default) on OpInfo samples, and the
    ops no OpInfo reaches on ``samplers``' calls (one axis: ``tests/test_rules_property.py``
    composes those on 2 and 3)."""
    found = Checked(selection or OpSelection())
    torch.manual_seed(0)  # OpInfo's sample values: the same walk every run
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a thread pool only spins (5x the time on a busy machine)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # OpInfo's sample makers look for the running unittest by inspect.stack(): on a
            # thread of its own the stack is a few frames, not pytest's hundred (minutes saved)
            with ThreadPoolExecutor(1) as pool:
                calls = pool.submit(opinfo_calls, found.selection).result()
            check_calls(calls, "OpInfo", found)
            check_calls(hand_calls(SAMPLERS if samplers is None else samplers, set(found.source), found.selection), "hand sample", found,
                        axes=1)
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
    """The selected ops of torch's core ATen set and with a rule, each checked, covered but
    not checked, or missing; the counts, and the core ops with no rule."""
    core = core_aten_ops()
    ruled = set(rules.registered_ops())
    listed = {op for op in core | ruled if op in found.selection}
    listed |= set(found.selection.unmatched(listed))  # a selected op neither core nor ruled: missing
    status = {}
    for op in listed:
        if op not in ruled:
            status[op] = "missing"
        elif found.strategies.get(op):
            status[op] = f"checked ({found.source[op]})"
        else:
            status[op] = "covered, not checked (no sample)"
    counts = {s: sum(1 for v in status.values() if v.startswith(s)) for s in ("checked", "covered", "missing")}
    core_listed = listed & core
    core_missing = sorted(core_listed - ruled)
    return "\n".join([
        f"{counts['checked']} checked, {counts['covered']} covered but not checked, "
        f"{counts['missing']} missing; core ATen: {len(core_listed) - len(core_missing)} of {len(core_listed)} "
        "have a rule.",
        "",
        "| op | core ATen | status |",
        "| --- | --- | --- |",
        *(f"| `{op}` | {'yes' if op in core else ''} | {status[op]} |" for op in sorted(listed)),
        "",
        "Core ATen ops with no rule: " + (", ".join(f"`{op}`" for op in core_missing) or "none") + ".",
        "",
    ])
