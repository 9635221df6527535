"""`trainer data download` against a loopback HTTP server (never the internet): a good archive, a bad
checksum, and a transfer cut in the middle then resumed with a Range request."""
import functools
import hashlib
import http.server
import io
import re
import subprocess
import threading
import zipfile

import pytest

from tests.inprocess import cli
from trainer.data import download as dl
from trainer.recipes.har import download as har_dl
from trainer.recipes.kgat import download as kgat_dl
from trainer.recipes.sasrec import download as seq_dl


def small_archive() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("ml-100k/u.data", "".join(f"{u}\t{i}\t5\t{100 + i}\n" for u in range(1, 6) for i in range(1, 9)))
        zf.writestr("ml-100k/README", "stand-in archive for tests\n" * 2000)   # some bulk to cut in half
    return buf.getvalue()


class Server:
    """Serves one payload; honours Range; can drop the connection half-way once."""

    def __init__(self, payload: bytes):
        self.payload, self.cut_once, self.ranges = payload, False, []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                start = 0
                if "Range" in self.headers:
                    start = int(self.headers["Range"].split("=")[1].split("-")[0])
                    outer.ranges.append(start)
                body = outer.payload[start:]
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if outer.cut_once:
                    outer.cut_once = False
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(2)      # the transfer dies half-way
                    return
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/ml-100k.zip"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture()
def server():
    s = Server(small_archive())
    yield s
    s.close()


def test_good_archive_is_verified_and_extracted(tmp_path, server):
    sha = hashlib.sha256(server.payload).hexdigest()
    out = dl.download("ml-100k", tmp_path, url=server.url, sha256=sha)
    assert (out / "u.data").read_text().count("\n") == 40
    assert not list(tmp_path.glob("*.part"))
    dl.download("ml-100k", tmp_path, url=server.url, sha256=sha)   # second time: already verified


def test_bad_checksum_is_refused_and_kept_aside(tmp_path, server):
    with pytest.raises(dl.DownloadError, match="sha256 mismatch"):
        dl.download("ml-100k", tmp_path, url=server.url, sha256="0" * 64)
    assert not (tmp_path / "ml-100k.zip").exists() and (tmp_path / "ml-100k.zip.part.bad").exists()


def test_interrupted_transfer_resumes_with_range(tmp_path, server):
    sha = hashlib.sha256(server.payload).hexdigest()
    server.cut_once = True
    with pytest.raises(dl.DownloadError, match="run the same command again to resume"):
        dl.download("ml-100k", tmp_path, url=server.url, sha256=sha)
    part = tmp_path / "ml-100k.zip.part"
    assert 0 < part.stat().st_size < len(server.payload)
    dl.download("ml-100k", tmp_path, url=server.url, sha256=sha)
    assert server.ranges == [len(server.payload) // 2]            # continued where it stopped
    assert hashlib.sha256((tmp_path / "ml-100k.zip").read_bytes()).hexdigest() == sha


def test_cli_download_and_unknown_name(tmp_path, server):
    sha = hashlib.sha256(server.payload).hexdigest()
    proc = cli("data", "download", "ml-100k", "--out", str(tmp_path), "--url", server.url, "--sha256", sha)
    assert "ml-100k" in proc.stdout and (tmp_path / "ml-100k" / "u.data").exists()
    bad = cli("data", "download", "ml-10t", "--out", str(tmp_path), check=False)
    known = "known: amazon-book, last-fm, ml-100k, ml-1m, uci-har, yelp2018"
    assert bad.returncode == 2 and f"unknown dataset 'ml-10t'; {known}" in bad.stderr


def test_registry_has_canonical_urls_and_hashes():
    for name, remote in seq_dl.MOVIELENS.items():
        assert remote.url.startswith("https://files.grouplens.org/datasets/movielens/")
        assert len(remote.sha256) == 64 and remote.size > 1_000_000


def _kgat_mirror(tmp_path, zipped: bool):
    """A folder holding a small dataset in the KGAT authors' layout (the KG zipped, or not: last-fm's)."""
    from trainer.recipes.kgat import convert
    root = tmp_path / "mirror"
    data = convert.synthesize(convert.Stats(users=30, items=20, entities=40, relations=3, triples=90, interactions=150))
    convert.write(data, root)
    if zipped:
        with zipfile.ZipFile(root / "kg_final.txt.zip", "w") as zf:
            zf.write(root / "kg_final.txt", "kg_final.txt")
        (root / "kg_final.txt").unlink()
    for extra in ("relation_list.txt", "user_list.txt"):
        (root / extra).write_text("org_id remap_id\n")
    return root


@pytest.fixture()
def serve():
    """serve(folder) -> a loopback URL serving it."""
    servers = []

    def start(root):
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_port}/"
    yield start
    for httpd in servers:
        httpd.shutdown()


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a):
        pass


