"""One GPU, measured: the profiler's GPU sweep, then a training step and a generation, each
checked against the same model in plain PyTorch and timed against the plan's prediction.

    python -m benchmarks.gpu_one_device [--out DIR] [--quick] [--parts profile train serve kernels overhead]

One process, a mesh of one device (nccl on a GPU, gloo on a CPU), so what is measured is the
device alone: the profile's fitted rates against the datasheet, the compiled step's losses and
parameters against ``torch.optim.AdamW`` on the same device (fp32, then bf16 compute with fp32
masters), greedy tokens against ``model.generate`` (the decode step eager and as a CUDA graph), and the
measured step time, time to first token and time per output token against ``Plan.predicted``
for the profile just measured; then where a decode step's GPU time goes, by ATen op, and what
one small op costs eagerly and in a CUDA graph.
The tables go to ``<out>/gpu_one_device_<device>_<yyyymmdd>.md`` (``benchmarks.results_file``), the
profile's JSON beside them. Each part reports its own failure and the run goes on.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.models import GPT, GPTConfig, MODELS
from autopar.costmodels.presets import preset
from autopar.costmodels.profiler import Sweep, measure_profile
from benchmarks.results_file import add_out_argument, write_results

MS = 1e3
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
TF = 1e12
PARTS_BY_TITLE = {"Profile": "profile", "Training step": "train", "Generation": "serve",
                  "Decode step by op": "kernels", "Per-op overhead": "overhead"}
PARTS = tuple(PARTS_BY_TITLE.values())


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def synced(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def reference_step(model, optimizer, tokens, target, policy) -> float:
    """One AdamW step of the one-device model, as FSDP2's policy runs it: forward and backward
    in ``param_dtype`` on a cast copy, gradients in ``reduce_dtype`` into the float32 masters."""
    work = model if policy is None else copy.deepcopy(model).to(policy.param_dtype)
    loss = lm_loss(work(tokens), target)
    optimizer.zero_grad()
    loss.backward()
    if policy is not None:
        for master, cast in zip(model.parameters(), work.parameters()):
            master.grad = cast.grad.to(policy.reduce_dtype).to(master.dtype)
    optimizer.step()
    return float(loss)


def median_time(run, device: torch.device, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = synced(device)
        run()
        times.append(synced(device) - start)
    return statistics.median(times)


def profile_part(mesh, out: Path, quick: bool, cuda: bool) -> tuple[object, list[str]]:
    sweep = Sweep.quick() if quick or not cuda else Sweep.gpu()
    start = time.perf_counter()
    profile = measure_profile(mesh, sweep, progress=False)
    profile.save(out / "profile.json")
    return profile, [f"Measured in {time.perf_counter() - start:.0f} s (`Sweep.gpu()` on a GPU), "
                     f"saved as `profile.json` beside this file.", ""] + profile_lines(profile)


def profile_lines(profile) -> list[str]:
    """The profile's fitted rates beside the ``h100`` preset's (the H200 is the H100's chip with
    more and faster memory, so its matmul rates are the preset's to check)."""
    dev, h100 = profile.device, preset("h100", (1,)).device
    lines = [f"Device {dev.name}, {dev.memory_bytes / 2**30:.0f} GiB.", "",
             "| dtype | fitted matmul TFLOP/s | h100 preset's | fitted / preset |", "| --- | --- | --- | --- |"]
    for dtype, rate in dev.matmul.items():
        theirs = h100.matmul[dtype].rate
        lines.append(f"| {dtype} | {rate.rate / TF:.1f} | {theirs / TF:.1f} | {rate.rate / theirs:.2f} |")
    dtypes = sorted({d for kinds in dev.pointwise.values() for d in kinds})
    lines += ["", "| pointwise kind | " + " | ".join(f"{d} GB/s" for d in dtypes) + " |",
              "| --- |" + " --- |" * len(dtypes)]
    lines += [f"| {kind} | " + " | ".join(f"{rates[d].rate / 1e9:.0f}" if d in rates else "" for d in dtypes) + " |"
              for kind, rates in sorted(dev.pointwise.items())]
    return lines


def train_sizes(quick: bool) -> list[tuple[GPTConfig, int]]:
    if quick:
        return [(GPTConfig(vocab_size=512, max_seq_len=64, dim=128, n_heads=4, n_layers=2), 4)]
    return [(GPTConfig(vocab_size=8192, max_seq_len=512, dim=1024, n_heads=16, n_layers=8), 16),
            (GPTConfig(vocab_size=32000, max_seq_len=1024, dim=2048, n_heads=16, n_layers=16), 8)]


def train_part(profile, mesh, device: torch.device, quick: bool) -> list[str]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    lines = ["| GPT | precision | losses equal (3 AdamW steps: compiled/reference) | max param diff | predicted step | "
             "measured step | measured / predicted |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for cfg, batch in train_sizes(quick):
        torch.manual_seed(0)
        model = GPT(cfg)
        size = (f"{cfg.n_layers} layers, dim {cfg.dim}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M "
                f"parameters, {batch} x {cfg.max_seq_len} tokens")
        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), device=device)
        target = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), device=device)
        for name, policy in (("fp32", None), ("bf16 compute, fp32 masters", bf16)):
            reference = copy.deepcopy(model).to(device)
            ref_opt = adamw(reference.parameters())
            pm = autopar.compile(copy.deepcopy(model), mesh, (tokens,), loss_fn=lm_loss, optimizer=adamw,
                                 hardware=profile, mp_policy=policy)
            got, want = [], []
            for _ in range(3):
                got.append(float(pm.train_step((tokens,), target)))
                want.append(reference_step(reference, ref_opt, tokens, target, policy))
            tol = 1e-4 if policy is None else 1e-2
            equal = all(abs(a - b) <= tol * max(1.0, abs(b)) for a, b in zip(got, want))
            full = pm.full_state_dict()
            diff = max((full[k].to(device) - v).abs().max().item() for k, v in reference.state_dict().items())
            reference = ref_opt = full = None  # (the device's memory, before the next run)
            measured = median_time(lambda: pm.train_step((tokens,), target), device, 5 if quick else 10)
            predicted = pm.plan.predicted.step_time
            losses = ", ".join(f"{g:.4f}/{w:.4f}" for g, w in zip(got, want))
            lines.append(f"| {size} | {name} | {'yes' if equal else 'NO'} ({losses}) | {diff:.2e} | "
                         f"{predicted * MS:.1f} ms | {measured * MS:.1f} ms | {measured / predicted:.2f} |")
            pm = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return lines


