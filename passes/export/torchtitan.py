"""The plan as a torchtitan job-config fragment, for the Llama-family models torchtitan trains.

torchtitan lays a Llama out by its own recipe from a few numbers (``torchtitan/config/
job_config.py``: ``[parallelism]``, ``[training]``, ``[activation_checkpoint]``): the degrees of
its mesh (pipeline, data-parallel replicate, data-parallel shard, tensor), the pipeline
schedule and micro-batch size, FSDP2's resharding policy and the activation-checkpoint mode.
``fragment`` writes those of an export (its reading of the plan's axes, FSDP groups and stages)
as TOML, with a comment for each choice of the plan that torchtitan's recipe cannot say
(torchtitan's tensor-parallel plan, with sequence-parallel norms and loss parallel, is fixed;
its mesh is ordered pp, dp_replicate, dp_shard, tp; it recomputes no layer, every layer, or a
selective policy of its own). A pipeline's stages are written as torchtitan names its Llama's
modules (``module_fqns_per_model_part``, one list per stage: its embedding ``tok_embeddings``, its
blocks ``layers.<i>`` by their index in its ``Transformer.layers``, its ``norm`` and ``output``);
torchtitan refuses the older ``pipeline_parallel_split_points`` since July 2025.
"""

from __future__ import annotations

import math

LLAMA_FAMILY = ("Llama", "Transformer")  # Hugging Face's Llama*ForCausalLM, torchtitan's own Transformer
# Plan.pipeline.schedule -> torchtitan's --parallelism.pipeline_parallel_schedule (torch's class names)
SCHEDULES = {"1F1B": "1F1B", "GPipe": "GPipe", "Interleaved1F1B": "Interleaved1F1B"}
# torchtitan's Llama (torchtitan/models/llama3/model/model.py): its modules' names, which its pipeline
# splitter takes (torchtitan/distributed/pipeline_parallel.py, generate_llm_fqn_per_model_part)
TITAN_EMBEDDING, TITAN_LAYERS, TITAN_HEAD = "tok_embeddings", "layers", ("norm", "output")


def is_llama_family(model_name: str) -> bool:
    return any(word in model_name for word in LLAMA_FAMILY)


def fragment(plan, model_name: str, reading, dp, cut, batch: int, notes: list[str]) -> str | None:
    """The TOML fragment (module docstring), or None for a model outside the Llama family."""
    if not is_llama_family(model_name):
        return None
    axes = reading.axes
    size = lambda picked: math.prod(axes.shape[a] for a in picked)  # noqa: E731
    tp = size(axes.tensor)
    shard = size(dp.shard_axes) if dp is not None and dp.kind == "fsdp" else 1
    replicate = size(dp.replicate_axes) if dp is not None else 1
    pp = plan.pipeline.stages if plan.pipeline is not None else 1
    said = [f"{model_name} as autopar's plan \"{plan.kind}\" lays it out, in torchtitan's job config"]
    order = [axes.role(a) for a in range(len(axes.shape)) if axes.shape[a] > 1]
    wanted = [r for r in ("pp", "dp", "fsdp", "tp") if r in order]
    if order != wanted:
        said.append(f"the plan's mesh axes are {', '.join(order)} from the outermost; torchtitan orders them pp, "
                    "dp_replicate, dp_shard, tp: the same degrees on other links")
    parallelism = [("data_parallel_replicate_degree", replicate), ("data_parallel_shard_degree", shard),
                   ("tensor_parallel_degree", tp), ("pipeline_parallel_degree", pp)]
    if dp is not None and dp.kind == "fsdp":
        reshards = set(dp.groups.values())
        policy = "always" if reshards == {True} else "never" if reshards == {False} else "default"
        parallelism.append(("fsdp_reshard_after_forward", f'"{policy}"'))
        if policy == "default":
            said.append("the plan reshards some FSDP groups after forward and not others; torchtitan sets one "
                        "policy for all (\"default\": its own choice)")
    local = batch // max(1, replicate * shard)
    if plan.pipeline is not None:
        p = plan.pipeline
        parallelism.append(("pipeline_parallel_schedule", f'"{SCHEDULES.get(p.schedule, p.schedule)}"'))
        parallelism.append(("pipeline_parallel_microbatch_size", max(1, local // p.micro_batches)))
        if cut is not None:
            parts = ", ".join("[" + ", ".join(f'"{name}"' for name in part) + "]" for part in model_parts(cut.layers))
            parallelism.append(("module_fqns_per_model_part", f"[{parts}]"))
    mode = _checkpoint_mode(plan, len(reading.layers), said)
    lines = [f"# {line}" for line in said]
    lines += ["# not as planned (torchtitan's Llama recipe is fixed): " + n for n in notes]
    lines += ["", "[parallelism]"] + [f"{k} = {v}" for k, v in parallelism]
    lines += ["", "[training]", f"local_batch_size = {local}", f"global_batch_size = {batch}"]
    lines += ["", "[activation_checkpoint]", f'mode = "{mode}"', ""]
    return "\n".join(lines)


def model_parts(layers: list[tuple[int, int]]) -> list[list[str]]:
    """torchtitan's modules of each (virtual) stage, in stage order, for stages running the
    repeated layers ``[first, last)`` each (``Stages.layers``): the blocks by their index in the
    container, which torchtitan's Llama keys alike; the embedding on the first stage, the final
    norm and the output projection on the last, where the export's stages hold them."""
    parts = [[f"{TITAN_LAYERS}.{i}" for i in range(first, last)] for first, last in layers]
    parts[0].insert(0, TITAN_EMBEDDING)
    parts[-1].extend(TITAN_HEAD)
    return parts


def _checkpoint_mode(plan, total: int, said: list[str]) -> str:
    """torchtitan's ``activation_checkpoint.mode`` for the plan's recomputed layers: "none",
    "full" (every layer), or, for some layers, "full" as the nearest that fits, said so."""
    layers = sorted(int(entry.split()[-1]) for entry in plan.recompute)
    if not layers:
        return "none"
    if len(layers) == total:
        return "full"
    said.append(f"the plan recomputes layers {layers} only; torchtitan recomputes every layer (full) or by its own "
                "selective policy: full, the nearest that fits, recomputes more")
    return "full"
