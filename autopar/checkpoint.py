"""``autopar.checkpoint``: checkpoints of a compiled module that reshard on load, and whole
weights for ``load_state_dict`` (the public names of ``autopar.runtime.checkpoint``, where
they are documented).

    from autopar.checkpoint import Checkpointer
    saver = Checkpointer(pm, "ckpt/", keep=3)
"""

from autopar.runtime.checkpoint import Checkpointer, Stateful, export, load, save

__all__ = ["Checkpointer", "Stateful", "export", "load", "save"]
