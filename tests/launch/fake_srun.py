"""A stand-in for ``srun`` on a machine without SLURM: logs its command line, runs the step with the local backend
(one process per task, node names from ``--nodelist``) and reports failed tasks with srun's own lines
with srun's own wordings: ``srun: error: HOST: task R: Exited with exit code C``, and for a signal the C library's
name of it (``Killed``, ``Aborted (core dumped)``, ``Segmentation fault (core dumped)``, ...). ``FAKE_NODE_FAILURE=1``
reports a task killed by SIGKILL as ``srun: error: Node failure on HOST`` (SLURM's line when a node dies);
``FAKE_SRUN_NOISE=1`` writes 1 MB of output with invalid UTF-8 bytes (a rank's binary garbage) to stderr first.
SIGTERM stops the step, as srun does.

Each task gets what SLURM gives a task, not torchrun's variables: ``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_NNODES``, ``SLURM_NTASKS_PER_NODE``, ``SLURMD_NODENAME`` (numbered
within this step: the one task of ``--ntasks=1`` is 0 of 1) and the caller's ``MASTER_ADDR`` / ``MASTER_PORT``.
Options without a value (``--overlap``, ``--no-kill``) are accepted; ``--ntasks`` without ``--ntasks-per-node`` is
spread over ``--nodes``.
"""

import json
import os
import signal
import sys
import time

from mula_lightning.launch.backends import LocalAttempt

_TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MULA_NODE_NAME")


def as_task(command: list[str]) -> int:
    """Exec ``command`` with the variables SLURM gives a task (from those the local backend set)."""
    env = dict(os.environ)
    per_node = int(env["LOCAL_WORLD_SIZE"])
    env.update(
        SLURM_PROCID=env["RANK"],
        SLURM_NTASKS=env["WORLD_SIZE"],
        SLURM_LOCALID=env["LOCAL_RANK"],
        SLURM_NODEID=env["GROUP_RANK"],
        SLURM_NNODES=str(int(env["WORLD_SIZE"]) // per_node),
        SLURM_NTASKS_PER_NODE=str(per_node),
        SLURMD_NODENAME=env["MULA_NODE_NAME"],
        MASTER_ADDR=env.pop("FAKE_SRUN_MASTER_ADDR", ""),
        MASTER_PORT=env.pop("FAKE_SRUN_MASTER_PORT", ""),
    )
    for name in _TORCHRUN:
        env.pop(name, None)
    os.execvpe(command[0], command, env)
    return 127


def main(argv: list[str]) -> int:
    if argv[:1] == ["--as-task"]:
        return as_task(argv[1:])
    options, i = {}, 0
    while i < len(argv) and argv[i].startswith("--"):
        key, _, value = argv[i][2:].partition("=")
        options[key] = value
        i += 1
    command = argv[i:]
    with open(os.environ["FAKE_SRUN_LOG"], "a") as fh:
        fh.write(json.dumps(["srun", *argv]) + "\n")
    nodes = options["nodelist"].split(",")
    per_node = int(options.get("ntasks-per-node") or int(options["ntasks"]) // len(nodes))
    env = {**os.environ, "FAKE_SRUN_MASTER_ADDR": os.environ.get("MASTER_ADDR", ""),
           "FAKE_SRUN_MASTER_PORT": os.environ.get("MASTER_PORT", "")}  # fmt: skip
    step = LocalAttempt([sys.executable, __file__, "--as-task", *command], nodes, per_node, env)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    worst = 0

    if os.environ.get("FAKE_SRUN_NOISE"):
        noise = b"\xff\xfe\x80 not utf-8 \xc3\x28" + b"x" * 1000 + b"\n"
        sys.stderr.buffer.write(noise * 1000 + b"\xffno newline for a while " * 2000 + b"\n")
        sys.stderr.buffer.flush()

    def report() -> None:
        nonlocal worst
        for ended in step.poll():
            if ended.code == 0:
                continue
            if ended.code == -signal.SIGKILL and os.environ.get("FAKE_NODE_FAILURE"):
                line = f"srun: error: Node failure on {ended.host}"
            else:
                if ended.code < 0:
                    core = " (core dumped)" if -ended.code in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS) else ""
                    what = signal.strsignal(-ended.code).split(":")[0] + core
                else:
                    what = f"Exited with exit code {ended.code}"
                line = f"srun: error: {ended.host}: task {ended.ranks[0]}: {what}"
            print(line, file=sys.stderr, flush=True)
            worst = max(worst, ended.code if ended.code > 0 else 128 - ended.code)

    while not step.finished():
        if stop:
            step.stop(2.0)
            return 143
        report()
        time.sleep(0.05)
    report()
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
