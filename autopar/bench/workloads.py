"""The benchmark's workloads: five model families, each at the size of the machine it runs on.

``build(name, scale)`` returns a ``Workload``: the model, its example inputs, the target
and the loss. ``scale`` is ``"cpu"`` (small float32 models that train in milliseconds to
a second per step on gloo ranks sharing this machine's cores) or a GPU count (``8``,
``64``, ``512``: bf16 models sized for that many 80 GB H100s, built on the meta device
by the caller and only planned). The same seed gives every rank the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models import GPT, GPTConfig, WideMLP


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


def _tokens(vocab: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, vocab, (batch, seq), generator=gen, device="cpu") for _ in range(2))


def _lm(model: nn.Module, vocab: int, batch: int, seq: int, loss_fn, label: str) -> Workload:
    tokens, target = _tokens(vocab, batch, seq)
    return Workload(model, (tokens,), target, loss_fn, f"{label}, batch {batch}x{seq}")


def _transformers(*names: str) -> list:
    try:
        import transformers
    except ImportError:
        raise ValueError("autopar: the gpt2, llama and moe benchmark models are Hugging Face models; "
                         "found no transformers package. Install it (pip install 'autopar[test]') or "
                         "benchmark big-vocab and wide-mlp only") from None
    return [getattr(transformers, n) for n in names]


def _params(model: nn.Module) -> str:
    n = sum(p.numel() for p in model.parameters())
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


# (layers, width, heads, vocab, batch, sequence) per scale
GPT2_SIZES = {"cpu": (2, 128, 4, 2048, 16, 64), 8: (24, 2048, 16, 50304, 16, 1024),
              64: (32, 4096, 32, 50304, 64, 2048), 512: (32, 8192, 64, 50304, 512, 2048)}


def gpt2(scale) -> Workload:
    GPT2Config, GPT2LMHeadModel = _transformers("GPT2Config", "GPT2LMHeadModel")

    layers, width, heads, vocab, batch, seq = GPT2_SIZES[scale]
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=seq,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                     use_cache=False)
    model = GPT2LMHeadModel(cfg)
    return _lm(model, vocab, batch, seq, hf_lm_loss, f"GPT-2 {_params(model)} ({layers} layers, width {width})")


# (layers, hidden, intermediate, heads, kv heads, vocab, batch, sequence)
LLAMA_SIZES = {"cpu": (2, 128, 384, 4, 4, 2048, 16, 64), 8: (16, 2048, 8192, 32, 8, 128256, 16, 2048),
               64: (32, 4096, 14336, 32, 8, 128256, 64, 4096), 512: (80, 8192, 28672, 64, 8, 128256, 256, 4096)}


def llama(scale) -> Workload:
    LlamaConfig, LlamaForCausalLM = _transformers("LlamaConfig", "LlamaForCausalLM")

    layers, hidden, inter, heads, kv, vocab, batch, seq = LLAMA_SIZES[scale]
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter,
                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                      max_position_embeddings=seq, use_cache=False)
    model = LlamaForCausalLM(cfg)
    return _lm(model, vocab, batch, seq, hf_lm_loss, f"Llama {_params(model)} ({layers} layers, hidden {hidden})")


# (layers, hidden, intermediate, heads, kv heads, experts, vocab, batch, sequence)
MOE_SIZES = {"cpu": (2, 128, 256, 4, 4, 4, 2048, 16, 32), 8: (8, 1024, 3584, 16, 8, 8, 32000, 16, 2048),
             64: (32, 4096, 14336, 32, 8, 8, 32000, 64, 4096), 512: (32, 6144, 16384, 48, 8, 8, 32768, 256, 4096)}


def moe(scale) -> Workload:
    MixtralConfig, MixtralForCausalLM = _transformers("MixtralConfig", "MixtralForCausalLM")

    layers, hidden, inter, heads, kv, experts, vocab, batch, seq = MOE_SIZES[scale]
    cfg = MixtralConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter,
                        num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                        num_local_experts=experts, num_experts_per_tok=2, max_position_embeddings=seq,
                        use_cache=False)
    model = MixtralForCausalLM(cfg)
    return _lm(model, vocab, batch, seq, hf_lm_loss,
               f"Mixtral {_params(model)} ({layers} layers, {experts} experts, top-2)")


# (vocab, width, heads, layers, batch, sequence): the embedding and the head dominate
BIG_VOCAB_SIZES = {"cpu": (32768, 64, 4, 2, 8, 16), 8: (262144, 2048, 16, 4, 16, 2048),
                   64: (262144, 4096, 32, 8, 64, 4096), 512: (524288, 8192, 64, 16, 256, 4096)}


def big_vocab(scale) -> Workload:
    vocab, width, heads, layers, batch, seq = BIG_VOCAB_SIZES[scale]
    model = GPT(GPTConfig(vocab_size=vocab, max_seq_len=seq, dim=width, n_heads=heads, n_layers=layers))
    return _lm(model, vocab, batch, seq, lm_loss, f"GPT {_params(model)}, vocab {vocab}, width {width}")


# (width, hidden, layers, batch)
WIDE_MLP_SIZES = {"cpu": (256, 2048, 2, 32), 8: (8192, 32768, 4, 16384),
                  64: (16384, 65536, 8, 65536), 512: (32768, 131072, 8, 262144)}


def wide_mlp(scale) -> Workload:
    width, hidden, layers, batch = WIDE_MLP_SIZES[scale]
    model = WideMLP(dim=width, hidden=hidden, n_layers=layers)
    if scale == "cpu":
        gen = torch.Generator().manual_seed(1)
        x, y = (torch.randn(batch, width, generator=gen) for _ in range(2))
    else:  # shapes only (built under the meta device)
        x, y = torch.empty(batch, width), torch.empty(batch, width)
    return Workload(model, (x,), y, mse, f"MLP {_params(model)} ({layers}x {width}->{hidden}), batch {batch}")


MODELS: dict[str, Callable[[Any], Workload]] = {
    "gpt2": gpt2,
    "llama": llama,
    "moe": moe,
    "big-vocab": big_vocab,
    "wide-mlp": wide_mlp,
}


def build(name: str, scale, *, meta: bool = False) -> Workload:
    """Workload ``name`` at ``scale``: seeded weights on CPU, or shapes only (``meta``, bf16)."""
    torch.manual_seed(0)
    if not meta:
        return MODELS[name](scale)
    with torch.device("meta"):
        work = MODELS[name](scale)
    work.model = work.model.to(torch.bfloat16)
    work.inputs = tuple(_meta(x) for x in work.inputs)
    work.target = _meta(work.target)
    return work


def _meta(x: torch.Tensor) -> torch.Tensor:
    return x.to("meta", torch.bfloat16) if x.is_floating_point() else x.to("meta")
