"""What a profiled GPU kernel is: its fusion in the compiled (optimized) HLO module, with result and operand
shapes, the ops fused into it, and the JAX op and source line it came from.

Kernels inside XLA's command buffers carry the command buffer as their hlo_op, so the kernel name is the only
clue in a trace; XLA names a fusion's kernel after the fusion instruction, '.' written as '_' (identical fusions
may share the first one's kernel).

  compiled = jax.jit(f).lower(*args).compile()
  describe(compiled.as_text(), ["loop_transpose_fusion", ...]) -> {kernel: {"result", "operands", "fused",
                                                                           "op_name", "source"}}
"""

from __future__ import annotations

import re

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (\(.*?\)|\w+\[[^\]]*\](?:\{[^}]*\})?) ([\w\-]+)\((.*?)\)(.*)$")
_COMP = re.compile(r"^%?([\w.\-]+) \(.*\{$|^ENTRY %?([\w.\-]+) ")
_TABLE = re.compile(r"^(\d+) (.*)$")


def _tables(lines):
    """The module's FileNames, FileLocations and StackFrames tables: {section: {id: text}}."""
    out, section = {}, None
    for ln in lines:
        if ln in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = out.setdefault(ln, {})
        elif not ln.strip():
            section = None
        elif section is not None and (m := _TABLE.match(ln)):
            section[m.group(1)] = m.group(2)
    return out


def _source(tables, frame_id: str) -> str:
    """file:line of a stack frame id, '' when the module has no such tables."""
    frame = tables.get("StackFrames", {}).get(frame_id, "")
    loc_id = re.search(r"file_location_id=(\d+)", frame)
    loc = tables.get("FileLocations", {}).get(loc_id.group(1) if loc_id else "", "")
    file_id, line = re.search(r"file_name_id=(\d+)", loc), re.search(r"\bline=(\d+)", loc)
    if not (file_id and line):
        return ""
    name = tables.get("FileNames", {}).get(file_id.group(1), "?").strip('"')
    return f"{name}:{line.group(1)}"


def describe(hlo_text: str, kernels) -> dict:
    """For each kernel name found as an instruction of the module: its result type, operand types, the opcodes
    fused into it (for fusions), the JAX op_name and source file:line from its metadata."""
    lines = hlo_text.splitlines()
    tables = _tables(lines)
    types, instrs, comps, comp = {}, {}, {}, None
    for ln in lines:
        if (c := _COMP.match(ln)) and ln.rstrip().endswith("{"):
            comp = c.group(1) or c.group(2)
            comps[comp] = []
            continue
        m = _INSTR.match(ln)
        if not m:
            continue
        name, typ, opcode, args, rest = m.groups()
        types[name] = typ
        instrs[name.replace(".", "_")] = (name, typ, opcode, args, rest)
        if comp is not None:
            comps[comp].append(opcode)
    out = {}
    for k in kernels:
        if k not in instrs:
            continue
        name, typ, opcode, args, rest = instrs[k]
        operands = [types.get(a.strip().lstrip("%"), a.strip()) for a in args.split(",") if a.strip()]
        called = re.search(r"calls=%?([\w.\-]+)", rest)
        fused = sorted(set(comps.get(called.group(1), ()))) if called and opcode == "fusion" else []
        op_name = re.search(r'op_name="([^"]*)"', rest)
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        out[k] = {"instruction": name, "opcode": opcode, "result": typ, "operands": operands,
                  "fused": [f for f in fused if f != "parameter"], "op_name": op_name.group(1) if op_name else "",
                  "source": _source(tables, frame.group(1)) if frame else ""}
    return out


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
                "f64": 8, "s64": 8, "u64": 8}


def _bytes(typ: str) -> int:
    m = re.match(r"(\w+)\[([\d,]*)\]", typ)
    if not m:
        return 0
    n = 1
    for d in filter(None, m.group(2).split(",")):
        n *= int(d)
    return n * _DTYPE_BYTES.get(m.group(1), 4)


def copies(hlo_text: str) -> list[dict]:
    """Every copy instruction of a compiled module that runs as its own operation (not one inside a fusion's body):
    {"computation", "entry", "result", "bytes", "operand", "op_name"}. Copies in ENTRY run once per call; those in a
    while loop's body or a conditional's branch, every iteration or branch taken. Most are copy insertion's: a value
    that cannot share its buffer with another (a while loop's carry from an input it does not own, a conditional's
    branch handing back its own parameter)."""
    out, comp, fusion_body = [], None, False
    fused = set(re.findall(r"\bcalls=%?([\w.\-]+)", hlo_text))  # fusion bodies, whose copies are not operations
    for ln in hlo_text.splitlines():
        if (c := _COMP.match(ln)) and ln.rstrip().endswith("{"):
            comp, entry = c.group(1) or c.group(2), ln.startswith("ENTRY")
            fusion_body = comp in fused and not entry
            continue
        m = _INSTR.match(ln)
        if not m or m.group(3) != "copy" or fusion_body or comp is None:
            continue
        _, typ, _, args, rest = m.groups()
        op_name = re.search(r'op_name="([^"]*)"', rest)
        out.append({"computation": comp, "entry": entry, "result": re.sub(r"\{.*", "", typ), "bytes": _bytes(typ),
                    "operand": args.strip().lstrip("%"), "op_name": op_name.group(1) if op_name else ""})
    return out
