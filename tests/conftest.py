"""Shared pytest setup: deterministic CPU math, few threads (CI has 2 cores), W&B offline."""

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(1234)
    yield


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """A test that runs Lightning in-process (one device) may leave the default process group initialised; tear it
    down so later tests (notably those that fork the test process) start from a clean torch.distributed state."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A dataset of the embedded corpus: 300 kB of stdlib text, 512-token BPE, 32-token instances."""
    from mula_lightning.data import prepare

    out = tmp_path_factory.mktemp("training_data") / "stdlib"
    prepare(output=str(out), seq_len=32, train_tokenizer=512, max_bytes=300_000, workers=0, progress=False)
    return out
