"""Printed forms of a profile: markdown tables for the CLI, notes and reports."""

from __future__ import annotations

import math

from autopar.costmodels.profile import COLLECTIVES, HardwareProfile
from autopar.costmodels.units import gib_text


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, "")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def profile_table(profile: HardwareProfile) -> str:
    """The profile as markdown: alpha/beta per axis and collective, then compute rates."""
    lines = [
        f"hardware profile: {profile.device.name}, backend {profile.backend}, mesh {profile.mesh_shape}",
        f"source: {profile.source}",
        "",
        "| axis | size | link | collective | alpha (us) | beta (bus bandwidth) | in a step, after compute: "
        "alpha (us), beta |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]

    def beta(fit) -> str:
        return _si(fit.beta_bytes_per_s, "B/s") if math.isfinite(fit.beta_bytes_per_s) else "- (size-1 axis)"

    for ax in profile.axes:
        for c in COLLECTIVES:
            fit, step = ax.collectives[c], ax.in_step.get(c)
            lines.append(
                f"| {ax.name} | {ax.size} | {ax.link} | {c} | {fit.alpha_s * 1e6:.1f} | {beta(fit)} | "
                + (f"{step.alpha_s * 1e6:.1f}, {beta(step)} |" if step else "as back to back |")
            )
    dev = profile.device
    lines += [
        "",
        "| dtype | matmul latency (us) | matmul rate | attention fwd / bwd rate |",
        "| --- | --- | --- | --- |",
    ]
    for d in dev.matmul:
        mm, att = dev.matmul[d], dev.attention
        lines.append(
            f"| {d} | {mm.latency_s * 1e6:.1f} | {_si(mm.rate, 'FLOP/s')} | "
            f"{_si(att['forward'][d].rate, 'FLOP/s')} / {_si(att['backward'][d].rate, 'FLOP/s')} |"
        )
    lines += [
        "",
        "pointwise kinds (effective bandwidth, every input and output counted once; latency in us):",
        "",
        "| kind | " + " | ".join(dev.matmul) + " |",
        "| --- |" + " --- |" * len(dev.matmul),
    ]
    for kind, table in dev.pointwise.items():
        cells = [f"{_si(table[d].rate, 'B/s')}, {table[d].latency_s * 1e6:.1f}" for d in dev.matmul]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines.append(f"\ndevice memory: {gib_text(dev.memory_bytes)}")
    return "\n".join(lines)
