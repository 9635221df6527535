"""Settings that other settings would make the run ignore: each refused before the run starts, in one line, naming the
setting that would make it count. Declared beside the section that owns the keys (its `ignored` class variable) and
walked by one check (trainer.config.settings.refuse_ignored, from configure()); docs/configuration.md lists every
rule.

    @dataclass
    class SeqLossConfig:
        ignored: ClassVar[tuple[Ignored, ...]] = (
            Ignored("gbce_t", 0.5, lambda s: s.kind == "gbce", "loss.kind=gbce"),)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


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


def generated_only(**examples: Any) -> tuple[Ignored, ...]:
    """The data section's synthetic_* keys (each with an example value): they shape the generated data, which a
    data.path replaces."""
    return tuple(Ignored(key, example, lambda s: not s.path, "data.path empty (generated data)",
                         under=dict(path="/data"))
                 for key, example in examples.items())


def cached_only() -> Ignored:
    """data.cache_cap_gb: the cap of a data cache that data.cache=off turns off."""
    return Ignored("cache_cap_gb", 5.0, lambda s: s.cache != "off", "data.cache on (not off)", under=dict(cache="off"))
