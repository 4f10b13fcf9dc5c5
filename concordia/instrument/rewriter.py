"""The PTX rewriter: exit hooks, a pause gate and an optional store tracker,
inserted into every kernel of a module without changing any kernel signature.

What the host sees (module-scope `.visible .global` variables, read and filled
through cuModuleGetGlobal / CuPy `RawModule.get_global`; all start at zero):

  __concordia_epochs   .u64[K]    launches of kernel k counted: block 0's thread 0
                                  counts its launch once, at its exit (at entry in a
                                  module where a `.func` calls `exit`)
  __concordia_slots    .u64[2*256] hold slots, one per %gridid % 256: threads
                                  counted and the sum of their signatures
  __concordia_hold     .u32       the gate's device-side mirror (read once per thread,
                                  at entry, with a weak load): 0 = no gate attached,
                                  1 = attached and open, 2 = closed
  __concordia_gate     .u64       device address of a gate, 0 = no gate.  A gate is
                                  u32 words in mapped pinned host memory: word 0
                                  written by the host (non-zero = hold), word 1 set
                                  to 1 by the GPU when a launch is held, bytes 24-31
                                  the %gridid of the launch that stamped its latest
                                  close (`runtime.Gate`)
  __concordia_nregions .u32       store tracker: number of regions in use
  __concordia_regions  .u64[4*R]  store tracker: per region base, size,
                                  bitmap address (u32 words, bit p%32 of word p/32
                                  = page p), page_bytes

Only a hold needs to know that every thread of a launch has left, so threads
count themselves only when the mirror said "closed" at their entry; with the
gate open or detached the exit of a thread not in block 0 is a test of the
mirror, and block 0's thread 0 counts the launch in `epochs`.  Counting every
thread while a gate was attached cost +10.4 % on the H200 against +3.3 % for the
test alone (per-element launch, docs/results/instrument.md); per-block counting
with a barrier, with `barrier.arrive`, with a shared-memory CAS, and counting at
entry were measured and cost as much or more.

Which launches count, and which hold.  The mirror can change while a launch
runs, so threads of one launch may disagree on "closed".  A launch never has
to count consistently unless it holds, and only launches that started after
the mirror was written may hold: `Gate.close()` writes the mirrors of every
attached module (and clears their slots), waits for the copies, and then
launches a one-thread stamp kernel that writes its own `%gridid` into the gate.
Grid ids follow submission order across streams (measured on the H200 with
five CuPy streams and PyTorch launches in between,
docs/results/gridid-probe.json), so a launch with a larger `%gridid` was
submitted after the stamp, started after the mirrors changed, and every one of
its threads reads "closed" (L1 does not serve a line cached before a grid
started, not even one cached by a grid still running: the same probe).

Exit hook.  Every `ret`/`exit` of an entry (predicated or not, however many)
becomes a branch to one stub at the end of the body; falling off the end
reaches it as well, so every thread passes the stub exactly once.  With the
mirror closed, the threads that reach the stub together (`activemask`) are
counted by the lowest of them, after `bar.warp.sync` orders the group's writes
before its own, with two GPU-scope release `red.add`s into the slot of their
launch (%gridid % 256): the group's size, and the group's size times the
launch's signature (an odd 64-bit multiplicative hash of %gridid).  Threads that
arrive in several groups form disjoint masks, so the counts sum to the threads
that left.  Then every block other than block 0 leaves on a test of
block-uniform registers; block 0's thread 0 counts the launch in `epochs`.

Pause gate.  Block 0's thread 0 holds its launch at its exit when the mirror
was closed at its entry, the host word is still set (read over PCIe once per
launch, only then), and its `%gridid` is larger than the gate's stamp.  It
waits until its slot holds exactly the launch's thread count N and signature
sum N x signature, fences (acquire), writes the arrival flag at system scope,
and waits for the host to open the gate.  Two launches whose grid ids are equal
modulo 256 and that count at once (a launch still running from an earlier
closed window, say) share a slot: the count passes N or the signature sum
differs, so the holder does not report arrival early (unless the other launch's
counts replace missing ones of its own with the same count and the same 64-bit
signature sum, a hash coincidence); it keeps waiting and leaves, without
arrival, when the host opens the gate.  While it waits the kernel cannot
complete, so its stream cannot start its next operation; launches on other
streams are held by their own holders.

What a short block can afford.  On the per-element shape (one element per
thread, a block lives about a microsecond) every instruction that the body's
first load or the block's end waits for lengthens each block's life and costs
bandwidth directly.  So the prologue is one weak load of the mirror that the
body does not wait for (a GPU-scope load per thread, which L1 does not serve,
sent every warp of the grid to the mirror's one L2 line: +56% on that shape on
the H200; served by L1 it costs nothing measurable), and everything else
happens at the exit.

Limits, stated once: the gate needs PTX targets sm_70 and newer (warp-level
count, `nanosleep`) and is left out below, where a spinning thread could starve
the rest of its warp; a thread (0,0,0) of block 0 that leaves through `exit`
inside a `.func` does not hold its launch (its launch is then counted at
entry); a launch that starts while a closed gate is being attached to its
module may hold without all its threads counting, and then waits until the gate
opens and leaves without arrival.  The hooks add one u32 register (the mirror
value) live across the kernel.

Store tracker.  Before every `st`, `atom` and `red` that may write global memory
(state space `.global`, or generic, which covers global), the address and
access size (type size x vector width) are passed, under the store's own
predicate, to `__concordia_track`, which marks every page of every registered
region that the byte range [addr, addr+nbytes) overlaps.  Generic addresses of
shared or local memory never fall inside a registered device allocation, so no
`isspacep` test is needed.  The region table is read through the non-coherent
path (the host writes it only between launches).  On sm_80 and newer, the
threads calling together group by bitmap word (`match.any`), OR their bits
(`redux.sync.or`) and one thread per word reads the word and issues a `red.or`
only when one of its bits is still clear: one bitmap word covers 32 pages, so
without that test every warp of the 128 blocks of a one-element-per-thread
kernel that write those pages hammered the one word (+474 % on the H200,
docs/results/instrument.md).  The read is a weak one, served by L1: within a
launch bits only go from 0 to 1 and L1 holds no line from before the launch
started, so a stale read can only miss a bit already set and cost a redundant
`red`, never skip one (the GPU-scope read it replaced cost 130 % per element
and 96 % grid-stride on the H200, the L1 read 114 % and 62 %).
Page indices use shifts when the page size is a power of two.  Bulk/tensor
copies into global memory (`cp.async.bulk`, `cp.reduce.async.bulk`,
`multimem`) cannot be tracked this way; they are counted as untracked.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field, replace

from concordia.instrument import ptx as P
from concordia.instrument.errors import InstrumentError

REWRITER_VERSION = 6            # bumped when the code inserted changes; in every result's JSON
MARK = "__concordia_"          # module-scope names
REG = "%__cnc_"                # registers we declare
LBL = "$__cnc_"                # labels we place

EPOCHS = MARK + "epochs"
SLOTS = MARK + "slots"
HOLD = MARK + "hold"
GATE = MARK + "gate"
NREGIONS = MARK + "nregions"
REGIONS = MARK + "regions"
TRACK = MARK + "track"
HOLD_SLOTS = 256               # hold slots (count, signature), by %gridid % HOLD_SLOTS
SIGN_MUL = "0x9E3779B97F4A7C15"  # odd multiplier of the launch signature (64-bit Fibonacci hashing)
GATE_STAMP_OFFSET = 24         # byte offset in a gate of the u64 %gridid of its stamp launch
REGION_WORDS = 4               # base, size, bitmap, page_bytes (u64 each)
MIRROR_DETACHED, MIRROR_OPEN, MIRROR_CLOSED = 0, 1, 2   # values of the `hold` mirror

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
            "rewriter_version": REWRITER_VERSION,
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
    nslots = len(entries)
    # activemask (6.2), nanosleep (6.3), scoped red/ld and bar.warp.sync (6.0), sm_70
    modern = header.sm >= 70 and header.version >= (6, 3)
    result = RewriteResult(ptx="", options=options, address_size=header.address_size,
                           target=header.target)
    func_exits = any(c.is_function and c.kind != "entry" and re.search(r"(^|[;{}\s])exit\s*;", c.body)
                     for c in chunks)
    # Below sm_70 a spinning holder could starve the rest of its warp, and
    # there is no warp-level count: no gate there.
    if not modern and options.pause_gate:
        options = replace(options, pause_gate=False)
        result.options = options
    ctx = _Ctx(options, header, symbols, modern, account_at_entry=func_exits and options.exit_hooks)
    out: list[str] = []
    slot = 0
    for k, ch in enumerate(chunks):
        if ch.is_function and ch.kind == "entry":
            info = KernelInfo(ch.name, slot, "entry")
            slot += 1
            out.append(ch.lead + _rewrite_function(ch, info, ctx))
            result.kernels.append(info)
        elif ch.is_function:
            info = KernelInfo(ch.name, -1, "func")   # a .func has no epoch slot
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
    account_at_entry: bool = False   # a .func calls `exit`: the launch is counted in the prologue


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
        f".visible .global .align 16 .u64 {SLOTS}[{2 * HOLD_SLOTS}];",
        f".visible .global .align 4 .u32 {HOLD};",
        f".visible .global .align 8 .u64 {GATE};",
    ]
    if ctx.options.track_stores:
        lines += [
            f".visible .global .align 4 .u32 {NREGIONS};",
            f".visible .global .align 8 .u64 {REGIONS}[{REGION_WORDS * ctx.options.max_regions}];",
            _track_function(a, ctx.header.sm >= 80 and ctx.modern),
        ]
    return "\n".join(lines)


def _page_bit(word: str) -> str:
    """PTX of the tracker: `word` = address of page %rd7's bitmap word (bitmap
    at %rd5), %r4 = its bit (%r3 scratch)."""
    return "\n\t".join([f"shr.u64 {word}, %rd7, 5;", f"shl.b64 {word}, {word}, 2;",
                         f"add.s64 {word}, %rd5, {word};", "cvt.u32.u64 %r3, %rd7;", "and.b32 %r3, %r3, 31;",
                         "mov.b32 %r4, 1;", "shl.b32 %r4, %r4, %r3;"])


def _track_function(address_size: int, aggregate: bool) -> str:
    """`__concordia_track(addr, nbytes)`: mark the pages of every registered region
    that [addr, addr+nbytes) overlaps.  Every thread that enters loops over the
    same regions, so the warp-synchronous steps see all of their mask."""
    load_regions = (f"mov.u64 %rd2, {REGIONS};" if address_size == 64 else
                    f"mov.u32 %r7, {REGIONS};\n\tcvt.u64.u32 %rd2, %r7;")
    if aggregate:
        prelude = "activemask.b32 %r8;\n\tmov.u32 %r9, %lanemask_lt;"
        mark_first = """match.any.sync.b64 %r10, %rd11, %r8;
	redux.sync.or.b32 %r11, %r4, %r10;
	and.b32 %r12, %r10, %r9;
	setp.eq.u32 %p1, %r12, 0;
	and.pred %p1, %p1, %p0;
	@%p1 ld.global.ca.u32 %r13, [%rd11];
	@%p1 and.b32 %r13, %r13, %r11;
	@%p1 setp.ne.u32 %p1, %r13, %r11;
	@%p1 red.global.or.b32 [%rd11], %r11;"""
    else:
        prelude = ""
        mark_first = "@%p0 red.global.or.b32 [%rd11], %r4;"
    return f"""
