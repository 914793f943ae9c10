"""Hardware profiles the tests build by hand."""

from __future__ import annotations

from autopar import costmodels
def measured_style(shape: tuple[int, ...], slow_bytes_per_s: float = 2e9) -> costmodels.HardwareProfile:
    """A profile as ``autopar profile`` writes one (fitted numbers, the mesh's own axis
    names ``nodes``, ``gpus0``, ...), for a mesh whose outermost axis is slow (by default
    2 GB/s and 100 us per message, a 25th of the preset's InfiniBand); the device and the
    inner axes are the H100 preset's."""
    base = costmodels.preset("h100", shape)
    slow = {c: costmodels.CollectiveFit(alpha_s=1e-4, beta_bytes_per_s=slow_bytes_per_s, source="test: fitted")
            for c in costmodels.COLLECTIVES}
    axes = [costmodels.AxisProfile(name="nodes", size=shape[0], link="inter_node", collectives=slow)]
    axes += [costmodels.AxisProfile(name=f"gpus{i}", size=a.size, link=a.link, collectives=a.collectives)
             for i, a in enumerate(base.axes[1:])]
    return costmodels.HardwareProfile(machine="test-cluster", backend="nccl", mesh_shape=tuple(shape),
                                      device=base.device, axes=axes, source="test: measured-style, slow outer axis")
