"""The PTX rewriter: exit hooks, a pause gate and an optional store tracker,
inserted into every kernel of a module without changing any kernel signature.

What the host sees (module-scope `.visible .global` variables, read and filled
through cuModuleGetGlobal / CuPy `RawModule.get_global`; all start at zero):

  __concordia_epochs   .u64[K+1]  launches of kernel k that have completed
                                  (slot K counts exits reached through `exit`
                                  inside a `.func`, which belongs to no one kernel)
  __concordia_arrivals .u32[K+1]  blocks of the launch in flight that have finished
                                  (wraps to 0 when the last block finishes)
  __concordia_gate     .u64       device address of a gate, 0 = no gate.  A gate is
                                  two u32 words, usually in mapped pinned host
                                  memory: word 0 written by the host (non-zero =
                                  hold), word 1 set to 1 by the GPU when a launch
                                  arrives at the closed gate.
  __concordia_nregions .u32       store tracker: number of regions in use
  __concordia_regions  .u64[4*R]  store tracker: per region base, size,
                                  bitmap address (u32 words, bit p%32 of word p/32
                                  = page p), page_bytes

Exit hook, and why only one thread waits.  Every `ret`/`exit` of an entry
(predicated or not, however many) becomes a branch to one stub at the end of
the body; falling off the end of the body reaches the stub as well.  The stub
counts the exiting thread in a block-shared counter (zeroed by thread 0 in a
prologue followed by `bar.sync 0`, the one point every thread of a block is
known to pass).  The thread that brings the count to blockDim is the last of its
block: it fences at GPU scope (cumulative over the release of every other
thread's arrival) and increments the kernel's arrival counter with
`atom.inc`, whose wrap at gridDim-1 both detects the last block of the launch
and resets the counter for the next launch.  Only that last thread of the last
block counts the epoch and polls the gate.  A `bar.sync` at the exits would be
wrong (threads leave at different points, so a barrier there can deadlock),
and polling from every thread or block would flood PCIe.  While it waits, every
other block of the launch has finished and its writes are visible at GPU scope,
and the stream cannot start its next operation: the device state is exactly
"after this kernel", which is what a consistent checkpoint needs.

Limits, stated once: two launches of the same kernel running concurrently on
different streams share its arrival counter, so "last block" is then only
approximate (epoch totals stay right when their grids are equal); the prologue
adds 4 bytes of static shared memory and one barrier per block; grids of 2^32
blocks or more are not supported.

Store tracker.  Before every `st`, `atom` and `red` that may write global memory
(state space `.global`, or generic, which covers global), the address and
access size (type size x vector width) are passed, under the store's own
predicate, to `__concordia_track`, which marks every page of every registered
region that the byte range [addr, addr+size) overlaps.  Generic addresses of
shared or local memory never fall inside a registered device allocation, so no
`isspacep` test is needed.  A bit already set is read (L2, `.cg`) before any
`red.or`, so repeated stores to a dirty page cost a load.  Bulk/tensor copies
into global memory (`cp.async.bulk`, `cp.reduce.async.bulk`, `multimem`) cannot
be tracked this way; they are counted as untracked in the report.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field

from concordia.instrument import ptx as P
from concordia.instrument.errors import InstrumentError

REWRITER_VERSION = 1
MARK = "__concordia_"          # module-scope names
REG = "%__cnc_"                # registers we declare
LBL = "$__cnc_"                # labels we place

EPOCHS = MARK + "epochs"
ARRIVALS = MARK + "arrivals"
GATE = MARK + "gate"
NREGIONS = MARK + "nregions"
REGIONS = MARK + "regions"
TRACK = MARK + "track"
BLOCK_EXITS = MARK + "block_exits"
REGION_WORDS = 4               # base, size, bitmap, page_bytes (u64 each)

_TYPE_BYTES = {
    "b8": 1, "u8": 1, "s8": 1,
    "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
    "b32": 4, "u32": 4, "s32": 4, "f32": 4, "f16x2": 4, "bf16x2": 4, "tf32": 4,
    "b64": 8, "u64": 8, "s64": 8, "f64": 8,
    "b128": 16,
}
_NON_GLOBAL_SPACES = ("shared", "local", "param", "const", "async", "bulk")
_UNTRACKABLE = ("cp.async.bulk", "cp.reduce.async.bulk", "multimem.st", "multimem.red")


@dataclass(frozen=True)
class Options:
    exit_hooks: bool = True
    pause_gate: bool = True
    track_stores: bool = False
    max_regions: int = 8


@dataclass
class KernelInfo:
    name: str
    index: int
    kind: str               # "entry" | "func"
    exit_sites: int = 0     # ret/exit statements rerouted through the hook
    stores_tracked: int = 0
    stores_untracked: int = 0

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class RewriteResult:
    ptx: str
    kernels: list[KernelInfo] = field(default_factory=list)   # entries, in slot order
    functions: list[KernelInfo] = field(default_factory=list)  # .func bodies touched
    options: Options = Options()
    address_size: int = 64
    target: str = ""

    @property
    def hook_sites(self) -> int:
        return sum(k.exit_sites for k in self.kernels + self.functions)

    @property
    def stores_tracked(self) -> int:
        return sum(k.stores_tracked for k in self.kernels + self.functions)

    @property
    def stores_untracked(self) -> int:
        return sum(k.stores_untracked for k in self.kernels + self.functions)

    def slot(self, kernel_name: str) -> int:
        for k in self.kernels:
            if k.name == kernel_name:
                return k.index
        raise InstrumentError(f"no instrumented kernel named {kernel_name!r}",
                              hint="kernels: " + ", ".join(k.name for k in self.kernels))

    def to_json(self) -> dict:
        return {
            "target": self.target,
            "address_size": self.address_size,
            "options": dict(self.options.__dict__),
            "kernels": [k.to_json() for k in self.kernels],
            "functions": [k.to_json() for k in self.functions],
            "hook_sites": self.hook_sites,
            "stores_tracked": self.stores_tracked,
            "stores_untracked": self.stores_untracked,
        }


def is_instrumented(text: str) -> bool:
    return EPOCHS in text


def rewrite(text: str | bytes, options: Options = Options()) -> RewriteResult:
    """Rewrite one PTX module.  Raises InstrumentError when the text is not PTX
    that this reader understands, or was instrumented already."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).split(b"\0", 1)[0].decode("utf-8", errors="strict")
    if is_instrumented(text):
        raise InstrumentError("module is already instrumented", where=EPOCHS)
    if "__cnc_" in text:
        raise InstrumentError("module already uses the reserved prefix __cnc_")
    clean = P.strip_comments(text)
    chunks = P.split_top_level(clean)
    header = P.read_header(chunks)
    if header.insert_after < 0:
        raise InstrumentError("no module header")
    symbols = _module_symbols(chunks)
    entries = [c for c in chunks if c.is_function and c.kind == "entry"]
    if not entries:
        raise InstrumentError("module has no .entry")
    nslots = len(entries) + 1
    modern = header.sm >= 70 and header.version >= (6, 0)
    sleep_ok = header.sm >= 70 and header.version >= (6, 3)
    result = RewriteResult(ptx="", options=options, address_size=header.address_size,
                           target=header.target)
    ctx = _Ctx(options, header, symbols, modern, sleep_ok, other_slot=len(entries))
    out: list[str] = []
    slot = 0
    for k, ch in enumerate(chunks):
        if ch.is_function and ch.kind == "entry":
            info = KernelInfo(ch.name, slot, "entry")
            slot += 1
            out.append(ch.lead + _rewrite_function(ch, info, ctx))
            result.kernels.append(info)
        elif ch.is_function:
            info = KernelInfo(ch.name, ctx.other_slot, "func")
            out.append(ch.lead + _rewrite_function(ch, info, ctx))
            if info.exit_sites or info.stores_tracked or info.stores_untracked:
                result.functions.append(info)
        else:
            out.append(ch.lead + ch.text)
        if k == header.insert_after:
            out.append("\n\n" + _module_additions(nslots, ctx) + "\n")
    result.ptx = "".join(out)
    if not result.ptx.endswith("\n"):
        result.ptx += "\n"
    return result


