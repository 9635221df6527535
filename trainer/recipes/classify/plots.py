"""Figures written into the run directory (Pillow only: it ships with the images, no plotting stack needed).

    confusion_png(cm, ["walk", "run"], "runs/har/confusion_val.png", "val, epoch 3")
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)
CELL, PAD = 44, 8


def confusion_png(cm: Sequence[Sequence[float]], names: Sequence[str], path: str | Path,
                  title: str = "") -> Path | None:
    """A confusion matrix (rows: true class, columns: predicted) as a PNG heat map with counts; the colour
    of a cell is its share of the row, so rare classes stay readable. None when Pillow is missing."""
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        log.warning("Pillow is not installed: %s not written (the matrix is in metrics.jsonl)", path)
        return None
    rows = [[float(v) for v in row] for row in cm]
    n = len(rows)
    font = ImageFont.load_default()
    labels = [f"{i} {name}" for i, name in enumerate(names)]
    left = PAD + max((int(font.getlength(s)) for s in labels), default=0) + PAD
    top = 3 * PAD + 2 * 12
    img = Image.new("RGB", (left + n * CELL + PAD, top + n * CELL + 3 * PAD + 12), "white")
    draw = ImageDraw.Draw(img)
    draw.text((PAD, PAD), title or "confusion matrix", fill="black", font=font)
    draw.text((left, PAD + 14), "predicted ->", fill="black", font=font)
    for j in range(n):
        draw.text((left + j * CELL + CELL // 2 - 4, top - 14), str(j), fill="black", font=font)
    for i, row in enumerate(rows):
        y = top + i * CELL
        draw.text((PAD, y + CELL // 2 - 6), labels[i], fill="black", font=font)
        total = sum(row) or 1.0
        for j, value in enumerate(row):
            share = value / total
            shade = (int(255 - 200 * share), int(255 - 150 * share), 255)
            x = left + j * CELL
            draw.rectangle([x, y, x + CELL - 1, y + CELL - 1], fill=shade, outline="grey")
            text = f"{value:g}"
            draw.text((x + (CELL - font.getlength(text)) / 2, y + CELL // 2 - 6), text,
                      fill="white" if share > 0.6 else "black", font=font)
    draw.text((PAD, top + n * CELL + PAD), "rows: true class; colour: share of the row", fill="grey", font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    img.save(tmp, format="PNG")
    tmp.replace(path)
    return path
