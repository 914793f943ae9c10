"""The models autopar ships, and the one registry of them (``MODELS``) that the CLI
(``autopar plan NAME``), the demo, the benchmarks (``autopar.bench.workloads``) and the
tests read.

``GPT`` and ``WideMLP`` are ordinary ``nn.Module`` code, written the way users write
models, with no autopar-specific hooks. The Hugging Face families (GPT-2, Llama, Mixtral,
BERT, ResNet, ConvNeXt, CLIP, Whisper, BART) need the optional ``transformers`` package,
imported when one of them is built.

A registry entry (``Family``) says what the model is, which named sizes it has (``Size``:
the config, an example batch and sequence length, the dtype) and what example inputs it
makes. ``MODELS[name].build(size)`` builds one on the current default device (under
``torch.device("meta")``: shapes only, nothing allocated; seed the global generator first
for reproducible weights); ``MODELS[name].inputs(size, generator=...)`` makes its example
inputs: drawn from ``generator`` on the CPU, or zeros on the default device without one.
A size is a name of the family's ``sizes`` or a dict of config keywords of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

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


@dataclass(frozen=True)
class WideMLPConfig:
    dim: int = 64
    hidden: int = 256
    n_layers: int = 2


class WideMLP(nn.Module):
    """A stack of wide two-layer MLPs with residuals: the simplest tensor-parallel case."""

    def __init__(self, dim: int = WideMLPConfig.dim, hidden: int = WideMLPConfig.hidden,
                 n_layers: int = WideMLPConfig.n_layers):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
            for _ in range(n_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


# --- the registry ----------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    """One named size of a family: its config keywords, the example batch and sequence
    length (None: inputs without a sequence dim), and the dtype the model is built in."""

    config: Mapping[str, Any]
    batch: int
    seq: int | None
    dtype: torch.dtype = torch.float32
    about: str = ""  # the size, in words


Inputs = tuple[tuple, dict]  # example (positional inputs, keyword inputs)


@dataclass(frozen=True)
class Family:
    """One entry of the registry: a model family and the sizes it is built at."""

    about: str  # what the model is
    takes: str  # what example inputs it makes, in words
    sizes: Mapping[str, Size]
    config: Callable[..., Any]  # config keywords -> the family's config object
    model: Callable[[Any], nn.Module]  # config object -> the model, on the current default device
    example: Callable[[Any, int, int | None, torch.Generator | None], Inputs]  # (config, batch, seq, generator)
    positions: str | None = None  # the config keyword of the position table: made at least the sequence length

    def keywords(self, size: str | Mapping[str, Any], seq: int | None = None, **overrides: Any) -> dict[str, Any]:
        """The config keywords of ``size`` (a name or keywords), ``overrides`` applied, the
        position table grown to ``seq``."""
        given = dict(self.size(size).config) if isinstance(size, str) else dict(size)
        keywords = {**given, **overrides}
        seq = seq or (self.size(size).seq if isinstance(size, str) else None)
        if self.positions and seq:
            keywords[self.positions] = max(keywords.get(self.positions, 0), seq)
        return keywords

    def size(self, name: str) -> Size:
        if name not in self.sizes:
            raise ValueError(f"autopar: no size {name!r} of {self.about}; expected one of {list(self.sizes)}, "
                             "or a dict of config keywords")
        return self.sizes[name]

    def build(self, size: str | Mapping[str, Any], seq: int | None = None, **overrides: Any) -> nn.Module:
        """The model of ``size`` (a name, in its dtype; or config keywords, in float32), its
        position table at least ``seq`` long, ``overrides`` applied to the config."""
        model = self.model(self.config(**self.keywords(size, seq, **overrides)))
        dtype = self.size(size).dtype if isinstance(size, str) else torch.float32
        return model if dtype == torch.float32 else model.to(dtype)

    def inputs(self, size: str | Mapping[str, Any], batch: int | None = None, seq: int | None = None,
               generator: torch.Generator | None = None) -> Inputs:
        """Example (args, kwargs) of ``batch`` x ``seq`` (default: the size's), drawn from
        ``generator`` on the CPU, or zeros on the current default device without one."""
        if isinstance(size, str):
            batch, seq = batch or self.size(size).batch, seq or self.size(size).seq
        elif batch is None:
            raise ValueError(f"autopar: example inputs of {self.about} from config keywords need batch= (and seq=, "
                             "where the inputs have a sequence); found none")
        return self.example(self.config(**self.keywords(size, seq)), batch, seq, generator)


def _transformers(name: str) -> Any:
    """A class of the optional ``transformers`` package, imported when a Hugging Face family is built."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"autopar: the Hugging Face models need the transformers package; found none ({e}). "
                          "Install it (pip install 'autopar[test]')") from None
    return getattr(transformers, name)


