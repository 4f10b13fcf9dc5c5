"""The house rules on imports (docs/ARCHITECTURE.md), held by reading every
module of the package with `ast`, imports inside functions included:

    tools -> concordia (the public face) -> demo -> integrations -> group, standby, mirror
      -> session, policy -> checkpoint -> restore, retention -> executor -> regions
      -> instrument -> gpu_kernels -> wal -> devmem -> root (root_error, lazy, sizes)

A module may import its own layer or any layer to its right, never one to its
left; no module imports `concordia.errors` (the public face of the errors:
each imports an error from the module that defines it); `wal` never imports
CuPy; `devmem` imports nothing of the project but the root layer; the root
layer imports nothing of the project; only the command line imports click; and
no two modules import each other, however indirectly (a circle hidden by an
import inside a function is still a circle).
"""

from __future__ import annotations

import ast
import collections
import functools
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

# folder -> import name (pyproject.toml's package-dir)
FOLDERS = {"concordia": "concordia", "wal": "concordia.wal", "devmem": "concordia.devmem",
           "gpu_kernels": "concordia.gpu_kernels", "tools": "concordia.tools"}
# each may import those before it; the runtime (the concordia/ folder) in rooms
LAYERS = ("root", "devmem", "wal", "gpu_kernels", "instrument", "regions", "executor", "restore", "checkpoint",
          "session", "group", "integrations", "demo", "face", "tools")
RUNTIME = LAYERS[LAYERS.index("instrument"):LAYERS.index("face") + 1]
#: modules of the runtime folder that are not a package of their own, by layer
ROOMS = {"concordia.root_error": "root", "concordia.lazy": "root", "concordia.sizes": "root",
         "concordia.retention": "restore", "concordia.session": "session", "concordia.session_log": "session",
         "concordia.session_register": "session",
         "concordia.policy": "session", "concordia.prefetching": "session",
         "concordia.group": "group", "concordia.standby": "group", "concordia.mirror": "group", "concordia": "face", "concordia.errors": "face"}
GPU = ("cupy", "cupyx", "cuda")                                   # wal never imports these
CLI = ("click",)                                                  # only tools imports these


def layer_of(module: str) -> str:
    if module in ROOMS:
        return ROOMS[module]
    for name in ("tools", "devmem", "wal", "gpu_kernels", "instrument", "regions", "executor", "restore",
                 "checkpoint", "integrations", "demo"):
        if module == f"concordia.{name}" or module.startswith(f"concordia.{name}."):
            return name
    raise AssertionError(f"{module}: no layer (add it to ROOMS or a package of its own)")


