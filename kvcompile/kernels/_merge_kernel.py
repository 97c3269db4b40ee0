"""@triton.jit merge of split-K decode (launched by attention_launcher.py after ``_attention_kernel``):
the partial outputs of one query row's splits combined by their log-sum-exp; a sink logit joins
the denominator once; a rotated V's output is multiplied by R_V^T on the way out.
"""

import triton
import triton.language as tl

from ._tile_parts import LOG2E
from ._codes import to_store_dtype
from ._rotation import sylvester_sign


@triton.jit
def _merge_kernel(
    OP, stride_opb, stride_oph, stride_opm, stride_ops,
    LSE, stride_lb, stride_lh, stride_lm, stride_ls,
    O, stride_ob, stride_oh, stride_om, stride_od,
    KVLEN, stride_kvl,
    VS, stride_vsh,
    SINKS, stride_sink,
    R_V, rot_scale,             # R_V [D, D] (read unless R_SYLVESTER); 1 / sqrt(D)
    Hq, Tq, D, split_len, num_splits, window, n_keys,  # n_keys: the cache's L (as _attention_kernel)
    GROUP: tl.constexpr,
    STATIC_SCALE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,   # splits start at the window (as in _attention_kernel, same BLOCK_N)
    HAS_SINKS: tl.constexpr,    # SINKS[h] joins the denominator once per row
    HAS_V_ROT: tl.constexpr,    # the partials are in V's rotated space: program (row, c) stores columns
    ROT_CHUNK: tl.constexpr,    # [c * ROT_CHUNK, (c + 1) * ROT_CHUNK) of the row times R_V^T
    R_SYLVESTER: tl.constexpr,  # R_V is H_D / sqrt(D): its entries generated, not read
    SPLITS_P2: tl.constexpr,
    BLOCK_N: tl.constexpr,      # the attention kernel's key tile (its splits' alignment)
    BLOCK_D: tl.constexpr,
):
    """grid (B * Hq * Tq, output column chunks): combine the splits of one query row by their
    log-sum-exp (one chunk, all columns, without HAS_V_ROT).

    A split is read only if the attention kernel wrote it: it starts below kv_len and (window) ends
    above this row's first visible key; any split of this row the kernel skipped fails one of the two.
    """
    pid = tl.program_id(0)
    qi = pid % Tq
    h = (pid // Tq) % Hq
    b = pid // (Tq * Hq)
    kv_len = tl.load(KVLEN + b * stride_kvl).to(tl.int32)
    kv_end = tl.minimum(kv_len, n_keys)
    sp = tl.arange(0, SPLITS_P2)
    if HAS_WINDOW:
        sp_lo = tl.maximum(kv_len - Tq - window + 1, 0) // BLOCK_N * BLOCK_N + sp * split_len
        win_lo = kv_len - Tq + qi - window + 1
        live = (sp < num_splits) & (sp_lo < kv_end) & (sp_lo + split_len > win_lo)
    else:
        live = (sp < num_splits) & (sp * split_len < kv_end)  # splits past kv_len wrote nothing
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + qi * stride_lm + sp * stride_ls, mask=live,
                  other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m_safe)  # log2 units; 0 for empty splits
    d = tl.arange(0, BLOCK_D)
    o = tl.load(OP + b * stride_opb + h * stride_oph + qi * stride_opm + sp[:, None] * stride_ops + d[None, :],
                mask=live[:, None] & (d[None, :] < D), other=0.0)
    den = tl.sum(w, axis=0)
    if HAS_SINKS:  # the sink logit (natural-log units) in the LSE's log2 units; none for a row without keys
        sink = tl.load(SINKS + h * stride_sink).to(tl.float32) * LOG2E
        den = den + tl.where(m == float("-inf"), 0.0, tl.math.exp2(sink - m_safe))
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(den > 0, den, 1.0)
    if STATIC_SCALE:
        out = out * tl.load(VS + (h // GROUP) * stride_vsh).to(tl.float32)  # static V scale, once
    o_row = O + b * stride_ob + h * stride_oh + qi * stride_om
    if HAS_V_ROT:  # out_j = sum_i out_i R_V[j, i] (fp32) for this program's ROT_CHUNK columns j
        j = tl.program_id(1) * ROT_CHUNK + tl.arange(0, ROT_CHUNK)
        if R_SYLVESTER:
            r = sylvester_sign(j[:, None], d[None, :]) * rot_scale
        else:
            r = tl.load(R_V + j[:, None] * D + d[None, :], mask=(j < D)[:, None] & (d < D)[None, :], other=0.0)
        tl.store(o_row + j * stride_od, to_store_dtype(tl.sum(r * out[None, :], axis=1), O.dtype.element_ty),
                 mask=j < D)
    else:
        tl.store(o_row + d * stride_od, to_store_dtype(out, O.dtype.element_ty), mask=d < D)
