"""Issue 82 point 5: words that are true. Every config key that a --help text, an error hint or a doc page names
exists (in some recipe's config); every knob that slurm/common.sh reads has its row in docs/cluster.md's knob table."""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.conftest import PY, REPO, clean_env
from tests.timeouts import limit
from trainer.config.registry import specs
from trainer.config.sections import ENGINE_RENAMED
from trainer.config.settings import default_config, renamed_key, valid_keys

SECTIONS = ("train", "optim", "log", "faults", "compile", "ckpt", "dist", "search", "data", "model", "eval", "loss")
# a key as a user would write it: section.key=value (a file such as train.log or model.py is never followed by "=")
KEY_SET = re.compile(r"(?<![\w./-])((?:%s)\.[a-z_][a-z0-9_]*)=" % "|".join(SECTIONS))


def known_keys() -> set[str]:
    return {k for spec in specs() for k in valid_keys(default_config(spec.name))}


def is_key(key: str, known: set[str]) -> bool:
    if key in known:
        return True
    try:                                           # an old name still taken (with its warning) counts as true
        return renamed_key(default_config("sasrec"), key, "test") in known
    except Exception:  # noqa: BLE001 - not an old name
        return False


def named_in(text: str) -> set[str]:
    return set(KEY_SET.findall(text))


def help_texts() -> str:
    out = []
    for command in ("train", "eval", "predict", "doctor", "data"):
        proc = subprocess.run([PY, "-m", "trainer", command, "--help"], cwd=REPO, env=clean_env(),
                              capture_output=True, text=True, timeout=limit("run"))
        out.append(proc.stdout + proc.stderr)
    return "\n".join(out)


def test_the_extractor_finds_keys_and_leaves_files_alone():
    assert named_in("set train.select_metric=full_ndcg@10, see train.log and model.py") == {"train.select_metric"}


def test_every_key_a_help_text_names_exists():
    known = known_keys()
    named = named_in(help_texts())
    assert named, "the --help texts name keys"
    assert sorted(k for k in named if not is_key(k, known)) == []


def test_every_key_an_error_hint_or_message_names_exists():
    known = known_keys()
    wrong = {}
    for path in (REPO / "trainer").rglob("*.py"):
        for key in named_in(path.read_text()):
            if not is_key(key, known):
                wrong.setdefault(key, path.relative_to(REPO).as_posix())
    assert wrong == {}


@pytest.mark.parametrize("page", ["README.md"] + sorted(p.relative_to(REPO).as_posix() for folder in ("docs", "bench")
                                                       for p in (REPO / folder).glob("*.md")))
def test_every_key_a_page_names_exists(page):
    known = known_keys()
    text = (REPO / page).read_text()
    # a page's own example config (docs/extending.md's plugin recipe) declares its keys: those are true there
    own = set(re.findall(r"^\s+([a-z_][a-z0-9_]*): [\w\[\], |\"]+ = ", text, re.M))
    assert sorted(k for k in named_in(text) if not is_key(k, known) and k.split(".")[1] not in own) == []


def test_every_knob_common_sh_reads_is_in_the_cluster_table():
    script = (REPO / "slurm" / "common.sh").read_text()
    read = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)(?::-|\})", script)) | set(re.findall(r"for knob in ([A-Z_ ]+);",
                                                                                         script)[0].split())
    knobs = {v for v in read if not v.startswith(("SLURM_", "SRUN_"))}
    doc = (REPO / "docs" / "cluster.md").read_text()
    table = doc[doc.index("| knob | what |"):].split("\n\n")[0]
    rows = set(re.findall(r"`([A-Z][A-Z0-9_]*)[=`]", table))
    assert {"TERM_HOLD_S", "MAX_RESTARTS", "EXTRA"} <= knobs
    assert sorted(knobs - rows) == []


def test_no_help_text_page_or_message_names_a_flat_train_key():
    """Issue 83 point 3: the old flat keys still work (with a warning), but nothing of ours tells a user to write
    one: the help texts, the pages, the package's messages and the shipped configs name the owners' keys."""
    texts = {"--help": help_texts()}
    texts.update({p.relative_to(REPO).as_posix(): p.read_text() for p in [*(REPO / "docs").glob("*.md"),
                  REPO / "README.md", *(REPO / "trainer").rglob("*.py"), *(REPO / "slurm").glob("*")]})
    old = {where: sorted(named_in(text) & set(ENGINE_RENAMED)) for where, text in texts.items()}
    assert {where: keys for where, keys in old.items() if keys} == {}
    shipped = [p for p in (REPO / "configs").rglob("*.yaml")
               if re.search(r"^train:\n(?:  .*\n)*?  (optimizer|lr|log_every_steps|schedule):", p.read_text(), re.M)]
    assert shipped == []
