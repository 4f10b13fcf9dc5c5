"""A PTX reader just deep enough to rewrite kernels: module header, top-level
chunks, functions, and the statements inside a function body.

PTX from nvcc, NVRTC (CuPy) and Triton's LLVM back end share one shape: a
header (`.version`, `.target`, `.address_size`), module-scope declarations, and
functions `[.visible|.weak|.extern] (.entry|.func) name (params) [directives]
{ body }`.  A body is a brace-nested sequence of declarations (`.reg`, `.shared`,
`.local`, `.param`), labels (`name:`), and instructions
`[@[!]pred] opcode.mod.mod operands;`.  Nested `{ }` scopes come from calls and
inline assembly.  Nothing here needs one statement per line.

Comments are removed first (keeping newlines, and leaving quoted strings such as
`.file 1 "a//b.cu"` alone); the rewriter emits the comment-free text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from concordia.instrument.errors import InstrumentError

_IDENT = r"[A-Za-z_$%][\w$]*"
_LABEL = re.compile(r"\s*(" + _IDENT + r")\s*:(?!:)")
_PRED = re.compile(r"\s*@\s*(!?)\s*(" + _IDENT + r")\s+")
_OPCODE = re.compile(r"\s*([A-Za-z_][\w.:]*)")
_FUNC_HEAD = re.compile(r"\.(entry|func)\b")
_NAME_AFTER_PARAMS = re.compile(r"(" + _IDENT + r")\s*\(")


def strip_comments(text: str) -> str:
    """Remove // and /* */ comments; newlines inside block comments are kept so
    positions by line stay meaningful, and quoted strings are left intact."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise InstrumentError("unterminated /* comment", where=f"PTX line {text.count(chr(10), 0, i) + 1}")
            out.append("\n" * text.count("\n", i, j))
            i = j + 2
        else:
            j = i
            while j < n and text[j] not in '"/':
                j += 1
            if j == i:  # a lone '/' (division never appears, but be safe)
                j = i + 1
            out.append(text[i:j])
            i = j
    return "".join(out)


@dataclass
class Chunk:
    """One top-level item: a directive or declaration ending in ';', or a
    function with a body.  `text` runs from the item's first non-blank
    character to its terminator inclusive; `lead` is the whitespace before."""

    lead: str
    text: str
    is_function: bool = False
    kind: str = ""  # "entry" | "func" for functions
    name: str = ""
    head: str = ""  # text before the body's '{'
    body: str = ""  # text between the outer braces


def split_top_level(text: str) -> list[Chunk]:
    """Split comment-free PTX into top-level chunks."""
    chunks: list[Chunk] = []
    i, n = 0, len(text)
    while i < n:
        j = i
        while j < n and text[j].isspace():
            j += 1
        lead = text[i:j]
        if j >= n:
            if lead:
                chunks.append(Chunk(lead=lead, text=""))
            break
        start = j
        line_end = _line_directive_end(text, j)
        if line_end >= 0:
            chunks.append(Chunk(lead=lead, text=text[start:line_end]))
            i = line_end
            continue
        paren = brace = 0
        body_open = -1
        while j < n:
            c = text[j]
            if c == '"':
                k = text.find('"', j + 1)
                j = n if k < 0 else k + 1
                continue
            if c == "(":
                paren += 1
            elif c == ")":
                paren -= 1
            elif c == "{":
                if brace == 0 and paren == 0:
                    body_open = j
                brace += 1
            elif c == "}":
                brace -= 1
                if brace < 0:
                    raise InstrumentError("unbalanced '}'", where=_where(text, j))
                if brace == 0 and paren == 0:
                    j += 1
                    break
            elif c == ";" and brace == 0 and paren == 0:
                j += 1
                break
            j += 1
        else:
            if brace or paren:
                raise InstrumentError("unterminated block at end of module", where=_where(text, start))
        chunk_text = text[start:j]
        chunk = Chunk(lead=lead, text=chunk_text)
        if body_open >= 0 and chunk_text.endswith("}"):
            head = text[start:body_open]
            m = _FUNC_HEAD.search(head)
            if m and "=" not in head:
                chunk.is_function = True
                chunk.kind = m.group(1)
                chunk.head = head
                chunk.body = text[body_open + 1 : j - 1]
                chunk.name = function_name(head)
        chunks.append(chunk)
        i = j
    return chunks


# Directives that end at the end of their line rather than at ';'.
_LINE_DIRECTIVES = re.compile(r"(\.version|\.target|\.address_size|\.file|\.loc|@@DWARF)\b")


def _line_directive_end(text: str, pos: int) -> int:
    """End of a line-terminated directive starting at pos, or -1."""
    if not _LINE_DIRECTIVES.match(text, pos):
        return -1
    k = text.find("\n", pos)
    return len(text) if k < 0 else k


def function_name(head: str) -> str:
    """The function's name in a head like `.visible .func (.param .b32 r) f(...)`:
    the identifier right before the parameter list, after any return list."""
    m = _FUNC_HEAD.search(head)
    rest = head[m.end():] if m else head
    rest = rest.lstrip()
    if rest.startswith("("):  # return parameter list of a .func
        depth = 0
        for k, c in enumerate(rest):
            depth += c == "("
            depth -= c == ")"
            if depth == 0:
                rest = rest[k + 1 :]
                break
    mm = re.match(r"\s*(" + _IDENT + r")", rest)
    if not mm:
        raise InstrumentError("function without a name", where=head.strip()[:60])
    return mm.group(1)


@dataclass
class Item:
    """One piece of a function body, in order.  kind is "ws", "open", "close",
    "label" or "stmt".  For statements: pred ("" or "@%p1" / "@!%p1"), opcode
    ("st.global.v4.f32"), operands (text between opcode and ';')."""

    kind: str
    text: str
    depth: int = 0
    pred: str = ""
    opcode: str = ""
    operands: str = ""

    @property
    def parts(self) -> list[str]:
        return self.opcode.split(".")


def split_body(body: str) -> list[Item]:
    """Split a function body (without its outer braces) into items."""
    items: list[Item] = []
    i, n, depth = 0, len(body), 0
    while i < n:
        c = body[i]
        if c.isspace():
            j = i
            while j < n and body[j].isspace():
                j += 1
            items.append(Item("ws", body[i:j], depth))
            i = j
            continue
        if c == "{":
            depth += 1
            items.append(Item("open", c, depth))
            i += 1
            continue
        if c == "}":
            items.append(Item("close", c, depth))
            depth -= 1
            i += 1
            continue
        line_end = _line_directive_end(body, i)
        if line_end >= 0:
            items.append(_statement(body[i:line_end], depth))
            i = line_end
            continue
        m = _LABEL.match(body, i)
        if m and not body.startswith(".", i):
            items.append(Item("label", body[i : m.end()], depth))
            i = m.end()
            continue
        j = body.find(";", i)
        if j < 0:
            raise InstrumentError("statement without ';'", where=body[i : i + 60].strip())
        stmt = body[i : j + 1]
        items.append(_statement(stmt, depth))
        i = j + 1
    return items


def _statement(stmt: str, depth: int) -> Item:
    item = Item("stmt", stmt, depth)
    pos = 0
    m = _PRED.match(stmt)
    if m:
        item.pred = "@" + m.group(1) + m.group(2)
        pos = m.end()
    m = _OPCODE.match(stmt, pos)
    if m:
        item.opcode = m.group(1)
        item.operands = stmt[m.end() : -1].strip()
    elif stmt.lstrip().startswith("."):
        item.opcode = stmt.split()[0].rstrip(";")
        item.operands = stmt.strip()[len(item.opcode) :].strip().rstrip(";")
    return item


@dataclass
class Header:
    version: tuple[int, int] = (0, 0)
    target: str = ""
    sm: int = 0
    address_size: int = 32  # PTX's default when no .address_size is given
    insert_after: int = -1  # index of the chunk after which module additions go


def read_header(chunks: list[Chunk]) -> Header:
    h = Header()
    for k, ch in enumerate(chunks):
        t = ch.text.strip()
        if t.startswith(".version"):
            m = re.match(r"\.version\s+(\d+)\.(\d+)", t)
            if m:
                h.version = (int(m.group(1)), int(m.group(2)))
            h.insert_after = k
        elif t.startswith(".target"):
            h.target = t[len(".target") :].strip()
            m = re.search(r"sm_(\d+)", h.target)
            h.sm = int(m.group(1)) if m else 0
            h.insert_after = k
        elif t.startswith(".address_size"):
            m = re.match(r"\.address_size\s+(\d+)", t)
            if m:
                h.address_size = int(m.group(1))
            h.insert_after = k
    if h.version == (0, 0) or not h.target:
        raise InstrumentError("not a PTX module (no .version / .target)")
    return h


# Register declarations: `.reg .b64 %rd<8>;` declares %rd0..%rd7; `.reg .b32 a, b;`.
_REG_DECL = re.compile(r"\.reg\s+((?:\.v\d\s+)?)\.(\w+)\s+(.*);", re.S)


@dataclass
class RegTable:
    """Register widths by name (`%r5`) and by parametrised prefix (`%r<6>`)."""

    names: dict[str, str] = field(default_factory=dict)
    prefixes: dict[str, str] = field(default_factory=dict)

    def add(self, stmt: str) -> None:
        m = _REG_DECL.match(stmt.strip())
        if not m:
            return
        typ = m.group(2)
        for decl in m.group(3).split(","):
            decl = decl.strip()
            pm = re.match(r"(" + _IDENT + r")\s*<\s*\d+\s*>", decl)
            if pm:
                self.prefixes[pm.group(1)] = typ
            elif decl:
                self.names[decl.split()[0]] = typ

    def type_of(self, reg: str) -> str | None:
        if reg in self.names:
            return self.names[reg]
        m = re.match(r"(.*?)(\d+)$", reg)
        if m and m.group(1) in self.prefixes:
            return self.prefixes[m.group(1)]
        return None


def _where(text: str, pos: int) -> str:
    return f"PTX line {text.count(chr(10), 0, pos) + 1}"
