"""Bad inputs, one process: each is one ``autopar:`` error that says what was expected, what
was found and what to do (a remedy that applies), never a raw error or a silent answer.

Checked elsewhere, not repeated here: the CLI's unknown model, hardware and layout, a missing
or corrupt plan JSON (``tests/test_cli.py``); a wrong number of dims and a bad ``accumulate``
(``tests/test_accumulate.py``); a bool input's value (``tests/test_variants.py``); a plan made
with its loss compiled without it (``tests/test_plan_request.py``); planning requests
(``tests/test_plan_request.py``); damaged checkpoints (``tests/distributed/checkpoint_check.py``).
The cases that need several ranks (a rank outside the mesh, ids out of range under a
vocabulary split over ranks, a destroyed group) run in ``tests/distributed/bad_input_check.py``.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils import _pytree as pytree

import autopar
from autopar.coverage import coverage
from autopar.models import GPT, GPTConfig, WideMLP
from autopar.passes.capture import CaptureError, capture
from autopar.costmodels.units import gib_text
from autopar.passes.planner.request import PlanningError
from autopar.runtime.loss import build_loss_program

VOCAB = 64


def _gpt(layers: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=8, dim=32, n_heads=4, n_layers=layers))


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


TOKENS = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
TARGET = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))


def _error(kind, match: str, call, *remedy: str) -> str:
    """The error ``call`` raises: of ``kind``, starting ``autopar:``, on one line, naming each ``remedy``."""
    with pytest.raises(kind) as err:
        call()
    text = str(err.value)
    assert text.startswith("autopar: ") and "\n" not in text, text
    assert match in text, text
    for words in remedy:
        assert words in text, (words, text)
    return text


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A one-rank gloo group and its mesh, for the whole module (as ``conftest.one_rank``)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = tmp_path_factory.mktemp("group") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()


@pytest.fixture(scope="module")
def dp_plan():
    return autopar.plan(_gpt(), (1,), (TOKENS,), layout="dp", time_limit_s=1)


@pytest.fixture(scope="module")
def compiled(mesh, dp_plan):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.compile(_gpt(), mesh, (TOKENS,), loss_fn=lm_loss, optimizer=adamw, plan=dp_plan)


# --- autopar.compile's arguments ----------------------------------------------------------

def test_an_optimizer_instance_instead_of_a_factory(mesh, dp_plan):
    model = _gpt()
    _error(TypeError, "found an optimizer instance (AdamW", lambda: autopar.compile(
        model, mesh, (TOKENS,), loss_fn=lm_loss, optimizer=torch.optim.AdamW(model.parameters()), plan=dp_plan),
        "pass e.g. optimizer=lambda params: torch.optim.AdamW(params")


def test_an_optimizer_factory_that_returns_none(mesh, dp_plan):
    _error(TypeError, "expected the optimizer factory to return a torch.optim.Optimizer", lambda: autopar.compile(
        _gpt(), mesh, (TOKENS,), loss_fn=lm_loss, optimizer=lambda params: None, plan=dp_plan).optimizer,
        "return the optimizer")


def test_a_meta_device_model(mesh, dp_plan):
    _error(ValueError, "on the meta device (e.g. 'tok.weight')", lambda: autopar.compile(
        _gpt().to("meta"), mesh, (TOKENS,), loss_fn=lm_loss, optimizer=adamw, plan=dp_plan),
        "model.to_empty(device=\"cpu\")", "autopar.plan(model, mesh_shape")


def test_a_plan_for_another_mesh(mesh):
    other = autopar.plan(_gpt(), (2,), (TOKENS,), layout="dp", time_limit_s=1)
    _error(ValueError, "are for a mesh of shape (2,), found (1,)", lambda: autopar.compile(
        _gpt(), mesh, (TOKENS,), loss_fn=lm_loss, optimizer=adamw, plan=other), "re-plan for this mesh")


def test_a_plan_for_another_model(mesh, dp_plan):
    mlp = WideMLP(dim=16, hidden=32, n_layers=1)
    _error(ValueError, "expected the plan of this model", lambda: autopar.compile(
        mlp, mesh, (torch.randn(4, 16),), loss_fn=F.mse_loss, optimizer=adamw, plan=dp_plan), "Re-plan for this model")


# --- a step's inputs ----------------------------------------------------------------------

def test_no_target_for_a_loss_that_takes_one(compiled):
    remedy = "pass it as train_step(inputs, target)"
    _error(ValueError, "expected a target for loss_fn(logits, target); found target None",
           lambda: compiled.train_step((TOKENS,), None), remedy)
    compiled.train_step((TOKENS,), TARGET)  # the loss laid out for a target: None is still refused by name
    _error(ValueError, "found target None", lambda: compiled.train_step((TOKENS,), None), remedy)


@pytest.mark.parametrize("bad", [VOCAB, 600, -1])
def test_token_ids_out_of_range(compiled, bad):
    tokens = TOKENS.clone()
    tokens[1, 3] = bad
    with pytest.raises(IndexError):  # what one process does
        _gpt()(tokens)
    _error(ValueError, f"expected input 0 (token ids into an embedding of {VOCAB} rows) in [0, {VOCAB - 1}]",
           lambda: compiled.train_step((tokens,), TARGET), "fix the ids")


def test_a_wrong_dtype(compiled):
    _error(ValueError, "expected input 0 of dtype torch.int64", lambda: compiled.train_step((TOKENS.int(),), TARGET),
           "convert it (x.to(torch.int64))")


def test_an_extra_input(compiled):
    _error(ValueError, "expected 1 input(s), as in the example inputs; found 2",
           lambda: compiled(TOKENS, attention_mask=torch.ones(4, 8)), "compile with the new ones")


def test_a_model_input_given_to_train_step_as_a_keyword(compiled):
    _error(TypeError, "found keyword(s) ['attention_mask']",
           lambda: compiled.train_step((TOKENS,), TARGET, attention_mask=torch.ones(4, 8)), "inside the inputs tuple")


def test_an_extra_keyword_input():
    class Masked(torch.nn.Module):
        def forward(self, x, scale=None):
            return x * 2 if scale is None else x * scale

    x = torch.randn(2, 3)
    cap = capture(Masked(), (), {"x": x})
    _error(ValueError, "expected the keyword inputs ['x'], as in example_kwargs; found ['attention_mask', 'x']",
           lambda: cap.flatten_inputs((), {"x": x, "attention_mask": x}),
           "leave out attention_mask, or compile with attention_mask in example_kwargs")


# --- the loss function --------------------------------------------------------------------

def _loss_program(loss_fn, target=TARGET):
    outputs = [torch.empty(4, 8, VOCAB, device="meta")]
    one_tensor = pytree.tree_structure(outputs[0])  # the model returns the logits alone
    return lambda: build_loss_program(loss_fn, one_tensor, outputs, [()], target, None)


@pytest.mark.parametrize("loss_fn, found", [
    (lambda logits, target: 1.0, "found a Python float (1.0)"),
    (lambda logits, target: (lm_loss(logits, target), logits.mean()), "found 2 outputs"),
    (lambda logits, target: F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none"),
     "found a tensor of shape (32,)"),
])
def test_a_loss_that_is_not_one_scalar_tensor(loss_fn, found):
    _error(ValueError, "expected loss_fn to return one scalar loss tensor", _loss_program(loss_fn), found,
           "reduction='mean', or .mean()")


def test_an_error_in_the_loss_function_names_the_loss_and_the_users_line():
    def typo(logits, target):
        return F.cross_entropyy(logits, target)

    text = _error(CaptureError, "the loss function (loss_fn) raised AttributeError", _loss_program(typo),
                  "cross_entropyy", "test_bad_inputs.py", "fix it there")
    assert "traceable" not in text  # it is the user's error, not a tracing limit


def test_a_loss_that_takes_no_target_given_one():
    _error(ValueError, "expected loss_fn to take (outputs, target); found loss_fn(logits)",
           _loss_program(lambda logits: logits.mean()), "give it a second parameter")


# --- planning -----------------------------------------------------------------------------

@pytest.mark.parametrize("shape, remedy", [("8x8", "pass (8, 8)"), ("4", "pass (4,)"), ([2, "x"], "pass a tuple")])
def test_a_mesh_shape_that_is_not_a_tuple(shape, remedy):
    _error(ValueError, "expected a DeviceMesh or a mesh shape", lambda: autopar.plan(_gpt(), shape, (TOKENS,)),
           remedy)


@pytest.mark.parametrize("shape, pipelines", [((1, 2), False), ((2, 1), True)])
def test_no_plan_fits_names_pipelines_only_where_they_could_apply(shape, pipelines):
    mlp = WideMLP(dim=16, hidden=32, n_layers=2)
    text = _error(PlanningError, "no plan fits", lambda: autopar.plan(
        mlp, shape, (torch.randn(4, 16),), memory_limit=1e3, pipeline=False, time_limit_s=0.1), "a smaller batch")
    assert ("allow pipeline stages" in text) == pipelines, text
    assert "accumulated micro-batches (accumulate=k" in text, text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_cuda_mesh_without_cuda(mesh, dp_plan):
    """``init_device_mesh("cuda", ...)`` fails inside torch here (docs/troubleshooting.md); a
    mesh made without its backend reaches compile, which names the CPU mesh to build."""
    cuda = DeviceMesh("cuda", [0], _init_backend=False)
    _error(RuntimeError, "expected CUDA devices for a \"cuda\" DeviceMesh; found none", lambda: autopar.compile(
        _gpt(), cuda, (TOKENS,), loss_fn=lm_loss, optimizer=adamw, plan=dp_plan), 'init_device_mesh("cpu", (1,))')


def test_launch_on_two_ranks():
    """The cases that need ranks (``tests/distributed/bad_input_check.py``), one launch: each an
    ``autopar:`` error on the rank it concerns, naming what to do."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "tests.distributed.bad_input_check"], capture_output=True, text=True, timeout=600,
                          env=env)
    ranks = {}
    for piece in done.stdout.split("RESULT ")[1:]:  # the ranks' lines may land on one line: read each object
        r, _ = json.JSONDecoder().raw_decode(piece)
        ranks[r["rank"]] = r["messages"]
    assert done.returncode == 0 and set(ranks) == {0, 1}, done.stdout[-3000:] + done.stderr[-3000:]
    for rank, messages in ranks.items():
        assert messages["embedding"].endswith("[vocab_parallel_embedding]"), messages  # each rank half the rows
        for bad, found in ((VOCAB, f"from 0 to {VOCAB}"), (600, "from 0 to 600"), (-1, "from -1 to")):
            text = messages[f"token id {bad}"]
            assert text.startswith("ValueError: autopar: expected input 0 (token ids") and found in text, text
        assert messages["a step after the checks"] == "no error", messages
        text = messages["step after destroy_process_group"]
        assert text.startswith("RuntimeError: autopar: expected an initialised process group"), text
        assert "before destroying the process group" in text, text
    text = ranks[1]["rank outside the mesh"]
    assert text.startswith("ValueError: autopar: expected this process (rank 1 of 2) to be a rank of the DeviceMesh; "
                           "found a mesh of ranks [0]; call autopar.compile only on the mesh's ranks"), text


