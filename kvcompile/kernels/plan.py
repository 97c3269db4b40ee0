"""Launch plans of ``kvcompile::attention``: every decision about how one call runs, in one place.

In the manner of FlashInfer's plan/run: :func:`plan` is a pure function from what a call is
(:class:`Call`: arch, shapes, dtypes, code types, scale layout, mask, features, rotations) to a
frozen :class:`LaunchPlan` (tile, split count, dot type, where the rotations run, every constexpr of
``_attention_kernel``). The launcher only executes a plan; :mod:`kvcompile.kernels.aot` compiles
exactly :meth:`LaunchPlan.constexprs`; ``python -m kvcompile info`` prints plans. Plans are cached
per call (a call is hashable; no tensor in it).

The smaller tile a call falls back to when Triton refuses one (:func:`plan_of`, :func:`shrink`) is
decided here too; the prefill path and how the fused prefill scores are :mod:`kvcompile.kernels.prefill`; the decode split
count is :mod:`kvcompile.kernels.splits`, the scale layout :mod:`kvcompile.kernels.scales`.

Variants for tests and benchmarks go through :func:`override` (``dataclasses.replace`` of every
plan made inside the ``with``), never through module flags. Tiles themselves are data in
:mod:`kvcompile.tiles`. Alternatives that lost their A/B, and by how much, are in
docs/perf-log.md; only what an architecture or a call shape chooses is left here.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Optional

import torch

from .. import tiles
from .prefill import (DECODE_MAX_Q, DENSE_MIN_Q, PREFILL_Q, QUANT_FUSED_MAX_Q, dense_ok, prefill_path,  # noqa: F401
                      prefill_q)
from .scales import SCALE_BLOCK, SCALE_STATIC, SCALE_TOKEN, scale_bytes, scale_layout
from .splits import (DECODE_MIN_SPLIT_TILES, DECODE_PROGRAMS_PER_SM_SMALL, DECODE_SMALL_PROGRAMS, DECODE_WAVES,
                     decode_splits)

__all__ = ["Call", "LaunchPlan", "plan", "plan_of", "shrink", "override", "prefill_path", "dense_ok", "decode_splits",
           "scale_layout", "scale_bytes", "SCALE_TOKEN", "SCALE_BLOCK", "SCALE_STATIC", "MASK_NONE", "MASK_BOOL",
           "MASK_ADD", "ROT_NONE", "ROT_MATRIX", "ROT_SYLVESTER", "DECODE_MAX_Q", "DECODE_SMALL_PROGRAMS",
           "DECODE_MIN_SPLIT_TILES", "DENSE_MIN_Q", "DECODE_WAVES", "DECODE_PROGRAMS_PER_SM_SMALL", "INTERPRET_TILE"]

# the kernel's mode constants (tl.constexpr in _attention_kernel.py; equal by test_plan)
MASK_NONE, MASK_BOOL, MASK_ADD = 0, 1, 2
# how a side of the cache is rotated: not, by any orthonormal matrix (read from memory), or by the
# shared Sylvester Hadamard matrix of a power-of-two head_dim (its +-1 entries generated in registers)
ROT_NONE, ROT_MATRIX, ROT_SYLVESTER = 0, 1, 2

# The interpreter (tests): small tiles so that short test caches cross tile edges.
INTERPRET_TILE = (32, 16)  # (largest block_m, block_n)
# Columns per product of a rotation (the q prologue's and the merge's); tl.dot needs >= 16.
ROT_CHUNK = 32
# LaunchPlan.fp8_acc past every reduction length: each fp8 dot promotes once (P V once per key tile)
FP8_ACC_PER_DOT = 1 << 30


@dataclasses.dataclass(frozen=True)
class Call:
    """What one ``kvcompile::attention`` call on the Triton kernels is, as far as planning goes."""

    cc: tuple  # compute capability; the interpreter counts as (9, 0)
    sms: int  # SMs of the device (the interpreter: 4)
    interpret: bool
    B: int
    Hq: int
    Hkv: int
    Tq: int
    L: int  # cache positions (max_cache_len)
    D: int
    q_dtype: torch.dtype
    k_code: torch.dtype  # code dtypes: float8_e4m3fn or int8
    v_code: torch.dtype
    scale_kind: int  # SCALE_*
    group_size: int  # values per scale (D for token / static)
    scale_bytes: int  # scale bytes per key, the larger of K's and V's (0: static)
    mask_kind: int = MASK_NONE
    is_causal: bool = False
    window: int = 0  # > 0 only when it hides keys (< L)
    softcap: bool = False
    sinks: bool = False
    k_rot: int = ROT_NONE
    v_rot: int = ROT_NONE
    v_keys: bool = False  # V codes key-contiguous with room for 16-key chunks (launcher.v_keys_contiguous)
    decode: bool = True  # split-K decode kernel (else the fused prefill kernel)
    # the call also stores the step's token (one query, one new key) at position kv_len - 1 (slot
    # (kv_len - 1) % L: a sliding layer's ring), K centered by an offset when store_offset
    store: bool = False
    store_offset: bool = False
    k_kind: int = 0  # the stored token's K and V formats (FormatSpec.id: the store's CODE)
    v_kind: int = 0


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """How one call runs. ``splits == 1``: no merge; the fields below ``tile`` are the kernel's switches."""

    call: Call
    tile: tiles.Tile
    resident: int  # programs of the tile per SM (decode split planning)
    splits: int
    split_len: int
    dot_dtype: torch.dtype  # both dots' operand type: fp16 for 16-bit q (module docstring of the kernel), else fp32
    k_fp8_bits: bool  # e4m3 codes passed as uint8 bits (no fp8 type in Triton for this arch)
    v_fp8_bits: bool
    v_pin: bool  # widen V by pinned inline PTX before its shared-memory transpose (_codes.codes_to_f16_pinned)
    int8_ptx: bool  # widen int8 tiles four codes at a time by inline PTX (_codes.codes_to)
    # int8 K and V (token or static scales) widened to 1152 + code without the fp16 subtraction, the
    # scores corrected by 1152 sum(q) per row and the PV product by 1152 rowsum(P) instead (with fp16
    # dots; fp32 dots widen exactly anyway)
    int8_bias: bool
    # int8 K (token or static scales, fp16 dots) scored on the int8 tensor cores, unwidened: q split in
    # the prologue into two int8 halves, q ~ t (254 hi + lo), the two int32 dots summed exactly
    int8_mma: bool
    # where a rotation runs: q "kernel" (generated H in _attention_kernel's prologue) or "launch"
    # (rotate_rows before); the output "merge" (R_V^T in _merge_kernel) or "launch" (rotate_rows
    # after); "" where that side is not rotated
    q_rotation: str = ""
    o_rotation: str = ""
    # where the step's token is stored (Call.store): "kernel" (the attention kernel's program that holds
    # its slot writes it first: _attention_kernel's STORE_NEW) or "launch" (store.store_kv before)
    store: str = ""
    # a program whose split is one key tile issues that tile's reads before q's prologue (ONE_TILE):
    # the plan's choice for decode; False keeps the loops (A/B)
    preload: bool = False
    # q quantized per row after its rotation to K's code type (int8, or e4m3 with Triton's fp8 type), one
    # 8-bit dot for the scores with the row's scale outside it: not exact (LaunchPlan.q_int8 / q_fp8);
    # and P in e4m3 against e4m3 V codes (pv_fp8). The fused prefill's choice (_plan, PREFILL_Q8)
    q_quant: bool = False
    p_fp8: bool = False
    # P in int8 at a scale per row of each key tile (s_v / max s_v folded in) against key-contiguous
    # int8 V codes: one int32 dot for P V (pv_int8); the int8 cache's counterpart of p_fp8
    p_int8: bool = False
    # products an fp8 x fp8 dot sums in the MMAs' reduced-precision accumulator before adding them to its
    # fp32 result (Triton's max_num_imprecise_acc, cut to the dot's reduction length); 0 leaves Triton's
    # default, which on sm_90 never promotes: P V's sum then runs the whole key loop at that precision
    fp8_acc: int = 0

    def _int8_fp16(self, code: torch.dtype) -> bool:
        # where the int8 bias and int8 MMAs apply (either may be forced by override): int8 codes whose
        # scales stay out of the tile (token / static), fp16 dots
        return code == torch.int8 and self.call.scale_kind != SCALE_BLOCK and self.dot_dtype == torch.float16

    def _biased(self, code: torch.dtype) -> bool:
        return self.int8_bias and self._int8_fp16(code)

    @property
    def k_mma(self) -> bool:
        """int8 K meets q's two int8 halves on the int8 tensor cores (no widening, no bias; the MMA
        takes 32 codes per step, so a head dim padded to at least 32)."""
        return self.int8_mma and self._int8_fp16(self.call.k_code) and _pow2(self.call.D) >= 32 and not self.q_int8

    def _q_codes(self, code: torch.dtype) -> bool:
        # q quantized to this code type: asked for, K of that type with its scales out of the tile, fp16
        # dots (16-bit q), and 8-bit MMAs for the arch (int8 from sm_80, e4m3 with the fp8 type: sm_89)
        c = self.call
        if not (self.q_quant and c.k_code == code and c.scale_kind != SCALE_BLOCK and self.dot_dtype == torch.float16
                and _pow2(c.D) >= 32):
            return False
        return tuple(c.cc) >= (8, 0) if code == torch.int8 else not self.k_fp8_bits

    @property
    def q_int8(self) -> bool:
        """int8 K meets q's int8 codes at a scale per row: one int32 dot (``Q_INT8``; replaces k_mma)."""
        return self._q_codes(torch.int8)

    @property
    def q_fp8(self) -> bool:
        """e4m3 K meets q's e4m3 codes at a scale per row on the fp8 MMAs (``Q_FP8``)."""
        return self._q_codes(torch.float8_e4m3fn)

    @property
    def pv_fp8(self) -> bool:
        """P in e4m3 (s_v / max s_v folded in) against key-contiguous e4m3 V codes (``P_FP8``): token
        scales, fp16 dots, Triton's fp8 type, V read like K (no transpose, no pin)."""
        c = self.call
        return (self.p_fp8 and c.v_code == torch.float8_e4m3fn and c.scale_kind == SCALE_TOKEN and c.v_keys
                and self.dot_dtype == torch.float16 and not self.v_fp8_bits and not self.v_pin and _pow2(c.D) >= 32)

    @property
    def pv_int8(self) -> bool:
        """P in int8 codes at amax / 127 per row of the tile (s_v / max s_v folded in) against
        key-contiguous int8 V codes (``P_INT8``): the fused prefill (unsplit: its NaN rides on l_i), token
        scales, fp16 dots, int8 MMAs (sm_80+)."""
        c = self.call
        return (self.p_int8 and not c.decode and c.v_code == torch.int8 and c.scale_kind == SCALE_TOKEN and c.v_keys
                and self.dot_dtype == torch.float16 and not self.v_pin and _pow2(c.D) >= 32 and tuple(c.cc) >= (8, 0))

    @property
    def k_bias(self) -> bool:
        """The int8 K bias runs (not when K is scored unwidened: k_mma, q_int8)."""
        return self._biased(self.call.k_code) and not (self.k_mma or self.q_int8)

    @property
    def v_bias(self) -> bool:
        """The int8 V bias runs (not with the pinned widening of a transposed V, which stays exact)."""
        return self._biased(self.call.v_code) and not (self.v_pin or self.pv_int8)

    @property
    def one_tile(self) -> bool:
        """Each split is one key tile, whose reads the kernel issues before q's prologue (``preload``)."""
        return self.preload and _one_tile_splits(self.split_len, self.tile)

    @property
    def codes_as_bits(self) -> tuple[bool, bool]:
        """(K, V): whether the launch passes that side's e4m3 codes as uint8 bits (no fp8 type in
        Triton for the arch; V also for the pinned PTX, which takes the bits)."""
        c = self.call
        return self.k_fp8_bits, self.v_fp8_bits or (self.v_pin and c.v_code == torch.float8_e4m3fn)

    def constexprs(self) -> dict:
        """The constexprs of ``_attention_kernel`` for this plan, as Triton types (what aot.py compiles;
        built once per plan: the launcher passes them every call)."""
        cached = self.__dict__.get("_constexprs")
        if cached is None:
            cached = self._build_constexprs()
            object.__setattr__(self, "_constexprs", cached)
        return cached

    def _build_constexprs(self) -> dict:
        import triton.language as tl

        c = self.call
        dt = {torch.float16: tl.float16, torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}[self.dot_dtype]
        fused = self.store == "kernel"
        return dict(
            GROUP=c.Hq // c.Hkv, GROUP_SIZE=c.group_size, SCALE_KIND=c.scale_kind, MASK_KIND=c.mask_kind,
            IS_CAUSAL=bool(c.is_causal), HAS_WINDOW=c.window > 0, HAS_SOFTCAP=c.softcap, HAS_SINKS=c.sinks,
            SPLIT_OUTPUT=self.splits > 1, K_FP8_BITS=self.k_fp8_bits, V_FP8_BITS=self.v_fp8_bits, DOT_DTYPE=dt,
            V_PIN=self.v_pin, V_KEYS_CONTIG=c.v_keys, INT8_PTX=self.int8_ptx,
            K_BIAS=self.k_bias, V_BIAS=self.v_bias, K_MMA=self.k_mma, Q_INT8=self.q_int8, Q_FP8=self.q_fp8,
            P_FP8=self.pv_fp8, P_INT8=self.pv_int8, E4M3_RNE=c.interpret and (self.q_fp8 or self.pv_fp8),
            QK_FP8_ACC=min(self.fp8_acc, _pow2(c.D)) if self.q_fp8 else 0,
            PV_FP8_ACC=min(self.fp8_acc, self.tile.block_n) if self.pv_fp8 else 0,
            Q_HADAMARD=self.q_rotation == "kernel", ROT_CHUNK=ROT_CHUNK,
            ROT_EXACT=c.interpret or self.dot_dtype == torch.float32,
            STORE_NEW=fused, STORE_OFFSET=fused and c.store_offset,
            STORE_K_CODE=c.k_kind if fused else 0, STORE_V_CODE=c.v_kind if fused else 0,
            STORE_HW_E4M3=fused and not c.interpret and tiles.has_native_fp8(c.cc)
            and torch.float8_e4m3fn in (c.k_code, c.v_code),
            STORE_K_HADAMARD=fused and c.k_rot == ROT_SYLVESTER, STORE_V_HADAMARD=fused and c.v_rot == ROT_SYLVESTER,
            ONE_TILE=self.one_tile, HOLD_TILE=self.one_tile and not c.interpret,
            BLOCK_M=self.tile.block_m, BLOCK_N=self.tile.block_n, BLOCK_D=_pow2(c.D),
        )

    def describe(self) -> str:
        t, c, k = self.tile, self.call, self.constexprs()
        split = f", {self.resident}/SM, {self.splits} splits of {self.split_len}" if c.decode else ""
        rot = [f"{side} rotated by {where}" for side, where in (("q", self.q_rotation), ("out", self.o_rotation)) if where]
        return (f"{'decode' if c.decode else 'fused'}: tile {t.block_m}x{t.block_n} {t.num_warps}w {t.num_stages}s"
                + (f" maxnreg {t.maxnreg}" if t.maxnreg else "") + split + f", {str(self.dot_dtype)[6:]} dots"
                + (", V pinned" if self.v_pin else "") + (", int8 PTX" if self.int8_ptx else "")
                + "".join(f", int8 {side} biased" for side, on in (("K", self.k_bias), ("V", self.v_bias)) if on)
                + (", int8 K by int8 MMA" if self.k_mma else "")
                + (", q as int8 per row" if self.q_int8 else "") + (", q as e4m3 per row" if self.q_fp8 else "")
                + (", P as e4m3" if self.pv_fp8 else "") + (", P as int8 per tile row" if self.pv_int8 else "")
                + "".join(f", {dot} fp8 sum to fp32 every {k[dot + '_FP8_ACC']}" for dot in ("QK", "PV")
                          if k[dot + "_FP8_ACC"])
                + (", V key-contiguous" if c.v_keys else "") + "".join(", " + r for r in rot)
                + (f", token stored by {self.store}" if self.store else "")
                + (", the tile read before q" if self.one_tile else ""))


