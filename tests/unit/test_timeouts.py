"""tests/timeouts.py: the tests' timeouts come from its one table, scaled by TEST_TIMEOUT_SCALE (issue 84), and the
tests that judge a time carry the one marker tests/under_load.sh selects."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.timeouts import TABLE, limit

TESTS = Path(__file__).resolve().parents[1]
# literal numbers after `timeout=` that are not waits: a parsed flag's value, the harness's own deliberate hang
NOT_WAITS = {"unit/test_environment.py", "unit/test_test_harness.py", "gpu/test_device_clock_cuda.py",
             "unit/test_timeouts.py"}


def test_a_timeout_is_its_table_entry_times_the_factor(monkeypatch):
    monkeypatch.delenv("TEST_TIMEOUT_SCALE", raising=False)
    assert limit("run") == TABLE["run"] == 120
    monkeypatch.setenv("TEST_TIMEOUT_SCALE", "2.5")
    assert limit("run") == 300 and limit("jobs") == 2.5 * TABLE["jobs"]


@pytest.mark.parametrize("raw,said", [("fast", "not a number"), ("0", "must be above 0"), ("-1", "must be above 0")])
def test_a_bad_factor_is_refused_by_name(monkeypatch, raw, said):
    monkeypatch.setenv("TEST_TIMEOUT_SCALE", raw)
    with pytest.raises(ValueError, match=f"TEST_TIMEOUT_SCALE='{re.escape(raw)}': {said}"):
        limit("run")


def test_an_unknown_name_lists_the_table():
    with pytest.raises(KeyError, match="no timeout named 'soon'.*brief, short"):
        limit("soon")


def test_no_test_waits_with_a_number_of_its_own():
    """Every `timeout=`, timeout default and deadline in tests/ is limit(NAME): a machine twice as slow changes one
    factor, not a hundred literals."""
    literal = re.compile(r"\btimeout(=|: float = |: int = )\d|monotonic\(\) \+ \d")
    found = [f"{p.relative_to(TESTS)}:{n}: {line.strip()}"
             for p in sorted(TESTS.rglob("*.py")) if str(p.relative_to(TESTS)) not in NOT_WAITS
             for n, line in enumerate(p.read_text().splitlines(), 1) if literal.search(line)]
    assert not found, "\n".join(found)


def test_the_slowing_tests_carry_the_timing_marker():
    """Each test that slows a rank or host (tests/slowing.py) judges a speed: it is marked timing, so
    tests/under_load.sh runs it beside the busy loops."""
    import ast
    unmarked = []
    for path in sorted(TESTS.rglob("test_*.py")):
        if path == Path(__file__).resolve():
            continue
        tree = ast.parse(path.read_text())
        module_marked = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                            and "timing" in ast.unparse(n.value) for n in tree.body)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                body = ast.unparse(node)
                slows = any(word in body for word in ("slowed_rank(", "slowed_node(", "slowed("))
                marked = module_marked or any("timing" in ast.unparse(d) for d in node.decorator_list)
                if slows and not marked:
                    unmarked.append(f"{path.relative_to(TESTS)}::{node.name}")
    assert not unmarked, unmarked


def test_no_name_in_a_test_shadows_the_table():
    """A parameter or variable named `limit` in a file that imports limit() would call a number (a TypeError
    caught only when that test runs: CI, 2026-12-07)."""
    import ast
    shadowed = []
    for path in sorted(TESTS.rglob("*.py")):
        text = path.read_text()
        if "from tests.timeouts import limit" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            names = [a.arg for a in node.args.args + node.args.kwonlyargs] if isinstance(node, ast.FunctionDef) else \
                [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else []
            if "limit" in names:
                shadowed.append(f"{path.relative_to(TESTS)}:{node.lineno}")
        if re.search(r"parametrize\(\"[^\"]*\blimit\b", text):
            shadowed.append(f"{path.relative_to(TESTS)}: a parameter named limit")
    assert not shadowed, shadowed
