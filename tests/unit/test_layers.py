"""The architecture's import rules, checked on the source with `ast`.

Layers import only downward: errors/config <- backends <- core <- fuse adapter <-
mount/cli <- testing. The core never imports pyfuse3 or a cloud SDK; only backends
(and testing, which seeds servers) import SDKs. scripts/ never imports tests/.
"""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
PKG = REPO / "bucketfs"
SDKS = ("boto3", "botocore", "google", "pyfuse3")
RANK = {"errors": 0, "config": 0, "allocator": 0, "backends": 1, "core": 2, "fuse_ops": 3, "fuse_dircache": 3, "fuse_noopendir": 3, "metrics": 3, "mountpoints": 4, "mount": 4, "cli": 5, "daemon": 5, "fstab": 5, "__main__": 5, "__init__": 0, "testing": 6}


def imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def layer(module_path: pathlib.Path) -> str:
    rel = module_path.relative_to(PKG).parts
    return rel[0] if len(rel) > 1 else rel[0][:-3]


def test_every_module_has_a_known_layer():
    for path in PKG.rglob("*.py"):
        assert layer(path) in RANK, f"{path}: add its layer to RANK"


def test_layers_import_downward_only():
    for path in PKG.rglob("*.py"):
        own = RANK[layer(path)]
        for name in imports(path):
            if name.startswith("bucketfs."):
                target = name.split(".")[1]
                assert RANK[target] <= own, f"{path.relative_to(PKG)} imports {name} (a higher layer)"


def test_only_backends_import_cloud_sdks_and_only_the_adapter_and_mount_import_pyfuse3():
    for path in PKG.rglob("*.py"):
        where = layer(path)
        for name in imports(path):
            root = name.split(".")[0]
            if root in ("boto3", "botocore", "google"):
                assert where in ("backends", "testing"), f"{path.relative_to(PKG)} imports {name}"
            if root == "pyfuse3":
                assert where in ("fuse_ops", "fuse_dircache", "fuse_noopendir", "mount"), f"{path.relative_to(PKG)} imports {name}"


def test_core_imports_no_sdk_and_no_fuse():
    for path in (PKG / "core").rglob("*.py"):
        for name in imports(path):
            assert name.split(".")[0] not in SDKS, f"{path.name} imports {name}"


def test_scripts_import_no_tests():
    """scripts/ uses the shared servers, proxies and mount harness from bucketfs.testing,
    never from tests/ (which holds the tests and their pytest fixtures)."""
    scripts = REPO / "scripts"
    paths = list(scripts.rglob("*.py"))
    assert paths
    for path in paths:
        for name in imports(path):
            assert name.split(".")[0] != "tests", f"{path.relative_to(REPO)} imports {name}"
