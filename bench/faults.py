"""The README's fault table from the fault tests' own measurements (make faults-report).

    FAULT_FIGURES=bench/results/faults.jsonl pytest tests/faults tests/distributed/test_resume_and_faults.py
    python -m bench.faults bench/results/faults.jsonl      # -> bench/results/faults.md
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def table(lines: list[dict]) -> str:
    """One row per fault: outcome, time to exit (min-max over the runs), steps lost beyond the last
    agreed checkpoint."""
    rows: dict[str, list[dict]] = defaultdict(list)
    for rec in lines:
        rows[rec["fault"]].append(rec)
    out = ["| fault or hostile input | what happens | time to exit | work lost |", "|---|---|---|---|"]
    for fault, recs in rows.items():
        times = sorted(r["exit_s"] for r in recs if "exit_s" in r)
        span = "" if not times else f"{times[0]:g} s" if times[0] == times[-1] else f"{times[0]:g}-{times[-1]:g} s"
        lost = sorted({r["steps_lost"] for r in recs if "steps_lost" in r})
        lost_text = ", ".join(f"{n} steps" for n in lost) if lost else "-"
        out.append(f"| {fault} | {recs[-1]['outcome']} | {span or '-'} | {lost_text} |")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    src = Path(argv[0] if argv else "bench/results/faults.jsonl")
    lines = [json.loads(x) for x in src.read_text().splitlines() if x.strip()]
    dest = src.with_suffix(".md")
    dest.write_text(table(lines))
    print(dest.read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