@dataclass
class _Ctx:
    options: Options
    header: P.Header
    symbols: set[str]
    modern: bool
    sleep_ok: bool
    other_slot: int


def _module_symbols(chunks: list[P.Chunk]) -> set[str]:
    """Names of module-scope variables (anything declared in a state space)."""
    names: set[str] = set()
    for ch in chunks:
        if ch.is_function:
            continue
        t = ch.text.strip()
        if re.match(r"(\.(visible|extern|weak|common)\s+)*\.(global|const|shared|local)\b", t):
            m = re.search(r"(" + P._IDENT + r")\s*(\[[^\]]*\]\s*)*(=|;)", t)
            if m:
                names.add(m.group(1))
    return names


def _module_additions(nslots: int, ctx: _Ctx) -> str:
    a = ctx.header.address_size
    lines = [
        f".visible .global .align 8 .u64 {EPOCHS}[{nslots}];",
        f".visible .global .align 4 .u32 {ARRIVALS}[{nslots}];",
        f".visible .global .align 8 .u64 {GATE};",
        f".shared .align 4 .u32 {BLOCK_EXITS};",
    ]
    if ctx.options.track_stores:
        lines += [
            f".visible .global .align 4 .u32 {NREGIONS};",
            f".visible .global .align 8 .u64 {REGIONS}[{REGION_WORDS * ctx.options.max_regions}];",
            _track_function(a),
        ]
    return "\n".join(lines)


