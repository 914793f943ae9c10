"""Hardware profiles of machines one plans for without having them.

``h100(mesh_shape)`` and ``a100(mesh_shape)`` build a profile for nodes of 8 GPUs: the
innermost mesh axes ride the intra-node link (NVLink) while the product of their sizes
fits in one node, every axis further out rides the inter-node link (InfiniBand, one NIC
per GPU, rail-aligned): a group of an inter-node axis with g members in each node drives g
NICs at once (``group_nics``). ``preset(name, mesh_shape)`` looks one up by name.

Rates are what a PyTorch training step achieves, not datasheet peaks: matmuls by shape
(``compute.matmul_efficiency``), fused attention forward and backward apart, elementwise
ops at achievable memory bandwidth, a fixed cost per kernel, collectives at the bus
bandwidths nccl-tests measures.

Every number below cites its source. Where no published *achieved* figure was found the
datasheet peak is used and the comment says so: such a number is an upper bound, and a
profile measured on the real machine (``autopar profile``) should replace it.

Collective latency follows NCCL's own cost model (src/graph/tuning.cc, ring algorithm,
Simple protocol, the one used for large messages): alpha = baseLat + steps * hwLat,
with baseLat = 8.4 us, hwLat = 3.4 us per step over NVLink and 9.6 us over the network;
steps = 2(N-1) for all-reduce, N-1 for all-gather / reduce-scatter / all-to-all, 1 for
send/recv; of a group spanning K nodes, the ring's steps over the K nodes (2(K-1) for
all-reduce, K-1 for the others) pay the network's hwLat and the rest NVLink's
(``ring_latency``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from autopar.costmodels.opkinds import POINTWISE_KINDS
from autopar.costmodels.overlap import KINDS as OVERLAP_KINDS
from autopar.costmodels.profile import (
    AxisProfile,
    CollectiveFit,
    DeviceProfile,
    HardwareProfile,
    Rate,
    default_axis_names,
)

GB = 1e9
TFLOPS = 1e12

# Fixed cost of every kernel (launch, prologue, tail): "a few microseconds" per launch
# (torchedup.dev "kernel launch overhead"); one dispatch on a B200 measured 5 us through
# cuLaunchKernel (dogacel.github.io, 2026-03-14, "GPU kernel dispatch overhead"). The
# measured figure is used.
OP_LATENCY_S = 5e-6
# Achievable share of HBM bandwidth for streaming elementwise kernels. One published H100
# Nsight Compute study measured 2.8 TB/s (84%) for coalesced loads, ECC costing about 6%
# (mikamirai.com, "GPU memory bandwidth", 2026); no benchmark table of elementwise kernels
# adopted, so 90% (between that and the peak) is assumed: an upper bound.
HBM_ACHIEVED = 0.9

NCCL_TUNING = "NCCL src/graph/tuning.cc, Ring/Simple"
NCCL_BASE_LATENCY_S = 8.4e-6  # NCCL tuning.cc baseLat[Ring][Simple]
NCCL_STEP_LATENCY_S = {
    "intra_node": 3.4e-6,  # NCCL tuning.cc hwLat[NVLINK][Ring][Simple]
    "inter_node": 9.6e-6,  # NCCL tuning.cc hwLat[NET][Ring][Simple]
}
# NCCL's LL protocol, which it picks for small buffers (tuning.cc of NVIDIA/nccl at commit
# 01afd20, ncclTopoTuneModel: baseLat[Ring][LL] 3.6 us, hwLat[NVLINK|NET][Ring][LL] 0.47 |
# 2.7 us a step, the intra-node step x 1.8 across nodes; the ring's bus bandwidth x 1/4 for
# all-reduce and across nodes, x 1/3 otherwise): a decode step's tensor-parallel all-reduces
# of a few kilobytes pay this latency, not Simple's
NCCL_TUNING_LL = "NCCL src/graph/tuning.cc (commit 01afd20), Ring/LL"
NCCL_LL_BASE_LATENCY_S = 3.6e-6
NCCL_LL_STEP_LATENCY_S = {"intra_node": 0.47e-6, "inter_node": 2.7e-6}
NCCL_LL_CROSS_NODE_INTRA_FACTOR = 1.8
NCCL_LL_BANDWIDTH_SHARE = {"all_reduce": 1 / 4, "cross_node": 1 / 4, "other": 1 / 3}
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


# Fused attention's FLOP/s here count every score (torch.utils.flop_counter), for causal
# attention, as the profiler times it (timing.attention_calls): the FlashAttention papers
# count half the scores under a causal mask, so a causal rate of theirs is doubled here.
# Non-causal attention (encoders) is then priced up to 2x fast.
CAUSAL_FLOP_COUNT = 2.0


def attention_rates(forward: float, backward: float, fp32: float) -> dict[str, dict[str, Rate]]:
    """Attention rates by direction: ``forward`` / ``backward`` for bf16 / fp16, ``fp32``
    both ways. No published per-head-size figures adopted: no points, one rate for every
    head size (a measured profile keeps points per head)."""
    def by_dtype(half: float) -> dict[str, Rate]:
        return {"fp32": Rate(latency_s=OP_LATENCY_S, rate=fp32)} | {
            d: Rate(latency_s=OP_LATENCY_S, rate=half) for d in ("bf16", "fp16")}
    return {"forward": by_dtype(forward), "backward": by_dtype(backward)}


A100_N_HALF = 1250.0  # m = n = k at half the large-size rate (NVIDIA CUDA 11 blog, Figure 6)
A100_SMS = 108  # NVIDIA A100 Tensor Core GPU architecture whitepaper
TILE_EDGE = 128.0  # cuBLAS tile short edge (NVIDIA Matrix Multiplication Background guide)


def matmul_rate(rate: float, sms: int) -> Rate:
    """A tensor-core matmul rate: ``rate`` for large matmuls, less for small or skinny ones
    (``compute.matmul_efficiency``). work_half: NVIDIA's bf16 cuBLAS curve on an A100
    (NVIDIA blog "CUDA 11 features revealed", 2020, Figure 6, m = n = k) reaches half its
    large-size rate (~145 of 290 TFLOP/s) near n = 1250 (about 2 * 1250^3 = 3.9 GFLOP):
    where its 128x256 output tiles (n^2 / 32768 = 48) fill under half the A100's 108 SMs
    (ml-engineering, training/performance "Tile and wave quantization"). The wave fills at
    the same tiles per SM on another GPU, so n_half scales with sqrt(SMs). dim_half: 128,
    the short edge of cuBLAS's tiles (NVIDIA "Matrix Multiplication Background User's
    Guide", sec. 2.3): a dimension of d elements fills about d / (d + 128) of its tiles."""
    n_half = A100_N_HALF * math.sqrt(sms / A100_SMS)
    return Rate(latency_s=OP_LATENCY_S, rate=rate, work_half=2.0 * n_half**3, dim_half=TILE_EDGE)


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """What a preset knows about one kind of node."""

    name: str
    gpus_per_node: int
    device: DeviceProfile
    # bus bandwidth (bytes/s) per collective and link, with its source
    busbw: dict[str, dict[str, tuple[float, str]]]
    # the part of a collective's time hidden beside compute (``costmodels.overlap``), every kind alike
    overlap: float = 0.0


