"""Typed run configuration. Precedence: dataclass defaults < YAML file < CLI flags < key=value overrides.

    cfg = build_config("toy", yaml_path="configs/toy.yaml", flags={"train.epochs": 3},
                       overrides=["train.lr=0.01", "model.hidden=32"])
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from trainer.config.bounds import FRACTION, POSITIVE, Bound, out_of_range
from trainer.config.ignored import Ignored
from trainer.config.registry import get_spec
from trainer.config.spec import EmptyConfig, RecipeSpec


class ConfigError(ValueError):
    """A bad config key or value; the message names where it came from."""


@dataclass
class TrainConfig:
    """Optimisation and loop settings shared by every recipe."""

    bounds: ClassVar[dict[str, Bound]] = dict(
        epochs=Bound(0, zero="no training: the initial weights are saved and evaluated"),
        max_steps=Bound(0, zero="no limit"), batch_size=POSITIVE,
        global_batch_size=Bound(0, zero="off: --batch-size is per rank"), grad_accum_steps=POSITIVE,
        lr=Bound(0, lo_open=True), momentum=Bound(0, 1), betas=FRACTION, min_lr_ratio=Bound(0, 1),
        clip_grad_norm=Bound(0, zero="no clipping"), eval_every_epochs=POSITIVE,
        eval_batch_size=Bound(0, zero="the training batch size"), early_stop_patience=Bound(0, zero="off"),
        log_every_steps=POSITIVE, num_workers=Bound(0, zero="load in the training process"),
        preflight_slow=Bound(0, 1, hi_open=True, zero="the site's TRAINER_PREFLIGHT_SLOW, else 0.5"))
    ignored: ClassVar[tuple[Ignored, ...]] = (
        Ignored("momentum", 0.5, lambda s: s.optimizer == "sgd", "train.optimizer=sgd"),
        Ignored("betas", [0.8, 0.99], lambda s: s.optimizer != "sgd", "train.optimizer=adamw or adam",
                under=dict(optimizer="sgd")),
        Ignored("min_lr_ratio", 0.1, lambda s: s.schedule != "constant", "train.schedule=cosine or linear",
                under=dict(schedule="constant")),
        Ignored("preflight_slow", 0.3, lambda s: s.preflight != "off", "train.preflight=auto or on",
                under=dict(preflight="off")),
    )
    epochs: int = 10
    max_steps: int = 0                    # stop after this many optimizer steps (0: no limit)
    batch_size: int = 32                  # per rank (per GPU)
    global_batch_size: int = 0            # if > 0: split across ranks and accumulation steps
    grad_accum_steps: int = 1
    optimizer: Literal["adamw", "adam", "sgd"] = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9                 # sgd only
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])   # adam/adamw
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"   # by world size
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 0
    warmup_epochs: float = 0.0            # converted to steps; the larger of the two wins
    min_lr_ratio: float = 0.0             # floor of the decay, as a fraction of the peak lr
    clip_grad_norm: float = 0.0           # 0: no clipping
    amp: Literal["off", "bf16", "fp16", "auto"] = "off"   # auto: bf16 (else fp16) on CUDA, off on CPU
    eval_every_epochs: int = 1
    eval_batch_size: int = 0              # per rank (0: the training batch size)
    early_stop_patience: int = 0          # epochs without improvement of the primary metric (0: off)
    # the validation metric that picks best.pt and drives early stopping ("": the recipe's; NAME or NAME:max|min)
    select_metric: str = ""
    log_every_steps: int = 10
    measure_sync: bool = False            # log forward/backward_frac; under DDP sync_wait_frac (collectives)
    num_workers: int = 0
    progress: Literal["auto", "on", "off"] = "auto"   # tqdm bar on rank 0 (auto: when a terminal)
    log_per_rank: bool = False            # every rank also writes RUN_DIR/train.rank{N}.log (rank 0: train.log too)
    tensorboard: bool = True
    # the GPU-shaped step: fixed shapes, device-side sampling, no host sync (auto: on CUDA devices; on: forced,
    # e.g. on a CPU to test the path a GPU takes; off: the CPU path's packing, length buckets and C++ kernels)
    gpu_path: Literal["auto", "on", "off"] = "auto"
    compile: Literal["off", "default", "reduce-overhead"] = "off"   # torch.compile of the model's training step
    # on: the whole optimizer step (forward, backward, clipping, optimizer) one CUDA graph per batch shape, replayed
    # (trainer/engine/step_graph.py; the GPU-shaped step, one rank, no accumulation; on a CPU the closure is replayed)
    step_graph: Literal["off", "on"] = "off"
    # deterministic kernels (torch.use_deterministic_algorithms, cuDNN, CUBLAS_WORKSPACE_CONFIG): bitwise resume on
    # CUDA, at a cost (docs/gpu.md); an op with no deterministic kernel stops the run naming it
    deterministic: bool = False
    profile: str = ""                     # START:STOP: torch.profiler trace of those optimizer steps (RUN_DIR/profile)
    # device and link checks before the first step (trainer/distributed/preflight.py; auto: several ranks or a GPU)
    preflight: Literal["auto", "on", "off"] = "auto"
    # a host below this fraction of the other hosts' median (matmul, host all-reduce, links) is unfit; lower it where
    # nodes are shared with other work (0: the site's TRAINER_PREFLIGHT_SLOW, else 0.5)
    preflight_slow: float = 0.0
    # a rank slower than the others while training (trainer/distributed/stragglers.py): name it in the log and the
    # train records (warn), or also checkpoint and exit 5 so that the restart loop relaunches without its host
    straggler_action: Literal["warn", "evict", "off"] = "warn"
    # no rank of the group making progress (a step, an evaluation batch, a checkpoint) for this long is a hang: every
    # rank's stacks in RUN_DIR/hangs/, one culprit named alike by every rank, exit 6 for the restart loop to relaunch
    # (trainer/engine/components/hang_watch.py). 0: auto, max(60 s, 20 x the slowest step); below 0: off
    hang_timeout_s: float = 0.0


@dataclass
class CheckpointConfig:
    """When checkpoints are written and how a run resumes."""

    bounds: ClassVar[dict[str, Bound]] = dict(
        every_epochs=Bound(0, zero="never by epoch"), every_steps=Bound(0, zero="never by step"),
        keep_last=Bound(0, zero="keep every periodic checkpoint"),
        signal_latency_s=Bound(0, zero="agree at every step"))
    ignored: ClassVar[tuple[Ignored, ...]] = (
        Ignored("keep_last", 5, lambda s: s.every_epochs > 0 or s.every_steps > 0,
                "ckpt.every_epochs or ckpt.every_steps above 0 (periodic checkpoints to keep)",
                under=dict(every_epochs=0)),)
    every_epochs: int = 1                 # 0: never by epoch
    every_steps: int = 0                  # 0: never by step
    keep_last: int = 3                    # periodic checkpoints kept (best/final are separate)
    save_best: bool = True
    resume: str = ""                      # "" (fresh), "auto" (newest valid in run_dir), or a path
    init_from: str = ""                   # a fresh start takes its weights (only) from this checkpoint
    allow_data_change: bool = False       # a resume may go on with data other than the checkpoint's (logged)
    requeue_signals: list[str] = field(default_factory=lambda: ["SIGUSR1", "SIGUSR2"])
    # ranks agree on a signal at each logging window and, between windows, every so many steps that a signal waits
    # at most this long (measured step time; until the first window: every step) before its checkpoint starts
    signal_latency_s: float = 5.0


@dataclass
class DistConfig:
    """How processes and devices are used."""

    bounds: ClassVar[dict[str, Bound]] = dict(timeout_s=Bound(0, lo_open=True))
    ignored: ClassVar[tuple[Ignored, ...]] = (
        Ignored("gpu_ids", [0, 1], lambda s: s.strategy == "dp", "dist.strategy=dp (--strategy dp)"),
        Ignored("find_unused_parameters", True, lambda s: s.strategy == "ddp", "dist.strategy=ddp",
                under=dict(strategy="single")),
        Ignored("shm_allreduce", "on", lambda s: s.strategy == "ddp" and s.backend != "nccl",
                "dist.strategy=ddp over gloo (dist.backend=auto or gloo)", under=dict(backend="nccl")))
    strategy: Literal["ddp", "dp", "single"] = "ddp"
    gpu_ids: list[int] = field(default_factory=list)     # DataParallel devices (default: all)
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: float = 1800.0            # process-group timeout: a dead rank ends the others
    find_unused_parameters: bool = False
    shm_allreduce: Literal["auto", "on", "off"] = "auto"   # gloo on one host: all-reduce through shared memory


@dataclass
class Config:
    """The whole resolved configuration of a run."""

    bounds: ClassVar[dict[str, Bound]] = dict(seed=Bound(0, 2**32 - 1))
    recipe: str = ""
    run_dir: str = ""
    seed: int = 0
    private: bool = False                 # run directory, checkpoints and logs readable by the owner only
    train: TrainConfig = field(default_factory=TrainConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    data: Any = field(default_factory=EmptyConfig)
    model: Any = field(default_factory=EmptyConfig)
    eval: Any = field(default_factory=EmptyConfig)
    loss: Any = field(default_factory=EmptyConfig)


_SECTIONS: dict[str, type] = {}       # the plugins' own sections (register_section), by name
_CONFIG_CLASSES: dict[tuple, type] = {}


def register_section(name: str, section: type) -> type:
    """A plugin's own config section: a dataclass with defaults (its `bounds` and `ignored` checked as the
    built-ins' are), set as NAME.KEY=VALUE on the command line or under NAME: in a YAML file, saved in config.yaml
    and the checkpoints, read by the plugin's component as trainer.cfg.NAME. Called at the plugin module's import
    (trainer/config/registry.py loads plugins before any config is made); the same section registered again counts
    once, another under a name taken is an error."""
    if not (isinstance(section, type) and dataclasses.is_dataclass(section)):
        raise TypeError(f"register_section({name!r}, ...): a dataclass type is needed, got {section!r}")
    taken = _SECTIONS.get(name)
    same = taken is not None and (taken.__module__, taken.__qualname__) == (section.__module__, section.__qualname__)
    if name in {f.name for f in dataclasses.fields(Config)} or (taken is not None and not same):
        owner = "the trainer" if taken is None else f"{taken.__module__}.{taken.__qualname__}"
        raise ValueError(f"config section {name!r} is taken by {owner}.\nHINT: give the plugin's section another name")
    _SECTIONS[name] = section
    return section


def _reduce_config(cfg: Config):
    return from_dict, (to_dict(cfg), "a copy of the config")


def config_class() -> type:
    """Config, with a field for each plugin section registered (a subclass made once per set of sections)."""
    if not _SECTIONS:
        return Config
    key = tuple(sorted((name, id(section)) for name, section in _SECTIONS.items()))
    if key not in _CONFIG_CLASSES:
        cls = dataclasses.make_dataclass("Config", [(name, section, field(default_factory=section))
                                                    for name, section in _SECTIONS.items()], bases=(Config,))
        cls.__module__ = __name__
        cls.__reduce__ = _reduce_config      # pickled as its values, rebuilt with the plugins' sections
        _CONFIG_CLASSES[key] = cls
    return _CONFIG_CLASSES[key]


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _yaml_value(text: str, where: str) -> Any:
    """A value written in YAML on the command line (a mapping, a list), or one line naming what is wrong."""
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}: {text!r} is not valid YAML ({problem}); write a mapping as "
                          f"'{{a: 1, b: 2}}' (quoted for the shell)") from None


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Convert a YAML or command-line value to the annotated type, or raise ConfigError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return _yaml_value(value, where) if isinstance(value, str) else value
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if origin is Literal:
        if isinstance(value, bool):  # YAML 1.1 reads on/off/yes/no as booleans
            value = next((c for c in (("on", "true", "yes") if value else ("off", "false", "no"))
                          if c in args), value)
        if value not in args and str(value) in map(str, args):
            value = next(a for a in args if str(a) == str(value))
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, args))}")
        return value
    if origin in (list, tuple):
        if isinstance(value, str):
            text = value.strip().strip("[]")
            value = [v.strip() for v in text.split(",") if v.strip()] if text else []
        if not isinstance(value, (list, tuple)):
            value = [value]
        item = args[0] if args else Any
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if hint is dict or origin is dict:
        if isinstance(value, str):
            value = _yaml_value(value, where) if value.strip() else {}
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {value!r} is not a mapping (e.g. {{a: b, c: d}})")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in _TRUE | _FALSE:
            return str(value).lower() in _TRUE
        raise ConfigError(f"{where}: {value!r} is not a boolean (true/false)")
    if hint in (int, float, str):
        try:
            if hint is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return hint(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: {value!r} is not a valid {hint.__name__}") from None
    return value


def _fields(obj: Any) -> dict[str, Any]:
    """Field name -> resolved type hint of a dataclass instance."""
    hints = typing.get_type_hints(type(obj))
    return {f.name: hints[f.name] for f in dataclasses.fields(obj)}


def valid_keys(obj: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a config tree: ['seed', 'train.lr', ...]."""
    keys = []
    for name, _ in _fields(obj).items():
        sub = getattr(obj, name)
        keys.extend(valid_keys(sub, f"{prefix}{name}.") if dataclasses.is_dataclass(sub)
                    else [f"{prefix}{name}"])
    return keys


