"""The node pool: failed nodes are replaced by buffer nodes in place, suspects only after repeated first failures,
and running out of nodes is an error that names the failed ones."""

import pytest

from mula_lightning.launch.node_pool import SUSPECT_LIMIT, NodePool, OutOfNodesError


def test_failed_nodes_are_replaced_in_place_by_buffer_nodes():
    """A failed node's position (its node rank) goes to the first buffer node; healthy nodes keep theirs."""
    pool = NodePool(["n0", "n1", "n2", "b0", "b1"], nnodes=3)
    assert pool.choose() == ["n0", "n1", "n2"] and pool.buffer == ["b0", "b1"]
    pool.mark_failed("n1", "killed")
    assert pool.choose() == ["n0", "b0", "n2"]
    pool.mark_failed("n0", "nan")
    assert pool.choose() == ["b1", "b0", "n2"] and pool.buffer == []
    pool.mark_failed("n2", "hang")
    with pytest.raises(OutOfNodesError) as err:
        pool.choose()
    text = str(err.value)
    assert "3 needed, 2 healthy left of 5" in text and "n1 (killed)" in text and "n2 (hang)" in text


def test_suspects_are_taken_out_only_after_failing_first_in_a_row():
    """A node that fails first once stays; failing first SUSPECT_LIMIT times in a row takes it out; another node
    failing first in between resets the count."""
    pool = NodePool(["n0", "n1", "b0"], nnodes=2)
    assert SUSPECT_LIMIT == 2
    assert not pool.mark_suspect("n1", "exit 1")
    assert not pool.mark_suspect("n0", "exit 1")  # the chain of n1 is broken
    assert not pool.mark_suspect("n1", "exit 1")
    assert pool.mark_suspect("n1", "exit 1")
    assert "n1" in pool.failed and "2 attempts in a row" in pool.failed["n1"]
    assert pool.choose() == ["n0", "b0"]


def test_slow_nodes_are_replaced_while_buffer_nodes_last_and_kept_otherwise():
    """A straggler (slow) keeps its place until the next relaunch (an in-job restart keeps it); then it is
    replaced in place by a buffer node and failed with its reason, after the failed nodes took the buffer nodes they
    need; with none left it stays."""
    pool = NodePool(["n0", "n1", "n2", "b0"], nnodes=3)
    pool.choose()
    pool.mark_slow("n2", "straggler in 3 reports")
    pool.mark_slow("n0", "straggler in 3 reports")
    pool.mark_failed("n1", "killed")
    assert pool.choose() == ["n0", "b0", "n2"]  # the failed node first; no buffer node is left for the slow ones
    assert set(pool.slow) == {"n0", "n2"} and "n2" not in pool.failed
    pool = NodePool(["n0", "n1", "b0"], nnodes=2)
    pool.mark_slow("n1", "straggler in 3 reports")
    assert pool.choose(swap_slow=False) == ["n0", "n1"] and "n1" in pool.slow  # an in-job restart keeps live nodes
    assert pool.choose() == ["n0", "b0"] and pool.failed == {"n1": "straggler in 3 reports"} and pool.slow == {}
    with pytest.raises(ValueError, match="'x' is not one of"):
        pool.mark_slow("x", "typo")


def test_bad_layouts_and_unknown_hosts_are_refused():
    """Fewer nodes than needed, no node at all, or a host that is not in the pool: errors naming the values."""
    with pytest.raises(ValueError, match="--nnodes 3 but only 2 nodes"):
        NodePool(["a", "b"], nnodes=3)
    with pytest.raises(ValueError, match="at least 1"):
        NodePool(["a"], nnodes=0)
    with pytest.raises(ValueError, match="'zz' is not one of"):
        NodePool(["a", "b"], nnodes=1).mark_failed("zz", "?")
