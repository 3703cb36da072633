"""Single-device Mula models: config + presets, the decoder, and conversion with transformers."""

from mula_lightning.models.config import PRESETS, MulaConfig
from mula_lightning.models.linear_cross_entropy import linear_cross_entropy
from mula_lightning.models.transformer import MulaForCausalLM, MulaOutput, init_parameter, init_weights

__all__ = [
    "PRESETS",
    "MulaConfig",
    "MulaForCausalLM",
    "MulaOutput",
    "init_parameter",
    "init_weights",
    "linear_cross_entropy",
]