def serve_sizes(quick: bool) -> list[dict]:
    small = dict(num_hidden_layers=2, hidden_size=512, intermediate_size=1408, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=8192, max_position_embeddings=512)
    if quick:
        return [small]
    return [dict(small, num_hidden_layers=8, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
                 num_key_value_heads=8),
            dict(small, num_hidden_layers=16, hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
                 num_key_value_heads=8, vocab_size=32000)]


def serve_part(profile, mesh, device: torch.device, quick: bool) -> list[str]:
    """Greedy generation against ``model.generate``, in float32 and bfloat16, its decode step
    run eagerly and replayed as a CUDA graph (``InferenceModule.cuda_graphs``), each timed
    against the prediction."""
    batch, prompt, new = 8, 128, 32 if quick else 64
    lines = ["| Llama | dtype | decode step run | ATen ops per decode step | greedy tokens as HF's | predicted TTFT | "
             "measured TTFT | TTFT measured / predicted | predicted TPOT | measured TPOT | "
             "TPOT measured / predicted | compiled / HF generate (whole) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for config, dtype in itertools.product(serve_sizes(quick), (torch.float32, torch.bfloat16)):
        model = llama_of(config, dtype)
        ids = torch.randint(0, config["vocab_size"], (batch, prompt), generator=torch.Generator().manual_seed(1))
        reference = copy.deepcopy(model).to(device)
        ids = ids.to(device)

        def hf(tokens: int = new):
            with torch.no_grad():
                return reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                          do_sample=False, pad_token_id=0)

        want = hf()[:, prompt:]
        ref_whole = median_time(hf, device, 3)
        work = autopar.Inference(batch=batch, prompt_len=prompt, max_len=prompt + new)
        pm = autopar.compile(model, mesh, inference=work, hardware=profile)
        ops = sum(1 for n in pm.decode.program.gm.graph.nodes if n.op == "call_function")
        p = pm.plan.predicted
        size = f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, batch {batch}, prompt {prompt}"
        graphs = [False, True] if device.type == "cuda" else [False]
        for graphed in graphs:
            pm.cuda_graphs = graphed
            got = pm.generate(ids, max_new_tokens=new).to(device)[:, prompt:]
            agree = (got == want).all(dim=0).long().cumprod(0).sum()  # leading tokens equal in every row
            whole = median_time(lambda: pm.generate(ids, max_new_tokens=new), device, 3)
            first = median_time(lambda: pm.generate(ids, max_new_tokens=1), device, 3)
            per_token = (whole - first) / (new - 1)
            lines.append(f"| {size} | {DTYPE_NAMES[dtype]} | {'CUDA graph' if graphed else 'eager'} | {ops} | "
                         f"{int(agree)} of {new} | {p.time_to_first_token * MS:.2f} ms | {first * MS:.2f} ms | "
                         f"{first / p.time_to_first_token:.2f} | {p.time_per_output_token * MS:.3f} ms | "
                         f"{per_token * MS:.3f} ms | {per_token / p.time_per_output_token:.2f} | "
                         f"{whole / ref_whole:.2f} |")
        pm = reference = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return lines + ["", "Greedy tokens as HF's: how many leading new tokens equal Hugging Face's `generate` in every "
                        "row (bfloat16 runs other kernels' rounding: a near tie may go the other way). TTFT: "
                        "`generate(max_new_tokens=1)`; TPOT: (whole generation - TTFT) / (new tokens - 1); medians of "
                        "3 after a warm-up; HF generate: the same model's `generate`, eager."]


