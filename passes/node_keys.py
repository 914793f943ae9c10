"""A node's identity across captures of one model: where it is, not what export named it.

torch.export numbers the nodes of an op across the whole graph (``to_16``), so the same
op gets another name as soon as anything before it differs: captured under ``no_grad``
(a no-grad region is inlined rather than wrapped), in eval mode, at another batch size,
or as the decode step of generation. A plan lays out the model, not one capture, so it
finds its nodes by identity: the module that called the op, the op, and its place among
that module's calls of that op (``model.layers.0.self_attn:aten.linear.default#1``).
Parameters and buffers are known by their qualified names, user inputs by their names.
"""

from __future__ import annotations

from autopar.passes.capture import Captured


def node_keys(captured: Captured) -> dict[str, str]:
    """Node name -> its identity (see the module docstring), for every node of ``captured``."""
    keys: dict[str, str] = {}
    seen: dict[tuple[str, str], int] = {}
    for node in captured.nodes():
        if node.op == "placeholder":
            if node.name in captured.params:
                keys[node.name] = f"param:{captured.params[node.name]}"
            elif node.name in captured.buffers:
                keys[node.name] = f"buffer:{captured.buffers[node.name]}"
            else:  # user inputs and lifted constants keep export's names, which their sources give
                keys[node.name] = f"input:{node.name}"
            continue
        if node.op == "output":
            keys[node.name] = "output"
            continue
        stack = node.meta.get("nn_module_stack") or {}
        module = next(reversed(stack.values()))[0] if stack else ""
        where = (module, str(node.target))
        seen[where] = seen.get(where, -1) + 1
        keys[node.name] = f"{module}:{node.target}#{seen[where]}"
    return keys
