"""The runtime: what runs during a training step, on every rank.

``module.ParallelModule`` (one program per rank) and ``pipeline.PipelineModule`` (pipeline
stages) run a lowered plan; around them: the loss program (``loss``), how inputs are split
(``batch``), the mesh a program runs on (``meshes``), gradient sync (``gradsync``), ZeRO-1/2
optimizer slices (``zero1``), clipping (``clipping``), compiled programs per input layout
(``variants``), whole state dicts (``state_dicts``), checkpoints (``checkpoint``) and
collective deadlines (``faults``). Nothing here imports the planner or the public API above.
"""
