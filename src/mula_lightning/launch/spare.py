"""A warm spare process: ``mula fit`` with its imports done, waiting for the rank it will replace.

Why: in an in-job restart (``mula launch --in-job``) the healthy ranks keep their processes, so what is left of the
restart's latency is the replacement's start: a fresh interpreter spends seconds importing torch, Lightning and this
package (several times that on a loaded node) before it can even join the group. NVIDIA's resiliency extension keeps
reserve processes for the same reason. The local backend therefore keeps spares started (``--spares``): each one
imports what ``mula fit`` imports, then blocks on one line of its standard input, the order::

    {"env": {...the rank's environment...}, "argv": ["fit", "--config", ...], "log": "logs/attempt3/node1.rank3.log"}

and becomes that rank: its output goes to the rank's log, its environment is replaced by the rank's (``RANK``,
``MULA_LAUNCH_ATTEMPT``, ... are read when the Trainer is built, after this), and it runs ``mula`` with ``argv``.
What was read at import time stays as the spare's environment had it: the spare is started with the attempt's
environment, so the settings imports read (``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES`` before CUDA starts, the
logging variables) are the ranks' own. An end of input (the launcher stopped it, or exited) ends the spare.
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["become_rank", "main", "warm_up"]


def warm_up() -> None:
    """Import what every ``mula fit`` imports before its first step (the expensive part of a process's start)."""
    import lightning.pytorch  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import mula_lightning.callbacks  # noqa: F401
    import mula_lightning.data.datamodule  # noqa: F401
    import mula_lightning.lightning_cli  # noqa: F401
    import mula_lightning.lightning_module  # noqa: F401
    import mula_lightning.strategies  # noqa: F401


def become_rank(order: dict) -> int:
    """Take the rank of ``order`` (see the module docstring) and run its command; the exit code."""
    log = order.get("log")
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in order["env"].items()})
    argv = [str(a) for a in order["argv"]]
    sys.argv = ["mula", *argv]
    from mula_lightning.cli import main as mula_main
    from mula_lightning.cli import skip_exit_collection

    code = mula_main(argv)
    skip_exit_collection()  # this process ends next
    return code


def main() -> int:
    warm_up()
    line = sys.stdin.buffer.readline()
    if not line.strip():  # the launcher closed our input: not needed
        return 0
    return become_rank(json.loads(line))


if __name__ == "__main__":
    sys.exit(main())
