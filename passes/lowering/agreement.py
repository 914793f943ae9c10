"""The ranks of a program's mesh agree on its collectives before it first runs.

A rank whose program differs from its peers' (another plan, other input shapes, another
mode) calls collectives the others never call, or pairs one collective with a different
one: it waits until the group's timeout, or computes garbage. ``collectives_by_axis`` lists
what a lowered program calls on each mesh axis's group, in graph order: each ``Reshard``'s
moves, each gather bucket's gathers, each kernel that trades rows with its peers, and the
gradient shares summed once per step. ``agree_before_first_run`` registers a hook that, the
first time the program runs, gathers a hash of each axis's list from the ranks of that
axis's group (one ``all_gather_object`` per axis, once per program; nothing per step) and
raises an ``autopar:`` error on every rank of a group that disagrees, naming the first
differing collective and the ranks on each side.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import _disable_current_modes


def _shape_of(node: Any) -> str:
    """A value's whole shape and dtype as captured (the same on every rank of one program)."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return f"{tuple(val.shape)} {val.dtype}".replace("torch.", "") if isinstance(val, torch.Tensor) else "?"


def collectives_by_axis(gm: fx.GraphModule, grad_sync: dict[str, tuple[int, ...]], n_axes: int) -> list[list[str]]:
    """Per mesh axis, the collectives the program calls on that axis's group, in order: what
    each module that communicates says it calls (``axis_calls``: a ``Reshard``, a gather
    bucket, a kernel that trades rows; axis None: any), then the gradient sums."""
    calls: list[list[str]] = [[] for _ in range(n_axes)]
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        described = getattr(gm.get_submodule(node.target), "axis_calls", None)
        for axis, what in described() if described is not None else []:
            for a in range(n_axes) if axis is None else (axis,):
                calls[a].append(f"{node.name}: {what} of {_shape_of(node.args[0] if node.args else None)}")
    for name, axes in sorted(grad_sync.items()):
        for a in axes:
            calls[a].append(f"gradient sum of {name}")
    return calls


def _digest(calls: list[str]) -> str:
    return hashlib.sha1("\n".join(calls).encode()).hexdigest()


def _first_difference(lists: list[list[str]], ranks: list[int]) -> str:
    """The first place the ranks' lists differ, and who has what there."""
    longest = max(len(c) for c in lists)
    for i in range(longest):
        seen: dict[str, list[int]] = {}
        for rank, c in zip(ranks, lists):
            seen.setdefault(c[i] if i < len(c) else "(nothing: its program ends here)", []).append(rank)
        if len(seen) > 1:
            sides = "; ".join(f"ranks {who}: {what}" for what, who in seen.items())
            return f"collective #{i + 1} differs ({sides})"
    return "the lists differ"  # unreachable: equal lists have equal digests


def check_agreement(calls: list[list[str]], mesh: DeviceMesh) -> None:
    """Every axis group of ``mesh`` compares its ranks' collectives (``collectives_by_axis``);
    raises on every rank of a group that disagrees. A collective on each axis's group."""
    names = mesh.mesh_dim_names or tuple(str(a) for a in range(mesh.ndim))
    with _disable_current_modes(), torch.device("cpu"):  # a first run under fake or meta tensors
        for axis, axis_calls in enumerate(calls):
            if mesh.shape[axis] == 1:
                continue
            group = mesh.get_group(axis)
            ranks = dist.get_process_group_ranks(group)
            digests: list[Any] = [None] * len(ranks)
            dist.all_gather_object(digests, _digest(axis_calls), group=group)
            if len(set(digests)) == 1:
                continue
            lists: list[Any] = [None] * len(ranks)
            dist.all_gather_object(lists, axis_calls, group=group)
            raise RuntimeError(
                f"autopar: the ranks {ranks} of mesh axis {names[axis]!r} lowered programs that call different "
                f"collectives on it: {_first_difference(lists, ranks)}; expected every rank of the group to run the "
                "same program (the same plan, example inputs of the same shapes, the same mode); compile with one "
                "plan on every rank and give every rank inputs of the same shapes")


def agree_before_first_run(gm: fx.GraphModule, grad_sync: dict[str, tuple[int, ...]], mesh: DeviceMesh | None) -> None:
    """The first call of ``gm`` checks first that its mesh's ranks agree (``check_agreement``);
    nothing without a multi-rank mesh on a real process group."""
    if mesh is None or mesh.size() == 1 or not dist.is_initialized() or dist.get_backend() == "fake":
        return
    calls = collectives_by_axis(gm, grad_sync, mesh.ndim)

    def check_once(module: fx.GraphModule, args: Any) -> None:
        if getattr(module, "_autopar_agreed", False):  # a copy made after its first run
            return
        module._autopar_agreed = True
        handle.remove()
        check_agreement(calls, mesh)

    handle = gm.register_forward_pre_hook(check_once)
