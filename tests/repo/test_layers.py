"""The package's shape: one import root, and layers that the imports respect.

A module's layer is the folder it lives in (``unicache/__init__.py`` states the rules):
  plumbing  ``unicache.plumbing``: imports only plumbing.
  contract  ``unicache.contract`` and the stubs ``unicache.v1``: contract and plumbing.
  replica   ``unicache.replica`` (folder ``replica/``): contract, plumbing and itself.
  router    ``unicache.router`` (folder ``router/``): contract, plumbing and itself.
  top       ``unicache.cli``, ``unicache.bench_client``, ``unicache.sim``, ``unicache.testing``:
            may import anything; nothing below imports it.
Every folder directly under ``unicache/`` must have a layer here, and no module lives
loose beside them, so a new folder or file cannot slip past the check.
"""

from __future__ import annotations

import pytest

from tests.support.source_tree import (
    REPO,
    declared_packages,
    first_party_files,
    imported_modules,
    module_file,
    module_name,
    package_dirs,
)

FOLDER_LAYERS = {
    "plumbing": "plumbing",
    "contract": "contract",
    "v1": "contract",
    "router": "router",
    "replica": "replica",
    "cli": "top",
    "bench_client": "top",
    "sim": "top",
    "testing": "top",
}
ALLOWED = {
    "plumbing": {"plumbing"},
    "contract": {"plumbing", "contract"},
    "replica": {"plumbing", "contract", "replica"},
    "router": {"plumbing", "contract", "router"},
    "top": {"plumbing", "contract", "replica", "router", "top"},
}


def layer(module: str) -> str:
    """The layer of ``unicache.FOLDER[.…]``: FOLDER's entry in ``FOLDER_LAYERS``."""
    parts = module.split(".")
    if parts[0] != "unicache" or len(parts) < 2 or parts[1] not in FOLDER_LAYERS:
        raise ValueError(f"{module} is not inside a layer folder")
    return FOLDER_LAYERS[parts[1]]


def test_every_folder_under_the_root_has_a_layer_and_no_module_is_loose():
    root = package_dirs()["unicache"]
    folders = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    assert folders | {"router", "replica"} == set(FOLDER_LAYERS)
    assert sorted(p.name for p in root.glob("*.py")) == ["__init__.py"]


def layer_violations() -> list[str]:
    bad = []
    for path in first_party_files():
        importer = module_name(path)
        if importer == "unicache":
            continue  # the root package's docstring only
        for imported in sorted(imported_modules(path)):
            if imported.split(".")[0] != "unicache" or module_file(imported) is None:
                continue  # third-party, or "module.name" of a name that is not a module
            if layer(imported) not in ALLOWED[layer(importer)]:
                bad.append(f"{importer} ({layer(importer)}) imports {imported} ({layer(imported)})")
    return bad


def test_no_product_module_imports_the_benchmarks():
    """bench/ is not installed: a product module importing it would break every install."""
    importers = sorted(module_name(path) for path in first_party_files()
                       if any(m == "bench" or m.startswith("bench.") for m in imported_modules(path)))
    assert importers == []


def test_every_package_installs_under_one_root():
    assert all(p == "unicache" or p.startswith("unicache.") for p in declared_packages())
    assert package_dirs()["unicache.router"] == REPO / "router"
    assert package_dirs()["unicache.replica"] == REPO / "replica"


def test_declared_packages_equal_the_folders_on_disk():
    on_disk = {module_name(init) for init in first_party_files() if init.name == "__init__.py"}
    assert sorted(declared_packages()) == sorted(on_disk)


def test_imports_respect_the_layers():
    assert layer_violations() == []


@pytest.mark.parametrize(
    "module, expected",
    [
        ("unicache.contract.block_hash", "contract"),
        ("unicache.contract.tokenizer", "contract"),
        ("unicache.v1.replica_pb2", "contract"),
        ("unicache.plumbing.tls", "plumbing"),
        ("unicache.router.routing.cache_aware.policy", "router"),
        ("unicache.bench_client.client", "top"),
        ("unicache.router.request_path.core", "router"),
        ("unicache.replica.kv.store", "replica"),
        ("unicache.sim.replay", "top"),
        ("unicache.cli.local_cluster", "top"),
        ("unicache.cli.main", "top"),
    ],
)
def test_layer_of(module, expected):
    assert module_file(module) is not None
    assert layer(module) == expected


def test_a_module_outside_the_layer_folders_has_no_layer():
    with pytest.raises(ValueError, match="not inside a layer folder"):
        layer("unicache.loose_module")


@pytest.mark.parametrize(
    "folder, source, expected",
    [
        ("contract", "from unicache.router.request_path.core import RouterCore\n",
         "unicache.contract.leaky (contract) imports unicache.router.request_path.core (router)"),
        ("plumbing", "import unicache.contract.block_hash\n",
         "unicache.plumbing.leaky (plumbing) imports unicache.contract.block_hash (contract)"),
        ("contract", "import unicache.cli.main\n",
         "unicache.contract.leaky (contract) imports unicache.cli.main (top)"),
    ],
)
def test_the_check_sees_a_violation(tmp_path, monkeypatch, folder, source, expected):
    """The check is not vacuous: a lower layer importing a higher one is reported."""
    import tests.support.source_tree as source_tree

    fake = tmp_path / "unicache"
    (fake / folder).mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / folder / "__init__.py").write_text("")
    (fake / folder / "leaky.py").write_text(source)
    real_dirs = source_tree.package_dirs()
    real_root = real_dirs["unicache"]
    dirs = {**real_dirs, "unicache": fake, **{f"unicache.{n}": real_root / n for n in ("contract", "plumbing", "cli")}}
    monkeypatch.setattr(source_tree, "package_dirs", lambda: dirs)
    monkeypatch.setattr(source_tree, "first_party_files", lambda: [fake / folder / "leaky.py"])
    import tests.repo.test_layers as me

    monkeypatch.setattr(me, "first_party_files", source_tree.first_party_files)
    assert me.layer_violations() == [expected]
