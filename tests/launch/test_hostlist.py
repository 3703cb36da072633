"""SLURM host lists: the expansion ``scontrol show hostnames`` gives, and a clear error for what it would refuse."""

import os
import stat

import pytest

from mula_lightning.launch.hostlist import allocation_nodes, expand_hostlist


@pytest.mark.parametrize(
    ("spec", "hosts"),
    [
        ("node1", ["node1"]),
        ("nid[001-003,007]", ["nid001", "nid002", "nid003", "nid007"]),
        ("a[1-2],b,c[08-10]", ["a1", "a2", "b", "c08", "c09", "c10"]),
        ("rack[1-2]-gpu[0-1]", ["rack1-gpu0", "rack1-gpu1", "rack2-gpu0", "rack2-gpu1"]),
        ("x[9-11]y", ["x9y", "x10y", "x11y"]),
        ("n[1-2],n2,n[3]", ["n1", "n2", "n3"]),
    ],
)
def test_expansion_keeps_order_padding_and_products(spec, hosts):
    """Ranges keep the first number's zero padding, several groups give the product in order, duplicates once."""
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("nid[001-003", "never closed"),
        ("nid001]", "without '['"),
        ("nid[3-1]", "backwards"),
        ("nid[a-b]", "'a-b'"),
        ("a,,b", "empty host name"),
        ("nid[]", "empty brackets"),
        ("", "empty"),
    ],
)
def test_malformed_lists_are_refused_by_name(spec, words):
    """Each malformed list is refused with an error that quotes the list and the offending part."""
    with pytest.raises(ValueError, match="host list") as err:
        expand_hostlist(spec)
    assert words in str(err.value)


def test_allocation_uses_scontrol_when_on_path_and_the_parser_otherwise(tmp_path):
    """Inside an allocation the nodes come from ``scontrol show hostnames`` when it exists (a fake one here that
    answers differently from the parser, so the test sees which was used), else from the parser; outside, an error."""
    fake = tmp_path / "scontrol"
    fake.write_text(
        "#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] || exit 2\necho from-scontrol-1\necho from-scontrol-2\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {"SLURM_JOB_NODELIST": "nid[01-02]", "PATH": f"{tmp_path}{os.pathsep}/usr/bin:/bin"}
    assert allocation_nodes(env) == ["from-scontrol-1", "from-scontrol-2"]
    assert allocation_nodes({"SLURM_JOB_NODELIST": "nid[01-02]", "PATH": str(tmp_path / "none")}) == ["nid01", "nid02"]
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST is not set"):
        allocation_nodes({"PATH": ""})
