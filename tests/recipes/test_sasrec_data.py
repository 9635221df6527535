"""SASRec data: every format, malformed lines, k-core, leave-one-out, time rescaling, negatives."""
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.recipes.sasrec import data as D
from trainer.recipes.sasrec.config import SeqDataConfig, SeqEvalConfig

SHARED_ML100K = Path(__file__).resolve().parents[3] / "shared" / "data" / "ml-100k"


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


FORMATS = {
    "pairs.txt": "1 10\n1 11\n1 12\n2 11\n2 12\n2 10\n",
    "u.data": "1\t11\t5\t200\n1\t10\t3\t100\n1\t12\t4\t300\n2\t11\t5\t100\n2\t12\t1\t200\n2\t10\t2\t300\n",
    "ratings.dat": "1::11::5::200\n1::10::3::100\n1::12::4::300\n2::11::5::100\n2::12::1::200\n2::10::2::300\n",
    "x.csv": "userId,movieId,rating,timestamp\n1,11,5,200\n1,10,3,100\n1,12,4,300\n2,11,5,100\n2,12,1,200\n"
             "2,10,2,300\n",
}


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_gives_the_same_sequences(tmp_path, name):
    data = D.build_sequences(D.read_interactions(write(tmp_path, name, FORMATS[name])))
    # items remapped to 1..3 in id order (10->1, 11->2, 12->3); sorted by time where there is one
    assert [s.tolist() for s in data.seqs] == [[1, 2, 3], [2, 3, 1]] and data.num_items == 3


def test_folder_path_and_csv_without_time(tmp_path):
    write(tmp_path, "u.data", FORMATS["u.data"])
    assert D.read_interactions(tmp_path).times is not None
    inter = D.read_interactions(write(tmp_path, "y.csv", "user,item\na,x\na,y\nb,y\n"))
    assert inter.times is None and inter.users == ["a", "a", "b"]


@pytest.mark.parametrize("name,text,message", [
    ("u.data", "1\t2\t5\t100\n1\tx\t5\t101\n", r"u.data:2: field 'item': 'x' is not an integer"),
    ("u.data", "1\t2\t5\t100\n1\t3\t5\tnoon\n", r"u.data:2: field 'timestamp': 'noon'"),
    ("u.data", "1\t2\t5\t100\n1\t3\tgood\t100\n", r"u.data:2: field 'rating'"),
    ("ratings.dat", "1::2::5::100\n1::2::5\n", r"ratings.dat:2: expected 4 fields"),
    ("p.txt", "1 2\n1 2 3 4 5\n", r"p.txt:1: cannot tell|p.txt:2: expected 2 fields"),
    ("z.csv", "who,what\n1,2\n", r"z.csv:1: header .* names no user column"),
    ("z.csv", "user,item\n1,\n", r"z.csv:2: field 'item' is empty"),
    ("e.txt", "\n\n", r"e.txt: the file is empty"),
])
def test_malformed_input_names_file_line_field(tmp_path, name, text, message):
    with pytest.raises(D.DataError, match=message):
        D.read_interactions(write(tmp_path, name, text))


def test_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(D.DataError, match="does not exist"):
        D.read_interactions(tmp_path / "nope")
    with pytest.raises(D.DataError, match="no interactions file found"):
        D.read_interactions(tmp_path)


def test_kcore_is_iterative():
    # item 3 has 1 interaction -> removed -> user 2 drops to 1 -> removed -> item 2 drops to 1 -> removed
    users = np.array([0, 0, 1, 1, 2, 2, 0, 2])
    items = np.array([0, 1, 0, 3, 0, 1, 2, 2])
    keep = D.kcore(users, items, 2)
    assert sorted(zip(users[keep], items[keep])) == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (2, 2)]


