"""Communication that runs beside compute, as the solver's ``Overlap`` streams
(``autopar.costmodels.overlap``): which parameter edges' collectives the runtime overlaps, and
the compute of each window they run beside, for ``autopar.passes.costing.build_costs``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from torch import fx

from autopar import costmodels
from autopar.passes.edge_costs import EdgeInput, EdgePricer
from autopar.passes.solve import Overlap


def beside_tables(edge_prices: list[EdgeInput], pricer: EdgePricer,
                  allowed: Mapping[fx.Node, np.ndarray] | None) -> dict[str, dict[int, tuple]]:
    """Window -> edge index -> (seconds run beside its compute, seconds hidden) per pair of
    strategies, for the parameters' edges whose collectives the runtime overlaps
    (``EdgePricer.beside``); empty where the profile hides nothing."""
    out: dict[str, dict[int, tuple]] = {}
    if not any(costmodels.hidden_share(pricer.profile.overlap, kind) for kind in costmodels.WINDOW):
        return out
    for window in sorted(set(costmodels.WINDOW.values())):
        for e, edge in enumerate(edge_prices):
            if not edge.regather:
                continue
            rows = cols = None
            if allowed is not None:
                rows, cols = allowed[edge.producer.node], allowed[edge.consumer.node]
            busy, hidden = pricer.beside(edge, window, rows, cols)
            if np.any(hidden[np.isfinite(hidden)] > 0):
                out.setdefault(window, {})[e] = (busy, hidden)
    return out


def overlaps(nodes: list[fx.Node], compute: list[np.ndarray], forward: list[np.ndarray],
             tables: dict[str, dict[int, tuple]], runs: int = 1, once: Sequence[np.ndarray] = ()) -> list[Overlap]:
    """The problem's ``Overlap`` per window: the forward compute of the graph's nodes, or the
    rest of their compute (backward, and a recomputed layer's forward again; not the ZeRO
    nodes' optimizer step, which runs after backward). A step of ``runs`` accumulated
    micro-batches (``compute`` and ``forward`` the sum of them, ``once``: per edge, where it moves
    once per step, ``EdgePricer.once_per_step``) runs what each micro-batch moves beside all of
    them, and its gradient sync beside the last micro-batch's backward alone."""
    if runs > 1:
        each: dict[str, dict[int, tuple]] = {}
        last: dict[str, dict[int, tuple]] = {}
        for window, edges in tables.items():
            for e, (busy, hidden) in edges.items():
                step = once[e]
                each.setdefault(window, {})[e] = (np.where(step, 0.0, busy * runs), np.where(step, 0.0, hidden * runs))
                last.setdefault(window, {})[e] = (np.where(step, busy, 0.0), np.where(step, hidden, 0.0))
        one = [c / runs for c in compute], [f / runs for f in forward]
        return overlaps(nodes, compute, forward, each) + overlaps(nodes, *one, last)
    out = []
    for window, edges in sorted(tables.items()):
        if window == "forward":
            seconds = [forward[v] for v in range(len(nodes))]
        else:
            seconds = [compute[v] - forward[v] for v in range(len(nodes))]
        out.append(Overlap(window=seconds, busy={e: b for e, (b, _) in edges.items()},
                           hidden={e: h for e, (_, h) in edges.items()}))
    return out
