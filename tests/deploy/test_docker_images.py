"""Offline checks of docker/: hadolint, image structure, the router image's dependency
set (no torch, no ray, yet everything the router imports), and the build context."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support.source_tree import imported_modules, module_file, module_name

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {"router": REPO / "docker" / "router.Dockerfile", "replica": REPO / "docker" / "replica.Dockerfile"}
ROUTER_REQUIREMENTS = REPO / "docker" / "requirements-router.txt"
FIRST_PARTY = {"unicache"}
# Not in pyproject.toml's dependencies, needed by the router image (see the file's comments).
ROUTER_ONLY_REQUIREMENTS = {"pyyaml"}


def pyproject_requirements() -> dict[str, Requirement]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    reqs = [Requirement(r) for r in data["project"]["dependencies"]]
    return {canonicalize_name(r.name): r for r in reqs}


def router_requirements() -> dict[str, Requirement]:
    lines = [ln.strip() for ln in ROUTER_REQUIREMENTS.read_text().splitlines()]
    reqs = [Requirement(ln) for ln in lines if ln and not ln.startswith("#")]
    return {canonicalize_name(r.name): r for r in reqs}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        current += stripped[:-1] + " " if stripped.endswith("\\") else stripped
        if not stripped.endswith("\\"):
            op, _, args = current.partition(" ")
            out.append((op.upper(), args.strip()))
            current = ""
    return out


def stages(path: Path) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for op, args in instructions(path):
        if op == "FROM":
            result.append([])
        if result:
            result[-1].append((op, args))
    return result


def arg_defaults(path: Path) -> dict[str, str]:
    out = {}
    for op, args in instructions(path):
        if op == "ARG" and "=" in args:
            name, _, value = args.partition("=")
            out[name] = value.strip('"')
    return out


# --- hadolint --------------------------------------------------------------------------


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_hadolint_reports_nothing_above_style(image):
    hadolint = Path(sys.executable).with_name("hadolint")
    proc = subprocess.run(
        [str(hadolint), "--format", "json", "--no-color", str(DOCKERFILES[image])],
        capture_output=True, text=True, timeout=60,
    )
    findings = json.loads(proc.stdout)
    serious = [(f["code"], f["line"], f["message"]) for f in findings if f["level"] in ("error", "warning")]
    assert serious == []
    assert proc.returncode in (0, 1)


def test_hadolint_is_not_vacuous(tmp_path):
    """The same invocation does report a warning-level finding on a bad Dockerfile."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("hadolint")), "--format", "json", "--no-color", str(bad)],
        capture_output=True, text=True, timeout=60,
    )
    codes = {f["code"] for f in json.loads(proc.stdout) if f["level"] in ("error", "warning")}
    assert {"DL3007", "DL3013"} <= codes


# --- structure -------------------------------------------------------------------------


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_images_are_multi_stage_non_root_and_pinned(image):
    path = DOCKERFILES[image]
    st = stages(path)
    assert len(st) >= 2
    froms = [args for s in st for op, args in s if op == "FROM"]
    assert froms[0].endswith(" AS builder") and froms[-1].endswith(" AS runtime")
    final = st[-1]
    users = [args for op, args in final if op == "USER"]
    assert users, "the final stage must switch to an unprivileged user"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) >= 10000  # numeric: Kubernetes runAsNonRoot can verify it
    assert any(op == "COPY" and args.startswith("--from=builder") for op, args in final)
    # base images come from ARG defaults; each is pinned to an explicit, non-latest tag
    defaults = arg_defaults(path)
    for ref in froms:
        image_ref = ref.split()[0]
        m = re.fullmatch(r"\$\{(\w+)\}", image_ref)
        resolved = defaults[m.group(1)] if m else image_ref
        repo, _, tag = resolved.rpartition(":")
        assert repo and re.fullmatch(r"[\w.-]*\d[\w.-]*", tag) and tag != "latest", resolved