.func {TRACK}(.param .b64 {MARK}a, .param .b32 {MARK}n)
{{
	.reg .pred %p<4>;
	.reg .b32 %r<14>;
	.reg .b64 %rd<12>;
	ld.param.b64 %rd0, [{MARK}a];
	ld.param.b32 %r0, [{MARK}n];
	cvt.u64.u32 %rd1, %r0;
	add.s64 %rd1, %rd0, %rd1;
	{prelude}
	ld.global.nc.u32 %r1, [{NREGIONS}];
	mov.u32 %r2, 0;
	{load_regions}
$Lregion:
	setp.ge.u32 %p2, %r2, %r1;
	@%p2 bra $Ldone;
	ld.global.nc.u64 %rd3, [%rd2];
	ld.global.nc.u64 %rd4, [%rd2+8];
	ld.global.nc.u64 %rd5, [%rd2+16];
	ld.global.nc.u64 %rd6, [%rd2+24];
	add.s64 %rd4, %rd3, %rd4;
	setp.lt.u64 %p0, %rd0, %rd4;
	setp.gt.u64 %p1, %rd1, %rd3;
	and.pred %p0, %p0, %p1;
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
	bra $Lfirst;
$Ldivide:
	div.u64 %rd7, %rd7, %rd6;
	div.u64 %rd8, %rd8, %rd6;
$Lfirst:
	{_page_bit("%rd11")}
	@!%p0 mov.u64 %rd11, 0;
	@!%p0 mov.b32 %r4, 0;
	{mark_first}
	@!%p0 bra $Lnext;
$Lpage:
	add.s64 %rd7, %rd7, 1;
	setp.gt.u64 %p2, %rd7, %rd8;
	@%p2 bra $Lnext;
	{_page_bit("%rd9")}
	red.global.or.b32 [%rd9], %r4;
	bra $Lpage;
$Lnext:
	add.s32 %r2, %r2, 1;
	add.s64 %rd2, %rd2, {8 * REGION_WORDS};
	bra $Lregion;
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
    hook_exits = ctx.options.exit_hooks and (is_entry or (ctx.options.pause_gate and any(
        it.kind == "stmt" and it.parts[0] == "exit" for it in items)))
    out: list[str] = []
    prologue_done = not (is_entry and ctx.options.exit_hooks)
    for it in items:
        if it.kind != "stmt":
            if it.kind in ("label", "open") and not prologue_done:
                out.append(_prologue(info.index, ctx))
                prologue_done = True
            out.append(it.text)
            continue
        if not prologue_done and not _is_declaration(it):
            out.append(_prologue(info.index, ctx))
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
        out.append(_prologue(info.index, ctx))
    body = "".join(out)
    decls = ""
    if hook_exits:
        decls = (f"\n\t.reg .pred {REG}p<4>;\n\t.reg .b32 {REG}r<6>;\n\t.reg .b64 {REG}d<6>;"
                 f"\n\t.reg .b32 {REG}h;")
        body = body.rstrip() + "\n" + _exit_stub(info.index, is_entry, ctx) + "\n"
    return ch.head + "{" + decls + body + "}"


def _is_declaration(it: P.Item) -> bool:
    return it.opcode in (".reg", ".shared", ".local", ".param", ".pragma", ".loc", ".const", ".global")


def _regs() -> tuple[list[str], list[str], list[str]]:
    return ([f"{REG}r{i}" for i in range(6)], [f"{REG}d{i}" for i in range(6)],
            [f"{REG}p{i}" for i in range(4)])


def _prologue(slot: int, ctx: _Ctx) -> str:
    """Nothing here may hold the kernel body back: a short block lives about a
    microsecond, and every instruction that its first load has to wait for
    (special-register reads, a branch) lengthens its life.  So every thread only
    reads the gate's mirror, with a weak load (served by L1 after the first warp
    of an SM; a strong load sent every warp of the grid to the one L2 line of
    the mirror), which the body does not wait for.  The launch itself is
    counted at the exit by block 0's thread 0, except in a module where a
    `.func` calls `exit` (that thread might never reach the stub): there block
    0's thread 0 counts it here."""
    r, d, p = _regs()
    lines = []
    if ctx.options.pause_gate:
        lines.append(f"ld.global.ca.u32 {REG}h, [{HOLD}];")
    if ctx.account_at_entry:
        lines += _first_thread(r[0], r[1], p[0]) + [f"@!{p[0]} bra {LBL}go;"]
        lines += _count_launch(slot) + [f"{LBL}go:"]
    if not lines:
        return ""
    return "\n" + "\n".join(_indent(lines)) + "\n\t"


def _count_launch(slot: int) -> list[str]:
    """Block 0's thread 0 counts one more launch of this kernel."""
    return [f"red.global.add.u64 [{EPOCHS}+{8 * slot}], 1;"]


def _or_of(r0: str, r1: str, sregs: tuple, p: str, test: str) -> list[str]:
    """`p` = (the OR of the special registers `sregs`) `test` 0 ("eq" or "ne")."""
    lines = [f"mov.u32 {r0}, {sregs[0]};"]
    for sreg in sregs[1:]:
        lines += [f"mov.u32 {r1}, {sreg};", f"or.b32 {r0}, {r0}, {r1};"]
    return lines + [f"setp.{test}.u32 {p}, {r0}, 0;"]


_TID = ("%tid.x", "%tid.y", "%tid.z")
_CTAID = ("%ctaid.x", "%ctaid.y", "%ctaid.z")   # all zero in block 0 only (block-uniform)


def _first_thread(r0: str, r1: str, p: str) -> list[str]:
    """`p` = this is thread (0,0,0) of block (0,0,0)."""
    return _or_of(r0, r1, _TID + _CTAID, p, "eq")


def _indent(lines: list[str]) -> list[str]:
    return [ln if ln.startswith(LBL) else "\t" + ln for ln in lines]


def _slot(gid: str, r: list[str], d: list[str], a64: bool) -> tuple[list[str], str]:
    """The address of the hold slot of the launch whose `%gridid` is in `gid`:
    SLOTS + 16 * (gid % HOLD_SLOTS)."""
    lines = [f"cvt.u32.u64 {r[5]}, {gid};", f"and.b32 {r[5]}, {r[5]}, {HOLD_SLOTS - 1};"]
    if a64:
        return lines + [f"mul.wide.u32 {d[1]}, {r[5]}, 16;", f"mov.u64 {d[0]}, {SLOTS};",
                        f"add.s64 {d[1]}, {d[1]}, {d[0]};"], d[1]
    return lines + [f"shl.b32 {r[5]}, {r[5]}, 4;", f"mov.u32 {r[4]}, {SLOTS};",
                    f"add.u32 {r[5]}, {r[5]}, {r[4]};"], r[5]


def _signature(gid: str, out: str) -> list[str]:
    """`out` = the launch's signature, an odd 64-bit hash of its `%gridid`."""
    return [f"mul.lo.u64 {out}, {gid}, {SIGN_MUL};", f"or.b64 {out}, {out}, 1;"]


def _exit_stub(slot: int, is_entry: bool, ctx: _Ctx) -> str:
    """The common exit of an entry (`ret`) or of a `.func` that calls `exit`.
    Threads that started with the gate closed count themselves into their
    launch's hold slot (the group's count and count x signature, both GPU-scope
    releases after the group's writes); then block 0's thread 0 counts the
    launch and, with the gate closed, offers it to the gate."""
    r, d, p = _regs()
    a64 = ctx.header.address_size == 64
    lines = [f"{LBL}exit:"]
    if ctx.options.pause_gate:
        if not is_entry:
            lines.append(f"ld.global.ca.u32 {REG}h, [{HOLD}];")
            lines += [f"setp.le.u32 {p[3]}, {REG}h, {MIRROR_OPEN};", f"@{p[3]} bra {LBL}counted;"]
        else:
            # the common path, a block other than 0 with the gate not closed, leaves on one branch
            # (p0 = not block 0 stays set for _block_zero_tail)
            lines += _or_of(r[3], r[4], _CTAID, p[0], "ne") + [
                f"setp.le.u32 {p[3]}, {REG}h, {MIRROR_OPEN};", f"and.pred {p[2]}, {p[0]}, {p[3]};",
                f"@{p[2]} bra {LBL}done;", f"@{p[3]} bra {LBL}counted;"]
        lines.append(f"mov.u64 {d[3]}, %gridid;")
        place, where = _slot(d[3], r, d, a64)
        lines += place + _signature(d[3], d[4]) + [
            f"activemask.b32 {r[0]};",
            f"popc.b32 {r[1]}, {r[0]};",
            f"cvt.u64.u32 {d[2]}, {r[1]};",
            f"mov.u32 {r[2]}, %lanemask_lt;",
            f"and.b32 {r[2]}, {r[2]}, {r[0]};",
            f"setp.eq.u32 {p[1]}, {r[2]}, 0;",            # the group's lowest lane counts it
            f"mul.lo.u64 {d[4]}, {d[4]}, {d[2]};",
            f"bar.warp.sync {r[0]};",                     # the group's writes before the leader's release
            f"@{p[1]} red.release.gpu.global.add.u64 [{where}+8], {d[4]};",
            f"@{p[1]} red.release.gpu.global.add.u64 [{where}], {d[2]};",
            f"{LBL}counted:",
        ]
    if is_entry:
        lines += _block_zero_tail(slot, r, d, p, a64, ctx)
    lines += [f"{LBL}done:", "ret;" if is_entry else "exit;"]
    return "\n".join(_indent(lines))


def _block_zero_tail(slot: int, r: list[str], d: list[str], p: list[str], a64: bool,
                     ctx: _Ctx) -> list[str]:
    """Thread (0,0,0) of block 0 counts the launch (unless the prologue did)
    and offers it to the gate.  Every other block leaves on the first test,
    which reads only block-uniform registers."""
    if ctx.account_at_entry and not ctx.options.pause_gate:
        return []
    # with the gate, the stub computed p0 = (not block 0) before counting
    lines = [] if ctx.options.pause_gate else _or_of(r[3], r[4], _CTAID, p[0], "ne")
    lines += [f"@{p[0]} bra {LBL}done;", *_or_of(r[0], r[1], _TID, p[0], "ne"), f"@{p[0]} bra {LBL}done;"]
    if not ctx.account_at_entry:
        lines += _count_launch(slot)
    if ctx.options.pause_gate:
        lines += _gate_hold(r, d, p, a64)
    return lines


def _gate_hold(r: list[str], d: list[str], p: list[str], a64: bool) -> list[str]:
    """Block 0's thread 0, when the gate was closed at entry and still is, and
    its launch was submitted after the gate's stamp (so every thread of it read
    the mirror closed and counts itself): wait until the launch's slot holds
    its whole thread count with its signature, then report arrival and wait for
    the host to open the gate.  If the host opens the gate first (it gave up
    waiting), leave without reporting arrival."""
    place, where = _slot(d[2], r, d, a64)
    return [
        f"setp.le.u32 {p[0]}, {REG}h, {MIRROR_OPEN};",   # not closed at entry
        f"@{p[0]} bra {LBL}done;",
        f"ld.global.u64 {d[3]}, [{GATE}];",
        f"setp.eq.u64 {p[0]}, {d[3]}, 0;",
        f"@{p[0]} bra {LBL}done;",
        f"ld.volatile.global.u32 {r[0]}, [{d[3]}];",
        f"setp.eq.u32 {p[0]}, {r[0]}, 0;",
        f"@{p[0]} bra {LBL}done;",
        f"mov.u64 {d[2]}, %gridid;",
        f"ld.volatile.global.u64 {d[5]}, [{d[3]}+{GATE_STAMP_OFFSET}];",
        f"setp.le.u64 {p[0]}, {d[2]}, {d[5]};",          # submitted before the stamp: may straddle
        f"@{p[0]} bra {LBL}done;",
        f"mov.u32 {r[0]}, %nctaid.x;", f"mov.u32 {r[1]}, %nctaid.y;", f"mul.wide.u32 {d[0]}, {r[0]}, {r[1]};",
        f"mov.u32 {r[0]}, %nctaid.z;", f"cvt.u64.u32 {d[1]}, {r[0]};", f"mul.lo.u64 {d[0]}, {d[0]}, {d[1]};",
        f"mov.u32 {r[0]}, %ntid.x;", f"mov.u32 {r[1]}, %ntid.y;", f"mul.lo.u32 {r[0]}, {r[0]}, {r[1]};",
        f"mov.u32 {r[1]}, %ntid.z;", f"mul.lo.u32 {r[0]}, {r[0]}, {r[1]};", f"cvt.u64.u32 {d[1]}, {r[0]};",
        f"mul.lo.u64 {d[5]}, {d[0]}, {d[1]};",            # d5 = threads of the launch
        *_signature(d[2], d[4]),
        f"mul.lo.u64 {d[4]}, {d[4]}, {d[5]};",            # d4 = their signature sum
        *place,
        f"mov.u64 {d[0]}, {d[5]};",                       # d0 = threads (after `place`, which uses it)
        f"{LBL}drain:",
        f"ld.relaxed.gpu.global.u64 {d[5]}, [{where}];",
        f"setp.ne.u64 {p[0]}, {d[5]}, {d[0]};",
        f"@{p[0]} bra {LBL}asked;",
        f"ld.relaxed.gpu.global.u64 {d[5]}, [{where}+8];",
        f"setp.eq.u64 {p[0]}, {d[5]}, {d[4]};",
        f"@{p[0]} bra {LBL}drained;",
        f"{LBL}asked:",
        f"ld.volatile.global.u32 {r[0]}, [{d[3]}];",
        f"setp.eq.u32 {p[0]}, {r[0]}, 0;",
        f"@{p[0]} bra {LBL}done;",                        # opened before arrival: leave
        "nanosleep.u32 500;",
        f"bra {LBL}drain;",
        f"{LBL}drained:",
        "fence.acq_rel.gpu;",
        "fence.acq_rel.sys;",
        f"mov.u32 {r[2]}, 1;",
        f"st.volatile.global.u32 [{d[3]}+4], {r[2]};",
        f"{LBL}wait:",
        f"ld.volatile.global.u32 {r[0]}, [{d[3]}];",
        f"setp.eq.u32 {p[0]}, {r[0]}, 0;",
        f"@{p[0]} bra {LBL}done;",
        "nanosleep.u32 1000;",
        f"bra {LBL}wait;",
    ]


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