def test_leave_one_out_and_short_users():
    data = D.SeqData([np.array([5, 6, 7, 8]), np.array([1, 2])], [np.arange(1, 5), np.arange(1, 3)], 8)
    split = D.Split(data)
    assert split.train(0).tolist() == [5, 6] and split.has_targets(0)
    items, _, target = split.eval_input(0, "val")
    assert items.tolist() == [5, 6] and target == 7
    items, _, target = split.eval_input(0, "test")
    assert items.tolist() == [5, 6, 7] and target == 8
    assert split.train(1).tolist() == [1, 2] and not split.has_targets(1)   # too short: train only


def test_time_rescaling_matches_tisasrec():
    assert D.rescale_times(np.array([100, 100, 160, 400])).tolist() == [1, 1, 2, 6]
    assert D.rescale_times(np.array([7, 7])).tolist() == [1, 1]


def test_negatives_avoid_history_and_are_deterministic():
    rng = np.random.default_rng(0)
    neg = D.sample_negatives(rng, (1000,), 10, np.array([1, 2, 3]))
    assert set(neg.tolist()) <= set(range(4, 11)) and len(set(neg.tolist())) == 7
    data = D.build_sequences(D.synthesize(50, 40, 12, seed=1))
    split = D.Split(data)
    a, b = (D.TrainSequences(split, 20, 2, seed=3) for _ in range(2))
    assert all(np.array_equal(a[i]["neg"], b[i]["neg"]) for i in range(5))
    b.epoch = 1
    assert not np.array_equal(a[0]["neg"], b[0]["neg"])
    few = D.EvalSequences(split, "test", 20, 100, seed=3, max_users=7)
    assert len(few) == 7
    every = D.EvalSequences(split, "test", 20, 100, seed=3).users
    assert set(few.users) <= set(every) and list(few.users) != list(every[:7])     # drawn, not the first ids
    assert list(few.users) == sorted(few.users)
    assert np.array_equal(D.EvalSequences(split, "val", 20, 100, seed=3, max_users=7).users, few.users)  # val = test's
    assert not np.array_equal(D.EvalSequences(split, "test", 20, 100, seed=4, max_users=7).users, few.users)
    assert len(D.EvalSequences(split, "test", 20, 100, seed=3, max_users=10_000)) == len(every)
    ev = D.EvalSequences(split, "test", 20, 100, seed=3)
    assert len(ev) == sum(len(s) >= 3 for s in data.seqs)            # every user with targets
    s = ev[0]
    assert s["candidates"][0] == data.seqs[ev.users[0]][-1]
    assert not set(s["candidates"][1:].tolist()) & set(data.seqs[ev.users[0]].tolist())


def test_eval_samples_kept_in_one_store_equal_the_samples_built_alone():
    """EvalSequences keeps its samples in arrays made once (the histories flat): each sample equals one built
    alone from the split (items left-padded, the target first among fixed negatives, the history without the
    target), in any order of first use, the same at a second read; a pickled copy (a loader worker's) carries no
    arrays and builds the same samples."""
    import pickle
    data = D.build_sequences(D.synthesize(40, 30, 9, seed=4))
    split = D.Split(data)
    for which in ("val", "test"):
        ev = D.EvalSequences(split, which, 6, 10, seed=3)
        order = list(range(len(ev)))[::-1]                     # first use in another order than the rows'
        got = {i: ev[i] for i in order}
        copy = pickle.loads(pickle.dumps(ev))
        assert copy._store is None and len(pickle.dumps(ev)) < 10_000
        for i, u in enumerate(ev.users):
            items, times, target = split.eval_input(u, which)
            rng = np.random.default_rng([3, 1 if which == "val" else 2, u])
            negs = D.sample_negatives(rng, 10, data.num_items, data.seqs[u])
            history = np.unique(items)
            want = dict(seq=D.left_pad(items, 6), time=D.left_pad(times, 6),
                        candidates=np.concatenate([[target], negs]), history=history[history != target])
            for sample in (got[i], ev[i], copy[i]):
                for key, value in want.items():
                    assert sample[key].dtype == (torch.int64 if key != "history" else torch.from_numpy(items).dtype)
                    assert np.array_equal(sample[key].numpy(), value), (which, u, key)
        batch = D.collate([ev[i] for i in range(4)])
        assert batch["seq"].shape == (4, 6) and batch["history"].shape[0] == 4


