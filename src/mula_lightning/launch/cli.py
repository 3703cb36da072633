"""``mula launch [OPTIONS] -- COMMAND ...``: run COMMAND on N nodes and relaunch it around failed ones.

Examples::

    # a laptop drill: 3 simulated nodes + 1 buffer, one rank each, node1 dies at step 5
    MULA_FAULT="kill@step=5,node=node1" mula launch --nnodes 3 --buffer-nodes 1 --report-dir runs/launch \\
        -- mula fit --config examples/configs/mula-tiny-moe.yaml

    # SLURM: allocate N + B nodes with --no-kill (a failed node must not end the job), run the launcher once
    sbatch --nodes 66 --no-kill --wrap "mula launch --backend slurm --nnodes 64 --buffer-nodes 2 --nproc-per-node 4 \\
        --hang-timeout 900 --report-dir runs/launch -- mula fit --config examples/configs/mula-7b-a1b.yaml"

Exit codes: 0 the command finished; 1 a bad option (one line naming it); 3 out of healthy nodes
(:data:`~mula_lightning.launch.launcher.EXIT_OUT_OF_NODES`); 4 the restarts are used up
(:data:`~mula_lightning.launch.launcher.EXIT_RESTARTS_EXHAUSTED`); 5 non-finite values the model or the data caused
(:data:`~mula_lightning.launch.launcher.EXIT_DIVERGED`: several nodes at once, or the same step again elsewhere;
nobody is evicted); 130 the launcher was stopped (every rank is stopped first). The report is
``REPORT_DIR/launch_report.json``; each rank's output (local backend) is in ``REPORT_DIR/logs/attemptK/NODE.rankR.log``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mula_lightning.launch.launcher import Launcher, LaunchOptions


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mula launch",
        description="Run a command on N nodes; relaunch it from the newest checkpoint around failed nodes.",
        epilog="Everything after -- is the command (mula fit gets --ckpt_path last on every attempt).",
    )
    parser.add_argument("--nnodes", type=int, required=True, help="active nodes every attempt runs on")
    parser.add_argument("--buffer-nodes", type=int, default=0, help="spare nodes that replace failed ones")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node")
    parser.add_argument("--max-restarts", type=int, default=3, help="relaunches before giving up")
    parser.add_argument(
        "--hang-timeout", type=float, default=600.0, help="seconds without a heartbeat = a hang (0: off)"
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=1800.0, help="seconds until the first heartbeat (0: off)"
    )
    parser.add_argument("--grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL on a stop")
    parser.add_argument("--report-dir", default="launch", help="where launch_report.json and the logs go")
    parser.add_argument("--backend", choices=("local", "slurm"), default="local")
    parser.add_argument(
        "--nodes", default="", help="node names, comma-separated (default: the SLURM allocation, or node0..)"
    )
    parser.add_argument("--srun", default="srun", help="the srun executable (slurm backend)")
    parser.add_argument(
        "--srun-args", default="", help="extra srun arguments, space-separated (--srun-args='--mpi=none ...')"
    )
    parser.add_argument(
        "--srun-replace-args",
        default="",
        help="with --in-job --backend slurm: extra srun arguments of the one-task step that restarts a rank "
        "(e.g. --srun-replace-args='--gpus-per-node=4'), space-separated",
    )
    parser.add_argument("--heartbeat-host", default="", help="this host's address as the ranks reach it (slurm)")
    parser.add_argument(
        "--straggler-reports",
        type=int,
        default=3,
        help="straggler reports in a row that make a node slow: replaced at the next relaunch (0: off)",
    )
    parser.add_argument(
        "--in-job",
        action="store_true",
        help="restart a failed rank inside the running job (mula fit, or a Fabric script whose main runs in "
        "run_loop_in_job; under slurm in a one-task srun step beside the job's): the other processes stay, "
        "rejoin and reload (the launcher hosts the job's store, so rank 0 too); a NaN and a second fault during a "
        "restart fall back to a relaunch",
    )
    parser.add_argument(
        "--rejoin-timeout",
        type=float,
        default=300.0,
        help="with --in-job: seconds until every rank reported from the restarted attempt, else a relaunch (0: the "
        "startup timeout)",
    )
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=0.0,
        help="with --in-job: seconds after which a collective of a rank fails (default 0: the startup timeout); "
        "a little above --hang-timeout bounds how long a survivor can stay blocked in a broken attempt",
    )
    parser.add_argument(
        "--spares",
        type=int,
        default=None,
        help="with --in-job: processes kept started with mula fit's imports done, each ready to replace a rank "
        "(default: --nproc-per-node, one node's worth)",
    )
    return parser


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        own, command = argv[:cut], argv[cut + 1 :]
    else:
        own, command = argv, []
    args = build_parser().parse_args(own)
    if not command:
        raise ValueError("no command to launch: mula launch [OPTIONS] -- mula fit --config ...")
    heartbeat_host = args.heartbeat_host
    if args.backend == "slurm" and not heartbeat_host:
        import socket

        heartbeat_host = socket.gethostname()
    options = LaunchOptions(
        command=command,
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        buffer_nodes=args.buffer_nodes,
        max_restarts=args.max_restarts,
        hang_timeout_s=args.hang_timeout,
        startup_timeout_s=args.startup_timeout,
        grace_s=args.grace,
        report_dir=args.report_dir,
        backend=args.backend,
        nodes=[n.strip() for n in args.nodes.split(",") if n.strip()],
        srun=args.srun,
        srun_args=args.srun_args.split(),
        srun_replace_args=args.srun_replace_args.split(),
        heartbeat_host=heartbeat_host,
        straggler_reports=args.straggler_reports,
        in_job=args.in_job,
        spares=args.spares,
        rejoin_timeout_s=args.rejoin_timeout,
        collective_timeout_s=args.collective_timeout,
    )
    return Launcher(options).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
