"""helm/unicache/README.md is generated from values.yaml's `# --` comments and kept current."""

from __future__ import annotations

import yaml

from tests.deploy.test_helm_chart import load_tool
from tests.support.source_tree import REPO

CHART = REPO / "helm" / "unicache"


GEN = load_tool("gen_readme")


def test_committed_readme_is_what_the_generator_writes():
    assert (CHART / "README.md").read_text() == GEN.render(), "run: python helm/tools/gen_readme.py"
    assert GEN.main(["--check"]) == 0


def leaf_keys(node, prefix=""):
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from leaf_keys(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1]


def test_every_value_is_in_the_readme_with_its_default():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    documented = dict(GEN.documented_keys((CHART / "values.yaml").read_text()))
    readme = (CHART / "README.md").read_text()
    for key in leaf_keys(values):
        owner = next(k for k in (key, *(key.rsplit(".", n)[0] for n in range(1, key.count(".") + 1))) if k in documented)
        assert f"| `{owner}` |" in readme, key
    assert "| `model.source` | `\"none\"` |" in readme
    assert "| `router.image.pullPolicy` | `\"IfNotPresent\"` |" in readme


def test_documented_keys_reads_nested_comments():
    text = "a:\n  # -- first\n  b: 1\n  c:\n    # -- second\n    # continued\n    d: x\n# -- top\ne: []\n"
    assert GEN.documented_keys(text) == [("a.b", "first"), ("a.c.d", "second continued"), ("e", "top")]
