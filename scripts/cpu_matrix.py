"""Run tests under the CPU kernel settings other x86 machines would pick; one pass/fail line per setting.

A parity tolerance that holds only on this CPU (Intel or AMD, AVX2 or AVX-512) fails in CI on another one. This
runs pytest once per setting and prints, per setting, pytest's summary and the worst comparison seen by
:func:`mula_lightning.testing.assert_parity` in each dtype (largest difference / tolerance: below 1 passes; the
closer to 0, the more margin). Comparisons above 1 are counted apart: they are the injected bugs of the mutation
tests, which must fail.

Usage, from the project root (``make test-cpus`` runs the default)::

    .venv/bin/python scripts/cpu_matrix.py                 # the parity and distributed tests (-m distributed)
    .venv/bin/python scripts/cpu_matrix.py tests/parallel -q # any pytest arguments
    .venv/bin/python scripts/cpu_matrix.py --by-file tests/parallel/test_expert_parallel.py  # worst case per file

Exit code 1 when any setting fails.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SETTINGS = ["native", "ATEN_CPU_CAPABILITY=default", "ATEN_CPU_CAPABILITY=avx2", "OMP_NUM_THREADS=1"]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def worst_by_dtype(log: Path, by_file: bool = False) -> tuple[dict[Any, tuple[float, float, str]], int]:
    """Per dtype (and test file): (largest / tol, largest, what) of the comparison with the least margin; and how
    many comparisons were over their tolerance."""
    worst: dict[Any, tuple[float, float, str]] = {}
    over = 0
    if not log.exists():
        return worst, over
    for line in log.read_text().splitlines():
        r = json.loads(line)
        ratio = r["largest"] / r["tol"] if r["tol"] else (0.0 if r["largest"] == 0 else float("inf"))
        if ratio > 1:
            over += 1
            continue
        key = (r.get("test", "").split("::")[0], r["dtype"]) if by_file else r["dtype"]
        if ratio >= worst.get(key, (-1.0,))[0]:
            worst[key] = (ratio, r["largest"], r["msg"])
    return worst, over


def main(argv: list[str]) -> int:
    by_file = "--by-file" in argv
    argv = [a for a in argv if a != "--by-file"]
    args = argv or ["-m", "distributed", "tests"]
    print(f"CPU: {cpu_name()}")
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, setting in enumerate(SETTINGS):
            env = dict(os.environ)
            if setting != "native":
                key, value = setting.split("=", 1)
                env[key] = value
            log = Path(tmp) / f"parity-{i}.jsonl"
            env["MULA_PARITY_LOG"] = str(log)
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            lines = proc.stdout.splitlines()
            summary = next((ln for ln in reversed(lines) if "passed" in ln or "failed" in ln or "error" in ln), "")
            mark = "pass" if proc.returncode == 0 else "FAIL"
            status = status or int(proc.returncode != 0)
            print(f"{setting:<28} {mark:<4} {summary.strip('= ')}")
            worst, over = worst_by_dtype(log, by_file)
            for key, (ratio, largest, what) in sorted(worst.items()):
                label = " ".join(key) if isinstance(key, tuple) else key
                print(f"    {label:<8} worst difference/tolerance {ratio:.3g} (difference {largest:.3g}: {what})")
            if over:
                print(
                    f"    {over} comparison(s) over tolerance (the injected bugs of the mutation tests, or a failure)"
                )
            for ln in lines:
                if ln.startswith(("FAILED", "ERROR")):
                    print(f"    {ln}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
