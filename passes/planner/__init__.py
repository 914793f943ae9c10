"""The planner: a captured model on a mesh -> the Plan to run.

``intra_op`` solves one mesh (manual layouts as candidates, recomputation to fit),
``pipeline`` searches stage cuts, micro-batches and schedules over a pipeline axis,
``search`` tries pipeline depths and keeps the fastest plan (``plan_captured``),
``assemble`` turns a solver assignment into a ``Plan``; ``layouts`` holds the manual
layouts, ``pinned`` prices a given layout as published runs ran it, ``microbatch`` the
valid micro-batch counts and ``reasons`` what ``explain()`` says about the choice.
"""
