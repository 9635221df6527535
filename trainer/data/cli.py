"""`python -m trainer data ...`: download public datasets, write synthetic ones.

    python -m trainer data download ml-100k --out data/
    python -m trainer data synth sasrec --out data/synth-seq --users 800 --items 300
"""
from __future__ import annotations

import argparse


def add_data_parser(sub) -> None:
    """Register `data download` and `data synth` under the main parser's subcommands."""
    data = sub.add_parser("data", help="download or generate datasets")
    dsub = data.add_subparsers(dest="data_command", required=True)
    dl = dsub.add_parser("download", help="fetch a public dataset (sha256-verified, resumable)")
    dl.add_argument("name", help="dataset: ml-100k, ml-1m")
    dl.add_argument("--out", required=True, help="output folder")
    dl.add_argument("--url", help="mirror URL of the same archive (the checksum is still enforced)")
    dl.add_argument("--sha256", help=argparse.SUPPRESS)   # for tests serving a small stand-in archive
    syn = dsub.add_parser("synth", help="write a synthetic dataset usable as data.path")
    syn.add_argument("kind", choices=["sasrec"], help="which recipe's data")
    syn.add_argument("--out", required=True, help="output folder")
    syn.add_argument("--users", type=int, default=800)
    syn.add_argument("--items", type=int, default=300)
    syn.add_argument("--mean-len", type=int, default=40)
    syn.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    """Dispatch `data` subcommands."""
    if args.data_command == "download":
        from trainer.data.download import download
        path = download(args.name, args.out, url=args.url, sha256=args.sha256)
        print(f"{args.name}: {path}")
        return 0
    from trainer.recipes.sasrec import data as seqdata
    inter = seqdata.synthesize(args.users, args.items, args.mean_len, args.seed)
    path = seqdata.write_udata(inter, f"{args.out}/u.data")
    print(f"wrote {len(inter.users)} interactions of {args.users} users to {path}")
    return 0
