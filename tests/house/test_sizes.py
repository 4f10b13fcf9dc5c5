"""Size parsing lives in the runtime (`concordia.sizes`), bounded, and every
command line and `Policy.parse` take it from there."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from concordia.sizes import MAX_SIZE, parse_size
from concordia.tools.wal_cli import main


@pytest.mark.parametrize("text, n", [("4096", 4096), ("64M", 64 << 20), ("1GiB", 1 << 30), ("1.5G", 3 << 29),
                                     (" 2 kb ", 2048), ("0", 0), ("7T", 7 << 40), (str(MAX_SIZE), MAX_SIZE)])
def test_sizes_as_a_person_types_them(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text, words", [
    ("99999999999999999999999", "too large"), (str(MAX_SIZE + 1), "too large"), ("9000000T", "too large"),
    ("0.3K", "whole number of bytes"), ("1.0000001", "whole number of bytes"),
    ("-5", "not a size"), ("12Q", "not a size"), ("", "not a size"), ("1e9", "not a size"),
])
def test_bad_sizes_end_in_one_line_naming_the_text(text, words):
    with pytest.raises(ValueError) as e:
        parse_size(text)
    assert words in str(e.value) and repr(text) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("size", ["99999999999999999999999", "9000000T", "0.3K"])
def test_format_with_an_impossible_size_is_a_usage_error(tmp_path, size):
    log = tmp_path / "x.log"
    r = CliRunner().invoke(main, ["format", f"file:{log}", "--size", size])
    assert r.exit_code == 2, r.output
    assert "--size" in r.output and size in r.output
    assert "unexpected failure" not in r.output and "Traceback" not in r.output
    assert not log.exists()


def test_policy_parses_sizes_without_the_command_line():
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'click' or name.startswith('click.') or name.startswith('concordia.tools'):\n"
            "            raise ImportError(f'blocked: {name}')\n"
            "sys.meta_path.insert(0, Block())\n"
            "from concordia.policy import Policy\n"
            "p = Policy.parse('steps=4,bytes=64M')\n"
            "assert (p.every_steps, p.every_bytes) == (4, 64 << 20)\n"
            "assert not any(m == 'click' or m.startswith('concordia.tools') for m in sys.modules)\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_policy_names_a_bad_size():
    from concordia.errors import SessionError
    from concordia.policy import Policy

    with pytest.raises(SessionError, match=r"bytes='99999999999999999999999T' is not a size"):
        Policy.parse("bytes=99999999999999999999999T")