def _track_function(address_size: int) -> str:
    """`__concordia_track(addr, nbytes)`: mark the pages of every registered region
    that [addr, addr+nbytes) overlaps."""
    ptr = "u64" if address_size == 64 else "u32"
    load_regions = (f"mov.u64 %rd2, {REGIONS};" if address_size == 64 else
                    f"mov.u32 %r7, {REGIONS};\n\tcvt.u64.u32 %rd2, %r7;")
    del ptr
    return f"""
.func {TRACK}(.param .b64 {MARK}a, .param .b32 {MARK}n)
{{
	.reg .pred %p<4>;
	.reg .b32 %r<8>;
	.reg .b64 %rd<12>;
	ld.param.b64 %rd0, [{MARK}a];
	ld.param.b32 %r0, [{MARK}n];
	cvt.u64.u32 %rd1, %r0;
	add.s64 %rd1, %rd0, %rd1;
	ld.global.u32 %r1, [{NREGIONS}];
	mov.u32 %r2, 0;
	{load_regions}
$Lregion:
	setp.ge.u32 %p0, %r2, %r1;
	@%p0 bra $Ldone;
	ld.global.u64 %rd3, [%rd2];
	ld.global.u64 %rd4, [%rd2+8];
	add.s64 %rd4, %rd3, %rd4;
	setp.lt.u64 %p0, %rd0, %rd4;
	setp.gt.u64 %p1, %rd1, %rd3;
	and.pred %p0, %p0, %p1;
	@!%p0 bra $Lnext;
	ld.global.u64 %rd5, [%rd2+16];
	ld.global.u64 %rd6, [%rd2+24];
	max.u64 %rd7, %rd0, %rd3;
	sub.s64 %rd7, %rd7, %rd3;
	min.u64 %rd8, %rd1, %rd4;
	sub.s64 %rd8, %rd8, %rd3;
	sub.s64 %rd8, %rd8, 1;
	sub.s64 %rd9, %rd6, 1;
	and.b64 %rd10, %rd6, %rd9;
	setp.eq.u64 %p3, %rd10, 0;
	@!%p3 bra $Ldivide;
	bfind.u64 %r6, %rd6;
	shr.u64 %rd7, %rd7, %r6;
	shr.u64 %rd8, %rd8, %r6;
	bra.uni $Lpage;
$Ldivide:
	div.u64 %rd7, %rd7, %rd6;
	div.u64 %rd8, %rd8, %rd6;
$Lpage:
	shr.u64 %rd9, %rd7, 5;
	shl.b64 %rd9, %rd9, 2;
	add.s64 %rd9, %rd5, %rd9;
	cvt.u32.u64 %r3, %rd7;
	and.b32 %r3, %r3, 31;
	mov.b32 %r4, 1;
	shl.b32 %r4, %r4, %r3;
	ld.global.cg.u32 %r5, [%rd9];
	and.b32 %r5, %r5, %r4;
	setp.ne.u32 %p2, %r5, 0;
	@!%p2 red.global.or.b32 [%rd9], %r4;
	add.s64 %rd7, %rd7, 1;
	setp.le.u64 %p2, %rd7, %rd8;
	@%p2 bra $Lpage;
$Lnext:
	add.s32 %r2, %r2, 1;
	add.s64 %rd2, %rd2, {8 * REGION_WORDS};
	bra.uni $Lregion;
$Ldone:
	ret;
}}"""


