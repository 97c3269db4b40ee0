"""@triton.jit rotations for caches stored rotated (codes of ``x @ R``, R an orthonormal ``[D, D]``
fp32 matrix, row-major): rows times R (K / V before quantizing, q before scoring) or times R^T (an
output back from V's rotated space).

Products run on the tensor cores with float32 accuracy: R is split into three bf16 parts whose sum
is R to all 24 bits (``hi + mid + lo``), and so is x unless it is already bf16-exact (a bf16 input:
one part). The significant cross products (``a_i b_j`` with i + j <= 2) are summed in fp32, smallest
first: the result is a float32 matmul's up to the order of its sums (~1e-7 relative), at a few
bf16 MMAs per tile instead of D fp32 FMAs per element. ``EXACT_FMA`` (Triton's interpreter, which
has no bf16 arithmetic) takes one fp32 FMA dot instead. R is read RC rows (or columns) at a time.
``tl.dot`` needs 16 rows: the launcher's row blocks are 16 or 64.
"""

import triton
import triton.language as tl

from ._codes import codes_to, codes_to_float, to_store_dtype


@triton.jit
def _split3(x):
    """fp32 -> (hi, mid, lo) bf16 with hi + mid + lo == x to 24 bits (each residual is exact in fp32)."""
    hi = x.to(tl.bfloat16)
    r = x - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def dot_f32(a, b, acc, A_PARTS: tl.constexpr, EXACT_FMA: tl.constexpr):
    """``acc + a @ b`` for fp32 ``a`` [M, K] and ``b`` [K, N] to float32 accuracy (module docstring).
    ``A_PARTS`` 1: ``a`` holds bf16 values exactly; 3: any fp32."""
    if EXACT_FMA:
        return tl.dot(a, b, acc, input_precision="ieee")
    b_hi, b_mid, b_lo = _split3(b)
    if A_PARTS == 1:
        a_hi = a.to(tl.bfloat16)
        acc = tl.dot(a_hi, b_lo, acc)
        acc = tl.dot(a_hi, b_mid, acc)
        acc = tl.dot(a_hi, b_hi, acc)
    else:
        a_hi, a_mid, a_lo = _split3(a)
        acc = tl.dot(a_lo, b_hi, acc)
        acc = tl.dot(a_hi, b_lo, acc)
        acc = tl.dot(a_mid, b_mid, acc)
        acc = tl.dot(a_mid, b_hi, acc)
        acc = tl.dot(a_hi, b_mid, acc)
        acc = tl.dot(a_hi, b_hi, acc)
    return acc


@triton.jit
def _rotate_cols(X, stride_xm, stride_xd, R, Y, stride_ym, stride_yd, M, D, pid_m, pid_j,
                 TRANSPOSE: tl.constexpr, X_PARTS: tl.constexpr, EXACT_FMA: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, RC: tl.constexpr):
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_ok = rows < M
    d = tl.arange(0, BLOCK_D)
    j = pid_j * RC + tl.arange(0, RC)
    x = tl.load(X + rows[:, None] * stride_xm + d[None, :] * stride_xd, mask=rows_ok[:, None] & (d < D)[None, :],
                other=0.0)
    r_ok = (d < D)[:, None] & (j < D)[None, :]
    if TRANSPOSE:  # columns j of R^T: rows j of R
        r = tl.load(R + j[None, :] * D + d[:, None], mask=r_ok, other=0.0)
    else:
        r = tl.load(R + d[:, None] * D + j[None, :], mask=r_ok, other=0.0)
    y = dot_f32(x.to(tl.float32), r, tl.zeros([BLOCK_M, RC], tl.float32), X_PARTS, EXACT_FMA)
    tl.store(Y + rows[:, None] * stride_ym + j[None, :] * stride_yd, to_store_dtype(y, Y.dtype.element_ty),
             mask=rows_ok[:, None] & (j < D)[None, :])


