"""A search space file: which config keys a search varies and how, the metric it optimises, its sampler and pruner.
Read on the login node without optuna (hpc/submit.py checks it before anything is submitted); each error names the
file, the line and the field.

    # configs/search/sasrec-ml100k.yaml  (hpc/submit.py --search FILE --trials 12 --array-parallelism 3)
    metric: ndcg@10              # default: the recipe's selection metric; NAME:max or NAME:min
    sampler: tpe                 # tpe (default) or random; seed: 0
    pruner: median               # median (default) or none; prune_after_epochs: 1, startup_trials: 2
    params:
      optim.lr: {low: 1.0e-4, high: 1.0e-2, log: true}    # a float; log-uniform
      model.num_blocks: {low: 1, high: 3}                 # integers (both bounds written as integers)
      model.dropout: {choices: [0.1, 0.2, 0.5]}           # one of these

    space = load_space("configs/search/sasrec-ml100k.yaml")
    space.params["optim.lr"].bounds()        # the values check_config builds before submitting: (0.0001, 0.01)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainer.config.settings import ConfigError, UniqueKeyLoader

KINDS = ("float", "int", "choices")
SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "none")
TOP_KEYS = ("metric", "sampler", "seed", "pruner", "prune_after_epochs", "startup_trials", "params")


class LineLoader(UniqueKeyLoader):
    """UniqueKeyLoader whose mappings remember the line of each key (errors name it)."""

    def construct_mapping(self, node, deep=False):
        mapping = Lines(super().construct_mapping(node, deep=True))
        mapping.lines = {self.construct_object(k, deep=True): k.start_mark.line + 1 for k, _ in node.value}
        mapping.line = node.start_mark.line + 1
        return mapping


class Lines(dict):
    lines: dict[Any, int]
    line: int = 0


LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, LineLoader.construct_mapping)


@dataclass(frozen=True)
class Param:
    """One key's distribution: float/int between low and high (log: log-uniform; step: a grid), or one of choices."""

    kind: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple = ()

    def bounds(self) -> list:
        """The values a check builds the config with before submitting (every choice; both ends)."""
        return list(self.choices) if self.kind == "choices" else [self.low, self.high]


@dataclass(frozen=True)
class Space:
    params: dict[str, Param]
    metric: str = ""                       # "": the recipe's selection metric (train.select_metric's syntax)
    sampler: str = "tpe"
    seed: int = 0
    pruner: str = "median"
    prune_after_epochs: int = 1            # no trial is pruned before this many evaluations
    startup_trials: int = 2                # nor before this many trials have completed
    path: str = field(default="", compare=False)

    def to_dict(self) -> dict[str, Any]:
        """As the study keeps it (its user attributes: every task reads the same space)."""
        out = asdict(self)
        out["params"] = {k: {**asdict(p), "choices": list(p.choices)} for k, p in self.params.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Space:
        params = {k: Param(**{**p, "choices": tuple(p.get("choices", ()))}) for k, p in data["params"].items()}
        return cls(**{**data, "params": params})


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_param(key: str, spec: Any, where: str) -> Param:
    """One entry of params: (its mapping, 'FILE:LINE: params.KEY') -> Param, or a ConfigError naming it."""
    if isinstance(spec, list):
        spec = Lines(choices=spec)
    if not isinstance(spec, dict):
        raise ConfigError(f"{where}: expected a mapping such as {{low: 1.0e-4, high: 1.0e-2, log: true}} or "
                          f"{{choices: [a, b]}}, got {spec!r}")
    unknown = sorted(set(spec) - {"type", "low", "high", "log", "step", "choices"})
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r} (fields: type, low, high, log, step, choices)")
    kind = spec.get("type") or ("choices" if "choices" in spec else
                                "int" if all(isinstance(spec.get(b), int) and not isinstance(spec.get(b), bool)
                                             for b in ("low", "high")) else "float")
    if kind not in KINDS:
        raise ConfigError(f"{where}: type {kind!r}: one of {', '.join(KINDS)}")
    if kind == "choices":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices or set(spec) - {"type", "choices"}:
            raise ConfigError(f"{where}: choices: a non-empty list (and no low/high/log/step beside it)")
        if any(isinstance(c, (dict, list)) for c in choices):
            raise ConfigError(f"{where}: choices: numbers, strings or booleans (Optuna keeps only those)")
        return Param("choices", choices=tuple(choices))
    low, high, log, step = spec.get("low"), spec.get("high"), spec.get("log", False), spec.get("step")
    for name, value in (("low", low), ("high", high)):
        if not _number(value):
            raise ConfigError(f"{where}: {name}: a number is required, got {value!r}")
    if kind == "int" and not (float(low).is_integer() and float(high).is_integer()):
        raise ConfigError(f"{where}: type int with low {low!r}, high {high!r}: integers are required")
    if not low < high:
        raise ConfigError(f"{where}: low {low!r} must be below high {high!r}")
    if not isinstance(log, bool):
        raise ConfigError(f"{where}: log: true or false, got {log!r}")
    if log and low <= 0:
        raise ConfigError(f"{where}: log: true needs low > 0 (got {low!r})")
    if step is not None and (not _number(step) or step <= 0 or log):
        raise ConfigError(f"{where}: step: a positive number, and not with log: true")
    if kind == "int":
        low, high, step = int(low), int(high), None if step is None else int(step)
    else:
        low, high = float(low), float(high)
    return Param(kind, low=low, high=high, log=log, step=step)


