"""Record the ATen ops one rank runs, as cost-model ``Op``s (FLOPs, bytes, dtype).

Used by the accuracy benchmark to get the per-rank op inventory of a model's forward
pass from its shapes (the hand-written layouts run through DTensor, FSDP and DDP, so
the sharded model is the graph). DTensor arguments count by their local shards.
Collectives are not recorded: the benchmark prices them from the layout. Every op keeps
its ATen name, which picks the rate that prices it (``autopar.costmodels.op_kind``) and the ops
its backward runs (``autopar.costmodels.backward_ops``). View ops count with zero FLOPs and
bytes (they still pay the fixed per-op cost). Attention counts its heads (batch x
heads), each priced by its size (``autopar.costmodels.compute_time``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from autopar.costmodels import Op, op_kind

_COMM_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "_dtensor"}
_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _local(x: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return x._local_tensor if isinstance(x, DTensor) else x


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


# functional collectives (DTensor's redistribute runs these) -> (kind, which tensor is X)
_FUNCTIONAL = {"all_reduce": ("all_reduce", "in"), "all_gather_into_tensor": ("all_gather", "out"),
               "reduce_scatter_tensor": ("reduce_scatter", "in"), "all_to_all_single": ("all_to_all", "in")}


class OpRecorder(TorchDispatchMode):
    """``with OpRecorder() as rec: model(x)``; then ``rec.ops``, and in ``rec.collectives``
    the functional collectives seen (DTensor's), as (kind, X bytes) pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.collectives: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in _COMM_NAMESPACES:
            kind = _FUNCTIONAL.get(func._overloadpacket.__name__)
            if kind is not None:
                t = _tensors(args if kind[1] == "in" else out)[0]
                self.collectives.append((kind[0], t.numel() * t.element_size()))
            return out
        largs, lkwargs, lout = tree_map(_local, args), tree_map(_local, kwargs), tree_map(_local, out)
        ins, outs = _tensors((largs, lkwargs)), _tensors(lout)
        is_view = bool(func._schema.returns) and any(
            r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns
        )
        flops = 0
        packet = func._overloadpacket
        if packet in flop_registry:
            flops = flop_registry[packet](*largs, **lkwargs, out_val=lout)
        elif packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
            # the CPU kernel's FLOPs, counted as flop_counter counts the CUDA one's
            flops = sdpa_flop_count(largs[0].shape, largs[1].shape, largs[2].shape)
        elif packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
            # (grad_out, query, key, value, ...)
            flops = sdpa_backward_flop_count(*(largs[i].shape for i in range(4)))
        nbytes = 0 if is_view else sum(t.numel() * t.element_size() for t in ins + outs)
        floats = [t.dtype for t in ins + outs if t.dtype in _DTYPE]
        dtype = _DTYPE[floats[0]] if floats else "fp32"
        out_bytes = 0 if is_view else sum(t.numel() * t.element_size() for t in outs)
        heads = 0
        if op_kind(str(func)) in ("attention", "attention_backward") and ins:
            heads = ins[0].shape[:-2].numel()  # (B, H, S, D): q forward, grad_out backward
        self.ops.append(Op(float(flops), float(nbytes), dtype, str(func), float(out_bytes), float(heads)))
        return out
