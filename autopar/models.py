"""Small built-in models used by the demo, the tests and the benchmarks.

They are ordinary ``nn.Module`` code, written the way users write models, with no
autopar-specific hooks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    max_seq_len: int = 64
    dim: int = 64
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4
    dropout: float = 0.0


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.o = nn.Linear(cfg.dim, cfg.dim)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # -1: as many heads as this rank holds
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """A GPT-2-shaped decoder: token and position embeddings, pre-norm blocks, LM head."""

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class WideMLP(nn.Module):
    """A stack of wide two-layer MLPs with residuals: the simplest tensor-parallel case."""

    def __init__(self, dim: int = 64, hidden: int = 256, n_layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
            for _ in range(n_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


LLAMA3 = {  # Llama 3 (Meta, 2024): hidden, ffn, layers, heads, kv heads, vocab
    "8b": (4096, 14336, 32, 32, 8, 128256),
    "70b": (8192, 28672, 80, 64, 8, 128256),
    "405b": (16384, 53248, 126, 128, 8, 128256),
}


def llama3(size: str, seq: int = 4096, layers: int | None = None) -> nn.Module:
    """A Hugging Face Llama of a Llama-3 size ("8b", "70b", "405b") in bf16, built on the
    current default device: build it under ``torch.device("meta")`` to plan without weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if size not in LLAMA3:
        raise ValueError(f"autopar: no Llama 3 size {size!r}; expected one of {sorted(LLAMA3)}")
    hidden, ffn, n_layers, heads, kv, vocab = LLAMA3[size]
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers or n_layers,
                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                      max_position_embeddings=seq, torch_dtype=torch.bfloat16)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


MEGATRON_GPT = {  # Megatron-LM README's H100 table (Megatron-Core r0.8.0): layers, hidden, heads
    "7.1b": (30, 4096, 32),
    "177b": (96, 12288, 96),
    "462b": (112, 18432, 144),
}
MEGATRON_VOCAB = 131072  # the README: "All models use a vocabulary size of 131,072 and a sequence length of 4096"


def megatron_gpt(size: str, seq: int = 4096) -> nn.Module:
    """A GPT of a Megatron-LM benchmark size ("7.1b", "177b", "462b") in bf16: this module's
    ``GPT`` (learned positions, LayerNorm, GELU MLP of 4x hidden, biases, an output head apart
    from the embedding, as Megatron's GPT), built on the current default device. Its
    parameter count matches the size named (7.13B, 177.2B, 461.5B)."""
    if size not in MEGATRON_GPT:
        raise ValueError(f"autopar: no Megatron GPT size {size!r}; expected one of {sorted(MEGATRON_GPT)}")
    layers, hidden, heads = MEGATRON_GPT[size]
    cfg = GPTConfig(vocab_size=MEGATRON_VOCAB, max_seq_len=seq, dim=hidden, n_heads=heads, n_layers=layers)
    return GPT(cfg).to(torch.bfloat16)