@triton.jit
def _rotate_rows_kernel(
    X, stride_xm, stride_xd, R, Y, stride_ym, stride_yd,
    X2, stride_x2m, stride_x2d, R2, Y2, stride_y2m, stride_y2d,
    M, D,
    TRANSPOSE: tl.constexpr,  # Y = X @ R^T (else X @ R)
    X_PARTS: tl.constexpr, EXACT_FMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, RC: tl.constexpr,
):
    """grid (cdiv(M, BLOCK_M), cdiv(D, RC), 1 or 2): rows of X [M, D] times R (or R^T) into Y, RC
    output columns per program (each reads whole rows once and RC columns of R: one pass, no
    loop-carried chain); axis 2 picks the second (X2, R2, Y2) of the same shape (K and V at once)."""
    if tl.program_id(2) == 0:
        _rotate_cols(X, stride_xm, stride_xd, R, Y, stride_ym, stride_yd, M, D, tl.program_id(0), tl.program_id(1),
                     TRANSPOSE, X_PARTS, EXACT_FMA, BLOCK_M, BLOCK_D, RC)
    else:
        _rotate_cols(X2, stride_x2m, stride_x2d, R2, Y2, stride_y2m, stride_y2d, M, D, tl.program_id(0),
                     tl.program_id(1), TRANSPOSE, X_PARTS, EXACT_FMA, BLOCK_M, BLOCK_D, RC)


# ---- the Sylvester Hadamard matrix generated in registers (attention prologue, split-K merge) ----
# H_D[i, j] = (-1)^popcount(i & j) for D a power of two; R = H_D / sqrt(D) is kvcompile.rotation's
# matrix for such a D. For c a multiple of RC and k < RC the bits of c and k are disjoint, so
# H[c + k, j] = H[k, j] * H[c, j]: one generated [RC, D] block of H serves every chunk of RC rows,
# its columns' signs flipped by row c of H.


@triton.jit
def sylvester_sign(i, j):
    """``H_D[i, j]`` as fp32 +-1: (-1)^popcount(i & j) (integers below 2^16, broadcast)."""
    x = i & j
    x = x ^ (x >> 8)
    x = x ^ (x >> 4)
    x = x ^ (x >> 2)
    x = x ^ (x >> 1)
    return 1.0 - 2.0 * (x & 1).to(tl.float32)


@triton.jit
def hadamard_rows(rows, stride_d, rows_ok, scale, EXACT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_D: tl.constexpr, RC: tl.constexpr, CODES: tl.constexpr = False,
                  FP8_BITS: tl.constexpr = False):
    """fp32 ``x @ H_D * scale`` of the rows at pointers ``rows`` [BLOCK_M, 1] (column j at ``rows + j *
    stride_d``, D == BLOCK_D), RC columns per product. Every chunk's load is issued before the first
    product, so that their latencies overlap (a decode program's q block is on its critical path).
    A 16-bit x meets H's +-1 (exact in its type) in one 16-bit MMA per chunk: exact products, fp32
    sums. ``CODES``: the rows are 8-bit codes (int8, e4m3, or e4m3 as uint8 bits with ``FP8_BITS``),
    widened to fp16 first (exact). ``EXACT``: fp32 FMA dots. H is symmetric: this is also
    ``x @ H_D^T * scale``."""
    k = tl.arange(0, RC)
    n = tl.arange(0, BLOCK_D)
    XTYPE: tl.constexpr = tl.float16 if CODES else rows.dtype.element_ty
    xs = ()
    for c in tl.static_range(0, BLOCK_D, RC):
        xs = xs + (tl.load(rows + (c + k)[None, :] * stride_d, mask=rows_ok, other=0.0),)
    h = sylvester_sign(k[:, None], n[None, :])  # H[0:RC, :]
    if not (EXACT or XTYPE == tl.float32):
        h = h.to(XTYPE)  # +-1: exact
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for c in tl.static_range(0, BLOCK_D, RC):
        x = xs[c // RC]
        if CODES:
            x = codes_to_float(x, FP8_BITS) if EXACT else codes_to(x, tl.float16, FP8_BITS)
        if EXACT or XTYPE == tl.float32:
            part = tl.dot(x.to(tl.float32), h, input_precision="ieee")
        else:
            part = tl.dot(x, h)
        acc += part * sylvester_sign(c, n)[None, :]
    return acc * scale
