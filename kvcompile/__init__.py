"""kvcompile: 8-bit KV caches that attention reads directly, inside torch.compile.

    cache = kvcompile.QuantizedCache(model.config, max_batch_size=B, max_cache_len=L, device="cuda")
    model.forward = torch.compile(model.forward, backend=kvcompile.backend())  # both: the default int8
    out = model.generate(ids, cache=cache, max_new_tokens=64)   # transformers < 5.24: past_key_values=cache

Importing kvcompile registers the ``torch.ops.kvcompile.*`` ops; Triton is imported only when
a kernel runs, so the package imports on machines without a GPU.
"""

from . import ops  # noqa: F401  (registers torch.ops.kvcompile.*)
from .cache import QuantizedCache
from .cache_layer import NoKVLayer, QuantizedLayer
from .state_layers import HybridLayer, StateLayer
from .calibration import calibrate, load_calibration, save_calibration
from .formats import DEFAULT_KV_DTYPE, KV_DTYPES, KVFormat, format_of, get_format
from .graphs import BatchPaddedForward, default_capture_sizes

__all__ = [
    "BatchPaddedForward",
    "DEFAULT_KV_DTYPE",
    "HybridLayer",
    "KV_DTYPES",
    "KVFormat",
    "NoKVLayer",
    "StateLayer",
    "QuantizedCache",
    "QuantizedLayer",
    "calibrate",
    "default_capture_sizes",
    "format_of",
    "get_format",
    "load_calibration",
    "save_calibration",
    "backend",
]
__version__ = "0.1.0"


def backend(kv_dtype: str | None = None, *, k_dtype: str | None = None, v_dtype: str | None = None, **options):
    """A torch.compile backend that rewrites attention over a kvcompile cache (see kvcompile.passes).

    ``kv_dtype`` names the cache's format (``None``: :data:`DEFAULT_KV_DTYPE`); ``k_dtype`` /
    ``v_dtype`` override one side, as in :class:`QuantizedCache`."""
    for name in ("mode", "fullgraph", "dynamic"):  # torch.compile's own options, given to the wrong call
        if name in options:
            raise TypeError(
                f"kvcompile.backend() takes no {name}=; it is torch.compile's: "
                f"torch.compile(model.forward, backend=kvcompile.backend(kv_dtype=...), {name}=...)"
            )
    from .compile_backend import KVCompileBackend

    return KVCompileBackend(kv_dtype=kv_dtype, k_dtype=k_dtype, v_dtype=v_dtype, **options)
