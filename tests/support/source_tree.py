"""The repository's first-party modules, as the installed package names them.

pyproject.toml maps the import root ``unicache`` onto three folders (``unicache/``,
``router/`` -> ``unicache.router``, ``replica/`` -> ``unicache.replica``). Tests that read
source files by module name (the layering check, the router image's import closure) go
through this one mapping instead of guessing paths.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOT = "unicache"


def package_dirs() -> dict[str, Path]:
    """Package name -> folder, from pyproject.toml's ``[tool.setuptools.package-dir]``."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {ROOT: REPO / ROOT}
    dirs.update({name: REPO / folder for name, folder in setuptools.get("package-dir", {}).items()})
    return dirs


def declared_packages() -> list[str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def module_file(module: str) -> Path | None:
    """Source file of a first-party module or package, or None if there is none."""
    dirs = package_dirs()
    for prefix in sorted(dirs, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            rest = module[len(prefix) :].lstrip(".")
            base = dirs[prefix].joinpath(*rest.split(".")) if rest else dirs[prefix]
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return candidate
            return None
    return None


def module_name(path: Path) -> str:
    """Inverse of :func:`module_file` for a file inside one of the mapped folders."""
    path = path.resolve()
    dirs = package_dirs()
    for prefix in sorted(dirs, key=lambda p: len(str(dirs[p])), reverse=True):
        folder = dirs[prefix].resolve()
        if path.is_relative_to(folder):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts and parts[-1] == "__init__":
                parts.pop()
            return ".".join([prefix, *parts])
    raise ValueError(f"{path} is not in a package folder")


def first_party_files() -> list[Path]:
    """Every .py file of the installed package (generated stubs included)."""
    seen: set[Path] = set()
    for folder in package_dirs().values():
        seen |= set(folder.rglob("*.py"))
    return sorted(seen)


def imported_modules(path: Path, *, skip_optional: bool = False) -> set[str]:
    """Every absolute module name imported anywhere in ``path`` (function bodies included:
    a lazy import still runs), plus ``module.name`` for each ``from module import name``.
    Relative imports are resolved against the file's own package. With ``skip_optional``,
    imports inside a ``try`` whose handler catches ImportError are left out."""
    tree = ast.parse(path.read_text())
    optional: set[int] = set()
    if skip_optional:
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in node.handlers
            ):
                optional |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    own = module_name(path) if path.name != "__init__.py" else module_name(path) + ".__init__"
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = own.split(".")[: -node.level]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module:
                found.add(module)
                found |= {f"{module}.{a.name}" for a in node.names}
    return found
