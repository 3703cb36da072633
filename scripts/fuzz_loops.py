"""Search for training loops a strategy gets wrong: ``make fuzz MINUTES=N`` (the differential tester of issue 71).

Draws fresh programs on every layout in turn, in batches, until the time is up: Fabric loop programs
(:func:`mula_lightning.testing.conformance.loop_programs`, checked by
:func:`~mula_lightning.testing.conformance.check_program`) and Trainer programs
(:func:`mula_lightning.testing.trainer_conformance.trainer_programs`, checked by
:func:`~mula_lightning.testing.trainer_conformance.check_trainer_program`), each on its layout's gloo ranks against
one process. A failing program is shrunk by ``hypothesis`` to the smallest one that still fails, and written, as
code a test can paste, with the error, to ``--out`` (one file per failure); the search then goes on. Exit status 1
if anything failed.

    python scripts/fuzz_loops.py --minutes 30 [--kinds fabric,trainer] [--layouts "zero_topo zero3,epso none"]
        [--out fuzz-failures]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings

from mula_lightning.testing.conformance import LAYOUTS, check_program, loop_programs
from mula_lightning.testing.trainer_conformance import TRAINER_LAYOUTS, check_trainer_program, trainer_programs

BATCH = 5  # programs per hypothesis run: the deadline is checked between batches
#: kind -> (the layouts it runs on, the programs' strategy, the check)
KINDS = {
    "fabric": (tuple(LAYOUTS), loop_programs, check_program),
    "trainer": (TRAINER_LAYOUTS, trainer_programs, check_trainer_program),
}


def _batch(kind: str, layout: str) -> None:
    _, programs, check = KINDS[kind]

    @settings(max_examples=BATCH, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(programs(layout))
    def run(program):
        check(program)

    run()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: fabric (loops), trainer")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated keys of LAYOUTS")
    parser.add_argument("--out", default="fuzz-failures", help="folder for failing programs")
    args = parser.parse_args()
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in layouts if name not in LAYOUTS]
    kinds = [name.strip() for name in args.kinds.split(",") if name.strip()]
    if unknown or set(kinds) - set(KINDS):
        parser.error(f"unknown layouts {unknown} or kinds {kinds}; known: {list(LAYOUTS)}, {list(KINDS)}")
    pairs = [(kind, layout) for layout in layouts for kind in kinds if layout in KINDS[kind][0]]
    if not pairs:
        parser.error(f"no layout of {layouts} runs as {kinds}")
    deadline = time.monotonic() + 60 * args.minutes
    failures, batches = 0, 0
    while time.monotonic() < deadline:
        kind, layout = pairs[batches % len(pairs)]
        batches += 1
        try:
            _batch(kind, layout)
        except Exception as error:  # an AssertionError with the program as code, or a rank's traceback
            failures += 1
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"{kind}-{layout.replace(' ', '_')}-{time.strftime('%Y%m%d-%H%M%S')}.txt"
            path.write_text(f"{kind} program on layout: {layout}\n\n{error}\n")
            print(f"FAIL {kind} {layout}: written to {path}", flush=True)
        else:
            print(f"ok   {kind} {layout}: {BATCH} programs", flush=True)
    print(f"{batches * BATCH} programs in {batches} batches of {len(pairs)} kinds x layouts; {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
