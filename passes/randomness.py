"""Random numbers that do not depend on the layout: each element's draw is a hash of its
position in the whole tensor and of a key.

A program's random ops (dropout, ``rand``, ``randn``, ``bernoulli``...) do not read a
generator. Each element's value is a pure function of the run's key, the op's ordinal
in the captured graph and the element's index in the whole (unsharded) tensor — a
counter-based generator (splitmix64's finaliser over the index, as Philox-style
generators do for GPUs). So every rank that holds an element draws the same value for
it, however the tensor is split and however each process seeded torch, and the shards
of a split tensor draw exactly what one process would draw for the whole: layouts, rank
counts and recomputation change nothing.

The key is set by whoever runs a program (``drawing``): the runtime takes one per run of a
training program (a micro-batch), from a seed agreed at compile time and a count it
keeps in its checkpoints. A random op run without a key is an error, never a silent
fixed stream.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence

import torch

from autopar.passes.placements import Spec, shard_offset

MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB

_RUN_KEY: contextvars.ContextVar[int | None] = contextvars.ContextVar("autopar_run_key", default=None)
_OP: contextvars.ContextVar[int] = contextvars.ContextVar("autopar_random_op", default=0)


def _signed(x: int) -> int:
    """A 64-bit pattern as torch's int64 holds it."""
    x &= MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def mix(x: int) -> int:
    """splitmix64's step on a Python int (the same function ``_mix`` applies to tensors)."""
    z = (x + _GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * _M1) & MASK64
    z = ((z ^ (z >> 27)) * _M2) & MASK64
    return z ^ (z >> 31)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch shifts signed values arithmetically)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    # int64 products wrap modulo 2**64 on every backend: the low 64 bits are splitmix64's
    z = z + _signed(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(_M1)
    z = (z ^ _shr(z, 27)) * _signed(_M2)
    return z ^ _shr(z, 31)


def run_key(seed: int, draw: int) -> int:
    """The key of the ``draw``-th run of a program under ``seed``."""
    return mix(mix(seed & MASK64) ^ (draw & MASK64))


def drawing(key: int) -> contextlib.AbstractContextManager:
    """Inside: random ops draw under ``key`` (``run_key``)."""
    return _set(_RUN_KEY, key)


def op(ordinal: int) -> contextlib.AbstractContextManager:
    """Inside: the random op running is the ``ordinal``-th of its captured graph."""
    return _set(_OP, ordinal)


@contextlib.contextmanager
def _set(var: contextvars.ContextVar, value: int) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def current_key() -> int | None:
    """The key random ops draw under now (None outside ``drawing``)."""
    return _RUN_KEY.get()


def _op_key() -> int:
    key = _RUN_KEY.get()
    if key is None:
        raise RuntimeError(
            "autopar: a random op (dropout, rand, bernoulli...) ran with no key to draw under; expected it inside "
            "a compiled module's step or forward (autopar.passes.randomness.drawing); run the program through the "
            "compiled module")
    return mix(key ^ mix(_OP.get()))


def _index(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int], coord: Sequence[int],
           device: torch.device) -> torch.Tensor:
    """The index in the whole tensor (row-major) of every element of this coordinate's shard."""
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(shape))):
        start, stop = shard_offset(shape, spec, mesh_shape, coord, dim) if spec else (0, shape[dim])
        positions = torch.arange(start, stop, dtype=torch.int64, device=device) * stride
        index = index + positions.view(-1, *([1] * (len(shape) - 1 - dim)))
        stride *= shape[dim]
    return index


def bits(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int], coord: Sequence[int],
         device: torch.device, stream: int = 0) -> torch.Tensor:
    """64 random bits (int64) per element of this coordinate's shard of a whole tensor of
    ``shape`` laid out as ``spec``; ``stream`` picks an independent stream of the same op."""
    key = _op_key() if stream == 0 else mix(_op_key() ^ mix(stream))
    return _mix(_index(shape, spec, mesh_shape, coord, device) ^ _signed(key))


def uniform(shape, spec, mesh_shape, coord, device, dtype: torch.dtype, stream: int = 0) -> torch.Tensor:
    """Uniform in [0, 1) with as many random bits as ``dtype``'s significand holds (exact, never 1)."""
    digits = round(-math.log2(torch.finfo(dtype).eps)) + 1  # the significand's bits
    top = _shr(bits(shape, spec, mesh_shape, coord, device, stream), 64 - digits)
    return top.to(dtype) * (2.0 ** -digits)


def normal(shape, spec, mesh_shape, coord, device, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal by Box-Muller over two independent uniforms (in float64, then cast)."""
    u1 = uniform(shape, spec, mesh_shape, coord, device, torch.float64, stream=1)
    u2 = uniform(shape, spec, mesh_shape, coord, device, torch.float64, stream=2)
    return (torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2.0 * math.pi * u2)).to(dtype)


def kept(p: float, shape, spec, mesh_shape, coord, device) -> torch.Tensor:
    """Dropout's mask: each element kept (True) with probability 1 - p, from 24 random bits."""
    dropped_below = round(p * (1 << 24))
    return _shr(bits(shape, spec, mesh_shape, coord, device), 40) >= dropped_below


def dropout(x: torch.Tensor, p: float, shape, spec, mesh_shape, coord) -> torch.Tensor:
    """``torch.dropout`` in training: each element kept with probability 1 - p (``kept``) and
    scaled by 1 / (1 - p)."""
    if p <= 0.0:
        return x.clone()
    if p >= 1.0:
        return x * 0.0
    keep = kept(p, shape, spec, mesh_shape, coord, x.device)
    return x * (keep.to(x.dtype) * (1.0 / (1.0 - p)))


def integers(low: int, high: int, shape, spec, mesh_shape, coord, device, dtype: torch.dtype) -> torch.Tensor:
    """Uniform integers in [low, high) (63 random bits reduced modulo the range)."""
    return (low + _shr(bits(shape, spec, mesh_shape, coord, device), 1) % (high - low)).to(dtype)
