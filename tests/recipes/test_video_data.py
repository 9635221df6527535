"""Video data: decoding the real carphone clip (synthetic video without ../shared), the frame cache and its
stale detection, clip centring and edge padding, the video-level split, class weights, the upstream
annotation layout with a merge map, and the documented errors."""
import csv
import shutil

import numpy as np
import pytest

from tests.conftest import REPO
from tests.timeouts import limit
from trainer.recipes.video import data as D
from trainer.recipes.video.clips import Clips, VideoDataConfig, class_weights, prepare, split_videos

CARPHONE = REPO.parent / "shared" / "data" / "videos" / "carphone_pristine.mp4"


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return D.synth_videos(tmp_path_factory.mktemp("videos"), videos=5, frames=40, size=32, classes=3)


def test_decoding_the_real_video_gives_its_frames_and_size(synth):
    if CARPHONE.exists():
        frames = list(D.decode(CARPHONE, size=0, gray=True))
        assert len(frames) == 120 and frames[0].shape == (144, 176) and frames[0].dtype == np.uint8
        rgb = next(D.decode(CARPHONE, size=64, gray=False))
        assert rgb.shape == (64, 64, 3)
        assert D.video_info(CARPHONE)["fps"] == pytest.approx(29.97, abs=0.01)
    else:
        print(f"{CARPHONE} missing: decoding a synthetic H.264 video instead")
        frames = list(D.decode(synth / "synth00.mp4", size=0, gray=True))
        assert len(frames) == 40 and frames[0].shape == (32, 32)
    assert 10 < np.mean(frames[0]) < 245                         # a real picture, not a blank frame


def test_frame_cache_round_trip_and_stale_detection(tmp_path, synth):
    src = tmp_path / "src"
    shutil.copytree(synth, src)
    videos = D.find_videos(src)
    spec = D.CacheSpec(size=24, gray=True)
    manifest = D.extract_frames(videos, src / ".frame-cache", spec, progress=False)
    entry = manifest["synth01.mp4"]
    cached = np.load(src / ".frame-cache" / entry["file"], mmap_mode="r")
    decoded = np.stack(list(D.decode(videos["synth01.mp4"], 24, True)))
    assert cached.shape == (40, 24, 24) and np.array_equal(cached, decoded)
    assert entry["frames"] == 40 and entry["fps"] == pytest.approx(25) and len(entry["source_sha256"]) == 64
    cache = src / ".frame-cache"
    assert D.stale_reason(entry, videos["synth01.mp4"], cache, spec) is None
    assert D.stale_reason(entry, videos["synth01.mp4"], cache, D.CacheSpec(32, True)) == "cached with other settings"
    other = D.synth_videos(tmp_path / "other", videos=2, frames=40, size=32, classes=3, seed=9)
    shutil.copy(other / "synth01.mp4", videos["synth01.mp4"])           # the video is replaced
    assert D.stale_reason(entry, videos["synth01.mp4"], cache, spec) == "the video changed since it was cached"
    again = D.extract_frames(videos, cache, spec, progress=False)       # only the stale one is redone
    assert again["synth01.mp4"]["source_sha256"] != entry["source_sha256"]
    assert again["synth00.mp4"] == manifest["synth00.mp4"]


def test_clips_are_centred_and_padded_by_repeating_edge_frames():
    clips = Clips([], [10], np.zeros(3, np.int64), np.array([0, 5, 9]), np.zeros(3, np.int64), clip_len=5,
                  stride=1)
    assert clips.frame_indices(0).tolist() == [0, 0, 0, 1, 2]
    assert clips.frame_indices(1).tolist() == [3, 4, 5, 6, 7]
    assert clips.frame_indices(2).tolist() == [7, 8, 9, 9, 9]
    strided = Clips([], [10], np.zeros(1, np.int64), np.array([4]), np.zeros(1, np.int64), clip_len=5, stride=2)
    assert strided.frame_indices(0).tolist() == [0, 2, 4, 6, 8]