def _pins(root, blob=("train.txt", "kg_final.txt", "kg_final.txt.zip")):
    """The mirror's files pinned as the registry pins the real ones: git's blob id for the large files (the
    test computes it as git does), sha256 for the rest."""
    out = {}
    for f in sorted(p.name for p in root.iterdir()):
        data = (root / f).read_bytes()
        out[f] = dl.Pin("git-blob-sha1", hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()) \
            if f in blob else dl.Pin("sha256", hashlib.sha256(data).hexdigest(), len(data))
    return out


@pytest.mark.parametrize("name,zipped", [("yelp2018", True), ("last-fm", False)])
def test_kgat_files_are_fetched_verified_by_sha256_or_git_blob_and_unzipped(tmp_path, serve, name, zipped):
    from trainer.recipes.kgat import data as kd
    root = _kgat_mirror(tmp_path, zipped)
    url, pins = serve(root), _pins(root)
    folder = kgat_dl.download_kgat(name, tmp_path / "out", base_url=url, pinned=pins)
    loaded = kd.load(folder)                                  # the KG (unzipped where zipped) and the lists
    assert loaded.n_users == 30 and len(loaded.kg) == 90
    sums = dict(line.split()[::-1] for line in (folder / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == set(pins)                             # blob-pinned files recorded by sha256 too
    assert sums["train.txt"] == hashlib.sha256((root / "train.txt").read_bytes()).hexdigest()
    # the mirror changes a file: its pin refuses it, and the verified copy is kept
    (root / "test.txt").write_text("0 1\n")
    (folder / "test.txt").write_text("tampered\n")
    with pytest.raises(dl.DownloadError, match="sha256 mismatch"):
        kgat_dl.download_kgat(name, tmp_path / "out", base_url=url, pinned=pins)


def test_a_file_whose_git_blob_id_differs_is_refused_and_set_aside(tmp_path, serve):
    root = _kgat_mirror(tmp_path, zipped=True)
    pins = dict(_pins(root), **{"train.txt": dl.Pin("git-blob-sha1", "0" * 40)})
    with pytest.raises(dl.DownloadError, match="git blob sha1 mismatch"):
        kgat_dl.download_kgat("amazon-book", tmp_path, base_url=serve(root), pinned=pins)
    folder = tmp_path / "amazon-book"
    assert (folder / "train.txt.bad").exists() and not (folder / "train.txt").exists()


def test_git_blob_sha1_is_gits_own(tmp_path):
    path = tmp_path / "f.txt"
    path.write_bytes(b"one\ntwo\n" * 1000)
    git = subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True)
    if git.returncode != 0:
        pytest.skip(f"git hash-object failed here: {git.stderr.strip()}")
    assert dl.git_blob_sha1(path) == git.stdout.strip()


def test_a_mirror_must_serve_the_pinned_bytes(tmp_path, serve):
    """--url names a mirror, not other data: the registry's pins still apply, the error names the file."""
    url = serve(_kgat_mirror(tmp_path, zipped=False))
    proc = cli("data", "download", "last-fm", "--out", str(tmp_path / "out"), "--url", url, check=False)
    assert proc.returncode != 0 and "mismatch" in proc.stderr and "Traceback" not in proc.stderr


def test_kgat_registry_pins_every_file_at_the_authors_head(tmp_path, monkeypatch):
    """All three datasets at c03737be (the earlier per-dataset commits hold no kg_final file), each with its
    own file names (last-fm's KG is not zipped), every file pinned; a branch name would let files change."""
    assert set(kgat_dl.KGAT_COMMITS) == set(kgat_dl.KGAT_DATASETS) == {"amazon-book", "last-fm", "yelp2018"}
    assert set(kgat_dl.KGAT_COMMITS.values()) == {"c03737be46ac26a0b5431efe149828e982ffbbfb"}
    common = {"train.txt", "test.txt", "item_list.txt", "entity_list.txt", "relation_list.txt", "user_list.txt"}
    assert set(kgat_dl.KGAT_DATASETS["last-fm"]) == common | {"kg_final.txt"}
    zipped = common | {"kg_final.txt.zip"}
    assert set(kgat_dl.KGAT_DATASETS["yelp2018"]) == set(kgat_dl.KGAT_DATASETS["amazon-book"]) == zipped
    pins = [p for files in kgat_dl.KGAT_DATASETS.values() for p in files.values()]
    assert all(re.fullmatch(r"[0-9a-f]{64}", p.digest) and p.size for p in pins if p.kind == "sha256")
    assert sum(p.kind == "git-blob-sha1" and bool(re.fullmatch(r"[0-9a-f]{40}", p.digest)) for p in pins) == 5
    asked = []
    monkeypatch.setattr(dl, "fetch", lambda url, dest, sha: asked.append(url) or (_ for _ in ()).throw(
        dl.DownloadError("stop")))
    with pytest.raises(dl.DownloadError):
        kgat_dl.download_kgat("last-fm", tmp_path)
    assert asked[0].startswith("https://raw.githubusercontent.com/xiangwang1223/knowledge_graph_attention_network/"
                               "c03737be46ac26a0b5431efe149828e982ffbbfb/Data/last-fm/")


def _zip_with(path, name, data=b"x", symlink=False):
    with zipfile.ZipFile(path, "w") as zf:
        info = zipfile.ZipInfo(name)
        if symlink:
            info.external_attr = (0o120777 << 16)
        zf.writestr(info, data)
    return zipfile.ZipFile(path)


@pytest.mark.parametrize("member,why", [("../escape.txt", "unsafe member path"),
                                        ("a/../../escape.txt", "unsafe member path"),
                                        ("/tmp/absolute-escape.txt", "unsafe member path"),
                                        ("out-sibling/../../out-evil/x.txt", "unsafe member path")])
def test_extraction_refuses_members_outside_the_folder(tmp_path, member, why):
    out = tmp_path / "out"
    out.mkdir()
    with _zip_with(tmp_path / "a.zip", member) as zf, pytest.raises(dl.DownloadError, match=why):
        dl.safe_extract(zf, out, tmp_path / "a.zip")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.zip", "out"]


def test_extraction_refuses_symlink_members_and_paths_through_symlinks(tmp_path):
    out, outside = tmp_path / "out", tmp_path / "outside"
    out.mkdir(), outside.mkdir()
    with _zip_with(tmp_path / "l.zip", "link", b"/etc/passwd", symlink=True) as zf, \
            pytest.raises(dl.DownloadError, match="symbolic link"):
        dl.safe_extract(zf, out, tmp_path / "l.zip")
    (out / "data").symlink_to(outside)               # left by an earlier, hostile archive or user
    with _zip_with(tmp_path / "t.zip", "data/planted.txt") as zf, \
            pytest.raises(dl.DownloadError, match="unsafe member path 'data/planted.txt'"):
        dl.safe_extract(zf, out, tmp_path / "t.zip")
    assert not list(outside.iterdir())
    with _zip_with(tmp_path / "ok.zip", "sub/fine.txt", b"ok") as zf:    # an ordinary member still works
        dl.safe_extract(zf, out, tmp_path / "ok.zip")
    assert (out / "sub" / "fine.txt").read_bytes() == b"ok"


def uci_archives(tmp_path):
    """(UCI's wrapper zip, the inner 'UCI HAR Dataset.zip') holding a small dataset in the UCI HAR layout."""
    from trainer.recipes.har import data as hd
    src = tmp_path / "src"
    s = hd.synthesize(n=24, classes=6, subjects=3)
    hd.write_uci_har(src / "UCI HAR Dataset", "train", s)
    hd.write_uci_har(src / "UCI HAR Dataset", "test", s)
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as zf:
        for f in sorted((src / "UCI HAR Dataset").rglob("*.txt")):
            zf.write(f, str(f.relative_to(src)))
    outer = io.BytesIO()
    with zipfile.ZipFile(outer, "w") as zf:
        zf.writestr("UCI HAR Dataset.names", "names\n")
        zf.writestr("UCI HAR Dataset.zip", inner.getvalue())
    return outer.getvalue(), inner.getvalue()


def test_uci_har_archive_in_an_archive_is_verified_and_readable(tmp_path):
    from trainer.recipes.har.data import read_uci_har
    outer, inner = uci_archives(tmp_path)
    sha = {k: hashlib.sha256(v).hexdigest() for k, v in (("outer", outer), ("inner", inner))}
    served = Server(outer)
    try:
        root = har_dl.download_uci_har(tmp_path / "out", url=served.url, sha256=sha["outer"], inner_sha256=sha["inner"])
        train = read_uci_har(root, "train")
        assert len(train.samples) == 24 and train.channels == 9 and train.samples[0].shape == (9, 128)
        # UCI's archive with a tampered inner zip is refused
        with pytest.raises(dl.DownloadError, match="'UCI HAR Dataset.zip' inside has sha256"):
            har_dl.download_uci_har(tmp_path / "out2", url=served.url, sha256=sha["outer"], inner_sha256="1" * 64)
    finally:
        served.close()
    mirror = Server(inner)        # a mirror serving the original inner zip directly
    try:
        root = har_dl.download_uci_har(tmp_path / "out3", url=mirror.url, sha256=sha["outer"],
                                       inner_sha256=sha["inner"])
        assert (root / "test" / "Inertial Signals" / "body_gyro_z_test.txt").exists()
        with pytest.raises(dl.DownloadError, match="is neither UCI's archive"):
            har_dl.download_uci_har(tmp_path / "out4", url=mirror.url, sha256="2" * 64, inner_sha256="3" * 64)
        assert (tmp_path / "out4" / "uci-har.zip.bad").exists() and not (tmp_path / "out4" / "UCI HAR Dataset").exists()
    finally:
        mirror.close()


def test_uci_har_registry_is_the_uci_archive_with_both_hashes():
    assert har_dl.UCI_HAR_URL.startswith("https://archive.ics.uci.edu/static/public/240/")
    assert len(har_dl.UCI_HAR_SHA256) == 64 and len(har_dl.UCI_HAR_INNER_SHA256) == 64
