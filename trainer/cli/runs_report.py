"""What `python -m trainer runs DIR` prints and draws (trainer/cli/runs.py reads the runs): the table as text, CSV
or Markdown, the PNG (the selection metric against each varied setting; the validation curves of the best few),
and the failed points' array indices.

    print(render(rows, "md"))
    plot(rows, Path("runs.png"))
"""
from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from trainer.cli.runs import RunRow, ordered, varied

TEST_COLUMNS = 3          # the test metrics shown beside the selection metric (the first few, by name)


def cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def columns(rows: list[RunRow]) -> tuple[list[str], list[list[str]]]:
    """(header, cells) in the table's order: run, the varied settings, state, best epoch, the selection metric,
    the first test metrics, the cause of a failure."""
    keys = varied(rows)
    metric = next((r.metric for r in rows if r.metric), "")
    tests = sorted({k for r in rows for k in r.test})[:TEST_COLUMNS]
    val = f"val {metric.replace(':', ' (')})" if metric else "val"
    header = ["run", *keys, "state", "best_epoch", val, *(f"test {t}" for t in tests), "cause"]
    cells = [[r.path.name or str(r.path), *(cell(r.settings.get(k)) for k in keys), r.state, cell(r.best_epoch),
              cell(r.best), *(cell(r.test.get(t)) for t in tests), r.cause] for r in ordered(rows)]
    return header, cells


def render(rows: list[RunRow], form: str = "table") -> str:
    header, cells = columns(rows)
    if form == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(cells)
        return out.getvalue()
    if form == "md":
        def line(values: list[str]) -> str:
            return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"
        return "\n".join([line(header), "|" + "---|" * len(header), *map(line, cells)]) + "\n"
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
    text = ["  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip() for values in [header, *cells]]
    return "\n".join(text) + "\n"


def failed_indices(rows: list[RunRow]) -> list[int]:
    """The array indices of the failed (and stopped, and preempted but not requeued) sweep points, from their
    folders' names."""
    return sorted(r.index for r in rows if r.state in ("failed", "stopped", "preempted") and r.index is not None)


def rerun_text(rows: list[RunRow], search: bool = False) -> str:
    """What to submit again for the failed points; `search`: the folder is a search's (its study draws the points)."""
    indices = failed_indices(rows)
    if not indices:
        return "no failed sweep point (nothing to rerun)\n"
    joined = ",".join(map(str, indices))
    if search:
        return (f"failed trials in array tasks {joined}: a search's points are drawn, not listed; the same "
                f"hpc/submit.py --search command with its --run-dir and --trials N adds N trials to the same study\n")
    return (f"failed points: {joined}\nrerun them: the same hpc/submit.py command (its --run-dir) with "
            f"--sweep-points {joined}: each resumes from its own checkpoint\n")


def _numeric(values: list[Any]) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def plot(rows: list[RunRow], path: Path, best: int = 3) -> Path:
    """The PNG: one panel per varied setting (the selection metric of each run against its value; a log axis for
    positive numbers spanning more than a decade), and one of the validation curves of the best `best` runs."""
    from trainer.native.extras import require
    matplotlib = require("matplotlib", "bench", "runs --plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys, scored = varied(rows), [r for r in rows if r.best is not None]
    label = next((r.metric for r in rows if r.metric), "metric").replace(":", " (") + ")"
    fig, axes = plt.subplots(1, len(keys) + 1, figsize=(4 * (len(keys) + 1), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        values = [r.settings.get(key) for r in scored]
        if _numeric(values):
            ax.scatter(values, [r.best for r in scored])
            if values and min(values) > 0 and max(values) > 10 * min(values):
                ax.set_xscale("log")
        else:
            labels = sorted({str(v) for v in values})
            ax.scatter([labels.index(str(v)) for v in values], [r.best for r in scored])
            ax.set_xticks(range(len(labels)), labels, rotation=30, fontsize=7)
        ax.set_xlabel(key)
        ax.set_ylabel(f"val {label}")
    curves = axes[0][-1]
    for r in ordered(scored)[:best]:
        curves.plot([s for s, _ in r.curve], [v for _, v in r.curve], marker=".", label=r.path.name)
    curves.set_xlabel("step")
    curves.set_ylabel(f"val {label}")
    curves.set_title(f"the best {min(best, len(scored))}")
    if scored:
        curves.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
