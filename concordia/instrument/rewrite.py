"""The PTX rewriter: exit hooks, a pause gate and an optional store tracker,
inserted into every kernel of a module without changing any kernel signature.

What the host sees (module-scope `.visible .global` variables, read and filled
through cuModuleGetGlobal / CuPy `RawModule.get_global`; all start at zero):

  __concordia_epochs   .u64[K]    launches of kernel k counted: block 0's thread 0
                                  counts its launch once, at its exit (at entry in a
                                  module where a `.func` calls `exit`)
  __concordia_targets  .u64[K]    for kernel k's latest counted launch: the value of
                                  `expect` once that launch was counted in it
  __concordia_expect   .u64       threads of all launches counted in this module
  __concordia_exits    .u64[64*16] threads counted, spread over 64 counters, one per
                                  128-byte line (stripe = (%ctaid.x + %ctaid.y +
                                  %ctaid.z) % 64)
  __concordia_hold     .u32       the gate's device-side mirror (read once per thread,
                                  at entry, with a weak load): 0 = no gate attached,
                                  1 = attached and open, 2 = closed
  __concordia_gate     .u64       device address of a gate, 0 = no gate.  A gate is
                                  two u32 words in mapped pinned host memory: word 0
                                  written by the host (non-zero = hold), word 1 set
                                  to 1 by the GPU when a launch is held.
  __concordia_nregions .u32       store tracker: number of regions in use
  __concordia_regions  .u64[4*R]  store tracker: per region base, size,
                                  bitmap address (u32 words, bit p%32 of word p/32
                                  = page p), page_bytes

Threads are counted (into `exits`, `expect` and `targets`) only while a gate is
attached, in a module built with the gate: nothing but a hold needs the
per-thread counts, and without them the exit of a thread not in block 0 is a
test of the mirror.  Every thread of one launch must see the same answer
(attached or not), so `runtime.attach` changes it for a module that may have
launches in flight only after synchronising the device; open and closed may
change under a running launch (both count).  A module built without the gate
always counts.

Completed launches are computed by the host: with E = sum(exits), kernel k has
completed epochs[k] launches, less one while targets[k] > E (its latest counted
launch still has threads running).  When no launch of the module is in flight E
equals `expect` and the count is exact; while one is held at the gate its holder
has counted it and waited for E to reach its target, so the held launch counts
as completed.

What a short block can afford.  On the per-element shape (one element per
thread, a block lives about a microsecond) every instruction that the body's
first load or the block's end waits for lengthens each block's life and costs
bandwidth directly.  So the prologue is one weak load of the mirror that the
body does not wait for (a GPU-scope load per thread, which L1 does not serve,
sent every warp of the grid to the mirror's one L2 line: +56% on that shape on
the H200; served by L1 it costs nothing measurable), and everything else
happens at the exit.

Exit hook, common path (`count_at="exit"`, the default).  Every `ret`/`exit`
of an entry (predicated or not, however many) becomes a branch to one stub at
the end of the body; falling off the end reaches it as well, so every thread
passes the stub exactly once.  The stub counts threads, not blocks, so no thread
has to know it is the last of its block: the threads that reach the stub
together (`activemask`) are counted by the lowest of them with one `red.add` of
the group's size, without a return value, into the counter of its block's
stripe.  Threads that arrive in several groups (divergent exits, predicated
exits, exits at different points) form disjoint masks: each thread executes
`activemask` once and every thread of one execution gets the same mask, so the
popcounts sum to the threads that left.  There is no barrier, no shared memory
and no atomic with a return value on the common path.  Then every block other
than block 0 leaves on a test of block-uniform registers; block 0's thread 0
adds the launch's thread count to `expect` (one atomic per launch), records the
target and counts the launch in `epochs`.

Counting once per block instead (one barrier at the exit, then one `red` by
thread (0,0,0), in modules without barriers or warp-synchronous code) and
without a barrier (a tagged shared-memory counter) were built and measured on
the H200 and removed: the barrier cost what the saved `red`s did, the 128-bit
shared CAS far more (docs/results/instrument.md).

Counting at entry (`count_at="entry"`, measured beside the default).  Threads
that start with the gate attached and open are counted at entry by their group's leader,
so the exit has no memory operation unless a hold was requested; the mirror's
value is then needed before the body, and a module with a `.func` that calls
`exit` gets no gate (a hold would wait for a thread counted nowhere).

Pause gate.  A launch is held by block 0's thread 0 at its exit: while it waits
the kernel cannot complete, so the stream cannot start its next operation.  It
holds only when the gate was closed both when it started (the `hold` mirror,
which `Gate.close()` writes into every attached module before it closes the
host word) and when it exits (the host word, read over PCIe once per launch, and
only when the mirror said closed).  Before it reports arrival it waits until
the counters reach its target: every thread of its launch (and of every
launch of the module counted before it) has left.  The ordering that makes the
launch's writes visible at that point: while the mirror says closed, each counting
group first synchronises (`bar.warp.sync`, which orders the group's writes
before the leader's), and the leader's `red` is a GPU-scope release; the holder
reads the counters and then fences (acquire) before it writes the arrival flag
at system scope.  With the gate open the counting `red` is relaxed: nothing waits
on it, and the host reads counters only after synchronising with the stream.
The mirror is read with a weak load: a launch sees the value written before it
started (`Gate.close()` completes its copies before it sets the host word).

Limits, stated once: the hook needs PTX targets sm_70 and newer for the
warp-level count (older targets count each thread with its own `red`) and the
gate is left out below sm_70, where a spinning thread could starve the rest of
its warp; a thread (0,0,0) of block 0 that leaves through `exit` inside a
`.func` does not hold its launch (its launch is then counted at entry); two
launches of one module running at once on different streams make the target
test (and the in-flight correction of `epochs`) approximate, since the counters
are module-wide; a launch that was already running when the gate closed is held
only if block 0 read the mirror after it was set, and then the warps that read
it earlier counted with relaxed `red`s; a gate attached from one thread while
another launches into the module may see threads of one launch disagree on
whether they count.  The hooks add one u32 register (the
mirror value) live across the kernel.

Store tracker.  Before every `st`, `atom` and `red` that may write global memory
(state space `.global`, or generic, which covers global), the address and
access size (type size x vector width) are passed, under the store's own
predicate, to `__concordia_track`, which marks every page of every registered
region that the byte range [addr, addr+nbytes) overlaps.  Generic addresses of
shared or local memory never fall inside a registered device allocation, so no
`isspacep` test is needed.  The region table is read through the non-coherent
path (the host writes it only between launches).  On sm_80 and newer, the
threads calling together group by bitmap word (`match.any`), OR their bits
(`redux.sync.or`) and one thread per word reads the word (GPU scope, so it sees
other SMs' marks) and issues a `red.or` only when one of its bits is still
clear: one bitmap word covers 32 pages, so without that test every warp of the
128 blocks of a one-element-per-thread kernel that write those pages hammered
the one word (+474 % on the H200, docs/results/instrument.md).  A stale read
only costs a redundant `red`.
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

REWRITER_VERSION = 5            # bumped when the code inserted changes; in every result's JSON
MARK = "__concordia_"          # module-scope names
REG = "%__cnc_"                # registers we declare
LBL = "$__cnc_"                # labels we place

EPOCHS = MARK + "epochs"
TARGETS = MARK + "targets"
EXPECT = MARK + "expect"
EXITS = MARK + "exits"
HOLD = MARK + "hold"
GATE = MARK + "gate"
NREGIONS = MARK + "nregions"
REGIONS = MARK + "regions"
TRACK = MARK + "track"
STRIPES = 64                   # exit counters, one per 128-byte line
STRIPE_WORDS = 16              # u64 words per stripe
REGION_WORDS = 4               # base, size, bitmap, page_bytes (u64 each)
COUNT_AT = ("exit", "entry")
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
    count_at: str = "exit"     # where threads are counted: "exit" or "entry" (see above)


@dataclass
class KernelInfo:
    name: str
    index: int
    kind: str               # "entry" | "func"
    exit_sites: int = 0     # ret/exit statements rerouted through the hook
    counted_by: str = ""    # how its threads are counted: "group", "thread" (at the exit) or "entry"
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
    if options.count_at not in COUNT_AT:
        raise InstrumentError(f"count_at {options.count_at!r} is not one of {', '.join(COUNT_AT)}",
                              where="Options")
    func_exits = any(c.is_function and c.kind != "entry" and re.search(r"(^|[;{}\s])exit\s*;", c.body)
                     for c in chunks)
    # Counting at entry leaves a .func's `exit` unhooked; a hold would wait for
    # a thread counted nowhere, so such a module gets no gate.
    if (not modern or (func_exits and options.count_at == "entry")) and options.pause_gate:
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
        f".visible .global .align 8 .u64 {TARGETS}[{nslots}];",
        f".visible .global .align 8 .u64 {EXPECT};",
        f".visible .global .align 128 .u64 {EXITS}[{STRIPES * STRIPE_WORDS}];",
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
	@%p1 ld.relaxed.gpu.global.u32 %r13, [%rd11];
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
    hook_exits = ctx.options.exit_hooks and (is_entry or (ctx.options.count_at == "exit" and any(
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
                 f"\n\t.reg .b32 {REG}h;\n\t.reg .pred {REG}pc;")
        body = body.rstrip() + "\n" + _exit_stub(info.index, is_entry, ctx) + "\n"
        info.counted_by = "entry" if ctx.options.count_at == "entry" else "group" if ctx.modern else "thread"
    return ch.head + "{" + decls + body + "}"


def _is_declaration(it: P.Item) -> bool:
    return it.opcode in (".reg", ".shared", ".local", ".param", ".pragma", ".loc", ".const", ".global")


def _stripe(r: list[str], d: list[str], a64: bool) -> tuple[list[str], str]:
    """r3 = %ctaid.x + %ctaid.y + %ctaid.z (zero in block 0 only; uniform over
    the block, so read on the uniform datapath) and the address of the block's
    counter, EXITS + 128 * (r3 % 64): blocks that run at once spread over the
    64 lines."""
    lines = _block_sum(r) + [f"and.b32 {r[5]}, {r[3]}, {STRIPES - 1};"]
    if a64:
        return lines + [f"mul.wide.u32 {d[0]}, {r[5]}, {8 * STRIPE_WORDS};", f"mov.u64 {d[1]}, {EXITS};",
                        f"add.s64 {d[0]}, {d[0]}, {d[1]};"], d[0]
    return lines + [f"mov.u32 {r[4]}, {EXITS};",
                    f"mad.lo.u32 {r[5]}, {r[5]}, {8 * STRIPE_WORDS}, {r[4]};"], r[5]


def _block_sum(r: list[str]) -> list[str]:
    return [f"mov.u32 {r[3]}, %ctaid.x;", f"mov.u32 {r[4]}, %ctaid.y;", f"add.u32 {r[3]}, {r[3]}, {r[4]};",
            f"mov.u32 {r[4]}, %ctaid.z;", f"add.u32 {r[3]}, {r[3]}, {r[4]};"]


def _regs() -> tuple[list[str], list[str], list[str]]:
    return ([f"{REG}r{i}" for i in range(6)], [f"{REG}d{i}" for i in range(6)],
            [f"{REG}p{i}" for i in range(4)])


def _prologue(slot: int, ctx: _Ctx) -> str:
    """Nothing here may hold the kernel body back: a short block lives about a
    microsecond, and every instruction that its first load has to wait for
    (special-register reads, a branch) lengthens its life.  So every thread only
    reads the gate's mirror, with a weak load (served by L1 after the first warp
    of an SM; a strong load sent every warp of the grid to the one L2 line of
    the mirror), which the body does not wait for.  Counting at entry, the
    threads not asked to hold are counted here by their group's leader.  The
    launch itself is counted at the exit by block 0's thread 0, except in a
    module where a `.func` calls `exit` (that thread might never reach the
    stub): there block 0's thread 0 counts it here."""
    r, d, p = _regs()
    pc = f"{REG}pc"
    lines = []
    if ctx.options.pause_gate:
        lines.append(f"ld.global.ca.u32 {REG}h, [{HOLD}];")
    if ctx.options.count_at == "entry":
        # pc = a gate attached and open: counted here, not at the exit (none
        # counts while no gate is attached; with the gate closed, at the exit)
        lines.append(f"setp.eq.u32 {pc}, {REG}h, {MIRROR_OPEN};" if ctx.options.pause_gate
                     else f"setp.eq.u32 {pc}, 0, 0;")
        stripe, where = _stripe(r, d, ctx.header.address_size == 64)
        lines += stripe
        if ctx.modern:
            lines.append(f"activemask.b32 {r[0]};")
            if ctx.options.pause_gate:
                lines.append(f"vote.sync.ballot.b32 {r[0]}, {pc}, {r[0]};")
            lines += [f"popc.b32 {r[1]}, {r[0]};", f"cvt.u64.u32 {d[2]}, {r[1]};",
                      f"mov.u32 {r[2]}, %lanemask_lt;", f"and.b32 {r[2]}, {r[2]}, {r[0]};",
                      f"setp.eq.u32 {p[1]}, {r[2]}, 0;", f"and.pred {p[1]}, {p[1]}, {pc};",
                      f"@{p[1]} red.relaxed.gpu.global.add.u64 [{where}], {d[2]};"]
        else:
            lines.append(f"red.global.add.u64 [{where}], 1;")
    if ctx.account_at_entry:
        lines += _first_thread(r[0], r[1], p[0]) + [f"@!{p[0]} bra {LBL}go;"]
        lines += _count_launch(slot, r, d, p, ctx) + [f"{LBL}go:"]
    if not lines:
        return ""
    return "\n" + "\n".join(_indent(lines)) + "\n\t"


