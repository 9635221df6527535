"""What the suite's processes share on this machine (its pytest-xdist workers, both halves of make test): file locks,
and the loopback ports handed to launches."""
from __future__ import annotations

import contextlib
import fcntl
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

# Between the ports the trainer derives from Slurm job ids (15000-29999, trainer/distributed/environment.py: the local
# cluster's jobs use them) and the kernel's ephemeral range (32768-60999 here, /proc/sys/net/ipv4/ip_local_port_range):
# a port the kernel picked (bind to 0) is one a connection elsewhere can take as its source port before the rank binds
# it, and a rank's store client retrying a connect to a not yet listening port in that range can connect to itself
# (TCP simultaneous open): rank 0 then fails with EADDRINUSE (seen with three workers). Steps of 2: room for port + 1.
PORTS = range(30_000, 32_768, 2)


@contextlib.contextmanager
def file_lock(name: str, mode: int = fcntl.LOCK_EX) -> Iterator[None]:
    """An flock on /tmp/hpc-trainer-NAME.lock for the duration: held across the suite's processes (its workers,
    both halves), released if the holder dies."""
    with open(Path(tempfile.gettempdir()) / f"hpc-trainer-{name}.lock", "a") as fh:
        fcntl.flock(fh, mode)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback TCP port free now, outside the ephemeral range and handed to no other test lately: the next of
    PORTS after the last one given to any of the suite's processes (a counter in /tmp under a lock)."""
    counter = Path(tempfile.gettempdir()) / "hpc-trainer-ports"
    with file_lock("ports"):
        start = 0
        with contextlib.suppress(OSError, ValueError):
            start = int(counter.read_text())
        for i in range(len(PORTS)):
            port = PORTS[(start + i) % len(PORTS)]
            if _bindable(port):
                counter.write_text(str((start + i + 1) % len(PORTS)))
                return port
    raise RuntimeError(f"no free loopback port in {PORTS.start}-{PORTS.stop}")