def test_clip_content_comes_from_the_cache(tmp_path, synth):
    cfg = VideoDataConfig(path=str(synth), cache=str(tmp_path / "cache"), size=16, clip_len=5, val_fraction=0.2,
                          test_fraction=0.2)
    data = prepare(cfg, seed=0)
    train = data.splits["train"]
    clip, label = train[0]
    assert clip.shape == (1, 5, 16, 16) and clip.dtype.is_floating_point is False
    frames = np.load(train.files[int(train.video_idx[0])])
    assert np.array_equal(clip[0].numpy(), frames[train.frame_indices(0)])
    assert int(label) == int(train.labels[0])


def test_video_level_split_has_no_overlap(tmp_path, synth):
    cfg = VideoDataConfig(path=str(synth), cache=str(tmp_path / "cache"), size=16, clip_len=3)
    data = prepare(cfg, seed=3)
    names = [set(v) for v in data.videos.values()]
    assert sum(map(len, names)) == 5 and set.union(*names) == {f"synth{i:02d}.mp4" for i in range(5)}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert a.isdisjoint(b)
    files = {k: {s.files[v].name for v in s.videos} for k, s in data.splits.items()}
    assert files["train"].isdisjoint(files["val"]) and files["train"].isdisjoint(files.get("test", set()))
    fixed = split_videos(["a", "b", "c", "d"], VideoDataConfig(val_videos=["b"], test_videos=["d"]), 0)
    assert fixed == {"train": ["a", "c"], "val": ["b"], "test": ["d"]}
    with pytest.raises(D.DataError, match=r"data.val_videos: \['zz'\] not among"):
        split_videos(["a", "b"], VideoDataConfig(val_videos=["zz"]), 0)


def test_class_weights_are_total_over_classes_times_count():
    labels = np.array([0] * 6 + [1] * 3 + [2] * 1)
    w = class_weights(labels, 4)
    assert w.tolist() == pytest.approx([10 / (4 * 6), 10 / (4 * 3), 10 / (4 * 1), 0.0])


def write_upstream(root, trials, frames_per_trial=5, code=lambda t, f: (t + f) % 8):
    (root / "Annotations").mkdir(parents=True, exist_ok=True)
    for trial in trials:
        with open(root / "Annotations" / f"prediction_mouse1.mp4_{trial}.csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["Frame", "Action"])
            for f in range(frames_per_trial):
                w.writerow([f, code(int(trial), f)])


def test_upstream_layout_concatenates_trials_in_order_and_merges_actions(tmp_path):
    write_upstream(tmp_path, ["10", "2", "1"], code=lambda t, f: {1: 3, 2: 5, 10: 4}[t])
    merge = {"paw_guard": "paw_withdraw", "flinch": "paw_withdraw"}
    (labels,), names = D.read_upstream(tmp_path, merge)
    assert names == ["rest", "paw_withdraw", "paw_lick", "paw_shake", "walk", "active"]
    assert labels.video == "mouse1.mp4" and labels.frames.tolist() == list(range(15))     # 1, 2, then 10
    expected = ["paw_withdraw"] * 5 + ["paw_withdraw"] * 5 + ["paw_shake"] * 5      # guard, flinch merged
    assert [names[i] for i in labels.labels] == expected
    with pytest.raises(D.DataError, match="'jump' is not an action"):
        D.read_upstream(tmp_path, {"jump": "rest"})


def test_annotation_errors_name_the_file(tmp_path, synth):
    write_upstream(tmp_path / "a", ["1"], code=lambda t, f: 9 if f == 3 else 0)
    with pytest.raises(D.DataError, match=r"prediction_mouse1.mp4_1.csv:5: field 'Action': code 9 is not 0-7"):
        D.read_upstream(tmp_path / "a", {})
    (tmp_path / "b.csv").write_text("video,frame,label\nx.mp4,one,still\n")
    with pytest.raises(D.DataError, match=r"b.csv:2: field 'frame': 'one' is not an integer"):
        D.read_generic(tmp_path / "b.csv")
    beyond = tmp_path / "beyond"
    shutil.copytree(synth, beyond)
    with open(beyond / "labels.csv", "a") as fh:
        fh.write("synth02.mp4,40,still\n")                         # the videos have frames 0-39
    with pytest.raises(D.DataError, match=r"annotations of synth02.mp4: frame 40 is beyond the video's 40 frames"):
        prepare(VideoDataConfig(path=str(beyond), size=16, clip_len=3))
    with pytest.raises(D.DataError, match="clip length must be odd"):
        prepare(VideoDataConfig(path=str(synth), clip_len=16))


def test_corrupt_and_truncated_videos_are_named(tmp_path, synth):
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 20)
    with pytest.raises(D.DataError, match=r"bad.mp4: unreadable or corrupt video"):
        list(D.decode(bad))
    cut = tmp_path / "cut.mp4"
    data = (synth / "synth00.mp4").read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(D.DataError, match=r"cut.mp4: (unreadable or corrupt video|corrupt video, decoding failed)"):
        list(D.decode(cut))


