"""Pure Slurm hostlist expansion, so that no `scontrol` is needed (it is often missing in containers).

    >>> expand("node[001-003,007],gpu-a100-[01-02],login")
    ['node001', 'node002', 'node003', 'node007', 'gpu-a100-01', 'gpu-a100-02', 'login']
"""
from __future__ import annotations

import itertools
import re

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class HostlistError(ValueError):
    """A nodelist that is not valid Slurm hostlist syntax."""


MAX_RANGE = 64 * 1024      # hosts in one range, and in a whole list: Slurm's MAX_RANGE (src/common/hostlist.c)


def _split_top_level(text: str) -> list[str]:
    """Split on commas and whitespace outside brackets, as Slurm's hostlist_create does: 'a[1,2],b c' -> ['a[1,2]',
    'b', 'c']."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested '[' in hostlist {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in hostlist {text!r}")
        elif (ch == "," or ch.isspace()) and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise HostlistError(f"unbalanced '[' in hostlist {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range_list(body: str, whole: str) -> list[str]:
    """'001-003,7' -> ['001', '002', '003', '7'], keeping the zero padding of each range."""
    out = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise HostlistError(f"bad range {item!r} in hostlist {whole!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise HostlistError(f"descending range {item!r} in hostlist {whole!r}")
        if int(hi) - int(lo) + 1 > MAX_RANGE:
            raise HostlistError(f"range {item!r} in hostlist {whole[:80]!r} has {int(hi) - int(lo) + 1:,} hosts; "
                                f"Slurm refuses more than {MAX_RANGE:,} in one range")
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def _expand_one(pattern: str, whole: str) -> list[str]:
    """Expand one comma-free pattern with any number of bracket groups: 'rack[1-2]-node[3-4]'."""
    pieces = re.split(r"(\[[^\]]*\])", pattern)
    choices = []
    count = 1
    for piece in pieces:
        if piece.startswith("["):
            choices.append(_expand_range_list(piece[1:-1], whole))
            count *= len(choices[-1])
        elif piece:
            choices.append([piece])
        if count > MAX_RANGE:
            raise HostlistError(f"{pattern[:80]!r} in hostlist {whole[:80]!r} expands to more than {MAX_RANGE:,} "
                                f"hosts (Slurm's limit)")
    return ["".join(combo) for combo in itertools.product(*choices)]


def expand(nodelist: str) -> list[str]:
    """Expand a Slurm nodelist ('node[001-004,007]', 'a,b', 'rack[1-2]-node[3-4]') to host names."""
    if nodelist is None or not nodelist.strip():
        raise HostlistError("empty hostlist")
    hosts: dict[str, None] = {}          # ordered, and a repeat found in constant time
    for pattern in _split_top_level(nodelist.strip()):
        hosts.update(dict.fromkeys(_expand_one(pattern, nodelist)))
        if len(hosts) > MAX_RANGE:
            raise HostlistError(f"hostlist {nodelist[:80]!r} names more than {MAX_RANGE:,} hosts (Slurm's limit)")
    return list(hosts)
