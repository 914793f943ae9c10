"""Mixed precision as FSDP2 runs it (``torch.distributed.fsdp.MixedPrecisionPolicy``).

The parameters (and so the optimizer's state) stay in their own dtype, float32: the
master copy, stored as the plan says (ZeRO levels apply to it). Each forward computes
with a ``param_dtype`` copy of every floating parameter, made once per program call and
shared by all of its ops:

- a parameter used as it is stored (ZeRO-0/1, tensor parallel) is cast by one graph node
  just before its first op; the copy lives until backward is done with it (its ops save it);
- a bucket gathered from storage (ZeRO-2/3, :class:`MixedGather`) casts this rank's
  shards and all-gathers in ``param_dtype``, as FSDP2 does; a ZeRO-3 bucket is cast
  and gathered again in backward;
- gradients leave backward in ``param_dtype``, are reduced in ``reduce_dtype`` (the
  bucket's reduce-scatter here; the data-parallel all-reduce in
  ``autopar.runtime.gradsync``) and accumulate in the master dtype in ``.grad``.

The program is captured with the parameters in ``param_dtype`` (:func:`capture_cast`),
so that what the model decides from its weights' dtype (``x.to(w.dtype)``, masks made
in it, norms computed in float32 and cast back) is what a ``param_dtype`` model does; its
parameters' placeholders carry the policy in the cost model's terms (``MixedPrecision``
under ``costmodels.precision.META_KEY``), so a plan of that graph prices the masters,
the working copies and the reductions as they run here.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import fx, nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from autopar.costmodels.precision import META_KEY, OUTPUT_DTYPE_KEY, MixedPrecision
from autopar.passes.capture import Captured
from autopar.passes.loss_memory import output_node
from autopar.passes.lowering.buckets import GatherBucket
from autopar.passes.lowering.codegen import RankProgram, Reshard


# Policies by the short name the CLI and benchmarks take (``--mp bf16``): bf16 compute with
# float32 masters, gradients reduced in float32 and outputs (the loss's inputs) in float32
POLICIES = {"bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                         output_dtype=torch.float32)}


@dataclass(frozen=True)
class Precision:
    """A policy as the runtime applies it: ``param_dtype`` None computes in the master dtype;
    ``reduce_dtype`` is FSDP2's: None reduces in the compute dtype."""

    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    output_dtype: torch.dtype | None
    cast_forward_inputs: bool

    @staticmethod
    def of(policy: Any) -> "Precision | None":
        """The policy checked (None: no mixed precision, today's behaviour)."""
        if policy is None:
            return None
        if not isinstance(policy, MixedPrecisionPolicy):
            raise TypeError(
                f"autopar: expected mp_policy as a torch.distributed.fsdp.MixedPrecisionPolicy, found "
                f"{type(policy).__name__}; e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                "reduce_dtype=torch.float32)"
            )
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(policy, field)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(
                    f"autopar: expected mp_policy.{field} to be a floating torch.dtype or None, found {dtype!r}; "
                    "e.g. torch.bfloat16"
                )
        return Precision(policy.param_dtype, policy.reduce_dtype, policy.output_dtype, policy.cast_forward_inputs)

    def compute_dtype(self, master: torch.dtype) -> torch.dtype:
        """The dtype a parameter of ``master`` dtype computes in (non-floating ones are not cast)."""
        return self.param_dtype if self.param_dtype is not None and master.is_floating_point else master

    def gradient_reduce_dtype(self, master: torch.dtype) -> torch.dtype:
        """The dtype a gradient of a ``master`` dtype parameter is reduced in (FSDP2's rule)."""
        if not master.is_floating_point:
            return master
        return self.reduce_dtype or self.compute_dtype(master)

    def cost_model(self, master: torch.dtype) -> MixedPrecision | None:
        """How a ``master`` dtype parameter runs, in the cost model's terms (None: not cast, not reduced otherwise)."""
        compute, reduce = self.compute_dtype(master), self.gradient_reduce_dtype(master)
        return None if compute == master == reduce else MixedPrecision(master, compute, reduce)

    def record(self, priced: MixedPrecision | None) -> dict[str, Any]:
        """The policy as a plan records it (``Plan.mp_policy``): dtype names, and how it was priced."""
        def name(dtype: torch.dtype | None) -> str | None:
            return None if dtype is None else str(dtype).removeprefix("torch.")

        return {"param_dtype": name(self.param_dtype), "reduce_dtype": name(self.reduce_dtype),
                "output_dtype": name(self.output_dtype), "cast_forward_inputs": self.cast_forward_inputs,
                "priced": priced.describe() if priced is not None else "as the model's own dtypes (nothing cast)"}

    def input(self, x: Any) -> Any:
        """A forward input as the model gets it (``cast_forward_inputs``: floating ones in ``param_dtype``)."""
        if self.cast_forward_inputs and self.param_dtype is not None and _floating(x):
            return x.to(self.param_dtype)
        return x

    def output(self, x: Any) -> Any:
        """A forward output as the caller gets it (``output_dtype``: floating ones cast)."""
        if self.output_dtype is not None and _floating(x):
            return x.to(self.output_dtype)
        return x


