"""@triton.jit attention over 8-bit K/V codes (launchers in attention_launcher.py).

One kernel serves prefill/extend (grid over query blocks, one split) and split-K decode
(flash-decoding: grid over splits of the cache, partial outputs merged by ``_merge_kernel``).
Rows of a program are (query index, query head) pairs of ONE kv head: row r is query ``r // GROUP``
of head ``hk * GROUP + r % GROUP``, so each K/V tile is read once for all heads that share it (GQA).

Scales never enter the 8-bit tiles (per-token formats): the QK^T tile's columns are scaled by
s_k, P by s_v before the PV dot, and the running denominator sums the unscaled p. The tile is
widened to 16 bits (exact for e4m3 and int8) into ``tl.dot``; accumulation is fp32. int8 may be
widened to 1152 + code (``K_BIAS`` / ``V_BIAS``), the dots corrected by 1152 sum(q) / rowsum(P).
int8 K may instead go unwidened into int8 MMAs (``K_MMA``): the prologue splits q into two int8
halves, q = t (254 hi + lo) with t one step per program (folded into the softmax scale), and the
two int32 dots sum exactly. Or, not exact, q is quantized per row after its rotation (``Q_INT8``: int8
codes at amax / 127, one int32 dot; ``Q_FP8``: e4m3 codes against e4m3 K on fp8 MMAs), the row's scale
applied to the scores, and P too (``P_FP8``: e4m3 P * s_v / max s_v against key-contiguous e4m3 V codes,
FlashAttention-3's fp8 recipe): ``_tile_parts._q_rows``, ``plan.LaunchPlan.q_quant``.
V is reduced over keys in ``P @ V``. Stored key-contiguous (``V_KEYS_CONTIG``: QuantizedCache's
layout for token and static scales) it feeds the dot like K, read in whole 16-key chunks (16-byte
loads). Stored head_dim-contiguous, the GPU widens it by pinned inline PTX before its shared-memory
transpose (``V_PIN``: ``_codes.codes_to_f16_pinned``); other int8 tiles by the same PTX unpinned
(``INT8_PTX``). K and V may hold different code types. block32 formats dequantize the tile (codes *
scale of each 32-wide slice) before the dot; static scales: K's folded into the softmax scale, V's
applied once at the end.
Keys are walked in loops over one tile step (``_attend_tile``): with a sliding window
(``HAS_WINDOW``) first the masked tiles at the window's lower edge (every tile wholly below it is
skipped, and split-K splits start at the window), then the tiles every row of the program sees in
full, with no masking at all, then (not pipelined) the at most two tiles that need the length /
causal / user mask. Softcap (``HAS_SOFTCAP``) bends the scaled logits before the mask; sinks
(``HAS_SINKS``) join the softmax denominator once per row, in the epilogue or, when split, in
``_merge_kernel``. All three switches off, the kernel compiles to the code it had without them.
Rotated caches (codes of ``x @ R``): with the shared Sylvester Hadamard matrix (power-of-two
head_dim) the kernel rotates q in its prologue (``Q_HADAMARD``), generating H's +-1 entries in
registers (``_rotation.py``): no launch and no read of R. A rotated V's output goes back through
R^T in the merge or in a launch after this kernel; any other R for q in a launch before (``plan.py``).
A decode split of one key tile (``ONE_TILE``: few programs over a short cache) issues that tile's
reads before q's prologue, so that their latency overlaps q's load and rotation, and scores it on
the masked path.
A decode step that also stores its token (``STORE_NEW``: a sliding layer's ring, ``kvcompile/ring.py``)
quantizes it in the one program whose split holds its slot, by the store kernel's own row quantizer
(``_store_kernel.store_token``), before that program reads any key: no store launch.
"""

import triton
import triton.language as tl

from ._codes import codes_to, codes_to_f16_pinned, to_store_dtype
from ._rotation import hadamard_rows
from ._store_kernel import store_token
from ._tile_parts import (LOG2E, MASK_ADD, MASK_BOOL, MASK_NONE, P_FP8_HEADROOM, PV_HEADROOM, SCALE_BLOCK,  # noqa: F401
                          SCALE_STATIC, SCALE_TOKEN, _held, _keys_end, _kv_bases, _load_k, _load_scales, _load_v,
                          _e4m3, _finite_v, _fp8_dot, _p_rows_int8, _q_in_fp16_range, _q_int8_halves, _q_rows,
                          _scale_groups, _tanh)