def best_match(key: str, keys: list[str]) -> str | None:
    """The valid key a mistyped one most likely means: a close spelling of the whole key, else a key whose last
    part is (close to) it: `epochs` -> `train.epochs`, `train.epcohs` -> `train.epochs`."""
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.7)
    if close:
        return close[0]
    last = key.rsplit(".", 1)[-1]
    tails = {k.rsplit(".", 1)[-1]: k for k in keys}
    same = [k for k in keys if k.rsplit(".", 1)[-1] == last]
    if same:
        return same[0]
    close = difflib.get_close_matches(last, list(tails), n=1, cutoff=0.75)
    return tails[close[0]] if close else None


def _node_for(cfg: Any, parts: list[str], source: str, dotted: str) -> tuple[Any, Any]:
    """Walk to the parent of the last key; (parent, type hint of the last key)."""
    node = cfg
    for i, part in enumerate(parts):
        fields = _fields(node) if dataclasses.is_dataclass(node) else {}
        if part not in fields:
            section = ".".join(parts[:i])
            close = best_match(dotted, valid_keys(cfg))
            guess = f" Did you mean {close!r}?" if close else ""
            if not section:         # the top level: its sections, not every key of every section
                choices = [f"{name}.*" if dataclasses.is_dataclass(getattr(node, name)) else name for name in fields]
            else:
                choices = valid_keys(node, f"{section}.") if fields else []
            raise ConfigError(f"{source}: unknown config key {dotted!r}.{guess}\nValid keys"
                              f"{' under ' + section if section else ''}: {', '.join(choices)}")
        if i == len(parts) - 1:
            return node, fields[part]
        node = getattr(node, part)
    raise ConfigError(f"{source}: empty config key")


