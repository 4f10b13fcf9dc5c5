"""docs/internals.md's layout table is the tree: every package of
pyproject.toml has its row, every module of a package is named in that row (`x.py`, or `x` in a list of kernels or benchmarks),
and every file a row names is there."""

from __future__ import annotations

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = {".py", ".cu", ".cuh", ".c"}


def _rows() -> dict[str, str]:
    text = (ROOT / "docs" / "internals.md").read_text(encoding="utf-8")
    table = text.split("## Layout and imports", 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"\| `([^`]+)/` \| `([\w.]+)` \| (.*) \|$", line)
        if m:
            rows[m.group(2)] = (m.group(1), m.group(3))
    return rows


def _package_dirs() -> dict[str, pathlib.Path]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = cfg["package-dir"]
    out = {}
    for pkg in cfg["packages"]:
        head = max((k for k in mapped if pkg == k or pkg.startswith(k + ".")), key=len)
        out[pkg] = ROOT / mapped[head] / pkg[len(head):].lstrip(".").replace(".", "/")
    return out


def test_every_package_has_a_row_in_its_folder():
    rows = _rows()
    for pkg, folder in _package_dirs().items():
        assert pkg in rows, f"docs/internals.md: no row for the package {pkg}"
        assert ROOT / rows[pkg][0] == folder, (pkg, rows[pkg][0])
    assert set(rows) == set(_package_dirs()), set(rows) - set(_package_dirs())


def test_every_module_is_named_and_every_name_is_a_file():
    rows = _rows()
    for pkg, folder in _package_dirs().items():
        owns = rows[pkg][1]
        files = {p.name for p in folder.iterdir() if p.suffix in SOURCES and p.name != "__init__.py"}
        for name in files:
            stem = name.rsplit(".", 1)[0]
            assert f"`{name}`" in owns or f"`{stem}`" in owns, \
                f"docs/internals.md: {folder.relative_to(ROOT)}/{name} is not in the {pkg} row"
        for named in re.findall(r"`([\w.]+\.(?:py|cu|cuh|c))`", owns):
            assert named in files, f"docs/internals.md: the {pkg} row names {named}, which is not there"
