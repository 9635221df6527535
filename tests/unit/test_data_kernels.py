"""The C++ data kernels (trainer/data/kernels.py) against numpy on the same input: the parser where it accepts
(and that it refuses what it must leave to the slower parsers), chunk edges, codes, the grouped order and TiSASRec's
rescaled times; and the readers give the same sequences with the kernels off."""
import numpy as np
import pytest

from trainer.data import flat, kernels
from trainer.recipes.sasrec import data as D
from trainer.recipes.sasrec import sequences

if kernels.EXT.load() is None:           # a machine without a compiler: the numpy path is what runs (tested below)
    pytest.skip(f"the C++ data kernels cannot be built here ({kernels.EXT.unavailable_reason()})",
                allow_module_level=True)


def write(tmp_path, text: str | bytes, name="f.txt"):
    p = tmp_path / name
    p.write_bytes(text.encode() if isinstance(text, str) else text)
    return p


def test_parses_what_numpy_parses(tmp_path):
    text = "\ufeff1\t10\t4.5\t100\r\n\n  2 11 5   200\n\t\n3\t12\tnan\t-7\n+4\t13\t1e0\t9\n"
    cols = kernels.parse_columns(write(tmp_path, text), "iifi")
    assert [c.tolist() for c in cols[:2]] == [[1, 2, 3, 4], [10, 11, 12, 13]]
    assert cols[3].tolist() == [100, 200, -7, 9] and cols[0].dtype == np.int64 and cols[2].dtype == np.float64
    assert cols[2][0] == 4.5 and np.isnan(cols[2][2])        # the caller refuses a NaN rating, not the parser
    assert cols[0].flags.c_contiguous
    assert [c.tolist() for c in kernels.parse_columns(write(tmp_path, "1 10 4.5 100\n2 11 5 200\n"), "iiFi")] == \
        [[1, 2], [10, 11], [100, 200]]                      # 'F': checked, not kept


def test_delimiters_header_and_skipped_fields(tmp_path):
    dat = kernels.parse_columns(write(tmp_path, "1::10::5::100\n2 :: 11::3.5::200\n"), "iifi", "::")
    assert dat[0].tolist() == [1, 2] and dat[2].tolist() == [5.0, 3.5] and dat[3].tolist() == [100, 200]
    csv = kernels.parse_columns(write(tmp_path, "userId,movieId,rating,timestamp\n1,10,x,100\n2,11,,200\n"), "ii-i",
                                ",", skip_lines=1)
    assert [c.tolist() for c in csv] == [[1, 2], [10, 11], [100, 200]]


@pytest.mark.parametrize("text,kinds,delimiter", [
    ("1 10 5 100\n2 11 200\n", "iifi", ""),           # a row of another field count
    ("1 10 5 100 7\n", "iifi", ""),
    ("1 1.0 5 100\n", "iifi", ""),                     # an id written as a float: the line parser names it
    ("1 x 5 100\n", "iifi", ""),
    ("1 10 five 100\n", "iifi", ""),
    ('1,"10",100\n', "iii", ","),                      # CSV quoting: numpy's parser knows it
    ("1,,100\n", "iii", ","),
    ("1 1234567890123456789 5 1\n", "iifi", ""),       # more than 18 digits
    ("1 10 5 1\x00\n", "iifi", ""),
    ("1 10 nan 1\n", "iiFi", ""),                     # a rating that must be finite: the line parser names it
    ("1 10 -inf 1\n", "iiFi", ""),
])
def test_refuses_what_it_must_leave_to_the_slower_parsers(tmp_path, text, kinds, delimiter):
    assert kernels.parse_columns(write(tmp_path, text), kinds, delimiter) is None


def test_rows_across_chunk_edges(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 10**9, size=(5000, 3))
    text = "".join(f"{a}\t{b}\t{c}\n" + ("\n" if a % 7 == 0 else "") for a, b, c in rows)
    path = write(tmp_path, text)
    for chunk in (64, 97, 4096):                    # lines cut by every chunk edge; blank lines at some
        monkeypatch.setattr(kernels, "CHUNK_BYTES", chunk)
        cols = kernels.parse_columns(path, "iii")
        assert np.array_equal(np.stack(cols, 1), rows), chunk
    monkeypatch.setattr(kernels, "CHUNK_BYTES", 16)
    assert kernels.parse_columns(write(tmp_path, "123456789 123456789 1\n" * 3, "long.txt"), "iii") is None


def test_codes_order_and_rescale_match_numpy(monkeypatch):
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 5000, size=20000) * 3
    major = rng.integers(0, 300, size=20000)
    minor = rng.integers(0, 50, size=20000)                  # many ties: their file order must be kept
    with_kernels = flat.codes(keys), flat.stable_order(major, minor)
    monkeypatch.setattr(kernels.EXT, "load", lambda: None)
    without = flat.codes(keys), flat.stable_order(major, minor)
    assert np.array_equal(with_kernels[0][0], without[0][0]) and with_kernels[0][1] == without[0][1]
    assert np.array_equal(with_kernels[1], without[1])
    assert np.array_equal(without[1], np.lexsort((minor, major)))
    times = np.sort(rng.integers(0, 10**6, size=(300, 20)), axis=1).reshape(-1)
    times[:20] = 5                                           # a user whose times are all equal: scale 1
    offsets = np.arange(0, 6001, 20)
    monkeypatch.undo()
    assert np.array_equal(sequences.rescale_flat(times, offsets), _numpy(sequences.rescale_flat, times, offsets))


def _numpy(fn, *args):
    mp = pytest.MonkeyPatch()
    mp.setattr(kernels.EXT, "load", lambda: None)
    try:
        return fn(*args)
    finally:
        mp.undo()


@pytest.mark.parametrize("name,text", [
    ("u.data", "7\t30\t4\t900\n7\t10\t3\t100\n9\t20\t5\t50\n7\t30\t4\t900\n9\t10\t1\t60\n7\t20\t2\t100\n"),
    ("ratings.dat", "7::30::4::900\n7::10::3.5::100\n9::20::5::50\n9::10::1::60\n"),
    ("r.csv", "userId,movieId,rating,timestamp\n7,30,4,900\n7,10,3,100\n9,20,5,50\n9,10,1,60\n"),
    ("pairs.txt", "7 30\n7 10\n9 20\n9 10\n"),
])
def test_sequences_the_same_with_the_kernels_off(tmp_path, name, text):
    path = write(tmp_path, text, name)
    on = D.build_sequences(D.read_interactions(path))
    off = _numpy(lambda: D.build_sequences(D.read_interactions(path)))
    for part in ("seqs", "times"):
        assert np.array_equal(getattr(on, part).flat, getattr(off, part).flat), part
        assert np.array_equal(getattr(on, part).offsets, getattr(off, part).offsets), part
    assert on.num_items == off.num_items


def test_tied_neighbours_match_numpy():
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, 5, 3000), rng.integers(0, 4, 3000)
    order = np.lexsort((b, a))
    assert np.array_equal(kernels.tied_neighbours(a, b, order),
                          (a[order][1:] == a[order][:-1]) & (b[order][1:] == b[order][:-1]))
    assert kernels.tied_neighbours(a[:1], b[:1], order[:1]).shape == (0,)
