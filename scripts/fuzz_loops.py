"""Search for training loops a strategy gets wrong: ``make fuzz MINUTES=N`` (the differential tester of issue 71).

Draws fresh loop programs (:func:`mula_lightning.testing.conformance.loop_programs`) on every layout in turn, in
batches, until the time is up; each program runs on its layout's gloo ranks and in one process
(:func:`~mula_lightning.testing.conformance.check_program`). A failing program is shrunk by ``hypothesis`` to the
smallest one that still fails, and written, as code a test can paste, with the error, to ``--out`` (one file per
failure); the search then goes on. Exit status 1 if anything failed.

    python scripts/fuzz_loops.py --minutes 30 [--layouts "zero_topo zero3,epso none"] [--out fuzz-failures]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings

from mula_lightning.testing.conformance import LAYOUTS, check_program, loop_programs

BATCH = 5  # programs per hypothesis run: the deadline is checked between batches


def _batch(layout: str) -> None:
    @settings(max_examples=BATCH, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(loop_programs(layout))
    def run(program):
        check_program(program)

    run()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated keys of LAYOUTS")
    parser.add_argument("--out", default="fuzz-failures", help="folder for failing programs")
    args = parser.parse_args()
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}; known: {list(LAYOUTS)}")
    deadline = time.monotonic() + 60 * args.minutes
    failures, batches = 0, 0
    while time.monotonic() < deadline:
        layout = layouts[batches % len(layouts)]
        batches += 1
        try:
            _batch(layout)
        except Exception as error:  # an AssertionError with the program as code, or a rank's traceback
            failures += 1
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"{layout.replace(' ', '_')}-{time.strftime('%Y%m%d-%H%M%S')}.txt"
            path.write_text(f"layout: {layout}\n\n{error}\n")
            print(f"FAIL {layout}: written to {path}", flush=True)
        else:
            print(f"ok   {layout}: {BATCH} programs", flush=True)
    print(f"{batches * BATCH} programs in {batches} batches on {len(layouts)} layouts; {failures} failing batches")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