def _count_launch(slot: int, r: list[str], d: list[str], p: list[str], ctx: _Ctx) -> list[str]:
    """Block 0's thread 0 counts its launch: the launch's thread count into
    `expect` and the resulting target (only while its threads are counted: in
    a module built with the gate, only while a gate is attached), and one more
    launch of this kernel."""
    r0, r1, d0, d1, d2 = r[0], r[1], d[0], d[1], d[2]
    skip = ([f"setp.eq.u32 {p[3]}, {REG}h, {MIRROR_DETACHED};", f"@{p[3]} bra {LBL}uncounted;"]
            if ctx.options.pause_gate else [])
    return skip + [
        f"mov.u32 {r0}, %nctaid.x;", f"mov.u32 {r1}, %nctaid.y;", f"mul.wide.u32 {d0}, {r0}, {r1};",
        f"mov.u32 {r0}, %nctaid.z;", f"cvt.u64.u32 {d1}, {r0};", f"mul.lo.u64 {d0}, {d0}, {d1};",
        f"mov.u32 {r0}, %ntid.x;", f"mov.u32 {r1}, %ntid.y;", f"mul.lo.u32 {r0}, {r0}, {r1};",
        f"mov.u32 {r1}, %ntid.z;", f"mul.lo.u32 {r0}, {r0}, {r1};", f"cvt.u64.u32 {d1}, {r0};",
        f"mul.lo.u64 {d0}, {d0}, {d1};",
        f"atom.global.add.u64 {d2}, [{EXPECT}], {d0};",
        f"add.s64 {d2}, {d2}, {d0};",
        f"st.global.u64 [{TARGETS}+{8 * slot}], {d2};",
        *([f"{LBL}uncounted:"] if skip else []),
        f"red.global.add.u64 [{EPOCHS}+{8 * slot}], 1;",
    ]


