"""docs/router.md's module table is generated from the router modules' docstrings
(docs/gen_module_table.py) and stays current: a module added, removed or redescribed
without regenerating it fails here."""

from __future__ import annotations

import importlib.util

from tests.support.source_tree import REPO


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_module_table", REPO / "docs" / "gen_module_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_module_table_is_current():
    gen = load_generator()
    text = gen.DOC.read_text()
    assert gen.with_table(text) == text, "run: python docs/gen_module_table.py"


def test_the_table_has_a_row_for_every_router_module():
    gen = load_generator()
    table = gen.render()
    on_disk = [p for p in (REPO / "router").rglob("*.py") if "__pycache__" not in p.parts and p.name != "__init__.py"]
    assert len(on_disk) > 30
    missing = [p.relative_to(REPO / "router").as_posix() for p in on_disk
               if f"| `{p.relative_to(REPO / 'router').as_posix()}` |" not in table]
    assert missing == []
