"""A batch as a plan cuts it: each rank's share, per-rank data, accumulation's pieces.

``Cut`` is one rank's shard of a whole tensor (worked out once per shape); ``DataParallel``
is the plan's data parallelism as a ``DistributedSampler`` sees it; ``check_dims`` and
``split_batch`` check that inputs have the compiled dims and cut a batch for accumulation;
``IndexBounds`` checks token ids against their embedding; ``SameInputs`` checks that every
rank was given the same batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.utils import _pytree as pytree

from autopar.runtime.gradsync import Rider
from autopar.passes.placements import Spec, is_partial, local_shape, shard_offset, spec_str
from autopar.passes.plan import check_accumulate


def check_dims(shapes: Sequence[tuple[int, ...]], compiled: Sequence[tuple[int, ...]]) -> None:
    """A clear error for inputs of ``shapes`` whose dims are not the compiled inputs' (any
    sizes are laid out by the plan: ``autopar.passes.planner.relayout``)."""
    for i, (shape, before) in enumerate(zip(shapes, compiled)):
        if len(shape) != len(before):
            raise ValueError(f"autopar: expected input {i} with {len(before)} dims, as in the example "
                             f"inputs ({before}); found shape {shape}")


# ops that pass token ids on unchanged in value, between an input and the embedding that reads it
_SAME_IDS = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.clone.default",
             "aten.alias.default", "aten.flatten.using_ints", "aten.unsqueeze.default", "aten.squeeze.dim",
             "aten.contiguous.default", "aten.expand.default"}


@dataclass(frozen=True)
class IndexBounds:
    """The inputs that are an embedding's indices (token ids) and its row count, checked on
    the whole ids before they are cut: one process raises IndexError for an id out of range,
    while a vocabulary split over ranks would find it on no rank and give a zero row."""

    rows: dict[str, int]  # user input name -> rows of the smallest table it indexes

    @classmethod
    def of(cls, captured: Any) -> "IndexBounds":
        inputs, rows = set(captured.user_inputs), {}
        for node in captured.nodes("call_function"):
            if str(node.target) != "aten.embedding.default":
                continue
            ids = node.args[1]
            while ids.op == "call_function" and str(ids.target) in _SAME_IDS:
                ids = ids.args[0]
            if ids.op == "placeholder" and ids.name in inputs:
                size = int(node.args[0].meta["val"].shape[0])
                rows[ids.name] = min(size, rows.get(ids.name, size))
        return cls(rows)

    def check(self, position: int, name: str, ids: torch.Tensor) -> None:
        size = self.rows.get(name)
        if size is None or ids.numel() == 0 or ids.device.type == "meta" or is_fake(ids):
            return  # no values to check (a dry run's fake ids)
        low, high = (int(v) for v in torch.aminmax(ids))
        if low < 0 or high >= size:
            raise ValueError(
                f"autopar: expected input {position} (token ids into an embedding of {size} rows) in [0, {size - 1}]; "
                f"found ids from {low} to {high}; fix the ids (a tokenizer whose vocabulary matches the model's), or "
                "give the model an embedding with as many rows as the vocabulary"
            )


def split_batch(inputs: Any, target: torch.Tensor | None, k: int) -> list[tuple[Any, torch.Tensor | None]]:
    """``k`` equal micro-batches: dim 0 of every input tensor and of the target cut in k."""
    check_accumulate(k)
    if k == 1:
        return [(inputs, target)]
    tensors = [t for t in pytree.tree_leaves((inputs, target)) if isinstance(t, torch.Tensor)]
    bad = sorted({tuple(t.shape) for t in tensors if t.dim() == 0 or t.shape[0] % k})
    if bad:
        raise ValueError(
            f"autopar: accumulate={k} cuts dim 0 (the batch) of every input and of the target into {k} equal "
            f"micro-batches; found shapes {bad}, which do not divide; pick an accumulate that divides the batch"
        )

    def piece(i: int) -> Callable[[Any], Any]:
        return lambda t: t.narrow(0, i * (t.shape[0] // k), t.shape[0] // k) if isinstance(t, torch.Tensor) else t

    return [pytree.tree_map(piece(i), (inputs, target)) for i in range(k)]


@dataclass(frozen=True)
class Cut:
    """One rank's shard of a whole tensor of one shape: the shape it has whole and here,
    and the ``narrow`` calls that take it (``local_slice``, worked out once)."""

    whole: tuple[int, ...]
    local: tuple[int, ...]
    narrows: tuple[tuple[int, int, int], ...]  # (dim, start, length)

    @staticmethod
    def of(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int], coord: Sequence[int]) -> Cut:
        if is_partial(spec):
            raise ValueError(f"autopar: cannot cut a whole tensor into a Partial ({spec_str(spec)}); "
                             "expected Shard/Replicate")
        narrows = []
        for dim in sorted({p.dim for p in spec if isinstance(p, Shard)}):
            start, stop = shard_offset(shape, spec, mesh_shape, coord, dim)
            narrows.append((dim, start, stop - start))
        return Cut(tuple(shape), local_shape(shape, spec, mesh_shape), tuple(narrows))

    def take(self, value: torch.Tensor) -> torch.Tensor:
        for dim, start, length in self.narrows:
            value = value.narrow(dim, start, length)
        return value

    def within(self, outer: Cut) -> Cut | None:
        """The same shard taken from ``outer``'s piece (a rank's rows of the batch) instead of
        from the whole tensor; None where the shard does not lie inside that piece."""
        mine = {dim: (start, length) for dim, start, length in self.narrows}
        narrows = []
        for dim, start, length in outer.narrows:
            s, n = mine.pop(dim, (0, self.whole[dim]))
            if s < start or s + n > start + length:
                return None
            if n != length:
                narrows.append((dim, s - start, n))
        narrows += [(dim, s, n) for dim, (s, n) in mine.items()]
        return Cut(outer.local, self.local, tuple(sorted(narrows)))


@dataclass(frozen=True)
class DataParallel:
    """A plan's data parallelism as a ``DistributedSampler`` sees it: ``num_replicas``
    distinct shards of the batch and this rank's index ``rank`` among them (ranks that
    hold the same rows, e.g. tensor-parallel peers, have the same ``rank``). ``axes``:
    the mesh axes that split the batch of every input; on the others each rank sees the
    same rows (and the plan splits other dims there, or keeps copies)."""

    num_replicas: int
    rank: int
    axes: tuple[int, ...]

    @staticmethod
    def of(specs: list[Spec], mesh_shape: Sequence[int], coord: Sequence[int]) -> DataParallel:
        """From the placements of the inputs that carry the batch (split on dim 0)."""
        axes = tuple(a for a in range(len(mesh_shape))
                     if specs and all(isinstance(s[a], Shard) and s[a].dim == 0 for s in specs))
        num_replicas, rank = 1, 0
        for a in axes:  # axis 0 outermost, as shards of one dim are laid out (shard_offset)
            num_replicas, rank = num_replicas * mesh_shape[a], rank * mesh_shape[a] + coord[a]
        return DataParallel(num_replicas, rank, axes)

    def spec(self, n_axes: int) -> Spec:
        """The placement of this rank's rows: the batch split over ``axes``, whole otherwise."""
        return tuple(Shard(0) if a in self.axes else Replicate() for a in range(n_axes))


