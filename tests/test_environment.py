"""The environment variables offload reads are one table with their meaning (offload/environment.py, issue 44 item
16): every variable the package or its install reads is in it, and `offload --help` and docs/environment.md show
it."""

from __future__ import annotations

import ast
import contextlib
import io
from pathlib import Path

from offload.cli.main import main
from offload.environment import ENVIRONMENT, environment_markdown

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [*sorted((ROOT / "offload").rglob("*.py")), ROOT / "setup.py"]


def _is_environ(node) -> bool:
    """os.environ (or a bare environ)."""
    return getattr(node, "attr", None) == "environ" or getattr(node, "id", None) == "environ"


def _read_names(tree) -> list[ast.expr]:
    """The expressions naming a variable read: os.environ.get(X), os.getenv(X), os.environ[X], X in os.environ."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and (
                getattr(node.func, "attr", None) == "get" and _is_environ(node.func.value)
                or getattr(node.func, "attr", None) == "getenv"):
            found.append(node.args[0])
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            found.append(node.slice)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            found.append(node.left)
    return found


def variables_read() -> set[str]:
    """Every variable the sources read, names resolved through module-level string constants (ENV_VAR = "...")."""
    trees = {path: ast.parse(path.read_text(), str(path)) for path in SOURCES}
    constants = {target.id: node.value.value for tree in trees.values() for node in tree.body
                 if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                 and isinstance(node.value.value, str) for target in node.targets if isinstance(target, ast.Name)}
    read = set()
    for path, tree in trees.items():
        for expr in _read_names(tree):
            name = expr.value if isinstance(expr, ast.Constant) else constants.get(getattr(expr, "id", None))
            assert isinstance(name, str), f"{path.relative_to(ROOT)}:{expr.lineno}: a variable this test cannot name"
            read.add(name)
    return read


def test_every_variable_read_is_in_the_table_and_only_those():
    read = variables_read()
    assert read - set(ENVIRONMENT) == set(), "variables read without a line in offload/environment.py"
    assert set(ENVIRONMENT) - read == set(), "variables in the table that nothing reads"
    assert {"OFFLOAD_CACHE", "OFFLOAD_KERNELS", "OFFLOAD_API_KEY", "OFFLOAD_NO_EXT"} <= read


def test_offload_help_lists_every_variable_with_its_meaning():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(["--help"])
    text = " ".join(out.getvalue().split())
    assert "environment variables:" in text
    for name, meaning in ENVIRONMENT.items():
        assert f"{name} {meaning}" in text, name


def test_the_docs_page_is_current():
    page = (ROOT / "docs" / "environment.md").read_text()
    assert page == environment_markdown(), "run `python -m offload.environment > docs/environment.md`"
