"""Sharding rules, one module per op family, all registered in ``registry``'s table."""

from autopar.passes.rules import (  # noqa: F401  (importing registers the rules)
    attention,
    conv,
    embedding,
    factory,
    indexing,
    loss,
    matmul,
    moe,
    moe_experts,
    norm,
    pointwise,
    random,
    reduction,
    spatial,
    view,
)
from autopar.passes.rules.registry import (
    LocalContext,
    registered_ops,
    rule_for,
    run_local,
    strategies_for,
)

__all__ = ["LocalContext", "registered_ops", "rule_for", "run_local", "strategies_for"]