def renamed_key(cfg: Any, dotted: str, source: str) -> str:
    """A deprecated key's new name (the recipe spec's `renamed`), with a warning; other keys unchanged."""
    new = getattr(cfg, "_renamed", {}).get(dotted)
    if new is None:
        return dotted
    # attributed to the config's source, not to this line: the user's file or flag is what must change
    warnings.warn_explicit(f"config key {dotted!r} is deprecated and will be removed in the next release; use "
                           f"{new!r} (docs/configuration.md: Config names)", FutureWarning, filename=source, lineno=0)
    return new


def set_key(cfg: Any, dotted: str, value: Any, source: str) -> None:
    """Set cfg.<dotted> = value with type conversion; an unknown key lists the valid ones."""
    dotted = renamed_key(cfg, dotted, source)
    parts = dotted.split(".")
    parent, hint = _node_for(cfg, parts, source, dotted)
    if dataclasses.is_dataclass(getattr(parent, parts[-1])):
        apply_dict(cfg, value, source, prefix=f"{dotted}.")
    else:
        value = _coerce(value, hint, f"{source}: {dotted}")
        problem = out_of_range(parent, parts[-1], value)
        if problem:
            raise ConfigError(f"{source}: {dotted} = {value!r} is out of range: {problem}")
        setattr(parent, parts[-1], value)