def test_train_negatives_per_batch_equal_per_user_and_avoid_the_history():
    """The DataLoader fetches a batch at once (__getitems__): each user's negatives are the same whichever
    users share its batch (so they do not change with the world size), never in its history, zero at
    padding, spread over the catalogue; another epoch draws others."""
    data = D.build_sequences(D.synthesize(60, 30, 12, seed=2))
    split = D.Split(data)
    ts = D.TrainSequences(split, 20, 3, seed=5)
    batch = ts.__getitems__(list(range(len(ts))))
    reordered = ts.__getitems__([7, 3, 0])
    for k, i in enumerate((7, 3, 0)):
        assert torch.equal(reordered[k]["neg"], batch[i]["neg"]) and torch.equal(ts[i]["neg"], batch[i]["neg"])
    drawn = []
    for sample, u in zip(batch, ts.users):
        neg, pos = sample["neg"], sample["pos"]
        assert neg.shape == (20, 3) and bool((neg[pos == 0] == 0).all())
        real = neg[pos != 0]
        assert bool((real >= 1).all() and (real <= data.num_items).all())
        assert not set(real.flatten().tolist()) & set(split.train(u).tolist())
        drawn += real.flatten().tolist()
    assert len(set(drawn)) > 0.9 * data.num_items
    ts.epoch = 1
    assert not all(torch.equal(a["neg"], b["neg"]) for a, b in zip(ts.__getitems__([0, 1]), batch[:2]))


def test_a_user_with_every_item_stops_negative_sampling_with_its_id():
    # user a trains on x, y, z (the last two are held out): every item of the catalogue
    inter = D.Interactions(["a"] * 5 + ["b"] * 3, ["x", "y", "z", "x", "y", "x", "y", "z"], np.arange(8))
    split = D.Split(D.build_sequences(inter))
    ts = D.TrainSequences(split, 5, 1, seed=0)
    with pytest.raises(D.DataError, match="user 0 has interacted with every item"):
        ts[0]


def test_empty_train_users_and_split_errors(tmp_path):
    from trainer.config.settings import TrainConfig
    from trainer.distributed.runtime import DistInfo
    from trainer.recipes.sasrec.recipe import SASRecRecipe
    p = write(tmp_path, "u.data", "1\t1\t5\t1\n2\t2\t5\t1\n2\t3\t5\t2\n")
    recipe = SASRecRecipe(SeqDataConfig(path=str(p)), None, TrainConfig(), DistInfo(), eval_cfg=SeqEvalConfig())
    with pytest.raises(D.DataError, match="no user has 3 or more interactions"):
        recipe.build_datasets()


def test_synthetic_is_deterministic_and_power_law():
    a, b = D.synthesize(100, 50, 20, seed=4), D.synthesize(100, 50, 20, seed=4)
    assert a.items == b.items and np.array_equal(a.times, b.times)
    counts = np.sort(np.bincount(np.asarray(a.items, dtype=int)))[::-1]
    assert counts[0] > 4 * np.median(counts[counts > 0])


@pytest.mark.skipif(not SHARED_ML100K.exists(), reason=f"{SHARED_ML100K} not present (licensed data is not "
                    "shipped); the synthetic tests cover the same code")
def test_movielens_100k_real_file():
    data = D.build_sequences(D.read_interactions(SHARED_ML100K))
    assert data.num_users == 943 and data.num_items == 1682 and sum(len(s) for s in data.seqs) == 100000
    five = D.build_sequences(D.read_interactions(SHARED_ML100K), k=5)
    assert all(len(s) >= 5 for s in five.seqs)


