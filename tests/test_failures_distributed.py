"""Any rank's failure reaches every rank at once (``autopar.runtime.faults.shared_failures``),
on 4 gloo processes with the default 30-minute timeout (``tests/distributed/failure_check.py``,
one launch): an error injected on one rank during capture (in ``autopar.compile``), planning
(``autopar.plan`` on every rank), planning in ``autopar.compile`` (rank 0, the others in the
plan's broadcast), a training step and a pipeline stage's step. The failing rank stays alive
with its connections open; every other rank must end on the side channel, well before it
exits, with the failing rank's number and message. Ranks that compiled different plans stop
before their first step, each naming the first collective that differs and the ranks on each
side (``autopar.passes.lowering.agreement``); since every rank raised, the group is sound and
they train on with one plan.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.distributed.failure_check import LINGER_S, SCENARIOS, WORLD

pytestmark = pytest.mark.alone  # it bounds seconds: nothing runs beside it (pyproject's markers)

ALL_EXIT_S = 30.0  # every process of a scenario, from the failure
PEER_EXIT_S = LINGER_S - 2.0  # every other rank: before the failing process ends (its connections close)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("failures")
    done = subprocess.run([sys.executable, "-m", "tests.distributed.failure_check", str(folder)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    return folder, json.loads((folder / "results.json").read_text())


@pytest.mark.parametrize("scenario", [s for s, (failing, _) in SCENARIOS.items() if failing is not None])
def test_failure_on_one_rank_ends_every_rank(launch, scenario):
    folder, results = launch
    r = results[scenario]
    failing, failed_at = r["failing"], r["failed_at"]
    errors = {rank: (folder / f"{scenario}.{rank}.err").read_text() for rank in range(WORLD)}
    assert failed_at is not None, f"the failure was never injected:\n{errors[failing][-3000:]}"
    assert sorted(r["exits"]) == [str(rank) for rank in range(WORLD)], ("a rank did not exit", r)
    injected = f"autopar-test: injected failure in {scenario} on rank {failing}"
    assert injected in errors[failing] and "every other rank was told" in errors[failing], errors[failing][-3000:]
    headlines = set()
    for rank in range(WORLD):
        code, exited = r["exits"][str(rank)]
        assert exited - failed_at < ALL_EXIT_S, (rank, exited - failed_at)
        if rank == failing:
            continue
        assert code in (1, 124), (rank, code, errors[rank][-3000:])
        assert exited - failed_at < PEER_EXIT_S, (rank, exited - failed_at, errors[rank][-3000:])
        headline = next((line for line in errors[rank].splitlines() if f"autopar: rank {failing} failed" in line), "")
        assert injected in headline, (rank, errors[rank][-3000:])
        headlines.add(headline.split("PeerFailure: ")[-1])
    assert len(headlines) == 1, headlines  # the same error on every rank


def test_ranks_that_lowered_different_programs_stop_before_the_first_step_and_can_go_on(launch):
    folder, results = launch
    r = results["disagreement"]
    assert sorted(r["exits"]) == [str(rank) for rank in range(WORLD)], ("a rank did not exit", r)
    for rank in range(WORLD):
        err = (folder / f"disagreement.{rank}.err").read_text()
        code, exited = r["exits"][str(rank)]
        # rank 2 holds its parameters split (FSDP): it gathers first, where the others sum gradients
        assert ("lowered programs that call different collectives on it: collective #1 differs (ranks [0, 1, 3]: "
                "gradient sum of") in err and "ranks [2]: all_gather" in err, err[-3000:]
        # every rank raised, nobody waits: compiled again with one plan, they train on
        assert code == 0 and "TRAINED ON" in err, (rank, code, err[-3000:])