def apply_dict(cfg: Any, values: Any, source: str, prefix: str = "") -> None:
    """Apply a nested mapping (from YAML or a checkpoint) onto a config tree."""
    if values is None and prefix:
        return
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'top level'} must be a mapping, "
                          f"got {type(values).__name__}")
    for key, value in values.items():
        set_key(cfg, f"{prefix}{key}", value, source)


def parse_override(text: str) -> tuple[str, str]:
    """'train.lr=0.1' -> ('train.lr', '0.1'); the value is converted by the field's type later."""
    if "=" not in text or text.startswith("="):
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. train.lr=0.01)")
    key, raw = text.split("=", 1)
    return key.strip(), raw.strip()


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (YAML keeps the last silently: a second
    `train:` section would drop the first one's settings)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                name = key_node.start_mark.name
                where = f"line {line}" if name.startswith("<") else f"{name}:{line}"
                raise ConfigError(f"{where}: key {key!r} given twice (first at line {seen[key]}); YAML would keep "
                                  f"only the last.\nHINT: merge the two into one.")
            seen[key] = line
        return super().construct_mapping(node, deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, UniqueKeyLoader.construct_mapping)


REPOSITORY = Path(__file__).resolve().parents[2]     # the clone (an installed package has no configs/ beside it)


def config_path(path: str | Path) -> Path:
    """--config's file: as given (relative to the working directory), else, for a relative path that names nothing
    there, the repository's (configs/... from any directory); the given path where neither exists."""
    given = Path(path)
    if given.exists() or given.is_absolute() or not (REPOSITORY / given).exists():
        return given
    return REPOSITORY / given


def load_yaml(path: str | Path) -> dict:
    """A YAML config file (config_path: the working directory's, else the repository's) as a mapping, with errors
    that name the file and line."""
    path = config_path(path)
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.y*ml"))[:6]
        raise ConfigError(f"--config {path} is a directory; give a YAML file"
                          + (f" (there: {', '.join(found)})" if found else ""))
    try:
        with open(path, encoding="utf-8-sig") as fh:        # a file handle: marks name the file
            data = yaml.load(fh, Loader=UniqueKeyLoader) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
                          f"save it as UTF-8") from None
    except FileNotFoundError:
        folders = [path.parent] + ([] if path.is_absolute() else [REPOSITORY / path.parent])
        names = {p.name: folder / p.name for folder in folders for p in sorted(folder.glob("*.y*ml"), reverse=True)}
        close = difflib.get_close_matches(path.name, list(names), n=1)
        guess = f" (did you mean {names[close[0]]}?)" if close else ""
        where = "" if path.is_absolute() else f" (looked in {Path.cwd()} and in the repository, {REPOSITORY})"
        raise ConfigError(f"config file {path} does not exist{where}{guess}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{line}: invalid YAML: {getattr(err, 'problem', err)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections (train:, model:, ...)")
    return data


