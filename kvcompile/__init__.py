"""kvcompile: 8-bit KV caches that attention reads directly, inside torch.compile.

    cache = kvcompile.QuantizedCache(model.config, max_batch_size=B, max_cache_len=L,
                                     kv_dtype="fp8_e4m3", device="cuda")
    model.forward = torch.compile(model.forward, backend=kvcompile.backend(kv_dtype="fp8_e4m3"))
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)

Importing kvcompile registers the ``torch.ops.kvcompile.*`` ops; Triton is imported only when
a kernel runs, so the package imports on machines without a GPU.
"""

from . import ops  # noqa: F401  (registers torch.ops.kvcompile.*)
from .cache import QuantizedCache, QuantizedLayer
from .calibration import calibrate, load_calibration, save_calibration
from .formats import KV_DTYPES, KVFormat, get_format
from .graphs import BatchPaddedForward, default_capture_sizes

__all__ = [
    "BatchPaddedForward",
    "KV_DTYPES",
    "KVFormat",
    "QuantizedCache",
    "QuantizedLayer",
    "calibrate",
    "default_capture_sizes",
    "get_format",
    "load_calibration",
    "save_calibration",
    "backend",
]
__version__ = "0.1.0"


def backend(kv_dtype: str = "fp8_e4m3", **options):
    """A torch.compile backend that rewrites attention over a kvcompile cache (see kvcompile.passes)."""
    for name in ("mode", "fullgraph", "dynamic"):  # torch.compile's own options, given to the wrong call
        if name in options:
            raise TypeError(
                f"kvcompile.backend() takes no {name}=; it is torch.compile's: "
                f"torch.compile(model.forward, backend=kvcompile.backend(kv_dtype=...), {name}=...)"
            )
    from .backend import KVCompileBackend

    # Importing the submodule kvcompile.backend binds it as the package attribute ``backend``,
    # shadowing this function; bind the function back so that later calls still work.
    globals()["backend"] = _backend_function
    return KVCompileBackend(kv_dtype=kv_dtype, **options)


_backend_function = backend