def test_synthetic_videos_of_other_settings_are_never_reused(tmp_path, monkeypatch):
    # the default folder is named by the settings: a run asking for longer videos gets them, not an earlier run's
    monkeypatch.chdir(tmp_path)
    short = prepare(VideoDataConfig(size=16, synthetic_videos=5, synthetic_frames=20), seed=0)
    long = prepare(VideoDataConfig(size=16, synthetic_videos=5, synthetic_frames=40), seed=0)
    assert sum(len(c) for c in short.splits.values()) == 5 * 20
    assert sum(len(c) for c in long.splits.values()) == 5 * 40
    # a named data.cache made with other settings is refused, naming both
    cache = tmp_path / "named"
    prepare(VideoDataConfig(size=16, cache=str(cache), synthetic_videos=5, synthetic_frames=20), seed=0)
    with pytest.raises(D.DataError, match=r"made with .*'frames': 20.*not .*'frames': 40.*another data.cache"):
        prepare(VideoDataConfig(size=16, cache=str(cache), synthetic_videos=5, synthetic_frames=40), seed=0)


def test_two_jobs_extracting_one_folder_at_once_decode_each_video_once(tmp_path, synth):
    """Jobs sharing a dataset share its .frame-cache: they take turns, the second finds the work done."""
    import json
    import subprocess
    import sys

    from tests.conftest import clean_env
    src = tmp_path / "src"
    shutil.copytree(synth, src)
    code = ("import json, logging, sys; from pathlib import Path; from trainer.recipes.video import data as D\n"
            "said = []; h = logging.Handler(); h.emit = lambda r: said.append(r.getMessage())\n"
            "logging.getLogger('trainer').addHandler(h); logging.getLogger('trainer').setLevel(logging.INFO)\n"
            "src = Path(sys.argv[1]); m = D.extract_frames(D.find_videos(src), src / '.frame-cache',"
            " D.CacheSpec(24), progress=False)\n"
            "print(json.dumps(dict(extracted=sum(s.startswith('extracting') for s in said), videos=sorted(m))))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(src)], cwd=REPO, env=clean_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    got = [json.loads(p.communicate(timeout=limit("run"))[0].strip().splitlines()[-1]) for p in procs]
    assert sorted(g["extracted"] for g in got) == [0, 5] and got[0]["videos"] == got[1]["videos"]
    manifest = D.read_manifest(src / ".frame-cache")
    assert len(manifest) == 5 and not list((src / ".frame-cache").glob(".*.tmp"))
    assert not (src / ".frame-cache" / ".extract.lock").exists()
    for name, path in D.find_videos(src).items():
        assert D.stale_reason(manifest[name], path, src / ".frame-cache", D.CacheSpec(24)) is None