def output_under(precision: Precision | None, x: Any) -> Any:
    """A model output as the caller (and the loss) gets it: ``output_dtype`` under a policy."""
    return x if precision is None else precision.output(x)


def masters_reduce_dtype(precision: Precision | None, params: Iterable[torch.Tensor]) -> torch.dtype | None:
    """The dtype the data-parallel shares of gradients are summed in: the policy's for the
    masters' dtype (None without a policy, or without floating parameters)."""
    if precision is None:
        return None
    masters = {p.dtype for p in params if p.is_floating_point()}
    if len(masters) > 1:
        raise ValueError(
            f"autopar: mp_policy expects every floating parameter in one dtype (the master copy), found "
            f"{sorted(str(d) for d in masters)}; convert the model first (model.float())"
        )
    return precision.gradient_reduce_dtype(masters.pop()) if masters else None


AUTOCAST_DEVICES = ("cpu", "cuda")  # the device types whose torch.autocast state is looked at


class AutocastWarning(UserWarning):
    """The model is planned or run inside ``torch.autocast``, which autopar does not price."""


def autocast_in_effect() -> dict[str, torch.dtype]:
    """Device type -> compute dtype of each ``torch.autocast`` region active here."""
    return {d: torch.get_autocast_dtype(d) for d in AUTOCAST_DEVICES if torch.is_autocast_enabled(d)}


def warn_under_autocast(doing: str, stacklevel: int = 3) -> None:
    """An ``AutocastWarning`` when ``doing`` ("planning", "running the compiled model") happens
    inside ``torch.autocast``: the plan prices the dtypes the model was captured in, not the
    casts autocast adds, so its predicted time and memory would be for another run. The
    supported path is a policy (``mp_policy``), priced and run as ``autopar.runtime.precision`` says."""
    active = autocast_in_effect()
    if not active:
        return
    where = ", ".join(f"{d}: {str(dtype).removeprefix('torch.')}" for d, dtype in active.items())
    warnings.warn(
        f"autopar: {doing} inside torch.autocast ({where}); autopar plans and runs the dtypes the model is "
        "captured in, so autocast's casts are neither priced nor laid out by the plan (its predicted time and "
        "memory are for the model without autocast); expected mixed precision as a policy: leave autocast out "
        "and pass mp_policy=torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
        "reduce_dtype=torch.float32) to autopar.plan and autopar.compile (bf16 compute, fp32 master, priced as run)",
        AutocastWarning, stacklevel=stacklevel)


def recorded_policy(record: dict[str, Any] | None) -> MixedPrecisionPolicy | None:
    """The policy a plan records (``Precision.record``), as torch's type again (None: none)."""
    if record is None:
        return None

    def dtype(name: str | None) -> torch.dtype | None:
        return None if name is None else getattr(torch, name)

    return MixedPrecisionPolicy(param_dtype=dtype(record["param_dtype"]), reduce_dtype=dtype(record["reduce_dtype"]),
                                output_dtype=dtype(record["output_dtype"]),
                                cast_forward_inputs=record["cast_forward_inputs"])


def captured_under_policy(captured: Captured) -> bool:
    """``captured`` was made by ``capture_cast`` (its parameters say how they run)."""
    return any(META_KEY in n.meta for n in captured.nodes("placeholder") if n.name in captured.params)


