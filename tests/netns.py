"""Nodes with networks of their own on this one machine, for tests of what crosses a link between hosts: a network
namespace per node with its own loopback (its ranks' traffic among themselves stays inside it) and a veth pair to
the root namespace, which routes between the nodes (ip_forward). Traffic between two nodes crosses both nodes'
veths, so `slow(node, rate)` (a TBF on both ends of that node's veth) slows every link of that node and nothing
inside it, the way a bad network card or cable does. Needs root and iproute2 (`available()` says why not).

    with nodes(3) as hosts:                        # hosts[i].ns, .addr (10.A.i.2), .ifname ("cl0" in every node)
        slow(hosts[2], "200mbit")
        subprocess.run(hosts[0].run([sys.executable, "-c", "..."]))
"""
from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tests.timeouts import limit

IFNAME = "cl0"          # the node's side of its veth, the same name in every node: GLOO_SOCKET_IFNAME=cl0
FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
_made = itertools.count()


@dataclass(frozen=True)
class Node:
    name: str           # nodeI, what SLURMD_NODENAME would say
    ns: str             # its network namespace
    addr: str           # its address on its veth
    outside: str        # the root namespace's end of its veth

    def run(self, argv: list[str]) -> list[str]:
        """argv run inside this node's network namespace (nsenter: `ip netns exec` would also remount /sys, and
        with it the cgroup files the trainer reads its memory limit from)."""
        return ["nsenter", f"--net=/run/netns/{self.ns}", *argv]


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    subprocess.run(argv, check=True, capture_output=True, text=True)


def available() -> str | None:
    """None, or why namespaces cannot be made here."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "iproute2 (ip, tc) is not installed"
    probe = f"trprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@contextlib.contextmanager
def nodes(n: int) -> Iterator[list[Node]]:
    """n nodes node1..nodeN, each a namespace joined to the root namespace by a veth; all removed on exit."""
    serial = next(_made)
    tag = f"tr{os.getpid() % 100000}x{serial}"
    block = 100 + (os.getpid() + serial) % 100   # 10.<block>.<i>.0/24 per node: apart from other runs' blocks
    forward = FORWARD.read_text().strip()
    made: list[Node] = []
    try:
        for i in range(1, n + 1):
            node = Node(f"node{i}", f"{tag}n{i}", f"10.{block}.{i}.2", f"{tag}v{i}")
            _ip("netns", "add", node.ns)
            made.append(node)
            _ip("link", "add", node.outside, "type", "veth", "peer", "name", IFNAME, "netns", node.ns)
            _ip("addr", "add", f"10.{block}.{i}.1/24", "dev", node.outside)
            _ip("link", "set", node.outside, "up")
            _ip("addr", "add", f"{node.addr}/24", "dev", IFNAME, ns=node.ns)
            _ip("link", "set", IFNAME, "up", ns=node.ns)
            _ip("link", "set", "lo", "up", ns=node.ns)
            _ip("route", "add", "default", "via", f"10.{block}.{i}.1", ns=node.ns)
        FORWARD.write_text("1")
        yield made
    finally:
        for node in made:
            subprocess.run(["ip", "netns", "del", node.ns], capture_output=True)     # its veth goes with it...
        deadline = time.monotonic() + limit("brief")
        for node in made:                                                           # ... a moment later
            while time.monotonic() < deadline and subprocess.run(["ip", "link", "show", node.outside],
                                                                 capture_output=True).returncode == 0:
                time.sleep(0.1)
        FORWARD.write_text(forward)


def slow(node: Node, rate: str) -> None:
    """Every link of `node` at `rate` each way (tc rate units: 200mbit), inside the node untouched."""
    tbf = ["root", "tbf", "rate", rate, "burst", "64kb", "latency", "100ms"]
    subprocess.run(["tc", "qdisc", "replace", "dev", node.outside, *tbf], check=True, capture_output=True)
    subprocess.run(node.run(["tc", "qdisc", "replace", "dev", IFNAME, *tbf]), check=True, capture_output=True)