def rows_text(dp: DataParallel) -> str:
    return (f"this rank's rows of the batch: the whole batch / data_parallel.num_replicas "
            f"({dp.num_replicas}), rank {dp.rank}")


class SameInputs:
    """The check that every rank was given the same batch: a checksum per input tensor,
    written in this rank's row of a table that is summed over the mesh (``rider``: it
    rides along with the gradients' all-reduce); every row must then be the same."""

    def __init__(self, tensors: tuple, mesh: DeviceMesh, coord: Sequence[int] | None = None):
        flat = [t.double() for t in pytree.tree_leaves(tensors) if isinstance(t, torch.Tensor)]
        sums = torch.stack([d.sum() + d.abs().sum() for d in flat])
        high = sums.float().double()  # two float32 parts: exact enough to ride in a float32 bucket
        shape = tuple(mesh.shape)
        self.table = torch.zeros(math.prod(shape), 2, len(flat), dtype=torch.float64, device=sums.device)
        row = 0
        for size, index in zip(shape, coord if coord is not None else mesh.get_coordinate()):
            row = row * size + index
        self.table[row, 0] = high
        self.table[row, 1] = sums - high
        self.rider = Rider(self.table, tuple(range(len(shape))), castable=True)

    def confirm(self) -> None:
        differs = (self.table != self.table[0]).flatten(0, 1).any(dim=0)
        if differs.any():
            bad = int(differs.nonzero()[0])
            raise ValueError(
                f"autopar: the ranks were given different values for input {bad} (expected the same whole "
                "batch on every rank); give every rank the same batch, or pass each rank's shard with "
                "local=True"
            )