# --- what the tools print -----------------------------------------------------------------

def test_coverage_marks_the_layouts_that_do_not_fit_in_memory():
    with torch.device("meta"):
        model = WideMLP(dim=16384, hidden=65536, n_layers=4)  # 8.6e9 parameters: 128 GiB of state with AdamW
    found = coverage(model, (torch.empty(8, 16384, device="meta"),), mesh_shape=(2, 2), hardware="h100")
    table = found.table()
    assert set(found.fits()) < set(found.applies()), table
    assert "dp" not in found.fits() and "fsdp" in found.fits(), table
    dp = next(line for line in table.splitlines() if line.split()[:1] == ["dp"])
    assert f"DOES NOT FIT in {gib_text(found.capacity)}" in dp, table
    assert f"apply, {len(found.fits())} of them fit" in table


def test_explain_names_the_device_mesh_and_says_the_solver_in_words(dp_plan):
    plan = autopar.Plan.from_json(dp_plan.to_json())
    plan.solver.update(status="feasible", method="hint 6", gap=float("inf"))
    text = plan.explain()
    assert 'init_device_mesh("cuda", (1,), mesh_dim_names=("axis0",))' in text, text
    assert "gap" not in text and "inf%" not in text and "by hint" not in text, text
    assert "starting candidate 6" in text and "no bound was proven" in text, text
    assert " GB" not in text and ("GiB" in text or "MiB" in text), text


def test_diff_puts_the_summary_first_and_folds_identical_layers():
    a = autopar.plan(_gpt(layers=4), (2,), (TOKENS,), layout="dp", time_limit_s=1)
    b = autopar.Plan.from_json(a.to_json())
    changed = sorted(f for f in b.params if f.endswith("attn.q.weight"))
    assert len(changed) == 4, sorted(b.params)
    for fqn in changed:
        b.params[fqn] = "S(0)"
    b.predicted.step_time *= 2
    lines = a.diff(b).splitlines()
    assert lines[0].startswith("predicted step") and "(2.000x)" in lines[0], lines
    assert "4 of " in lines[1] and "parameters placed differently" in lines[1], lines
    folded = [line for line in lines if line.startswith("param ")]
    assert folded == [f"param {changed[0]}: R -> S(0) (and the same in 3 more layers: 1-3)"], lines


def test_a_step_after_destroy_process_group_is_refused(compiled):
    """Last of the tests on the module's group: it destroys it."""
    dist.destroy_process_group()
    _error(RuntimeError, "expected an initialised process group to train or run on; found none",
           lambda: compiled.train_step((TOKENS,), TARGET), "call the compiled module before destroying")