def _one_tile_splits(split_len: int, tile: tiles.Tile) -> bool:
    """Whether every split is (at most) one key tile: the kernel's ONE_TILE path applies."""
    return split_len <= tile.block_n


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


_OVERRIDE: contextvars.ContextVar = contextvars.ContextVar("kvcompile_plan_override", default=None)


@contextlib.contextmanager
def override(**fields):
    """Inside the ``with``, every plan made is ``dataclasses.replace(plan, **fields)`` (tests and
    benchmarks: a forced tile, split count, dot type, V pin...). ``splits`` without ``split_len``
    gets whole tiles per split; a ``tile`` without ``splits`` is re-planned for its splits."""
    token = _OVERRIDE.set({**(_OVERRIDE.get() or {}), **fields})
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def plan(call: Call, tile: Optional[tiles.Tile] = None) -> LaunchPlan:
    """The plan of ``call`` (cached); ``tile`` replaces the table's (:func:`plan_of`'s fallback when
    Triton refuses a tile for lack of shared memory)."""
    fields = {**prefill_q(call.decode), **(_OVERRIDE.get() or {})}
    if fields:
        fields = dict(fields)
        tile = fields.pop("tile", tile)
        p = _plan(call, tile)
        if "splits" in fields and "split_len" not in fields:
            span = _span(call, p.tile)
            bn = p.tile.block_n
            fields["split_len"] = -(-(-(-span // fields["splits"])) // bn) * bn
            fields["splits"] = -(-span // fields["split_len"])
        p = dataclasses.replace(p, **fields)
        # a forced rotation place only where it applies: a rotated side, the generated matrix only
        # for the Sylvester one, a merge only when split
        q_rot, o_rot = p.q_rotation, p.o_rotation
        if call.k_rot == ROT_NONE or (q_rot == "kernel" and call.k_rot != ROT_SYLVESTER):
            q_rot = _plan(call, tile).q_rotation
        if call.v_rot == ROT_NONE:
            o_rot = _plan(call, tile).o_rotation
        if o_rot == "merge" and p.splits == 1:
            o_rot = "launch"
        store = p.store if p.store != "kernel" or _store_fits(call, p.tile) else "launch"  # e.g. a forced tile
        return dataclasses.replace(p, q_rotation=q_rot, o_rotation=o_rot, store=store)
    return _plan(call, tile)


@functools.lru_cache(maxsize=4096)
def _plan(call: Call, tile: Optional[tiles.Tile]) -> LaunchPlan:
    c = call
    native_fp8 = tiles.has_native_fp8(c.cc)
    k_fp8_bits = c.k_code == torch.float8_e4m3fn and not c.interpret and not native_fp8
    v_fp8_bits = c.v_code == torch.float8_e4m3fn and not c.interpret and not native_fp8
    dot_dtype = _dot_dtype(c)
    gpu16 = not c.interpret and dot_dtype == torch.float16
    # V widened by pinned PTX before its transpose (GPU, fp16 PV dot, codes the PTX decodes: int8 or
    # native e4m3; never for key-contiguous V, which needs no transpose). bench_kv.py, H200, 88147e6:
    # Triton's own placement of the convert reads V a byte per lane, fp8 B=8 L=32k 201.9 vs 190.5 us,
    # fp8/block32 638.0 vs 292.6.
    v_pin = gpu16 and not c.v_keys and not v_fp8_bits
    # int8 tiles widened by PTX four codes at a time (bench_kv.py, H200, 6e126b2: q8_0 decode 2.7-3% faster
    # than Triton's per-code arithmetic, which the interpreter keeps)
    int8_ptx = gpu16 and torch.int8 in (c.k_code, c.v_code)
    qb = dot_dtype.itemsize
    kb = vb = 1
    rows = c.Tq * (c.Hq // c.Hkv)
    if tile is None:
        if c.decode:
            tile = tiles.decode_tile(c.cc, c.D, qb, kb, vb, rows, c.v_keys, c.scale_bytes)
        else:
            tile = tiles.prefill_tile(c.cc, c.D, qb, kb, vb, c.v_keys, c.scale_bytes, k_fp8_bits or v_fp8_bits)
        if c.interpret:
            tile = dataclasses.replace(tile, block_m=min(tile.block_m, INTERPRET_TILE[0]), block_n=INTERPRET_TILE[1])
    # int8 tiles widened to 1152 + code: the fp16 subtraction, one per two codes (BLOCK_N * D / 2 per
    # tile and side), becomes a correction per score (K: one subtraction) or per P element (V: the
    # row sums of P, about two instructions each and a cross-warp reduction), BLOCK_M * BLOCK_N per
    # tile: fewer instructions only for decode tiles, faster only where enough programs hide the
    # reduction's latency (bench_kv.py --sweep, H200, 87306cd, docs/perf-log.md: +1-3% at B >= 4, -3% at B=1,
    # -4% in prefill). Not for block32 scales, which scale the widened tile (LaunchPlan.k_bias / v_bias).
    programs = c.B * c.Hkv * -(-rows // tile.block_m)  # per split
    # programs of this tile one SM holds at once: the decode split count fills whole waves of them
    resident = (tiles.programs_per_sm(tile, c.cc, tiles.smem_bytes(tile, c.D, qb, kb, vb, c.v_keys, c.scale_bytes))
                if c.decode else 1)
    if c.decode:
        splits, split_len = decode_splits(programs, _span(c, tile), tile.block_n, c.sms, resident)
    else:
        splits, split_len = 1, -(-c.L // tile.block_n) * tile.block_n
    decode_rows = 4 * tile.block_m <= _pow2(c.D)  # a decode tile's few query rows
    few_rows = decode_rows and programs > DECODE_SMALL_PROGRAMS
    # A decode program whose split is one key tile (few programs over a short cache: B=1 at 4k keys)
    # waits on q's prologue, then on that tile's reads; issued first, the reads overlap the prologue
    # (LaunchPlan.one_tile). bench_kv.py --sweep, H100, 55f1f31 (us, this plan / preload off): B=1 L=4k fp8 11.07 /
    # 11.00, int8 K rotated 11.00 / 11.95; B=1 L=1k fp8 7.29 / 7.61, int8 K rotated 7.58 / 8.74.
    preload = c.decode
    one_tile = preload and _one_tile_splits(split_len, tile)
    # Where many programs run, int8 K goes unwidened into int8 MMAs (LaunchPlan.k_mma): the decode loop
    # drops K's widening and its score correction for one int -> float convert per score (Triton 3.9
    # SASS, per tile pair: 765 instructions, 920 with K widened and both sides biased, fp8's 787). H200,
    # bench_kv.py --sweep at 5b0f37b (K rotated, us, this plan / K widened and both sides biased): B=8 L=32k 148.4 /
    # 154.9, B=32 L=8k 152.7 / 158.9, B=4 L=128k 289.0 / 303.4, B=8 L=4k 28.6 / 29.6. With few programs
    # q's split into int8 halves sits on the critical path (B=1 L=4k 11.9 forced against 11.5), unless
    # a one-tile split's reads overlap it: bench_kv.py --sweep, H100, 55f1f31, K rotated, us, MMA / K widened
    # exactly: B=1 L=4k 11.00 / 11.35, B=1 L=1k 7.58 / 8.03 (B=1 L=32k, eight tiles a split: 34.60 /
    # 34.45, not taken). The fused prefill too: its tile is compute-bound, and K's widening and its
    # staging through registers are the work int8 adds to fp8's; the q halves are made once per program.
    # H100, the prefill A/B before 9e48688 (h100_prefill_ab_9e48688.log; int8 K rotated, 16k cache, causal,
    # us, MMA / K widened exactly, fp8):
    # 512 new tokens 477.1 / 531.2, fp8 505.7; 1024 920.8 / 1037.3, 982.0; 2048 1759.4 / 2014.3, 1911.5.
    # Triton turns an int8 dot into MMAs from sm_80 on; below (Turing's T4, Volta) its fallback takes
    # no int8 operands and the compile fails, so K is widened there
    int8_mma = (few_rows or (decode_rows and one_tile) or not c.decode) and tuple(c.cc) >= (8, 0)
    # ... and with K by MMA, V's bias no longer pays (H200, the A/B before 5b0f37b, us, V biased / exact: B=8 L=4k
    # 29.5 / 28.8, B=4 L=8k 29.4 / 28.7, B=8 L=32k 141.2 / 142.2, B=32 L=8k 146.9 / 146.6): only an int8
    # V beside e4m3 K
    int8_bias = few_rows and c.k_code != torch.int8
    q_rot, o_rot = _rotations(c, splits)
    # The step's token (a ring's decode): stored by the attention kernel itself when one program per
    # split and kv head reads its slot (one query block) and the store kernel's in-register rotation
    # applies to each rotated side (the shared Sylvester matrix, token scales); else by a store launch.
    store = ("kernel" if _store_fits(c, tile) else "launch") if c.store else ""
    return LaunchPlan(call=c, tile=tile, resident=max(1, resident), splits=splits, split_len=split_len,
                      dot_dtype=dot_dtype, k_fp8_bits=k_fp8_bits, v_fp8_bits=v_fp8_bits, v_pin=v_pin,
                      int8_ptx=int8_ptx, int8_bias=int8_bias, int8_mma=int8_mma, q_rotation=q_rot, o_rotation=o_rot,
                      store=store, preload=preload)


def _dot_dtype(c: Call) -> torch.dtype:
    """The dtype of the kernel's dots."""
    if c.interpret or c.q_dtype == torch.float32:  # the interpreter: numpy underneath, no bf16 dot (tests run
        return torch.float32  # fp16 dots through override(dot_dtype=...))
    # fp16 dots for 16-bit q: e4m3 -> fp16 is one convert per two values and int8 -> fp16 a
    # magic-number add, and decode is bound by those instructions (bench_kv.py, H200, 9dfbe0c: dots
    # in bf16 took fp8 B=8 L=32k 267.8 instead of 201.5 us, q8_0 1061.9 instead of 301.2). A q
    # block beyond fp16's range is scaled by a power of two inside the kernel.
    return torch.float16


def _rotations(c: Call, splits: int) -> tuple[str, str]:
    """Where q's and the output's rotations run (``LaunchPlan.q_rotation`` / ``o_rotation``)."""
    # Rotations (int8's default; see kvcompile.rotation). q: with the shared Sylvester matrix of a
    # power-of-two head_dim, in decode, rotated in the kernel's prologue from H's generated +-1
    # entries (no launch, no read of R; the key loops compile as unrotated); otherwise by one
    # rotate_rows launch per call (prefill: amortized over its tokens). The output: by the split-K
    # merge (H generated there for the Sylvester matrix, else R read), or by one launch when the
    # call is not split. (Rotating each split's partial in the kernel's epilogue instead spilled
    # under the decode tile's register cap and lost end to end: bench_decode_e2e.py, H200, 489df26, B=8 ctx 32k, 2.467
    # against 2.133 ms per step.)
    q_rot = o_rot = ""
    if c.k_rot != ROT_NONE:
        q_rot = "kernel" if c.k_rot == ROT_SYLVESTER and c.decode else "launch"
    if c.v_rot != ROT_NONE:
        o_rot = "merge" if splits > 1 else "launch"
    return q_rot, o_rot


def _store_fits(c: Call, tile: tiles.Tile) -> bool:
    """Whether the attention kernel can store the step's token itself (:func:`_plan`)."""
    if not (c.store and c.decode and c.Tq == 1 and c.Hq // c.Hkv <= tile.block_m):
        return False
    return all(r == ROT_NONE or (r == ROT_SYLVESTER and c.scale_kind == SCALE_TOKEN) for r in (c.k_rot, c.v_rot))


def _span(c: Call, tile: tiles.Tile) -> int:
    """Keys the decode splits cover: the whole cache, or with a window the keys query 0 can see (from
    its window's first key, rounded down to a tile): a sliding layer plans like a full layer of the
    window's length."""
    if c.window and c.decode:
        return min(c.L, c.window + c.Tq - 1 + tile.block_n - 1)
    return c.L


# calls whose tile Triton refused for lack of shared memory -> the smaller tile that compiled
# (the shared-memory model in tiles.py is an estimate; Triton has the last word)
_SHRUNK: dict = {}


def plan_of(call: Call) -> LaunchPlan:
    """The plan the launcher runs for ``call``: the table's, or the smaller tile that compiled (:func:`shrink`)."""
    return plan(call, _SHRUNK.get(call))


def shrink(call: Call, refused: tiles.Tile) -> bool:
    """Triton refused ``refused`` for ``call`` (out of shared memory): plan the next smaller tile
    from now on (one stage fewer, then half the keys, then half the queries). False: none is left."""
    smaller = _smaller_tile(refused)
    if smaller is None:
        return False
    _SHRUNK[call] = smaller
    return True


def _smaller_tile(tile: tiles.Tile) -> Optional[tiles.Tile]:
    if tile.num_stages > 2:
        return dataclasses.replace(tile, num_stages=tile.num_stages - 1)
    if tile.block_n > 16:
        return dataclasses.replace(tile, block_n=tile.block_n // 2)
    if tile.block_m > 16:
        return dataclasses.replace(tile, block_m=tile.block_m // 2)
    return None
