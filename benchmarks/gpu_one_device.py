"""One GPU, measured: the profiler's GPU sweep, then a training step and a generation, each
checked against the same model in plain PyTorch and timed against the plan's prediction.

    python -m benchmarks.gpu_one_device [--out DIR] [--quick]

One process, a mesh of one device (nccl on a GPU, gloo on a CPU), so what is measured is the
device alone: the profile's fitted rates against the datasheet, the compiled step's losses and
parameters against ``torch.optim.AdamW`` on the same device (fp32, then bf16 compute with fp32
masters), greedy tokens against ``model.generate``, and the measured step time, time to first
token and time per output token against ``Plan.predicted`` for the profile just measured.
The tables go to ``<out>/gpu_one_device_<device>_<yyyymmdd>.md`` (``benchmarks.results_file``), the
profile's JSON beside them. Each part reports its own failure and the run goes on.
"""

from __future__ import annotations

import argparse
import copy
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
TF = 1e12


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
    batch, prompt, new = 8, 128, 32 if quick else 64
    lines = ["| Llama (float32) | greedy tokens equal | predicted TTFT | measured TTFT | TTFT measured / predicted | "
             "predicted TPOT | measured TPOT | TPOT measured / predicted | compiled / HF generate (whole) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for config in serve_sizes(quick):
        torch.manual_seed(0)
        model = MODELS["llama"].build(config, config["max_position_embeddings"]).eval()
        ids = torch.randint(0, config["vocab_size"], (batch, prompt), generator=torch.Generator().manual_seed(1))
        reference = copy.deepcopy(model).to(device)
        ids = ids.to(device)

        def hf(tokens: int = new):
            with torch.no_grad():
                return reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                          do_sample=False, pad_token_id=0)

        want = hf()
        work = autopar.Inference(batch=batch, prompt_len=prompt, max_len=prompt + new)
        pm = autopar.compile(model, mesh, inference=work, hardware=profile)
        same = torch.equal(pm.generate(ids, max_new_tokens=new).to(device), want)
        whole = median_time(lambda: pm.generate(ids, max_new_tokens=new), device, 3)
        first = median_time(lambda: pm.generate(ids, max_new_tokens=1), device, 3)
        ref_whole = median_time(hf, device, 3)
        per_token = (whole - first) / (new - 1)
        p = pm.plan.predicted
        size = (f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, batch {batch}, "
                f"prompt {prompt}, {new} new")
        lines.append(f"| {size} | {'yes' if same else 'NO'} | {p.time_to_first_token * MS:.2f} ms | "
                     f"{first * MS:.2f} ms | {first / p.time_to_first_token:.2f} | "
                     f"{p.time_per_output_token * MS:.3f} ms | {per_token * MS:.3f} ms | "
                     f"{per_token / p.time_per_output_token:.2f} | {whole / ref_whole:.2f} |")
        pm = reference = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return lines + ["", "TTFT: `generate(max_new_tokens=1)`; TPOT: (whole generation - TTFT) / (new tokens - 1); "
                        "medians of 3 after a warm-up."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(parser)
    parser.add_argument("--quick", action="store_true", help="small sizes (a CPU check of the script)")
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
    for title, part in (("Profile", lambda: profile_part(mesh, out, args.quick, cuda)),
                        ("Training step", lambda: train_part(profile, mesh, device, args.quick)),
                        ("Generation", lambda: serve_part(profile, mesh, device, args.quick))):
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
