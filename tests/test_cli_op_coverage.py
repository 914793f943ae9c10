"""``autopar coverage --ops``: the sharding rules of some ATen ops checked on torch's OpInfo
samples, through the command line's entry point (the whole walk is
``tests/test_rules_opinfo.py``)."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Shard

from autopar.cli import main
from autopar.passes.op_strategies import AxisOption
from autopar.passes.rules import registry

OPS = "aten.roll,aten.tril.default,aten.prod.default"  # two ops with a rule, one core op without


def test_the_table_of_some_ops_says_checked_and_missing(capsys):
    assert registry.rule_for("aten.prod.default") is None  # else pick another op without a rule
    assert main(["coverage", "--ops", OPS]) == 0
    out = capsys.readouterr().out
    rows = {line.split("`")[1]: line for line in out.splitlines() if line.startswith("| `")}
    assert set(rows) == {"aten.roll.default", "aten.tril.default", "aten.prod.default"}, out
    assert rows["aten.roll.default"].endswith("| checked (OpInfo) |")
    assert rows["aten.tril.default"].endswith("| checked (OpInfo) |")
    assert rows["aten.prod.default"] == "| `aten.prod.default` | yes | missing |"
    assert out.startswith("2 checked, 0 covered but not checked, 1 missing; core ATen: 0 of 1 have a rule.")
    assert "Core ATen ops with no rule: `aten.prod.default`." in out
    summary = out.strip().splitlines()[-1]
    assert summary.endswith("strategies checked on 2 ops; 0 wrong") and int(summary.split()[0]) > 20, summary


def _every_dim_kept(info):
    """Wrong for roll: a dim that rolls crosses shard borders, so it cannot keep its split."""
    return [AxisOption((Shard(d),), (Shard(d),)) for d in range(len(info.inputs[0].shape))]


def test_a_wrong_rule_is_reported_with_exit_status_1(capsys, monkeypatch):
    monkeypatch.setitem(registry._RULES, "aten.roll.default", registry.Rule(_every_dim_kept))
    assert main(["coverage", "--ops", "aten.roll"]) == 1
    out = capsys.readouterr().out
    wrong = [line for line in out.splitlines() if line.startswith("wrong: aten.roll.default ")]
    assert wrong and "SimulationMismatch" in out, out


@pytest.mark.parametrize("argv, message", [
    (["coverage", "--ops", "aten.rol"], "autopar: argument --ops: expected ATen op names like aten.roll"),
    (["coverage", "gpt-small", "--ops"], "autopar: coverage --ops checks the rules on torch's op samples, not a model"),
    (["coverage"], "autopar: coverage: expected a MODEL, or --ops"),
])
def test_wrong_arguments_are_one_line_errors(capsys, argv, message):
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own checks exit from inside parse_args
        status = e.code
    err = capsys.readouterr().err
    assert status == 2 and err.startswith(message) and err.count("\n") == 1, (status, err)
