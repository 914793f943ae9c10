"""Activation recomputation: run the plan's chosen layers under ``torch.utils.checkpoint``.

A rank's program is one flat ``fx.GraphModule``. Each of its nodes knows the captured
node it came from (``meta["autopar_node"]``, set by codegen; a Reshard takes its
consumer's), and the plan knows each captured node's layer (``Plan.breakdown``). The
program is split (``torch.fx.passes.split_module``) into consecutive segments — one per
recomputed layer, and the stretches between them — and each recomputed layer's segment
is wrapped in non-reentrant checkpointing: its forward keeps only its inputs, and its
backward runs the forward again (collectives included, on every rank alike) to rebuild
what it needs, its random ops drawing what they drew in forward (the forward's key).
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

from torch import fx, nn
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint

from autopar.passes import randomness

SOURCE = "autopar_node"  # node.meta key: the captured node a program node was made for


class Recomputed(nn.Module):
    """A segment of the program whose activations are rebuilt in backward."""

    def __init__(self, segment: nn.Module, layer: int):
        super().__init__()
        self.segment = segment
        self.layer = layer

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.segment, *args, use_reentrant=False, context_fn=_same_draws)

    def extra_repr(self) -> str:
        return f"layer {self.layer}, recomputed in backward"


def _same_draws() -> tuple[ContextManager, ContextManager]:
    """The forward runs as it is; the recomputation draws under the key of that forward
    (backward comes after other micro-batches' forwards, in another key)."""
    key = randomness.current_key()
    return contextlib.nullcontext(), _Drawing(key)


class _Drawing:
    """``randomness.drawing(key)`` each time it is entered: a split backward (zero-bubble
    pipelines) rebuilds a layer twice, for its input gradients and for its weight gradients."""

    def __init__(self, key: int | None):
        self.key, self.entered = key, []

    def __enter__(self) -> None:
        context = randomness.drawing(self.key) if self.key is not None else contextlib.nullcontext()
        context.__enter__()
        self.entered.append(context)

    def __exit__(self, *exc) -> None:
        self.entered.pop().__exit__(*exc)


def layers_to_recompute(recompute: list[str]) -> set[int]:
    """Plan.recompute entries ("layer 3") -> layer numbers."""
    out = set()
    for entry in recompute:
        word, _, number = entry.partition(" ")
        if word != "layer" or not number.isdigit():
            raise ValueError(f"autopar: expected recompute entries like 'layer 3'; found {entry!r}")
        out.add(int(number))
    return out


def plan_layers(plan) -> dict[str, int]:
    """Captured node name -> layer number, as the planner recorded them (``Plan.breakdown``)."""
    layers = {name: int(row["layer"]) for name, row in plan.breakdown.items() if "layer" in row}
    if plan.recompute and not layers:
        raise ValueError(
            f"autopar: the plan recomputes {len(plan.recompute)} layers but records no node's layer "
            "(its breakdown is empty: made by hand?); make it with autopar.plan or clear plan.recompute"
        )
    return layers


def recompute_layers(gm: fx.GraphModule, layer_of: dict[str, int], layers: set[int]) -> fx.GraphModule:
    """``gm`` with the nodes of each layer in ``layers`` run under checkpointing.

    ``layer_of``: captured node name -> layer number. Returns ``gm`` itself when there is
    nothing to recompute.
    """
    if not layers:
        return gm
    missing = layers - set(layer_of.values())
    if missing:
        raise ValueError(
            f"autopar: the plan recomputes layers {sorted(missing)}, but its nodes name no such layer "
            f"(known: {sorted(set(layer_of.values()))[:8]}...); re-plan, or clear plan.recompute"
        )
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    keys: list[tuple] = [None] * len(body)
    for i, node in enumerate(body):
        if SOURCE in node.meta:
            layer = layer_of.get(node.meta[SOURCE])
            keys[i] = ("layer", layer) if layer in layers else ("rest",)
    # a node made for no captured node (a Reshard) goes with the op that reads it: the next tagged one
    following = ("rest",)
    for i in reversed(range(len(body))):
        keys[i] = following = keys[i] or following
    segment_of: dict[fx.Node, int] = {}
    segment_layer: dict[int, int] = {}
    current, current_key = -1, None
    for node, key in zip(body, keys):
        if key != current_key:
            current, current_key = current + 1, key
            if key[0] == "layer":
                segment_layer[current] = key[1]
        segment_of[node] = current
    if not segment_layer:
        raise ValueError(
            "autopar: no node of this program belongs to a recomputed layer; the program was built "
            "without codegen's node tags (autopar.passes.lowering.codegen.lower sets them)"
        )
    split = split_module(gm, gm, lambda n: segment_of[n], keep_original_order=True)
    for index, layer in segment_layer.items():
        name = f"submod_{index}"
        setattr(split, name, Recomputed(getattr(split, name), layer))
    split.recompile()
    return split

