"""The --json outputs of info, dump, verify, recover --plan and compact are the ones
docs/cli.md documents: every documented key is there, every top-level key
is documented, and the schema names match.  Parsed from the doc itself, so
the two cannot drift apart."""

from __future__ import annotations

import json
import os
import re

import pytest
from click.testing import CliRunner

from concordia.tools.wal_cli import main

from .conftest import flip

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "cli.md")


def documented(name: str) -> list[str]:
    text = open(DOC, encoding="utf-8").read()
    m = re.search(rf"<!-- schema: {name} -->\n(.*?)<!-- end -->", text, re.S)
    assert m, f"docs/cli.md has no schema block {name!r}"
    return re.findall(r"^\| `([^`]+)` \|", m.group(1), re.M)


def resolve(obj, path: str) -> list:
    """Every value at `path` (`a.b`, `a[].b`, `a.*.b`); raises KeyError when absent."""
    vals = [obj]
    for part in path.split("."):
        nxt = []
        for v in vals:
            if part == "*":
                nxt.extend(v.values())
            elif part.endswith("[]"):
                nxt.extend(v[part[:-2]])
            else:
                if part not in v:
                    raise KeyError(path)
                nxt.append(v[part])
        vals = nxt
    return vals


def check(name: str, out: dict) -> None:
    keys = documented(name)
    top = {k.split(".")[0].removesuffix("[]") for k in keys}
    assert set(out) <= top, f"undocumented keys in {name}: {set(out) - top}"
    for k in keys:
        head = k.split(".")[0].removesuffix("[]")
        if head not in out or out[head] is None:
            continue  # e.g. dump's records/stats alternatives, info's stats without --stats
        resolve(out, k)
    assert out["schema"].startswith("concordia-wal/")


def js(*args, code=(0,)):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code in code, res.output
    return json.loads(res.stdout)


@pytest.mark.parametrize("damaged", [False, True])
def test_documented_schemas(log_path, damaged):
    if damaged:
        recs = js("dump", log_path, "--json")["records"]
        victim = [r for r in recs if r["type"] == "page_batch"][4]
        flip(log_path, victim["offset"] + victim["length"] - 3)
    code = (1,) if damaged else (0,)
    info = js("info", log_path, "--json", "--stats", code=(0, 1))
    check("info", info)
    assert info["schema"] == "concordia-wal/info/1" and info["slots"] and info["segments"]
    dump = js("dump", log_path, "--json", code=code)
    check("dump", dump)
    assert set(dump["records"][0]) == {k.split(".", 1)[1] for k in documented("dump") if k.startswith("records[].")}
    check("dump", js("dump", log_path, "--json", "--stats", code=code))
    ver = js("verify", log_path, "--json", code=code)
    check("verify", ver)
    if damaged:
        assert {k.split(".", 1)[1] for k in documented("verify") if k.startswith("problems[].")} == set(ver["problems"][0])
    plan = js("recover", log_path, "--plan", "--mode", "skip-corrupt", "--json", code=code)
    check("plan", plan)
    assert plan["regions"]["kv"]["sources"]
    if damaged:
        assert plan["dropped"] and plan["dropped"][0]["offset"] == victim["offset"]


def test_compact_schema(log_path):
    # the dry run and the real run, each with the keys its block documents (the
    # dry run without those marked "not with --dry-run")
    dry = js("compact", log_path, "--keep", "1", "--dry-run", "--json")
    check("compact", dry)
    real_only = {k for k in documented("compact") if "not with `--dry-run`" in _meaning("compact", k)}
    assert dry["dry_run"] is True and not real_only & set(dry)
    assert set(dry) == set(documented("compact")) - real_only
    rep = js("compact", log_path, "--keep", "1", "--json")
    check("compact", rep)
    assert rep["schema"] == "concordia-wal/compact/1" and rep["dry_run"] is False
    assert set(rep) == set(documented("compact"))


def _meaning(name: str, key: str) -> str:
    text = open(DOC, encoding="utf-8").read()
    block = re.search(rf"<!-- schema: {name} -->\n(.*?)<!-- end -->", text, re.S).group(1)
    return re.search(rf"^\| `{re.escape(key)}` \|[^|]*\|(.*)\|$", block, re.M).group(1)