# NCCL runs a collective as one thread block per channel, each block holding a streaming
# multiprocessor while the collective runs: an all-gather beside a GEMM on an H100 launched
# 24 blocks (NVIDIA developer forums, "Compute-Communication Overlap Causes Severe GEMM
# Performance Degradation because of Tail Effect", 2025, Nsight Systems trace). A GEMM beside it
# runs on the other SMs, so a collective of C seconds beside compute costs that compute
# C * 24 / SMs: it hides 1 - 24 / SMs of its time. (The same post shows a one-wave GEMM
# doubling in time, a tail effect of its shape; large GEMMs run many waves.)
NCCL_COLLECTIVE_SMS = 24


def nccl_overlap(sms: int) -> float:
    """The part of a collective's time hidden beside compute on a GPU of ``sms`` SMs."""
    return 1.0 - NCCL_COLLECTIVE_SMS / sms


@dataclass(frozen=True, kw_only=True)
class H100Variant:
    """What sets one H100 board apart from another: its dense bf16 tensor peak, HBM and
    memory. The SXM5's measured rates (matmul, attention) are scaled by the tensor peak's
    ratio to the SXM5's: the same kernels reach the same share of a slower clock."""

    key: str  # the preset's name (``PRESETS``)
    name: str
    bf16_peak: float  # dense FLOP/s
    hbm: float  # bytes/s, peak
    memory_bytes: int
    source: str
    fp32_gemm: float | None = None  # achieved fp32 GEMM FLOP/s where measured; None: the datasheet peak


# NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 / FP16 tensor 1,979 TFLOPS *with
# sparsity*, so 989.5 dense; 80 GB HBM3 at 3.35 TB/s.
H100_SXM = H100Variant(key="h100", name="NVIDIA H100 80GB SXM5", bf16_peak=989.5 * TFLOPS, hbm=3350 * GB,
                       memory_bytes=80 * 10**9, source="NVIDIA H100 Tensor Core GPU datasheet (SXM5, dense)")
# NVIDIA H100 Tensor Core GPU datasheet (H100 NVL): BF16 tensor 1,671 TFLOPS with
# sparsity, 835.5 dense; one end of the bracket the 500 W board's peak lies in.
H100_NVL_BF16 = 835.5 * TFLOPS
# Meta's Grand Teton H100 (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md,
# "Hardware" and footnote 2): "96GB HBM2e with 2.4 TB/sec peak memory bandwidth", "the
# default 500W power limit", and "the actual peak TFLOPs number is between SXM and NVL, and
# we don't know its exact value": the middle of that bracket, (989.5 + 835.5) / 2.
H100_HBM2E_500W = H100Variant(
    key="h100-96gb-500w", name="NVIDIA H100 96GB HBM2e SXM, 500 W",
    bf16_peak=(H100_SXM.bf16_peak + H100_NVL_BF16) / 2, hbm=2400 * GB, memory_bytes=96 * 10**9,
    source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md (96 GB HBM2e, 2.4 TB/s, 500 W; bf16 peak "
           "between SXM 989.5 and NVL 835.5 dense: their middle)")


# NVIDIA H200 Tensor Core GPU datasheet (SXM): the H100 SXM5's GH100 at its tensor peaks, with
# 141 GB of HBM3e at 4.8 TB/s; HGX H200 boards keep NVLink 4 and a 400 Gb/s NIC per GPU. fp32
# GEMM (no TF32, torch's default) fitted on one H200 by the profiler's GPU sweep: 51.8 TFLOP/s
# (benchmarks/results/gpu_one_device_h200_20261129.md); the H100 SXM5 keeps the datasheet's 67
# as its upper bound until re-priced on an H100.
H200_SXM = H100Variant(key="h200", name="NVIDIA H200 141GB SXM", bf16_peak=H100_SXM.bf16_peak, hbm=4800 * GB,
                       memory_bytes=141 * 10**9, fp32_gemm=51.8 * TFLOPS,
                       source="NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e, 4.8 TB/s; H100 SXM5 tensor peaks)")


def _h100_node(variant: H100Variant = H100_SXM) -> NodeSpec:
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): FP32 67 TFLOPS; 132 SMs.
    clock = variant.bf16_peak / H100_SXM.bf16_peak  # 1 for the SXM5
    peak = {"fp32": 67 * TFLOPS * clock, "bf16": variant.bf16_peak, "fp16": variant.bf16_peak}
    sms = 132
    matmul = {
        # the variant's measured fp32 GEMM, else (no published achieved figure adopted) the
        # datasheet peak: an upper bound
        "fp32": matmul_rate(variant.fp32_gemm or peak["fp32"], sms),
        # stas00/ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul
        # FLOPS comparison table": H100 SXM BF16 MAMF 794.5 TFLOPS (80.3% of peak, torch
        # 2.7.0+cu126), the best of a search over large shapes. Cross-checked by shape against
        # OpenXLA's measured sm_90 table (tensorflow third_party/xla/xla/service/gpu/model/
        # matmul_interpolator_data.h: 4096^3 783 TFLOP/s, 2048^3 632): this curve gives 0.69-0.93
        # of it for cubes and square-ish shapes (tests/test_costmodel_rates.py)
        "bf16": matmul_rate(794.5 * TFLOPS * clock, sms),
        # fp16 runs on the same tensor cores at the same datasheet rate as bf16; the MAMF
        # table reports bf16 only, so the bf16 measurement is used
        "fp16": matmul_rate(794.5 * TFLOPS * clock, sms),
    }
    hbm = variant.hbm
    # FlashAttention-3 paper (Shah et al. 2024, arXiv:2407.08608), H100 80GB SXM5, head
    # dim 128, sequence 8k, FlashAttention-2 (PyTorch's flash SDPA kernel): forward with a
    # causal mask 333 TFLOP/s, forward without 370, backward without 318; the causal
    # backward is taken as 318 * 333 / 370 = 286. Doubled for the flop counter's causal
    # count (CAUSAL_FLOP_COUNT). (FlashAttention-3 reaches 602-646 forward, 559 backward;
    # cuDNN 529-600 / 518: faster kernels than a default SDPA run uses.)
    attention = attention_rates(CAUSAL_FLOP_COUNT * 333 * TFLOPS * clock, CAUSAL_FLOP_COUNT * 286 * TFLOPS * clock,
                                peak["fp32"])  # fp32 has no flash kernel: fp32 peak
    device = DeviceProfile(
        name=variant.name,
        memory_bytes=variant.memory_bytes,
        matmul=matmul,
        pointwise=bandwidth_bound(HBM_ACHIEVED * hbm),
        attention=attention,
        peak_matmul_flops=peak,
        peak_memory_bandwidth=hbm,
        peak_source=variant.source,
    )
    # nccl-tests all_reduce_perf on 8x H100 SXM5 over NVLink 4, large messages: busbw about
    # 370 GB/s with the ring algorithm, up to about 480 GB/s with NVLink SHARP (NVLS)
    # (NVIDIA/nccl-tests issues 212 and 290). Ring figure for every collective: NVLS
    # accelerates all-reduce only, and not on every NCCL setup.
    nvlink = (370 * GB, "nccl-tests busbw 8x H100 NVLink 4, ring: ~370 GB/s (nccl-tests #212, #290)")
    # 400 Gb/s NDR InfiniBand (ConnectX-7, one per GPU): nccl-tests busbw 46-48 GB/s per NIC,
    # up to ~396 GB/s for a node's 8 NICs (nccl-tests issues 290, 319); the low end
    ndr = (46 * GB, "nccl-tests busbw per 400 Gb/s NDR NIC: 46-48 GB/s (nccl-tests #290, #319)")
    return NodeSpec(
        name=variant.key,
        gpus_per_node=8,  # DGX H100 / HGX H100 8-GPU baseboard; Grand Teton: 8 H100s per host
        device=device,
        busbw={"intra_node": {c: nvlink for c in RING_STEPS}, "inter_node": {c: ndr for c in RING_STEPS}},
        overlap=nccl_overlap(sms),
    )


