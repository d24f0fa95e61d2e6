"""Move first-party modules and rewrite every reference to them, in one step.

Usage: ``python tools/move_modules.py MOVES_FILE [--dry-run]``

MOVES_FILE holds one move per line, ``OLD_PATH -> NEW_PATH`` (repository-relative; a
``.py`` file or a package folder; ``#`` starts a comment). For each move the tool runs
``git mv`` and then rewrites, in every tracked text file:

- dotted module names (``unicache.router.core`` -> ``unicache.router.request_path.core``,
  submodules of a moved package included, ``module:attr`` entry points included);
- ``from PACKAGE import MODULE`` where ``PACKAGE.MODULE`` moved
  (``from unicache import hop`` -> ``from unicache.contract import hop``);
- file paths (``router/core.py``, ``replica/engine/``), relative links included.

Names are matched whole (``unicache.trace`` never matches ``unicache.tracer``), all moves in
one pass, so a new name is never rewritten again by another move. Folders map onto module
names as pyproject.toml says: ``router/`` is ``unicache.router``, ``replica/`` is
``unicache.replica``, every other folder is its own dotted path.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDER_PACKAGES = {"router": "unicache.router", "replica": "unicache.replica"}
TEXT_SUFFIXES = {".py", ".pyi", ".md", ".toml", ".yaml", ".yml", ".tpl", ".json", ".txt", ".sh", ".cfg", ".ini", ".html",
                 ".proto", ".Dockerfile"}
TEXT_NAMES = {"run", ".dockerignore", ".gitignore", ".helmignore"}


def module_of(path: str) -> str:
    """``router/request_path/core.py`` -> ``unicache.router.request_path.core``."""
    parts = list(Path(path).with_suffix("").parts) if path.endswith(".py") else list(Path(path).parts)
    if parts[-1] == "__init__":
        parts.pop()
    head = FOLDER_PACKAGES.get(parts[0], parts[0])
    return ".".join([head, *parts[1:]])


def read_moves(moves_file: Path) -> list[tuple[str, str]]:
    moves = []
    for n, line in enumerate(moves_file.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        old, sep, new = (s.strip() for s in line.partition("->"))
        if not sep or not old or not new:
            sys.exit(f"{moves_file}:{n}: expected 'OLD -> NEW', got {line!r}")
        if not (REPO / old).exists():
            sys.exit(f"{moves_file}:{n}: {old} does not exist")
        moves.append((old.rstrip("/"), new.rstrip("/")))
    return moves


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout
    files = []
    for name in names.decode().split("\0"):
        path = REPO / name
        if name.startswith("tools/moves/"):
            continue  # the record of past moves keeps their old names
        if name and path.is_file() and (path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES):
            files.append(path)
    return files


class Rewriter:
    """All moves' name and path substitutions, applied to a text in one pass each."""

    def __init__(self, moves: list[tuple[str, str]]):
        self.modules = {module_of(old): module_of(new) for old, new in moves}
        self.paths = dict(moves)
        by_length = sorted(self.modules, key=len, reverse=True)
        self._module_re = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, by_length)) + r")(?!\w)")
        by_length = sorted(self.paths, key=len, reverse=True)
        self._path_re = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, by_length)) + r")(?![\w-])")
        self._from_re = re.compile(r"^(\s*)from\s+([\w.]+)\s+import\s+(\w+)(\s+as\s+(\w+))?\s*$", re.M)

    def _from_import(self, match: re.Match) -> str:
        indent, package, name, alias = match.group(1), match.group(2), match.group(3), match.group(5)
        new = self.modules.get(f"{package}.{name}")
        if new is None:
            return match.group(0)
        parent, leaf = new.rsplit(".", 1)
        bound = alias or name
        return f"{indent}from {parent} import {leaf}" + ("" if bound == leaf else f" as {bound}")

    def rewrite(self, text: str) -> str:
        text = self._module_re.sub(lambda m: self.modules[m.group(1)], text)
        text = self._path_re.sub(lambda m: self.paths[m.group(1)], text)
        return self._from_re.sub(self._from_import, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("moves_file", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="print what would change; move and write nothing")
    args = parser.parse_args(argv)
    moves = read_moves(args.moves_file)
    rewriter = Rewriter(moves)
    changed = []
    for path in tracked_text_files():
        text = path.read_text()
        new = rewriter.rewrite(text)
        if new != text:
            changed.append(path)
            if not args.dry_run:
                path.write_text(new)
    for old, new in moves:
        print(f"move {old} -> {new}  ({module_of(old)} -> {module_of(new)})")
        if not args.dry_run:
            (REPO / new).parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["git", "mv", old, new], cwd=REPO, check=True)
    print(f"{len(changed)} files {'would change' if args.dry_run else 'rewritten'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