def test_router_image_has_a_healthcheck_and_runs_the_router():
    final = stages(DOCKERFILES["router"])[-1]
    health = [args for op, args in final if op == "HEALTHCHECK"]
    assert len(health) == 1 and "/healthz" in health[0] and "CMD" in health[0]
    assert ("ENTRYPOINT", '["unicache"]') in final
    assert ("CMD", '["router", "--grpc-port", "50051", "--http-port", "8000"]') in final
    assert ("EXPOSE", "50051 8000") in final


def test_replica_image_is_cuda_based_and_its_ray_matches_the_chart():
    defaults = arg_defaults(DOCKERFILES["replica"])
    assert re.fullmatch(r"nvidia/cuda:12\.\d+\.\d+-runtime-ubuntu\d+\.\d+", defaults["CUDA_IMAGE"])
    assert defaults["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cu" + "".join(
        re.match(r"nvidia/cuda:(\d+)\.(\d+)", defaults["CUDA_IMAGE"]).groups()
    )
    values = yaml.safe_load((REPO / "helm" / "unicache" / "values.yaml").read_text())
    assert defaults["RAY_VERSION"] == values["rayCluster"]["rayVersion"]
    pyproject = pyproject_requirements()
    assert Version(defaults["RAY_VERSION"]) in pyproject["ray"].specifier
    (torch_spec,) = re.findall(r'"(torch[^"]*)"', DOCKERFILES["replica"].read_text())
    assert Requirement(torch_spec).specifier == pyproject["torch"].specifier
    final = stages(DOCKERFILES["replica"])[-1]
    assert ("HEALTHCHECK", "NONE") in final  # explicit: the chart probes each Ray role itself


# --- the router image's dependencies ---------------------------------------------------


def test_router_requirements_are_a_torch_free_subset_of_pyproject():
    router, pyproject = router_requirements(), pyproject_requirements()
    assert "torch" not in router and "ray" not in router
    for name, req in router.items():
        if name in ROUTER_ONLY_REQUIREMENTS:
            continue
        assert name in pyproject, f"{name} is not a pyproject.toml dependency"
        assert req.specifier == pyproject[name].specifier, f"{name}: {req.specifier} != {pyproject[name].specifier}"


def router_import_closure() -> tuple[set[str], set[str]]:
    """(first-party modules, third-party top-level names) reachable from router/."""
    todo = [module_name(p) for p in (REPO / "router").rglob("*.py")]
    todo.append("unicache.cli.main")
    seen, third = set(), set()
    while todo:
        module = todo.pop().removesuffix(".__init__")
        if module in seen:
            continue
        path = module_file(module)
        if path is None:
            continue  # e.g. "unicache.router.x.Name": a name imported from a module, not a module
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # parent packages run too
        for imported in imported_modules(path, skip_optional=True):
            top = imported.split(".")[0]
            if top in FIRST_PARTY:
                todo.append(imported)
            elif top not in sys.stdlib_module_names and top != "__future__":
                third.add(top)
    return seen, third


def test_router_requirements_cover_everything_the_router_imports():
    seen, third = router_import_closure()
    assert {"unicache.router.app", "unicache.router.cli", "unicache.cli.main", "unicache.contract.tokenizer"} <= seen
    dists = packages_distributions()
    provided = set(router_requirements())
    missing = {top: dists.get(top) for top in third if not {canonicalize_name(d) for d in dists.get(top, [])} & provided}
    assert missing == {}
    assert not {"torch", "ray"} & third


ROUTER_IMAGE_PROBE = textwrap.dedent(
    """
    import importlib.abc, re, sys
    from importlib.metadata import packages_distributions

    allowed = set(sys.argv[1].split(","))
    dists = packages_distributions()

    class RouterImage(importlib.abc.MetaPathFinder):
        # Fails imports of third-party packages the router image does not install.
        def find_spec(self, name, path=None, target=None):
            top = name.split(".")[0]
            owners = {re.sub(r"[-_.]+", "-", d).lower() for d in dists.get(top, [])}
            if owners and not owners & allowed and top not in ("router", "unicache", "replica"):
                raise ModuleNotFoundError(f"{name} is not in the router image", name=name)
            return None

    sys.meta_path.insert(0, RouterImage())
    import unicache.router.app, unicache.router.cli, unicache.cli.main
    parser = unicache.cli.main.build_parser()
    try:
        parser.parse_args(["router", "--help"])
    except SystemExit as exc:
        assert exc.code == 0, exc.code
    assert "torch" not in sys.modules and "ray" not in sys.modules
    print("ok")
    """
)


def test_router_entry_point_runs_with_only_the_router_image_packages():
    """`unicache router` must start where torch, ray, numpy... are not installed. The
    subprocess blocks every third-party distribution not in requirements-router.txt."""
    allowed = set(router_requirements()) | {
        # packages those requirements pull in themselves
        "typing-extensions", "click", "h11", "anyio", "idna", "sniffio", "huggingface-hub", "async-timeout", "markupsafe",
    }
    proc = subprocess.run(
        [sys.executable, "-c", ROUTER_IMAGE_PROBE, ",".join(sorted(allowed))],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


BENCH_IN_ROUTER_IMAGE = ROUTER_IMAGE_PROBE.replace(
    'parser.parse_args(["router", "--help"])', 'parser.parse_args(["bench", "--help"])'
).replace(
    "import unicache.router.app, unicache.router.cli, unicache.cli.main",
    "import unicache.router.app, unicache.router.cli, unicache.cli.main, unicache.bench_client.client, httpx, tqdm",
)


def test_unicache_bench_runs_with_only_the_router_image_packages():
    """`unicache bench` ships in the router image (`kubectl exec` into a router pod to
    measure the fleet from inside): its HTTP client must be installed there."""
    assert BENCH_IN_ROUTER_IMAGE != ROUTER_IMAGE_PROBE
    allowed = set(router_requirements()) | {
        "typing-extensions", "click", "h11", "anyio", "idna", "sniffio", "huggingface-hub", "async-timeout", "markupsafe",
        "httpcore", "certifi",  # httpx's own
    }
    proc = subprocess.run(
        [sys.executable, "-c", BENCH_IN_ROUTER_IMAGE, ",".join(sorted(allowed))],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"httpx", "tqdm"} <= set(router_requirements())


# --- build context -------------------------------------------------------------------


def _dockerignore_patterns() -> list[tuple[bool, re.Pattern]]:
    out = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pat = line.lstrip("!").strip("/")
        rx = re.escape(pat).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        out.append((negate, re.compile(rx)))
    return out


def excluded(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a parent
    directory matches everything beneath it."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    state = False
    for negate, rx in _dockerignore_patterns():
        if any(rx.fullmatch(p) for p in prefixes):
            state = not negate
    return state


def test_dockerignore_sends_what_the_images_copy_and_nothing_heavy():
    sources = set()
    for path in DOCKERFILES.values():
        for op, args in instructions(path):
            if op == "COPY" and not args.startswith("--from"):
                sources |= set(args.split()[:-1])
    assert sources == {"constraints.txt", "docker/requirements-router.txt", "pyproject.toml", "README.md", "unicache", "router", "replica"}
    for src in sorted(sources):
        target = REPO / src
        assert target.exists(), src
        files = [target] if target.is_file() else [p for p in target.rglob("*.py") if "__pycache__" not in p.parts]
        assert files, src
        for f in files:
            assert not excluded(str(f.relative_to(REPO))), f
    for heavy in [".venv/bin/python", ".git/HEAD", "tests/conftest.py", "helm/unicache/values.yaml",
                  "router/__pycache__/app.cpython-311.pyc", "docker/router.Dockerfile"]:
        assert excluded(heavy), heavy
