"""Settings that other settings would make the run ignore: each refused before the run starts, in one line, naming the
setting that would make it count. Declared beside the section that owns the keys (its `ignored` class variable) and
walked by one check (trainer.config.settings.configure); docs/configuration.md lists every rule.

    @dataclass
    class SeqLossConfig:
        ignored: ClassVar[tuple[Ignored, ...]] = (
            Ignored("gbce_t", 0.5, lambda s: s.kind == "gbce", "loss.kind=gbce"),)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable


class IgnoredSettingError(ValueError):
    """A setting the chosen options would ignore (a ConfigError to the caller: exit 2)."""


@dataclass(frozen=True)
class Ignored:
    """`key` (of this section) counts only when applies(section) holds, which `when` says in words. example: a value
    of it that differs from the default, and under: the other keys of the section that make it ignored (both for the
    test that walks every rule)."""

    key: str
    example: Any
    applies: Callable[[Any], bool]
    when: str
    under: dict[str, Any] = field(default_factory=dict)


def _default(section: Any, key: str) -> Any:
    f = next(f for f in dataclasses.fields(section) if f.name == key)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()    # type: ignore[misc]


def refuse_ignored(section: Any, prefix: str) -> None:
    """Raise IgnoredSettingError for the first key of `section` set away from its default where it would be ignored."""
    for rule in getattr(type(section), "ignored", ()):
        value = getattr(section, rule.key)
        if value != _default(section, rule.key) and not rule.applies(section):
            raise IgnoredSettingError(f"{prefix}{rule.key}={value} would be ignored: it counts only with {rule.when}"
                                      f"\nHINT: remove {prefix}{rule.key}, or set {rule.when}")