@triton.jit
def _attend_tile(
    acc, l_i, m_i, v_prev, start_n, n_hi, q, q_lo, q_bias, qk_scale, row_ok, q_pos, win_lo, softcap, inv_softcap,
    d, d_ok, D,
    k_base, stride_kn, stride_kd, v_base, stride_vn, stride_vd, ks_base, stride_ksn, stride_ksg,
    vs_base, stride_vsn, stride_vsg, m_base, stride_mn, pre,
    GROUP_SIZE: tl.constexpr, SCALE_KIND: tl.constexpr, MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    K_FP8_BITS: tl.constexpr, V_FP8_BITS: tl.constexpr, DOT_DTYPE: tl.constexpr,
    V_PIN: tl.constexpr, V_KEYS_CONTIG: tl.constexpr, INT8_PTX: tl.constexpr, K_BIAS: tl.constexpr,
    V_BIAS: tl.constexpr, K_MMA: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of the tile is visible to every row (see the caller)
    PRELOADED: tl.constexpr,  # ``pre`` holds the tile's reads, (K codes, K scales, V codes, V scales)
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, Q_INT8: tl.constexpr, Q_FP8: tl.constexpr, P_FP8: tl.constexpr,
    P_INT8: tl.constexpr, E4M3_RNE: tl.constexpr, QK_FP8_ACC: tl.constexpr, PV_FP8_ACC: tl.constexpr,
):
    """One BLOCK_N-key tile of the online softmax: returns the updated (acc, l_i, m_i, v_prev). Its reads
    are :func:`_load_k` and :func:`_load_v` (``MASKED`` alike), made here or, ``PRELOADED``, given.

    ``win_lo`` [BLOCK_M]: each row's first visible key (read with HAS_WINDOW by masked tiles only);
    ``softcap`` / ``inv_softcap``: c and 1 / c (HAS_SOFTCAP). Q_INT8 / Q_FP8: ``q_lo`` is each row's scale.
    """
    FOLD_V_MAX: tl.constexpr = SCALE_KIND == SCALE_TOKEN and DOT_DTYPE == tl.float16
    n = start_n + tl.arange(0, BLOCK_N)
    if MASKED:
        n_ok = n < n_hi
    # ---- S = Q K^T, the scale kept out of the K tile (token) or folded in (static) ----
    if PRELOADED:
        kc, ks, vc, vs = pre
    else:
        kc = _load_k(start_n, n_hi, d, d_ok, k_base, stride_kn, stride_kd, MASKED, BLOCK_N)
    if SCALE_KIND == SCALE_BLOCK:
        if not PRELOADED:
            ks = _load_scales(start_n, n_hi, D, ks_base, stride_ksn, stride_ksg, GROUP_SIZE, SCALE_KIND, MASKED,
                              BLOCK_N, BLOCK_D)
        k = codes_to(kc, DOT_DTYPE, K_FP8_BITS, INT8_PTX).to(tl.float32)
        k = _scale_groups(k, ks.to(tl.float32), BLOCK_N, BLOCK_D, GROUP_SIZE).to(DOT_DTYPE)
    elif K_MMA or Q_INT8 or Q_FP8:
        k = kc  # 8-bit codes straight into the 8-bit MMA
    else:
        k = codes_to(kc, DOT_DTYPE, K_FP8_BITS, INT8_PTX, K_BIAS)  # e4m3 / int8 -> 16 bits is exact
    if K_MMA:  # q = t (254 q_hi + q_lo) (the prologue; t is in qk_scale): exact int32 sums, |s| < 2^30
        s = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
        s = tl.dot(q_lo, tl.trans(k), s * 254, out_dtype=tl.int32).to(tl.float32)
    elif Q_INT8:  # q's codes at one scale per row (q_lo): one 8-bit dot, int32 exact
        s = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32) * q_lo[:, None]
    elif Q_FP8:  # ... or on the fp8 MMAs, fp32
        s = _fp8_dot(q, tl.trans(k), None, QK_FP8_ACC) * q_lo[:, None]
    elif DOT_DTYPE == tl.float32:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if K_BIAS:  # the int8 K tile arrived as 1152 + code: q . (1152 + k) - 1152 sum(q) = q . k
        s = s - q_bias[:, None]
    if SCALE_KIND == SCALE_TOKEN:
        if not PRELOADED:
            ks = _load_scales(start_n, n_hi, D, ks_base, stride_ksn, stride_ksg, GROUP_SIZE, SCALE_KIND, MASKED,
                              BLOCK_N, BLOCK_D)
        s = s * (ks.to(tl.float32) * qk_scale)[None, :]
    else:
        s = s * qk_scale
    if HAS_SOFTCAP:  # s is the scaled logit here (natural-log units): c * tanh(s / c), before the mask
        s = softcap * _tanh(s * inv_softcap)

    # ---- visibility: length, causal, window, mask ----
    if MASKED:
        valid = row_ok[:, None] & n_ok[None, :]
        if IS_CAUSAL:
            valid = valid & (n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            valid = valid & (n[None, :] >= win_lo[:, None])
        if MASK_KIND == MASK_BOOL:
            mv = tl.load(m_base + n[None, :] * stride_mn, mask=valid, other=0)
            valid = valid & (mv != 0)
        if MASK_KIND == MASK_ADD:
            s = s + tl.load(m_base + n[None, :] * stride_mn, mask=valid, other=0.0).to(tl.float32)
        s = tl.where(valid, s, float("-inf"))

    # ---- online softmax (natural-log units; exp via exp2) ----
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # an all-masked row so far
    alpha = tl.math.exp2((m_i - m_safe) * LOG2E)
    p = tl.math.exp2((s - m_safe[:, None]) * LOG2E)
    l_i = l_i * alpha + tl.sum(p, axis=1)  # the denominator sums the unscaled p
    if not FOLD_V_MAX:
        acc = acc * alpha[:, None]

    # ---- O += P V, s_v applied to P (token) or to the tile (block32) ----
    if not PRELOADED:
        vc = _load_v(start_n, n_hi, d, d_ok, v_base, stride_vn, stride_vd, V_KEYS_CONTIG, MASKED, BLOCK_N)
    if SCALE_KIND == SCALE_BLOCK:
        if not PRELOADED:
            vs = _load_scales(start_n, n_hi, D, vs_base, stride_vsn, stride_vsg, GROUP_SIZE, SCALE_KIND, MASKED,
                              BLOCK_N, BLOCK_D)
        if V_PIN:
            v = codes_to_f16_pinned(vc).to(tl.float32)
        else:
            v = codes_to(vc, DOT_DTYPE, V_FP8_BITS, INT8_PTX).to(tl.float32)
        v = _scale_groups(v, vs.to(tl.float32), BLOCK_N, BLOCK_D, GROUP_SIZE).to(DOT_DTYPE)
        pv = p.to(DOT_DTYPE)
    else:
        if V_PIN:
            v = codes_to_f16_pinned(vc)
        elif P_FP8 or P_INT8:
            v = vc
        else:
            v = codes_to(vc, DOT_DTYPE, V_FP8_BITS, INT8_PTX, V_BIAS)
        if SCALE_KIND == SCALE_TOKEN:
            if not PRELOADED:
                vs = _load_scales(start_n, n_hi, D, vs_base, stride_vsn, stride_vsg, GROUP_SIZE, SCALE_KIND, MASKED,
                                  BLOCK_N, BLOCK_D)
            vs = vs.to(tl.float32)
            if DOT_DTYPE == tl.float16:
                # fp16 has no room for p * s_v (s_v ~ amax / 448 underflows): scale P by s_v / max(s_v)
                # of this tile (<= 1) times PV_HEADROOM, and the tile's PV product by max(s_v) in fp32
                v_max = tl.max(vs, axis=0)
                v_max = tl.where(v_max > 0, v_max, 1.0)
                if P_FP8:  # e4m3 P (times P_FP8_HEADROOM <= 448) against V's e4m3 codes: fp8 MMAs
                    pv = _e4m3(p * (vs * (P_FP8_HEADROOM / v_max))[None, :], E4M3_RNE)
                elif P_INT8:  # int8 P at a scale per row against V's int8 codes: one int32 dot
                    pv, p_scale = _p_rows_int8(p * (vs / v_max)[None, :])
                    # no int8 holds a NaN: a NaN V scale (an Inf or NaN stored) reaches every row through
                    # l_i, as 0 x NaN reaches them in the 16-bit P V; a NaN p already sums into l_i
                    l_i += 0.0 * tl.sum(vs, axis=0)
                else:
                    pv = (p * (vs * (PV_HEADROOM / v_max))[None, :]).to(DOT_DTYPE)
            else:
                pv = (p * vs[None, :]).to(DOT_DTYPE)
        else:
            pv = p.to(DOT_DTYPE)
    if MASKED and V_KEYS_CONTIG and vc.dtype != tl.int8:  # e4m3 codes past n_hi may be NaN (_finite_v)
        v = _finite_v(v, n_ok, SCALE_KIND, P_FP8)
    if DOT_DTYPE == tl.float32:
        acc += tl.dot(pv, v, input_precision="ieee")
    else:
        if FOLD_V_MAX:  # the rescale rides on the dot's accumulator input: no separate pass over acc
            acc = acc * (alpha * (v_prev / v_max))[:, None]
            v_prev = v_max
        if V_BIAS:  # V arrived as 1152 + code: P (1152 + v) - 1152 rowsum(P) = P v, summing the fp16 P the dot sees
            acc = acc - 1152.0 * tl.sum(pv.to(tl.float32), axis=1)[:, None]
        if P_FP8:
            acc = _fp8_dot(pv, v, acc, PV_FP8_ACC)
        elif P_INT8:  # the exact int32 sum at the row's scale (times PV_HEADROOM, as the fp16 P carries it)
            acc += tl.dot(pv, v, out_dtype=tl.int32).to(tl.float32) * (p_scale * PV_HEADROOM)[:, None]
        elif FOLD_V_MAX or V_BIAS:
            acc = tl.dot(pv, v, acc)
        else:
            acc += tl.dot(pv, v)
    m_i = m_new
    return acc, l_i, m_i, v_prev


@triton.jit
def _attention_kernel(
    Q, stride_qb, stride_qh, stride_qm, stride_qd,
    K, stride_kb, stride_kh, stride_kn, stride_kd,
    V, stride_vb, stride_vh, stride_vn, stride_vd,
    KS, stride_ksb, stride_ksh, stride_ksn, stride_ksg,
    VS, stride_vsb, stride_vsh, stride_vsn, stride_vsg,
    KVLEN, stride_kvl,
    MASK, stride_mb, stride_mh, stride_mm, stride_mn,
    SINKS, stride_sink,                                  # [Hq] extra logit per query head (HAS_SINKS)
    O, stride_ob, stride_oh, stride_om, stride_od,
    OP, stride_opb, stride_oph, stride_opm, stride_ops,  # partial outputs [B, Hq, Tq, S, D] fp32
    LSE, stride_lb, stride_lh, stride_lm, stride_ls,     # their log2-sum-exp [B, Hq, Tq, S]
    Hkv, Tq, D, sm_scale, split_len, window, softcap, rot_scale,  # rot_scale: 1 / sqrt(D) (Q_HADAMARD)
    n_keys,  # the cache's L: keys past it are never read, whatever kv_len says (a ring's token count)
    # STORE_NEW: the step's token ([B, Hkv, 1, D] raw K and V), the caches as the store writes them (e4m3 as
    # uint8 bits) and K's centering offset [Hkv, D]
    KN, stride_knb, stride_knh, stride_knt, stride_knd,
    VN, stride_vnb, stride_vnh, stride_vnt, stride_vnd,
    KW, stride_kwb, stride_kwh, stride_kwn, stride_kwd,
    VW, stride_vwb, stride_vwh, stride_vwn, stride_vwd,
    OFF, stride_offh, stride_offd,
    GROUP: tl.constexpr,         # query heads per kv head
    GROUP_SIZE: tl.constexpr,    # values per scale group (block32: 32)
    SCALE_KIND: tl.constexpr,    # SCALE_TOKEN / SCALE_BLOCK / SCALE_STATIC
    MASK_KIND: tl.constexpr,     # MASK_NONE / MASK_BOOL / MASK_ADD
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,    # a query at p sees keys > p - window only; splits start at the window
    HAS_SOFTCAP: tl.constexpr,   # logits become softcap * tanh(logit / softcap)
    HAS_SINKS: tl.constexpr,     # SINKS[h] joins the softmax denominator (in the merge when split)
    SPLIT_OUTPUT: tl.constexpr,  # write partial outputs + LSE for _merge_kernel
    K_FP8_BITS: tl.constexpr,    # K's e4m3 codes arrive as uint8 bits (no fp8 type on this arch)
    V_FP8_BITS: tl.constexpr,    # V's e4m3 codes arrive as uint8 bits (K and V may differ in code type)
    DOT_DTYPE: tl.constexpr,     # operand type of both dots: fp16 (P scaled by s_v / max s_v), or fp32
    V_PIN: tl.constexpr,         # widen V by pinned inline PTX before its smem transpose (GPU; _codes.py)
    V_KEYS_CONTIG: tl.constexpr,  # V codes key-contiguous (stride_vn == 1; QuantizedCache's token / static layout)
    INT8_PTX: tl.constexpr,      # widen int8 tiles to fp16 by inline PTX, four at a time (GPU; _codes.codes_to)
    K_BIAS: tl.constexpr,        # int8 K widened to 1152 + code (no subtraction), S corrected by 1152 sum(q) per row
    V_BIAS: tl.constexpr,        # int8 V likewise, the PV product corrected by 1152 rowsum(P)
    K_MMA: tl.constexpr,         # int8 K unwidened into int8 MMAs with q's two int8 halves (_q_int8_halves)
    Q_INT8: tl.constexpr,        # ... or with q's int8 codes at a scale per row (_q_rows): one dot, not exact
    Q_FP8: tl.constexpr,         # e4m3 K unwidened into fp8 MMAs with q's e4m3 codes at a scale per row
    P_FP8: tl.constexpr,         # e4m3 P (s_v folded in, token scales) against e4m3 V codes: fp8 MMAs
    P_INT8: tl.constexpr,        # int8 P at a scale per row (s_v folded in, token scales) against int8 V codes
    E4M3_RNE: tl.constexpr,      # ... those e4m3 roundings made exact in fp32 first (the interpreter's cast)
    QK_FP8_ACC: tl.constexpr,    # Q_FP8's dot promotes its sum to fp32 every QK_FP8_ACC products (0: Triton's default)
    PV_FP8_ACC: tl.constexpr,    # P_FP8's dot likewise (_fp8_dot)
    Q_HADAMARD: tl.constexpr,    # q times H_D / sqrt(D) in the prologue (K stored rotated by it)
    ROT_CHUNK: tl.constexpr,     # columns per dot of that product
    ROT_EXACT: tl.constexpr,     # that product as fp32 FMA dots (interpreter, fp32 q) instead of 16-bit MMAs
    STORE_NEW: tl.constexpr,     # decode: quantize the step's token into slot (kv_len - 1) % n_keys first
    STORE_OFFSET: tl.constexpr,  # ... K centered by OFF before quantizing
    STORE_HW_E4M3: tl.constexpr,  # ... e4m3 encoded by the sm_89+ convert (_store_kernel.py)
    STORE_K_HADAMARD: tl.constexpr,  # ... K rotated by H_D / sqrt(D) before quantizing
    STORE_V_HADAMARD: tl.constexpr,  # ... V likewise
    STORE_K_CODE: tl.constexpr, STORE_V_CODE: tl.constexpr,  # ... K's, V's format (FormatSpec.id)
    ONE_TILE: tl.constexpr,      # each split is one tile (split_len <= BLOCK_N): its reads go before q's prologue
    HOLD_TILE: tl.constexpr,     # ... and its staging for the dots after it (GPU: _held)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    kv_len = tl.load(KVLEN + b * stride_kvl).to(tl.int32)
    kv_end = tl.minimum(kv_len, n_keys)  # the keys stored

    if HAS_WINDOW:
        # Splits cover the keys query 0 of this row can see, from its window's first key rounded
        # down to a tile (the launcher planned them for that span, not the whole cache): a sliding
        # layer's decode reads and launches as for a cache of the window's length.
        n_lo = tl.maximum(kv_len - Tq - window + 1, 0) // BLOCK_N * BLOCK_N + split * split_len
        # the first key the program's first row (its lowest query) sees
        win_first = kv_len - Tq + (pid_m * BLOCK_M) // GROUP - window + 1
    else:
        n_lo = split * split_len
    if SPLIT_OUTPUT:
        if n_lo >= kv_end:  # a split past the current length: nothing to do, the merge skips it
            return
        if HAS_WINDOW:
            if n_lo + split_len <= win_first:  # wholly below every row's window: the merge skips it too
                return

    if STORE_NEW:
        # The step's token goes to slot (kv_len - 1) % n_keys (a ring's, or a full cache's kv_len - 1),
        # written by the one program whose split holds it (the plan makes one query block per kv head),
        # as the store kernel writes it, before that program reads its keys: the store's launch saved.
        # The barrier orders the program's own writes before its tile loads; no other program reads the slot.
        slot = (kv_len - 1) % n_keys
        if (slot >= n_lo) & (slot < n_lo + split_len):
            store_token(KN, stride_knb, stride_knh, stride_knt, stride_knd,
                        VN, stride_vnb, stride_vnh, stride_vnt, stride_vnd,
                        KW, stride_kwb, stride_kwh, stride_kwn, stride_kwd,
                        VW, stride_vwb, stride_vwh, stride_vwn, stride_vwd,
                        KS, stride_ksb, stride_ksh, stride_ksn, stride_ksg,
                        VS, stride_vsb, stride_vsh, stride_vsn, stride_vsg,
                        OFF, stride_offh, stride_offd, b, hk, slot, D, rot_scale,
                        STORE_OFFSET, SCALE_KIND == SCALE_STATIC, SCALE_KIND == SCALE_BLOCK, STORE_HW_E4M3,
                        STORE_K_HADAMARD, STORE_V_HADAMARD, ROT_EXACT, ROT_CHUNK, GROUP_SIZE, BLOCK_D, STORE_K_CODE, STORE_V_CODE)
            tl.debug_barrier()

    # ---- rows of this program: (query index, query head) pairs of kv head hk ----
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // GROUP
    h = hk * GROUP + rows % GROUP
    row_ok = qi < Tq
    q_pos = kv_len - Tq + qi  # absolute position of each query (causal is bottom-right aligned)
    win_lo = q_pos - window + 1  # each row's first visible key (HAS_WINDOW)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    # ---- keys this program reads: its split, cut at kv_len and (causal) at its last query ----
    last_q = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, Tq * GROUP - 1) // GROUP
    if ONE_TILE:
        # The split is one tile: its reads are issued before q's prologue (q's load, its rotation), so
        # that the two latencies overlap instead of adding up. Masked, which serves any tile.
        n_hi = _keys_end(kv_len, kv_end, n_lo, split_len, Tq, last_q, IS_CAUSAL)
        k_base, v_base, ks_base, vs_base = _kv_bases(K, V, KS, VS, b, hk, stride_kb, stride_kh, stride_vb, stride_vh,
                                                     stride_ksb, stride_ksh, stride_vsb, stride_vsh)
        first = (_load_k(n_lo, n_hi, d, d_ok, k_base, stride_kn, stride_kd, True, BLOCK_N),
                 _load_scales(n_lo, n_hi, D, ks_base, stride_ksn, stride_ksg, GROUP_SIZE, SCALE_KIND, True, BLOCK_N,
                              BLOCK_D),
                 _load_v(n_lo, n_hi, d, d_ok, v_base, stride_vn, stride_vd, V_KEYS_CONTIG, True, BLOCK_N),
                 _load_scales(n_lo, n_hi, D, vs_base, stride_vsn, stride_vsg, GROUP_SIZE, SCALE_KIND, True, BLOCK_N,
                              BLOCK_D))

    q_rows = Q + b * stride_qb + h[:, None] * stride_qh + qi[:, None] * stride_qm
    if Q_HADAMARD:  # scores against K's rotated codes: (q H)(k H)^T = q k^T
        q = hadamard_rows(q_rows, stride_qd, row_ok[:, None], rot_scale, ROT_EXACT, BLOCK_M, BLOCK_D, ROT_CHUNK)
    else:
        q = tl.load(q_rows + d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_unscale = 1.0
    q_lo = 0
    q_nan = 0.0
    Q_CODES: tl.constexpr = K_MMA or Q_INT8 or Q_FP8  # q goes into the dots as 8-bit codes
    if Q_INT8 or Q_FP8:  # q_lo: each row's scale
        q, q_lo, q_nan = _q_rows(q, Q_FP8, E4M3_RNE)
    elif K_MMA:
        q, q_lo, q_unscale, q_nan = _q_int8_halves(q)
    elif DOT_DTYPE == tl.float16 and q.dtype != tl.float16:  # a block beyond fp16's range, scaled
        q, q_unscale = _q_in_fp16_range(q)
    if not Q_CODES:
        q = q.to(DOT_DTYPE)
    q_bias = 0.0
    if K_BIAS:  # 1152 * sum(q) of the values the dot sees, once per program (_attend_tile subtracts it)
        q_bias = 1152.0 * tl.sum(q.to(tl.float32), axis=1)

    if not ONE_TILE:  # here, after the prologue, they hold no registers through it
        n_hi = _keys_end(kv_len, kv_end, n_lo, split_len, Tq, last_q, IS_CAUSAL)
        k_base, v_base, ks_base, vs_base = _kv_bases(K, V, KS, VS, b, hk, stride_kb, stride_kh, stride_vb, stride_vh,
                                                     stride_ksb, stride_ksh, stride_vsb, stride_vsh)
    qk_scale = sm_scale * q_unscale
    if SCALE_KIND == SCALE_STATIC:
        qk_scale = qk_scale * tl.load(KS + hk * stride_ksh).to(tl.float32)
    inv_softcap = 1.0
    if HAS_SOFTCAP:
        inv_softcap = 1.0 / softcap
    m_base = MASK + b * stride_mb + h[:, None] * stride_mh + qi[:, None] * stride_mm

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # token scales with an fp16 PV dot: P is scaled by s_v / v_max of each tile (x PV_HEADROOM), so acc
    # holds O * PV_HEADROOM / v_max of the last tile and is rescaled by alpha * v_max_prev / v_max as
    # the dot's accumulator input
    FOLD_V_MAX: tl.constexpr = SCALE_KIND == SCALE_TOKEN and DOT_DTYPE == tl.float16
    v_prev = 1.0

    if ONE_TILE:
        if HOLD_TILE:
            first = (_held(first[0]), first[1], _held(first[2]), first[3])
        acc, l_i, m_i, v_prev = _attend_tile(
            acc, l_i, m_i, v_prev, n_lo, n_hi, q, q_lo, q_bias, qk_scale, row_ok, q_pos, win_lo, softcap,
            inv_softcap, d, d_ok, D,
            k_base, stride_kn, stride_kd, v_base, stride_vn, stride_vd, ks_base, stride_ksn, stride_ksg,
            vs_base, stride_vsn, stride_vsg, m_base, stride_mn, first,
            GROUP_SIZE, SCALE_KIND, MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, K_FP8_BITS, V_FP8_BITS,
            DOT_DTYPE, V_PIN, V_KEYS_CONTIG, INT8_PTX, K_BIAS, V_BIAS, K_MMA, True, True, BLOCK_N,
            BLOCK_D, Q_INT8, Q_FP8, P_FP8, P_INT8, E4M3_RNE, QK_FP8_ACC, PV_FP8_ACC)
    else:
        # Key tiles in up to three loops (module docstring), each from a multiple of BLOCK_N: the window's
        # edge (from the first row's first visible key to the LAST row's, masked), the tiles every row
        # sees in full (no length / causal / window / mask test, whole-tile loads, no NaN clearing of V),
        # and the rest (the last tile of a split, a causal block's diagonal), masked.
        n_start = n_lo
        if HAS_WINDOW:
            n_start = tl.maximum(n_lo, tl.maximum(win_first, 0) // BLOCK_N * BLOCK_N)
        n_full = n_start
        if MASK_KIND == MASK_NONE:
            n_body = n_start
            if HAS_WINDOW:
                # The first tile inside every row's window: the one at or above the last row's first key.
                # Not cut at n_hi, so the compiler sees a multiple of BLOCK_N (aligned, vectorized and
                # pipelined loads in the loops below); a tile past n_hi is masked out in full, and one
                # past the last row's first key is only reached by a split the row's window ends in.
                win_last = kv_len - Tq + last_q - window + 1
                n_body = tl.maximum(n_start, (tl.maximum(win_last, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
                for start_n in tl.range(n_start, n_body, BLOCK_N, num_stages=1):  # window edge: not pipelined
                    acc, l_i, m_i, v_prev = _attend_tile(
                        acc, l_i, m_i, v_prev, start_n, n_hi, q, q_lo, q_bias, qk_scale, row_ok, q_pos, win_lo, softcap,
                        inv_softcap, d, d_ok, D,
                        k_base, stride_kn, stride_kd, v_base, stride_vn, stride_vd, ks_base, stride_ksn, stride_ksg,
                        vs_base, stride_vsn, stride_vsg, m_base, stride_mn, 0,
                        GROUP_SIZE, SCALE_KIND, MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, K_FP8_BITS, V_FP8_BITS,
                        DOT_DTYPE, V_PIN, V_KEYS_CONTIG, INT8_PTX, K_BIAS, V_BIAS, K_MMA, True, False, BLOCK_N,
                        BLOCK_D, Q_INT8, Q_FP8, P_FP8, P_INT8, E4M3_RNE, QK_FP8_ACC, PV_FP8_ACC)
            n_vis = n_hi
            if IS_CAUSAL:
                n_vis = tl.minimum(n_vis, kv_len - Tq + (pid_m * BLOCK_M) // GROUP + 1)
            n_full = n_body + tl.maximum(n_vis - n_body, 0) // BLOCK_N * BLOCK_N
            for start_n in range(n_body, n_full, BLOCK_N):
                acc, l_i, m_i, v_prev = _attend_tile(
                    acc, l_i, m_i, v_prev, start_n, n_hi, q, q_lo, q_bias, qk_scale, row_ok, q_pos, win_lo, softcap,
                    inv_softcap, d, d_ok, D,
                    k_base, stride_kn, stride_kd, v_base, stride_vn, stride_vd, ks_base, stride_ksn, stride_ksg,
                    vs_base, stride_vsn, stride_vsg, m_base, stride_mn, 0,
                    GROUP_SIZE, SCALE_KIND, MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, K_FP8_BITS, V_FP8_BITS,
                    DOT_DTYPE, V_PIN, V_KEYS_CONTIG, INT8_PTX, K_BIAS, V_BIAS, K_MMA, False, False, BLOCK_N,
                    BLOCK_D, Q_INT8, Q_FP8, P_FP8, P_INT8, E4M3_RNE, QK_FP8_ACC, PV_FP8_ACC)
        for start_n in tl.range(n_full, n_hi, BLOCK_N, num_stages=1):  # at most 2 tiles without a mask: not pipelined
            acc, l_i, m_i, v_prev = _attend_tile(
                acc, l_i, m_i, v_prev, start_n, n_hi, q, q_lo, q_bias, qk_scale, row_ok, q_pos, win_lo, softcap,
                inv_softcap, d, d_ok, D,
                k_base, stride_kn, stride_kd, v_base, stride_vn, stride_vd, ks_base, stride_ksn, stride_ksg,
                vs_base, stride_vsn, stride_vsg, m_base, stride_mn, 0,
                GROUP_SIZE, SCALE_KIND, MASK_KIND, IS_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, K_FP8_BITS, V_FP8_BITS,
                DOT_DTYPE, V_PIN, V_KEYS_CONTIG, INT8_PTX, K_BIAS, V_BIAS, K_MMA, True, False, BLOCK_N,
                BLOCK_D, Q_INT8, Q_FP8, P_FP8, P_INT8, E4M3_RNE, QK_FP8_ACC, PV_FP8_ACC)

    # ---- epilogue: rows with no visible key give zeros ----
    has_key = l_i > 0
    den = l_i
    if HAS_SINKS and not SPLIT_OUTPUT:  # unsplit: the sink joins the denominator here (else in the merge)
        sink = tl.load(SINKS + h * stride_sink, mask=row_ok, other=0.0).to(tl.float32)
        den = l_i + tl.math.exp2((sink - m_i) * LOG2E)  # l_i is relative to exp(m_i); inf past range: out -> 0
    out = acc / tl.where(has_key, den, 1.0)[:, None]
    if FOLD_V_MAX:
        out = out * (v_prev / (P_FP8_HEADROOM if P_FP8 else PV_HEADROOM))
    if P_INT8:  # a NaN p or V scale seen, which int8 P cannot carry: l_i is NaN there
        out = out + 0.0 * l_i[:, None]
    if Q_CODES:
        out = out + q_nan[:, None]
    out_ok = row_ok[:, None] & d_ok[None, :]
    if SPLIT_OUTPUT:
        lse = tl.where(has_key, m_i * LOG2E + tl.math.log2(tl.where(has_key, l_i, 1.0)), float("-inf"))
        tl.store(OP + b * stride_opb + h[:, None] * stride_oph + qi[:, None] * stride_opm + split * stride_ops
                 + d[None, :], out, mask=out_ok)
        tl.store(LSE + b * stride_lb + h * stride_lh + qi * stride_lm + split * stride_ls, lse, mask=row_ok)
    else:
        if SCALE_KIND == SCALE_STATIC:
            out = out * tl.load(VS + hk * stride_vsh).to(tl.float32)
        tl.store(O + b * stride_ob + h[:, None] * stride_oh + qi[:, None] * stride_om + d[None, :] * stride_od,
                 to_store_dtype(out, O.dtype.element_ty), mask=out_ok)
