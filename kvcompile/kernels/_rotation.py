"""@triton.jit helpers for caches stored rotated (codes of ``x @ R``, R an orthonormal ``[D, D]``
fp32 matrix, row-major): rows times R before quantizing or scoring, and an output times R^T.

Both run as fp32 FMA dots (``input_precision="ieee"``: exact products, fp32 sums, what a float32
matmul computes up to the order of its sums) over RC columns of R at a time, so a whole R (64 KiB
at D=128) is never held in registers. ``tl.dot`` needs 16 rows: callers pad their rows to 16.
"""

import triton
import triton.language as tl

from ._codes import to_store_dtype


@triton.jit
def rows_times_r(X, stride_xd, rows_ok, R, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, RC: tl.constexpr):
    """``[BLOCK_M, D]`` rows of X times R (``[D, D]`` fp32, row-major) in fp32 FMAs (exact products,
    fp32 sums, like a float32 matmul). ``X`` points at column 0 of each row ([BLOCK_M, 1]); the rows
    are read RC columns at a time against RC rows of R, so R never sits in registers whole."""
    d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for c0 in tl.static_range(0, BLOCK_D, RC):
        c = c0 + tl.arange(0, RC)
        x = tl.load(X + c[None, :] * stride_xd, mask=rows_ok[:, None] & (c < D)[None, :], other=0.0)
        r = tl.load(R + c[:, None] * D + d[None, :], mask=(c < D)[:, None] & (d < D)[None, :], other=0.0)
        acc = tl.dot(x.to(tl.float32), r, acc, input_precision="ieee")
    return acc


@triton.jit
def store_times_rt(out, O, stride_od, rows_ok, R, D, BLOCK_D: tl.constexpr, RC: tl.constexpr):
    """Store ``out @ R^T`` (out ``[BLOCK_M, BLOCK_D]`` fp32, R ``[D, D]`` fp32) at O ([BLOCK_M, 1]
    pointers to column 0), RC output columns at a time: fp32 FMAs, R^T read RC columns at a time."""
    d = tl.arange(0, BLOCK_D)
    for j0 in tl.static_range(0, BLOCK_D, RC):
        j = j0 + tl.arange(0, RC)
        rt = tl.load(R + j[None, :] * D + d[:, None], mask=(d < D)[:, None] & (j < D)[None, :], other=0.0)
        o = tl.dot(out, rt, input_precision="ieee")
        tl.store(O + j[None, :] * stride_od, to_store_dtype(o, O.dtype.element_ty),
                 mask=rows_ok[:, None] & (j < D)[None, :])
