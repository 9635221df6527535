"""KGAT: what the trainer needs to know about this recipe (no torch imported here)."""
from __future__ import annotations

import argparse
import math

from trainer.config.spec import DataCommand, Dataset, RecipeSpec, RecipeTools
from trainer.recipes.kgat.config import KGATDataConfig, KGATEvalConfig, KGATLossConfig, KGATModelConfig

PRESET_NAMES = ("tiny", "amazon-book")


def describe(data) -> str:
    """One line of a KGAT dataset's sizes."""
    n_train, n_test = sum(map(len, data.train)), sum(map(len, data.test))
    return (f"{data.n_users} users, {data.n_items} items, {data.n_entities} entities, {data.n_relations} "
            f"relations, {len(data.kg)} triples, {n_train} train / {n_test} test interactions")


def _synth_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=PRESET_NAMES, default="tiny",
                   help="the statistics to match (amazon-book: the KGAT paper's Table 1)")


def _synth(args: argparse.Namespace) -> int:
    from trainer.recipes.kgat import convert
    data = convert.synthesize(convert.Stats(**convert.PRESETS[args.preset]), seed=args.seed)
    print(f"wrote {describe(data)} to {convert.write(data, args.out)}")
    return 0


def _convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", required=True, help="ml-100k or ml-1m folder (u.data+u.item, ratings.dat+movies.dat)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--test-fraction", type=float, default=0.2, help="per-user random test share (0.2)")
    p.add_argument("--seed", type=int, default=2019)


def _convert(args: argparse.Namespace) -> int:
    from trainer.recipes.kgat import convert
    data, lists = convert.convert_movielens(args.src, args.test_fraction, args.seed)
    path = convert.write(data, args.out, lists)
    print(f"wrote {describe(data)} to {path}")
    return 0


SPEC = RecipeSpec(
    name="kgat",
    recipe="trainer.recipes.kgat.recipe:KGATRecipe",
    own_batch_plan=True,         # epoch_batches: a CF and a KG plan per epoch
    summary="KGAT knowledge-graph recommender",
    data_config=KGATDataConfig, model_config=KGATModelConfig, eval_config=KGATEvalConfig, loss_config=KGATLossConfig,
    renamed={"model.embed_dim": "model.width", "model.relation_dim": "model.relation_width",
             "model.layers": "model.layer_widths", "model.mess_dropout": "model.dropout",
             "model.cf_l2": "loss.cf_l2", "model.kg_l2": "loss.kg_l2"},
    tools=RecipeTools(
        synth=DataCommand("clustered users/items/entities in the KGAT file format", _synth_arguments, _synth),
        converters={"movielens-kg": DataCommand("KGAT format from MovieLens ratings + item metadata (genres, "
                                                "release year)", _convert_arguments, _convert)},
        datasets={name: Dataset(f"trainer.recipes.kgat.download:{name.replace('-', '_')}", name)
                  for name in ("amazon-book", "last-fm", "yelp2018")},
        data_hints={"ml-100k-kg": "python -m trainer data download ml-100k --out {parent} && python -m trainer data "
                                  "convert movielens-kg --src {parent}ml-100k --out {path}"},
    ),
)


# the benchmark harness's preset (bench/run.py): per-rank batch, fixed overrides, and data(n, out) -> the
# overrides that give at least n training samples; CF steps only: the epoch's CF phase comes first; train.txt keeps
# 0.8 x 0.9 of the interactions
BENCH = dict(batch=1024, args=("data.synthetic_users=3000", "data.synthetic_items=2000",
                               "data.synthetic_entities=4000", "data.synthetic_triples=20000"),
             data=lambda n, out: [f"data.synthetic_interactions={max(6000, math.ceil(n / 0.72 * 1.05))}"])
