"""The kgat recipe's config sections (no torch here: the CLI, config and hpc/submit.py read them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from trainer.config.bounds import CACHE_CAP, FRACTION, POSITIVE, Bound
from trainer.config.ignored import Ignored, cached_only, generated_only

KS = (20, 40, 60, 80, 100)          # cut-offs of recall/ndcg@K (the KGAT paper's)


@dataclass
class KGATDataConfig:
    """Where the data comes from and how it is split."""

    bounds: ClassVar[dict[str, Bound]] = dict(cache_cap_gb=CACHE_CAP,
                                              val_fraction=Bound(0, 1, hi_open=True, zero="the test split is used"),
                                              kg_batch_size=Bound(0, zero="twice the CF batch"),
                                              synthetic_users=POSITIVE, synthetic_items=POSITIVE,
                                              synthetic_entities=POSITIVE, synthetic_relations=POSITIVE,
                                              synthetic_triples=POSITIVE, synthetic_interactions=POSITIVE)
    ignored: ClassVar[tuple[Ignored, ...]] = (
        cached_only(),
        Ignored("split_seed", 7, lambda s: s.val_fraction > 0, "data.val_fraction above 0 (0: the test split, no draw)",
                under=dict(val_fraction=0)),
        *generated_only(synthetic_users=100, synthetic_items=80, synthetic_entities=160, synthetic_relations=3,
                        synthetic_triples=900, synthetic_interactions=2000, synthetic_seed=1))

    path: str = ""                 # folder in the KGAT format; "" = synthetic data generated in memory
    synthetic: bool = False               # generated data on purpose: needed under Slurm/submitit (data.path "")
    duplicates: Literal["drop", "keep", "error"] = "drop"   # an item repeated on a user's line (drop: warned)
    cache: str = ""                # the parsed-data cache: "" ~/.cache/hpc-trainer/data, "off", or a folder
    cache_cap_gb: float = 20.0     # past it, the least recently used entries no job maps are removed (0: no cap)
    remap_ids: bool = False        # compact sparse ids (refused otherwise); the maps go to RUN_DIR/ids.npz
    user_column: str = ""          # train/test.parquet: the user and item columns ("": `user`, `item`)
    item_column: str = ""
    val_fraction: float = 0.1      # of each user's train items, held out for early stopping (0: use test)
    split_seed: int = 2019
    laplacian: Literal["random-walk", "symmetric"] = "random-walk"
    kg_batch_size: int = 0         # KG triples per rank and step (0: twice the CF batch, the seed's rule)
    synthetic_users: int = 300
    synthetic_items: int = 200
    synthetic_entities: int = 400  # including the items
    synthetic_relations: int = 4
    synthetic_triples: int = 2400
    synthetic_interactions: int = 6000
    synthetic_seed: int = 0


@dataclass
class KGATModelConfig:
    bounds: ClassVar[dict[str, Bound]] = dict(width=POSITIVE, relation_width=POSITIVE, layer_widths=POSITIVE,
                                              dropout=FRACTION)
    width: int = 64                # user/item/entity embeddings (the seed's --embed_size)
    relation_width: int = 64       # relation embeddings (--kge_size)
    layer_widths: list[int] = field(default_factory=lambda: [64, 32, 16])   # one per propagation layer
    dropout: float = 0.1           # message dropout (--mess_dropout)
    aggregator: Literal["bi-interaction", "gcn", "graphsage"] = "bi-interaction"
    pretrain: str = ""             # mf.npz with user_embed/item_embed from BPR-MF ("" = random init)
    phase_optimizers: Literal["separate", "shared"] = "separate"   # one optimizer state per phase (original)
    # which embedding rows a KG step updates: "sparse" (the rows of its batch; Adam's moments of the other
    # rows wait, as SparseAdam; a step costs its batch at any graph size, ranks exchange those rows only) or
    # "dense" (every row every step, as the original TF Adam: a step costs the whole table)
    kg_update: Literal["sparse", "dense"] = "sparse"
    # what the next layer reads: "raw" (the original TF code: the un-normalised output; only the copies
    # concatenated into the final embedding are L2-normalised) or "normalized" (the PyTorch ports)
    layer_input: Literal["raw", "normalized"] = "raw"


@dataclass
class KGATEvalConfig:
    """Full-ranking evaluation over every item a user has not trained on."""

    bounds: ClassVar[dict[str, Bound]] = dict(ks=POSITIVE)

    ks: list[int] = field(default_factory=lambda: list(KS))
    ndcg: Literal["standard", "original"] = "standard"   # original: the KGAT code's inflated IDCG


@dataclass
class KGATLossConfig:
    """L2 weights of the two phases' losses (the seed's --regs)."""

    bounds: ClassVar[dict[str, Bound]] = dict(cf_l2=Bound(0, zero="off"), kg_l2=Bound(0, zero="off"))

    cf_l2: float = 1e-5
    kg_l2: float = 1e-5