def load_space(path: str | Path) -> Space:
    """The space file at `path` as a Space, or ConfigError naming the file, the line and the field."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--search {path}: no such file (a YAML space: params, metric, pruner; docs/cluster.md)")
    try:
        with open(path, encoding="utf-8-sig") as fh:
            data = yaml.load(fh, Loader=LineLoader) or Lines()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise ConfigError(f"{path}:{mark.line + 1 if mark else ''}: invalid YAML: "
                          f"{getattr(err, 'problem', err)}") from None
    if not isinstance(data, Lines):
        raise ConfigError(f"{path}: the top level must be a mapping (params:, metric:, pruner:, ...)")

    def at(mapping: Lines, key: Any) -> str:
        return f"{path}:{mapping.lines.get(key, mapping.line)}"
    for key in data:
        if key not in TOP_KEYS:
            raise ConfigError(f"{at(data, key)}: unknown field {key!r} (fields: {', '.join(TOP_KEYS)})")
    params = data.get("params")
    if not isinstance(params, Lines) or not params:
        raise ConfigError(f"{at(data, 'params')}: params: a mapping of config keys to their distributions, e.g. "
                          f"params: {{optim.lr: {{low: 1.0e-4, high: 1.0e-2, log: true}}}}")
    parsed = {}
    for key, spec in params.items():
        if not isinstance(key, str) or "." not in key:
            raise ConfigError(f"{at(params, key)}: params: {key!r} is not a config key (section.key, e.g. optim.lr)")
        parsed[key] = parse_param(key, spec, f"{at(params, key)}: params.{key}")
    options: dict[str, Any] = {}
    for key, allowed in (("sampler", SAMPLERS), ("pruner", PRUNERS)):
        if key in data:
            if data[key] not in allowed:
                raise ConfigError(f"{at(data, key)}: {key}: {data[key]!r}: one of {', '.join(allowed)}")
            options[key] = data[key]
    for key, low in (("seed", 0), ("prune_after_epochs", 0), ("startup_trials", 0)):
        if key in data:
            if not isinstance(data[key], int) or isinstance(data[key], bool) or data[key] < low:
                raise ConfigError(f"{at(data, key)}: {key}: an integer >= {low}, got {data[key]!r}")
            options[key] = data[key]
    if "metric" in data:
        if not isinstance(data["metric"], str) or not data["metric"].strip():
            raise ConfigError(f"{at(data, 'metric')}: metric: a validation metric's name, e.g. ndcg@10 or loss:min")
        options["metric"] = data["metric"].strip()
    return Space(parsed, path=str(path), **options)
