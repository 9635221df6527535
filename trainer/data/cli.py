"""`python -m trainer data ...`: download public datasets, write synthetic ones.

    python -m trainer data download ml-100k --out data/
    python -m trainer data synth sasrec --out data/synth-seq --users 800 --items 300
    python -m trainer data synth kgat --out data/kgat-synth --preset amazon-book
    python -m trainer data synth har --out data/har-synth --preset uci-har     # the UCI HAR layout and sizes
    python -m trainer data convert movielens-kg --src data/ml-100k --out data/ml-100k-kg
    python -m trainer data synth video --out data/synth-video                 # real .mp4 files + labels.csv
    python -m trainer data extract-frames --src data/synth-video --size 128   # -> data/synth-video/.frame-cache
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def add_data_parser(sub) -> None:
    """Register `data download` and `data synth` under the main parser's subcommands."""
    data = sub.add_parser("data", help="download or generate datasets")
    dsub = data.add_subparsers(dest="data_command", required=True)
    dl = dsub.add_parser("download", help="fetch a public dataset (sha256-verified, resumable)")
    dl.add_argument("name", help="dataset: ml-100k, ml-1m (SASRec); amazon-book, last-fm, yelp2018 (KGAT); "
                    "uci-har (HAR)")
    dl.add_argument("--out", required=True, help="output folder")
    dl.add_argument("--url", help="mirror URL of the same archive, or of the folder holding a KGAT "
                    "dataset's files (checksums are still enforced)")
    dl.add_argument("--sha256", help=argparse.SUPPRESS)   # for tests serving a small stand-in archive
    syn = dsub.add_parser("synth", help="write a synthetic dataset usable as data.path")
    syn.add_argument("kind", choices=["sasrec", "kgat", "har", "video"], help="which recipe's data")
    syn.add_argument("--out", required=True, help="output folder")
    syn.add_argument("--users", type=int, default=800)
    syn.add_argument("--items", type=int, default=300)
    syn.add_argument("--mean-len", type=int, default=40, help="sasrec: mean sequence length")
    syn.add_argument("--preset", choices=["tiny", "amazon-book", "uci-har"], default="tiny",
                     help="kgat: the statistics to match (amazon-book: the KGAT paper's Table 1); "
                     "har: tiny (600 windows) or uci-har (7352 train / 2947 test windows of 30 subjects)")
    syn.add_argument("--videos", type=int, default=8, help="video: number of .mp4 files")
    syn.add_argument("--frames", type=int, default=90, help="video: frames per video")
    syn.add_argument("--classes", type=int, default=4, help="video: motion classes (2-6)")
    syn.add_argument("--seed", type=int, default=0)
    ex = dsub.add_parser("extract-frames", help="decode videos once into the uint8 frame cache training reads")
    ex.add_argument("--src", required=True, help="folder of videos (searched recursively)")
    ex.add_argument("--out", help="cache folder (default SRC/.frame-cache, where training looks)")
    ex.add_argument("--size", type=int, default=128, help="frames resized to SIZE x SIZE (0: as decoded)")
    colour = ex.add_mutually_exclusive_group()
    colour.add_argument("--gray", dest="gray", action="store_true", default=True, help="grayscale (default)")
    colour.add_argument("--rgb", dest="gray", action="store_false", help="RGB frames")
    conv = dsub.add_parser("convert", help="build a dataset from raw files")
    conv.add_argument("kind", choices=["movielens-kg"], help="movielens-kg: KGAT format from MovieLens "
                      "ratings + item metadata (genres, release year)")
    conv.add_argument("--src", required=True, help="ml-100k or ml-1m folder (u.data+u.item, ratings.dat+movies.dat)")
    conv.add_argument("--out", required=True, help="output folder")
    conv.add_argument("--test-fraction", type=float, default=0.2, help="per-user random test share (0.2)")
    conv.add_argument("--seed", type=int, default=2019)


def run(args) -> int:
    """Dispatch `data` subcommands."""
    if args.data_command == "download":
        from trainer.data.download import download
        path = download(args.name, args.out, url=args.url, sha256=args.sha256)
        print(f"{args.name}: {path}")
        return 0
    if args.data_command == "convert":
        from trainer.recipes.kgat import build
        data, lists = build.convert_movielens(args.src, args.test_fraction, args.seed)
        path = build.write(data, args.out, lists)
        print(f"wrote {describe_kgat(data)} to {path}")
        return 0
    if args.data_command == "extract-frames":
        return extract(args)
    if args.kind == "video":
        from trainer.recipes.video.data import synth_videos
        path = synth_videos(Path(args.out), args.videos, args.frames, classes=args.classes, seed=args.seed)
        print(f"wrote {args.videos} videos of {args.frames} frames and labels.csv to {path}")
        return 0
    if args.kind == "har":
        return synth_har(args)
    if args.kind == "kgat":
        from trainer.recipes.kgat import build
        data = build.synthesize(build.Stats(**build.PRESETS[args.preset]), seed=args.seed)
        print(f"wrote {describe_kgat(data)} to {build.write(data, args.out)}")
        return 0
    from trainer.recipes.sasrec import data as seqdata
    inter = seqdata.synthesize(args.users, args.items, args.mean_len, args.seed)
    path = seqdata.write_udata(inter, f"{args.out}/u.data")
    print(f"wrote {len(inter.users)} interactions of {args.users} users to {path}")
    return 0


def extract(args) -> int:
    """Decode every video under --src into the frame cache (only what is missing or stale)."""
    from trainer.recipes.video import data as vd
    src = Path(args.src)
    videos = vd.find_videos(src)
    if not videos:
        print(f"no videos ({', '.join(vd.VIDEO_SUFFIXES)}) under {src}")
        return 2
    cache = Path(args.out) if args.out else src / ".frame-cache"
    manifest = vd.extract_frames(videos, cache, vd.CacheSpec(args.size, args.gray))
    frames = sum(manifest[name]["frames"] for name in videos)
    print(f"{len(videos)} videos, {frames} frames cached in {cache} (manifest.json)")
    return 0


def synth_har(args) -> int:
    """Synthetic windows in the UCI HAR layout (9 signals x 128 samples, 6 activities, subjects)."""
    from trainer.recipes.har import data as hd
    from trainer.recipes.har.prepare import subset
    n_train, n_test = (7352, 2947) if args.preset == "uci-har" else (450, 150)
    rng = np.random.default_rng(args.seed)
    test_ids = np.arange(1, 31)[::3] + 1                           # 9 of 30 subjects are the test set, as in UCI HAR
    train_ids = np.setdiff1d(np.arange(1, 31), test_ids)
    ids = np.concatenate([rng.choice(train_ids, n_train), rng.choice(test_ids, n_test)])
    s = hd.synthesize(n=n_train + n_test, seed=args.seed, subject_ids=ids)
    s.class_names = list(hd.UCI_ACTIVITIES)
    is_test = np.arange(n_train + n_test) >= n_train
    root = Path(args.out) / "UCI HAR Dataset"
    for split, mask in (("train", ~is_test), ("test", is_test)):
        hd.write_uci_har(root, split, subset(s, mask))
    print(f"wrote {int((~is_test).sum())} train / {int(is_test.sum())} test windows (9 x 128) to {root}")
    return 0


def describe_kgat(data) -> str:
    n_train, n_test = sum(map(len, data.train)), sum(map(len, data.test))
    return (f"{data.n_users} users, {data.n_items} items, {data.n_entities} entities, {data.n_relations} "
            f"relations, {len(data.kg)} triples, {n_train} train / {n_test} test interactions")
