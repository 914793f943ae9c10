"""The checks a checkpoint load makes before DCP reads, in one process (no ranks): the
COMPLETE marker's CRC-32 of every file, an unreadable marker, a folder without a marker,
and which ``extra`` states a checkpoint holds (the distributed behaviour, every rank
raising alike, is in tests/test_checkpoint_distributed.py). Under a second."""

import json

import pytest

from autopar.runtime import checkpoint, checkpoint_files


def marked_folder(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"shard bytes" * 10)
    (tmp_path / ".metadata").write_bytes(b"metadata")
    checkpoint_files.write_marker(tmp_path, 3, checkpoint_files.file_checksums(tmp_path))
    return tmp_path


def test_marker_records_every_file_and_passes_when_unchanged(tmp_path):
    folder = marked_folder(tmp_path)
    recorded = json.loads((folder / checkpoint.MARKER).read_text())
    assert recorded["step"] == 3 and sorted(recorded["crc32"]) == [".metadata", "__0_0.distcp"]
    checkpoint_files.check_checksums(folder)  # nothing changed: no error


@pytest.mark.parametrize("damage", ["garbled", "removed"])
def test_a_changed_or_missing_file_is_named(tmp_path, damage):
    folder = marked_folder(tmp_path)
    shard = folder / "__0_0.distcp"
    if damage == "garbled":
        shard.write_bytes(bytes(shard.stat().st_size))  # same length, other bytes
    else:
        shard.unlink()
    with pytest.raises(ValueError, match=r"^autopar: .*files \['__0_0.distcp'\] are missing or differ"):
        checkpoint_files.check_checksums(folder)


def test_an_unreadable_marker_is_an_autopar_error(tmp_path):
    folder = marked_folder(tmp_path)
    (folder / checkpoint.MARKER).write_text('{"crc32": {"__0_0.distcp": "not a number"}}')
    with pytest.raises(ValueError, match=r"^autopar: .*COMPLETE marker could not be read"):
        checkpoint_files.check_checksums(folder)


def test_a_folder_without_marker_is_left_to_the_length_checks(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    checkpoint_files.check_checksums(tmp_path)  # DCP's own folder: no checksums to compare


class Counter:
    def __init__(self, n: int = 0):
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_extra_states_name_check_and_per_rank_request(tmp_path):
    saved = {"extra.scheduler.last_epoch": None, f"{checkpoint.PER_RANK}.data.0.n": None}
    shared, per_rank = checkpoint._extra_request(tmp_path, saved, {"scheduler": Counter(), "data": Counter()})
    assert shared == {"scheduler": {"n": 0}} and per_rank == {"data": {"0": {"n": 0}}}
    with pytest.raises(ValueError, match=r"^autopar: .*holds extra state \['data', 'scheduler'\]; load was given"):
        checkpoint._extra_request(tmp_path, saved, {"scheduler": Counter()})
    two_ranks = {**saved, f"{checkpoint.PER_RANK}.data.1.n": None}  # saved by 2 ranks, loaded by 1
    with pytest.raises(ValueError, match=r"^autopar: .*extra state \['data'\] per rank .* 2 ranks that saved"):
        checkpoint._extra_request(tmp_path, two_ranks, {"scheduler": Counter(), "data": Counter()})
