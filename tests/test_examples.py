"""examples/train_hf.py, the training loop the README documents, on 4 gloo ranks (tensor
parallel inside data parallel, per-rank data, clipping, accumulation, warm-up, eval,
checkpoint) trains like the same loop in one process with plain PyTorch."""

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_hf.py"
ARGS = ["--steps", "4", "--eval-every", "2", "--warmup", "2", "--accumulate", "2", "--max-norm", "0.5", "--float64"]
# Hugging Face's own loss runs on logits.float(): float32 values, whatever the model's dtype
LOSS_TOL = 1e-5


def result_of(cmd: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.JSONDecoder().raw_decode(lines[-1].removeprefix("RESULT "))[0]


def test_train_hf_example_matches_one_process(tmp_path):
    parallel = result_of([
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(EXAMPLE),
        "--mesh", "2x2", "--layout", "tp+dp", "--checkpoint", str(tmp_path / "ckpt"), *ARGS,
    ])
    reference = result_of([sys.executable, str(EXAMPLE), "--reference", *ARGS])
    assert parallel["data_parallel"][0] == 2, "tp+dp on 2x2: two batch shards, each shared by two ranks"
    assert len(parallel["losses"]) == len(reference["losses"]) == 4
    assert max(abs(a - b) for a, b in zip(parallel["losses"], reference["losses"])) <= LOSS_TOL, (parallel, reference)
    assert len(parallel["evals"]) == len(reference["evals"]) == 2
    assert max(abs(a - b) for a, b in zip(parallel["evals"], reference["evals"])) <= LOSS_TOL, (parallel, reference)
    assert abs(parallel["weights_norm"] - reference["weights_norm"]) <= 1e-9 * reference["weights_norm"]
    # a module loaded from the checkpoint evaluates as the one that saved it
    assert parallel["reloaded_eval"] == parallel["evals"][-1]
