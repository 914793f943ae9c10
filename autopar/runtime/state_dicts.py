"""The whole model's ``state_dict`` from the tensors a parallel module gathered.

A ParallelModule or PipelineModule knows its parameters and buffers by the names the
capture gave them (one name per tied parameter, non-persistent buffers included); a
``state_dict`` is named and ordered by the model, holds every name of a tied weight and
leaves non-persistent buffers out. This puts the one into the shape of the other.
"""

from __future__ import annotations

import torch
from torch import nn


def in_state_dict_order(model: nn.Module, held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model.state_dict()``'s names and order, each holding the gathered tensor of that name
    (a tied weight's names: the same tensor object)."""
    state = model.state_dict(keep_vars=True)
    source: dict[int, str] = {}  # a tensor of the model -> the name it was gathered under
    for name, tensor in state.items():
        if name in held:
            source.setdefault(id(tensor), name)
    missing = [name for name, tensor in state.items() if id(tensor) not in source]
    if missing:
        raise ValueError(
            f"autopar: the model's state_dict holds {missing} but the parallel module gathered no tensor for them "
            f"(it holds {sorted(held)[:8]}...); expected every parameter and persistent buffer to be captured")
    return {name: held[source[id(tensor)]] for name, tensor in state.items()}
