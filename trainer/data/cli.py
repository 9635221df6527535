"""`python -m trainer data ...`: download public datasets, write synthetic ones, convert raw files. The
subcommands other than `download` come from the recipes' specs (trainer/recipes/<name>/spec.py).

    python -m trainer data download ml-100k --out data/
    python -m trainer data synth sasrec --out data/synth-seq --users 800 --items 300
    python -m trainer data synth kgat --out data/kgat-synth --preset amazon-book
    python -m trainer data synth har --out data/har-synth --preset uci-har     # the UCI HAR layout and sizes
    python -m trainer data convert movielens-kg --src data/ml-100k --out data/ml-100k-kg
    python -m trainer data synth video --out data/synth-video                 # real .mp4 files + labels.csv
    python -m trainer data extract-frames --src data/synth-video --size 128   # -> data/synth-video/.frame-cache
    python -m trainer data cache list                 # the parsed-data cache: entries, sizes, the jobs mapping them
    python -m trainer data cache clear --keep-gb 5    # remove entries no job maps, least recently used first
"""
from __future__ import annotations

import argparse
import time

from trainer.config.registry import specs


def add_data_parser(sub) -> None:
    """Register `data download`, `data synth`, `data convert` and the recipes' own data subcommands."""
    data = sub.add_parser("data", help="download, generate or convert datasets")
    dsub = data.add_subparsers(dest="data_command", required=True)
    owned = "; ".join(f"{', '.join(s.tools.datasets)} ({s.name})" for s in specs() if s.tools.datasets)
    dl = dsub.add_parser("download", help="fetch a public dataset (sha256-verified, resumable)")
    dl.add_argument("name", help=f"dataset: {owned}")
    dl.add_argument("--out", required=True, help="output folder")
    dl.add_argument("--url", help="mirror URL of the same archive, or of the folder holding the files of a dataset "
                    "fetched file by file (checksums are still enforced)")
    dl.add_argument("--sha256", metavar="HEX", help="with --url: the archive's sha256 where the mirror serves "
                    "another archive than the canonical one (e.g. a trimmed copy); verified the same way")
    dl.set_defaults(run=_download)
    _add_cache_parser(dsub)
    syn = dsub.add_parser("synth", help="write a synthetic dataset usable as data.path")
    ssub = syn.add_subparsers(dest="kind", required=True, metavar="RECIPE")
    convert = dsub.add_parser("convert", help="build a dataset from raw files")
    csub = convert.add_subparsers(dest="kind", required=True, metavar="KIND")
    for spec in specs():
        if spec.tools.synth:
            p = _command(ssub, spec.name, spec.tools.synth)
            p.add_argument("--out", required=True, help="output folder")
            p.add_argument("--seed", type=int, default=0)
        for kind, command in spec.tools.converters.items():
            _command(csub, kind, command)
        for name, command in spec.tools.data_commands.items():
            _command(dsub, name, command)


def _add_cache_parser(dsub) -> None:
    parser = dsub.add_parser("cache", help="list or clear the parsed-data cache (data.cache), shared by every job")
    csub = parser.add_subparsers(dest="cache_command", required=True)
    for name, help_ in (("list", "its entries, least recently used first, with the jobs that map each"),
                        ("clear", "remove the entries no job maps (a live lease), least recently used first")):
        p = csub.add_parser(name, help=help_, description=help_)
        p.add_argument("--root", default="", help="the cache folder (default: TRAINER_DATA_CACHE, else "
                       "~/.cache/hpc-trainer/data; a run's data.cache)")
        if name == "clear":
            p.add_argument("--keep-gb", type=float, default=0.0, help="stop once the cache holds at most this many "
                           "GB (default 0: every entry no job maps)")
        p.set_defaults(run=_cache)


def _cache(args) -> int:
    from trainer.data import cache
    root = cache.root_of(args.root or "")
    if root is None or not root.is_dir():
        print(f"{root}: no data cache there")
        return 0
    if args.cache_command == "clear":
        removed = cache.evict(root, args.keep_gb * 1e9)
        print(f"{root}: removed {len(removed)} entries ({sum(e.bytes for e in removed) / 2**20:.1f} MiB)")
    for e in cache.entries_of(root):
        used = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(e.used))
        jobs = ", ".join(str(o) for o in e.leases) or "-"
        print(f"{e.path.name}  {e.bytes / 2**20:9.1f} MiB  last used {used}  mapped by: {jobs}")
    return 0


def _command(sub, name: str, command) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=command.help, description=command.help)
    command.add_arguments(p)
    p.set_defaults(run=command.run)
    return p


def _download(args) -> int:
    from trainer.data.download import download
    path = download(args.name, args.out, url=args.url, sha256=args.sha256)
    print(f"{args.name}: {path}")
    return 0


def run(args) -> int:
    """Dispatch a `data` subcommand."""
    return args.run(args)
