"""The architecture's import rules, checked on the source with `ast`.

Layers import only downward, by top-level package (subpackages such as
backends/http belong to their package's layer):
errors/config/allocator <- backends <- diskcache <- core <- fuse/metrics <- app <- testing.
The core and the disk cache never import pyfuse3 or a cloud SDK; only backends (and
testing, which seeds servers) import SDKs; only fuse/ and app/mount.py import pyfuse3.
backends/http imports no SDK and nothing else of backends. scripts/ never imports tests/.
The FUSE adapter (fuse/) reaches the core only through `Filesystem`'s methods and
properties, never its components (`fs.ns`, `fs.cache`, ...).
"""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
PKG = REPO / "bucketfs"
SDKS = ("boto3", "botocore", "google", "pyfuse3")
RANK = {
    "__init__": 0,
    "errors": 0,
    "config": 0,
    "allocator": 0,
    "backends": 1,
    "diskcache": 2,  # a backend wrapper: below the core, which builds it
    "core": 3,
    "fuse": 4,
    "metrics": 4,
    "app": 5,
    "__main__": 5,
    "testing": 6,
}
PACKAGES = {"app", "fuse", "core", "diskcache", "backends", "backends/http", "testing"}


def imports(path: pathlib.Path):
    """Every absolute import's dotted name; `from bucketfs import x` gives bucketfs.x."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "bucketfs":
                for alias in node.names:
                    yield f"bucketfs.{alias.name}"
            else:
                yield node.module


def layer(module_path: pathlib.Path) -> str:
    """The layer of a module: the first path component under bucketfs/."""
    rel = module_path.relative_to(PKG).parts
    return rel[0] if len(rel) > 1 else rel[0][:-3]


def target_layer(name: str) -> str:
    """The layer an import of `bucketfs.<first>...` reaches (a name that is no module
    or package, such as __version__, is bucketfs/__init__.py's)."""
    first = name.split(".")[1]
    if (PKG / first).is_dir() or (PKG / f"{first}.py").exists():
        return first
    return "__init__"


def test_the_walk_covers_every_package():
    walked = {path.parent.relative_to(PKG).as_posix() for path in PKG.rglob("*.py")}
    assert PACKAGES <= walked
    assert layer(PKG / "backends" / "http" / "curl.py") == "backends"
    packages = {path.parent.relative_to(PKG).as_posix() for path in PKG.rglob("__init__.py")} - {"."}
    assert packages == PACKAGES, "a new package: add it to PACKAGES (and its layer to RANK)"


def test_every_module_has_a_known_layer():
    for path in PKG.rglob("*.py"):
        assert layer(path) in RANK, f"{path}: add its layer to RANK"


def test_layers_import_downward_only():
    for path in PKG.rglob("*.py"):
        own = RANK[layer(path)]
        for name in imports(path):
            if name.startswith("bucketfs."):
                assert RANK[target_layer(name)] <= own, f"{path.relative_to(PKG)} imports {name} (a higher layer)"


def test_only_backends_import_cloud_sdks_and_only_the_adapter_and_mount_import_pyfuse3():
    for path in PKG.rglob("*.py"):
        where = layer(path)
        rel = path.relative_to(PKG).as_posix()
        for name in imports(path):
            root = name.split(".")[0]
            if root in ("boto3", "botocore", "google"):
                assert where in ("backends", "testing"), f"{rel} imports {name}"
            if root == "pyfuse3":
                assert where == "fuse" or rel == "app/mount.py", f"{rel} imports {name}"


def test_http_plumbing_imports_no_sdk_and_no_other_backend_module():
    """backends/http moves and signs bytes: the contract, the retries and the stores'
    SDKs are above it."""
    for path in (PKG / "backends" / "http").rglob("*.py"):
        for name in imports(path):
            assert name.split(".")[0] not in SDKS, f"backends/http/{path.name} imports {name}"
            if name.startswith("bucketfs.backends"):
                assert name.startswith("bucketfs.backends.http"), f"backends/http/{path.name} imports {name}"


def test_core_and_disk_cache_import_no_sdk_and_no_fuse():
    for package in ("core", "diskcache"):
        for path in (PKG / package).rglob("*.py"):
            for name in imports(path):
                assert name.split(".")[0] not in SDKS, f"{package}/{path.name} imports {name}"


def test_scripts_import_no_tests():
    """scripts/ uses the shared servers, proxies and mount harness from bucketfs.testing,
    never from tests/ (which holds the tests and their pytest fixtures)."""
    scripts = REPO / "scripts"
    paths = list(scripts.rglob("*.py"))
    assert paths
    for path in paths:
        for name in imports(path):
            assert name.split(".")[0] != "tests", f"{path.relative_to(REPO)} imports {name}"


# The FUSE adapter reaches the core only through `Filesystem`'s methods and properties
# (lookup, open, read, note_lookup, forget, watch_vanished, count, ...), never the
# components behind it, and imports from the core only these names.
CORE_PARTS = {"ns", "cache", "prefetcher", "budget", "shards", "backend", "disk_cache"}
CORE_NAMES_FOR_FUSE = {"bucketfs.core.filesystem": {"Filesystem", "DOT_NAMES", "ROOT_INO", "Pieces"}}


def adapter_problems(source: str):
    """(problems, fs_accesses_count) of one fuse/ module: a reach past `Filesystem`
    (`fs.ns`, `self.fs.cache`, a private attribute, `fs.stats` other than handed as
    an argument to the objects that count into it) or an import from the core other
    than CORE_NAMES_FOR_FUSE."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    problems, accesses = [], 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            problems += [f"import {a.name}" for a in node.names if a.name.startswith("bucketfs.core")]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = {a.name for a in node.names}
            if node.level == 0 and module == "bucketfs" and "core" in names:
                problems.append("from bucketfs import core")
            elif node.level == 0 and module.startswith("bucketfs.core"):
                if not names <= CORE_NAMES_FOR_FUSE.get(module, set()):
                    problems.append(f"from {module} import {', '.join(sorted(names))}")
            elif node.level > 1 and (module == "core" or module.startswith("core.")):
                problems.append(f"from {'.' * node.level}{module} import ...")
        elif isinstance(node, ast.Attribute):
            value = node.value
            if not (
                (isinstance(value, ast.Name) and value.id == "fs")
                or (isinstance(value, ast.Attribute) and value.attr == "fs")
            ):
                continue
            accesses += 1
            if node.attr in CORE_PARTS or node.attr.startswith("_"):
                problems.append(f"line {node.lineno}: fs.{node.attr}")
            elif node.attr == "stats":
                parent = parents.get(node)
                if not (isinstance(parent, ast.Call) and node in parent.args):
                    problems.append(f"line {node.lineno}: fs.stats used other than as an argument (use fs.count)")
    return problems, accesses


def test_the_fuse_adapter_reaches_the_core_only_through_the_filesystem():
    accesses_total = 0
    for path in (PKG / "fuse").rglob("*.py"):
        problems, accesses = adapter_problems(path.read_text())
        assert not problems, f"fuse/{path.name}: {problems}"
        accesses_total += accesses
    assert accesses_total > 10, "the adapter holds the filesystem as `fs` or `self.fs`: the check must see it"


def test_the_adapter_check_catches_a_reach_past_the_filesystem():
    bad = (
        "from bucketfs.core.namespace import Namespace\n"
        "from bucketfs.core.filesystem import Filesystem, FileHandle\n"
        "def f(self, fs):\n"
        "    self.fs.ns.forget(1, 1)\n"
        "    fs.cache.evict(1)\n"
        "    self.fs._handles.clear()\n"
        "    self.fs.stats['x'] += 1\n"
        "    fs.count('x')\n"
        "    Counter(fs.stats)\n"
    )
    problems, accesses = adapter_problems(bad)
    assert len(problems) == 6, problems
    assert accesses == 6
