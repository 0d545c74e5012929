"""The layout keeps the design's boundaries: imports run downward only (no circles), the planner and the spec
import no torch, torch.cuda lives in the CUDA backend, and every shared name has one home."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "offload"

# Each module may import from its own layer and the layers below (a top-level module or a package).
LAYERS = [
    {"__init__", "errors", "paths", "formats", "system", "units", "attention_sizes", "config_values", "rate_curves",
     "option_values", "environment", "rope_spec", "families", "moe_spec",
     "reasoning"},
    {"spec", "hardware", "sampling", "options", "baseline", "structured", "tools", "tool_parsers"},
    {"planner", "kernels"},
    {"profile", "model"},
    {"weights"},
    {"runtime"},
    {"sequence", "kv_pool", "schedule_step", "grammar", "prefix_cache", "proposal_tree"},
    {"generate", "engine", "speculative", "quality", "substitute_draft"},
    {"api", "simulate", "costfit", "quick_calibration"},
    {"jobs"},
    {"serve"},
    {"cli", "__main__"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """offload modules that path imports, at any depth (function-level imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in modules and n.startswith("offload")}
    return found


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_has_a_layer():
    assert {_top(m) for m in _modules()} <= set(RANK), sorted({_top(m) for m in _modules()} - set(RANK))


def test_imports_run_downward_only():
    modules = _modules()
    upward = [f"{m} imports {dep}" for m, path in modules.items() for dep in _imports(path, modules)
              if RANK[_top(dep)] > RANK[_top(m)]]
    assert not upward, upward


def test_no_import_circles():
    modules = _modules()
    graph = {m: {d for d in _imports(p, modules) if d != m} for m, p in modules.items()}
    # a package's __init__ importing its own submodules is how packages export names, not a circle
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_planner_spec_and_formats_import_no_torch():
    code = ("import sys; import offload.planner, offload.spec, offload.formats, offload.hardware; "
            "from offload.planner import PlanRequest, plan_for; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_torch_cuda_only_in_the_cuda_backend():
    users = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if "torch.cuda" in p.read_text()]
    assert users == ["runtime/backends/cuda.py"], users


def _module_constants() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                if isinstance(t, ast.Name) and re.fullmatch(r"[A-Z][A-Z0-9_]*", t.id):
                    out.setdefault(t.id, []).append(str(path.relative_to(PACKAGE)))
    return out


def test_each_constant_is_defined_in_one_module():
    twice = {name: where for name, where in _module_constants().items() if len(where) > 1}
    assert not twice, twice


def test_format_names_are_listed_only_in_the_formats_package():
    """A literal list of weight formats anywhere but offload/formats/ is a second definition that can drift."""
    listing = re.compile(r"""["'](q8_0|q4_0|bf16|fp16|fp32)["']\s*,\s*["'](q8_0|q4_0|bf16|fp16|fp32)["']""")
    offenders = [f"{p.relative_to(PACKAGE)}:{i}" for p in PACKAGE.rglob("*.py") if p.parent.name != "formats"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if listing.search(line)]
    assert not offenders, offenders


def test_the_spec_names_the_stored_format_apart_from_the_compute_one():
    from offload.spec import ModelSpec

    fields = ModelSpec.__dataclass_fields__
    assert "stored_format" in fields and "dtype" not in fields


def test_python_in_the_folder_holding_a_clone_named_offload_imports_the_package(tmp_path):
    """Issue 44 item 15: `from offload import LLM` run in the folder that holds the clone failed with "cannot import
    name 'LLM' from 'offload' (unknown location)": Python's path search, before setuptools' editable finder, took the
    clone's folder for a namespace package. The editable install this pyproject makes is a path entry (the clone's
    root), whose regular package wins. Built here from a copy of the clone named offload, installed into a site
    folder, imported from the folder that holds it."""
    import os
    import shutil
    import sysconfig
    import zipfile

    pytest.importorskip("setuptools", minversion="77", reason="the build requirement of pyproject.toml")
    root = Path(__file__).resolve().parent.parent
    clone = tmp_path / "parent" / "offload"
    clone.mkdir(parents=True)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(root / name, clone / name)
    shutil.copytree(root / "offload", clone / "offload", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    build = ("import sys, setuptools.build_meta as b; sys.path.insert(0, '.'); "
             f"print(b.build_editable({str(tmp_path / 'wheel')!r}))")
    (tmp_path / "wheel").mkdir()
    made = subprocess.run([sys.executable, "-c", build], cwd=clone, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OFFLOAD_NO_EXT": "1"})
    assert made.returncode == 0, made.stderr[-3000:]
    zipfile.ZipFile(tmp_path / "wheel" / made.stdout.split()[-1]).extractall(tmp_path / "site")
    # the copy's install first, then this environment's packages (torch...) without its own install of offload
    # winning: python -S, the two site folders added in that order
    packages = sysconfig.get_paths()["purelib"]  # this environment's (under -S the child knows no venv)
    check = (f"import site; site.addsitedir({str(tmp_path / 'site')!r}); site.addsitedir({packages!r}); "
             f"from offload import LLM; import offload; print(offload.__file__)")
    shell = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a user's, whose path names no clone
    ran = subprocess.run([sys.executable, "-S", "-c", check], cwd=clone.parent, capture_output=True, text=True,
                         timeout=300, env=shell)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert Path(ran.stdout.split()[-1]) == clone / "offload" / "__init__.py"
