"""A stand-in for ``scontrol``: ``show hostnames SPEC`` expands with the project's parser; ``--json show job ID``
answers with ``kill_on_node_fail`` from ``FAKE_KILL_ON_NODE_FAIL`` (``1`` / ``0``; unset: SLURM without --json);
``show node -o HOSTS`` prints one line per node in scontrol's format, ``State=DOWN+NOT_RESPONDING`` for the nodes
named in ``FAKE_DOWN_NODES`` (comma-separated), ``State=ALLOCATED`` for the others."""

import json
import os
import sys

from mula_lightning.launch import expand_hostlist


def main(argv: list[str]) -> int:
    if argv[:2] == ["show", "hostnames"]:
        print("\n".join(expand_hostlist(argv[2])))
        return 0
    if argv[:3] == ["show", "node", "-o"]:
        down = set(filter(None, os.environ.get("FAKE_DOWN_NODES", "").split(",")))
        for host in argv[3].split(","):
            state = "DOWN+NOT_RESPONDING" if host in down else "ALLOCATED"
            print(f"NodeName={host} Arch=x86_64 CoresPerSocket=64 CPUAlloc=128 State={state} ThreadsPerCore=2")
        return 0
    if argv[:3] == ["--json", "show", "job"]:
        if "FAKE_KILL_ON_NODE_FAIL" not in os.environ:
            print("scontrol: unrecognized option '--json'", file=sys.stderr)
            return 1
        job = {"job_id": int(argv[3]), "kill_on_node_fail": os.environ["FAKE_KILL_ON_NODE_FAIL"] == "1"}
        print(json.dumps({"jobs": [job]}))
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