def _or_of(r0: str, r1: str, sregs: tuple, p: str, test: str) -> list[str]:
    """`p` = (the OR of the special registers `sregs`) `test` 0 ("eq" or "ne")."""
    lines = [f"mov.u32 {r0}, {sregs[0]};"]
    for sreg in sregs[1:]:
        lines += [f"mov.u32 {r1}, {sreg};", f"or.b32 {r0}, {r0}, {r1};"]
    return lines + [f"setp.{test}.u32 {p}, {r0}, 0;"]


_TID = ("%tid.x", "%tid.y", "%tid.z")


def _first_thread(r0: str, r1: str, p: str) -> list[str]:
    """`p` = this is thread (0,0,0) of block (0,0,0)."""
    return _or_of(r0, r1, _TID + ("%ctaid.x", "%ctaid.y", "%ctaid.z"), p, "eq")


def _indent(lines: list[str]) -> list[str]:
    return [ln if ln.startswith(LBL) else "\t" + ln for ln in lines]


def _exit_stub(slot: int, is_entry: bool, ctx: _Ctx) -> str:
    """The common exit of an entry (`ret`) or, counting at the exit, of a
    `.func` that calls `exit`."""
    r, d, p = _regs()
    a64 = ctx.header.address_size == 64
    if ctx.options.count_at == "entry":
        return "\n".join(_indent(_entry_counted_exit(slot, r, d, p, a64, ctx)))
    stripe, where = _stripe(r, d, a64)
    lines = [f"{LBL}exit:"] + stripe
    gated = is_entry and ctx.options.pause_gate
    if ctx.options.pause_gate:
        # no gate attached (mirror 0, the same for the whole launch): nothing counts
        if not is_entry:
            lines.append(f"ld.global.ca.u32 {REG}h, [{HOLD}];")
        lines += [f"setp.eq.u32 {p[3]}, {REG}h, 0;", f"@{p[3]} bra {LBL}counted;"]
    if not ctx.modern:
        # no warp-level count below sm_70: each thread counts itself
        lines.append(f"red.global.add.u64 [{where}], 1;")
    else:
        lines += [
            f"activemask.b32 {r[0]};",
            f"popc.b32 {r[1]}, {r[0]};",
            f"cvt.u64.u32 {d[2]}, {r[1]};",
            f"mov.u32 {r[2]}, %lanemask_lt;",
            f"and.b32 {r[2]}, {r[2]}, {r[0]};",
            f"setp.eq.u32 {p[1]}, {r[2]}, 0;",            # the group's lowest lane counts it
        ]
        if gated:
            lines += [f"setp.gt.u32 {p[2]}, {REG}h, {MIRROR_OPEN};",         # closed at some thread's entry
                      f"vote.sync.any.pred {p[2]}, {p[2]}, {r[0]};",   # one choice per group
                      f"@!{p[2]} bra {LBL}relaxed;"]
        if not is_entry or gated:
            # ordered: the group's writes before the leader's release at GPU scope
            lines += [f"bar.warp.sync {r[0]};",
                      f"@{p[1]} red.release.gpu.global.add.u64 [{where}], {d[2]};"]
        if gated:
            lines += [f"bra {LBL}counted;", f"{LBL}relaxed:"]
        if is_entry:
            lines.append(f"@{p[1]} red.relaxed.gpu.global.add.u64 [{where}], {d[2]};")
    if ctx.options.pause_gate:
        lines.append(f"{LBL}counted:")
    if is_entry:
        lines += _block_zero_tail(slot, r, d, p, a64, ctx, have_block_sum=True)
    lines += [f"{LBL}done:", "ret;" if is_entry else "exit;"]
    return "\n".join(_indent(lines))


