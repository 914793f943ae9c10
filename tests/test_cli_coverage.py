"""``autopar coverage MODEL`` (issue #18, item 5): the ops without a sharding rule and the
layouts that apply, through the command line's entry point."""

from __future__ import annotations

import torch
from torch import nn

from autopar.cli import main
from autopar.passes import rules
from autopar.passes.planner.layouts import LAYOUTS

UNRULED = "aten.prod.default"  # an op no rule covers (a product of every element): it runs replicated


class _Scan(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = self.up(x)
        return self.down(h * torch.prod(h.sigmoid()))


def scan_model():
    """(model, example_inputs): two linears around an op without a rule."""
    torch.manual_seed(0)
    return _Scan(), (torch.randn(4, 8),)


def test_coverage_lists_the_op_without_a_rule_and_every_layout(capsys):
    assert rules.rule_for(UNRULED) is None  # else pick another op for this test
    assert main(["coverage", "tests.test_cli_coverage:scan_model", "--mesh", "2x2"]) == 0
    out = capsys.readouterr().out
    assert f"no rule: {UNRULED} (1 calls)" in out and "1 without a sharding rule" in out
    assert "aten.linear.default" not in out.split("layouts on")[0]  # ops with rules are not listed
    lines = {line.split()[0]: line for line in out.split("layouts on mesh 2x2:")[1].splitlines()[1:]}
    assert set(lines) == set(LAYOUTS), lines
    assert all("applies, predicted step" in line for line in lines.values()), out


def test_coverage_on_one_axis_says_which_layouts_need_two(capsys):
    assert main(["coverage", "tests.test_cli_coverage:scan_model", "--mesh", "4"]) == 0
    out = capsys.readouterr().out
    assert "tp+dp      does not apply: it needs a mesh of two or more axes" in out
    assert "tp         applies" in out


def test_coverage_of_an_unknown_model_is_a_one_line_error(capsys):
    assert main(["coverage", "no-such-model"]) == 2
    assert capsys.readouterr().err.startswith("autopar: unknown model 'no-such-model'")
