"""Generation's two programs: a causal LM's prefill and decode steps, with a static key-value
cache held as the model's state.

Serving runs two programs over one layout of the weights: **prefill** (the prompt, every
position at once: compute-bound, sets the time to first token) and **decode** (one new
token per sequence against the cache: bound by reading the weights and the cache, sets the
time per output token). Both are captures of one module, ``CachedStep``: the model with a
static cache of ``max_len`` positions per sequence (Hugging Face's ``StaticCache``, as its
exportable path builds it) whose tensors are the module's buffers. So the cache is a value
of the graph: sharding propagation lays it out like any buffer (split by heads under tensor
parallelism, by sequence under data parallelism), a pipeline stage owns the cache of its
layers, and each step writes its new keys and values into it in place (``index_copy_``,
which the runtime runs on this rank's shard).

A step's inputs: the new tokens (batch, length), the attention mask over every cache slot
(batch, ``max_len``: 0 where a left-padded prompt has padding), each new token's position
(batch, length: a left-padded row counts from its first real token, as Hugging Face's
``generate`` does) and ``offset``, the first cache slot the step writes (a 0-d tensor). Its output: the logits of
the last position, what the next token needs (``capture_prompt_logits``: of every position,
for ``pm(input_ids)``).
Nothing here is special to a model family: any Hugging Face causal LM whose attention
updates a ``Cache`` works.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopar.passes.capture import Captured, capture, fuse_grouped_query_attention

OBJECTIVES = ("latency", "throughput")
INFERENCE_FIELDS = ("batch", "prompt_len", "max_len", "objective", "micro_batches")  # what a serving plan records of it


@dataclass(frozen=True, kw_only=True)
class Inference:
    """An inference workload to plan for: ``batch`` sequences (None with the throughput
    objective: searched, from the largest that fits), prompts of up to ``prompt_len`` tokens,
    generation up to ``max_len`` tokens in all (the cache's length).

    ``objective="latency"``: minimise the time to first token plus (``max_len`` -
    ``prompt_len``) times the time per output token at this batch. ``"throughput"``:
    maximise generated tokens per second per device.

    ``micro_batches``: how many a pipeline keeps in flight, each its share of the batch
    (None: the planner's choice: one, or under the throughput objective one per stage
    where that serves faster)."""

    batch: int | None = 1
    prompt_len: int = 128
    max_len: int = 2048
    objective: str = "latency"
    micro_batches: int | None = None

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"autopar: Inference(objective=) expected one of {OBJECTIVES}; found "
                             f"{self.objective!r}; pass objective='latency' or 'throughput'")
        if self.batch is None and self.objective != "throughput":
            raise ValueError("autopar: Inference(batch=None) means the batch is searched, which only the "
                             "throughput objective does; give a batch (e.g. batch=1) for objective='latency'")
        for name in ("batch", "prompt_len", "max_len", "micro_batches"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"autopar: Inference({name}=) expected a positive int; found {value!r}")
        if self.max_len <= self.prompt_len:
            raise ValueError(f"autopar: Inference expected max_len (the prompt and what is generated: "
                             f"{self.max_len}) above prompt_len ({self.prompt_len}); raise max_len")
        if self.micro_batches is not None and self.batch is not None and self.batch % self.micro_batches:
            raise ValueError(f"autopar: Inference expected micro_batches ({self.micro_batches}) to divide the batch "
                             f"({self.batch}); pick a divisor, or leave micro_batches out")

    @property
    def new_tokens(self) -> int:
        """Tokens generated per sequence: one from prefill, the rest one decode step each."""
        return self.max_len - self.prompt_len

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in INFERENCE_FIELDS}

    @staticmethod
    def of(plan_inference: dict[str, Any]) -> "Inference":
        """The workload a serving plan records (``Plan.inference``; its batch resolved)."""
        return Inference(**{name: plan_inference[name] for name in INFERENCE_FIELDS if name in plan_inference})


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise TypeError(
            f"autopar: inference expected a Hugging Face causal LM (a model with a .config and a key-value cache "
            f"path, e.g. AutoModelForCausalLM); found {type(model).__name__}; plan it for training instead, or "
            "wrap a Hugging Face model")
    if getattr(config, "is_encoder_decoder", False):
        raise TypeError(
            f"autopar: inference expected a decoder-only causal LM; found {type(model).__name__}, an encoder-decoder "
            "model (config.is_encoder_decoder), whose generation also runs an encoder and a cross-attention cache: "
            "not supported yet; plan it for training, or serve a decoder-only model")
    return config.get_text_config(decoder=True)


def check_positions(model: nn.Module, max_len: int) -> None:
    """``max_len`` within the model's positions, where the config says how many it has."""
    limit = getattr(_text_config(model), "max_position_embeddings", None)
    if limit is not None and max_len > limit:
        raise ValueError(f"autopar: Inference(max_len={max_len}) is beyond the model's {limit} positions "
                         f"(config.max_position_embeddings); use max_len <= {limit}")


class CachedStep(nn.Module):
    """``model`` with a static cache of ``max_len`` positions for ``batch`` sequences as its
    buffers ``cache_keys_<i>`` / ``cache_values_<i>`` (one pair per layer, zeros); its forward
    is one step of generation (the module docstring) and returns the logits."""

    def __init__(self, model: nn.Module, batch: int, max_len: int, last_logits: bool = True):
        super().__init__()
        from transformers.cache_utils import StaticCache, StaticLayer  # transformers: only for its models
        from transformers.configuration_utils import get_head_shapes

        config = _text_config(model)
        check_positions(model, max_len)
        weight = next(model.parameters())
        try:
            cache = StaticCache(config=config, max_cache_len=max_len)
            heads, head_dim = get_head_shapes(config)
            cache.early_initialization(batch, heads, head_dim, weight.dtype, weight.device)
        except Exception as exc:  # noqa: BLE001 - whatever the config lacks, one clear error
            raise TypeError(
                f"autopar: inference expected a causal LM with a static key-value cache (transformers' StaticCache); "
                f"{type(model).__name__} has none ({type(exc).__name__}: {exc}); encoder-decoder and recurrent "
                "models are not supported yet: plan them for training") from exc

        class _Slots(StaticLayer):
            """A static layer whose tensors the step binds on each call; it writes the new keys
            and values at ``offset`` and up (``cumulative_length``), in place, and counts nothing
            (``offset`` is the step's input)."""

            def update(self, key_states, value_states, *args, **kwargs):
                slots = torch.arange(key_states.shape[-2], device=key_states.device) + self.cumulative_length
                self.keys.index_copy_(2, slots, key_states)
                self.values.index_copy_(2, slots, value_states)
                return self.keys, self.values

        layers = []
        for i, layer in enumerate(cache.layers):
            slots = _Slots(max_len)
            slots.__dict__.update(layer.__dict__)
            layers.append(slots)
            self.register_buffer(f"cache_keys_{i}", layer.keys, persistent=False)
            self.register_buffer(f"cache_values_{i}", layer.values, persistent=False)
        cache.layers = layers
        self.model = model
        self.batch, self.max_len = batch, max_len
        self._cache = (cache,)  # a tuple: not a submodule, its tensors are the buffers above
        # the next token needs the last position's logits only (Hugging Face's generate asks
        # for them alone too): a prompt's logits over the vocabulary would be the largest
        # tensor of a step (Llama-3-8B, 1,076 prompts of 128 tokens: 33 GiB in bfloat16)
        keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._keep = {"logits_to_keep": 1} if last_logits and keeps else {}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                offset: torch.Tensor) -> torch.Tensor:
        cache = self._cache[0]
        for i, layer in enumerate(cache.layers):  # the buffers as this call sees them (export swaps them)
            layer.keys, layer.values = getattr(self, f"cache_keys_{i}"), getattr(self, f"cache_values_{i}")
            layer.cumulative_length = offset
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True, **self._keep)
        return out.logits


