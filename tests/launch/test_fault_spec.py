"""``MULA_FAULT`` specs: what parses, where a fault applies, and errors that name the bad part."""

import pytest

from mula_lightning.utils.launch_env import Fault, parse_faults


def test_specs_parse_with_defaults_and_several_faults():
    """Kinds, keys and the ';'-separated list; attempt defaults to 0 and unnamed filters match everywhere."""
    faults = parse_faults(
        "kill@step=5,node=node1; nan@step=9,node=node2,attempt=1;exception@step=2,rank=3,local_rank=1;"
        "slow@step=4,rank=1,ms=250"
    )
    assert faults == [
        Fault("kill", 5, node="node1"),
        Fault("nan", 9, node="node2", attempt=1),
        Fault("exception", 2, rank=3, local_rank=1),
        Fault("slow", 4, rank=1, ms=250),
    ]
    kill, nan, exc, _ = faults
    assert kill.applies("node1", rank=4, local_rank=0, attempt=0)
    assert not kill.applies("node1", rank=4, local_rank=0, attempt=1)  # a relaunch does not die again
    assert not kill.applies("node0", rank=0, local_rank=0, attempt=0)
    assert nan.applies("node2", 0, 0, 1) and not nan.applies("node2", 0, 0, 0)
    assert exc.applies("any", 3, 1, 0) and not exc.applies("any", 3, 0, 0)
    assert parse_faults("") == []
    assert parse_faults("kill@step=0,rank=2,attempt=5") == [Fault("kill", 0, rank=2, attempt=5)]  # in the set-up


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("explode@step=1", "KIND@step=S"),
        ("kill", "KIND@step=S"),
        ("kill@node=n1", "step=S"),
        ("nan@step=0", "0, during the set-up, for kill/hang/exception/abort"),
        ("slow@step=0,ms=5", "step=S (S >= 1"),
        ("kill@step=x", "'x' is not a non-negative integer"),
        ("kill@step=1,host=n1", "'host=n1' is not one of"),
        ("slow@step=3,rank=1", "ms=M (M >= 1) is required by slow"),
        ("kill@step=3,ms=20", "taken by no other kind"),
    ],
)
def test_bad_specs_name_the_part(spec, words):
    """A typo in a drill must fail loudly, naming the part, not silently inject nothing."""
    with pytest.raises(ValueError, match="MULA_FAULT") as err:
        parse_faults(spec)
    assert words in str(err.value)
