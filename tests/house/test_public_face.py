"""What a user imports: `concordia` lists Session, Policy, the statistics and
every error class (`dir`, `__all__`); `concordia.wal` exports planning,
compaction and snapshots; a missing dependency is named in one line; library
errors carry no exit codes (the command line maps them)."""

from __future__ import annotations

import inspect
import subprocess
import sys
import pathlib

import pytest

import concordia
import concordia.errors as errors
from concordia.root_error import ConcordiaError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _error_classes_of(module) -> set[str]:
    return {n for n, v in vars(module).items()
            if inspect.isclass(v) and issubclass(v, ConcordiaError) and v.__module__ == module.__name__}


def test_dir_and_all_list_what_a_user_needs():
    listed = dir(concordia)
    for name in ("Session", "Policy", "CheckpointStats", "RecoveryStats", "ConcordiaError", "SessionError",
                 "CorruptionError", "NotALogError", "DevmemError", "MissingDependencyError"):
        assert name in listed and name in concordia.__all__, name
    for name in concordia.__all__:
        assert getattr(concordia, name) is not None, name
    assert concordia.Session.__name__ == "Session" and concordia.RecoveryStats.__name__ == "RecoveryStats"
    with pytest.raises(AttributeError, match="no attribute 'Sesion'"):
        concordia.Sesion  # noqa: B018


def test_every_error_class_is_exported_from_concordia_and_concordia_errors():
    """Each layer's error module names its classes; concordia.errors imports each
    by name (no star, no swallowed ImportError) and concordia lists them all."""
    from concordia.devmem import errors as devmem_errors
    from concordia.executor import errors as executor_errors
    from concordia.gpu_kernels import errors as kernel_errors
    from concordia.instrument import errors as instrument_errors
    from concordia.regions import errors as runtime_errors
    from concordia.wal import errors as wal_errors
    import concordia.root_error as root

    defined = set()
    for module in (root, devmem_errors, wal_errors, kernel_errors, executor_errors, instrument_errors, runtime_errors,
                   errors):
        defined |= _error_classes_of(module)
    assert set(errors.__all__) == defined
    assert set(concordia._ERRORS) == defined
    assert all(getattr(concordia, n) is getattr(errors, n) for n in defined)


def test_no_error_class_lives_outside_the_error_modules():
    """An error class defined anywhere else would be missing from concordia.errors."""
    import ast
    import pathlib

    repo = pathlib.Path(__file__).resolve().parents[2]
    stray = []
    for folder in ("concordia", "wal", "devmem", "gpu_kernels", "tools"):
        for path in sorted((repo / folder).rglob("*.py")):
            if path.name in ("errors.py", "root_error.py"):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and any(
                        isinstance(b, ast.Name) and b.id.endswith("Error") for b in node.bases):
                    stray.append(f"{path.relative_to(repo)}: {node.name}")
    assert not stray, stray


