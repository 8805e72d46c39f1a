"""The `-m exclusive` step collects only files naming the mark (tests/conftest.py
pytest_ignore_collect): a file marking its cases exclusive some other way would never run them."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import EXCLUSIVE_MARK_TEXT

TESTS = Path(__file__).parent


def _marks_exclusive(tree: ast.AST) -> bool:
    """Whether the module applies the `exclusive` mark in any spelling: an attribute `.exclusive`
    on a mark, a getattr/add_marker/mark call naming it as a string."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "exclusive":
            return True
        if isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and a.value == "exclusive"
                                              for a in node.args):
            return True
    return False


def test_every_file_that_marks_cases_exclusive_names_the_mark_as_the_collection_looks_for():
    marking = {p.name for p in TESTS.glob("test_*.py") if _marks_exclusive(ast.parse(p.read_text(encoding="utf-8")))}
    named = {p.name for p in TESTS.glob("test_*.py") if EXCLUSIVE_MARK_TEXT in p.read_text(encoding="utf-8")}
    assert marking, "no file marks a case exclusive: the check below would prove nothing"
    # a file that marks cases exclusive but is skipped by the collection: those cases never run
    assert marking <= named, sorted(marking - named)