def _hf(config: str, model: str) -> dict[str, Callable]:
    """A Hugging Face family's config and model constructors (transformers imported at the call)."""
    return {"config": lambda **keywords: _transformers(config)(**keywords),
            "model": lambda cfg: _transformers(model)(cfg)}


def _ids(high: int, shape: tuple[int, ...], generator: torch.Generator | None) -> torch.Tensor:
    if generator is None:
        return torch.zeros(shape, dtype=torch.long)
    return torch.randint(0, high, shape, generator=generator, device="cpu")


def _floats(shape: tuple[int, ...], generator: torch.Generator | None) -> torch.Tensor:
    return torch.zeros(shape) if generator is None else torch.randn(shape, generator=generator, device="cpu")


def _tokens(cfg: Any, batch: int, seq: int, generator: torch.Generator | None) -> Inputs:
    return (_ids(cfg.vocab_size, (batch, seq), generator),), {}


def _features(cfg: Any, batch: int, seq: int | None, generator: torch.Generator | None) -> Inputs:
    return (_floats((batch, cfg.dim) if seq is None else (batch, seq, cfg.dim), generator),), {}


def _image_labels(cfg: Any, batch: int, side: int, generator: torch.Generator | None) -> Inputs:
    pixels = _floats((batch, cfg.num_channels, side, side), generator)
    return (pixels,), {"labels": _ids(cfg.num_labels, (batch,), generator)}


def _clip_pairs(cfg: Any, batch: int, seq: int, generator: torch.Generator | None) -> Inputs:
    vision = cfg.vision_config
    return (), {"input_ids": _ids(cfg.text_config.vocab_size, (batch, seq), generator),
                "pixel_values": _floats((batch, vision.num_channels, vision.image_size, vision.image_size), generator),
                "return_loss": True}


def _speech_labels(cfg: Any, batch: int, seq: int, generator: torch.Generator | None) -> Inputs:
    frames = 2 * cfg.max_source_positions  # the encoder's two convolutions halve the frames
    return (), {"input_features": _floats((batch, cfg.num_mel_bins, frames), generator),
                "labels": _ids(cfg.vocab_size, (batch, seq), generator)}


def _text_labels(cfg: Any, batch: int, seq: int, generator: torch.Generator | None) -> Inputs:
    return (), {"input_ids": _ids(cfg.vocab_size, (batch, seq), generator),
                "labels": _ids(cfg.vocab_size, (batch, seq), generator)}


def _bench(sizes: dict[Any, tuple], keys: tuple[str, ...], prefix: str = "bench", **shared: Any) -> dict[str, Size]:
    """The benchmark's sizes (``autopar.bench.workloads``), "<prefix>-<scale>": per scale, the
    config values in ``keys`` order, then the batch and the sequence length."""
    about = "autopar bench: 'cpu' trains on gloo ranks here; 8, 64, 512 H100s are planned only"
    return {f"{prefix}-{scale}": Size({**dict(zip(keys, values[:len(keys)])), **shared}, *values[len(keys):],
                                   about=about)
            for scale, values in sizes.items()}


NO_HF_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
LLAMA_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "vocab_size")

LLAMA3 = {  # Llama 3 (Meta, 2024): hidden, ffn, layers, heads, kv heads, vocab
    "8b": (4096, 14336, 32, 32, 8, 128256),
    "70b": (8192, 28672, 80, 64, 8, 128256),
    "405b": (16384, 53248, 126, 128, 8, 128256),
}
MEGATRON_GPT = {  # Megatron-LM README's H100 table (Megatron-Core r0.8.0): layers, hidden, heads, global batch
    "7.1b": (30, 4096, 32, 192),
    "177b": (96, 12288, 96, 1152),
    "462b": (112, 18432, 144, 3072),
}
MEGATRON_VOCAB = 131072  # the README: "All models use a vocabulary size of 131,072 and a sequence length of 4096"


def _llama3_size(name: str, hidden: int, ffn: int, layers: int, heads: int, kv: int, vocab: int) -> Size:
    config = dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, vocab_size=vocab, torch_dtype=torch.bfloat16)
    return Size(config, 16, 4096, torch.bfloat16, f"Llama-3 {name.upper()} shape, bf16")


def _megatron_size(name: str, layers: int, hidden: int, heads: int, batch: int) -> Size:
    config = dict(vocab_size=MEGATRON_VOCAB, dim=hidden, n_heads=heads, n_layers=layers)
    return Size(config, batch, 4096, torch.bfloat16, f"Megatron-LM's GPT {name.upper()} (README, H100 table), bf16")


