"""The sasrec recipe's config sections (no torch here: the CLI, config and hpc/submit.py read them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from trainer.config.bounds import CACHE_CAP, FRACTION, POSITIVE, Bound
from trainer.config.ignored import Ignored, cached_only, generated_only


@dataclass
class SeqDataConfig:
    """Where the interactions come from and how they are cut into samples."""

    bounds: ClassVar[dict[str, Bound]] = dict(cache_cap_gb=CACHE_CAP,
                                              kcore=Bound(0, zero="no filtering"), maxlen=POSITIVE,
                                              train_negatives=POSITIVE,
                                              synthetic_users=POSITIVE, synthetic_items=Bound(2),
                                              synthetic_mean_len=POSITIVE)
    ignored: ClassVar[tuple[Ignored, ...]] = (
        cached_only(),
        *generated_only(synthetic_users=100, synthetic_items=50, synthetic_mean_len=10, synthetic_seed=1))

    path: str = ""                        # file or folder; "" = synthetic data generated in memory
    synthetic: bool = False               # generated data on purpose: needed under Slurm/submitit (data.path "")
    format: Literal["auto", "pairs", "udata", "dat", "csv", "parquet", "arrow"] = "auto"
    # the columns of a CSV, Parquet or Arrow file ("": the first of user/user_id/uid..., item/item_id/movie_id...,
    # timestamp/time/ts... that the header has)
    user_column: str = ""
    item_column: str = ""
    time_column: str = ""
    duplicates: Literal["drop", "keep", "error"] = "drop"   # rows repeating a user, item and time (drop: warned)
    # the parsed-data cache: "" ~/.cache/hpc-trainer/data (or TRAINER_DATA_CACHE), "off", or a folder; parsed once,
    # memory-mapped by every rank of every later launch (trainer/data/cache.py)
    cache: str = ""
    cache_cap_gb: float = 20.0   # past it, the least recently used entries no job maps are removed (0: no cap)
    kcore: int = 0                        # keep users and items with >= k interactions (TiSASRec: 5)
    maxlen: int = 50                      # sequence length fed to the model
    train_negatives: int = 1              # sampled negatives per position
    synthetic_users: int = 800
    synthetic_items: int = 300
    synthetic_mean_len: int = 40
    synthetic_seed: int = 0


@dataclass
class SeqRecConfig:
    """Model variant and sizes. time=False -> SASRec attention; mhc=False -> plain residuals."""

    bounds: ClassVar[dict[str, Bound]] = dict(width=POSITIVE, depth=POSITIVE, heads=POSITIVE, dropout=FRACTION,
                                              time_span=POSITIVE, mhc_streams=POSITIVE, mhc_sinkhorn_iters=POSITIVE,
                                              mhc_sinkhorn_tol=Bound(0, zero="fixed count"),
                                              mhc_newton_steps=Bound(0, zero="none: the iterations alone"),
                                              init_std=Bound(0, lo_open=True),
                                              length_buckets=POSITIVE)

    width: int = 50                            # item embedding / transformer width
    depth: int = 2                             # transformer blocks
    heads: int = 1
    dropout: float = 0.2
    # pre-LN (the maintained port), post-LN (the paper's text), or original: both papers' code (SASRec 2018's
    # TensorFlow, pmixer's port before 2024, Klenitskiy & Vasilev's): x -> LN(x) + attention(q=LN(x), k=v=x), then
    # LN(x) + FFN(LN(x)); plain residuals only (mHC streams always normalise before each sub-layer)
    norm: Literal["pre", "post", "original"] = "pre"
    # the matrices' initialisation: xavier (both papers' code) or normal (N(0, init_std), biases zero: RecBole's and
    # Klenitskiy & Vasilev's; on a large sparse catalogue xavier's embeddings start ~1/sqrt(items) small, learn slowly)
    init: Literal["xavier", "normal"] = "xavier"
    init_std: float = 0.02
    # SASRec's learned positions: from_end (the newest item always at maxlen, as both papers' left-padded code) or
    # from_start (the oldest kept item at 1, as right-padded code: Klenitskiy & Vasilev's, RecBole's)
    positions: Literal["from_end", "from_start"] = "from_end"
    time: bool = True                          # TiSASRec time-interval aware attention
    time_span: int = 256                       # intervals are clipped at this many (rescaled) units
    mhc: bool = True                           # manifold-constrained hyper-connections
    mhc_streams: int = 4
    mhc_sinkhorn_iters: int = 20               # at most; fewer once rows sum to 1 within the tolerance
    mhc_sinkhorn_tol: float = 1e-4             # 0: always mhc_sinkhorn_iters
    mhc_newton_steps: int = 8                  # then Newton steps for maps still above the tolerance (0: none)
    mhc_gate_init: float = 0.01
    mhc_fp32: bool = True                      # mHC maps in fp32 under AMP (the seed's --mhc_no_amp)
    mhc_fused: bool = True                     # fused C++ kernels for the streams on CPU (built on first use)
    attention_fused: bool = True               # SASRec's training attention as one C++ kernel on CPU (float32)
    grad_checkpoint: bool = False
    length_buckets: int = 4                    # rows sorted by length, each bucket trimmed of padding


@dataclass
class SeqEvalConfig:
    """Evaluation protocol."""

    bounds: ClassVar[dict[str, Bound]] = dict(negatives=POSITIVE, max_users=Bound(0, zero="every user"))

    negatives: int = 100          # sampled protocol: the target plus this many never-seen items
    max_users: int = 0            # 0: every user; N: N users drawn from the seed (the reference ports: 10,000, random)
    full_ranking: bool = True     # also rank all items (history excluded): full_hr/ndcg/recall@5,10,20


@dataclass
class SeqLossConfig:
    """The training loss."""

    bounds: ClassVar[dict[str, Bound]] = dict(l2_emb=Bound(0, zero="off"), gbce_t=FRACTION)
    ignored: ClassVar[tuple[Ignored, ...]] = (
        Ignored("gbce_t", 0.5, lambda s: s.kind == "gbce", "loss.kind=gbce"),
        Ignored("logq", False, lambda s: s.kind == "sampled_softmax", "loss.kind=sampled_softmax"),
        Ignored("shared_negatives", "sequence", lambda s: s.kind != "ce",
                "loss.kind=sampled_softmax, bce or gbce (ce scores every item: it samples no negatives)",
                under=dict(kind="ce")),
        Ignored("negative_distribution", "popularity", lambda s: s.shared_negatives in ("sequence", "batch"),
                "loss.shared_negatives=sequence or batch (popularity draws shared negatives)"),
    )

    # bce: one sampled negative per position; sampled_softmax: a softmax over the position's sampled negatives;
    # ce: a softmax over the whole catalogue at every position (chunked: losses.py); gbce: gSASRec's calibrated BCE
    kind: Literal["bce", "sampled_softmax", "ce", "gbce"] = "bce"
    gbce_t: float = 0.75                              # gbce's calibration t in [0, 1] (gSASRec's default)
    # the sampled negatives (bce, sampled_softmax, gbce): none = data.train_negatives of their own at every position;
    # sequence = data.train_negatives shared by all positions of a sequence; batch = shared by the whole batch;
    # in_batch = the batch's own targets, one per sequence (negatives.py)
    shared_negatives: Literal["none", "sequence", "batch", "in_batch"] = "none"
    negative_distribution: Literal["uniform", "popularity"] = "uniform"   # popularity: training counts (shared)
    logq: bool = True             # sampled_softmax: subtract log q where the sampling is not uniform (popularity,
    #                               in_batch): Yi et al. 2019's correction
    exclude_history: bool = True  # negatives the user has seen: drawn again (none) or masked (shared)
    l2_emb: float = 0.0                               # L2 penalty on the item embeddings
