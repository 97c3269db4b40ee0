"""Compile the attention kernel ahead of time for a GPU arch, on any machine, and read its SASS.

No GPU needed: Triton lowers to PTX, its bundled ``ptxas`` assembles for the target, and its
bundled ``cuobjdump`` prints the machine code. Used by ``python -m kvcompile sass`` and by
``tests/test_sass.py``, which pins the code shape of the decode loop in CI (no byte-wise
shared-memory reads of V; no register spills) on a machine without a GPU.

The compile is one real launch of :func:`attention_launcher._run`: the constexprs of the plan
:mod:`kvcompile.kernels.plan` makes for the call, and the launch-time specializations Triton makes
(integer arguments equal to 1 become constants, multiples of 16 and pointers are marked
16-divisible) for contiguous ``[B, H, L, D]`` tensors (V key-contiguous with ``v_keys``). The
version of Triton installed decides the code: compare against the GPU machine's Triton when it
matters.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Optional

from .. import formats, tiles

__all__ = ["SassReport", "compile_attention", "compile_attention_isolated", "compile_store", "tool_path"]


@dataclasses.dataclass
class SassReport:
    arch: str
    tile: tiles.Tile
    registers: int
    stack_bytes: int  # local memory per thread: > 0 means spills
    shared_bytes: int
    instructions: int
    opcodes: collections.Counter  # SASS opcode (with modifiers) -> count, whole kernel
    # the kernel's loops (a backward branch and the code it jumps back over, 100+ instructions), in
    # program order: opcode -> count in each
    loops: list = dataclasses.field(default_factory=list)
    # opcode -> index of its first / last instruction in program order
    first: dict = dataclasses.field(default_factory=dict)
    last: dict = dataclasses.field(default_factory=dict)

    def count(self, prefix: str) -> int:
        """Instructions whose opcode starts with ``prefix`` (e.g. "LDS.U8", "HMMA")."""
        return sum(n for op, n in self.opcodes.items() if op.startswith(prefix))

    def first_at(self, prefix: str) -> int:
        """Where in program order the first instruction whose opcode starts with ``prefix`` is (-1: none)."""
        return min((self.first[op] for op in self.opcodes if op.startswith(prefix)), default=-1)

    def last_at(self, prefix: str) -> int:
        """Where in program order the last instruction whose opcode starts with ``prefix`` is (-1: none)."""
        return max((self.last[op] for op in self.opcodes if op.startswith(prefix)), default=-1)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["opcodes"] = dict(self.opcodes)
        d["loops"] = [dict(c) for c in self.loops]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "SassReport":
        d = dict(d)
        d["tile"] = tiles.Tile(**d["tile"])
        d["opcodes"] = collections.Counter(d["opcodes"])
        d["loops"] = [collections.Counter(c) for c in d.get("loops", [])]
        return cls(**d)

    def summary(self, top: int = 16) -> str:
        ops = "  ".join(f"{op}:{n}" for op, n in self.opcodes.most_common(top))
        t = self.tile
        loops = " / ".join(str(sum(c.values())) for c in self.loops) or "none"
        return (f"{self.arch} tile {t.block_m}x{t.block_n} {t.num_warps}w {t.num_stages}s: {self.registers} registers, "
                f"{self.stack_bytes} B stack, {self.shared_bytes} B shared, {self.instructions} instructions "
                f"(loops: {loops})\n  {ops}")


def tool_path(name: str) -> str:
    """A tool Triton ships for the NVIDIA backend (``ptxas``, ``cuobjdump``)."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise RuntimeError(f"kvcompile.kernels.aot: {name} not found at {path} (Triton's NVIDIA backend tools)")
    return path


def compile_attention(
    cc: tuple[int, int] = (9, 0),
    kv_dtype: str = "fp8_e4m3",
    granularity: Optional[str] = None,
    head_dim: int = 128,
    group: int = 4,
    q_len: int = 1,
    mask: str = "none",
    causal: Optional[bool] = None,
    v_pin: Optional[bool] = None,
    tile: Optional[tiles.Tile] = None,
    v_keys: bool = False,
    window: bool = False,
    softcap: bool = False,
    sinks: bool = False,
    k_codes: Optional[str] = None,
    v_codes: Optional[str] = None,
    rotated=False,
    plan_fields: Optional[dict] = None,
) -> SassReport:
    """Compile ``_attention_kernel`` as the launcher would for this case; return its SASS report.

    ``q_len <= 16`` is the split-K decode launch (partial outputs), longer the fused prefill launch
    (causal). ``causal`` defaults to ``q_len > 1``. ``mask``: "none", "bool" or "add" (an explicit attention mask, as HF passes for padded
    batches). Queries bf16, fp16 dots (the GPU default). ``v_pin`` overrides the plan's V pinning
    (A/B); ``tile`` the tile the plan picks. ``v_keys``: V key-contiguous (the
    cache's transposed V layout; never pinned). ``window`` / ``softcap`` / ``sinks``: the kernel's
    HAS_WINDOW / HAS_SOFTCAP / HAS_SINKS switches. ``k_codes`` / ``v_codes`` ("e4m3" or "int8")
    override the format's code type of K / V (e.g. int8 codes with token scales, or K and V of
    different code types); scales keep the format's. ``rotated``: K and V (or only "k" / "v")
    stored rotated by the shared Sylvester matrix (decode rotates q in the kernel). ``plan_fields``:
    fields of the plan to replace (:func:`kvcompile.kernels.plan.override`), e.g. ``{"q_rotation": "launch"}``.

    The constexprs are exactly those of :func:`kvcompile.kernels.plan.plan` for this call (no copy of
    its logic here).
    """
    from . import attention_launcher as launcher
    from . import plan as plan_mod
    from ._attention_kernel import _attention_kernel
    from .common import interpreting

    if interpreting():
        raise RuntimeError(
            "kvcompile.kernels.aot: Triton was imported with TRITON_INTERPRET=1 in this process and cannot "
            "compile here; use compile_attention_isolated(...) (a fresh process) or unset TRITON_INTERPRET"
        )

    fmt = formats.get_format(kv_dtype, granularity)
    tiles.check_head_dim(head_dim)
    call = _attention_call(cc, fmt, head_dim, group, q_len, mask, causal, v_keys, window, softcap, sinks,
                           k_codes, v_codes, rotated)
    fields = dict(plan_fields or {})
    if v_pin is not None:
        fields["v_pin"] = v_pin and not v_keys
    if call.decode:
        fields["splits"] = 2  # the partial-output epilogue (a split launch), whatever the split planner says
    with plan_mod.override(**fields, **({"tile": tile} if tile is not None else {})):
        p = plan_mod.plan(call)
    ptrs, ones, zeros = _attention_signature(p, fmt, mask, v_keys, sinks, q_len)
    compiled = _compile(_attention_kernel, cc, p.constexprs(), ptrs, ones, zeros | {"Hkv", "Tq", "window"},
                        "compile_attention", "attention_launcher._run", num_warps=p.tile.num_warps,
                        num_stages=p.tile.num_stages, **launcher._FP_FUSION, **launcher._maxnreg(p.tile))
    return _report(compiled, f"sm_{cc[0]}{cc[1]}", p.tile)


_MASK_PTRS = {"none": "*bf16", "bool": "*u8", "add": "*bf16"}  # the MASK pointer's type per mask kind


def _attention_call(cc, fmt, head_dim, group, q_len, mask, causal, v_keys, window, softcap, sinks,
                    k_codes, v_codes, rotated):
    """The launch plan's view of a Llama-3-8B-like call at batch 8 over a long cache (decode splits;
    enough programs for the throughput plan, e.g. the int8 bias), bf16 queries (the GPU default)."""
    import torch

    from . import plan as plan_mod

    code_types = {"e4m3": torch.float8_e4m3fn, "int8": torch.int8, None: fmt.code_dtype}
    if k_codes not in code_types or v_codes not in code_types:
        raise ValueError(f"kvcompile.kernels.aot: k_codes / v_codes must be 'e4m3' or 'int8', got {k_codes!r} / {v_codes!r}")
    masks = {"none": plan_mod.MASK_NONE, "bool": plan_mod.MASK_BOOL, "add": plan_mod.MASK_ADD}
    if mask not in masks:
        raise ValueError(f"kvcompile.kernels.aot: mask must be one of {list(masks)}, got {mask!r}")
    kind, group_size = plan_mod.scale_layout(fmt, fmt, head_dim)
    k_rot = plan_mod.ROT_SYLVESTER if rotated in (True, "k") else plan_mod.ROT_NONE
    v_rot = plan_mod.ROT_SYLVESTER if rotated in (True, "v") else plan_mod.ROT_NONE
    return plan_mod.Call(
        cc=tuple(cc), sms=132, interpret=False, B=8, Hq=8 * group, Hkv=8, Tq=q_len, L=32768, D=head_dim,
        q_dtype=torch.bfloat16, k_code=code_types[k_codes], v_code=code_types[v_codes], scale_kind=kind,
        group_size=group_size, scale_bytes=plan_mod.scale_bytes(fmt, head_dim),
        mask_kind=masks[mask], is_causal=q_len > 1 if causal is None else causal,
        window=1024 if window else 0, softcap=softcap, sinks=sinks, k_rot=k_rot, v_rot=v_rot, v_keys=v_keys,
        decode=q_len <= plan_mod.DECODE_MAX_Q)


def _attention_signature(p, fmt, mask, v_keys, sinks, q_len):
    """The pointer types of ``_attention_kernel``'s tensors as the launcher passes them for plan ``p``,
    and the integer arguments it passes as 1 and as 0 (or that are not multiples of 16)."""
    from . import plan as plan_mod

    k_bits, v_bits = p.codes_as_bits  # e4m3 codes as uint8 bits, as the launcher passes them
    k_code = "*i8" if not p.call.k_code.is_floating_point else ("*u8" if k_bits else "*fp8e4nv")
    v_code = "*i8" if not p.call.v_code.is_floating_point else ("*u8" if v_bits else "*fp8e4nv")
    scale = "*fp32" if fmt.scale_dtype.itemsize == 4 else "*fp16"
    ptrs = {"Q": "*bf16", "K": k_code, "V": v_code, "KS": scale, "VS": scale, "KVLEN": "*i64", "MASK": _MASK_PTRS[mask],
            "SINKS": "*fp32" if sinks else "*bf16", "O": "*bf16", "OP": "*fp32", "LSE": "*fp32",
            # no token stored (the plan's store is off here): the launcher passes q for these
            "KN": "*bf16", "VN": "*bf16", "KW": "*bf16", "VW": "*bf16", "OFF": "*bf16"}
    ones = {"stride_qd", "stride_kd", "stride_vn" if v_keys else "stride_vd", "stride_od", "stride_kvl", "stride_ls"}
    if sinks:
        ones.add("stride_sink")  # a contiguous [Hq] parameter (without sinks the launcher passes 0)
    kind = p.call.scale_kind
    if kind == plan_mod.SCALE_TOKEN:
        ones |= {"stride_ksn", "stride_vsn", "stride_ksg", "stride_vsg"}
    elif kind == plan_mod.SCALE_BLOCK:
        ones |= {"stride_ksg", "stride_vsg"}
    else:  # static: [Hkv] viewed as [1, Hkv, 1, 1]
        ones |= {"stride_ksh", "stride_vsh", "stride_ksn", "stride_vsn", "stride_ksg", "stride_vsg"}
    if q_len == 1:
        ones.add("Tq")
    # no mask: the launcher passes 0 strides; an expanded [B, 1, Tq, L] mask: 0 over heads, 1 along keys
    zeros = {"stride_mb", "stride_mh", "stride_mm", "stride_mn"} if mask == "none" else {"stride_mh", "stride_mm"}
    if mask != "none":
        ones.add("stride_mn")
    return ptrs, ones, zeros


def compile_store(
    cc: tuple[int, int] = (9, 0),
    kv_dtype: str = "fp8_e4m3",
    granularity: Optional[str] = None,
    head_dim: int = 128,
    tokens: int = 16384,
    v_keys: Optional[bool] = None,
) -> SassReport:
    """Compile ``_store_kv_kernel`` as :func:`store.store_kv` launches it for ``tokens`` new tokens of
    bf16 K/V (contiguous ``[B, H, T, D]``) into a cache of this format; return its SASS report.
    ``v_keys`` (the V codes key-contiguous) defaults to the format's ``v_keys_contiguous``, as
    ``QuantizedCache`` lays V out. The report's tile is ``(block_t, 1, 4 warps, 1)``."""
    from . import store as launcher
    from ._store_kernel import _store_kv_kernel
    from .common import interpreting, next_pow2

    if interpreting():
        raise RuntimeError("kvcompile.kernels.aot: cannot compile with TRITON_INTERPRET=1; use compile_attention_isolated")
    fmt = formats.get_format(kv_dtype, granularity)
    v_keys = fmt.v_keys_contiguous if v_keys is None else v_keys
    int8 = not fmt.code_dtype.is_floating_point
    static = fmt.is_static
    groups = 1 if static else fmt.groups(head_dim)
    groups_p2 = next_pow2(groups)
    group_size = next_pow2(head_dim) if groups == 1 else head_dim // groups
    block_t = max(1, min(next_pow2(tokens), 4096 // (groups_p2 * group_size)))
    code = fmt.spec.id  # the store kernel's CODE constexpr
    consts = dict(HAS_OFFSET=False, K_CODE=code, V_CODE=code, STATIC_SCALE=static,
                  HW_E4M3=not int8 and tiles.has_native_fp8(cc),  # store.hw_e4m3 for a GPU of this arch
                  GROUPS_P2=groups_p2, GROUP_SIZE=group_size, BLOCK_T=block_t,
                  K_HADAMARD=False, V_HADAMARD=False, ROT_EXACT=False, ROT_CHUNK=32)  # unrotated
    scale = "*fp16" if fmt.scale_dtype.itemsize == 2 else "*fp32"
    code_ptr = "*i8" if int8 else "*u8"  # e4m3 codes go in as uint8 bits
    ptrs = {"K": "*bf16", "V": "*bf16", "KC": code_ptr, "VC": code_ptr, "KS": scale, "VS": scale, "OFF": scale, "START": "*i64"}
    ones = {"stride_kd", "stride_vd", "stride_kcd", "stride_vct" if v_keys else "stride_vcd"}
    if static:  # [Hkv] viewed as [1, Hkv, 1, 1]
        ones |= {"stride_ksh", "stride_vsh", "stride_kst", "stride_vst", "stride_ksg", "stride_vsg"}
    elif groups == 1:  # [B, Hkv, L, 1]
        ones |= {"stride_kst", "stride_vst", "stride_ksg", "stride_vsg"}
    else:
        ones |= {"stride_ksg", "stride_vsg"}
    zeros = {"stride_oh", "stride_od"}  # no offset: the launcher passes 0 strides
    compiled = _compile(_store_kv_kernel, cc, consts, ptrs, ones, zeros | {"H", "T"}, "compile_store",
                        "store.store_kv", num_warps=4, **launcher._EXACT)
    return _report(compiled, f"sm_{cc[0]}{cc[1]} store_kv", tiles.Tile(block_t, 1, 4, 1))


def _compile(kernel, cc, consts: dict, ptrs: dict, ones: set, not16: set, mirror: str, launch: str, **options):
    """``triton.compile`` of ``kernel`` for ``cc`` with the launch-time specializations Triton makes:
    ``consts`` the constexprs, ``ptrs`` pointer types (16-byte aligned), ``ones`` integer arguments
    equal to 1 (constants), every other integer 16-divisible unless in ``not16``; ``sm_scale`` fp32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    declared = {names[i] for i in kernel.constexprs}
    if declared != set(consts):  # the kernel and this mirror of its launcher drifted apart
        raise RuntimeError(
            f"kvcompile.kernels.aot: {kernel.__name__}'s constexprs {sorted(declared)} differ from the ones "
            f"compiled here {sorted(consts)}; update {mirror} to match {launch}"
        )
    signature, constexprs, attrs = {}, {}, {}
    for i, a in enumerate(names):
        if a in consts:
            signature[a], constexprs[(i,)] = "constexpr", consts[a]
        elif a in ptrs:
            signature[a] = ptrs[a]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif a in ones:
            signature[a], constexprs[(i,)] = "constexpr", 1
        elif a in ("sm_scale", "softcap", "rot_scale"):  # the kernel's float arguments
            signature[a] = "fp32"
        else:
            signature[a] = "i32"
            if a not in not16:
                attrs[(i,)] = [["tt.divisibility", 16]]  # strides, D, split_len: multiples of 16 here
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", cc[0] * 10 + cc[1], 32), options=options)


def _report(compiled, arch: str, tile: tiles.Tile) -> SassReport:
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([tool_path("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tool_path("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                             check=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    # SASS lines: "        /*0150*/                   LDS.U8 R5, [R2+0x10] ;" (optionally predicated "@P0 ")
    ins = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass)]
    ops = collections.Counter(op for _, op, _ in ins)
    first, last = {}, {}
    for i, (_, op, _) in enumerate(ins):
        first.setdefault(op, i)
        last[op] = i
    return SassReport(arch=arch, tile=tile, registers=int(regs.group(1)) if regs else -1,
                      stack_bytes=int(stack.group(1)) if stack else -1,
                      shared_bytes=int(compiled.metadata.shared), instructions=sum(ops.values()), opcodes=ops,
                      loops=_loops(ins), first=first, last=last)


def _loops(ins: list) -> list:
    """Opcode counts of each loop: a ``BRA`` to a lower address spans the loop body (100+
    instructions, so the short spin loops of barriers and the like are left out)."""
    loops = []
    for addr, op, args in ins:
        target = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            body = collections.Counter(o for a, o, _ in ins if lo <= a <= addr)
            if sum(body.values()) >= 100:
                loops.append(body)
    return loops


# compile processes at once: about 0.5 GB each (torch, Triton); a container may show the host's cores
_MAX_COMPILE_PROCESSES = 4


def compile_attention_isolated(cases: list[dict], timeout: float = 600.0) -> list[SassReport]:
    """:func:`compile_attention` (or, with ``kernel="store"`` in a case, :func:`compile_store`) for
    each dict of keyword arguments, in fresh Python processes with the Triton interpreter off (a
    process that imported Triton with ``TRITON_INTERPRET=1``, as the CPU tests do, cannot compile
    kernels): one per CPU core (at most four), the cases dealt out in turn, the reports in the cases' order."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = max(1, min(len(cases), cores, _MAX_COMPILE_PROCESSES))
    shares = [list(range(w, len(cases), workers)) for w in range(workers)]
    procs = []
    try:
        for share in shares:
            with tempfile.TemporaryFile("w+") as payload:  # the child reads its cases from stdin
                json.dump([{k: (dataclasses.asdict(v) if isinstance(v, tiles.Tile) else v) for k, v in cases[i].items()}
                           for i in share], payload)
                payload.seek(0)
                procs.append(subprocess.Popen([sys.executable, "-m", "kvcompile.kernels.aot"], stdin=payload,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        reports: list = [None] * len(cases)
        for share, proc in zip(shares, procs):
            out, err = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"kvcompile.kernels.aot: the compile process failed:\n{err[-4000:]}")
            for i, d in zip(share, json.loads(out.strip().splitlines()[-1])):
                reports[i] = SassReport.from_json(d)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return reports


def _main() -> None:  # the isolated process: JSON cases on stdin, JSON reports on the last stdout line
    cases = json.loads(sys.stdin.read())
    out = []
    for c in cases:
        if isinstance(c.get("tile"), dict):
            c["tile"] = tiles.Tile(**c["tile"])
        if "cc" in c:
            c["cc"] = tuple(c["cc"])
        kernel = c.pop("kernel", "attention")
        out.append((compile_store if kernel == "store" else compile_attention)(**c).to_json())
    print(json.dumps(out))


if __name__ == "__main__":
    _main()
