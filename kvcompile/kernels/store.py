"""Launchers: ``store_kv`` (quantize-on-store, K and V in one launch) and ``dequantize``."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import formats, rotation, tiles
from ._store_kernel import _dequantize_kernel, _dequantize_kv_kernel, _store_kv_kernel
from .common import device_cc, interpreting, kv_len_arg, next_pow2, rot_scale
from .plan import ROT_CHUNK
from .rotate import rotate_rows

# Exact rounding must not be contracted into FMAs (x * s + o must round twice, as torch does).
_EXACT = {} if interpreting() else {"enable_fp_fusion": False}


def _as_bits(codes: Tensor) -> Tensor:
    return codes.view(torch.uint8) if codes.dtype == torch.float8_e4m3fn else codes


def _scale_layout(fmt: formats.KVFormat, head_dim: int) -> tuple[bool, int, int]:
    """(static, groups padded to a power of two, values per group) of a format's scales."""
    if fmt.groups(head_dim) <= 1:  # static (0 groups) or one scale per token
        return fmt.is_static, 1, next_pow2(head_dim)
    size = fmt.group_size(head_dim)
    if size & (size - 1):
        raise ValueError(
            f"kvcompile: scale groups of {size} values (head_dim={head_dim}) are not supported "
            "by the Triton store kernel; use granularity 'token' or 'block32'"
        )
    return False, next_pow2(head_dim // size), size


def store_kv(
    k_cache: Tensor, k_scale: Tensor, v_cache: Tensor, v_scale: Tensor,
    k: Tensor, v: Tensor, start: Tensor, k_offset: Optional[Tensor],
    k_rotation: Optional[Tensor] = None, v_rotation: Optional[Tensor] = None, *, shift: int = 0, ring: int = 0,
    k_fmt: formats.KVFormat, v_fmt: formats.KVFormat,
) -> None:
    """Quantize-on-store of K and V in one launch, at positions ``start + shift + arange(T)``; ``ring`` W > 0:
    one token (T == 1) at slot ``(start + shift) % W`` of a sliding layer's ring (:mod:`kvcompile.ring`), the
    slot computed in the kernel (no launch for it). K and V may be written in different formats that
    share one scale granularity (fp8 and int8 per token; fp8/block32 and q8_0). A rotation ``[D, D]``
    is applied first, float32 accuracy: kvcompile.rotation's shared matrix over token scales in the
    store kernel for 16 tokens or more (:func:`_rotation.hadamard_rows`), any other rotation (and a
    decode step's) by one more launch (:func:`rotate.rotate_rows`). Either rounds its sums in another
    order than the reference's matmul, so a value within an fp32 ulp or so of a rounding boundary may
    get the neighbouring code."""
    B, H, T, D = k.shape
    if T == 0:
        return
    if ring and T != 1:
        raise ValueError(f"kvcompile.store_kv (triton): a ring slot takes one token, got {T}")
    if k_fmt.granularity != v_fmt.granularity:
        raise ValueError(
            f"kvcompile.store_kv (triton): K and V scales must share one granularity, got {k_fmt.name} and {v_fmt.name}"
        )
    static, groups_p2, group_size = _scale_layout(k_fmt, D)
    # kvcompile.rotation's shared Sylvester matrix over token scales, 16 tokens or more: rotated in the
    # store kernel (_in_kernel)
    k_had = k_rotation is not None and _in_kernel(k_rotation, static, groups_p2, T)
    v_had = v_rotation is not None and _in_kernel(v_rotation, static, groups_p2, T)
    k_rot = None if k_had else k_rotation
    v_rot = None if v_had else v_rotation
    if k_rot is not None and v_rot is not None and k.dtype == v.dtype:
        k, v = rotate_rows(k, k_rot, x2=v, rotation2=v_rot)  # one launch for both
    elif k_rot is not None:
        k = rotate_rows(k, k_rot)
    elif v_rot is not None:
        v = rotate_rows(v, v_rot)
    k_code, v_code = k_fmt.spec.id, v_fmt.spec.id
    any_fp8 = torch.float8_e4m3fn in (k_fmt.code_dtype, v_fmt.code_dtype)
    kc, vc = _as_bits(k_cache), _as_bits(v_cache)
    ks = k_scale.view(1, -1, 1, 1) if static else k_scale
    vs = v_scale.view(1, -1, 1, 1) if static else v_scale
    off = k_offset if k_offset is not None else k_scale  # dummy pointer when there is no offset
    off_strides = (k_offset.stride(0), k_offset.stride(1)) if k_offset is not None else (0, 0)
    # ~4K values per program: enough bytes in flight, registers stay small
    block_t = max(1, min(next_pow2(T), 4096 // (groups_p2 * group_size)))
    if k_had or v_had:
        block_t = max(block_t, 16)  # the rotation's tl.dot takes 16 rows (masked past T)
    grid = (triton_cdiv(T, block_t), B * H, 2)
    _store_kv_kernel[grid](
        k, *k.stride(), v, *v.stride(),
        kc, *kc.stride(), vc, *vc.stride(),
        ks, *ks.stride(), vs, *vs.stride(),
        off, *off_strides,
        start, H, T, D, shift, ring, rot_scale(D),
        HAS_OFFSET=k_offset is not None, K_CODE=k_code, V_CODE=v_code, STATIC_SCALE=static,
        HW_E4M3=any_fp8 and hw_e4m3(k.device),
        GROUPS_P2=groups_p2, GROUP_SIZE=group_size, BLOCK_T=block_t,
        K_HADAMARD=k_had, V_HADAMARD=v_had, ROT_EXACT=interpreting(), ROT_CHUNK=ROT_CHUNK,
        num_warps=4, **_EXACT,
    )


def _in_kernel(rotation_matrix: Tensor, static: bool, groups_p2: int, tokens: int) -> bool:
    """Whether the store kernel rotates a side itself: the shared Sylvester matrix (its entries
    generated, not read) over one scale per token (a whole row per tile), 16 tokens or more.

    Measured on the H200 (bench_kv's store, int8, K rotated, 0e64080): a 16k-token store of one
    layer in 170 instead of 177 us (K and V rotated: 208 instead of 261), and no float32 copy of the
    rotated K. A decode step's one token was slower in the kernel, 5.9 against 4.5 us for the rotation
    launch plus the store at B=8: the rotation's 16-row dot tile is 15 rows of padding whose
    quantization the kernel still computes, and its layout changes sit on the program's critical path."""
    return tokens >= 16 and not static and groups_p2 == 1 and rotation.is_shared_sylvester(rotation_matrix)


def hw_e4m3(device: torch.device) -> bool:
    """Whether e4m3 codes are encoded by the sm_89+ convert (``cvt.rn.satfinite.e4m3x2.f32``; H200,
    bench_kv.py at eb79b98: fp8 store at T=16k 92.5 instead of 100.2 us, block32 86.6 instead of 133.2) or by
    integer arithmetic (archs below sm_89, the interpreter). Both are bit-exact with formats.py."""
    return not interpreting() and tiles.has_native_fp8(device_cc(device))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dequantize(codes: Tensor, scale: Tensor, offset: Optional[Tensor], kv_len: Tensor, dtype: torch.dtype,
               out: Optional[Tensor] = None, fp8_bits: Optional[bool] = None,
               rotation: Optional[Tensor] = None, *, fmt: formats.KVFormat) -> Tensor:
    """codes [B, H, L, D] in format ``fmt`` -> values in ``dtype`` (``out`` may be a preallocated workspace).

    With ``rotation`` R ([D, D] float32): ``(codes * scale + offset) @ R^T``; the kernel writes the
    float32 values (zeros at positions >= kv_len), one float32 torch matmul un-rotates them (exactly
    what the reference does), then the cast to ``dtype``."""
    if rotation is not None:
        x = dequantize(codes, scale, offset, kv_len, torch.float32, fp8_bits=fp8_bits, fmt=fmt)
        x = torch.matmul(x, rotation.t()).to(dtype)
        if out is None:
            return x
        return out.copy_(x)
    B, H, L, D = codes.shape
    if out is None:
        out = torch.empty((B, H, L, D), dtype=dtype, device=codes.device)
    if L == 0:
        return out
    if fp8_bits is None:
        fp8_bits = _by_bits(fmt, codes.device)
    c = codes.view(torch.uint8) if fp8_bits else codes
    static = fmt.is_static
    s = scale.view(1, -1, 1, 1) if static else scale
    groups = max(1, fmt.groups(D))
    off = offset if offset is not None else scale
    off_strides = (offset.stride(0), offset.stride(1)) if offset is not None else (0, 0)
    kvl, kvl_stride = kv_len_arg(kv_len, B, codes.device)
    block_d = next_pow2(D)
    block_l = max(1, min(next_pow2(L), 4096 // block_d))
    grid = (triton_cdiv(L, block_l), B * H)
    _dequantize_kernel[grid](
        c, *c.stride(), s, *s.stride(), off, *off_strides, kvl, kvl_stride,
        out, *out.stride(), H, L, D, groups,
        HAS_OFFSET=offset is not None, STATIC_SCALE=static, FP8_BITS=fp8_bits,
        BLOCK_L=block_l, BLOCK_D=block_d, num_warps=4, **_EXACT,
    )
    return out


def _by_bits(fmt: formats.KVFormat, device: torch.device) -> bool:
    """Whether e4m3 codes of format ``fmt`` are widened from their bits (no native fp8 convert)."""
    return fmt.code_dtype == torch.float8_e4m3fn and not tiles.has_native_fp8(device_cc(device))


def _unrotation_fits(head_dim: int, fmt: formats.KVFormat) -> bool:
    """The dequantize's un-rotation takes this side: a power-of-two head_dim the 16-wide dots take, one
    scale per row (token or static: it factors out of the product with the exact codes)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and fmt.groups(head_dim) <= 1


def unrotates_in_dequantize(rotation_matrix: Optional[Tensor], fmt: formats.KVFormat) -> bool:
    """Whether :func:`dequantize_kv` can rotate a side of format ``fmt`` back itself: the shared
    Sylvester matrix (its entries generated, never read) and a side :func:`_unrotation_fits`."""
    return (rotation_matrix is not None and rotation.is_shared_sylvester(rotation_matrix)
            and _unrotation_fits(rotation_matrix.shape[0], fmt))


def dequantize_kv(k_codes: Tensor, k_scale: Tensor, v_codes: Tensor, v_scale: Tensor, kv_len: Tensor, n: int,
                  dtype: torch.dtype, k_unrotate: bool = False, v_unrotate: bool = False, *, k_fmt: formats.KVFormat,
                  v_fmt: formats.KVFormat) -> tuple[Tensor, Tensor]:
    """The first ``n`` positions of K and V codes ``[B, H, L, D]`` (each in its own layout) -> two
    contiguous ``[B, H, n, D]`` tensors in ``dtype``, in one launch (K in ``k_fmt``, V in ``v_fmt``); zeros at positions >= kv_len[b].
    K's centering offset is not added (the dense prefill's workspace: softmax does not see it). A side
    stored rotated stays rotated, unless ``k_unrotate`` / ``v_unrotate`` (the side is rotated by the
    shared Sylvester matrix, :func:`unrotates_in_dequantize`): then its values come out rotated back,
    ``(codes @ H^T) * scale / sqrt(D)`` from the exact codes. K and V codes may differ in dtype (fp8
    and int8) when their scales share one granularity."""
    B, H, L, D = k_codes.shape
    if not 0 <= n <= L or v_codes.shape != k_codes.shape:
        raise ValueError(f"kvcompile.dequantize_kv: n={n} for codes {tuple(k_codes.shape)} / {tuple(v_codes.shape)}")
    unrotate = k_unrotate or v_unrotate
    if unrotate and not _unrotation_fits(D, k_fmt):
        raise ValueError(f"kvcompile.dequantize_kv: no un-rotation in the dequantize for head_dim {D} and "
                         f"{k_fmt.name} (a power of two >= 16 and one scale per token or head)")
    k = torch.empty((B, H, n, D), dtype=dtype, device=k_codes.device)
    v = torch.empty_like(k)
    if n == 0:
        return k, v
    k_bits, v_bits = _by_bits(k_fmt, k_codes.device), _by_bits(v_fmt, v_codes.device)
    kc = k_codes.view(torch.uint8) if k_bits else k_codes
    vc = v_codes.view(torch.uint8) if v_bits else v_codes
    static = k_fmt.is_static
    ks, vs = (k_scale.view(1, -1, 1, 1), v_scale.view(1, -1, 1, 1)) if static else (k_scale, v_scale)
    kvl, kvl_stride = kv_len_arg(kv_len, B, k_codes.device)
    block_d = next_pow2(D)
    block_l = max(1, min(next_pow2(n), 4096 // block_d))
    if unrotate:  # the dots need 16 rows
        block_l = max(block_l, 16)
    _dequantize_kv_kernel[(triton_cdiv(n, block_l), B * H, 2)](
        kc, *kc.stride(), ks, *ks.stride(), vc, *vc.stride(), vs, *vs.stride(), kvl, kvl_stride,
        k, *k.stride(), v, *v.stride(), H, n, D, max(1, k_fmt.groups(D)), rot_scale(D),
        STATIC_SCALE=static, K_FP8_BITS=k_bits, V_FP8_BITS=v_bits, BLOCK_L=block_l, BLOCK_D=block_d,
        K_UNROTATE=k_unrotate, V_UNROTATE=v_unrotate, EXACT=interpreting(), RC=min(ROT_CHUNK, block_d),
        num_warps=4, **_EXACT,
    )
    return k, v
