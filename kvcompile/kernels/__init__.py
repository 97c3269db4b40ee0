"""Triton kernels behind the kvcompile ops (launchers; the @triton.jit code lives beside them).

Entry points, called by :mod:`kvcompile.ops` with the op's exact arguments:
``store_kv``, ``dequantize``, ``attention``.
"""


def _missing(name):
    def fn(*args, **kwargs):
        raise NotImplementedError(
            f"kvcompile: the Triton {name} kernel is not built yet; set KVCOMPILE_KERNELS=reference"
        )

    return fn


store_kv = _missing("store_kv")
dequantize = _missing("dequantize")
attention = _missing("attention")
