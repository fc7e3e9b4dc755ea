"""The registries are assembled where they are defined: OBJECTIVES and TASKS list their
builders from the modules that define them, no module fills another's table as a side effect
of being imported, and `register` stays the way to add an entry (a plugin's)."""

import ast
from pathlib import Path

import pytest

from harness.base.registry import register
from harness.objectives import OBJECTIVES, Objective, build_objective, grid, methods, peers
from harness.tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]


def _side_effects(source: str) -> list[str]:
    """Statements that fill a table at import: `@register(...)` on a definition, and a
    module-level call of `<name>.update(...)`, where the table is imported from another module."""
    tree = ast.parse(source)
    imported = {
        a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names
    }
    found = []
    for node in tree.body:
        for deco in getattr(node, "decorator_list", []):
            if isinstance(deco, ast.Call) and getattr(deco.func, "id", None) == "register":
                table = deco.args[0]
                if isinstance(table, ast.Name) and table.id in imported:
                    found.append(f"@register({table.id}, ...) on {node.name}")
        call = node.value if isinstance(node, ast.Expr) else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
            target = call.func.value
            if call.func.attr == "update" and getattr(target, "id", None) in imported:
                found.append(f"{target.id}.update(...)")
    return found


def test_the_side_effect_finder_by_hand():
    fills = "from x import T\n\n@register(T, 'a')\ndef a(): ...\n\nT.update(b=1)\n"
    assert _side_effects(fills) == ["@register(T, ...) on a", "T.update(...)"]
    own = "T = {}\n\n@register(T, 'a')\ndef a(): ...\n"  # a module's own table: its business
    assert _side_effects(own) == []


def test_no_module_fills_another_modules_table_at_import():
    found = {
        str(p.relative_to(ROOT)): hits
        for p in sorted((ROOT / "harness").rglob("*.py"))
        if (hits := _side_effects(p.read_text()))
    }
    assert found == {}


def test_no_import_is_kept_for_its_side_effect():
    """A `noqa: F401` import in harness/ or analysis/ would be one kept for what importing it
    does (filling a registry, storing a schema): those are explicit calls now."""
    kept = [
        f"{p.relative_to(ROOT)}:{i}"
        for pkg in ("harness", "analysis")
        for p in sorted((ROOT / pkg).rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "noqa: F401" in line
    ]
    assert kept == []


def test_the_tables_list_the_defining_modules_builders():
    assert OBJECTIVES["ppo_clip"] is methods.ppo_clip and OBJECTIVES["vespo"] is peers.vespo
    assert OBJECTIVES["grid"] is grid.grid
    assert {fn.__module__ for fn in TASKS.values()} == {
        f"harness.tasks.{m}" for m in ("arithmetic", "countdown", "hf", "word_problems")
    }
    # the grid composes the peers' corrections beside the methods' ones
    assert {"ratio", "tv", "cis", "s2t", "rs", "opsm", "outlier"} == set(grid.CORRECTIONS)
    assert isinstance(grid.build_correction({"kind": "outlier"}), peers.OutlierTokenMask)


def test_register_adds_an_entry_as_a_plugin_does():
    def my_clip(*, eps: float = 0.1):
        return build_objective("ppo_clip", eps_low=eps, eps_high=eps)

    register(OBJECTIVES, "my_clip")(my_clip)
    try:
        assert OBJECTIVES["my_clip"] is my_clip
        assert isinstance(build_objective("my_clip", eps=0.3), Objective)
        with pytest.raises(KeyError, match="duplicate"):
            register(OBJECTIVES, "my_clip")(my_clip)
    finally:
        del OBJECTIVES["my_clip"]
