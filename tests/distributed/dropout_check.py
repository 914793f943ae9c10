"""Cases run under torchrun by train_check (``dropout:<case>``): a GPT with dropout 0.1
(residual and attention weights), each rank seeded ``SEED + rank``, trained compiled for a
few AdamW steps in float64, against one process seeded ``SEED`` (rank 0's seed, the one
the module agrees on).

The one-process reference draws as the compiled module does (``autopar.passes.randomness``):
each micro-batch is a run of the stream, each dropout (``F.dropout`` or attention's
``dropout_p``) the next op of it. So every layout, rank count and recomputation must give
the reference's losses and parameters. A pipeline (or ``accumulate=k``) runs m
micro-batches per step, each drawing as its own run: its reference accumulates over the
same micro-batches (dropout's masks depend on the micro-batching, as in any run).

    torchrun --standalone --nproc_per_node 4 -m tests.distributed.train_check dropout:2x2:tp+dp dropout:2x2:pp:tp:recompute

(tests/test_train_distributed.py runs these cases inside its train_check launches).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.ops import aten
from torch.overrides import TorchFunctionMode

import autopar
from autopar.models import GPT, GPTConfig
from autopar.passes import randomness
from autopar.passes.lowering.recompute import Recomputed
from autopar.passes.op_strategies import OpInfo, ShardingStrategy, TensorMeta
from autopar.passes.rules.attention import keyed_attention
from autopar.passes.rules.registry import LocalContext
from tests.distributed.plans import pipeline_plan, planned

SEED, STEPS, DROPOUT = 1234, 4, 0.1
DTYPE = torch.float64


class OneProcessDraws(TorchFunctionMode):
    """The eager model's dropouts drawn as a compiled module draws them: the k-th dropout
    call of a forward is the k-th random op of the captured graph."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout and kwargs.get("training", args[2] if len(args) > 2 else True):
            x, p = args[0], kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            with randomness.op(self._next()):
                return randomness.dropout(x, p, tuple(x.shape), (), (), ())
        if func is F.scaled_dot_product_attention and kwargs.get("dropout_p", 0.0) > 0:
            q, k, v = args
            info = OpInfo(aten.scaled_dot_product_attention.default,
                          tuple(TensorMeta.of(t) for t in (q, k, v)), {}, (TensorMeta.of(q),))
            whole = ShardingStrategy(((), (), ()), ((),))
            with randomness.op(self._next()):
                return keyed_attention(info, whole, (q, k, v), kwargs, LocalContext((), ()))
        return func(*args, **kwargs)

    def _next(self) -> int:
        self.calls += 1
        return self.calls - 1


def model_and_batches(dropout: float = DROPOUT):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=8, dim=32, n_heads=4, n_layers=2, dropout=dropout)).to(DTYPE)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 64, (8, 8), generator=gen), torch.randint(0, 64, (8, 8), generator=gen))
               for _ in range(STEPS)]
    return model, batches


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def reference_run(model, batches, micro_batches: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process under ``SEED``: each step's micro-batches drawn as consecutive runs."""
    opt = adamw(list(model.parameters()))
    count, losses = 0, []
    for tokens, target in batches:
        opt.zero_grad()
        total = 0.0
        for x, y in zip(tokens.chunk(micro_batches), target.chunk(micro_batches)):
            with randomness.drawing(randomness.run_key(SEED, count)), OneProcessDraws():
                loss = lm_loss(model(x), y) / micro_batches
            loss.backward()
            total += loss.item()
            count += 1
        opt.step()
        losses.append(total)
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def compiled(spec: str, model, tokens):
    """<mesh>:<layout> (autopar.layouts) or <mesh>:pp[:<intra layout>] (2 stages over axis 0, 2
    micro-batches, GPipe), then ``:recompute`` for every layer recomputed in backward."""
    mesh_text, layout, *rest = spec.split(":")
    recompute = rest[-1:] == ["recompute"]
    rest = rest[:-1] if recompute else rest
    mesh_shape = tuple(int(x) for x in mesh_text.split("x"))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=tuple(f"a{i}" for i in range(len(mesh_shape))))
    if layout == "pp":
        plan = copy.deepcopy(pipeline_plan(model, tokens, mesh_shape, "GPipe", 2, 1, *rest))
    else:
        plan = planned(model, mesh, tokens, layout)
    if recompute:
        plan.recompute = ["layer 0", "layer 1"]
    torch.manual_seed(SEED + dist.get_rank())  # each rank seeded otherwise: masks must not depend on it
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=lm_loss, optimizer=adamw, plan=plan)
    programs = [p.gm for p in pm.programs] if layout == "pp" else [pm.gm]
    recomputed = sum(isinstance(m, Recomputed) for gm in programs for m in gm.modules())
    return pm, (plan.pipeline.micro_batches if layout == "pp" else 1), (plan.recompute, recomputed)


def run_case(spec: str) -> dict:
    model, batches = model_and_batches()
    reference, no_dropout = copy.deepcopy(model), model_and_batches(dropout=0.0)[0]
    pm, micro_batches, (recompute, recomputed_here) = compiled(spec, model, batches[0][0])
    losses = [pm.train_step((x,), y).item() for x, y in batches]
    ref_losses, ref_params = reference_run(reference, batches, micro_batches)
    plain_losses, _ = reference_run(no_dropout, batches, micro_batches)
    full = pm.full_parameters()
    return {
        "case": spec,
        "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "param_err": max((full[n] - p).abs().max().item() for n, p in ref_params.items()),
        # how far dropout moves the losses: the check above is not met by a model without it
        "dropout_effect": max(abs(a - b) for a, b in zip(ref_losses, plain_losses)),
        "draws": pm.draws.count,
        # the layers the plan names, and how many run under checkpointing on this rank
        "recompute": recompute, "recomputed_here": recomputed_here,
    }
