"""The torchtitan job-config fragment of an export (``Exported.torchtitan``:
``autopar.passes.export.torchtitan``): torchtitan's own key names (``torchtitan/config/
job_config.py``), the plan's degrees, schedule, micro-batch size, stages (by torchtitan's own module
names) and checkpoint mode, and a note where torchtitan's recipe cannot say the plan's choice; none for a
model outside the Llama family."""

from __future__ import annotations

import tomllib
import warnings

import pytest
import torch

import autopar
from autopar.models import MODELS
from tests.models import BATCH, SEQ, TINY, gpt2, llama

# torchtitan/config/job_config.py: the fields of Parallelism, Training, ActivationCheckpoint it reads
PARALLELISM = {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
               "tensor_parallel_degree", "pipeline_parallel_degree", "pipeline_parallel_schedule",
               "pipeline_parallel_microbatch_size", "module_fqns_per_model_part"}


def planned(factory, *args, **options):
    model, inputs = factory()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, inputs, autopar.plan(model, *args, inputs, hardware="h100", time_limit_s=5, **options)


def test_a_data_parallel_llama_is_torchtitans_replicate_degree(tmp_path):
    model, inputs, plan = planned(llama, (2,), layout="dp", pipeline=False)
    exported = plan.export(model, tmp_path / "dp.py", example_inputs=inputs)
    config = tomllib.loads(exported.torchtitan)
    assert set(config) == {"parallelism", "training", "activation_checkpoint"}
    assert set(config["parallelism"]) <= PARALLELISM
    assert config["parallelism"]["data_parallel_replicate_degree"] == 2
    assert config["parallelism"]["data_parallel_shard_degree"] == 1
    assert config["parallelism"]["pipeline_parallel_degree"] == 1 and config["activation_checkpoint"]["mode"] == "none"
    assert config["training"] == {"local_batch_size": inputs[0].shape[0] // 2, "global_batch_size": inputs[0].shape[0]}
    assert exported.write_torchtitan(tmp_path / "job.toml").read_text() == exported.torchtitan


def test_a_pipelined_fsdp_llama_with_some_layers_recomputed(tmp_path):
    model, inputs, plan = planned(llama, (2, 2), layout="pp+fsdp", constraints=autopar.Constraints(
        recompute=(0,), micro_batches=2, schedule="1f1b"))
    exported = plan.export(model, tmp_path / "pp.py", example_inputs=inputs)
    config = tomllib.loads(exported.torchtitan)
    p = config["parallelism"]
    assert (p["pipeline_parallel_degree"], p["data_parallel_shard_degree"], p["tensor_parallel_degree"]) == (2, 2, 1)
    assert p["pipeline_parallel_schedule"] == "1F1B" and p["fsdp_reshard_after_forward"] == "always"
    local = config["training"]["local_batch_size"]
    assert local == inputs[0].shape[0] // 2 and p["pipeline_parallel_microbatch_size"] == local // 2
    assert p["module_fqns_per_model_part"] == [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    # layer 0 only: torchtitan recomputes all layers or by its own policy, said so
    assert config["activation_checkpoint"]["mode"] == "full"
    assert "recomputes layers [0] only" in exported.torchtitan


def test_no_torchtitan_config_outside_the_llama_family(tmp_path):
    model, inputs, plan = planned(gpt2, (2,), layout="dp", pipeline=False)
    exported = plan.export(model, tmp_path / "gpt2.py", example_inputs=inputs)
    assert exported.torchtitan is None
    with pytest.raises(ValueError, match="autopar: no torchtitan job config for this model"):
        exported.write_torchtitan(tmp_path / "job.toml")


def test_torchtitan_stages_are_the_plans_cut_in_torchtitans_module_names(tmp_path):
    """A 5-layer Llama cut where the pin says (its second stage from model.layers.3): torchtitan's
    stages hold its blocks layers.<i> by their index in the Hugging Face container, every block
    once and in order, the embedding first and the norm and output projection last."""
    torch.manual_seed(0)
    model = MODELS["llama"].build({**TINY["llama"], "num_hidden_layers": 5}, SEQ)
    inputs = (torch.randint(0, TINY["llama"]["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0)),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (2,), inputs, hardware="h100", time_limit_s=5, constraints=autopar.Constraints(
            stage_starts=("model.layers.3",), micro_batches=2, schedule="gpipe"))
    exported = plan.export(model, tmp_path / "pp.py", example_inputs=inputs)
    parts = tomllib.loads(exported.torchtitan)["parallelism"]["module_fqns_per_model_part"]
    assert parts == [["tok_embeddings", "layers.0", "layers.1", "layers.2"], ["layers.3", "layers.4", "norm", "output"]]
    assert "model.layers" not in exported.torchtitan