def _rewrite_function(ch: P.Chunk, info: KernelInfo, ctx: _Ctx) -> str:
    items = P.split_body(ch.body)
    regs = P.RegTable()
    local_symbols = set(ctx.symbols)
    for it in items:
        if it.kind == "stmt" and it.opcode == ".reg":
            regs.add(it.text)
        elif it.kind == "stmt" and it.opcode in (".shared", ".local", ".global", ".const"):
            m = re.search(r"(" + P._IDENT + r")\s*(\[[^\]]*\]\s*)*(=|;)", it.text)
            if m:
                local_symbols.add(m.group(1))
    is_entry = ch.kind == "entry"
    hook_exits = ctx.options.exit_hooks and (is_entry or any(
        it.kind == "stmt" and it.parts[0] == "exit" for it in items))
    out: list[str] = []
    prologue_done = not (is_entry and ctx.options.exit_hooks)
    for it in items:
        if it.kind != "stmt":
            if it.kind in ("label", "open") and not prologue_done:
                out.append(_prologue())
                prologue_done = True
            out.append(it.text)
            continue
        if not prologue_done and not _is_declaration(it):
            out.append(_prologue())
            prologue_done = True
        op = it.parts[0]
        if hook_exits and (op == "exit" or (op == "ret" and is_entry)) and it.depth >= 0:
            uni = ".uni" if "uni" in it.parts[1:] else ""
            pred = it.pred + " " if it.pred else ""
            out.append(f"{pred}bra{uni} {LBL}exit;")
            info.exit_sites += 1
            continue
        if ctx.options.track_stores:
            tracked = _track_store(it, regs, local_symbols, ctx, info)
            if tracked:
                out.append(tracked)
        out.append(it.text)
    if not prologue_done:
        out.append(_prologue())
    body = "".join(out)
    decls = ""
    if hook_exits:
        decls = (f"\n\t.reg .pred {REG}p;\n\t.reg .b32 {REG}r<3>;\n\t.reg .b64 {REG}d<2>;")
        body = body.rstrip() + "\n" + _exit_stub(info.index if is_entry else ctx.other_slot,
                                                  "ret" if is_entry else "exit", ctx) + "\n"
    return ch.head + "{" + decls + body + "}"


def _is_declaration(it: P.Item) -> bool:
    return it.opcode in (".reg", ".shared", ".local", ".param", ".pragma", ".loc", ".const", ".global")


def _prologue() -> str:
    """Thread (0,0,0) zeroes the block's exit counter; the barrier orders that
    before any thread can exit."""
    return (f"\n\tmov.u32 {REG}r0, %tid.x;\n\tmov.u32 {REG}r1, %tid.y;\n\tor.b32 {REG}r0, {REG}r0, {REG}r1;"
            f"\n\tmov.u32 {REG}r1, %tid.z;\n\tor.b32 {REG}r0, {REG}r0, {REG}r1;"
            f"\n\tsetp.ne.u32 {REG}p, {REG}r0, 0;"
            f"\n\t@!{REG}p st.shared.u32 [{BLOCK_EXITS}], 0;\n\tbar.sync 0;\n\t")