def _reference(users, items, times):
    """The per-row semantics the vectorized path keeps: the first of repeated (user, item, time) rows kept, ids
    coded in sorted order, each user's rows by time then file order, TiSASRec's rescaled times."""
    first, rows = set(), []
    for r, key in enumerate(zip(users, items, times)):
        if key not in first:
            first.add(key)
            rows.append(r)
    ucode = {u: c for c, u in enumerate(sorted({users[r] for r in rows}))}
    icode = {i: c + 1 for c, i in enumerate(sorted({items[r] for r in rows}))}
    seqs, rescaled = [], []
    for u in sorted(ucode, key=ucode.get):
        mine = sorted((times[r], r) for r in rows if users[r] == u)
        seqs.append([icode[items[r]] for _, r in mine])
        t = [time for time, _ in mine]
        gaps = [b - a for a, b in zip(t, t[1:]) if b != a]
        scale = min(gaps) if gaps else 1
        rescaled.append([round((x - t[0]) / scale) + 1 for x in t])
    return seqs, rescaled, len(icode)


@pytest.mark.parametrize("seed", range(40))
def test_the_vectorized_path_equals_the_per_row_reference(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 120))
    users, items, times = (rng.integers(lo, hi, n) for lo, hi in ((1, 8), (1, 6), (0, 5)))
    data = D.build_sequences(D.without_duplicates(D.Interactions(users, items, times), "x", "drop"))
    seqs, rescaled, n_items = _reference(users.tolist(), items.tolist(), times.tolist())
    assert data.num_items == n_items and [s.tolist() for s in data.seqs] == seqs
    assert [t.tolist() for t in data.times] == rescaled


def test_popularity_counts_each_users_training_items_in_chunks(monkeypatch):
    """Issue 88: the popularity is counted a chunk at a time, less each user's held-out items, not with a position per
    interaction (480 MB at MovieLens-20M's size): equal to counting each user's train(u), users shorter than 3
    (whole sequences in training) and chunks that cut through a user included."""
    from trainer.recipes.sasrec.read import Interactions
    inter = D.synthesize(60, 25, 6, seed=3)
    extra_users = np.array([1000, 1000, 1001])          # two users with fewer than 3 interactions
    inter = Interactions(np.concatenate([inter.user_ids, extra_users]),
                         np.concatenate([inter.item_ids, np.array([3, 4, 5])]),
                         np.concatenate([inter.times, np.array([1, 2, 3])]))
    data = D.build_sequences(inter)
    split = D.Split(data)
    want = np.zeros(data.num_items + 1)
    for u in range(len(data.seqs)):
        np.add.at(want, split.train(u), 1)
    assert (data.seqs.lengths() < 3).sum() == 2
    monkeypatch.setattr(D, "POPULARITY_CHUNK", 7)          # chunks of 7 interactions: every boundary inside a user
    got = D.popularity_scores(split)
    assert got.dtype == np.float64 and np.array_equal(got, want)
    monkeypatch.setattr(D, "POPULARITY_CHUNK", 1 << 22)
    assert np.array_equal(D.popularity_scores(split), want)


def test_a_run_with_uniform_negatives_counts_no_popularity(monkeypatch):
    """The popularity is counted on first use: popularity sampling and logQ read it, uniform negatives never do."""
    from trainer.recipes.sasrec.config import SeqLossConfig
    from trainer.recipes.sasrec.recipe import SASRecRecipe
    counted = []
    original = D.popularity_scores
    monkeypatch.setattr(D, "popularity_scores", lambda split: counted.append(1) or original(split))
    from trainer.config.settings import build_config
    from trainer.distributed.runtime import DistInfo
    for distribution, expected in (("uniform", 0), ("popularity", 1)):
        cfg = build_config("sasrec", None, None, ["data.synthetic_users=40", "loss.shared_negatives=in_batch"
                                                  if distribution == "uniform" else "loss.shared_negatives=sequence",
                                                  f"loss.negative_distribution={distribution}"])
        counted.clear()
        recipe = SASRecRecipe(cfg.data, cfg.model, cfg.train, DistInfo(), eval_cfg=cfg.eval, seed=0,
                              loss_cfg=cfg.loss, optim_cfg=cfg.optim)
        recipe.build_datasets()
        assert len(counted) == expected, distribution
        assert isinstance(cfg.loss, SeqLossConfig)
