"""``mula plan`` beside the papers' numbers: Aurora Table 1, the 16-bytes-per-parameter rule and EPSO's split
(Aurora paper, Section 3.2), and the ZeRO-topo paper's Tables IV-VIII (sharding factors, bytes per device per
state, bytes per collective with its group and link) for its four configurations at its largest scale.

Run: ``.venv/bin/python benchmarks/plan_papers.py`` (a second; closed forms, no process group).

ZeRO-topo conventions: the paper counts weights and gradients in fp16 (2 bytes, its ``psi`` in Tables VII-VIII is
the fp16 model in bytes) and INT8 / INT4 without block scales; ours are bf16 weights (2 bytes), float32 gradient
shards (4 bytes: twice the paper's) and a float32 scale per 256-element block (INT8 x 1.016, INT4 x 1.031). Every
ratio printed is ours / the paper's, and each comes from those stated factors alone. The model is ``mula-20b-a2b``
with its experts in the dense units (``ep`` 1; the paper trains the dense GPT-NeoX-20B: the per-``psi`` figures do
not depend on the model), 48 Frontier nodes of 8 GCDs (384 ranks), one micro-batch.
"""

from __future__ import annotations

from mula_lightning.models import MulaConfig
from mula_lightning.parallel.hardware import HardwareTopology
from mula_lightning.plan import Layout, stage_params, state_bytes
from mula_lightning.plan.comm import Batch, comm_bytes

NODES, P, G = 48, 8, 2
WORLD = NODES * P
#: name: (w, g, o, s), quantized collectives
ZERO_TOPO = {
    "ZeRO-3": ((WORLD, WORLD, WORLD, WORLD), False),
    "ZeRO++": ((WORLD, WORLD, WORLD, P), True),
    "Ours: Sec-Degree=8": ((G, P, WORLD, P), True),
    "Ours: Sec-Degree=2": ((G, P, WORLD, G), True),
}


def paper_tables(psi: float) -> dict[str, dict[str, tuple[float, int, str]]]:
    """The paper's Tables V-VIII in bytes (fp16 psi = 2 x elements) per configuration: kind -> (bytes, d, link)."""
    n = psi

    def vol(full: float, d: int) -> float:
        return full * (d - 1) / d

    return {
        "ZeRO-3": {"weights": (2 * n / WORLD, 0, ""), "gradients": (2 * n / WORLD, 0, ""),
                   "weights.forward": (vol(2 * n, WORLD), WORLD, "inter_node"),
                   "weights.backward": (vol(2 * n, WORLD), WORLD, "inter_node"),
                   "grads.reduce_scatter": (vol(2 * n, WORLD), WORLD, "inter_node")},
        "ZeRO++": {"weights": (2 * n / WORLD + 2 * n / P, 0, ""), "gradients": (2 * n / WORLD, 0, ""),
                   "weights.forward": (vol(n, WORLD), WORLD, "inter_node"),
                   "weights.backward": (vol(n, P), P, "intra_node"),
                   "grads.reduce_scatter": (vol(n / 2, WORLD), WORLD, "inter_node")},
        "Ours: Sec-Degree=8": {"weights": (2 * n / 2 + n / 8, 0, ""), "gradients": (2 * n / 8, 0, ""),
                               "weights.forward": (vol(n, G), G, "gcd"),
                               "weights.backward": (vol(n, P), P, "intra_node"),
                               "grads.reduce_scatter": (vol(n / 2, P), P, "intra_node")},
        "Ours: Sec-Degree=2": {"weights": (2 * n / 2 + n / 2, 0, ""), "gradients": (2 * n / 8, 0, ""),
                               "weights.forward": (vol(n, G), G, "gcd"), "weights.backward": (vol(n, G), G, "gcd"),
                               "grads.reduce_scatter": (vol(n / 2, P), P, "intra_node")},
    }  # fmt: skip


def ours(config: MulaConfig, sizes: tuple[int, int, int, int], quantized: bool) -> dict[str, tuple[float, int, str]]:
    """The plan's per-device bytes and per-collective bytes (with group size and link) of one configuration."""
    extra = {"quantize_weights": quantized, "quantize_grads": quantized}
    layout = Layout(WORLD, strategy="zero_topo", precision="bf16-true", zero_sizes=sizes, ranks_per_node=P,
                    ranks_per_gpu=G, extra=extra)  # fmt: skip
    (states,) = state_bytes(config, layout)
    hw = HardwareTopology.uniform(WORLD, P, G)
    (collectives,) = comm_bytes(config, layout, Batch(1, 2048, 1), hw)
    out = {"weights": (states["weights"], 0, ""), "gradients": (states["gradients"], 0, "")}
    for c in collectives:
        out[c.tag] = (c.bytes_sent, c.group_size, c.link)
    lay = layout.zero_layout()
    out["factors"] = ((lay.weight_size, lay.grad_size, lay.optimizer_size), 0, "")
    return out


