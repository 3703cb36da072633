"""``make drill FAULTS=100 [IN_JOB=1]``: ``mula launch [--in-job]`` through FAULTS faults of mixed kinds drawn
from SEED, ending bit-equal to a straight run; prints the table of BENCHMARKS.md (faults by kind, handled by which
path, time lost per fault and its parts) and writes ``OUT/drill_result.json``. See
:mod:`mula_lightning.testing.drill`."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from mula_lightning.testing.drill import DRILL_KINDS, drill_table, restart_ratio, run_drill


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split(";")[0])
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(DRILL_KINDS), help="comma-separated subset of the fault kinds")
    parser.add_argument("--out", default="runs/drill", help="working directory (straight run, drill, result)")
    parser.add_argument("--data_dir", default="", help="prepared data (default: 300 kB of stdlib text, prepared)")
    parser.add_argument("--in-job", action="store_true", help="mula launch --in-job: restart failed ranks in-job")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(args.data_dir) if args.data_dir else None
    if data_dir is None:
        from mula_lightning.data import prepare

        data_dir = Path(tempfile.mkdtemp(prefix="drill_data_")) / "stdlib"
        prepare(output=str(data_dir), seq_len=32, train_tokenizer=512, max_bytes=300_000, workers=0, progress=False)
    began = time.time()
    result = run_drill(out.resolve(), data_dir.resolve(), args.faults, args.seed, tuple(args.kinds.split(",")),
                       in_job=args.in_job)  # fmt: skip
    print(drill_table(result))
    if args.in_job:
        ratio = restart_ratio(result)
        print(f"in-job / relaunch: restart latency {ratio['restart_in_job_s']:.1f} / {ratio['restart_relaunch_s']:.1f} "
              f"s = {ratio['restart_ratio']}x; time lost per fault {ratio['lost_in_job_s']:.1f} / "
              f"{ratio['lost_relaunch_s']:.1f} s = {ratio['lost_ratio']}x")  # fmt: skip
    print(f"{args.faults} faults (seed {args.seed}), {result['max_steps']} steps in {result['attempts']} attempts: "
          f"every loss bit-equal to the straight run's, 0 lost steps; straight run {result['straight_s']} s, drill "
          f"{result['drill_s']} s, total {time.time() - began:.0f} s; {out / 'drill_result.json'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