def _exit_stub(slot: int, leave: str, ctx: _Ctx) -> str:
    r0, r1, r2, d0, d1, p = (f"{REG}r0", f"{REG}r1", f"{REG}r2", f"{REG}d0", f"{REG}d1", f"{REG}p")
    arrive = (f"atom.acq_rel.cta.shared.add.u32 {r0}, [{BLOCK_EXITS}], 1;" if ctx.modern else
              f"membar.cta;\n\tatom.shared.add.u32 {r0}, [{BLOCK_EXITS}], 1;")
    fence = "fence.acq_rel.gpu;" if ctx.modern else "membar.gl;"
    lines = [
        f"{LBL}exit:",
        arrive,
        f"mov.u32 {r1}, %ntid.x;", f"mov.u32 {r2}, %ntid.y;", f"mul.lo.u32 {r1}, {r1}, {r2};",
        f"mov.u32 {r2}, %ntid.z;", f"mul.lo.u32 {r1}, {r1}, {r2};", f"sub.u32 {r1}, {r1}, 1;",
        f"setp.ne.u32 {p}, {r0}, {r1};",
        f"@{p} bra {LBL}done;",
        fence,
        f"mov.u32 {r1}, %nctaid.x;", f"mov.u32 {r2}, %nctaid.y;", f"mul.lo.u32 {r1}, {r1}, {r2};",
        f"mov.u32 {r2}, %nctaid.z;", f"mul.lo.u32 {r1}, {r1}, {r2};", f"sub.u32 {r1}, {r1}, 1;",
        f"atom.global.inc.u32 {r0}, [{ARRIVALS}+{4 * slot}], {r1};",
        f"setp.ne.u32 {p}, {r0}, {r1};",
        f"@{p} bra {LBL}done;",
        f"red.global.add.u64 [{EPOCHS}+{8 * slot}], 1;",
    ]
    if ctx.options.pause_gate:
        lines += [
            f"ld.global.u64 {d0}, [{GATE}];",
            f"setp.eq.u64 {p}, {d0}, 0;",
            f"@{p} bra {LBL}done;",
            f"ld.volatile.global.u32 {r0}, [{d0}];",
            f"setp.eq.u32 {p}, {r0}, 0;",
            f"@{p} bra {LBL}done;",
            f"mov.u32 {r2}, 1;",
            f"st.volatile.global.u32 [{d0}+4], {r2};",
            f"{LBL}wait:",
            f"ld.volatile.global.u32 {r0}, [{d0}];",
            f"setp.eq.u32 {p}, {r0}, 0;",
            f"@{p} bra {LBL}done;",
        ]
        if ctx.sleep_ok:
            lines.append("nanosleep.u32 1000;")
        lines.append(f"bra.uni {LBL}wait;")
    lines += [f"{LBL}done:", f"{leave};"]
    del d1
    return "\n".join(("\t" + ln) if not ln.startswith(LBL) else ln for ln in lines)


def _store_bytes(parts: list[str]) -> int:
    vec = 1
    size = 0
    for p in parts[1:]:
        m = re.fullmatch(r"v(\d+)", p)
        if m:
            vec = int(m.group(1))
        elif p in _TYPE_BYTES:
            size = _TYPE_BYTES[p]
    return vec * (size or 16)  # unknown type: assume the widest single access


def _writes_global(it: P.Item) -> str:
    """"track", "untracked" or "" for an instruction."""
    op = it.opcode
    for u in _UNTRACKABLE:
        if op.startswith(u) and (".global" in op or u.startswith("multimem")):
            return "untracked"
    parts = it.parts
    if parts[0] not in ("st", "atom", "red"):
        return ""
    for p in parts[1:]:
        if any(p == s or p.startswith(s + "::") for s in _NON_GLOBAL_SPACES):
            return ""
    return "track"


_ADDR = re.compile(r"\[\s*([^\]]+?)\s*\]")