def _a100_node() -> NodeSpec:
    # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): FP32 19.5 TFLOPS; BF16 / FP16
    # tensor 312 TFLOPS dense; 80 GB HBM2e at 2,039 GB/s; 108 SMs.
    peak = {"fp32": 19.5 * TFLOPS, "bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS}
    matmul = {
        # no published achieved fp32 GEMM figure adopted: datasheet peak (upper bound)
        "fp32": matmul_rate(19.5 * TFLOPS, A100_SMS),
        # stas00/ml-engineering MAMF table: A100 SXM BF16 271.2 TFLOPS (torch 2.6.0+cu126)
        "bf16": matmul_rate(271.2 * TFLOPS, A100_SMS),
        # same tensor cores and datasheet rate as bf16; bf16 measurement used
        "fp16": matmul_rate(271.2 * TFLOPS, A100_SMS),
    }
    hbm = 2039 * GB  # datasheet: 2,039 GB/s
    # FlashAttention-2 (Dao 2023, arXiv:2307.08691, sec. 4.1) on A100: up to 73% of the
    # 312 TFLOP/s peak in the forward pass and up to 63% in the backward pass, in the
    # paper's count (half the scores under a causal mask): doubled for the flop counter's
    # causal count (CAUSAL_FLOP_COUNT). fp32 has no flash kernel: the fp32 peak.
    attention = attention_rates(CAUSAL_FLOP_COUNT * 0.73 * 312 * TFLOPS, CAUSAL_FLOP_COUNT * 0.63 * 312 * TFLOPS,
                                19.5 * TFLOPS)
    device = DeviceProfile(
        name="NVIDIA A100 80GB SXM4",
        memory_bytes=80 * 10**9,  # datasheet: 80 GB HBM2e
        matmul=matmul,
        pointwise=bandwidth_bound(HBM_ACHIEVED * hbm),
        attention=attention,
        peak_matmul_flops=peak,
        peak_memory_bandwidth=hbm,
        peak_source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM, dense)",
    )
    # NCCL's tuning model caps A100 (compute capability 8.0) bus bandwidth at 235 GB/s
    # (tuning.cc: `if (compCap80) busBw = std::min(busBw, 235.0f)`), matching published
    # nccl-tests all_reduce busbw of 230-250 GB/s on 8x A100 SXM4 (docs.alayanew.com);
    # the 230 GB/s low end
    nvlink = (230 * GB, "nccl-tests all_reduce busbw 8x A100 NVLink 3: 230-250 GB/s; NCCL tuning.cc cap 235")
    # nccl-tests sendrecv_perf on 8x A100 NVLink, 1 GiB: busbw 195 GB/s
    # (github.com/li-plus/playground, cuda/nccl.md)
    sendrecv = (195 * GB, "nccl-tests sendrecv_perf 8xA100 NVLink, 1 GiB: 195 GB/s")
    # 200 Gb/s HDR InfiniBand (ConnectX-6, one per GPU) is 25 GB/s line rate; nccl-tests
    # reach the same ~92% of it as on NDR (46 of 50 GB/s): 23 GB/s per NIC
    hdr = (23 * GB, "HDR 200 Gb/s per NIC: 25 GB/s line rate at nccl-tests' ~92% (as NDR's 46 of 50)")
    return NodeSpec(
        name="a100",
        gpus_per_node=8,  # DGX A100 / HGX A100 8-GPU baseboard
        device=device,
        busbw={
            "intra_node": {c: nvlink for c in RING_STEPS} | {"send_recv": sendrecv},
            "inter_node": {c: hdr for c in RING_STEPS},
        },
        overlap=nccl_overlap(A100_SMS),
    )


