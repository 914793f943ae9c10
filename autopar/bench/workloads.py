"""The benchmark's workloads: five model families of the registry (``autopar.models.MODELS``),
each at the size of the machine it runs on.

``build(name, scale)`` returns a ``Workload``: the model, its example inputs, the target
and the loss. ``scale`` is ``"cpu"`` (small float32 models that train in milliseconds to
a second per step on gloo ranks sharing this machine's cores) or a GPU count (``8``,
``64``, ``512``: bf16 models sized for that many 80 GB H100s, built on the meta device
by the caller and only planned): the registry's size ``"<prefix>-<scale>"`` of the family
``MODELS`` names. The same seed gives every rank the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models import MODELS as REGISTRY


@dataclass
class Workload:
    model: nn.Module
    inputs: tuple
    target: torch.Tensor
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    label: str  # the size, in words, for the table


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def hf_lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    return lm_loss(output.logits, target)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


@dataclass(frozen=True)
class Benchmarked:
    """A benchmark model: its registry family, the prefix of its sizes there, its loss, and
    how the table describes it (``describe(config keywords, parameters in words)``)."""

    family: str
    prefix: str
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    describe: Callable[[dict, str], str]


MODELS: dict[str, Benchmarked] = {
    "gpt2": Benchmarked("gpt2", "bench", hf_lm_loss,
                        lambda c, n: f"GPT-2 {n} ({c['n_layer']} layers, width {c['n_embd']})"),
    "llama": Benchmarked("llama", "bench", hf_lm_loss,
                         lambda c, n: f"Llama {n} ({c['num_hidden_layers']} layers, hidden {c['hidden_size']})"),
    "moe": Benchmarked("mixtral", "bench", hf_lm_loss, lambda c, n: (
        f"Mixtral {n} ({c['num_hidden_layers']} layers, {c['num_local_experts']} experts, top-2)")),
    "big-vocab": Benchmarked("gpt", "big-vocab", lm_loss,
                             lambda c, n: f"GPT {n}, vocab {c['vocab_size']}, width {c['dim']}"),
    "wide-mlp": Benchmarked("wide-mlp", "bench", mse,
                            lambda c, n: f"MLP {n} ({c['n_layers']}x {c['dim']}->{c['hidden']})"),
}


def _workload(name: str, scale) -> Workload:
    """Workload ``name`` at ``scale`` on the current default device. At the "cpu" scale its
    inputs and target are drawn (one generator, seeded 1); the GPU scales are shapes only
    (zeros: a 512-GPU batch is more than this machine holds)."""
    bench = MODELS[name]
    family, size = REGISTRY[bench.family], f"{bench.prefix}-{scale}"
    try:
        model = family.build(size)
    except ImportError:
        raise ValueError("autopar: the gpt2, llama and moe benchmark models are Hugging Face models; "
                         "found no transformers package. Install it (pip install 'autopar[test]') or "
                         "benchmark big-vocab and wide-mlp only") from None
    gen = torch.Generator().manual_seed(1) if scale == "cpu" else None
    (inputs,), _ = family.inputs(size, generator=gen)
    (target,), _ = family.inputs(size, generator=gen)
    shape = family.size(size)
    batch = f"batch {shape.batch}" if shape.seq is None else f"batch {shape.batch}x{shape.seq}"
    return Workload(model, (inputs,), target, bench.loss_fn, f"{bench.describe(dict(shape.config), _params(model))}, "
                    f"{batch}")


def _params(model: nn.Module) -> str:
    n = sum(p.numel() for p in model.parameters())
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def build(name: str, scale, *, meta: bool = False) -> Workload:
    """Workload ``name`` at ``scale``: seeded weights on CPU, or shapes only (``meta``, bf16)."""
    torch.manual_seed(0)
    if not meta:
        return _workload(name, scale)
    with torch.device("meta"):
        work = _workload(name, scale)
    work.model = work.model.to(torch.bfloat16)
    work.inputs = tuple(_meta(x) for x in work.inputs)
    work.target = _meta(work.target)
    return work


def _meta(x: torch.Tensor) -> torch.Tensor:
    return x.to("meta", torch.bfloat16) if x.is_floating_point() else x.to("meta")
