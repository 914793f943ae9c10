"""The models the capture and sharding tests run on: small configs, random weights, no
downloads. Each factory returns (model, example_inputs)."""

from __future__ import annotations

from typing import Callable

import torch

from autopar.models import GPT, GPTConfig

VOCAB = 128
BATCH, SEQ = 4, 8


def _tokens(vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(0)
    return build()


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return _seeded(lambda: GPT2LMHeadModel(cfg)), (_tokens(),)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
    )
    return _seeded(lambda: LlamaForCausalLM(cfg)), (_tokens(),)


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    return _seeded(lambda: MixtralForCausalLM(cfg)), (_tokens(),)


def bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return _seeded(lambda: BertModel(cfg)), (_tokens(),)


def torch_transformer():
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    args = ModelArgs(n_layers=2, vocab_size=VOCAB, max_seq_len=SEQ, dim=64, n_heads=4, dropout_p=0.0)
    return _seeded(lambda: Transformer(args)), (_tokens(),)


def small_gpt():
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, dim=64, n_heads=4, n_layers=2)
    return _seeded(lambda: GPT(cfg)), (_tokens(),)


MODELS = {
    "gpt2": gpt2,
    "llama": llama,
    "mixtral": mixtral,
    "bert": bert,
    "torch_transformer": torch_transformer,
}
