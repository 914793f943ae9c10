"""``autopar bench``: auto versus manual layouts, predicted and measured, in one command.

``run`` drives it (``autopar.bench.run``); ``workloads`` builds the five model families
at each scale, ``worker`` trains one layout on gloo ranks, ``report`` writes the table.
"""

from autopar.bench.run import MESHES, MODELS, QUICK_LAYOUTS, layout_plans, run

__all__ = ["MESHES", "MODELS", "QUICK_LAYOUTS", "layout_plans", "run"]