def modules(repo: pathlib.Path = REPO) -> dict[str, tuple[pathlib.Path, bool]]:
    """Every module of the package: name -> (file, is a package)."""
    out = {}
    for folder, name in FOLDERS.items():
        for path in sorted((repo / folder).rglob("*.py")):
            parts = list(path.relative_to(repo / folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            out[".".join([name, *parts])] = (path, is_pkg)
    return out


Import = collections.namedtuple("Import", "source target line")


@functools.lru_cache(maxsize=None)
def _real():
    mods = modules()
    return mods, _imports(mods)


def imports(mods=None) -> list[Import]:
    """Every import statement of every module, at any depth (functions, methods,
    try blocks), resolved to the module it loads: `from a import b` is `a.b`
    when that is a module, else `a`."""
    return _real()[1] if mods is None else _imports(mods)


def _imports(mods) -> list[Import]:
    out = []
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out += [Import(name, a.name, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    out.append(Import(name, sub if sub in mods else base, node.lineno))
    return out


def _where(imp: Import, mods) -> str:
    path = mods[imp.source][0]
    return f"{path.parent.name}/{path.name}:{imp.line}: {imp.source} imports {imp.target}"


def _top(target: str) -> str:
    return target.split(".")[0]


def forbidden(mods=None) -> list[str]:
    """Imports against the direction or the rules above, one line each."""
    mods, found = _real() if mods is None else (mods, _imports(mods))
    bad = []
    for imp in found:
        src = layer_of(imp.source)
        if imp.target == "concordia" or imp.target.startswith("concordia."):
            dst = layer_of(imp.target)
            if imp.target == "concordia.errors":
                bad.append(_where(imp, mods) + " (the public face is for users: import the error from its module)")
            elif src == "devmem" and dst not in ("devmem", "root"):
                bad.append(_where(imp, mods) + " (devmem imports nothing of the project)")
            elif src == "root":
                bad.append(_where(imp, mods) + " (the root layer imports nothing of the project)")
            elif LAYERS.index(dst) > LAYERS.index(src):
                bad.append(_where(imp, mods) + f" ({src} may not import {dst})")
        elif src == "wal" and _top(imp.target) in GPU:
            bad.append(_where(imp, mods) + " (wal never imports CuPy)")
        elif src != "tools" and _top(imp.target) in CLI:
            bad.append(_where(imp, mods) + " (only the command line imports click)")
    return bad


def circles(mods=None) -> list[list[str]]:
    """Strongly connected groups of more than one module in the import graph
    (Tarjan), each sorted; an import of a package's own `__init__` by one of its
    modules counts like any other."""
    mods, found = _real() if mods is None else (mods, _imports(mods))
    graph = collections.defaultdict(set)
    for imp in found:
        if imp.target in mods and imp.target != imp.source:
            graph[imp.source].add(imp.target)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(mods):
        if v not in index:
            visit(v)
    return sorted(out)


# ------------------------------------------------------------------ the checks


def test_the_walk_sees_the_whole_package_and_imports_inside_functions():
    mods = _real()[0]
    assert {"concordia", "concordia.wal.format", "concordia.devmem.backend", "concordia.gpu_kernels.jit",
            "concordia.tools.wal_cli", "concordia.tools.bench"} <= set(mods)
    found = imports()
    # an import inside a function: gpu_kernels.jit imports CuPy only when asked
    assert any(i.source == "concordia.gpu_kernels.jit" and i.target == "cupy" for i in found)
    assert layer_of("concordia.executor.persistent") == "executor" and layer_of("concordia.tools.bench.recover") == "tools"
    assert layer_of("concordia.checkpoint.epoch") == "checkpoint" and layer_of("concordia.regions.registry") == "regions"


def test_imports_run_one_way():
    bad = forbidden()
    assert not bad, "imports against the house direction:\n" + "\n".join(bad)


def test_no_circles_between_modules():
    found = circles()
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(g) for g in found)


# the checker itself, on small made-up packages


def _fake(tmp_path, files: dict[str, str]):
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for folder in FOLDERS:
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / "__init__.py").touch()
    return modules(tmp_path)


def test_checker_finds_a_wrong_direction_hidden_in_a_function(tmp_path):
    mods = _fake(tmp_path, {
        "wal/log.py": "def f():\n    from concordia.session import Session\n    import cupy\n",
        "devmem/tier.py": "from concordia.wal import format\nfrom concordia.root_error import ConcordiaError\n",
        "concordia/policy.py": "def parse():\n    import click\n    from concordia.tools.common import x\n",
        "concordia/session.py": "from concordia.errors import SessionError\n",
        "concordia/regions/region.py": "def f():\n    from concordia.checkpoint.detect import reset\n",
        "concordia/checkpoint/epoch.py": "from concordia.session import Session\n",
        "tools/common.py": "import click\n",
    })
    bad = "\n".join(forbidden(mods))
    assert "wal/log.py:2: concordia.wal.log imports concordia.session (wal may not import session)" in bad
    assert "wal/log.py:3: concordia.wal.log imports cupy (wal never imports CuPy)" in bad
    assert "devmem/tier.py:1: concordia.devmem.tier imports concordia.wal (devmem imports nothing" in bad
    assert "concordia/policy.py:2: concordia.policy imports click (only the command line" in bad
    assert "concordia.policy imports concordia.tools.common (session may not import tools)" in bad
    assert "concordia.session imports concordia.errors (the public face is for users" in bad
    assert "concordia.regions.region imports concordia.checkpoint.detect (regions may not import checkpoint)" in bad
    assert "concordia.checkpoint.epoch imports concordia.session (checkpoint may not import session)" in bad
    assert "tools/common.py" not in bad and "root_error" not in bad


def test_checker_finds_a_circle_closed_inside_a_function(tmp_path):
    mods = _fake(tmp_path, {
        "devmem/backend.py": "def open_backend():\n    from .tiers import FileBackend\n",
        "devmem/tiers.py": "from .backend import Backend\n",
        "wal/planner.py": "from . import snapshot\n",
        "wal/snapshot.py": "def f():\n    from .planner import plan\n",
        "wal/format.py": "",
        "wal/reader.py": "from .format import X\n",
    })
    assert circles(mods) == [["concordia.devmem.backend", "concordia.devmem.tiers"],
                             ["concordia.wal.planner", "concordia.wal.snapshot"]]


@pytest.mark.parametrize("layer", LAYERS)
def test_every_layer_is_present(layer):
    assert any(layer_of(m) == layer for m in modules())


# ------------------------------------------------------------------ benchmarks

# Private names a benchmark may reach, each because its figure is labelled a
# component (tools/bench/recover.py MEASURED_THROUGH "host_read_*": the
# restore's reader threads alone).
COMPONENT_REACH = {("recover.py", "_source_of"), ("recover.py", "_wait"), ("recover.py", "_fill")}


def test_benchmarks_measure_through_public_entry_points():
    reach = set()
    for path in sorted((REPO / "tools" / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id not in ("self", "cls") \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                reach.add((path.name, node.attr))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("concordia"):
                reach |= {(path.name, a.name) for a in node.names if a.name.startswith("_")}
    assert reach == COMPONENT_REACH
    from concordia.tools.bench import recover

    assert "component" in recover.MEASURED_THROUGH["host_read_*"]


def test_every_package_is_installed():
    """An installed (not editable) copy, as the GPU machine uses, holds only the
    packages pyproject.toml lists: each package of the tree must be there."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, (_, is_pkg) in _real()[0].items() if is_pkg}
    assert packages == listed