def step_inputs(ids: torch.Tensor, mask: torch.Tensor, max_len: int) -> tuple[torch.Tensor, ...]:
    """The prefill step's inputs for left-padded prompts ``ids`` (batch, prompt) with their
    attention ``mask`` (1: a token, 0: padding): the tokens, the mask over every cache slot,
    each token's position (counted from the row's first token) and offset 0."""
    batch, prompt = ids.shape
    slots = torch.cat([mask.to(torch.long), mask.new_ones((batch, max_len - prompt), dtype=torch.long)], dim=1)
    positions = (mask.to(torch.long).cumsum(-1) - 1).clamp(min=0)
    return ids, slots, positions, torch.tensor(0, dtype=torch.long, device=ids.device)


def example_inputs(batch: int, length: int, max_len: int, device: Any = "meta") -> tuple[torch.Tensor, ...]:
    """Inputs of one step of ``length`` new tokens per sequence (prefill: the prompt; decode:
    1), for capture: their shapes and dtypes are what matter."""
    ids = torch.zeros((batch, length), dtype=torch.long, device=device)
    mask = torch.ones((batch, max_len), dtype=torch.long, device=device)
    positions = torch.zeros((batch, length), dtype=torch.long, device=device)
    return ids, mask, positions, torch.tensor(0, dtype=torch.long, device=device)