def group_nics(mesh_shape: Sequence[int], axis: int, gpus_per_node: int) -> int:
    """NICs one group of an inter-node ``axis`` drives at once: its members in one node,
    each with its own NIC (rail-aligned, one NIC per GPU). The axes inside ``axis`` fill
    ``inner`` GPUs of a node, so a group has gpus_per_node // inner members per node (1
    where the inner axes fill the node)."""
    inner = math.prod(mesh_shape[axis + 1:])
    return max(1, min(mesh_shape[axis], gpus_per_node // inner))


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


def ring_latency(steps: Callable[[int], int], size: int, nodes: int, low_latency: bool = False) -> float:
    """NCCL's ring latency for ``size`` ranks on ``nodes`` nodes (tuning.cc: latency =
    baseLat + (nsteps - nInterSteps) * intraLat + nInterSteps * interLat, nInterSteps the
    ring's steps over the nodes): only the steps that leave a node pay the network's
    latency, the others NVLink's. ``low_latency``: the LL protocol's."""
    inter = steps(nodes) if nodes > 1 else 0
    if low_latency:
        intra = NCCL_LL_STEP_LATENCY_S["intra_node"] * (NCCL_LL_CROSS_NODE_INTRA_FACTOR if nodes > 1 else 1.0)
        return NCCL_LL_BASE_LATENCY_S + (steps(size) - inter) * intra + inter * NCCL_LL_STEP_LATENCY_S["inter_node"]
    return (NCCL_BASE_LATENCY_S + (steps(size) - inter) * NCCL_STEP_LATENCY_S["intra_node"]
            + inter * NCCL_STEP_LATENCY_S["inter_node"])


def build(
    node: NodeSpec, mesh_shape: Sequence[int], axis_names: Sequence[str] | None = None
) -> HardwareProfile:
    mesh_shape = tuple(int(n) for n in mesh_shape)
    if not mesh_shape or any(n < 1 for n in mesh_shape):
        raise ValueError(
            f"autopar: a mesh shape is a non-empty tuple of positive axis sizes; found {mesh_shape}."
        )
    names = tuple(axis_names) if axis_names else default_axis_names(len(mesh_shape))
    if len(names) != len(mesh_shape):
        raise ValueError(
            f"autopar: {len(names)} axis names {names} for a {len(mesh_shape)}-axis mesh "
            f"{mesh_shape}; give one name per axis."
        )
    axes = []
    links = axis_links(mesh_shape, node.gpus_per_node)
    for i, (name, size, link) in enumerate(zip(names, mesh_shape, links)):
        fits, small = {}, {}
        nics = group_nics(mesh_shape, i, node.gpus_per_node) if link == "inter_node" else 1
        nodes = -(-size // nics) if link == "inter_node" else 1
        for coll, steps in RING_STEPS.items():
            bw, src = node.busbw[link][coll]
            if nics > 1:  # no faster than the NVLink ring it also runs through
                bw, src = min(nics * bw, node.busbw["intra_node"][coll][0]), f"{nics} NICs x ({src})"
            fits[coll] = CollectiveFit(
                alpha_s=ring_latency(steps, size, nodes), beta_bytes_per_s=bw, source=f"alpha: {NCCL_TUNING}; beta: {src}"
            )
            share = NCCL_LL_BANDWIDTH_SHARE["all_reduce" if coll == "all_reduce" else
                                            "cross_node" if nodes > 1 else "other"]
            small[coll] = CollectiveFit(alpha_s=ring_latency(steps, size, nodes, low_latency=True),
                                        beta_bytes_per_s=bw * share, source=f"{NCCL_TUNING_LL}; beta: {src} x {share:.3g}")
        axes.append(AxisProfile(name=name, size=size, link=link, collectives=fits, low_latency=small))
    return HardwareProfile(
        machine=f"preset:{node.name}",
        backend="preset",
        mesh_shape=mesh_shape,
        device=node.device,
        axes=axes,
        source=f"preset {node.name}: nodes of {node.gpus_per_node} GPUs (see costmodels/presets.py)",
        overlap={kind: node.overlap for kind in OVERLAP_KINDS},
    )


def h100(mesh_shape: Sequence[int], axis_names: Sequence[str] | None = None) -> HardwareProfile:
    """Nodes of 8x H100 SXM5, NVLink 4 inside, 400 Gb/s InfiniBand NDR per GPU between."""
    return build(_h100_node(), mesh_shape, axis_names)


def h100_96gb_500w(mesh_shape: Sequence[int], axis_names: Sequence[str] | None = None) -> HardwareProfile:
    """Nodes of 8x H100 96GB HBM2e at a 500 W power limit (Meta's Grand Teton, the
    torchtitan benchmarks' machine): NVLink inside, 400 Gb/s RDMA per GPU between."""
    return build(_h100_node(H100_HBM2E_500W), mesh_shape, axis_names)


def h200(mesh_shape: Sequence[int], axis_names: Sequence[str] | None = None) -> HardwareProfile:
    """Nodes of 8x H200 SXM (HGX H200), NVLink 4 inside, 400 Gb/s InfiniBand NDR per GPU between."""
    return build(_h100_node(H200_SXM), mesh_shape, axis_names)


def a100(mesh_shape: Sequence[int], axis_names: Sequence[str] | None = None) -> HardwareProfile:
    """Nodes of 8x A100 80GB SXM4, NVLink 3 inside, 200 Gb/s InfiniBand HDR per GPU between."""
    return build(_a100_node(), mesh_shape, axis_names)


PRESETS: dict[str, Callable[..., HardwareProfile]] = {"h100": h100, "h100-96gb-500w": h100_96gb_500w, "h200": h200,
                                                     "a100": a100}


def preset(name: str, mesh_shape: Sequence[int], axis_names: Sequence[str] | None = None) -> HardwareProfile:
    """The preset profile called ``name`` (a key of ``PRESETS``) built for ``mesh_shape``."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(
            f"autopar: no hardware preset named {name!r}; known presets: {sorted(PRESETS)}. "
            f"For other machines measure a profile with `autopar profile`."
        )
    return PRESETS[key](mesh_shape, axis_names)
