"""A stand-in for ``scontrol``: ``show hostnames SPEC`` expands with the project's parser; ``--json show job ID``
answers with ``kill_on_node_fail`` from ``FAKE_KILL_ON_NODE_FAIL`` (``1`` / ``0``; unset: SLURM without --json)."""

import json
import os
import sys

from mula_lightning.launch import expand_hostlist


def main(argv: list[str]) -> int:
    if argv[:2] == ["show", "hostnames"]:
        print("\n".join(expand_hostlist(argv[2])))
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
