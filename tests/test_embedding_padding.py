"""The vocabulary-parallel embedding keeps ``padding_idx``'s row out of the gradient on the
device that holds that row, and no other row (the rule simulator checks forward values
only; a padding row shows in backward). BART's shared embedding has padding_idx 1."""

import pytest
import torch
from torch.ops import aten

from autopar.passes import rules
from autopar.passes.op_strategies import OpInfo

VOCAB, HIDDEN, DEVICES = 8, 3, 2


@pytest.mark.parametrize("padding_idx", [1, 6, -1])
def test_vocab_parallel_embedding_gradient_keeps_the_padding_row_zero(padding_idx):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64, generator=gen)
    ids = torch.tensor([[1, 6, 2, 7], [0, 1, 6, 5]])
    info = OpInfo.from_call(aten.embedding.default, (weight, ids, padding_idx))
    strategy = next(s for s in rules.strategies_for(info, (DEVICES,)) if s.kernel == "vocab_parallel_embedding")
    upstream = torch.randn(*ids.shape, HIDDEN, dtype=torch.float64, generator=gen)

    whole = weight.clone().requires_grad_()
    (aten.embedding.default(whole, ids, padding_idx) * upstream).sum().backward()

    shards = [w.clone().requires_grad_() for w in weight.chunk(DEVICES)]
    outputs = [rules.run_local(info, strategy, [shard, ids], rules.LocalContext((DEVICES,), (d,)))
               for d, shard in enumerate(shards)]
    (sum(outputs) * upstream).sum().backward()  # the output is a Partial: the devices' sum

    torch.testing.assert_close(sum(outputs), aten.embedding.default(weight, ids, padding_idx), rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat([s.grad for s in shards]), whole.grad, rtol=0, atol=1e-12)
    if padding_idx >= 0:
        assert whole.grad[padding_idx].abs().sum() == 0  # the check has a padding row to miss