def default_config(recipe: str) -> Config:
    """Dataclass defaults, with the recipe's own data/model sections."""
    return defaults_of(get_spec(recipe))


def defaults_of(spec: RecipeSpec) -> Config:
    """default_config for a spec the caller looked up already."""
    recipe = spec.name
    cfg = config_class()(recipe=recipe, data=spec.data_config(), model=spec.model_config(), eval=spec.eval_config(),
                         loss=spec.loss_config())
    cfg._renamed = dict(spec.renamed)      # not a field: neither saved nor listed among the keys
    for key, value in spec.defaults.items():
        set_key(cfg, key, value, f"recipe {recipe} defaults")
    return cfg


def build_config(recipe: str | None, yaml_path: str | None = None, flags: dict[str, Any] | None = None,
                 overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """defaults < YAML < CLI flags < key=value overrides."""
    return configure(recipe, yaml_path, flags, overrides)[0]


def configure(recipe: str | None, yaml_path: str | None = None, flags: dict[str, Any] | None = None,
              overrides: list[str] | tuple[str, ...] = ()) -> tuple[Config, RecipeSpec]:
    """build_config, with the recipe's spec it looked up: a run looks its recipe up once and passes it along."""
    file_values = load_yaml(yaml_path) if yaml_path else {}
    name = recipe or file_values.get("recipe")
    if not name:
        raise ConfigError("no recipe given: pass --recipe NAME or put 'recipe: NAME' in the config file")
    spec = get_spec(name)
    cfg = defaults_of(spec)
    file_values = {k: v for k, v in file_values.items() if k != "recipe"}
    apply_dict(cfg, file_values, str(yaml_path))
    for key, value in (flags or {}).items():
        if value is not None:
            set_key(cfg, key, value, "command line")
    for text in overrides:
        key, value = parse_override(text)
        set_key(cfg, key, value, f"override {text!r}")
    for name, section in ((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)):
        if dataclasses.is_dataclass(section):
            refuse_ignored(section, f"{name}.")
    return cfg, spec


def refuse_ignored(section: Any, prefix: str) -> None:
    """ConfigError for the first key of `section` set away from its default where the section's own rules
    (trainer/config/ignored.py) say the run would ignore it."""
    defaults = {f.name: f for f in dataclasses.fields(section)}
    for rule in getattr(type(section), "ignored", ()):
        value, f = getattr(section, rule.key), defaults[rule.key]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()   # type: ignore[misc]
        if value != default and not rule.applies(section):
            raise ConfigError(f"{prefix}{rule.key}={value} would be ignored: it counts only with {rule.when}"
                              f"\nHINT: remove {prefix}{rule.key}, or set {rule.when}")


def to_dict(cfg: Config) -> dict:
    """Plain nested dict (for YAML and checkpoints)."""
    return dataclasses.asdict(cfg)


def from_dict(values: dict, source: str = "checkpoint") -> Config:
    """Rebuild a Config from to_dict() output."""
    cfg = default_config(values["recipe"])
    apply_dict(cfg, {k: v for k, v in values.items() if k != "recipe"}, source)
    return cfg


def save_config(cfg: Config, path: str | Path, note: str = "") -> None:
    """Write the resolved config as YAML (next to the results); `note`: a first comment line (what the run trained
    on, where it is not obvious from the keys: generated data)."""
    head = f"# {note}\n" if note else ""
    Path(path).write_text(head + yaml.safe_dump(to_dict(cfg), sort_keys=False))