def _entry_counted_exit(slot: int, r: list[str], d: list[str], p: list[str], a64: bool,
                        ctx: _Ctx) -> list[str]:
    """Counting at entry: the exit counts only the threads that started while a
    hold was requested, after their writes, and then leaves block 0's thread 0
    to count the launch and to offer it to the gate."""
    lines = [f"{LBL}exit:"]
    if ctx.options.pause_gate:
        stripe, where = _stripe(r, d, a64)
        lines += [
            f"activemask.b32 {r[0]};",
            f"setp.gt.u32 {p[3]}, {REG}h, {MIRROR_OPEN};",       # started with the gate closed
            f"vote.sync.ballot.b32 {r[1]}, {p[3]}, {r[0]};",     # the group's threads still to count
            f"setp.eq.u32 {p[2]}, {r[1]}, 0;",
            f"@{p[2]} bra {LBL}counted;",
            f"bar.warp.sync {r[0]};",                            # their writes before the leader's release
            *stripe,
            f"popc.b32 {r[2]}, {r[1]};",
            f"cvt.u64.u32 {d[2]}, {r[2]};",
            f"mov.u32 {r[2]}, %lanemask_lt;",
            f"and.b32 {r[2]}, {r[2]}, {r[1]};",
            f"setp.eq.u32 {p[1]}, {r[2]}, 0;",
            f"and.pred {p[1]}, {p[1]}, {p[3]};",
            f"@{p[1]} red.release.gpu.global.add.u64 [{where}], {d[2]};",
            f"{LBL}counted:",
        ]
    lines += _block_zero_tail(slot, r, d, p, a64, ctx, have_block_sum=False)
    return lines + [f"{LBL}done:", "ret;"]


