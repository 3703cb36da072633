"""``mula plan --trace`` at the papers' full world sizes: the real set-up code of chosen ranks under torch's fake
process group, against the plan, with its time and peak resident memory (a laptop-class CPU, no accelerator).

Run: ``.venv/bin/python benchmarks/plan_trace.py`` (about a minute). Layouts:

* ``mula-220b-a10b`` at PP 8 x EP 12 x DP 128 on 1,024 Aurora nodes (12,288 ranks), norms, attention and experts
  recomputed (the Aurora paper's largest run), ranks 0, 6143 and 12287;
* ``mula-20b-a2b`` under ``zero_topo``'s 3-level layout with EP 8 on 48 Frontier nodes (384 GCDs, the ZeRO-topo
  paper's largest run), ranks 0, 200 and 383;
* ``mula-100b-a7b`` at PP 4 x EP 12 with TP 4 and sequence parallelism folded over the EP ranks on 256 Aurora nodes
  (3,072 ranks), ranks 0, 1537 and 3071.

Each row: the rank's stage, bytes held by the real objects against the plan per state kind (GB), the flat buffers'
padding, group sizes (``zero_topo``: the engine's weight / secondary / gradient / cross-node / post-step groups of
the dense family and of the expert slices), the checkpoint file and bytes it writes, seconds and the
process's peak resident memory. ``mula plan`` exits 1 where the objects and the plan disagree, so a printed table is
an agreement.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

LAYOUTS = [
    ("220B, PP 8 x EP 12 x DP 128, 12,288 ranks", ["mula-220b-a10b", "--cluster", "aurora", "--nodes", "1024", "--ep",
     "12", "--pp", "8", "--activation-checkpointing", "norm,attention,moe", "--ranks", "0,6143,-1"]),
    ("20B, zero_topo EP 8, 384 GCDs", ["mula-20b-a2b", "--cluster", "frontier", "--nodes", "48", "--strategy",
     "zero_topo", "--ep", "8", "--ranks", "0,200,-1"]),
    ("100B, PP 4 x EP 12 x DP 64, TP 4 + SP folded, 3,072 ranks", ["mula-100b-a7b", "--cluster", "aurora", "--nodes",
     "256", "--ep", "12", "--pp", "4", "--tp", "4", "--sp", "4", "--ranks", "0,1537,-1"]),
]  # fmt: skip


def main() -> int:
    for name, args in LAYOUTS:
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "mula_lightning.cli", "plan", *args, "--trace", "--json"],
                             capture_output=True, text=True)  # fmt: skip
        if run.returncode:
            print(f"{name}: mula plan --trace failed:\n{run.stderr}")
            return 1
        (layout,) = json.loads(run.stdout)["layouts"]
        print(f"== {name}: {time.perf_counter() - start:.0f} s in all (one process, the ranks one after the other)")
        print(f"{'rank':>6} {'stage':>5}  {'weights':>13} {'gradients':>13} {'master':>13} {'moments':>13}  "
              f"{'padding':>8}  {'groups':<48} {'checkpoint':<28} {'s':>5} {'peak GB':>7}")  # fmt: skip
        for t in layout["traced"]:
            planned = layout["stages"][t["stage"]]
            kinds = " ".join(f"{t['memory_bytes'][k] / 1e9:>6.3f}/{planned[k] / 1e9:<6.3f}" for k in
                             ("weights", "gradients", "master", "moments"))  # fmt: skip
            families: dict[str, list[str]] = {}
            for key, members in t["groups"].items():  # zero_topo's "family.kind": sizes per family, in kind order
                family, _, kind = key.rpartition(".")
                families.setdefault(family, []).append(str(len(members)) if family else f"{kind} {len(members)}")
            groups = ", ".join(f"{f} {'/'.join(v)}" if f else ", ".join(v) for f, v in families.items())
            files = "not traced" if t["checkpoint_files"] is None else (
                f"{','.join(t['checkpoint_files'])} {t['checkpoint_bytes'] / 1e9:.2f} GB")  # fmt: skip
            print(f"{t['rank']:>6} {t['stage']:>5}  {kinds}  {t['padding_elements']:>8}  {groups:<48} {files:<28} "
                  f"{t['seconds']:>5.1f} {t['peak_resident_bytes'] / 1e9:>7.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
