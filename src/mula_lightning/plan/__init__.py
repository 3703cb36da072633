"""plan: what a run needs before it is launched (``mula plan``).

``clusters`` names the machines (devices per node, memory per device); ``states`` gives one rank's model-state bytes
(weights, gradients, fp32 master, AdamW moments) of a Mula model at an ``epso`` or ``zero_topo`` layout, from the
closed forms the optimizers document; ``cli`` is ``mula plan``. Activations, communication volumes, step times, the
layout search and the traced dry run come next (issue 61).
"""

from mula_lightning.plan.clusters import CLUSTERS, Cluster, load_cluster
from mula_lightning.plan.states import Layout, stage_params, state_bytes

__all__ = ["CLUSTERS", "Cluster", "Layout", "load_cluster", "stage_params", "state_bytes"]