def _block_zero_tail(slot: int, r: list[str], d: list[str], p: list[str], a64: bool, ctx: _Ctx,
                     have_block_sum: bool) -> list[str]:
    """After its own count, thread (0,0,0) of block 0 counts the launch (unless
    the prologue did) and offers it to the gate.  Every other block leaves on
    the first test, which reads only block-uniform registers."""
    if ctx.account_at_entry and not ctx.options.pause_gate:
        return []
    lines = [] if have_block_sum else _block_sum(r)
    lines += [f"setp.ne.u32 {p[0]}, {r[3]}, 0;", f"@{p[0]} bra {LBL}done;",
              *_or_of(r[0], r[1], _TID, p[0], "ne"), f"@{p[0]} bra {LBL}done;"]
    if not ctx.account_at_entry:
        lines += _count_launch(slot, r, d, p, ctx)
    if ctx.options.pause_gate:
        lines += _gate_hold(slot, r, d, p, a64, ctx)
    return lines


def _gate_hold(slot: int, r: list[str], d: list[str], p: list[str], a64: bool, ctx: _Ctx) -> list[str]:
    """Block 0's thread 0, when the gate was closed at entry and still is: wait
    until every thread counted up to this launch's target has left, then report
    arrival and wait for the host to open the gate."""
    sum_addr = (f"mov.u64 {d[1]}, {EXITS};" if a64 else
                f"mov.u32 {r[4]}, {EXITS};\n\tcvt.u64.u32 {d[1]}, {r[4]};")
    lines = [
        f"setp.le.u32 {p[0]}, {REG}h, {MIRROR_OPEN};",   # no gate attached, or open at entry
        f"@{p[0]} bra {LBL}done;",
        f"ld.global.u64 {d[3]}, [{GATE}];",
        f"setp.eq.u64 {p[0]}, {d[3]}, 0;",
        f"@{p[0]} bra {LBL}done;",
        f"ld.volatile.global.u32 {r[0]}, [{d[3]}];",
        f"setp.eq.u32 {p[0]}, {r[0]}, 0;",
        f"@{p[0]} bra {LBL}done;",
        f"ld.global.u64 {d[4]}, [{TARGETS}+{8 * slot}];",
        f"{LBL}drain:",
        f"mov.u64 {d[2]}, 0;",
        sum_addr,
        f"mov.u32 {r[2]}, 0;",
        f"{LBL}sum:",
        f"ld.relaxed.gpu.global.u64 {d[5]}, [{d[1]}];",
        f"add.s64 {d[2]}, {d[2]}, {d[5]};",
        f"add.s64 {d[1]}, {d[1]}, {8 * STRIPE_WORDS};",
        f"add.u32 {r[2]}, {r[2]}, 1;",
        f"setp.lt.u32 {p[0]}, {r[2]}, {STRIPES};",
        f"@{p[0]} bra {LBL}sum;",
        f"setp.ge.u64 {p[0]}, {d[2]}, {d[4]};",
        f"@{p[0]} bra {LBL}drained;",
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
    return lines


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
