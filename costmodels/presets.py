"""Hardware profiles of machines one plans for without having them.

``h100(mesh_shape)`` and ``a100(mesh_shape)`` build a profile for nodes of 8 GPUs: the
innermost mesh axes ride the intra-node link (NVLink) while the product of their sizes
fits in one node, every axis further out rides the inter-node link (InfiniBand, one NIC
per GPU). ``preset(name, mesh_shape)`` looks one up by name.

Every number below cites its source. Where no published *achieved* figure was found the
datasheet peak is used and the comment says so: such a number is an upper bound, and a
profile measured on the real machine (``autopar profile``) should replace it.

Collective latency follows NCCL's own cost model (src/graph/tuning.cc, ring algorithm,
Simple protocol, the one used for large messages): alpha = baseLat + steps * hwLat,
with baseLat = 8.4 us, hwLat = 3.4 us per step over NVLink and 9.6 us over the network;
steps = 2(N-1) for all-reduce, N-1 for all-gather / reduce-scatter / all-to-all, 1 for
send/recv.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from costmodels.opkinds import POINTWISE_KINDS
from costmodels.profile import AxisProfile, CollectiveFit, DeviceProfile, HardwareProfile, Rate

GB = 1e9
TFLOPS = 1e12

# Per-op fixed cost (kernel launch) of matmuls and pointwise ops: no published figure
# adopted, so presets leave it out (0); a measured profile fits it.
OP_LATENCY_S = 0.0

NCCL_TUNING = "NCCL src/graph/tuning.cc, Ring/Simple"
NCCL_BASE_LATENCY_S = 8.4e-6  # NCCL tuning.cc baseLat[Ring][Simple]
NCCL_STEP_LATENCY_S = {
    "intra_node": 3.4e-6,  # NCCL tuning.cc hwLat[NVLINK][Ring][Simple]
    "inter_node": 9.6e-6,  # NCCL tuning.cc hwLat[NET][Ring][Simple]
}
RING_STEPS: dict[str, Callable[[int], int]] = {
    "all_reduce": lambda n: 2 * (n - 1),
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,
    "send_recv": lambda n: 1,
}


def bandwidth_bound(bandwidth: float) -> dict[str, dict[str, Rate]]:
    """Pointwise rates of a GPU: every kind at the memory bandwidth. On datacenter GPUs
    elementwise kernels, transcendental ones included (gelu, exp, tanh, softmax, norms),
    are bandwidth-bound: an H100 SXM5 does 67 TFLOP/s of fp32 against 3.35 TB/s, about
    80 FLOP per fp32 element moved, more than an erf or exp costs (unlike a CPU core,
    where they are compute-bound)."""
    return {k: {d: Rate(latency_s=OP_LATENCY_S, rate=bandwidth) for d in ("fp32", "bf16", "fp16")}
            for k in POINTWISE_KINDS}


# Fused attention's FLOP/s here count every score (torch.utils.flop_counter); the
# FlashAttention papers count half of them under a causal mask, so for causal attention
# these rates are up to 2x low and predict up to 2x the time.
def attention_rates(half: float, fp32: float) -> dict[str, dict[str, Rate]]:
    """Forward and backward attention rates: ``half`` for bf16 / fp16, ``fp32`` for fp32.
    No published per-head-size figures adopted: no points, one rate for every head size
    (a measured profile keeps points per head)."""
    rates = {"fp32": Rate(latency_s=OP_LATENCY_S, rate=fp32)}
    rates |= {d: Rate(latency_s=OP_LATENCY_S, rate=half) for d in ("bf16", "fp16")}
    return {"forward": dict(rates), "backward": dict(rates)}


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """What a preset knows about one kind of node."""

    name: str
    gpus_per_node: int
    device: DeviceProfile
    # bus bandwidth (bytes/s) per collective and link, with its source
    busbw: dict[str, dict[str, tuple[float, str]]]


def _h100_node() -> NodeSpec:
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): FP32 67 TFLOPS; BF16 / FP16 tensor
    # 1,979 TFLOPS *with sparsity*, so 989.5 dense; 80 GB HBM3 at 3.35 TB/s.
    peak = {"fp32": 67 * TFLOPS, "bf16": 989.5 * TFLOPS, "fp16": 989.5 * TFLOPS}
    matmul = {
        # no published achieved fp32 GEMM figure adopted: datasheet peak (upper bound)
        "fp32": Rate(latency_s=OP_LATENCY_S, rate=67 * TFLOPS),
        # stas00/ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul
        # FLOPS comparison table": H100 SXM BF16 MAMF 794.5 TFLOPS (torch 2.7.0+cu126)
        "bf16": Rate(latency_s=OP_LATENCY_S, rate=794.5 * TFLOPS),
        # fp16 runs on the same tensor cores at the same datasheet rate as bf16; the MAMF
        # table reports bf16 only, so the bf16 measurement is used
        "fp16": Rate(latency_s=OP_LATENCY_S, rate=794.5 * TFLOPS),
    }
    # no published achieved pointwise bandwidth adopted: datasheet 3.35 TB/s (upper bound),
    # for every pointwise kind (bandwidth-bound on GPUs, see bandwidth_bound)
    pointwise = bandwidth_bound(3350 * GB)
    # FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608, abstract): FP16 forward up to
    # 740 TFLOP/s on H100 (75% utilisation); no backward figure adopted, the forward one
    # is used (upper bound). fp32 has no flash kernel: the fp32 matmul peak (upper bound).
    attention = attention_rates(740 * TFLOPS, 67 * TFLOPS)
    device = DeviceProfile(
        name="NVIDIA H100 80GB SXM5",
        memory_bytes=80 * 10**9,  # datasheet: 80 GB HBM3
        matmul=matmul,
        pointwise=pointwise,
        attention=attention,
        peak_matmul_flops=peak,
        peak_memory_bandwidth=3350 * GB,  # datasheet: 3.35 TB/s
        peak_source="NVIDIA H100 Tensor Core GPU datasheet (SXM5, dense)",
    )
    nvlink = (450 * GB, "NVLink 4: 900 GB/s bidirectional = 450 GB/s per direction (datasheet), upper bound")
    ib = (50 * GB, "ConnectX-7 InfiniBand NDR 400 Gb/s = 50 GB/s per GPU (line rate), upper bound")
    return NodeSpec(
        name="h100",
        gpus_per_node=8,  # DGX H100 / HGX H100 8-GPU baseboard
        device=device,
        busbw={
            "intra_node": {
                # nccl-tests all_reduce_perf reference on 8x H100 SXM5 NVLink: busbw
                # 460-480 GB/s at large sizes (docs.alayanew.com, "NCCL-tests in
                # practice", 2026); the low end is used
                "all_reduce": (460 * GB, "nccl-tests all_reduce busbw 8xH100 SXM5 (460-480 GB/s)"),
                "all_gather": nvlink,
                "reduce_scatter": nvlink,
                "all_to_all": nvlink,
                "send_recv": nvlink,
            },
            "inter_node": {c: ib for c in RING_STEPS},
        },
    )


def _a100_node() -> NodeSpec:
    # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): FP32 19.5 TFLOPS; BF16 / FP16
    # tensor 312 TFLOPS dense; 80 GB HBM2e at 2,039 GB/s.
    peak = {"fp32": 19.5 * TFLOPS, "bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS}
    matmul = {
        # no published achieved fp32 GEMM figure adopted: datasheet peak (upper bound)
        "fp32": Rate(latency_s=OP_LATENCY_S, rate=19.5 * TFLOPS),
        # stas00/ml-engineering MAMF table: A100 SXM BF16 271.2 TFLOPS (torch 2.6.0+cu126)
        "bf16": Rate(latency_s=OP_LATENCY_S, rate=271.2 * TFLOPS),
        # same tensor cores and datasheet rate as bf16; bf16 measurement used
        "fp16": Rate(latency_s=OP_LATENCY_S, rate=271.2 * TFLOPS),
    }
    # no published achieved pointwise bandwidth adopted: datasheet 2,039 GB/s (upper bound),
    # for every pointwise kind (bandwidth-bound on GPUs, see bandwidth_bound)
    pointwise = bandwidth_bound(2039 * GB)
    # FlashAttention-2 (Dao 2023, arXiv:2307.08691, abstract): 50-73% of the A100's
    # theoretical maximum FLOP/s; the low end, 50% of 312 TFLOP/s, for both directions.
    # fp32 has no flash kernel: the fp32 matmul peak (upper bound).
    attention = attention_rates(0.5 * 312 * TFLOPS, 19.5 * TFLOPS)
    device = DeviceProfile(
        name="NVIDIA A100 80GB SXM4",
        memory_bytes=80 * 10**9,  # datasheet: 80 GB HBM2e
        matmul=matmul,
        pointwise=pointwise,
        attention=attention,
        peak_matmul_flops=peak,
        peak_memory_bandwidth=2039 * GB,  # datasheet: 2,039 GB/s
        peak_source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM, dense)",
    )
    # NCCL's tuning model caps A100 (compute capability 8.0) bus bandwidth at 235 GB/s
    # (tuning.cc: `if (compCap80) busBw = std::min(busBw, 235.0f)`), matching published
    # nccl-tests all_reduce busbw of 230-250 GB/s on 8x A100 SXM4 (docs.alayanew.com)
    nccl_cap = (235 * GB, "NCCL tuning.cc A100 busBw cap 235 GB/s; nccl-tests 230-250 GB/s")
    # nccl-tests sendrecv_perf on 8x A100 NVLink, 1 GiB: busbw 195 GB/s
    # (github.com/li-plus/playground, cuda/nccl.md)
    sendrecv = (195 * GB, "nccl-tests sendrecv_perf 8xA100 NVLink, 1 GiB: 195 GB/s")
    ib = (25 * GB, "ConnectX-6 InfiniBand HDR 200 Gb/s = 25 GB/s per GPU (line rate), upper bound")
    return NodeSpec(
        name="a100",
        gpus_per_node=8,  # DGX A100 / HGX A100 8-GPU baseboard
        device=device,
        busbw={
            "intra_node": {
                "all_reduce": nccl_cap,
                "all_gather": nccl_cap,
                "reduce_scatter": nccl_cap,
                "all_to_all": nccl_cap,
                "send_recv": sendrecv,
            },
            "inter_node": {c: ib for c in RING_STEPS},
        },
    )


def axis_links(mesh_shape: Sequence[int], gpus_per_node: int) -> list[str]:
    """The link each mesh axis rides: inner axes are intra-node while their product fits
    in one node; the first axis that does not fit, and all axes outside it, cross nodes."""
    links: list[str] = []
    inner = 1
    fits = True
    for size in reversed(list(mesh_shape)):
        inner *= size
        fits = fits and inner <= gpus_per_node
        links.append("intra_node" if fits else "inter_node")
    return links[::-1]


def build(
    node: NodeSpec, mesh_shape: Sequence[int], axis_names: Sequence[str] | None = None
) -> HardwareProfile:
    mesh_shape = tuple(int(n) for n in mesh_shape)
    if not mesh_shape or any(n < 1 for n in mesh_shape):
        raise ValueError(
            f"autopar: a mesh shape is a non-empty tuple of positive axis sizes; found {mesh_shape}."
        )
    names = tuple(axis_names) if axis_names else tuple(f"axis{i}" for i in range(len(mesh_shape)))
    if len(names) != len(mesh_shape):
        raise ValueError(
            f"autopar: {len(names)} axis names {names} for a {len(mesh_shape)}-axis mesh "
            f"{mesh_shape}; give one name per axis."
        )
    axes = []
    for name, size, link in zip(names, mesh_shape, axis_links(mesh_shape, node.gpus_per_node)):
        fits = {}
        for coll, steps in RING_STEPS.items():
            bw, src = node.busbw[link][coll]
            alpha = NCCL_BASE_LATENCY_S + steps(size) * NCCL_STEP_LATENCY_S[link]
            fits[coll] = CollectiveFit(
                alpha_s=alpha, beta_bytes_per_s=bw, source=f"alpha: {NCCL_TUNING}; beta: {src}"
            )
        axes.append(AxisProfile(name=name, size=size, link=link, collectives=fits))
    return HardwareProfile(
        machine=f"preset:{node.name}",
        backend="preset",
        mesh_shape=mesh_shape,
        device=node.device,
        axes=axes,
        source=f"preset {node.name}: nodes of {node.gpus_per_node} GPUs (see costmodels/presets.py)",
    )


def h100(mesh_shape: Sequence[int], axis_names: Sequence[str] | None = None) -> HardwareProfile:
    """Nodes of 8x H100 SXM5, NVLink 4 inside, 400 Gb/s InfiniBand NDR per GPU between."""
    return build(_h100_node(), mesh_shape, axis_names)


def a100(mesh_shape: Sequence[int], axis_names: Sequence[str] | None = None) -> HardwareProfile:
    """Nodes of 8x A100 80GB SXM4, NVLink 3 inside, 200 Gb/s InfiniBand HDR per GPU between."""
    return build(_a100_node(), mesh_shape, axis_names)


PRESETS: dict[str, Callable[..., HardwareProfile]] = {"h100": h100, "a100": a100}


def preset(name: str, mesh_shape: Sequence[int], axis_names: Sequence[str] | None = None) -> HardwareProfile:
    """The preset profile called ``name`` ("h100", "a100") built for ``mesh_shape``."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(
            f"autopar: no hardware preset named {name!r}; known presets: {sorted(PRESETS)}. "
            f"For other machines measure a profile with `autopar profile`."
        )
    return PRESETS[key](mesh_shape, axis_names)
