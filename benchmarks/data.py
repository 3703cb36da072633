"""Data pipeline benchmark: tokenization throughput and loader overhead, measured side by side in one run.

Run::

    python benchmarks/data.py --max-bytes 8000000 --batches 200

1. Tokenization tokens/s on the embedded corpus (the standard library's ``.py`` sources): a naive single-process
   loop calling ``tokenizer.encode`` once per document, against ``prepare`` with 1 and with 2 workers (batched
   fast-tokenizer calls in worker processes): its tokenize step (worker start-up included) and the whole run
   (plus discovery, checksums, shuffle and shard writes). Contenders run interleaved, best of ``--repeats``.
2. Loader time per micro-batch: ``MulaDataModule``'s training DataLoader against reading the same rows with plain
   numpy from the memory-mapped shard (slice + ``int64`` copy + ``torch.from_numpy``).
3. The loader's share of a ``mula-tiny-moe`` training step: one forward + backward of
   ``MulaForCausalLM(MulaConfig.from_name("mula-tiny-moe"))`` on a batch of the same shape (target: < 1%).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from mula_lightning.data.prepare import prepare
from mula_lightning.data.sources import discover_units, iter_documents
from mula_lightning.data.tokenizer import TRAINED_EOS, load_tokenizer

# torch, Lightning and the model are imported inside the functions that use them: prepare's worker processes are
# spawned, and a spawned child re-imports this script's top level; heavy imports here would be paid per worker.


def naive_tokenize(tokenizer_path: Path, documents: list[str]) -> tuple[int, float, float]:
    """The obvious loop: one ``encode`` call per document in this process, EOS appended, one array at the end.

    The tokenizer is loaded afresh (its word cache cold, like a worker's). Returns (tokens, seconds, seconds).
    """
    tokenizer = load_tokenizer(tokenizer_path)
    eos = tokenizer.token_to_id(TRAINED_EOS)
    start = time.perf_counter()
    ids: list[int] = []
    for doc in documents:
        ids += tokenizer.encode(doc, add_special_tokens=False).ids
        ids.append(eos)
    tokens = np.asarray(ids, dtype=np.uint16)
    seconds = time.perf_counter() - start
    return len(tokens), seconds, seconds


def prepare_once(out: Path, tokenizer: Path, workers: int, max_bytes: int, seq_len: int) -> tuple[int, float, float]:
    """One fresh ``prepare`` run: (tokens, end-to-end seconds, seconds of its tokenize step incl. worker start)."""
    start = time.perf_counter()
    m = prepare(output=str(out), seq_len=seq_len, tokenizer=str(tokenizer), workers=workers, max_bytes=max_bytes,
                progress=False)  # fmt: skip
    return m.content["num_tokens"], time.perf_counter() - start, m.timings["tokenize"]


def loader_times(data_dir: Path, micro_batch_size: int, batches: int, rounds: int) -> tuple[float, float, dict]:
    """Median seconds per batch over interleaved rounds: the DataModule's loader (with its position bookkeeping)
    and plain numpy reads of the same rows from the memory-mapped shard."""
    import torch

    from mula_lightning.data import MulaDataModule

    dm = MulaDataModule(str(data_dir), micro_batch_size=micro_batch_size)
    loader = dm.train_dataloader()
    batches = min(batches, len(loader) - 1)
    shard = np.load(data_dir / dm.manifest.shards("train")[0]["file"], mmap_mode="r")
    first = next(iter(loader))
    origin = dm.state_dict()
    ours, plain = [], []
    for _ in range(rounds):
        it = iter(loader)
        start = time.perf_counter()
        for _ in range(batches):
            next(it)
            dm.mark_consumed()  # the position bookkeeping the Lightning hook does per micro-batch
        ours.append((time.perf_counter() - start) / batches)
        dm.load_state_dict(origin)  # every round reads the same rows
        start = time.perf_counter()
        for i in range(batches):
            rows = torch.from_numpy(shard[i * micro_batch_size : (i + 1) * micro_batch_size].astype(np.int64))
            _ = rows.clone()  # labels, as the loader builds them
        plain.append((time.perf_counter() - start) / batches)
    return statistics.median(ours), statistics.median(plain), first


def train_step_time(batch: dict, repeats: int) -> float:
    """Median seconds of one forward + backward of mula-tiny-moe on ``batch``."""
    from mula_lightning.models import MulaConfig, MulaForCausalLM

    model = MulaForCausalLM(MulaConfig.from_name("mula-tiny-moe"))
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        out = model(batch["input_ids"], labels=batch["labels"])
        (out.loss + out.aux_loss).backward()
        model.zero_grad(set_to_none=True)
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-bytes", type=int, default=8_000_000, help="bytes of the embedded corpus to tokenize")
    parser.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary (mula-tiny-moe uses 4096)")
    parser.add_argument("--seq-len", type=int, default=256, help="context size (mula-tiny-moe: 256)")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=200, help="loader batches to time")
    parser.add_argument("--step-repeats", type=int, default=5, help="timed training steps")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per contender (the best is kept)")
    parser.add_argument("--torch-threads", type=int, default=1, help="intra-op threads of the training step")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.torch_threads)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # Train the tokenizer once (also through prepare, on a prefix) so every contender uses the same one.
        prepare(output=str(root / "tok"), seq_len=args.seq_len, train_tokenizer=args.vocab,
                max_bytes=min(args.max_bytes, 2_000_000), workers=0, progress=False)  # fmt: skip
        tok_path = root / "tok" / "tokenizer.json"
        documents = [d for u in discover_units(None, max_bytes=args.max_bytes) for d in iter_documents(u)]
        runs: dict[str, list[tuple[int, float, float]]] = {"naive": [], "w1": [], "w2": []}
        for r in range(args.repeats):  # interleaved: a burst of load on a shared machine hits every contender
            runs["naive"].append(naive_tokenize(tok_path, documents))
            for w in (1, 2):
                runs[f"w{w}"].append(prepare_once(root / f"w{w}-{r}", tok_path, w, args.max_bytes, args.seq_len))
        (n_naive, t_naive, _), (n_w1, t_w1, k_w1), (n_w2, t_w2, k_w2) = (
            min(v, key=lambda x: x[2]) for v in runs.values()
        )
        assert n_naive == n_w1 == n_w2, (n_naive, n_w1, n_w2)
        ours, plain, batch = loader_times(root / "w1-0", args.micro_batch_size, args.batches, rounds=5)
        step = train_step_time(batch, args.step_repeats)

    naive_tps = n_naive / t_naive

    def tps(tokens: int, seconds: float) -> tuple[str, str]:
        return f"{tokens / seconds / 1e6:.3f} M tok/s", f"{tokens / seconds / naive_tps:.2f}x"

    rows = [
        ("tokenize: naive encode() loop, 1 process", f"{naive_tps / 1e6:.3f} M tok/s", "1.00x"),
        ("tokenize step of prepare, 1 worker", *tps(n_w1, k_w1)),
        ("tokenize step of prepare, 2 workers", *tps(n_w2, k_w2)),
        ("prepare end to end, 1 worker", *tps(n_w1, t_w1)),
        ("prepare end to end, 2 workers", *tps(n_w2, t_w2)),
        ("loader: plain numpy memmap slice", f"{plain * 1e6:.1f} us/batch", "1.00x"),
        ("loader: MulaDataModule train loader", f"{ours * 1e6:.1f} us/batch", f"{ours / plain:.2f}x"),
        ("mula-tiny-moe forward+backward", f"{step * 1e3:.1f} ms/step", ""),
        ("loader / training step", f"{100 * ours / step:.4f} %", "target < 1 %"),
    ]
    shape = f"batch {args.micro_batch_size} x {args.seq_len}"
    print(f"corpus: {n_naive:,} tokens from {args.max_bytes:,} bytes of stdlib sources; {shape}; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    width = max(len(r[0]) for r in rows)
    print(f"| {'measurement':<{width}} | {'value':>16} | {'ratio':>12} |")
    print(f"|{'-' * (width + 2)}|{'-' * 18}|{'-' * 14}|")
    for name, value, ratio in rows:
        print(f"| {name:<{width}} | {value:>16} | {ratio:>12} |")


if __name__ == "__main__":
    main()