@dataclass
class Programs:
    """The two programs of generation, captured from one ``CachedStep`` at ``batch`` sequences."""

    prefill: Captured  # the prompt: ``prompt_len`` new tokens per sequence
    decode: Captured  # one new token per sequence
    batch: int
    prompt_len: int
    max_len: int

    def __iter__(self):
        return iter((self.prefill, self.decode))


def meta_twin(model: nn.Module) -> nn.Module:
    """``model`` on the meta device, built anew from its config where it holds real weights:
    capture reads shapes only, and a real model's twin costs no memory (nor does its cache)."""
    _text_config(model)  # a Hugging Face causal LM, or a clear error
    if all(p.device.type == "meta" for p in model.parameters()):
        return model
    config = getattr(model, "config", None)
    dtype = next(model.parameters()).dtype
    try:
        with torch.device("meta"):
            twin = type(model)(config).to(dtype)
    except Exception as exc:  # noqa: BLE001 - a model its config does not rebuild
        raise TypeError(f"autopar: inference expected a Hugging Face model its config rebuilds "
                        f"(type(model)(model.config)); {type(model).__name__} failed ({type(exc).__name__}: {exc})"
                        ) from exc
    mine = {n: tuple(p.shape) for n, p in model.named_parameters()}
    theirs = {n: tuple(p.shape) for n, p in twin.named_parameters()}
    if mine != theirs:
        raise TypeError(f"autopar: {type(model).__name__} rebuilt from its config has other parameters than the model "
                        "given (changed after construction?); pass the model on the meta device instead")
    return twin.train(model.training)


def capture_programs(model: nn.Module, batch: int, prompt_len: int, max_len: int) -> Programs:
    """Prefill and decode of ``model`` (on the meta device: ``meta_twin``) with a static cache
    of ``max_len`` positions for ``batch`` sequences, captured in eval mode; each returns the
    logits of the last position only (``CachedStep``)."""
    step = CachedStep(meta_twin(model), batch, max_len)
    prefill = _captured_step(step, example_inputs(batch, prompt_len, max_len), model)
    decode = _captured_step(step, example_inputs(batch, 1, max_len), model)
    return Programs(prefill, decode, batch, prompt_len, max_len)


def capture_prompt_logits(model: nn.Module, batch: int, prompt_len: int, max_len: int) -> Captured:
    """The prefill returning the logits of every prompt position (``pm(input_ids)``)."""
    step = CachedStep(meta_twin(model), batch, max_len, last_logits=False)
    return _captured_step(step, example_inputs(batch, prompt_len, max_len), model)


def _captured_step(step: CachedStep, inputs: tuple, model: nn.Module) -> Captured:
    captured = capture(step, inputs, train=False)
    fuse_grouped_query_attention(captured.gm)  # the cache read as it lies, not copied per query head
    captured.gm.recompile()
    captured.model_name = type(model).__name__  # the model served, not its wrapper
    return captured


def state_name(fqn: str) -> str:
    """A ``CachedStep`` state tensor's name in the user's model (``model.`` dropped), or the
    cache's own name (``cache_keys_0``)."""
    return fqn.removeprefix("model.")


def is_cache(fqn: str) -> bool:
    return fqn.startswith(("cache_keys_", "cache_values_"))
