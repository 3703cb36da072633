"""``mula upcycle``: turn a dense checkpoint into an MoE, written as a Mula model-only checkpoint (and optionally HF).

Example::

    mula upcycle --from /ckpt/llama-3-8b --experts 8 --top-k 2 --out /ckpt/llama-3-8b-e8t2 \\
        --hf-out /ckpt/llama-3-8b-e8t2-hf

``--from`` is a transformers Llama directory (single or sharded safetensors) or a Mula model-only checkpoint.
The MoE is built offline on this machine (every expert); use :func:`mula_lightning.models.upcycle.upcycle`
with ``ep_rank`` / ``ep_size`` to build one expert-parallel rank's experts inside a training job instead.
``--hf-out`` writes the transformers family that computes the same function (Mixtral without q/k-norm, OLMoE
with it); the export is checked before anything is written, so an MoE transformers cannot express (mixed
dense/MoE layers, an un-normalised ``softmax_topk`` router without q/k-norm) fails without leaving files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch
from jsonargparse import ArgumentParser

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="mula upcycle",
        description="Turn a dense checkpoint (a transformers Llama directory or a Mula model-only checkpoint) into "
        "an MoE: each FFN copied into the experts, a random router, everything else copied. Writes a Mula "
        "model-only checkpoint and, with --hf-out, a transformers Mixtral/OLMoE directory.",
    )
    parser.add_argument("--from", dest="source", type=str, required=True, help="dense HF Llama or Mula directory")
    parser.add_argument("--out", type=str, required=True, help="directory of the Mula model-only checkpoint")
    parser.add_argument("--experts", type=int, required=True, help="experts per MoE layer (E)")
    parser.add_argument("--top-k", type=int, required=True, help="experts per token (K)")
    parser.add_argument("--granularity", type=int, default=1, help="experts per FFN copy, each of width I/G")
    parser.add_argument(
        "--router",
        type=Literal["topk_softmax", "softmax_topk"],
        default="topk_softmax",
        help="topk_softmax (Mixtral) preserves the dense function; softmax_topk (ST) does not unless renormalised",
    )
    parser.add_argument("--norm-topk-prob", type=bool, default=False, help="renormalise softmax_topk weights")
    parser.add_argument("--capacity-factor", type=float | None, default=None, help="None = dropless")
    parser.add_argument("--noise", type=float, default=0.0, help="fraction of neurons re-initialised per expert")
    parser.add_argument("--layers", type=str, default="all", help='"all" or comma-separated layer indices')
    parser.add_argument("--seed", type=int, default=0, help="seeds the router and the noise")
    parser.add_argument(
        "--dtype", type=Literal["float32", "bfloat16", "float16"] | None, default=None, help="default: as stored"
    )
    parser.add_argument("--hf-out", type=str | None, default=None, help="also write a transformers directory")
    return parser


def parse_layers(text: str) -> str | list[int]:
    """``"all"`` or a comma-separated list of layer indices (``"0,2,5"``)."""
    if text.strip() == "all":
        return "all"
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise ValueError(f'--layers {text!r} must be "all" or comma-separated integers') from err


def main(argv: Sequence[str] | None = None) -> int:
    from mula_lightning.models.checkpoint_io import load_data_info, save_data_info, save_model_only
    from mula_lightning.models.hf_convert import hf_family, save_hf
    from mula_lightning.models.upcycle import UpcycleSpec, build_upcycled

    args = build_parser().parse_args(list(argv or []))
    spec = UpcycleSpec(
        num_experts=args.experts,
        top_k=args.top_k,
        router=args.router,
        granularity=args.granularity,
        noise=args.noise,
        layers=parse_layers(args.layers),
        seed=args.seed,
        norm_topk_prob=args.norm_topk_prob,
        capacity_factor=args.capacity_factor,
    )
    model = build_upcycled(args.source, spec, dtype=DTYPES[args.dtype] if args.dtype else None)
    config = model.config
    if args.hf_out:
        family = hf_family(config)  # fails here, before any file is written, when HF cannot express the model
    save_model_only(model, args.out)
    data = load_data_info(args.source) if Path(args.source).is_dir() else None
    if data is not None:  # a model-only source trained here: its tokenizer comes along
        save_data_info(args.out, data)
    print(f"upcycled {args.source} -> {args.out}: {config.name}{' (with its tokenizer)' if data else ''}")
    print(
        f"  E={config.num_experts} K={config.top_k} G={args.granularity} router={config.router_kind} "
        f"moe_layers={config.moe_layers or 'all'} expert width={config.intermediate_size}"
    )
    print(f"  parameters: {config.num_params():,} total, {config.num_params(active=True):,} active per token")
    if args.hf_out:
        save_hf(model, args.hf_out)
        print(f"  transformers ({family}) -> {args.hf_out}")
    return 0
