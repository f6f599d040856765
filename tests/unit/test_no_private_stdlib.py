"""pgqueue uses no private standard-library names: they change without notice between Python
releases (``json.encoder._make_iterencode`` was one)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "pgqueue"
#: Underscored but documented, public API: os._exit, sys._getframe.
DOCUMENTED = {"_exit", "_getframe"}


def private_stdlib_uses(tree: ast.AST) -> list[str]:
    found = []
    stdlib = {name for name in sys.stdlib_module_names if not name.startswith("_")}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in stdlib:
                found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
                if any(part.startswith("_") for part in node.module.split(".")):
                    found.append(node.module)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            base = node.value
            if isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in stdlib and node.attr not in DOCUMENTED:
                found.append(f"{base.id}...{node.attr}")
    return found


def test_no_module_uses_a_private_standard_library_name() -> None:
    uses = {
        str(path.relative_to(SRC)): found
        for path in SRC.rglob("*.py")
        if (found := private_stdlib_uses(ast.parse(path.read_text())))
    }
    assert uses == {}


def test_the_check_finds_the_old_encoder_import() -> None:
    tree = ast.parse("from json.encoder import _make_iterencode\nimport json\njson.encoder._x")
    assert private_stdlib_uses(tree) == ["json.encoder._make_iterencode", "json..._x"]
