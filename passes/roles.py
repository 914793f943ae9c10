"""What a mesh axis does in a plan: its role.

Glossary: a **mesh axis** is one dimension of the device mesh (``"axis"`` is always a mesh
axis, ``"dim"`` a tensor dimension); it has a **name** (``Plan.axis_names``: ``"dp"``,
``"axis1"``, or whatever the mesh was given) and, in a plan, one or more **roles** — what
splitting work over it buys. A role is a ``str`` (its value), so a plan's text and JSON
read the same as before the type existed.
"""

from __future__ import annotations

from enum import Enum
from typing import Sequence

from autopar.costmodels.profile import is_default_axis_name


class AxisRole(str, Enum):
    """The role of a mesh axis (module docstring: the glossary).

    - ``DP``: data parallel: the batch is split over the axis; parameters are whole (or
      their optimizer state and gradients sharded, ZeRO-1/2) and their gradients summed.
    - ``TP``: tensor parallel (Megatron): weights split over the axis and used split, the
      activations moved between them.
    - ``FSDP``: fully sharded data parallel (ZeRO-3): weights split over the axis and
      gathered whole before use; the batch is split too.
    - ``PP``: pipeline parallel: each rank on the axis runs a stage of the layers.
    - ``EP``: expert parallel (mixture-of-experts): each rank on the axis holds whole
      experts and computes the tokens routed to them; the batch is split too.
    - ``REPLICA``: none of these: every rank on the axis runs the same work.
    """

    DP = "dp"
    TP = "tp"
    FSDP = "fsdp"
    PP = "pp"
    EP = "ep"
    REPLICA = "replica"

    def __str__(self) -> str:  # printed as its value, as a plain str would be
        return self.value

    __format__ = str.__format__


def label_axes(names: Sequence[str], roles: Sequence[str]) -> list[str]:
    """Each mesh axis as a user reads it: a name the mesh was given as it is, a default name
    with the axis's role in the plan beside it, ``axis1 (tp)``."""
    return [f"{name} ({role})" if role and is_default_axis_name(name) else name for name, role in zip(names, roles)]
