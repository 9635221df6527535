"""Typed run configuration. Precedence: dataclass defaults < YAML file < CLI flags < key=value overrides.

    cfg = build_config("toy", yaml_path="configs/toy.yaml", flags={"train.epochs": 3},
                       overrides=["optim.lr=0.01", "model.hidden=32"])
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

from trainer.config.bounds import Bound, out_of_range
from trainer.config.registry import get_spec
from trainer.config.sections import (
    ENGINE_RENAMED,
    CheckpointConfig,
    CompileConfig,
    DistConfig,
    FaultsConfig,
    LogConfig,
    OptimConfig,
    SearchConfig,
    TrainConfig,
)
from trainer.config.spec import EmptyConfig, RecipeSpec


class ConfigError(ValueError):
    """A bad config key or value; the message names where it came from."""


@dataclass
class Config:
    """The whole resolved configuration of a run."""

    bounds: ClassVar[dict[str, Bound]] = dict(seed=Bound(0, 2**32 - 1))
    recipe: str = ""
    run_dir: str = ""
    seed: int = 0
    private: bool = False                 # run directory, checkpoints and logs readable by the owner only
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    log: LogConfig = field(default_factory=LogConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
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
    """Every dotted key of a config tree: ['seed', 'optim.lr', ...]."""
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
    """A deprecated key's new name (the engine's ENGINE_RENAMED, the recipe spec's `renamed`), with a warning;
    other keys unchanged. A checkpoint's config is renamed quietly (from_dict): its writer cannot change it."""
    new = getattr(cfg, "_renamed", {}).get(dotted)
    if new is None:
        return dotted
    if getattr(cfg, "_renamed_quietly", False):
        return new
    why = ("train.* is split into the sections of its owners; docs/configuration.md: Sections"
           if ENGINE_RENAMED.get(dotted) == new else "docs/configuration.md: Config names")
    # attributed to the config's source, not to this line: the user's file or flag is what must change
    warnings.warn_explicit(f"config key {dotted!r} is deprecated and will be removed in the next release; use "
                           f"{new!r} ({why})", FutureWarning, filename=source, lineno=0)
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
    """'optim.lr=0.1' -> ('optim.lr', '0.1'); the value is converted by the field's type later."""
    if "=" not in text or text.startswith("="):
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. optim.lr=0.01)")
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
    cfg._renamed = {**ENGINE_RENAMED, **spec.renamed}      # not a field: neither saved nor listed among the keys
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
    cfg._renamed_quietly = True        # a checkpoint of before a rename: its keys are taken, without a warning
    try:
        apply_dict(cfg, {k: v for k, v in values.items() if k != "recipe"}, source)
    finally:
        del cfg._renamed_quietly
    return cfg


def save_config(cfg: Config, path: str | Path, note: str = "") -> None:
    """Write the resolved config as YAML (next to the results); `note`: a first comment line (what the run trained
    on, where it is not obvious from the keys: generated data)."""
    head = f"# {note}\n" if note else ""
    Path(path).write_text(head + yaml.safe_dump(to_dict(cfg), sort_keys=False))