def llama_of(config: dict, dtype: torch.dtype):
    torch.manual_seed(0)
    return MODELS["llama"].build(config, config["max_position_embeddings"]).eval().to(dtype)


def kernels_part(profile, mesh, device: torch.device, quick: bool) -> list[str]:
    """Where a decode step's GPU time goes: ``torch.profiler`` over a generation of 17 tokens
    and one of 1 (the prefill alone), the difference over 16 decode steps, by ATen op (the
    decode step eager: a graph's replay shows as one event)."""
    from torch.profiler import ProfilerActivity, profile as profiler

    batch, prompt, new = 8, 128, 17
    config = serve_sizes(quick)[-1]
    lines = []
    for dtype in (torch.float32, torch.bfloat16):
        ids = torch.randint(0, config["vocab_size"], (batch, prompt), generator=torch.Generator().manual_seed(1))
        ids = ids.to(device)
        work = autopar.Inference(batch=batch, prompt_len=prompt, max_len=prompt + new)
        pm = autopar.compile(llama_of(config, dtype), mesh, inference=work, hardware=profile)
        pm.cuda_graphs = False
        pm.generate(ids, max_new_tokens=new)  # warm-up

        def by_op(tokens: int) -> dict[str, tuple[float, int]]:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profiler(activities=activities) as prof:
                pm.generate(ids, max_new_tokens=tokens)
                synced(device)
            return {e.key: (e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total, e.count)
                    for e in prof.key_averages() if e.key.startswith("aten::")}  # ops, not their kernels again

        one, many = by_op(1), by_op(new)
        steps = new - 1
        rows = sorted(((k, (t - one.get(k, (0, 0))[0]) / steps, (c - one.get(k, (0, 0))[1]) / steps)
                       for k, (t, c) in many.items()), key=lambda r: -r[1])
        total = sum(t for _, t, _ in rows if t > 0)
        size = f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, batch {batch}"
        lines += [f"{size}, {DTYPE_NAMES[dtype]}: {total / 1e3:.3f} ms of {'GPU' if device.type == 'cuda' else 'CPU'} "
                  f"time per decode step (the profiler's self time of every ATen op); predicted TPOT "
                  f"{pm.plan.predicted.time_per_output_token * MS:.3f} ms.", "",
                  "| ATen op | calls per decode step | us per decode step | share |", "| --- | --- | --- | --- |"]
        lines += [f"| {key} | {calls:.0f} | {t:.1f} | {t / total:.1%} |" for key, t, calls in rows[:8] if t > 0]
        lines.append("")
        pm = None
    return lines


def overhead_part(device: torch.device, quick: bool) -> list[str]:
    """What one small op costs: queued eagerly (the host's time per op, the GPU left behind)
    and inside a CUDA graph (the GPU's time per kernel, no host in the loop)."""
    n = 200 if quick else 2000
    lines = ["| tensor elements | eager: host time per op | eager: time per op, waited for | "
             "CUDA graph replay: time per kernel |", "| --- | --- | --- | --- |"]
    for numel in (256, 1 << 20):
        x = torch.zeros(numel, device=device)
        for _ in range(n):  # warm-up
            x.add_(1.0)
        start = synced(device)
        for _ in range(n):
            x.add_(1.0)
        queued = time.perf_counter() - start
        done = synced(device) - start
        replay = "-"
        if device.type == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                x.add_(1.0)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(n):
                    x.add_(1.0)
            replay = f"{median_time(graph.replay, device, 5) / n * 1e6:.2f} us"
        lines.append(f"| {numel} | {queued / n * 1e6:.2f} us | {done / n * 1e6:.2f} us | {replay} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(parser)
    parser.add_argument("--quick", action="store_true", help="small sizes (a CPU check of the script)")
    parser.add_argument("--parts", nargs="*", default=list(PARTS), choices=list(PARTS),
                        help="which parts to run (the profile always runs: the others are priced on it)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tempfile.mkdtemp()}/store",
                            rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("d",))
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    lines: list[str] = []
    profile = "h100"  # stands in if the profile part fails
    parts = {"Profile": lambda: profile_part(mesh, out, args.quick, cuda),
             "Training step": lambda: train_part(profile, mesh, device, args.quick),
             "Generation": lambda: serve_part(profile, mesh, device, args.quick),
             "Decode step by op": lambda: kernels_part(profile, mesh, device, args.quick),
             "Per-op overhead": lambda: overhead_part(device, args.quick)}
    chosen = {"profile", *args.parts}
    for title, part in ((t, p) for t, p in parts.items() if PARTS_BY_TITLE[t] in chosen):
        start = time.perf_counter()
        lines += [f"## {title}", ""]
        try:
            result = part()
            if title == "Profile":
                profile, result = result
            lines += result
        except Exception:  # noqa: BLE001  (each part reports its own failure; the run goes on)
            lines += ["```", traceback.format_exc()[-3000:], "```"]
        lines += ["", f"({title}: {time.perf_counter() - start:.0f} s)", ""]
        print("\n".join(lines[-12:]), flush=True)
        write_results("gpu_one_device", name.split()[-1].lower(), f"One device measured: {name}", lines, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
