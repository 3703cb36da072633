"""``mula launch``: run a command on N nodes and relaunch it around failed ones (Aurora paper, Section 4).

* :mod:`~mula_lightning.launch.hostlist`: SLURM host lists (``nid[001-004]``) and the job's allocation;
* :mod:`~mula_lightning.launch.node_pool`: active, buffer and failed nodes; each attempt's choice;
* :mod:`~mula_lightning.launch.backends`: one attempt's processes, on simulated local nodes or one ``srun`` step;
* :mod:`~mula_lightning.launch.launcher`: the attempt loop (failure detection, hang detection, relaunch);
* :mod:`~mula_lightning.launch.report`: ``launch_report.json`` and the event lines;
* :mod:`~mula_lightning.launch.cli`: the ``mula launch`` command.

The ranks' side lives in :mod:`mula_lightning.callbacks`: ``Heartbeat`` (progress, for hang detection),
``FaultInjector`` (``MULA_FAULT`` drills) and ``NaNDetector`` (soft failures, exit code 86).
"""

from mula_lightning.launch.hostlist import allocation_nodes, expand_hostlist
from mula_lightning.launch.launcher import (
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
    EXIT_OUT_OF_NODES,
    EXIT_RESTARTS_EXHAUSTED,
    Launcher,
    LaunchOptions,
)
from mula_lightning.launch.node_pool import NodePool, OutOfNodesError

__all__ = [
    "EXIT_DIVERGED",
    "EXIT_INTERRUPTED",
    "EXIT_OUT_OF_NODES",
    "EXIT_RESTARTS_EXHAUSTED",
    "LaunchOptions",
    "Launcher",
    "NodePool",
    "OutOfNodesError",
    "allocation_nodes",
    "expand_hostlist",
]
