"""Triton kernels behind the kvcompile ops (launchers; the @triton.jit code lives beside them).

Entry points, called by :mod:`kvcompile.ops` with the op's exact arguments:
``store_kv``, ``dequantize``, ``attention``. How each attention call runs (path, tile, splits, dot
type, where rotations happen, every constexpr): :mod:`kvcompile.kernels.plan`, from the tile table
in :mod:`kvcompile.tiles`. ``attention(..., new_token=(k, v, k_offset))`` (a sliding layer's ring
decode, :mod:`kvcompile.ring`) also stores the step's token, inside ``_attention_kernel`` where the plan
fits it (``_store_kernel.store_token``, the store kernel's own row quantizer).

=========================  ======================================  ==========================
launcher                   kernels                                 file
=========================  ======================================  ==========================
``store_kv``               ``_store_kv_kernel`` (K and V at once)   store.py / _store_kernel.py
``dequantize``             ``_dequantize_kernel``                  store.py / _store_kernel.py
``attention``              ``_attention_kernel``, ``_merge_kernel``  plan.py (+ prefill.py), attention_launcher.py (+ dense.py) / _attention_kernel.py (+ _tile_parts.py), _merge_kernel.py
``rotate_rows``            ``_rotate_rows_kernel``                 rotate.py / _rotation.py
=========================  ======================================  ==========================
"""

from .attention_launcher import attention
from .store import dequantize as _dequantize
from .store import store_kv


def dequantize(codes, scale, offset, kv_len, dtype, rotation=None, *, fmt):
    return _dequantize(codes, scale, offset, kv_len, dtype, rotation=rotation, fmt=fmt)


__all__ = ["store_kv", "dequantize", "attention"]
