"""Unit tests of the PTX reader and rewriter (no GPU, no CUDA tools)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from concordia.instrument import ptx as P
from concordia.instrument.errors import InstrumentError
from concordia.instrument.rewriter import (EPOCHS, REWRITER_VERSION, TRACK, Options, _split_address, _store_bytes,
                                          rewrite)
from tests.instrument.conftest import CORPUS

HEADER = ".version 8.0\n.target sm_90\n.address_size 64\n"


def entry(body: str, name: str = "k") -> str:
    return HEADER + f".visible .entry {name}(.param .u64 p)\n{{\n{body}\n}}\n"


def calls_before_stores(ptx: str) -> list[tuple[str, int, str]]:
    """(predicate, nbytes, store line) for every tracked store, in order."""
    found = []
    for m in re.finditer(r"st\.param\.b32 \[__cnc_pn\], (\d+);\n\t(@!?\S+ )?call " + TRACK
                         + r".*?\}\s*([^\n]*)", ptx, re.S):
        found.append(((m.group(2) or "").strip(), int(m.group(1)), m.group(3).strip()))
    return found


def test_comments_are_removed_but_strings_and_lines_kept():
    text = '.file 1 "a//b.cu" // tail\n/* x\ny */ld.global.u32 %r1, [%rd1];'
    out = P.strip_comments(text)
    assert '"a//b.cu"' in out and "tail" not in out
    assert out.count("\n") == text.count("\n")


def test_top_level_split_handles_initialisers_sections_and_prototypes():
    text = HEADER + (".global .align 4 .b32 t[2] = {1, 2};\n"
                     ".extern .func (.param .b32 r) vprintf(.param .b64 a, .param .b64 b);\n"
                     ".visible .entry e() { ret; }\n"
                     ".section .debug_info { .b8 1 }\n")
    chunks = P.split_top_level(P.strip_comments(text))
    funcs = [c for c in chunks if c.is_function]
    assert [(c.kind, c.name) for c in funcs] == [("entry", "e")]
    assert any(c.text.startswith(".section") for c in chunks)


def test_function_name_after_return_list():
    assert P.function_name(".func (.param .b32 r) dev_fn(.param .b64 a)") == "dev_fn"
    assert P.function_name(".visible .entry kern(") == "kern"


def test_every_exit_is_routed_through_one_stub():
    body = ("\t.reg .pred %p<3>;\n\tsetp.eq.u32 %p1, 1, 1;\n\t@%p1 ret;\n"
            "\t@!%p1 exit;\n\t{ @%p1 ret; }\n\tret.uni;")
    res = rewrite(entry(body))
    assert res.kernels[0].exit_sites == 4 and res.options.pause_gate
    out = res.ptx
    assert "@%p1 bra $__cnc_exit;" in out and "@!%p1 bra $__cnc_exit;" in out
    assert "bra.uni $__cnc_exit;" in out
    # the only ret left is the stub's own; no exit remains
    assert out.count("ret;") == 1 and "exit;" not in out.replace("$__cnc_exit", "")
    # no barrier and no shared memory anywhere; the only prologue is a weak,
    # L1-served mirror read: no special register, branch or atomic before the body
    assert "bar.sync" not in out and ".shared" not in out
    head = out[:out.index("setp.eq.u32 %p1")]
    body = head[head.index(".reg .b32 %__cnc_h;"):]
    assert "ld.global.ca.u32 %__cnc_h, [__concordia_hold];" in body
    assert not any(s in body for s in ("%tid", "%ctaid", "bra", "atom", "red.", "ld.relaxed"))


def test_threads_count_only_when_the_mirror_said_closed():
    out = rewrite(entry("\tret;")).ptx
    stub = out[out.index("$__cnc_exit:"):]
    counting = stub[:stub.index("$__cnc_counted:")]
    # open (1) or detached (0): a block other than 0 leaves on one branch, block
    # 0 goes to its launch count; no memory operation on either path
    common = ("setp.ne.u32 %__cnc_p0, %__cnc_r3, 0;\n\tsetp.le.u32 %__cnc_p3, %__cnc_h, 1;\n"
              "\tand.pred %__cnc_p2, %__cnc_p0, %__cnc_p3;\n\t@%__cnc_p2 bra $__cnc_done;\n"
              "\t@%__cnc_p3 bra $__cnc_counted;")
    assert common in counting
    before = counting[:counting.index(common)]
    assert "ld." not in before and "red." not in before and "%ctaid.z" in before
    # closed: one group leader adds the group's size and size x signature into
    # its launch's slot (%gridid % 256), releases after a warp barrier
    order = [counting.index(s) for s in ("mov.u64 %__cnc_d3, %gridid;", "and.b32 %__cnc_r5, %__cnc_r5, 255;",
                                         "[mov.u64 %__cnc_d0, __concordia_slots;".lstrip("["),
                                         "mul.lo.u64 %__cnc_d4, %__cnc_d3, 0x9E3779B97F4A7C15;",
                                         "activemask.b32", "bar.warp.sync %__cnc_r0;",
                                         "@%__cnc_p1 red.release.gpu.global.add.u64 [%__cnc_d1+8], %__cnc_d4;",
                                         "@%__cnc_p1 red.release.gpu.global.add.u64 [%__cnc_d1], %__cnc_d2;")]
    assert order == sorted(order)
    assert "red.relaxed" not in stub and "atom." not in stub
    assert ".visible .global .align 16 .u64 __concordia_slots[512];" in out


def test_gate_waits_only_in_block_zero_and_only_for_launches_after_the_stamp():
    out = rewrite(entry("\tret;")).ptx
    tail = out[out.index("$__cnc_counted:"):]
    # thread (0,0,0) of block (0,0,0) (p0 = not block 0, set before the count),
    # launch counted, mirror closed, gate attached, host word set, grid id
    # above the gate's stamp: in that order
    order = [tail.index(s) for s in ("@%__cnc_p0 bra $__cnc_done;", "%tid.z",
                                     "red.global.add.u64 [__concordia_epochs+0], 1;",
                                     "setp.le.u32 %__cnc_p0, %__cnc_h, 1;", "[__concordia_gate]",
                                     "ld.volatile.global.u32 %__cnc_r0, [%__cnc_d3];",
                                     "ld.volatile.global.u64 %__cnc_d5, [%__cnc_d3+24];",
                                     "setp.le.u64 %__cnc_p0, %__cnc_d2, %__cnc_d5;", "$__cnc_drain:")]
    assert order == sorted(order)
    drain = tail[tail.index("$__cnc_drain:"):tail.index("$__cnc_drained:")]
    # arrival needs the slot's count equal to the launch's threads and its
    # signature sum equal to threads x signature; an opened gate ends the wait
    assert "setp.ne.u64 %__cnc_p0, %__cnc_d5, %__cnc_d0;" in drain
    assert "[%__cnc_d1+8];\n\tsetp.eq.u64 %__cnc_p0, %__cnc_d5, %__cnc_d4;" in drain
    assert "ld.volatile.global.u32 %__cnc_r0, [%__cnc_d3];\n\tsetp.eq.u32 %__cnc_p0, %__cnc_r0, 0;\n\t@%__cnc_p0 bra $__cnc_done;" in drain
    # the slot address is computed before d0 takes the thread count
    before = tail[:tail.index("$__cnc_drain:")]
    assert before.rindex("mov.u64 %__cnc_d0, __concordia_slots;") < before.rindex("mov.u64 %__cnc_d0, %__cnc_d5;")
    after = tail[tail.index("$__cnc_drained:"):]
    assert after.index("fence.acq_rel.gpu;") < after.index("st.volatile.global.u32 [%__cnc_d3+4]")


def test_a_module_without_the_gate_only_counts_launches():
    bare = rewrite(entry("\tret;"), Options(pause_gate=False))
    out = bare.ptx
    assert "__concordia_hold]" not in out and "__concordia_gate]" not in out and "%gridid" not in out
    assert "red.global.add.u64 [__concordia_epochs+0], 1;" in out
    assert out.count("red.") == 1


def test_old_targets_get_no_gate_and_count_only_launches():
    text = ".version 6.0\n.target sm_60\n.address_size 64\n.visible .entry k()\n{\n\tret;\n}\n"
    res = rewrite(text)
    assert not res.options.pause_gate
    assert "activemask" not in res.ptx and "__concordia_hold]" not in res.ptx
    assert "red.global.add.u64 [__concordia_epochs+0], 1;" in res.ptx


def test_func_exit_is_hooked_but_func_ret_is_not():
    text = HEADER + (".func f(.param .b32 a)\n{\n\t.reg .pred %q;\n\tsetp.eq.u32 %q, 1, 1;\n"
                     "\t@%q exit;\n\tret;\n}\n.visible .entry e()\n{\n\tret;\n}\n")
    res = rewrite(text)
    assert [f.name for f in res.functions] == ["f"]
    assert res.functions[0].exit_sites == 1
    f_body = res.ptx[res.ptx.index(".func f"):res.ptx.index(".visible .entry e")]
    assert "@%q bra $__cnc_exit;" in f_body
    assert f_body.rstrip().endswith("$__cnc_done:\n\texit;\n}")  # the stub leaves with exit
    assert "\tret;" in f_body  # a .func return goes back to its caller, untouched
    # the .func reads the mirror itself and counts into its launch's slot while closed
    order = [f_body.index(s) for s in ("ld.global.ca.u32 %__cnc_h, [__concordia_hold];",
                                       "@%__cnc_p3 bra $__cnc_counted;", "%gridid",
                                       "red.release.gpu.global.add.u64", "$__cnc_counted:")]
    assert order == sorted(order) and "__concordia_gate" not in f_body
    # thread (0,0,0) might leave there, so the entry counts its launch in the prologue
    e_body = res.ptx[res.ptx.index(".visible .entry e"):]
    assert e_body.index("[__concordia_epochs+0], 1;") < e_body.index("$__cnc_exit:")
    assert e_body.count("[__concordia_epochs+0], 1;") == 1 and "$__cnc_go:" in e_body
    # without the gate a .func's exit needs no hook
    bare = rewrite(text, Options(pause_gate=False))
    assert bare.functions == [] and "@%q exit;" in bare.ptx


def test_slots_follow_entry_order():
    text = HEADER + "".join(f".visible .entry k{i}()\n{{\n\tret;\n}}\n" for i in range(3))
    res = rewrite(text)
    assert [(k.name, k.index) for k in res.kernels] == [("k0", 0), ("k1", 1), ("k2", 2)]
    assert f"{EPOCHS}[3]" in res.ptx
    assert "[__concordia_epochs+16]" in res.ptx
    assert res.slot("k2") == 2
    with pytest.raises(InstrumentError, match="no instrumented kernel"):
        res.slot("nope")


def test_predicated_and_vector_stores_are_tracked_under_their_predicate():
    body = ("\t.reg .pred %p<2>;\n\t.reg .b64 %rd<3>;\n\t.reg .f32 %f<2>;\n"
            "\tld.param.u64 %rd1, [p];\n\tsetp.eq.u64 %p1, %rd1, 0;\n"
            "\t@%p1 st.global.v4.f32 [%rd1+16], {%f1, %f1, %f1, %f1};\n"
            "\t@!%p1 st.global.v2.u64 [%rd1+-8], {%rd1, %rd1};\n"
            "\tst.global.u8 [%rd1], %rd1;\n\tret;")
    res = rewrite(entry(body), Options(track_stores=True))
    assert res.stores_tracked == 3
    got = calls_before_stores(res.ptx)
    assert [(g[0], g[1]) for g in got] == [("@%p1", 16), ("@!%p1", 16), ("", 1)]
    assert got[0][2].startswith("@%p1 st.global.v4.f32")
    assert "add.s64 %__cnc_ta, %__cnc_ta, -8;" in res.ptx


def test_non_global_stores_are_left_alone_and_bulk_copies_reported():
    body = ("\t.reg .b32 %r<3>;\n\t.reg .b64 %rd<3>;\n\t.shared .align 4 .b8 s[64];\n"
            "\tmov.u32 %r1, s;\n\tst.shared.u32 [%r1], %r1;\n\tst.local.u32 [%rd1], %r1;\n"
            "\tatom.shared.add.u32 %r2, [%r1], 1;\n"
            "\tcp.async.bulk.global.shared::cta.bulk_group [%rd1], [%r1], 64;\n"
            "\tst.u32 [%rd1], %r1;\n\tret;")
    res = rewrite(entry(body), Options(track_stores=True))
    assert res.stores_tracked == 1  # the generic st only
    assert res.stores_untracked == 1


def test_thirty_two_bit_addressing_widens_addresses():
    text = (CORPUS / "addr32" / "edge_addr32.ptx").read_text()
    res = rewrite(text, Options(track_stores=True))
    assert res.address_size == 32
    assert "cvt.u64.u32 %__cnc_ta, %r5;" in res.ptx
    assert "mov.u32 %__cnc_t32, counter;" in res.ptx
    assert "cvt.u64.u32 %rd2, %r7;" in res.ptx  # the tracker's region table address


def test_store_sizes_and_address_forms():
    assert _store_bytes("st.global.v4.f32".split(".")) == 16
    assert _store_bytes("st.global.v2.u64".split(".")) == 16
    assert _store_bytes("atom.global.add.noftz.bf16x2".split(".")) == 4
    assert _store_bytes("red.global.add.u64".split(".")) == 8
    assert _store_bytes("st.global.b128".split(".")) == 16
    assert _split_address("%rd1+16") == ("%rd1", 16)
    assert _split_address(" %rd1 + -8 ".strip()) == ("%rd1", -8)
    assert _split_address("table+0x10") == ("table", 16)
    assert _split_address("sym") == ("sym", 0)


def test_tracking_off_adds_no_tracker_and_gate_off_adds_no_poll():
    text = entry("\t.reg .b64 %rd<2>;\n\tst.global.u32 [%rd1], 1;\n\tret;")
    plain = rewrite(text, Options(pause_gate=False))
    assert TRACK not in plain.ptx and "ld.volatile" not in plain.ptx
    assert plain.stores_tracked == 0


def test_refuses_what_it_cannot_or_should_not_rewrite():
    with pytest.raises(InstrumentError, match="not a PTX module"):
        rewrite(".visible .entry x() { ret; }")
    with pytest.raises(InstrumentError, match="no .entry"):
        rewrite(HEADER + ".func f() { ret; }")
    once = rewrite(entry("\tret;")).ptx
    with pytest.raises(InstrumentError, match="already instrumented"):
        rewrite(once)
    with pytest.raises(InstrumentError, match="unbalanced"):
        rewrite(HEADER + ".visible .entry x() { ret; }}")


def test_bytes_with_trailing_nul_are_accepted():
    res = rewrite((entry("\tret;")).encode() + b"\0junk")
    assert res.kernels[0].name == "k"


def test_cli_rewrites_and_reports(tmp_path):
    report = tmp_path / "r.jsonl"
    src = entry("\t.reg .b64 %rd<2>;\n\tst.global.u32 [%rd1], 1;\n\tret;")
    p = subprocess.run([sys.executable, "-m", "concordia.instrument", "--track-stores",
                        "--report", str(report), "--name", "m1"],
                       input=src.encode(), capture_output=True)
    assert p.returncode == 0, p.stderr
    assert EPOCHS.encode() in p.stdout
    rec = json.loads(report.read_text().splitlines()[0])
    assert rec["module"] == "m1" and rec["stores_tracked"] == 1 and rec["hook_sites"] == 1
    assert rec["rewriter_version"] == REWRITER_VERSION   # which inserted code the record describes
    bad = subprocess.run([sys.executable, "-m", "concordia.instrument", "--report",
                          str(report)], input=b"\x7fELF\x02\x01", capture_output=True)
    assert bad.returncode == 3 and bad.stdout == b""
    assert bad.stderr.decode().count("\n") == 1 and "skipped" in bad.stderr.decode()
