"""The KGAT authors' datasets for `data download amazon-book|last-fm|yelp2018` (declared in this recipe's spec),
file by file from one pinned commit of their repository."""
from __future__ import annotations

import zipfile
from pathlib import Path

from trainer.data.download import SUMS, Pin, fetch_pinned, parse_pins, read_sums, safe_extract

KGAT_REPO = "https://raw.githubusercontent.com/xiangwang1223/knowledge_graph_attention_network"
# a commit, never a branch: the repository's head, which holds all three datasets (the commits pinned before,
# a018ee4b for last-fm and 0fc6fb21 for yelp2018, hold no kg_final file). Each file is pinned by its sha256,
# or where only git's blob id of the five largest could be read, by that (sha1 of "blob <size>\0" + bytes:
# what the commit serves); a file pinned so is recorded by its sha256 in DIR/SHA256SUMS once verified.
KGAT_COMMIT = "c03737be46ac26a0b5431efe149828e982ffbbfb"
_KGAT_PINS = """
amazon-book entity_list.txt sha256=b03e9cb7eeab38756f0b10c06478a611201a7d42cb16acb8513624dda05270ca size=1810815
amazon-book item_list.txt sha256=efea8518cd68e515584fdfbfca95f318b25ef551c64498c5935897c2b02e436f size=658401
amazon-book kg_final.txt.zip git-blob-sha1=7eedb0ed50a9bae8a89ef2193b3a9fb1bf9ed03e
amazon-book relation_list.txt sha256=50fe9c6560224b20d8ace78ae8ca0b8dad39248f6dc900f6744b633ba8c33f4b size=2424
amazon-book test.txt sha256=f47eff9d35fb95c07d74251a991478a84095ce6c5969b0dafcb4afe99fc716ec size=1478039
amazon-book train.txt sha256=4d10106bb06a77e11df660429903c0067aeb85b86431807836b0d8b7edc30c38 size=3897477
amazon-book user_list.txt sha256=ae2e001d4e49fd82d4c7e25f950827a8be2fbd5c6f3a16dacb2d104edb32310e size=1454742
last-fm entity_list.txt sha256=56741c54984c929682ffb89f5e255ebdbf862fa031157220474139824d4f9ba7 size=1656602
last-fm item_list.txt sha256=0e4991b5b8a292e82dc5fe3ca34bd04dc90bdeee63e0b99d71b4b8d93c129e80 size=1065416
last-fm kg_final.txt git-blob-sha1=42d2726e067d743bf73891a7ff8caddb5c1adf84
last-fm relation_list.txt sha256=069643eab7dea9e21b02e8c7b8df4af91fb70f0628a5a36cb3091cfcb87d8e7d size=512
last-fm test.txt sha256=bb79750f3a034e5ce5bc4aa8541cdc9d456ea51158f0059f84167942bd9837b2 size=3522888
last-fm train.txt git-blob-sha1=905779bf273225caa33049cef2b6cf9b923bd139
last-fm user_list.txt sha256=3ccf277897bbc1cdc7ca6689f76045397462a8dc69615a7e47ed10f88e180f0d size=335974
yelp2018 entity_list.txt sha256=bb6390ee1568eed802d5113a6b4b38e76402bce88519186d2a99402955571801 size=4025349
yelp2018 item_list.txt sha256=1ba988c00ea8d97945a5fb0f6cbb3867e55f327e2c341bcfe55c5a5584b06a9d size=2311356
yelp2018 kg_final.txt.zip git-blob-sha1=9a11bad2806d43f613787f000d8d826f3bc91767
yelp2018 relation_list.txt sha256=f5b19de6fc169ec6f4ac9943cce7614d1427b32130a6063f990721b45e636abc size=1167
yelp2018 test.txt sha256=ad1034bf609176893abcce4b7b9266d9f02fcc05e13966aa078b432df02a78f0 size=1676196
yelp2018 train.txt git-blob-sha1=c834b6e61cbb6a716b039367f3ddd711ca3a2483
yelp2018 user_list.txt sha256=49b8f178a6a6ee71d0d0b06242628afe9289d27734d44fa31f6d07aa4611b7be size=1320557
"""


# per dataset, its own file names (last-fm's knowledge graph is kg_final.txt, the others' kg_final.txt.zip)
KGAT_DATASETS: dict[str, dict[str, Pin]] = parse_pins(_KGAT_PINS)
KGAT_COMMITS = {name: KGAT_COMMIT for name in KGAT_DATASETS}


def download_kgat(name: str, out: str | Path, base_url: str | None = None,
                  pinned: dict[str, Pin | str | None] | None = None) -> Path:
    """The KGAT authors' files of one dataset into out/name/, each verified (sha256, or git's blob id), the KG
    unzipped where it is zipped. pinned (tests, mirrors): file -> Pin, a sha256 string, or None (record)."""
    folder = Path(out) / name
    pins = {f: Pin("sha256", p) if isinstance(p, str) else p
            for f, p in (KGAT_DATASETS[name] if pinned is None else pinned).items()}
    sums_path = folder / SUMS
    recorded = read_sums(sums_path)
    base = (base_url or f"{KGAT_REPO}/{KGAT_COMMITS[name]}/Data/{name}").rstrip("/") + "/"
    for fname, pin in pins.items():
        fetch_pinned(base + fname, folder / fname, pin, recorded)
    sums_path.write_text("".join(f"{h}  {f}\n" for f, h in sorted(recorded.items())))
    for fname in pins:
        if fname.endswith(".zip"):
            with zipfile.ZipFile(folder / fname) as zf:
                safe_extract(zf, folder, folder / fname)
    return folder


def by_name(name: str):
    """`data download NAME`'s function for one of the datasets (--url: a mirror of the folder holding its files)."""
    def fetch(out: str | Path, url: str | None = None, sha256: str | None = None) -> Path:
        return download_kgat(name, out, base_url=url)
    return fetch


amazon_book, last_fm, yelp2018 = by_name("amazon-book"), by_name("last-fm"), by_name("yelp2018")
