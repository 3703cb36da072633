"""One task of ``mula launch --in-job --backend slurm``: the job's rank numbers, a pid file, then the command.

Why: under SLURM an in-job restart starts a single failed rank again in a step of its own (``srun --overlap
--nodes 1 --ntasks 1 --nodelist HOST``, :class:`~mula_lightning.launch.slurm_backend.SlurmAttempt`), where SLURM
numbers the one task 0 of 1. Lightning's ``SLURMEnvironment`` and plain ``torch.distributed`` code read the rank from
the task variables, so this module puts the *job's* numbers there (``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_NTASKS_PER_NODE``, ``SLURM_NNODES``) and torchrun's (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``GROUP_RANK``), for the main step's tasks too
(whose SLURM numbers are the job's already), so that every rank of an in-job launch sees one layout.

It then writes ``CONTROL/KEY.pid`` (``{"host": ..., "pid": ...}``: how the launcher reaches this rank's process to
SIGKILL it or to see it stopped, through ``srun --overlap`` on its node) and replaces itself with the command
(``exec``: the same process id, no process in between to forward signals through or to outlive the rank). The
control folder is the launch's report folder's, which an in-job launch already shares with the ranks (its
announcement file, ``in_job.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["main", "task_env"]


def task_env(
    environ: Mapping[str, str], world_size: int, nproc_per_node: int, rank: int | None = None
) -> dict[str, str]:
    """``environ`` with the job's numbers of this task: ``rank`` (a replacement's), else SLURM's ``SLURM_PROCID``
    (a task of the main step, which SLURM numbers as the job). Refuses a task whose SLURM numbers do not match the
    block layout the launcher assumes (``--distribution=block``: node ``k`` holds ranks ``k*P .. k*P+P-1``)."""
    env = dict(environ)
    if rank is None:
        missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS") if not env.get(k)]
        if missing:
            raise ValueError(f"not a task of an srun step: {', '.join(missing)} unset (give --rank for a replacement)")
        rank, ntasks = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        if ntasks != world_size:
            raise ValueError(f"SLURM_NTASKS={ntasks}, but the launch has {world_size} ranks")
        node = env.get("SLURM_NODEID")
        if node is not None and int(node) != rank // nproc_per_node:
            raise ValueError(
                f"task {rank} runs on node {node} of the step, not on node {rank // nproc_per_node}: the step's tasks "
                f"are not laid out in blocks of {nproc_per_node} (--distribution=block)"
            )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the launch's {world_size} ranks")
    node_rank, local_rank = divmod(rank, nproc_per_node)
    nnodes = world_size // nproc_per_node
    env.update(
        SLURM_PROCID=str(rank),
        SLURM_NTASKS=str(world_size),
        SLURM_LOCALID=str(local_rank),
        SLURM_NODEID=str(node_rank),
        SLURM_NTASKS_PER_NODE=str(nproc_per_node),
        SLURM_NNODES=str(nnodes),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(nproc_per_node),
        NODE_RANK=str(node_rank),
        GROUP_RANK=str(node_rank),
    )
    return env


def pid_file(control: Path, key: str) -> Path:
    """Where the task of ``key`` (``r<rank>.<n>``: the n-th process of that rank in its attempt's steps) writes its
    host and process id."""
    return control / f"{key}.pid"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m mula_lightning.launch.slurm_task [OPTIONS] -- COMMAND ...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="mula_lightning.launch.slurm_task")
    parser.add_argument("--control", required=True, help="the folder of the pid files")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--rank", type=int, default=None, help="a replacement's rank (default: SLURM_PROCID)")
    parser.add_argument("--key", default="", help="the pid file's name (default: r<rank>.0)")
    args = parser.parse_args(argv[:cut])
    command = argv[cut + 1 :]
    if not command:
        print("slurm_task: no command after --", file=sys.stderr)
        return 2
    try:
        env = task_env(os.environ, args.world_size, args.nproc_per_node, args.rank)
    except ValueError as err:
        print(f"slurm_task: {err}", file=sys.stderr)
        return 2
    from mula_lightning.utils.io import atomic_write_text
    from mula_lightning.utils.launch_env import host_name

    control = Path(args.control)
    control.mkdir(parents=True, exist_ok=True)
    key = args.key or f"r{env['RANK']}.0"
    atomic_write_text(pid_file(control, key), json.dumps({"host": host_name(), "pid": os.getpid()}))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(command[0], command, env)  # noqa: S606 - the user's command, as srun would run it
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
