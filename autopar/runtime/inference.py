"""InferenceModule: one rank's share of a causal LM served by a plan.

A serving plan (``Plan.inference``) lays out two programs of the model over one layout of
its weights and key-value cache (``autopar.passes.generation``): the prefill, run once per
batch of prompts, and the decode step, run once per generated token. This rank holds its
shard of every weight (in the model's dtype, nothing for training) and of the cache, both
captured once at the planned batch, prompt length and cache length: a generation never
captures again, whatever its prompts' lengths or its number of rows (up to the planned
ones). Prompts are left-padded to the planned length as Hugging Face pads them, rows
beyond the given ones are padding the outputs drop. Every rank gets the whole logits and
so picks the same tokens; sampling draws from a generator every rank seeds alike.

Under a pipeline with several micro-batches (a throughput plan: one per stage) the
programs are captured at one micro-batch and each stage holds the cache of every
micro-batch, each a slice of rows of one tensor. A stage runs micro-batch ``j``'s step
``t`` as soon as it has its input (``_launch``: receive, compute, send on without waiting),
so every stage works on a different micro-batch at once; the last stage's logits reach the
others (``_collect``) just before they need them: the last stage broadcasts each as it
finishes it, the others take it before launching that micro-batch's next step. Every rank
meets the broadcasts in the same order, (step, micro-batch).

On a GPU the decode step is replayed as a CUDA graph (``autopar.runtime.cuda_graphs``): run
eagerly, its few hundred small kernels per token wait on the host. ``cuda_graphs = False``
runs it eagerly; a pipeline's stages run eagerly (their sends and receives lie outside the
step, between ranks that reach a step at different times). The prefill runs eagerly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._guards import detect_fake_mode
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from autopar.runtime.batch import Cut, DataParallel, IndexBounds
from autopar.runtime.contract import CompiledModule, Held
from autopar.runtime.cuda_graphs import GraphedStep
from autopar.runtime.draws import agreed_seed
from autopar.runtime.meshes import mesh_device, whole
from autopar.runtime.relay import Relay
from autopar.runtime.stages import stage_parts
from autopar.passes.capture import Captured, on_device
from autopar.passes.generation import (Inference, capture_programs, capture_prompt_logits, is_cache, state_name,
                                       step_inputs)
from autopar.passes.lowering.codegen import RankProgram, lower
from autopar.passes.placements import Spec, local_slice
from autopar.passes.plan import Plan
from autopar.passes.planner.relayout import relayout, relayout_stages
from autopar.passes.strategy_graph import build_strategy_graph


@dataclass
class Step:
    """One program laid out on this rank (under a pipeline: this rank's stage of it): its
    capture and program, the order it takes its values in, this rank's cut of each input it
    reads, the constants export lifted (this rank's shards), what it receives from the stage
    before (name, local shape, dtype), and where its logits are among its outputs (None: it
    sends its outputs on to the next stage)."""

    captured: Captured
    program: RankProgram
    order: list[str]
    cuts: dict[str, Cut]
    constants: dict[str, torch.Tensor]
    received: list[tuple[str, tuple[int, ...], torch.dtype]]
    logits: int | None


class InferenceModule(CompiledModule):
    def __init__(self, model: nn.Module, plan: Plan, mesh: DeviceMesh):
        super().__init__()
        if plan.inference is None:
            raise ValueError("autopar: InferenceModule expected a serving plan (autopar.plan(..., inference=...)); "
                             "found a training plan; plan with inference=autopar.Inference(...)")
        if tuple(mesh.shape) != tuple(plan.mesh_shape):
            raise ValueError(f"autopar: the serving plan is for a mesh of shape {plan.mesh_shape}, found "
                             f"{tuple(mesh.shape)}; re-plan for this mesh, or run on the mesh the plan was made for")
        self.plan, self.mesh = plan, mesh
        self.workload = Inference.of(plan.inference)
        self.device = mesh_device(mesh)
        self.place = Relay.of(mesh, plan)
        work = self.workload
        self.micro_batches = plan.pipeline.micro_batches if plan.pipeline is not None else 1
        if work.batch % self.micro_batches:
            raise ValueError(f"autopar: the serving plan runs {self.micro_batches} micro-batches of its batch of "
                             f"{work.batch}; expected a batch they divide; re-plan")
        self.rows = work.batch // self.micro_batches  # sequences per micro-batch
        programs = capture_programs(model, self.rows, work.prompt_len, work.max_len)
        self.state: dict[str, torch.Tensor] = {}  # qualified name (CachedStep's) -> this rank's shard
        self.specs: dict[str, Spec] = {}
        sources = _state_sources(model)
        self._parameters = set(programs.prefill.params.values())
        # ids out of the vocabulary: one process raises, a vocabulary split over ranks would give zero rows
        self._ids = (programs.prefill.user_inputs[0], IndexBounds.of(programs.prefill))
        self.prefill = self._lay_out(programs.prefill, None, sources)
        self.decode = self._lay_out(programs.decode, "decode", sources)
        self._model = (model,)  # for the prefill of every position's logits (``forward``); a tuple: not a submodule
        self._generator: torch.Generator | None = None  # seeded alike on every rank at first use
        self._sending: list = []  # (handle, tensor) of the sends not yet completed
        # the decode step as a CUDA graph per micro-batch (the module docstring), recorded at first use
        self.cuda_graphs = self.device.type == "cuda" and self.place.stages == 1 and detect_fake_mode() is None
        self._graphed: dict[int, GraphedStep] = {}

    # --- laying out -----------------------------------------------------------------
    def _lay_out(self, captured: Captured, program: str | None, sources: dict[str, torch.Tensor]) -> Step:
        """The program as the plan lays it out (``relayout``), this rank's stage of it under a pipeline."""
        place = self.place
        graph = build_strategy_graph(on_device(captured, self.device), place.shape)
        choice = relayout(graph, self.plan, program=program).choice
        if program is None:  # the batch's split, for data_parallel
            ids = next(n for n in graph.nodes if n.name == captured.user_inputs[0])
            self._ids_spec = graph.nodes[ids].strategies[choice[ids]].output
        part = None
        if self.plan.pipeline is not None:
            part = stage_parts(captured, relayout_stages(captured, self.plan), place.stages, shared_state=True)[place.stage]
        laid = lower(graph, choice, place.grid, part=part)
        order = [n.name for n in part.inputs] if part is not None else list(captured.placeholders)
        metas = {n.name: n.meta["val"] for n in captured.nodes() if "val" in n.meta}
        state = {**captured.params, **captured.buffers}
        for ph in order:
            if ph in state:
                self._hold(state[ph], tuple(metas[ph].shape), laid.input_specs.get(ph), sources)
        cuts = {name: Cut.of(tuple(metas[name].shape), laid.input_specs.get(name) or (), place.shape, place.coord)
                for name in captured.user_inputs if name in order}
        constants = {name: (value if laid.input_specs.get(name) is None
                            else local_slice(value, laid.input_specs[name], place.shape, place.coord)).to(self.device)
                     for name, value in captured.constant_values.items() if name in order}
        received = [(name, place.local(tuple(metas[name].shape), laid.input_specs.get(name)), metas[name].dtype)
                    for name in order if name not in state and name not in cuts and name not in constants]
        last = place.stage == place.stages - 1
        return Step(captured, laid, order, cuts, constants, received, captured.user_outputs[0] if last else None)

    def _hold(self, fqn: str, shape: tuple[int, ...], spec: Spec | None, sources: dict[str, torch.Tensor]) -> None:
        """This rank's shard of state tensor ``fqn`` (made once; a second program must hold it alike)."""
        if fqn in self.state:
            if self.specs[fqn] != spec:
                raise ValueError(f"autopar: the serving plan's programs hold {fqn} in two layouts "
                                 f"({self.specs[fqn]} and {spec}); expected one; re-plan")
            return
        place = self.place
        if is_cache(fqn):  # zeros, made as this rank's shard (the whole cache is never held), one per micro-batch
            dtype = next(t.dtype for name, t in sources.items() if t.is_floating_point())
            local = place.local(shape, spec)
            value = torch.zeros((local[0] * self.micro_batches, *local[1:]), dtype=dtype, device=self.device)
        else:
            whole_value = sources[state_name(fqn)]
            if whole_value.device.type == "meta":  # no weights to take: a dry run's fake tensors, else an error
                if detect_fake_mode() is None:
                    raise ValueError(
                        f"autopar: {state_name(fqn)} is on the meta device: the model has no weights to serve; load "
                        "them (e.g. from_pretrained, or model.to_empty() and a checkpoint) before autopar.compile")
                value = torch.empty(place.local(shape, spec), dtype=whole_value.dtype, device=self.device)
            else:
                whole_value = whole_value.detach()
                value = (whole_value if spec is None else local_slice(whole_value, spec, place.shape, place.coord))
                value = value.to(self.device, copy=True)
        self.state[fqn], self.specs[fqn] = value, spec

    # --- running -------------------------------------------------------------------
    @torch.no_grad()
    def _run(self, step: Step, inputs: tuple[torch.Tensor, ...], micro_batch: int = 0) -> torch.Tensor:
        """The step's logits of one micro-batch, whole on every rank; its cache shards written in place."""
        return self._collect(step, self._launch(step, inputs, micro_batch))

    @torch.no_grad()
    def _launch(self, step: Step, inputs: tuple[torch.Tensor, ...], micro_batch: int = 0) -> torch.Tensor | None:
        """Run this rank's part of ``step`` on ``micro_batch`` (``inputs``: its rows): under a
        pipeline, receive from the stage before and send on without waiting for the send.
        The logits where this rank computes them (the last stage), else None."""
        captured, place = step.captured, self.place
        values = {ph: self._state(fqn, micro_batch) for ph, fqn in {**captured.params, **captured.buffers}.items()
                  if ph in step.order}
        values.update(step.constants)
        for name, x in zip(captured.user_inputs, inputs):
            if name in step.cuts:
                values[name] = step.cuts[name].take(x.to(self.device))
        for name, shape, dtype in step.received:
            values[name] = place.receive(shape, dtype, self.device)
        outs = self._program(step, micro_batch)(*[values[n] for n in step.order])
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        if step.logits is None:
            self._sending = [(w, t) for w, t in self._sending if w is not None and not w.is_completed()]
            for t in outs:
                t = t.contiguous()
                self._sending.append((place.send(t), t))  # t kept until its send completes
            return None
        spec = step.program.output_specs[step.logits]
        return outs[step.logits] if spec is None else whole(outs[step.logits], spec, self.place.grid)

    def _program(self, step: Step, micro_batch: int):
        """What runs ``step`` on this rank: the decode step's CUDA graph where graphs are used, else its program."""
        if step is not self.decode or not self.cuda_graphs:
            return step.program.gm
        if micro_batch not in self._graphed:
            fixed = [name not in step.cuts and all(name != r[0] for r in step.received) for name in step.order]
            self._graphed[micro_batch] = GraphedStep(step.program.gm, fixed, "the decode step")
        return self._graphed[micro_batch]

    def _collect(self, step: Step, logits: torch.Tensor | None) -> torch.Tensor:
        """A launched step's logits on every rank: the last stage's, broadcast along the pipeline."""
        if self.place.stages == 1:
            return logits
        meta = next(iter(step.captured.nodes("output"))).args[0]
        meta = pytree.tree_leaves(meta)[step.captured.user_outputs[0]].meta["val"]
        return self.place.from_last(logits, tuple(meta.shape), meta.dtype, self.device)

    def _state(self, fqn: str, micro_batch: int) -> torch.Tensor:
        """State tensor ``fqn`` as a step of ``micro_batch`` reads it (its rows of the cache)."""
        value = self.state[fqn]
        if not is_cache(fqn) or self.micro_batches == 1:
            return value
        rows = value.shape[0] // self.micro_batches
        return value[micro_batch * rows:(micro_batch + 1) * rows]

    def _padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts left-padded to the planned batch and prompt length: (ids, mask)."""
        work = self.workload
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
            raise ValueError(f"autopar: expected input_ids of shape (batch, length) and an integer dtype; found "
                             f"{tuple(input_ids.shape)} {input_ids.dtype}")
        rows, length = input_ids.shape
        self._ids[1].check(0, self._ids[0], input_ids)
        if rows > work.batch or length > work.prompt_len:
            raise ValueError(
                f"autopar: this serving plan takes up to {work.batch} prompts of up to {work.prompt_len} tokens; found "
                f"{rows} of {length}; split the batch, or plan for it (autopar.Inference(batch=, prompt_len=))")
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(torch.long)
        if mask.shape != input_ids.shape:
            raise ValueError(f"autopar: expected attention_mask of the shape of input_ids {tuple(input_ids.shape)}; "
                             f"found {tuple(mask.shape)}")
        ids = torch.zeros((work.batch, work.prompt_len), dtype=torch.long)
        padded = torch.zeros((work.batch, work.prompt_len), dtype=torch.long)
        ids[:rows, work.prompt_len - length:] = input_ids.cpu()
        padded[:rows, work.prompt_len - length:] = mask.cpu()
        padded[rows:, -1] = 1  # rows beyond the given ones: one token each, their outputs dropped
        return ids, padded

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The logits of ``input_ids`` (up to the planned batch and prompt length; shorter
        rows left-padded by ``attention_mask``'s zeros), whole on every rank: the prefill."""
        rows, length = input_ids.shape[:2]
        ids, mask = self._padded(input_ids, attention_mask)
        first = step_inputs(ids, mask, self.workload.max_len)
        stream = _Stream(self)
        for j in range(self.micro_batches):
            stream.launch(self.prompt_logits, self._rows_of(first, j), j)
        logits = torch.cat([stream.collect() for _ in range(self.micro_batches)])
        stream.finish()
        return logits[:rows, self.workload.prompt_len - length:]

    @functools.cached_property
    def prompt_logits(self) -> Step:
        """The prefill returning every prompt position's logits, laid out by the plan as the
        prefill is (only its last layer's output differs): captured at the first ``forward``."""
        work = self.workload
        model = self._model[0]
        captured = capture_prompt_logits(model, self.rows, work.prompt_len, work.max_len)
        return self._lay_out(captured, None, _state_sources(model))

    def _rows_of(self, inputs: tuple[torch.Tensor, ...], micro_batch: int) -> tuple[torch.Tensor, ...]:
        """A step's inputs for one micro-batch: its rows of each per-sequence input."""
        if self.micro_batches == 1:
            return inputs
        rows = slice(micro_batch * self.rows, (micro_batch + 1) * self.rows)
        return tuple(x[rows] if x.dim() else x for x in inputs)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int | None = None, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, eos_token_id: int | None = None, pad_token_id: int | None = None,
                 seed: int | None = None) -> torch.Tensor:
        """Hugging Face's ``generate`` on left-padded prompts: ``input_ids`` followed by up to
        ``max_new_tokens`` tokens (default: as many as the cache holds), greedy unless
        ``do_sample`` (``temperature``, ``top_k``; ``seed`` reseeds the generator every rank
        shares). A row that emits ``eos_token_id`` is continued with ``pad_token_id`` (default
        the eos token), and generation stops once every row has. Under a pipeline with
        several micro-batches each runs its next step as soon as its token is picked (the
        module docstring)."""
        work = self.workload
        room = work.max_len - work.prompt_len
        steps = room if max_new_tokens is None else max_new_tokens
        if not isinstance(steps, int) or not 1 <= steps <= room:
            raise ValueError(f"autopar: expected max_new_tokens from 1 to {room} (the planned max_len {work.max_len} "
                             f"minus prompt_len {work.prompt_len}); found {max_new_tokens!r}; plan a longer max_len")
        if do_sample and not temperature > 0:
            raise ValueError(f"autopar: expected a positive temperature for sampling; found {temperature}")
        if seed is not None:
            self.generator.manual_seed(seed)
        rows = input_ids.shape[0]
        ids, mask = self._padded(input_ids, attention_mask)
        first = step_inputs(ids, mask, work.max_len)
        slots, positions = first[1], first[2][:, -1:]
        pad = eos_token_id if pad_token_id is None else pad_token_id
        done = torch.zeros(work.batch, dtype=torch.bool)
        tokens = torch.zeros((steps, work.batch), dtype=torch.long)
        stream, m = _Stream(self), self.micro_batches
        for j in range(m):
            stream.launch(self.prefill, self._rows_of(first, j), j)
        taken = steps
        for t in range(steps):  # token t of every micro-batch, from its step t; then its step t + 1
            for j in range(m):
                mine = slice(j * self.rows, (j + 1) * self.rows)
                token = self._pick(stream.collect()[:, -1].cpu(), do_sample, temperature, top_k)
                if eos_token_id is not None:
                    token = torch.where(done[mine], torch.full_like(token, pad), token)
                    done[mine] |= token == eos_token_id
                tokens[t, mine] = token
                if eos_token_id is not None and bool(done[:rows].all()):  # every rank sees the same logits
                    tokens[t, (j + 1) * self.rows:] = pad
                    taken = t + 1
                    break
                if t < steps - 1:
                    offset = torch.tensor(work.prompt_len + t, dtype=torch.long)
                    inputs = (token[:, None], slots[mine], positions[mine] + t + 1, offset)
                    stream.launch(self.decode, inputs, j)
            if taken < steps:
                break
        stream.finish()
        return torch.cat([input_ids.cpu(), tokens[:taken].T[:rows]], dim=1)

    @property
    def generator(self) -> torch.Generator:
        """The sampling generator, seeded alike on every rank (rank 0's seed, broadcast at first
        use: every rank samples in the same calls)."""
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(agreed_seed(self.device))
        return self._generator

    def _pick(self, logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int | None) -> torch.Tensor:
        if not do_sample:
            return logits.argmax(dim=-1)
        scores = logits.to(torch.float64) / temperature
        if top_k is not None:
            kth = torch.topk(scores, min(top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=self.generator)[:, 0]

    # --- state ---------------------------------------------------------------------
    @functools.cached_property
    def data_parallel(self) -> DataParallel:
        """How the plan splits the batch of sequences (the prefill's token ids' placement on
        the intra-op mesh; a pipeline's stages share it)."""
        spec = self._ids_spec
        return DataParallel.of([spec] if spec is not None else [], self.place.shape, self.place.coord)

    @property
    def pipeline_rank(self) -> int:
        return self.place.stage

    def held_parameters(self) -> dict[str, Held]:
        return {state_name(fqn): (t, self.specs[fqn], self.place.grid) for fqn, t in self.state.items()
                if fqn in self._parameters}

    def held_buffers(self) -> dict[str, Held]:
        return {state_name(fqn): (t, self.specs[fqn], self.place.grid) for fqn, t in self.state.items()
                if fqn not in self._parameters}

    def state_tensors(self) -> list[torch.Tensor]:
        return list(self.state.values())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights and buffers whole, by its own names, on every rank (collectives
        over the intra-op mesh, then along the pipeline)."""
        grid = self.place.grid
        mine = {state_name(fqn): whole(t, self.specs[fqn], grid) if self.specs[fqn] is not None else t
                for fqn, t in self.state.items() if not is_cache(fqn)}
        if self.place.stages == 1:
            return mine
        every: list[dict] = [None] * self.place.stages
        dist.all_gather_object(every, {k: v.cpu() for k, v in mine.items()}, group=self.place.group)
        return {k: v for d in every for k, v in d.items()}

    def memory(self) -> dict[str, int]:
        """This rank's bytes by kind: the weights and buffers it holds, and its cache shard."""
        held = {"parameters": 0, "kv_cache": 0}
        for fqn, t in self.state.items():
            held["kv_cache" if is_cache(fqn) else "parameters"] += t.numel() * t.element_size()
        return held


def _state_sources(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by name: where the held shards are cut from."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


class _Stream:
    """The steps a rank has launched and not yet collected, in launch order (the module
    docstring): the last stage collects each at once (it broadcasts the logits it just
    computed), the others when the logits are next needed, so that every rank meets the
    broadcasts in the same order."""

    def __init__(self, module: InferenceModule):
        self.module = module
        self.last = module.place.stage == module.place.stages - 1
        self.ready: list[torch.Tensor] = []
        self.waiting: list[Step] = []

    def launch(self, step: Step, inputs: tuple[torch.Tensor, ...], micro_batch: int) -> None:
        logits = self.module._launch(step, inputs, micro_batch)
        if self.last:
            self.ready.append(self.module._collect(step, logits))
        else:
            self.waiting.append(step)

    def collect(self) -> torch.Tensor:
        """The logits of the oldest launched step not yet collected."""
        if self.last:
            return self.ready.pop(0)
        return self.module._collect(self.waiting.pop(0), None)

    def finish(self) -> None:
        """Collect what is left (a generation stopped early) and wait for this rank's sends."""
        while self.ready or self.waiting:
            self.collect()
        for work, _ in self.module._sending:
            if work is not None:
                work.wait()
        self.module._sending = []
