"""docs/architecture.md stays true: every file, folder, module and function it names exists; every docs page
keeps its lines within 120 characters and the README within 350 lines; every relative link resolves."""
import importlib
import re

import pytest

from tests.conftest import REPO

DOC = REPO / "docs" / "architecture.md"
PATH = re.compile(r"(?<![\w./-])((?:trainer|hpc|slurm|bench|tests|docs)/[\w./<>-]*)")
DOTTED = re.compile(r"`(trainer(?:\.\w+)+)(?:\(\))?`")


def named_paths(text: str) -> set[str]:
    return {m.rstrip(".,)") for m in PATH.findall(text)}


def test_every_path_the_architecture_names_exists():
    paths = named_paths(DOC.read_text())
    assert len(paths) > 30, "the page names the layout's files"
    missing = []
    for path in sorted(paths):
        if "<name>" in path:
            found = [p for p in (REPO / "trainer" / "recipes").iterdir()
                     if (p / path.split("<name>/", 1)[1]).exists() or path.endswith("<name>/")]
            if not found:
                missing.append(path)
        elif not (REPO / path).exists():
            missing.append(path)
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"


def test_every_module_and_function_the_architecture_names_exists():
    names = set(DOTTED.findall(DOC.read_text()))
    assert "trainer.engine.resume.check_resume_config" in names
    for dotted in sorted(names):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):        # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            for attr in parts[cut:]:
                assert hasattr(obj, attr), f"docs/architecture.md names {dotted}: no {attr!r}"
                obj = getattr(obj, attr)
            break
        else:
            pytest.fail(f"docs/architecture.md names {dotted}, which does not import")


def test_the_recipe_hooks_it_names_are_the_interfaces():
    from trainer.engine import capabilities
    from trainer.engine.recipe import Recipe
    text = DOC.read_text().split("## Recipe interface", 1)[1]
    hooks = re.findall(r"`(\w+)\(\)`", text)
    assert hooks and all(hasattr(Recipe, hook) for hook in hooks), hooks
    named = re.findall(r"`([A-Z]\w+)`", text)
    assert {c.__name__ for c in capabilities.CAPABILITIES} <= set(named), named


def test_docs_lines_and_readme_length():
    pages = [REPO / "README.md", *sorted((REPO / "bench").glob("*.md")), *sorted((REPO / "docs").glob("*.md"))]
    long = [f"{p.relative_to(REPO)}:{n}" for p in pages for n, line in enumerate(p.read_text().splitlines(), 1)
            if len(line) > 120]
    assert not long, f"lines over 120 characters: {long[:10]}"
    assert len((REPO / "README.md").read_text().splitlines()) <= 350


def test_relative_links_resolve():
    pages = [REPO / "README.md", *sorted((REPO / "bench").glob("*.md")), *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, broken


def test_the_layout_names_every_module():
    """Issue 56: the map misses no room. Every module of trainer/ and hpc/ (and every C++ source) is named in the
    layout, by its path or by its file name in its folder's line."""
    layout = DOC.read_text().split("## Layout", 1)[1].split("## Data flow", 1)[0]
    files = [p for d in ("trainer", "hpc") for ext in ("*.py", "*.cpp", "*.h") for p in (REPO / d).rglob(ext)
             if p.name != "__init__.py" and "__pycache__" not in p.parts]
    assert len(files) > 80
    unnamed = [str(p.relative_to(REPO)) for p in files
               if str(p.relative_to(REPO)) not in layout and not re.search(rf"(?<![\w.]){re.escape(p.name)}", layout)]
    assert not unnamed, f"docs/architecture.md's layout does not name: {unnamed}"


def test_test_modules_have_one_name_each_and_the_pages_name_only_real_tests():
    """One name per test module across the suite (a failure's file name says which), and every test file a page
    names exists."""
    names = [p.name for p in (REPO / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    pages = [REPO / "README.md", *sorted((REPO / "bench").glob("*.md")), *sorted((REPO / "docs").glob("*.md"))]
    named = {m for p in pages for m in re.findall(r"tests/[\w/]+\.py", p.read_text())}
    assert named and not [n for n in named if not (REPO / n).exists()]


def readme_map() -> list[str]:
    """The README's "Map of the code": each line's first word (a path), continuation lines left out."""
    block = (REPO / "README.md").read_text().split("## Map of the code", 1)[1].split("```")[1].split("\n", 1)[1]
    return [line.split()[0] for line in block.strip().splitlines() if line.strip() and not line.startswith(" ")]


def test_the_readmes_map_is_the_tree():
    """Every path the map names exists, and every package folder of trainer/ and hpc/ (and every recipe) is on it."""
    named = readme_map()
    assert len(named) > 10 and not [n for n in named if not (REPO / n).exists()], named
    text = (REPO / "README.md").read_text().split("## Map of the code", 1)[1].split("```")[1].split("\n", 1)[1]
    packages = [p for base in ("trainer", "trainer/engine") for p in sorted((REPO / base).iterdir())
                if (p / "__init__.py").exists()] + [REPO / "hpc" / "cluster"]
    unnamed = [str(p.relative_to(REPO)) + "/" for p in packages if str(p.relative_to(REPO)) + "/" not in named]
    assert not unnamed, f"README.md's map does not name: {unnamed}"
    recipes = [p.name for p in (REPO / "trainer/recipes").iterdir() if (p / "__init__.py").exists()]
    assert recipes and all(f"{r}/" in text for r in recipes), recipes
