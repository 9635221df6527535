import pytest

from trainer.distributed.hostlist import HostlistError, expand

CASES = [
    ("node[001-004,007]", ["node001", "node002", "node003", "node004", "node007"]),
    ("rack[1-2]-node[3-4]", ["rack1-node3", "rack1-node4", "rack2-node3", "rack2-node4"]),
    ("alpha,beta", ["alpha", "beta"]),
    ("linux[1,2]", ["linux1", "linux2"]),
    ("jean-zay-ia[810-811]", ["jean-zay-ia810", "jean-zay-ia811"]),
    ("gpu-a100-[01-03],cpu1", ["gpu-a100-01", "gpu-a100-02", "gpu-a100-03", "cpu1"]),
    ("node1", ["node1"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("a[1-2],b[01-02]c,d", ["a1", "a2", "b01c", "b02c", "d"]),
    ("node[1-2],node1", ["node1", "node2"]),
    ("x-1-[5]", ["x-1-5"]),
]


@pytest.mark.parametrize("nodelist,hosts", CASES)
def test_expand(nodelist, hosts):
    assert expand(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "node[1-", "node1]", "node[a-b]", "node[3-1]", "n[[1]]", "n[1-2"])
def test_bad_hostlists_raise(bad):
    with pytest.raises(HostlistError):
        expand(bad)


def test_whitespace_separates_hosts_as_slurm_does():
    assert expand("n1 n2\tn[3-4]\nn5") == ["n1", "n2", "n3", "n4", "n5"]
    assert expand("a[1-2], b") == ["a1", "a2", "b"]


def test_a_range_past_slurms_max_range_is_refused_with_one_line():
    assert len(expand("n[1-65536]")) == 65536
    for bad in ("n[1-1000000]", "r[1-300]n[1-300]", ",".join(f"a{i}[1-40000]" for i in range(2))):
        with pytest.raises(HostlistError, match="65,536") as err:
            expand(bad)
        assert "\n" not in str(err.value)

