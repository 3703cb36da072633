"""Stage 5 of FastSparseMoE: the weighted reduction of expert outputs back to tokens (Algorithm 1 lines 82-113).

Legend: S = tokens, K = experts per token, RT = routed rows (expert order), H = hidden size.

Forward (lines 82-96): ``out[t] = sum_i weights[t, k_i] * mlp_out[output_indices[i]]`` over the local (token, k)
pairs of token t, accumulated in fp32 in k order. Backward (lines 98-113), per routed row r of token t and
slot k:

* ``mlp_out_grad[r] = weights[t, k] * out_grad[t]``;
* ``weights_grad[t, k] = <mlp_out[r], out_grad[t]>`` (fp32), zero for pairs not routed here.

Every output element is written by exactly one reduction with a fixed order (no atomics, no scatter-add), so
forward and backward are bit-reproducible. The rows are visited in cache-sized chunks on CPU
(:func:`~mula_lightning.moe.dispatch.row_chunks`), which avoids the (RT, H) temporaries an unfused version makes.

With expert parallelism the result is this rank's partial sum over its local experts; the caller reduce-scatters
it (line 116).
"""

from __future__ import annotations

import torch

from mula_lightning.moe.dispatch import DispatchPlan, reduce_rows_to_tokens, row_chunks


class CombineExpertOutputs(torch.autograd.Function):
    """``ExpertOutputReduction`` of Algorithm 1 as an autograd function (see the module docstring)."""

    @staticmethod
    def forward(
        ctx, mlp_out_RH: torch.Tensor, weights_SK: torch.Tensor, plan: DispatchPlan, reuse_dead_activations: bool
    ) -> torch.Tensor:
        out_SH = reduce_rows_to_tokens(mlp_out_RH, plan, weights_SK)
        ctx.save_for_backward(mlp_out_RH, weights_SK)
        ctx.plan = plan
        ctx.reuse = reuse_dead_activations
        return out_SH.to(mlp_out_RH.dtype)

    @staticmethod
    def backward(ctx, grad_out_SH: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        mlp_out_RH, weights_SK = ctx.saved_tensors
        plan: DispatchPlan = ctx.plan
        grad_out_SH = grad_out_SH.contiguous()
        num_rows, hidden = mlp_out_RH.shape
        weights_R = weights_SK.reshape(-1).index_select(0, plan.row_slot)  # router weight of each routed row
        # mlp_out is dead once its rows have given the weight gradients: its storage can receive mlp_out_grad chunk by
        # chunk (no new (RT, H) buffer; a second backward through the same graph then fails on the version check).
        reuse = ctx.reuse and not torch.is_grad_enabled()
        grad_mlp_out_RH = mlp_out_RH if reuse else torch.empty_like(mlp_out_RH)
        acc_dtype = torch.promote_types(mlp_out_RH.dtype, torch.float32)
        grad_weights_R = torch.empty(num_rows, dtype=acc_dtype, device=mlp_out_RH.device)
        for c in row_chunks(num_rows, hidden * 4, mlp_out_RH.device):
            grad_CH = grad_out_SH.index_select(0, plan.input_indices[c])  # out_grad[t] of each row
            torch.linalg.vecdot(mlp_out_RH[c].to(acc_dtype), grad_CH.to(acc_dtype), out=grad_weights_R[c])  # l.108
            torch.mul(grad_CH, weights_R[c].unsqueeze(-1), out=grad_mlp_out_RH[c])  # line 107 (fp32 math)
        grad_weights_SK = None
        if ctx.needs_input_grad[1]:
            grad_weights_SK = torch.zeros(weights_SK.numel(), dtype=acc_dtype, device=weights_SK.device)
            grad_weights_SK.index_copy_(0, plan.row_slot, grad_weights_R)  # each slot written once
            grad_weights_SK = grad_weights_SK.view_as(weights_SK).to(weights_SK.dtype)
        return grad_mlp_out_RH, grad_weights_SK, None, None


def combine_expert_outputs(
    mlp_out_RH: torch.Tensor,
    weights_SK: torch.Tensor | None,
    plan: DispatchPlan,
    reuse_dead_activations: bool = False,
    backend: str = "grouped_mm",
) -> torch.Tensor:
    """(RT, H) expert outputs and (S, K) router weights -> (S, H) block output (in ``mlp_out_RH``'s dtype).

    Args:
        mlp_out_RH: expert outputs in routed order.
        weights_SK: router weights; None when the Triton experts applied them to the rows (the rows are summed).
        plan: the dispatch plan.
        reuse_dead_activations: write ``mlp_out_grad`` into ``mlp_out_RH``'s storage in backward (only when nothing
            else reads ``mlp_out_RH``; the graph can then be backpropagated once).
        backend: the experts' resolved backend: ``"triton"`` combines in the Triton kernels
            (:class:`~mula_lightning.moe.triton_experts.TritonCombine`), anything else here.
    """
    if backend == "triton":
        from mula_lightning.moe.triton_experts import TritonCombine

        return TritonCombine.apply(mlp_out_RH, weights_SK, plan, reuse_dead_activations)
    if weights_SK is None:
        raise ValueError("rows weighted by the experts are combined by the Triton backend only")
    return CombineExpertOutputs.apply(mlp_out_RH, weights_SK, plan, reuse_dead_activations)
