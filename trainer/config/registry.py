"""Recipes by name. Built-in recipes are the folders of trainer/recipes/ that hold a spec.py with SPEC;
out-of-tree ones come from the modules named in TRAINER_PLUGINS (comma-separated), which call register().
Nothing here imports torch.

    from trainer.config.registry import get_spec, recipe_names
    get_spec("har").recipe_class()
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys

from trainer.config.spec import RecipeSpec

_SPECS: dict[str, RecipeSpec] = {}
_LOADED: set[str] = set()


class DuplicateRecipeError(ValueError):
    """Two recipes registered under one name."""


def _where(spec: RecipeSpec) -> str:
    target = spec.recipe
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def register(spec: RecipeSpec) -> RecipeSpec:
    """Make spec known under spec.name. Another recipe under a name already taken is an error (a plugin would
    silently replace a built-in recipe); the same recipe registered again (a module imported twice) is not."""
    known = _SPECS.get(spec.name)
    if known is not None and _where(known) != _where(spec):
        raise DuplicateRecipeError(f"recipe name {spec.name!r} is taken by {_where(known)}; {_where(spec)} "
                                   f"registers it again.\nHINT: give the new recipe another name in its RecipeSpec.")
    _SPECS[spec.name] = spec
    return spec


def spec_modules() -> tuple[list[str], list[str]]:
    """(the built-in recipes' spec modules, the TRAINER_PLUGINS modules), by name: what _load_modules imports, and
    where a tool finds what a recipe keeps beside its SPEC (the benchmark harness: BENCH)."""
    # found by name, as the plugins are: the recipes import this module, not the other way round
    folders = importlib.util.find_spec("trainer.recipes").submodule_search_locations
    builtin = [f"trainer.recipes.{m.name}.spec" for m in pkgutil.iter_modules(folders) if m.ispkg]
    plugins = [m.strip() for m in os.environ.get("TRAINER_PLUGINS", "").split(",") if m.strip()]
    return builtin, plugins


def _load_modules() -> None:
    """Import every built-in recipe's spec module and every TRAINER_PLUGINS module, once each."""
    builtin, plugins = spec_modules()
    for name in builtin + plugins:
        if name in _LOADED:
            continue
        _LOADED.add(name)
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if name in builtin and err.name == name:
                continue            # a helper package without a spec (e.g. shared code)
            if name in plugins and err.name is not None and name.startswith(err.name):
                print(f"warning: TRAINER_PLUGINS names {name!r}, which cannot be imported ({err}); its recipes "
                      f"are not registered.\nHINT: put the folder holding it on PYTHONPATH", file=sys.stderr)
                continue
            if name not in plugins:
                raise
            _plugin_failed(name, err)
            continue
        except Exception as err:            # a plugin's own bug must not break every command (doctor, --help)
            if name not in plugins:
                raise
            _plugin_failed(name, err)
            continue
        spec = getattr(module, "SPEC", None)
        if isinstance(spec, RecipeSpec):
            register(spec)


def _plugin_failed(name: str, err: BaseException) -> None:
    """One warning naming the plugin module, its error and where it was raised; its recipes stay unregistered."""
    import traceback
    frames = traceback.extract_tb(err.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    print(f"warning: TRAINER_PLUGINS module {name!r} raised {type(err).__name__}: {err}{where} while importing; "
          f"its recipes are not registered.\nHINT: fix the module, or remove it from TRAINER_PLUGINS",
          file=sys.stderr)


def specs() -> list[RecipeSpec]:
    """Every registered recipe, by name."""
    _load_modules()
    return [_SPECS[name] for name in sorted(_SPECS)]


def recipe_names() -> list[str]:
    return [s.name for s in specs()]


def get_spec(name: str) -> RecipeSpec:
    """The spec registered under name, or a ValueError listing the known names."""
    _load_modules()
    if name not in _SPECS:
        raise ValueError(f"unknown recipe {name!r}; registered recipes: {', '.join(recipe_names()) or 'none'}")
    return _SPECS[name]
