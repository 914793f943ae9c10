"""Where measured profiles live, and how a cached one is checked before reuse.

A profile is cached under ``<cache dir>/<host>-<hash>-<backend>-<mesh>-<axis names>.json``.
The cache dir is the ``cache_dir`` argument, else ``$AUTOPAR_CACHE_DIR``, else
``~/.cache/autopar``. A cached profile is reused only if its machine fingerprint,
backend, mesh shape and axis names all match; ``check_profile`` says which did not.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
from pathlib import Path
from typing import Sequence

from autopar.costmodels.profile import HardwareProfile, ProfileError

ENV_CACHE_DIR = "AUTOPAR_CACHE_DIR"


def default_cache_dir() -> Path:
    env = os.environ.get(ENV_CACHE_DIR)
    return Path(env) if env else Path.home() / ".cache" / "autopar"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_fingerprint(device_name: str) -> str:
    """Host, CPU model and core count, and the device the profile measures."""
    return f"{platform.node()}|{_cpu_model()}|{os.cpu_count()} cpus|{device_name}"


def cache_path(
    machine: str,
    backend: str,
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
    cache_dir: str | Path | None = None,
) -> Path:
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    host = re.sub(r"[^A-Za-z0-9_.]+", "_", machine.split("|", 1)[0])[:40] or "host"
    digest = hashlib.sha1(machine.encode()).hexdigest()[:10]
    shape = "x".join(str(n) for n in mesh_shape)
    names = "-".join(re.sub(r"[^A-Za-z0-9_]+", "_", n) for n in axis_names)
    return root / f"{host}-{digest}-{backend}-{shape}-{names}.json"


def check_profile(
    profile: HardwareProfile,
    *,
    machine: str | None = None,
    backend: str | None = None,
    mesh_shape: Sequence[int] | None = None,
    axis_names: Sequence[str] | None = None,
    path: str | Path = "<profile>",
) -> None:
    """Raise ``ProfileError`` naming every field where ``profile`` is not what is expected."""
    wrong = []
    if machine is not None and profile.machine != machine:
        wrong.append(f"machine {profile.machine!r} (this machine is {machine!r})")
    if backend is not None and profile.backend != backend:
        wrong.append(f"backend {profile.backend!r} (running {backend!r})")
    if mesh_shape is not None and profile.mesh_shape != tuple(mesh_shape):
        wrong.append(f"mesh {profile.mesh_shape} (running {tuple(mesh_shape)})")
    if axis_names is not None and profile.axis_names != tuple(axis_names):
        wrong.append(f"axis names {profile.axis_names} (running {tuple(axis_names)})")
    if wrong:
        raise ProfileError(
            f"autopar: the hardware profile {path} was measured for another setup: "
            f"{'; '.join(wrong)}. Re-measure here with `autopar profile --force`, or pass the "
            f"profile that matches."
        )


def load_profile(path: str | Path, **expected) -> HardwareProfile:
    """Load a profile from ``path`` and check it against ``expected`` (see ``check_profile``)."""
    profile = HardwareProfile.load(path)
    check_profile(profile, path=path, **expected)
    return profile