def _floating(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


@contextlib.contextmanager
def cast_parameters(model: nn.Module, precision: Precision) -> Iterator[None]:
    """Inside: ``model``'s floating parameters are ``param_dtype`` copies (one per tensor:
    tied names share it); its buffers as they are, as FSDP2 leaves them."""
    copies: dict[int, nn.Parameter] = {}
    swapped = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        dtype = precision.compute_dtype(p.dtype)
        if dtype != p.dtype:
            copy = copies.get(id(p))
            if copy is None:
                copy = copies[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            swapped[name] = copy
    with _reparametrize_module(model, swapped):
        yield


def capture_cast(capture: Callable[..., Captured], model: nn.Module, precision: Precision) -> Callable[..., Captured]:
    """``capture(model, inputs, kwargs, train=)`` as the model computes under ``precision``:
    parameters in ``param_dtype``, floating inputs cast (``cast_forward_inputs``)."""

    def captured(inputs: tuple, kwargs: dict | None = None, train: bool = True) -> Captured:
        inputs, kwargs = pytree.tree_map(precision.input, (inputs, kwargs or {}))
        with cast_parameters(model, precision):
            cast = capture(model, inputs, kwargs, train=train)
        _mark_masters(cast, model, precision)
        if precision.output_dtype is not None and cast.user_outputs:
            output_node(cast).meta[OUTPUT_DTYPE_KEY] = precision.output_dtype
        return cast

    return captured


def _mark_masters(captured: Captured, model: nn.Module, precision: Precision) -> None:
    """Each cast parameter's placeholder says how it runs (``MixedPrecision``), for costing."""
    masters = dict(model.named_parameters(remove_duplicate=False))
    for node in captured.nodes("placeholder"):
        if node.name in captured.params:
            priced = precision.cost_model(masters[captured.params[node.name]].dtype)
            if priced is not None:
                node.meta[META_KEY] = priced


def to_compute(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A parameter's working copy: its backward casts the gradient back to the master dtype."""
    return x.to(dtype)


class MixedGather(GatherBucket):
    """A bucket gathered as FSDP2 gathers a unit under a policy: this rank's master shards
    cast to ``param_dtype`` and all-gathered in it; gradients reduce-scattered in
    ``reduce_dtype`` (autograd then casts them to the shards' dtype, where they accumulate)."""

    def __init__(self, bucket: GatherBucket, param_dtype: torch.dtype, reduce_dtype: torch.dtype):
        super().__init__(bucket.names, bucket.steps, bucket.keep)
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def gather(self, shards):
        return super().gather([s.detach().to(self.param_dtype) for s in shards])

    def scatter(self, grads):
        return super().scatter([g.to(self.reduce_dtype) for g in grads])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}; gathered in {self.param_dtype}, reduced in {self.reduce_dtype}"


def apply_precision(program: RankProgram, captured: Captured, masters: dict[str, torch.Tensor],
                    precision: Precision) -> None:
    """Rewrite ``program`` (in place) to run on ``masters`` (placeholder -> the master
    tensor): a floating parameter's placeholder now receives the master, and every op that
    read it reads one cast copy; a gathered bucket of such parameters casts in its gather
    (``MixedGather``), and a parameter moved otherwise (a reshard) is moved in
    ``param_dtype`` when its gradient is reduced in it too, else moved as the master and cast after."""
    gm = program.gm
    for node in list(gm.graph.nodes):
        if node.op != "placeholder" or node.name not in captured.params:
            continue
        master = masters[node.name].dtype
        compute, reduce = precision.compute_dtype(master), precision.gradient_reduce_dtype(master)
        if compute == master and reduce == master:
            continue
        gathers = [u for u in node.users if _gather_of(gm, u) is not None]
        for user in gathers:
            _mixed_gather(gm, user, compute, reduce)
        others = [u for u in node.users if u not in gathers]
        moved_after = [u for u in others if reduce != compute and _is_reshard(gm, u)]
        _cast_for(gm, node, [u for u in others if u not in moved_after], compute)
        for user in moved_after:  # its move's backward reduces the gradient: in the master dtype (>= reduce)
            _cast_for(gm, user, list(user.users), compute)
    gm.graph.lint()
    gm.recompile()


def _gather_of(gm: fx.GraphModule, node: fx.Node) -> GatherBucket | None:
    if node.op != "call_module":
        return None
    module = gm.get_submodule(node.target)
    return module if isinstance(module, GatherBucket) else None


def _is_reshard(gm: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), Reshard)


def _mixed_gather(gm: fx.GraphModule, node: fx.Node, compute: torch.dtype, reduce: torch.dtype) -> None:
    bucket = _gather_of(gm, node)
    if isinstance(bucket, MixedGather):
        if (bucket.param_dtype, bucket.reduce_dtype) != (compute, reduce):
            raise ValueError(
                f"autopar: the gathered bucket {node.target} holds parameters that compute in {bucket.param_dtype} "
                f"and {compute} (or reduce in {bucket.reduce_dtype} and {reduce}); expected one dtype per bucket: "
                "give every parameter of a model the same dtype before compiling"
            )
        return
    gm.set_submodule(node.target, MixedGather(bucket, compute, reduce))


def _cast_for(gm: fx.GraphModule, value: fx.Node, users: list[fx.Node], dtype: torch.dtype) -> None:
    """One cast of ``value`` read by all of ``users`` in its place, made just before the
    first of them runs (the copy lives from there until backward is done with it)."""
    if not users:
        return
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    with gm.graph.inserting_before(min(users, key=order.__getitem__)):
        cast = gm.graph.call_function(to_compute, (value, dtype))
    for user in users:
        user.replace_input_with(value, cast)

