"""Checkpoints and faults on real processes (gloo, CPU): autopar.runtime.checkpoint.Checkpointer and
autopar.runtime.faults.

- Resuming reproduces the uninterrupted run's losses bit-exactly (``==``) with dropout 0.1
  and an LR warm-up (LambdaLR as ``extra``, kept once) and a per-rank data position (kept
  per rank), for DP (each rank seeded on its own), FSDP, TP+DP and a pipeline (1F1B; every
  rank seeded alike), saves synchronous and asynchronous, the two newest kept; ranks
  seeded apart: no warning at save (dropout reads the module's random stream, not their
  generators), each rank's own generator state and the stream restored at load; an asynchronous save returns while its disk writes are held back; a checkpoint
  loads into another layout and mesh; ``full_state_dict`` and ``export`` give what
  ``model.load_state_dict`` and Hugging Face's ``from_pretrained`` read; another model's,
  a damaged (shard, metadata, marker; with or without a marker) or an unmarked checkpoint
  is refused with an ``autopar:`` error on every rank and leaves the module as it was.
- A rank killed by SIGKILL inside a save: a fresh launch resumes from the last complete
  checkpoint and reproduces the uninterrupted losses exactly.
- A rank that dies or hangs mid-step, launched without torchrun: the other exits with an
  ``autopar:`` message within the deadline (``autopar.runtime.faults.deadline``).
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

RESUMED = ["resume-seeded:4:dp", "resume:4:fsdp", "resume:2x2:tp+dp", "resume:2x2:pp:1F1B:2:1"]
RESHARDED = ["reshard:4:dp:2x2:tp+dp", "reshard:4:fsdp:2x2:pp:1F1B:2:1"]
EXPORTED = ["export:4:fsdp", "export:2x2:pp:1F1B:2:1"]
KILL_STEPS, KILLED_AT = 8, 6  # checkpoints after every second step; a rank dies inside the 6th's save
DEADLINE = 10.0  # seconds (autopar.runtime.faults.deadline) around each step of the fault test
SLACK = 20.0  # start-up of the exit on a loaded 2-core machine


def torchrun(root: Path, cases: list[str], env: dict | None = None) -> tuple[int, dict[str, dict]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           "-m", "tests.distributed.checkpoint_check", str(root), *cases]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            try:  # ranks that fail all report, and their lines may interleave: those are kept as text
                result = json.loads(line.removeprefix("RESULT "))
            except json.JSONDecodeError:
                results.setdefault("_garbled", []).append(line)
                continue
            results[result["case"]] = result
    return done.returncode, results | {"_stderr": done.stderr[-3000:]}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    code, found = torchrun(tmp_path_factory.mktemp("ckpt"), [*RESUMED, "rng:2x2:tp+dp", *RESHARDED, *EXPORTED, "hf-export", "async", "errors"])
    assert code == 0, found["_stderr"]
    return found


@pytest.mark.parametrize("case", RESUMED)
def test_resume_is_exact(results, case):
    r = results[case]
    assert "error" not in r, r["error"]
    assert r["start"] == 4 and r["kept"] == [3, 4]  # saves after steps 1-4, two kept
    assert r["resumed"] == r["uninterrupted"], r  # bit-exact: RNG (dropout), LR schedule, optimizer
    assert r["lr_at_load"] == r["lr_expected"]  # the warm-up's learning rate, from param_groups
    assert r["plan_saved"]  # plan.json: the plan that saved
    assert r["dropout_active"] in (True, None)  # None: not probed (a pipeline)
    assert all(loaded == saved for loaded, saved in r["positions"]), r["positions"]  # each rank's own
    assert len({saved for _, saved in r["positions"]}) == 4  # four different positions
    entries = r["extra_entries"]  # the scheduler once, the data position once per rank
    assert any(e.startswith("extra.scheduler.") for e in entries) and not any(".scheduler." in e for e in entries
                                                                           if e.startswith("extra_per_rank."))
    assert sorted(e for e in entries if e.startswith("extra_per_rank.data.")) == [
        f"extra_per_rank.data.{rank}.consumed" for rank in range(4)], entries


def test_each_rank_gets_its_own_rng_state_and_the_module_its_random_stream(results):
    r = results["rng:2x2:tp+dp"]
    assert "error" not in r, r["error"]
    assert len(set(r["saved"])) == 4 and not r["warned"], r  # seeded one by one: nothing to warn of
    assert r["loaded"] == r["saved"], r  # each rank its own generator back
    assert r["draws_loaded"] == r["draws_saved"] and r["draws_saved"]["count"] >= 1, r


@pytest.mark.parametrize("case", RESHARDED)
def test_resume_into_another_layout(results, case):
    r = results[case]
    assert "error" not in r, r["error"]
    assert r["start"] == 3
    assert r["loss_err"] < 1e-9, r


@pytest.mark.parametrize("case", EXPORTED)
def test_full_state_dict_and_export(results, case):
    r = results[case]
    assert "error" not in r, r["error"]
    assert r["names_match"] and r["params_match"]
    assert r["load_state_dict"] == {"missing": [], "unexpected": []} and r["exported_equal"]
    assert r["buffer"] == 2.0 and r["buffer_loaded"] == 2.0  # a checkpoint carries buffers


def test_export_reads_in_from_pretrained(results):
    r = results["hf-export"]
    assert "error" not in r, r["error"]
    assert r["from_pretrained_equal"] and r["tied"]


def test_wrong_or_damaged_checkpoints_are_refused(results):
    r = results["errors"]
    assert "error" not in r, r["error"]
    messages = r["messages"]
    assert all(m.startswith("autopar:") for m in messages.values()), messages
    assert "missing ['buffers.scale', 'model.inner." in messages["other model"]
    assert "unexpected ['model.blocks.0." in messages["other model"]
    assert "holds extra state ['scheduler']; load was given ['schedule']" in messages["extra names"]
    assert "differ from what was written" in messages["truncated shard"] and ".distcp" in messages["truncated shard"]
    assert "differ from what was written" in messages["garbled shard"] and ".distcp" in messages["garbled shard"]
    assert "differ from what was written" in messages["garbled metadata"] and ".metadata" in messages["garbled metadata"]
    assert "marker could not be read" in messages["garbled marker"]
    assert "differ from what was written" in messages["garbled, plain"] and ".distcp" in messages["garbled, plain"]
    assert "is unreadable (CheckpointException" in messages["garbled, no marker"]
    assert "shorter than its metadata says" in messages["truncated, no marker"]
    for name in messages:  # every rank refused, with an autopar: error (none left waiting)
        assert all(m[name].startswith("autopar:") for m in r["every_rank"]), (name, [m[name] for m in r["every_rank"]])
    assert all(r["untouched"].values()), r["untouched"]
    assert r["without_marker_ignored"]
    assert r["nothing_yet"] is None  # no checkpoint under the root: load returns None


def test_asynchronous_save_does_not_wait_for_the_disk(results):
    r = results["async"]
    assert "error" not in r, r["error"]
    assert r["returned_s"] < r["held_s"] / 2, r  # returned while the writes were held back
    assert r["complete_while_held"] == [] and r["complete_after"] == [1], r


def test_kill_during_save_then_resume(tmp_path):
    spec = f"train:{KILL_STEPS}:{KILLED_AT}"
    code, killed = torchrun(tmp_path, [spec], {"AUTOPAR_KILL_RANK": "1"})
    # the others fail when their peer is gone (or are torn down first): no run finished
    assert code != 0 and "error" in killed.get(spec, {"error": "none reported"}), "a rank was to die inside the save"
    complete = sorted(p.name for p in (tmp_path / "run").iterdir() if (p / "COMPLETE").is_file())
    assert complete == ["step_00000002", "step_00000004"], complete
    code, found = torchrun(tmp_path, [f"after-kill:{KILL_STEPS}"])
    r = found.get("after-kill", {"error": found["_stderr"]})
    assert code == 0 and "error" not in r, r.get("error")
    assert r["found"] == [2, 4] and r["start"] == 4
    assert r["resumed"] == r["uninterrupted"], r


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_without_torchrun(mode: str) -> list[subprocess.Popen]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE="2")
    return [subprocess.Popen([sys.executable, "-m", "tests.distributed.fault_check", mode, "1", str(DEADLINE)],
                             env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(2)]


def _exit_times(processes: list[subprocess.Popen], timeout: float) -> list[float]:
    """When each process exited (wall clock, polled every 0.1 s)."""
    times: dict[int, float] = {}
    end = time.time() + timeout
    while len(times) < len(processes) and time.time() < end:
        for i, process in enumerate(processes):
            if i not in times and process.poll() is not None:
                times[i] = time.time()
        time.sleep(0.1)
    assert len(times) == len(processes), "a surviving rank did not exit"
    return [times[i] for i in range(len(processes))]


@pytest.mark.alone  # it bounds seconds: nothing runs beside it (pyproject's markers)
def test_rank_dies_or_hangs_others_exit_bounded():
    launches = {mode: _launch_without_torchrun(mode) for mode in ("die", "hang")}  # both at once: start-up is slow
    try:
        exited = _exit_times([survivor for survivor, _ in launches.values()], timeout=600)
        for (mode, (survivor, failing)), exit_time in zip(launches.items(), exited):
            out, err = survivor.communicate()
            failing_step = [float(line.split()[2]) for line in out.splitlines() if line.startswith("STEP 2 ")]
            assert failing_step, f"{mode}: the survivor never reached the failing step:\n{err[-2000:]}"
            assert survivor.returncode in (1, 124), (mode, survivor.returncode, err[-2000:])
            assert "autopar: rank 0:" in err, err[-2000:]
            assert exit_time - failing_step[0] < DEADLINE + SLACK, (mode, exit_time - failing_step[0])
    finally:
        for survivor, failing in launches.values():
            for process in (survivor, failing):
                if process.poll() is None:
                    process.kill()
                process.wait()
