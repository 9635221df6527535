"""MovieLens archives for `data download ml-100k|ml-1m` (declared in this recipe's spec)."""
from __future__ import annotations

from pathlib import Path

from trainer.data.download import Remote, fetch_remote

# sha256 and sizes as published in tensorflow/datasets' url_checksums/movielens.txt
MOVIELENS: dict[str, Remote] = {
    "ml-100k": Remote("https://files.grouplens.org/datasets/movielens/ml-100k.zip",
                      "50d2a982c66986937beb9ffb3aa76efe955bf3d5c6b761f4e3a7cd717c6a3229", 4924029),
    "ml-1m": Remote("https://files.grouplens.org/datasets/movielens/ml-1m.zip",
                    "a6898adb50b9ca05aa231689da44c217cb524e7ebd39d264c56e2832f2c54e20", 5917549),
}


def ml_100k(out: str | Path, url: str | None = None, sha256: str | None = None) -> Path:
    return fetch_remote(MOVIELENS["ml-100k"], out, url, sha256)


def ml_1m(out: str | Path, url: str | None = None, sha256: str | None = None) -> Path:
    return fetch_remote(MOVIELENS["ml-1m"], out, url, sha256)
