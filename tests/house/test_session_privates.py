"""Who may touch what, held by reading every module with `ast`:

* no module but `concordia/session.py` reads or writes an attribute of a
  Session whose name starts with `_` (the rooms take the `RegionSet` and the
  session's public attributes; a private field reached from outside is a
  second owner of state nobody sees);
* no module but `concordia/regions/registry.py` assigns a region's baseline
  (`.crcs`, `.digest`): the `RegionSet` is its one owner.

What counts as "a Session": an expression whose last name says so (`session`,
`sess`, `s`, `self.session`, `g.session`, ...), or any expression but
`self`/`cls` reaching an attribute that `Session` itself defines privately.
"""

from __future__ import annotations

import ast
import pathlib
import re

from tests.house.test_imports import REPO, modules

SESSION = REPO / "concordia" / "session.py"
REGISTRY = REPO / "concordia" / "regions" / "registry.py"
SESSIONISH = re.compile(r"^(s|sess|session|.*_session|session_.*)$", re.IGNORECASE)


def _last_name(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def session_privates() -> set[str]:
    """The private attributes and methods class Session defines."""
    tree = ast.parse(SESSION.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Session")
    names = {f.name for f in cls.body if isinstance(f, ast.FunctionDef) and f.name.startswith("_")
             and not f.name.startswith("__")}
    for node in ast.walk(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            names.add(node.attr)
    return names


def reaches(path: pathlib.Path, privates: set[str], root: pathlib.Path = REPO) -> list[str]:
    """`file:line: expr._name` for every access of a Session's private attribute in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        base = _last_name(node.value)
        if base in ("self", "cls"):
            continue
        if (base is not None and SESSIONISH.match(base)) or node.attr in privates:
            out.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return sorted(out, key=lambda s: int(s.split(":")[1]))


def baseline_writes(path: pathlib.Path, root: pathlib.Path = REPO) -> list[str]:
    """`file:line: target` for every assignment to a `.crcs` or `.digest` attribute in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for sub in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                # the table itself replaced (a pass filling the table it was given,
                # `r.crcs[ids] = ...`, writes into the baseline the RegionSet handed out)
                if isinstance(sub, ast.Attribute) and sub.attr in ("crcs", "digest"):
                    out.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(sub)}")
    return sorted(out, key=lambda s: int(s.split(":")[1]))


def test_no_module_but_the_session_touches_its_private_attributes():
    privates = session_privates()
    assert {"_writer", "_owns_log", "_closed"} <= privates  # the walk sees the class
    found = []
    for name, (path, _) in sorted(modules().items()):
        if path != SESSION:
            found += reaches(path, privates)
    assert not found, "a Session's private attributes reached from outside:\n" + "\n".join(found)


def test_only_the_region_set_changes_a_baseline():
    found = []
    for name, (path, _) in sorted(modules().items()):
        if name.startswith(("concordia.wal", "concordia.devmem", "concordia.gpu_kernels", "concordia.tools")):
            continue  # the log's own records carry digests of their own; these are the runtime's regions
        if path != REGISTRY:
            found += baseline_writes(path)
    assert not found, "a region's baseline assigned outside the RegionSet:\n" + "\n".join(found)


# the checkers themselves, on made-up code


def test_the_checker_finds_a_reach_and_a_write(tmp_path):
    src = tmp_path / "concordia" / "mod.py"
    src.parent.mkdir()
    src.write_text("def f(session, g, s, other, r):\n"
                   "    session._regions.clear()\n"
                   "    g.session._next_epoch = 3\n"
                   "    s._writer('x')\n"
                   "    other._owns_log\n"
                   "    self_like = other._private_of_its_own\n"
                   "    r.crcs = None\n"
                   "    r.digest += 1\n")
    found = [line.split(": ", 1)[1] for line in reaches(src, {"_owns_log", "_writer"}, tmp_path)]
    assert found == ["session._regions", "g.session._next_epoch", "s._writer", "other._owns_log"]
    writes = [line.split(": ", 1)[1] for line in baseline_writes(src, tmp_path)]
    assert writes == ["r.crcs", "r.digest"]


def test_the_session_is_a_facade():
    """session.py stays a facade over the rooms: at most 500 lines."""
    lines = SESSION.read_text().count("\n")
    assert lines <= 500, f"concordia/session.py has {lines} lines"
