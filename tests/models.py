"""The models the capture and sharding tests run on: families of the registry
(``autopar.models.MODELS``) at tiny test-only configs, random weights, no downloads. Each
factory returns (model, example_inputs): token ids of shape (BATCH, SEQ).

``torch_transformer`` is torch's own test Transformer (``common_dtensor``), a test-only
model that is no family of autopar's."""

from __future__ import annotations

from typing import Callable

import torch

from autopar.models import MODELS as REGISTRY

VOCAB = 128
BATCH, SEQ = 4, 8

# family -> its tiny config keywords (positions: the position tables hold 32)
TINY = {
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
    "llama": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32),
    "mixtral": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=32),
    "bert": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0),
    "gpt": dict(vocab_size=VOCAB, max_seq_len=SEQ, dim=64, n_heads=4, n_layers=2),
}


def _tokens(vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(0)
    return build()


def tiny(family: str):
    """(model, example_inputs) of a registry family at its tiny config (``TINY``): weights
    seeded 0, token ids drawn from a generator seeded 0."""
    entry = REGISTRY[family]
    model = _seeded(lambda: entry.build(TINY[family], SEQ))
    args, _ = entry.inputs(TINY[family], BATCH, SEQ, generator=torch.Generator().manual_seed(0))
    return model, args


def gpt2():
    return tiny("gpt2")


def llama():
    return tiny("llama")


def mixtral():
    return tiny("mixtral")


def bert():
    return tiny("bert")


def small_gpt():
    return tiny("gpt")


def torch_transformer():
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    args = ModelArgs(n_layers=2, vocab_size=VOCAB, max_seq_len=SEQ, dim=64, n_heads=4, dropout_p=0.0)
    return _seeded(lambda: Transformer(args)), (_tokens(),)


MODELS = {
    "gpt2": gpt2,
    "llama": llama,
    "mixtral": mixtral,
    "bert": bert,
    "torch_transformer": torch_transformer,
}


class CutIndices(torch.nn.Module):
    """Token ids -> logits, with integer and boolean values made at the start and read at
    the end: positions (int64, drawn from the tokens, so that any other values index out of
    range or elsewhere) by ``index_select`` of a position table and by ``gather`` along the
    sequence, and a mask (bool) by ``masked_fill``. A pipeline cut between carries them."""

    def __init__(self, vocab: int = 64, seq: int = 8, dim: int = 16, hidden: int = 32, n_layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.table = torch.nn.Parameter(torch.randn(seq, dim))
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))
            for _ in range(n_layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, seq = tokens.shape
        positions = (tokens * 5 + 3) % seq
        keep = tokens % 3 != 0
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h)
        h = h + self.table.index_select(0, positions.flatten()).view(batch, seq, -1)
        h = torch.gather(h, 1, positions.unsqueeze(-1).expand(batch, seq, h.shape[-1]))
        return self.head(h.masked_fill(~keep.unsqueeze(-1), 0.0))
