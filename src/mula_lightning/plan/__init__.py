"""plan: what a run needs before it is launched (``mula plan``).

``clusters`` names the machines (devices per node, memory per device, a reserve); ``states`` gives one rank's
model-state bytes (weights, gradients, fp32 master, AdamW moments) of a Mula model at an ``epso`` or ``zero_topo``
layout, from the closed forms the optimizers document; ``activations`` what a micro-batch keeps for backward and how
many micro-batches a schedule holds; ``comm`` the bytes of every collective of a step in the ledger's conventions;
``step_time`` predicts a step's time, tokens/s and MFU; ``planner`` puts them together for one layout; ``search``
plans every layout of a model on a cluster; ``trace`` runs the real set-up code of chosen ranks at the full world
size under torch's fake process group and checks it against the plan; ``cli`` is ``mula plan``.
"""

from mula_lightning.plan.clusters import CLUSTERS, Cluster, load_cluster
from mula_lightning.plan.planner import Training, plan_layout
from mula_lightning.plan.states import Layout, stage_params, state_bytes

__all__ = ["CLUSTERS", "Cluster", "Layout", "Training", "load_cluster", "plan_layout", "stage_params", "state_bytes"]
