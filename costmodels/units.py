"""Sizes as users read them: binary units, GiB (2**30 bytes) and MiB (2**20), the units of
torch's memory tools and of ``nvidia-smi``. Every size printed to a user goes through
``gib_text``; decimal GB stays only in the names of published devices ("H100 80GB")."""

from __future__ import annotations

GIB = float(1 << 30)
MIB = float(1 << 20)


def gib_text(nbytes: float, digits: int = 3) -> str:
    """``nbytes`` in GiB, or in MiB below a tenth of a GiB, to ``digits`` significant digits."""
    scale, unit = (GIB, "GiB") if abs(nbytes) >= GIB / 10 or nbytes == 0 else (MIB, "MiB")
    return f"{nbytes / scale:.{digits}g} {unit}"
