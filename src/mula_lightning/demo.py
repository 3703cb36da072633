"""``make demo``: a first look at mula_lightning on a laptop CPU.

What it does now: prints the Mula preset table (analytic parameter counts beside the Aurora paper's Table 1),
builds the largest preset on the meta device (no memory), then builds ``mula-tiny-moe`` for real and runs a
forward and backward pass on CPU, printing the losses and timings. Training the tiny MoE with several
processes is added on top of this entry point as the strategies and the data pipeline land.
"""

from __future__ import annotations

import time

import torch

from mula_lightning.models import MulaConfig, MulaForCausalLM
from mula_lightning.models.cli import parameter_table


def main() -> None:
    print("== Mula presets (parameter counts computed from the shapes) ==")
    print(parameter_table())

    print("\n== mula-220b-a10b on the meta device (no memory allocated) ==")
    big = MulaConfig.from_name("mula-220b-a10b")
    with torch.device("meta"):
        model = MulaForCausalLM(big)
    print(f"built {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters as meta tensors")
    del model

    print("\n== mula-tiny-moe: forward + backward on CPU ==")
    torch.manual_seed(0)
    cfg = MulaConfig.from_name("mula-tiny-moe")
    model = MulaForCausalLM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len))
    start = time.perf_counter()
    out = model(tokens, labels=tokens)
    forward_s = time.perf_counter() - start
    start = time.perf_counter()
    (out.loss + out.aux_loss).backward()
    backward_s = time.perf_counter() - start
    grads = sum(p.grad.norm() ** 2 for p in model.parameters() if p.grad is not None) ** 0.5
    print(f"MoE implementation: {cfg.moe_impl}; batch {tuple(tokens.shape)}")
    print(f"LM loss {out.loss.item():.4f} (ln V = {torch.log(torch.tensor(float(cfg.vocab_size))).item():.4f})")
    print(f"aux loss {out.aux_loss.item():.5f} over {len(out.moe_aux)} MoE layers")
    for i, aux in enumerate(out.moe_aux):
        print(f"  layer {i}: tokens per expert {aux.tokens_per_expert.tolist()}")
    print(f"gradient norm {grads.item():.4f}; forward {forward_s * 1e3:.1f} ms, backward {backward_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
