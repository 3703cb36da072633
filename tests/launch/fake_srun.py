"""A stand-in for ``srun`` on a machine without SLURM: logs its command line, runs the step with the local backend
(one process per task, node names from ``--nodelist``) and reports failed tasks with srun's own lines
with srun's own wordings: ``srun: error: HOST: task R: Exited with exit code C``, and for a signal the C library's
name of it (``Killed``, ``Aborted (core dumped)``, ``Segmentation fault (core dumped)``, ...). ``FAKE_NODE_FAILURE=1``
reports a task killed by SIGKILL as ``srun: error: Node failure on HOST`` (SLURM's line when a node dies);
``FAKE_SRUN_NOISE=1`` writes 1 MB of output with invalid UTF-8 bytes (a rank's binary garbage) to stderr first.
SIGTERM stops the step, as srun does.
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