def _track_store(it: P.Item, regs: P.RegTable, symbols: set[str], ctx: _Ctx, info: KernelInfo) -> str:
    kind = _writes_global(it)
    if not kind:
        return ""
    if kind == "untracked":
        info.stores_untracked += 1
        return ""
    m = _ADDR.search(it.operands)
    if not m:
        raise InstrumentError(f"store without an address operand: {it.text.strip()}", where=info.name)
    base, offset = _split_address(m.group(1))
    a = f"{REG}ta"
    code = [f"{{\n\t.reg .b64 {a};", f"\t.param .b64 {REG[1:]}pa;", f"\t.param .b32 {REG[1:]}pn;"]
    if re.fullmatch(r"[-+]?(0[xX][0-9a-fA-F]+|\d+)U?", base):
        code.append(f"\tmov.u64 {a}, {int(base.rstrip('U'), 0)};")
    elif base in symbols or not (base.startswith("%") or regs.type_of(base)):
        if ctx.header.address_size == 64:
            code.append(f"\tmov.u64 {a}, {base};")
        else:
            code += [f"\t.reg .b32 {REG}t32;", f"\tmov.u32 {REG}t32, {base};", f"\tcvt.u64.u32 {a}, {REG}t32;"]
    else:
        typ = regs.type_of(base)
        width = int(re.sub(r"\D", "", typ)) if typ and re.search(r"\d", typ) else ctx.header.address_size
        if width == 32:
            code.append(f"\tcvt.u64.u32 {a}, {base};")
        else:
            code.append(f"\tmov.b64 {a}, {base};")
    if offset:
        code.append(f"\tadd.s64 {a}, {a}, {offset};")
    nbytes = _store_bytes(it.parts)
    pred = it.pred + " " if it.pred else ""
    code += [f"\tst.param.b64 [{REG[1:]}pa], {a};", f"\tst.param.b32 [{REG[1:]}pn], {nbytes};",
             f"\t{pred}call {TRACK}, ({REG[1:]}pa, {REG[1:]}pn);", "\t}\n\t"]
    info.stores_tracked += 1
    return "\n".join(code)


def _split_address(expr: str) -> tuple[str, int]:
    """`%rd1+16` -> ("%rd1", 16); `%rd1+-8` -> ("%rd1", -8); `sym` -> ("sym", 0)."""
    expr = expr.replace(" ", "")
    m = re.fullmatch(r"(.+?)\+(-?(?:0[xX][0-9a-fA-F]+|\d+))U?", expr)
    if m and not re.fullmatch(r"-?(0[xX][0-9a-fA-F]+|\d+)", m.group(1)):
        return m.group(1), int(m.group(2), 0)
    m = re.fullmatch(r"(.+?)-((?:0[xX][0-9a-fA-F]+|\d+))U?", expr)
    if m and m.group(1) and not m.group(1).endswith("+"):
        return m.group(1), -int(m.group(2), 0)
    return expr, 0


def main(argv: list[str] | None = None) -> int:
    """`python -m concordia.instrument [--track-stores] [--no-gate]
    [--no-exits] [--report FILE] < in.ptx > out.ptx`.

    Exit 0: rewritten PTX on stdout.  Exit 3: the module was left alone (reason
    on stderr, one line; nothing on stdout).  Exit 2: usage error.
    """
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m concordia.instrument",
                                 description="Instrument one PTX module read from stdin.")
    ap.add_argument("--track-stores", action="store_true")
    ap.add_argument("--no-gate", action="store_true")
    ap.add_argument("--no-exits", action="store_true")
    ap.add_argument("--report", help="append a JSON line describing the result to FILE")
    ap.add_argument("--name", default="", help="module name for the report")
    args = ap.parse_args(argv)
    opts = Options(exit_hooks=not args.no_exits, pause_gate=not args.no_gate,
                   track_stores=args.track_stores)
    data = sys.stdin.buffer.read()
    try:
        res = rewrite(data, opts)
    except (InstrumentError, UnicodeDecodeError) as exc:
        msg = exc.one_line() if isinstance(exc, InstrumentError) else f"not UTF-8 text: {exc}"
        print(f"skipped: {msg}", file=sys.stderr)
        if args.report:
            with open(args.report, "a") as f:
                f.write(json.dumps({"module": args.name, "skipped": msg}) + "\n")
        return 3
    sys.stdout.write(res.ptx)
    sys.stdout.flush()
    if args.report:
        with open(args.report, "a") as f:
            f.write(json.dumps({"module": args.name, **res.to_json()}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
