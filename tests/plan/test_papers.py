"""``mula plan`` reproduces the ZeRO-topo paper's Tables IV-VIII for its four configurations at its largest scale
(48 Frontier nodes x 8 GCDs, 2 per GPU): the sharding factors, the bytes per device of weights and gradients, and
per collective the bytes, the group size ``d`` and the link, each equal to the paper's formula up to our stated
dtypes alone (bf16 weights as the paper's fp16, float32 gradient shards: x2, a float32 scale per 256-element INT8 /
INT4 block: x1.016 / x1.031) and the units' padding (< 0.1%). Aurora Table 1, the 16-bytes rule and EPSO's split are
in ``test_states.py``."""

import pytest

from mula_lightning.models import MulaConfig
from mula_lightning.parallel.hardware import HardwareTopology
from mula_lightning.plan import Layout, stage_params, state_bytes
from mula_lightning.plan.comm import Batch, comm_bytes

W, P, G = 384, 8, 2
Q8, Q4 = 1 + 4 / 256, 1 + 8 / 256


def _paper(name, n):
    """Table IV factors (w, g, o); Tables V-VI bytes; Tables VII-VIII: tag -> (fp16 bytes moved, d, link)."""
    ring = {d: (d - 1) / d for d in (G, P, W)}
    if name == "ZeRO-3":
        factors, weights = (W, W, W), 2 * n / W
        moved = {"weights.forward": (2 * n * ring[W], W, "inter_node"),
                 "weights.backward": (2 * n * ring[W], W, "inter_node"),
                 "grads.reduce_scatter": (2 * n * ring[W], W, "inter_node")}  # fmt: skip
    elif name == "ZeRO++":
        factors, weights = (W, W, W), 2 * n / W + 2 * n / P
        moved = {"weights.forward": (n * ring[W], W, "inter_node"), "weights.backward": (n * ring[P], P, "intra_node"),
                 "grads.reduce_scatter": (n / 2 * ring[W], W, "inter_node")}  # fmt: skip
    else:
        s = int(name[-1])
        factors, weights = (G, P, W), n + n / s
        moved = {"weights.forward": (n * ring[G], G, "gcd"),
                 "weights.backward": (n * ring[s], s, "gcd" if s == G else "intra_node"),
                 "grads.reduce_scatter": (n / 2 * ring[P], P, "intra_node")}  # fmt: skip
    return factors, weights, 2 * n / factors[1], moved


@pytest.mark.parametrize("name, sizes, quantized, weight_ratio", [
    ("ZeRO-3", (W, W, W, W), False, 1.0),
    ("ZeRO++ unquantized secondary", (W, W, W, P), False, 1.0),
    ("ZeRO++", (W, W, W, P), True, None),
    ("Ours: Sec-Degree=8", (G, P, W, P), True, None),
    ("Ours: Sec-Degree=2", (G, P, W, G), True, None),
])  # fmt: skip
def test_zero_topo_tables_iv_to_viii(name, sizes, quantized, weight_ratio):
    """Per configuration: factors equal; weights equal (a quantized secondary: its INT8 and scales, whose bytes are
    checked on their own); gradients x2; each collective's bytes / the paper's = the dtype factor, with its d and
    link."""
    config = MulaConfig.from_name("mula-20b-a2b")
    (stage,) = stage_params(config)
    n = stage.non_expert + stage.expert
    factors, weights, grads, moved = _paper(name.replace(" unquantized secondary", ""), n)
    layout = Layout(W, strategy="zero_topo", zero_sizes=sizes, ranks_per_node=P, ranks_per_gpu=G,
                    extra={"quantize_weights": quantized, "quantize_grads": quantized})  # fmt: skip
    lay = layout.zero_layout()
    assert (lay.weight_size, lay.grad_size, lay.optimizer_size) == factors
    (states,) = state_bytes(config, layout)
    if weight_ratio is not None:  # the paper's secondary is in fp16: ours is too when weights travel unquantized
        assert states["weights"] == pytest.approx(weights, rel=1e-3)
    else:  # primary 2n / w in bf16, secondary n / s in INT8 with a float32 scale per block
        assert states["weights"] == pytest.approx(2 * n / sizes[0] + n / sizes[3] * Q8, rel=1e-3)
    assert states["gradients"] == pytest.approx(2 * grads, rel=1e-3)
    (collectives,) = comm_bytes(config, layout, Batch(1, 2048, 1), HardwareTopology.uniform(W, P, G))
    got = {c.tag: c for c in collectives}
    for tag, (paper_bytes, d, link) in moved.items():
        rs = tag == "grads.reduce_scatter"
        per_element = (Q4 / 2 if rs else Q8) if quantized else (4 if rs else 2)  # bytes an element travels in
        assert (got[tag].group_size, got[tag].link) == (d, link), tag
        assert got[tag].bytes_sent == pytest.approx(n * (d - 1) / d * per_element, rel=1e-3), tag
        if "unquantized" not in name:  # the paper's own row: ours / its bytes is the stated dtype factor
            factor = (Q4 if rs else Q8) if quantized else (2.0 if rs else 1.0)
            assert got[tag].bytes_sent / paper_bytes == pytest.approx(factor, rel=1e-3), tag