MODELS: dict[str, Family] = {
    "gpt": Family(
        about="autopar.models.GPT: a GPT-2-shaped decoder (learned positions, LayerNorm, GELU MLP of 4x width)",
        takes="token ids (batch, seq)",
        sizes={
            "small": Size({"max_seq_len": 64}, 8, 64, about="default config (2 layers, dim 64)"),
            "demo": Size(dict(vocab_size=512, dim=128, n_heads=4, n_layers=2), 16, 64,
                         about="the demo's: 2 layers, dim 128, vocab 512"),
            # Megatron's GPT: parameter counts 7.13B, 177.2B, 461.5B
            **{f"megatron-{name}": _megatron_size(name, *shape) for name, shape in MEGATRON_GPT.items()},
            # the embedding and the head dominate (vocab, width, heads, layers; batch, seq)
            **_bench({"cpu": (32768, 64, 4, 2, 8, 16), 8: (262144, 2048, 16, 4, 16, 2048),
                      64: (262144, 4096, 32, 8, 64, 4096), 512: (524288, 8192, 64, 16, 256, 4096)},
                     ("vocab_size", "dim", "n_heads", "n_layers"), prefix="big-vocab"),
        },
        config=GPTConfig, model=GPT, example=_tokens, positions="max_seq_len",
    ),
    "wide-mlp": Family(
        about="autopar.models.WideMLP: residual two-layer MLPs, the simplest tensor-parallel case",
        takes="features (batch, dim), or (batch, seq, dim) where the size has a sequence",
        sizes={
            "plan": Size(dict(dim=4096, hidden=16384, n_layers=8), 16, 256, about="8 layers, 4096 -> 16384 -> 4096"),
            **_bench({"cpu": (256, 2048, 2, 32, None), 8: (8192, 32768, 4, 16384, None),
                      64: (16384, 65536, 8, 65536, None), 512: (32768, 131072, 8, 262144, None)},
                     ("dim", "hidden", "n_layers")),
        },
        config=WideMLPConfig, model=lambda cfg: WideMLP(cfg.dim, cfg.hidden, cfg.n_layers), example=_features,
    ),
    "gpt2": Family(
        about="Hugging Face GPT-2 (GPT2LMHeadModel)",
        takes="token ids (batch, seq)",
        sizes={
            "124m": Size({"n_positions": 1024}, 8, 1024, about="GPT-2 124M shape"),
            **_bench({"cpu": (2, 128, 4, 2048, 16, 64), 8: (24, 2048, 16, 50304, 16, 1024),
                      64: (32, 4096, 32, 50304, 64, 2048), 512: (32, 8192, 64, 50304, 512, 2048)},
                     ("n_layer", "n_embd", "n_head", "vocab_size"), **NO_HF_DROPOUT, bos_token_id=0,
                     eos_token_id=0, use_cache=False),
        },
        **_hf("GPT2Config", "GPT2LMHeadModel"), example=_tokens, positions="n_positions",
    ),
    "llama": Family(
        about="Hugging Face Llama (LlamaForCausalLM): rotary positions, RMSNorm, SwiGLU, grouped-query attention",
        takes="token ids (batch, seq)",
        sizes={
            **{name: _llama3_size(name, *shape) for name, shape in LLAMA3.items()},
            **_bench({"cpu": (2, 128, 384, 4, 4, 2048, 16, 64), 8: (16, 2048, 8192, 32, 8, 128256, 16, 2048),
                      64: (32, 4096, 14336, 32, 8, 128256, 64, 4096),
                      512: (80, 8192, 28672, 64, 8, 128256, 256, 4096)}, LLAMA_KEYS, use_cache=False),
        },
        **_hf("LlamaConfig", "LlamaForCausalLM"), example=_tokens, positions="max_position_embeddings",
    ),
    "mixtral": Family(
        about="Hugging Face Mixtral (MixtralForCausalLM): Llama with mixture-of-experts MLPs, top-2 routing",
        takes="token ids (batch, seq)",
        sizes={
            "small": Size(dict(num_hidden_layers=4, hidden_size=1024, intermediate_size=3584, num_attention_heads=16,
                               num_key_value_heads=4, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
                               max_position_embeddings=1024), 8, 1024, torch.bfloat16,
                          about="small: 4 layers, dim 1024, 8 experts top-2, bf16"),
            **_bench({"cpu": (2, 128, 256, 4, 4, 2048, 4, 16, 32), 8: (8, 1024, 3584, 16, 8, 32000, 8, 16, 2048),
                      64: (32, 4096, 14336, 32, 8, 32000, 8, 64, 4096),
                      512: (32, 6144, 16384, 48, 8, 32768, 8, 256, 4096)},
                     (*LLAMA_KEYS, "num_local_experts"), num_experts_per_tok=2, use_cache=False),
        },
        **_hf("MixtralConfig", "MixtralForCausalLM"), example=_tokens, positions="max_position_embeddings",
    ),
    "bert": Family(
        about="Hugging Face BERT encoder (BertModel)", takes="token ids (batch, seq)", sizes={},
        **_hf("BertConfig", "BertModel"), example=_tokens, positions="max_position_embeddings",
    ),
    "resnet": Family(
        about="Hugging Face ResNet classifier (conv2d, batch norm, max pooling)",
        takes="pixels (batch, channels, seq, seq) and class labels (batch,): the loss is the output's",
        sizes={"tiny": Size(dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck",
                                 num_labels=4), 2, 32, about="the rule coverage tests")},
        **_hf("ResNetConfig", "ResNetForImageClassification"), example=_image_labels,
    ),
    "convnext": Family(
        about="Hugging Face ConvNeXt classifier (depthwise conv2d, layer norm over channels)",
        takes="pixels (batch, channels, seq, seq) and class labels (batch,): the loss is the output's",
        sizes={"tiny": Size(dict(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=4, image_size=32),
                            2, 32, about="the rule coverage tests")},
        **_hf("ConvNextConfig", "ConvNextForImageClassification"), example=_image_labels,
    ),
    "clip": Family(
        about="Hugging Face CLIP: a vision and a text tower, contrastive loss",
        takes="keywords input_ids (batch, seq), pixel_values (batch, channels, image, image), return_loss=True",
        sizes={"tiny": Size(dict(text_config=dict(vocab_size=96, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=1, num_attention_heads=2,
                                                  max_position_embeddings=16),
                                 vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                    num_attention_heads=2, image_size=32, patch_size=8),
                                 projection_dim=16), 2, 8, about="the rule coverage tests")},
        **_hf("CLIPConfig", "CLIPModel"), example=_clip_pairs,
    ),
    "whisper": Family(
        about="Hugging Face Whisper: conv1d front, encoder-decoder",
        takes="keywords input_features (batch, mel bins, 2 x source positions), labels (batch, seq)",
        sizes={"tiny": Size(dict(vocab_size=96, num_mel_bins=16, encoder_layers=1, decoder_layers=1,
                                 encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                 decoder_ffn_dim=64, d_model=32, max_source_positions=16, max_target_positions=16,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                                 **NO_DROPOUT), 2, 8, about="the rule coverage tests")},
        **_hf("WhisperConfig", "WhisperForConditionalGeneration"), example=_speech_labels,
    ),
    "bart": Family(
        about="Hugging Face BART: encoder-decoder",
        takes="keywords input_ids (batch, seq), labels (batch, seq)",
        sizes={"tiny": Size(dict(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1,
                                 encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                 decoder_ffn_dim=64, max_position_embeddings=32, **NO_DROPOUT), 2, 8,
                            about="the rule coverage tests")},
        **_hf("BartConfig", "BartForConditionalGeneration"), example=_text_labels,
    ),
}


def llama3(size: str, seq: int = 4096, layers: int | None = None) -> nn.Module:
    """A Hugging Face Llama of a Llama-3 size ("8b", "70b", "405b") in bf16, built on the
    current default device: build it under ``torch.device("meta")`` to plan without weights."""
    if size not in LLAMA3:
        raise ValueError(f"autopar: no Llama 3 size {size!r}; expected one of {sorted(LLAMA3)}")
    overrides = {"num_hidden_layers": layers} if layers else {}
    return MODELS["llama"].build(size, seq, **overrides)


def megatron_gpt(size: str, seq: int = 4096) -> nn.Module:
    """A GPT of a Megatron-LM benchmark size ("7.1b", "177b", "462b") in bf16: this module's
    ``GPT`` (learned positions, LayerNorm, GELU MLP of 4x hidden, biases, an output head apart
    from the embedding, as Megatron's GPT), built on the current default device. Its
    parameter count matches the size named (7.13B, 177.2B, 461.5B)."""
    if size not in MEGATRON_GPT:
        raise ValueError(f"autopar: no Megatron GPT size {size!r}; expected one of {sorted(MEGATRON_GPT)}")
    return MODELS["gpt"].build(f"megatron-{size}", seq)