#: Aurora paper, Table 1: preset -> (total, active) parameters in billions, as printed
TABLE_1 = {"mula-1b": (1.3, 1.3), "mula-7b-a1b": (6.9, 1.3), "mula-20b-a2b": (20, 2.4), "mula-100b-a7b": (100, 7.6),
           "mula-220b-a10b": (220, 10)}  # fmt: skip


def aurora() -> None:
    """Table 1, the 16 bytes per parameter of replicated bf16 AdamW training, EPSO's split (Section 3.2)."""
    print("== Aurora Table 1: parameters (billions), ours / the paper's")
    for name, (total, active) in TABLE_1.items():
        config = MulaConfig.from_name(name)
        print(f"{name:<16} total {config.num_params() / 1e9:7.2f} / {total:<5} active "
              f"{config.num_params(active=True) / 1e9:6.2f} / {active}")  # fmt: skip
    config = MulaConfig.from_name("mula-20b-a2b")
    params = config.num_params()
    (replicated,) = state_bytes(config, Layout(16, mode="none"))
    print(f"\n== bytes per parameter, replicated bf16-true AdamW ({config.name}): ours "
          f"{replicated['total'] / params:.2f} (weights 2 + float32 gradients 4 + master 4 + moments 8); the paper's "
          f"rule 16 (bf16 gradients: ours less 2 = {(replicated['total'] - 2 * params) / params:.2f})")  # fmt: skip
    (so,) = state_bytes(config, Layout(192, ep=12, mode="dp"))
    (epso,) = state_bytes(config, Layout(192, ep=12, mode="ep_aware"))
    (stage,) = stage_params(config)
    saved = so["master"] + so["moments"] - epso["master"] - epso["moments"]
    print(f"== EPSO vs SO at DP 16 x EP 12 ({config.name}), master + moments per rank: SO "
          f"{(so['master'] + so['moments']) / 1e9:.3f} GB, EPSO {(epso['master'] + epso['moments']) / 1e9:.3f} GB; "
          f"the non-expert states ({stage.non_expert / 1e9:.2f} B elements x 12 bytes) sharded over DP x EP = 192 "
          f"instead of DP = 16 ranks (Section 3.2): saved {saved / 1e9:.3f} GB "
          f"= 12 x {stage.non_expert / 1e9:.2f} B x (1/16 - 1/192) = "
          f"{12 * stage.non_expert * (1 / 16 - 1 / 192) / 1e9:.3f} GB\n")  # fmt: skip


def main() -> int:
    aurora()
    config = MulaConfig.from_name("mula-20b-a2b")
    (stage,) = stage_params(config)
    psi = stage.non_expert + stage.expert
    paper = paper_tables(psi)
    print(f"== ZeRO-topo Tables IV-VIII: {config.name} (psi = {psi / 1e9:.2f} B elements), {NODES} Frontier nodes "
          f"x {P} GCDs (2 per GPU), one micro-batch; GB per rank")  # fmt: skip
    print(f"{'configuration':<20} {'quantity':<22} {'ours':>9} {'paper':>9} {'ratio':>7} {'d ours/paper':>13} "
          f"{'link ours / paper':>24}")  # fmt: skip
    for name, (sizes, quantized) in ZERO_TOPO.items():
        mine = ours(config, sizes, quantized)
        print(f"{name:<20} {'factors w, g, o':<22} {str(mine['factors'][0]):>19}  (Table IV)")
        for kind, (value, d, link) in paper[name].items():
            got, got_d, got_link = mine[kind]
            print(f"{'':<20} {kind:<22} {got / 1e9:>9.3f} {value / 1e9:>9.3f} {got / value:>7.3f} "
                  f"{f'{got_d}/{d}' if d else '':>13} {f'{got_link} / {link}' if link else '':>24}")  # fmt: skip
        for kind in ("grads.all_reduce", "weights.post_step"):
            if kind in mine:
                got, got_d, got_link = mine[kind]
                print(f"{'':<20} {kind:<22} {got / 1e9:>9.3f} {'':>9} {'':>7} {got_d:>13} {got_link:>24}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
