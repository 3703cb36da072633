"""The token-dispatcher seam of FastSparseMoEBlock: one forward, the transport swappable.

A block built from an ``MoEConfig`` carries a ``LocalDispatcher``; any ``TokenDispatcher`` set in its place carries
the tokens instead, with the same result when the transport is faithful and a different one when it is not.
"""

import pytest
import torch

from mula_lightning.moe import FastSparseMoEBlock, MoEConfig, ReferenceMoEBlock
from mula_lightning.moe.combine import combine_expert_outputs
from mula_lightning.moe.dispatch import build_dispatch_plan
from mula_lightning.moe.token_dispatcher import DispatchedTokens, LocalDispatcher, TokenDispatcher
from mula_lightning.testing import assert_parity

CFG = MoEConfig(hidden_size=12, intermediate_size=10, num_experts=6, top_k=2)


class ShuffledLoopback(TokenDispatcher):
    """A transport that "sends" the tokens in a random order (as a real exchange would reorder them) and brings
    the outputs back to their source order; ``faithful=False`` forgets to undo the permutation."""

    name = "shuffled"

    def __init__(self, num_experts, faithful=True):
        super().__init__(num_experts)
        self.faithful = faithful

    def dispatch(self, x_SH, routed, dropless=False):
        perm = torch.randperm(x_SH.shape[0], generator=torch.Generator().manual_seed(7))
        plan = build_dispatch_plan(routed.indices_SK[perm], self.num_experts, self.n_start, self.n_end)
        return DispatchedTokens(x_SH=x_SH[perm], plan=plan, weights_SK=routed.weights_SK[perm], state=perm)

    def combine(self, y_RH, tokens, reuse_dead_activations=False):
        out = combine_expert_outputs(y_RH, tokens.weights_SK, tokens.plan, reuse_dead_activations)
        if not self.faithful:
            return out
        return out.index_select(0, torch.argsort(tokens.state))


def _block(dtype=torch.float64):
    torch.manual_seed(0)
    block = FastSparseMoEBlock(CFG).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    return block


def _forward_backward(block, x):
    x = x.clone().requires_grad_(True)
    out, aux = block.forward_with_aux(x)
    (out.square().sum() + aux.aux_loss).backward()
    return out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


def test_default_block_uses_the_local_dispatcher_over_every_expert():
    """A fresh block moves tokens with a LocalDispatcher that holds all experts [0, E-1]."""
    block = FastSparseMoEBlock(CFG)
    assert isinstance(block.dispatcher, LocalDispatcher)
    assert (block.n_start, block.n_end) == (0, CFG.num_experts - 1)
    assert "LocalDispatcher(local, experts [0, 5] of 6)" in repr(block)


def test_a_swapped_transport_carries_the_tokens_and_the_gradients():
    """A transport that reorders tokens and restores them gives the reference block's output and every gradient
    (float64); one that forgets to restore the order does not: the block's result really flows through it."""
    x = torch.randn(3, 7, CFG.hidden_size, dtype=torch.float64)
    reference = ReferenceMoEBlock(CFG).to(torch.float64)
    reference.load_state_dict(_block().state_dict())
    ref_out, ref_x_grad, ref_grads = _forward_backward(reference, x)
    block = _block()
    block.dispatcher = ShuffledLoopback(CFG.num_experts)
    out, x_grad, grads = _forward_backward(block, x)
    n = CFG.hidden_size + 2 * CFG.intermediate_size + CFG.num_experts + CFG.top_k
    assert_parity(out, ref_out, reduction_len=n)
    assert_parity(x_grad, ref_x_grad, reduction_len=n)
    for name, grad in grads.items():
        assert_parity(grad, ref_grads[name], reduction_len=21 * n, msg=name)
    broken = _block()
    broken.dispatcher = ShuffledLoopback(CFG.num_experts, faithful=False)
    with pytest.raises(AssertionError):
        assert_parity(_forward_backward(broken, x)[0], ref_out, reduction_len=n)


def test_expert_range_is_checked():
    """A dispatcher whose local experts fall outside [0, E) is refused with the values named."""
    with pytest.raises(ValueError, match=r"n_start=2, n_end=6.*num_experts=6"):
        LocalDispatcher(6, 2, 6)
    assert LocalDispatcher(8, 2, 5).num_local_experts == 4
