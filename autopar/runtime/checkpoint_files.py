"""A checkpoint folder's completion marker and checksums, and the agreement of every rank
on a check before anything is read.

A folder is complete once rank 0 has written its ``COMPLETE`` marker (``write_marker``:
the step, the world size and the CRC-32 of every file, itself written whole and synced).
Before DCP reads a folder, every rank reads the marker and checksums its share of the
files (``check_checksums``); any failure on any rank is raised on every rank
(``agreed``), so no rank waits in a collective the others left.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch.distributed as dist

MARKER = "COMPLETE"


def this_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def short(exc: Any, most: int = 300) -> str:
    text = str(exc)
    return text if len(text) <= most else text[:most] + " ..."


T = TypeVar("T")


def agreed(check: Callable[[], T]) -> T:
    """``check()`` on every rank; an error on any rank is raised on every rank (the first
    failing rank's message on the others). All ranks call this."""
    try:
        result, error = check(), None
    except Exception as exc:  # noqa: BLE001  (every failure must reach the other ranks)
        result, error = None, exc
    message = None if error is None else (str(error) if str(error).startswith("autopar:") else
                                          f"autopar: rank {this_rank()}: {type(error).__name__}: {short(error)}")
    first = next((m for m in gathered(message) if m is not None), None)
    if isinstance(error, ValueError) and message == str(error):
        raise error
    if error is not None:
        raise ValueError(message) from error
    if first is not None:
        raise ValueError(first)
    return result


def gathered(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (all ranks call this)."""
    if not dist.is_initialized():
        return [value]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def file_checksums(folder: Path, group=None) -> dict[str, int | None]:
    """CRC-32 of each file of a checkpoint (the marker aside; None: unreadable), each rank
    reading its share of the files (all ranks of ``group`` call this)."""
    try:
        names = sorted(f.name for f in folder.iterdir() if f.is_file() and not f.name.startswith((MARKER, f".{MARKER}")))
    except OSError:  # a folder gone: its files are missing (named by the caller); the others must not wait
        names = []
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    mine = {name: crc32(folder / name) for name in names[rank::size]}
    if not dist.is_initialized():
        return mine
    every: list[Any] = [None] * size
    dist.all_gather_object(every, mine, group=group)
    return {name: crc for crcs in every for name, crc in crcs.items()}


def crc32(file: Path, chunk: int = 1 << 24) -> int | None:
    try:
        with open(file, "rb") as f:
            crc = 0
            while block := f.read(chunk):
                crc = zlib.crc32(block, crc)
            return crc
    except OSError:
        return None


def recorded_checksums(path: Path) -> dict[str, int] | None:
    """The checksums the marker holds; None without a marker (a folder DCP wrote alone)."""
    if not (path / MARKER).exists():
        return None
    try:
        recorded = json.loads((path / MARKER).read_text())["crc32"]
        return {str(name): int(crc) for name, crc in recorded.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"autopar: checkpoint {path} is unreadable: its {MARKER} marker could not be read "
                         f"({type(exc).__name__}: {short(exc)}); expected the JSON autopar writes. Nothing was "
                         "loaded; use an older checkpoint (Checkpointer.load(step=...))") from exc


def check_checksums(path: Path) -> None:
    """Before DCP reads: every rank reads the marker and checksums its share of the files
    (``file_checksums``); a file missing or changed is an error on every rank. A folder without
    a marker (DCP's own) is left to ``_check_files``'s lengths."""
    recorded = agreed(lambda: recorded_checksums(path))
    if recorded is None:
        return
    found = file_checksums(path)
    damaged = sorted(name for name, crc in recorded.items() if found.get(name) != crc)
    if damaged:
        raise ValueError(f"autopar: checkpoint {path} is unreadable: files {damaged} are missing or differ from "
                         "what was written (CRC-32 in its COMPLETE marker); expected them unchanged. Nothing was "
                         "loaded; use an older checkpoint (Checkpointer.load(step=...))")


def write_marker(folder: Path, step: int | None, checksums: dict[str, int | None]) -> None:
    """The completion marker, itself written whole (a temporary file renamed) and synced;
    rank 0 writes it."""
    if this_rank() != 0:
        return
    temporary = folder / f".{MARKER}.tmp"
    with open(temporary, "w") as f:
        json.dump({"step": step, "world_size": world_size(), "crc32": checksums}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, folder / MARKER)
