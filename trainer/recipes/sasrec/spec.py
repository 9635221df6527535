"""SASRec / TiSASRec (+ mHC): what the trainer needs to know about this recipe (no torch imported here)."""
from __future__ import annotations

import argparse
import math

from trainer.config.spec import DataCommand, Dataset, RecipeSpec, RecipeTools
from trainer.recipes.sasrec.config import SeqDataConfig, SeqEvalConfig, SeqLossConfig, SeqRecConfig


def _synth_arguments(p: argparse.ArgumentParser) -> None:
    d = SeqDataConfig()
    p.add_argument("--users", type=int, default=d.synthetic_users, help="users (data.synthetic_users)")
    p.add_argument("--items", type=int, default=d.synthetic_items, help="items (data.synthetic_items)")
    p.add_argument("--mean-len", type=int, default=d.synthetic_mean_len,
                   help="mean sequence length (data.synthetic_mean_len)")


def _synth(args: argparse.Namespace) -> int:
    from trainer.recipes.sasrec import data as seqdata
    inter = seqdata.synthesize(args.users, args.items, args.mean_len, args.seed)
    path = seqdata.write_udata(inter, f"{args.out}/u.data")
    print(f"wrote {len(inter.users)} interactions of {args.users} users to {path}")
    return 0


SPEC = RecipeSpec(
    name="sasrec",
    recipe="trainer.recipes.sasrec.recipe:SASRecRecipe",
    summary="SASRec / TiSASRec sequential recommender, optional mHC",
    data_config=SeqDataConfig, model_config=SeqRecConfig, eval_config=SeqEvalConfig, loss_config=SeqLossConfig,
    renamed={"model.hidden": "model.width", "model.blocks": "model.depth", "model.loss": "loss.kind",
             "model.l2_emb": "loss.l2_emb"},
    defaults={"optim.clip_grad_norm": 1.0},          # the seed's main.py always clips (max norm 1)
    tools=RecipeTools(
        synth=DataCommand("user sequences with timestamps in the MovieLens u.data layout", _synth_arguments, _synth),
        datasets={"ml-100k": Dataset("trainer.recipes.sasrec.download:ml_100k", "ml-100k"),
                  "ml-1m": Dataset("trainer.recipes.sasrec.download:ml_1m", "ml-1m")},
        # configs/sasrec/beauty.yaml: no licence lets us fetch it for the user
        data_hints={"beauty.txt": "put there the preprocessed Amazon Beauty of the BERT4Rec paper (one `user item` "
                                  "pair per line, each user's lines in time order)"},
    ),
)


# the benchmark harness's preset (bench/run.py): per-rank batch, fixed overrides, and data(n, out) -> the
# overrides that give at least n training samples; one training sequence per user
BENCH = dict(batch=64, args=("data.maxlen=50", "model.width=32", "eval.max_users=200"),
             data=lambda n, out: [f"data.synthetic_users={max(800, math.ceil(n * 1.1))}"])
