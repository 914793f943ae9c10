"""Lowering: a plan to one program per rank.

``codegen`` rewrites the captured graph with each node's local shapes and the collectives
between placements (``collectives``), gradient-sync buckets (``buckets``) and activation
recomputation (``recompute``). The runtime (``autopar.runtime``) runs what this emits.
"""
