"""constraints.txt: the one set of versions pip install, CI and both images use."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version

import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from tests.support.source_tree import REPO


def pins() -> dict[str, Requirement]:
    out = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            out[req.name.lower()] = req
    return out


def core_dependencies() -> dict[str, Requirement]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {Requirement(d).name.lower(): Requirement(d) for d in deps}


def exact(req: Requirement) -> str | None:
    specs = list(req.specifier)
    return specs[0].version if len(specs) == 1 and specs[0].operator == "==" else None


def test_every_core_dependency_is_constrained_inside_its_range():
    p, core = pins(), core_dependencies()
    assert sorted(p) == sorted(core)
    for name, req in core.items():
        pinned = exact(p[name])
        if name == "torch":
            assert str(p[name].specifier) == str(req.specifier)  # a range: CPU and CUDA builds
            continue
        assert pinned is not None, name
        assert Version(pinned) in req.specifier, (name, pinned, str(req.specifier))


def test_the_installed_versions_are_the_pinned_ones():
    for name, req in pins().items():
        installed = Version(version(name))
        if exact(req):
            assert installed == Version(exact(req)), name
        else:
            assert installed in req.specifier, name


def test_the_images_and_the_chart_use_the_same_ray():
    ray = exact(pins()["ray"])
    replica = (REPO / "docker" / "replica.Dockerfile").read_text()
    assert re.search(r"^ARG RAY_VERSION=(\S+)$", replica, re.M).group(1) == ray
    assert replica.count("-c constraints.txt") == 2 and "COPY constraints.txt" in replica
    router = (REPO / "docker" / "router.Dockerfile").read_text()
    assert "-c constraints.txt -r requirements-router.txt" in router
    values = yaml.safe_load((REPO / "helm" / "unicache" / "values.yaml").read_text())
    assert values["rayCluster"]["rayVersion"] == ray