def test_importing_the_errors_loads_no_runtime_code():
    """`concordia.errors` is the public face: importing it loads the error
    modules of each layer (and their packages' `__init__`, which import
    nothing) and no other module of the package, nor numpy."""
    code = ("import sys, json\n"
            "import concordia.errors\n"
            "print(json.dumps(sorted(m for m in sys.modules if m == 'numpy' or m.startswith('concordia'))))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    import json

    loaded = set(json.loads(r.stdout))
    packages = {"concordia", "concordia.devmem", "concordia.wal", "concordia.gpu_kernels", "concordia.executor",
                "concordia.instrument", "concordia.regions"}
    allowed = packages | {"concordia.errors", "concordia.root_error", "concordia.lazy"} | {f"{p}.errors" for p in packages}
    assert loaded <= allowed, f"importing concordia.errors loads {sorted(loaded - allowed)}"


def test_no_module_of_the_package_imports_the_public_face():
    """The public face is for users: every module inside the package imports
    an error from the module that defines it."""
    from tests.house.test_imports import imports

    assert not [i for i in imports() if i.target == "concordia.errors"]


def test_the_error_module_imports_each_class_by_name():
    text = inspect.getsource(errors)
    assert "import *" not in text and "except ImportError" not in text and "__import__" not in text


def test_a_missing_crc32c_is_named_in_one_line():
    code = ("import sys\n"
            "sys.modules['crc32c'] = None  # as if the package were not installed\n"
            "import concordia\n"
            "try:\n"
            "    concordia.Session\n"
            "except ImportError as exc:\n"
            "    print(type(exc).__name__, exc.name)\n"
            "    print(exc)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    kind, message = r.stdout.strip().split("\n")
    assert kind == "MissingDependencyError crc32c"
    assert message == ("concordia.Session: needs the 'crc32c' package, which is not installed "
                       "(pip install crc32c)")


def test_a_missing_crc32c_found_by_a_meta_path_finder_is_named_too():
    code = ("import sys\n"
            "class NoCrc:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'crc32c':\n"
            "            raise ModuleNotFoundError(\"No module named 'crc32c'\", name='crc32c')\n"
            "sys.meta_path.insert(0, NoCrc())\n"
            "import concordia\n"
            "concordia.Session\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert "MissingDependencyError: concordia.Session: needs the 'crc32c' package" in last


def test_library_errors_carry_no_exit_codes():
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert all("exit_code" not in vars(k) for k in cls.__mro__), name


def test_the_command_line_maps_errors_to_the_documented_codes():
    from concordia.tools.common import EXIT_PROBLEMS, EXIT_USAGE, exit_code_of

    problems = {"CorruptionError", "TornTailError", "ChainError", "SuperblockError", "NotALogError",
                "RegionMismatchError", "NothingToRecoverError", "RecoveryDigestError", "AbsentRegionError"}
    for name in errors.__all__:
        cls = getattr(errors, name)
        exc = cls("x") if name != "MissingDependencyError" else cls("crc32c", needed_by="here")
        assert exit_code_of(exc) == (EXIT_PROBLEMS if name in problems else EXIT_USAGE), name


def test_wal_exports_planning_compaction_and_snapshots():
    import concordia.wal as wal

    for name in ("Log", "RecoveryMode", "plan", "Plan", "RegionPlan", "scan", "History", "compact",
                 "CompactReport", "create_base_snapshot", "list_snapshots", "SnapshotInfo", "verify",
                 "region_digest"):
        assert name in wal.__all__ and getattr(wal, name) is not None, name
    for plumbing in ("Appender", "Reservation", "Extent", "Volume", "SegmentInfo"):
        assert plumbing not in wal.__all__, plumbing
    assert set(wal.__all__) <= set(dir(wal))


@pytest.mark.parametrize("program,entry", [("concordia", "concordia"), ("concordia-wal", "concordia_wal")])
def test_the_commands_without_crc32c_say_so_in_one_line(program, entry):
    code = ("import sys\n"
            "sys.modules['crc32c'] = None  # as if the package were not installed\n"
            f"sys.argv = [{program!r}, '--help']\n"
            f"from concordia.tools.entry import {entry}\n"
            f"{entry}()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    assert r.stderr == (f"{program}: error: needs the 'crc32c' package, which is not installed "
                        "(pip install crc32c)\n")


def test_the_installed_commands_go_through_the_guarded_entry():
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"concordia": "concordia.tools.entry:concordia",
                       "concordia-wal": "concordia.tools.entry:concordia_wal"}


@pytest.mark.parametrize("package", ["concordia.wal", "concordia.devmem", "concordia.executor",
                                     "concordia.instrument"])
def test_a_lazy_package_keeps_its_names_once_every_submodule_is_loaded(package):
    """A package that loads its contents on first use (`concordia.lazy`) must
    not have a submodule of the same name as one of its own functions or
    exports: importing that submodule later would put the module where the
    function was (`instrument.report()` once was `instrument/report.py`)."""
    code = ("import importlib, inspect, json, pkgutil, sys, types\n"
            f"pkg = importlib.import_module({package!r})\n"
            "own = {n: v for n, v in vars(pkg).items() if inspect.isfunction(v) and v.__module__ == pkg.__name__}\n"
            "exported = {n: getattr(pkg, n) for n in getattr(pkg, '__all__', [])}\n"
            "for m in pkgutil.iter_modules(pkg.__path__):\n"
            "    if m.name not in ('__main__',):\n"
            "        importlib.import_module(pkg.__name__ + '.' + m.name)\n"
            "bad = [n for n, v in {**own, **exported}.items() if getattr(pkg, n) is not v\n"
            "       or isinstance(getattr(pkg, n), types.ModuleType)]\n"
            "print(json.dumps(bad))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"{package}: names replaced by a submodule: {r.stdout.strip()}"
