"""How well does the cost model predict this machine? Predict, then measure.

    python benchmarks/costmodel_accuracy.py                 # 2, 4 and 8 gloo ranks
    python benchmarks/costmodel_accuracy.py --ranks 2 4     # a subset

For each world size this launches ``torchrun`` on costmodel_worker.py, which measures
a fresh profile and then compares predictions with measurements of (1) each collective
at message sizes the fit did not use, (2) matmuls and pointwise ops of the benchmark
GPT's shapes, (3) a whole GPT training step under DP (DDP), TP (parallelize_module on
the MLPs) and ZeRO-3 (FSDP2). It prints markdown tables (fitted alpha/beta, every row,
and the median absolute error per category) and writes them, with the raw rows as
JSON, under results/ (gitignored).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"collective": 0.15, "op": 0.15, "step": 0.20}


def run_world(n: int, out: Path, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(n),
        str(REPO / "benchmarks" / "costmodel_worker.py"),
        "--out",
        str(out),
        "--steps",
        str(steps),
    ]
    t0 = time.time()
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        sys.stderr.write(run.stderr[-4000:])
        raise SystemExit(f"autopar: the {n}-rank benchmark run failed (exit {run.returncode}); see above.")
    data = json.loads(out.read_text())
    data["wall_s"] = time.time() - t0
    return data


def err(row: dict) -> float:
    return (row["predicted"] - row["measured"]) / row["measured"]


def fmt_s(x: float) -> str:
    return f"{x * 1e3:.3f} ms" if x >= 1e-3 else f"{x * 1e6:.1f} us"


def fit_table(results: list[dict]) -> list[str]:
    lines = ["| ranks | collective | alpha | beta (bus bandwidth) | fit |", "| --- | --- | --- | --- | --- |"]
    for data in results:
        for c, fit in data["profile"]["axes"][0]["collectives"].items() if data["ranks"] > 1 else ():
            lines.append(
                f"| {data['ranks']} | {c} | {fmt_s(fit['alpha_s'])} | "
                f"{fit['beta_bytes_per_s'] / 1e6:.0f} MB/s | {fit['source']} |"
            )
    lines += [
        "",
        "| ranks | dtype | matmul latency | matmul rate | pointwise latency | pointwise bandwidth |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for data in results:
        dev = data["profile"]["device"]
        for d in dev["matmul"]:
            mm, pw = dev["matmul"][d], dev["pointwise"][d]
            lines.append(
                f"| {data['ranks']} | {d} | {fmt_s(mm['latency_s'])} | {mm['rate'] / 1e9:.1f} GFLOP/s | "
                f"{fmt_s(pw['latency_s'])} | {pw['rate'] / 1e9:.2f} GB/s |"
            )
    return lines


def rows_table(results: list[dict]) -> list[str]:
    lines = [
        "| ranks | kind | what | predicted | measured | error |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for data in results:
        for r in data["rows"]:
            lines.append(
                f"| {data['ranks']} | {r['kind']} | {r['name']} | {fmt_s(r['predicted'])} | "
                f"{fmt_s(r['measured'])} | {100 * err(r):+.1f}% |"
            )
    return lines


def breakdown_table(results: list[dict]) -> list[str]:
    lines = [
        "| ranks | layout | forward | backward | fwd comm | bwd comm | optimizer | predicted | measured | "
        "forward + fwd comm: predicted / measured (no_grad) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for data in results:
        for r in data["rows"]:
            if r["kind"] == "step":
                b = r["breakdown"]
                lines.append(
                    f"| {data['ranks']} | {r['group']} | {fmt_s(b['forward'])} | {fmt_s(b['backward'])} | "
                    f"{fmt_s(b['forward_comm'])} | {fmt_s(b['backward_comm'])} | {fmt_s(b['optimizer'])} | "
                    f"{fmt_s(r['predicted'])} | {fmt_s(r['measured'])} | "
                    f"{fmt_s(b['forward'] + b['forward_comm'])} / {fmt_s(r['measured_forward'])} |"
                )
    return lines


def drift_table(results: list[dict]) -> list[str]:
    """How far the same quantity moved between the profile at the start of a run and one
    measured again just before the steps: the noise floor of this machine."""
    lines = [
        "| ranks | load avg (after profile / before steps / after steps) | quantity | start | end | drift |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for data in results:
        a, b = data["profile"], data["profile_again"]
        if data["ranks"] == 1:
            a["axes"][0]["collectives"], b["axes"][0]["collectives"] = {}, {}
        load = " / ".join(f"{v:.1f}" for v in data["load"].values())
        pairs = [
            (
                f"{c} beta (MB/s)",
                a["axes"][0]["collectives"][c]["beta_bytes_per_s"] / 1e6,
                b["axes"][0]["collectives"][c]["beta_bytes_per_s"] / 1e6,
            )
            for c in a["axes"][0]["collectives"]
        ]
        pairs += [
            (
                f"{c} alpha (us)",
                a["axes"][0]["collectives"][c]["alpha_s"] * 1e6,
                b["axes"][0]["collectives"][c]["alpha_s"] * 1e6,
            )
            for c in a["axes"][0]["collectives"]
            if c in ("all_reduce", "all_gather")
        ]
        pairs += [
            (
                f"matmul {d} (GFLOP/s)",
                a["device"]["matmul"][d]["rate"] / 1e9,
                b["device"]["matmul"][d]["rate"] / 1e9,
            )
            for d in ("fp32", "bf16")
        ]
        pairs += [
            (
                "pointwise fp32 (GB/s)",
                a["device"]["pointwise"]["fp32"]["rate"] / 1e9,
                b["device"]["pointwise"]["fp32"]["rate"] / 1e9,
            )
        ]
        for name, x, y in pairs:
            lines.append(
                f"| {data['ranks']} | {load} | {name} | {x:.1f} | {y:.1f} | {100 * (y - x) / x:+.0f}% |"
            )
    return lines


def summary_table(results: list[dict]) -> list[str]:
    lines = [
        "| ranks | category | rows | median abs error | target | within target |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    groups: dict[tuple, list[float]] = {}
    for data in results:
        for r in data["rows"]:
            groups.setdefault((data["ranks"], r["kind"], r["group"]), []).append(abs(err(r)))
            groups.setdefault((data["ranks"], r["kind"], "all"), []).append(abs(err(r)))
    for (n, kind, group), errs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "all", kv[0][2])
    ):
        med = statistics.median(errs)
        target = TARGETS[kind]
        lines.append(
            f"| {n} | {kind}: {group} | {len(errs)} | {100 * med:.1f}% | {100 * target:.0f}% | "
            f"{'yes' if med <= target else 'NO'} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=7, help="timed training steps per layout")
    ap.add_argument(
        "--results", default=str(REPO / "results"), help="where to write the report ('' for nowhere)"
    )
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.ranks:
            print(f"running {n} gloo ranks ...", file=sys.stderr, flush=True)
            results.append(run_world(n, Path(tmp) / f"rows{n}.json", args.steps))
    load = os.getloadavg()
    report = [
        "# Cost-model accuracy on this machine",
        "",
        f"{os.cpu_count()} CPUs, gloo, OMP_NUM_THREADS=1, load average at the end {load[0]:.2f}. "
        "Error = (predicted - measured) / measured. Command: `python benchmarks/costmodel_accuracy.py "
        + " ".join(f"--ranks {' '.join(map(str, args.ranks))}".split())
        + "`.",
        "",
        "## Median absolute error",
        "",
        *summary_table(results),
        "",
        "## Fitted profile (fresh, per world size)",
        "",
        *fit_table(results),
        "",
        "## Noise floor: the profile measured again just before the steps (steps are predicted from it)",
        "",
        *drift_table(results),
        "",
        "## Step breakdown (predicted)",
        "",
        *breakdown_table(results),
        "",
        "## Every row",
        "",
        *rows_table(results),
    ]
    text = "\n".join(report)
    print(text)
    if args.results:
        out = Path(args.results)
        out.mkdir(parents=True, exist_ok=True)
        (out / "costmodel_accuracy.md").write_text(text + "\n")
        (out / "costmodel_accuracy.json").write_text(json.dumps(results, indent=1))
        print(f"\nwritten: {out / 'costmodel_accuracy.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
