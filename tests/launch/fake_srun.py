"""A stand-in for ``srun`` on a machine without SLURM: logs its command line, runs the step with the local backend
(one process per task, node names from ``--nodelist``) and reports failed tasks with srun's own lines
(``srun: error: HOST: task R: Killed`` / ``Exited with exit code C``). SIGTERM stops the step, as srun does.
"""

import json
import os
import signal
import sys
import time

from mula_lightning.launch.backends import LocalAttempt


def main(argv: list[str]) -> int:
    options, i = {}, 0
    while i < len(argv) and argv[i].startswith("--"):
        key, _, value = argv[i][2:].partition("=")
        options[key] = value
        i += 1
    command = argv[i:]
    with open(os.environ["FAKE_SRUN_LOG"], "a") as fh:
        fh.write(json.dumps(["srun", *argv]) + "\n")
    step = LocalAttempt(command, options["nodelist"].split(","), int(options["ntasks-per-node"]), dict(os.environ))
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    worst = 0

    def report() -> None:
        nonlocal worst
        for ended in step.poll():
            if ended.code == 0:
                continue
            what = "Killed" if ended.code < 0 else f"Exited with exit code {ended.code}"
            print(f"srun: error: {ended.host}: task {ended.ranks[0]}: {what}", file=sys.stderr, flush=True)
            worst = max(worst, ended.code if ended.code > 0 else 137)

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
