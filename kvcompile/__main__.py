"""``python -m kvcompile info``: the GPU, the launch plans chosen for it, and the KV formats.

``python -m kvcompile info --config MODEL_DIR_OR_CONFIG_JSON --max-cache-len N [--batch B]
[--kv-dtype ...]``: the bytes a ``QuantizedCache`` for that model would hold, per layer and in
total, against a bf16 cache of the same capacity, computed without allocating anything and without
network (the config is read from a local directory, a ``config.json``, or the Hugging Face cache).

``python -m kvcompile sass``: compile the attention kernel (``--kernel store``: the store kernel)
for an arch (no GPU needed) and print its registers, shared memory and SASS opcode counts
(:mod:`kvcompile.kernels.aot`).

Prints the detected CUDA device and compute capability (or "no CUDA device"), the decode and
prefill launch plans :mod:`kvcompile.kernels.plan` makes for common head dims per format on that
arch (on a machine without CUDA: for a few reference archs), and every format with its bytes per
element.
"""

from __future__ import annotations

import argparse
import sys

from .checks import positive_int_arg

HEAD_DIMS = (64, 128, 256)
REFERENCE_ARCHS = ((8, 0), (8, 9), (9, 0))  # shown when no GPU is present: A100, L40/4090, H100/H200
Q_BYTES = 2  # bf16 / fp16 queries


def _device_lines() -> tuple[list[str], list]:
    import torch

    lines = [f"torch {torch.__version__}"]
    try:
        import triton

        lines.append(f"triton {triton.__version__}")
    except ImportError:
        lines.append("triton not installed (the reference ops run)")
    from . import native

    lines.append(f"CPU: {native.status()}")
    if not torch.cuda.is_available():
        lines.append("GPU: no CUDA device (on the CPU the torch reference ops run, with the C decode path above)")
        return lines, []
    archs = []
    for i in range(torch.cuda.device_count()):
        cc = torch.cuda.get_device_capability(i)
        props = torch.cuda.get_device_properties(i)
        lines.append(
            f"GPU {i}: {props.name}  sm_{cc[0]}{cc[1]}  {props.total_memory / 2**30:.0f} GiB"
        )
        if (cc, props.multi_processor_count) not in archs:
            archs.append((cc, props.multi_processor_count))
    return lines, archs


def _format_rows():
    """(name, kv_dtype, granularity, bytes/element at head_dim 64 and 128, scale dtype) per format."""
    from . import formats

    rows = []
    for kv in formats.KV_DTYPES:
        for g in formats.SCALE_GRANULARITIES:
            try:
                fmt = formats.KVFormat(kv, g)
            except ValueError:
                continue
            rows.append((fmt, [fmt.bytes_per_element(d) for d in (64, 128)]))
    return rows


def _plan_lines(archs) -> list[str]:
    """The launch plan (kernels/plan.py) of a Llama-3-8B-shaped layer (32 q heads, 8 kv heads, bf16
    q) at B=8 over a 32k cache, per arch, head_dim and format: decode and a 1024-token prefill."""
    try:
        import torch

        from . import formats, tiles
        from .kernels import plan as plan_mod
    except ImportError as e:
        return [f"launch plans unavailable ({e})"]
    shown = archs or [(cc, 132 if cc >= (9, 0) else 108) for cc in REFERENCE_ARCHS]
    lines = []
    if not archs:
        lines.append("(no GPU: plans shown for reference archs " + ", ".join(f"sm_{a}{b}" for (a, b), _ in shown)
                     + ")")
    for cc, sms in shown:
        lines.append(f"sm_{cc[0]}{cc[1]}: fp8 e4m3 " + ("native (tl.float8e4nv)" if tiles.has_native_fp8(cc)
                                                       else "decoded by bit manipulation"))
        for d in HEAD_DIMS:
            every = [formats.get_format(s.name, g) for s in formats.specs() for g in s.granularities]
            for fmt in sorted(every, key=lambda f: f.kv_dtype != formats.DEFAULT_KV_DTYPE):  # the default first
                label, rot = fmt.name, fmt.spec.rotate_k and not fmt.is_static
                kind, group = plan_mod.scale_layout(fmt, fmt, d)
                sb = plan_mod.scale_bytes(fmt, d)
                # the format's default: K rotated or not, V not (QuantizedCache(rotate=None))
                r = plan_mod.ROT_NONE if not rot else (plan_mod.ROT_SYLVESTER if d & (d - 1) == 0 else plan_mod.ROT_MATRIX)
                for decode in (True, False):
                    call = plan_mod.Call(cc=tuple(cc), sms=sms, interpret=False, B=8, Hq=32, Hkv=8, Tq=1 if decode else 1024,
                                         L=32768, D=d, q_dtype=torch.bfloat16, k_code=fmt.code_dtype,
                                         v_code=fmt.code_dtype, scale_kind=kind, group_size=group, scale_bytes=sb,
                                         is_causal=not decode, k_rot=r, v_rot=plan_mod.ROT_NONE, v_keys=fmt.v_keys_contiguous,
                                         decode=decode)
                    try:
                        desc = plan_mod.plan(call).describe()
                    except ValueError as e:
                        desc = f"n/a ({e})"
                    lines.append(f"  D={d:<3d} {label + (' (K rotated)' if rot else ''):18s} {desc}")
    return lines


def info(out=print) -> None:
    from . import __version__, formats

    out(f"kvcompile {__version__}")
    dev, archs = _device_lines()
    for line in dev:
        out(line)
    out("")
    out("KV formats (bytes per cached element, scales included; static scales amortize to 0):")
    out(f"  {'format':22s} {'code':14s} {'scale':9s} {'D=64':>6s} {'D=128':>6s}")
    for fmt, (b64, b128) in _format_rows():
        code = str(fmt.code_dtype).replace("torch.", "")
        scale = str(fmt.scale_dtype).replace("torch.", "")
        name = f"{fmt.kv_dtype} / {fmt.granularity}"
        out(f"  {name:22s} {code:14s} {scale:9s} {b64:6.3f} {b128:6.3f}")
    out("  (bf16 cache: 2.000 bytes per element)")
    out(f"  default format (no kv_dtype given): {formats.DEFAULT_KV_DTYPE}. fp8_e4m3 uses token scales (block32 or")
    out("  static on request); q8_0 is always block32, int8 always token. int8 stores K Hadamard-rotated by")
    out("  default (rotate=None; head_dim a multiple of 8; rotate=True rotates V too), the others unrotated.")
    out("  K and V may differ (k_dtype=, v_dtype=) when they share one scale granularity. K centering")
    out("  (calibration k_offset) works with every format.")
    out("  sliding-window layers (Mistral, Phi-3, Gemma 2/3, gpt-oss, ...) store only their window, as a ring")
    out("  (QuantizedCache(ring=True), the default): their memory follows the window, not max_cache_len.")
    out("")
    out("launch plans (kvcompile/kernels/plan.py; B=8, 32 q / 8 kv heads, bf16 q, 32k cache; prefill: 1024 tokens):")
    for line in _plan_lines(archs):
        out("  " + line)
    from .kernels.plan import DECODE_MAX_Q, DENSE_MIN_Q, QUANT_FUSED_MAX_Q

    out(f"  prefill path (KVCOMPILE_PREFILL=auto, on a GPU): split-K decode up to {DECODE_MAX_Q} new tokens, the fused")
    out(f"  kernel up to {DENSE_MIN_Q - 1}, from {DENSE_MIN_Q} the dense path (the live prefix dequantized once, then SDPA's")
    out("  causal kernels); the fused kernel under CUDA graph capture, with softcap or sinks, or a window that hides keys,")
    out(f"  and up to {QUANT_FUSED_MAX_Q} where KVCOMPILE_PREFILL_Q=int8|fp8|p8 quantizes its scores.")


def _load_config(src: str):
    """A transformers config from a local model directory, a config json, or the local Hugging Face cache."""
    import os

    from transformers import AutoConfig

    try:
        if os.path.isfile(src):
            return AutoConfig.from_pretrained(src)
        return AutoConfig.from_pretrained(src, local_files_only=True)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(
            f"kvcompile info: cannot read a model config from {src!r} ({first}). info works offline: pass a local "
            "model directory or its config.json (a hub id works once it is in the local Hugging Face cache)"
        ) from None


def _layer_span(idx: list[int]) -> str:
    """``layer 3``, ``layers 0-29``, or for layers that recur in a pattern ``layers 0-2, 4-6, 8-10 (9)``."""
    runs, first = [], idx[0]
    for prev, cur in zip(idx, idx[1:] + [None]):
        if cur != prev + 1 if cur is not None else True:
            runs.append(f"{first}" if first == prev else f"{first}-{prev}")
            first = cur
    text = ("layer " if len(idx) == 1 else "layers ") + ", ".join(runs)
    return text + (f" ({len(idx)})" if len(runs) > 1 else "")


def _mib(n: float) -> str:
    """Bytes in the binary unit that reads best (KiB / MiB / GiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n / 2**10:,.2f} KiB"


def cache_size_lines(config, *, max_cache_len=None, batch=1, kv_dtype=None, granularity=None,
                     calibration=None) -> list[str]:
    """What ``QuantizedCache(config, batch, max_cache_len, kv_dtype, ...)`` would hold, layer by layer,
    measured on the meta device (nothing is allocated). ``kv_dtype=None``: the cache's default format."""
    import warnings

    from .cache import CacheSizeWarning, HybridLayer, NoKVLayer, QuantizedCache, StateLayer

    fmt_kw = {} if kv_dtype is None else {"kv_dtype": kv_dtype}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheSizeWarning)  # said below, in words that fit here
        cache = QuantizedCache(config, max_batch_size=batch, max_cache_len=max_cache_len, granularity=granularity,
                               calibration=calibration, **fmt_kw)
    sizes = cache.planned_nbytes(per_layer=True)
    total, bf16 = sum(sizes), cache.bf16_nbytes()
    name = getattr(config, "_name_or_path", "") or type(config).__name__
    lines = [f"QuantizedCache for {name} ({type(config).__name__}): {len(sizes)} layers"]
    src = "given" if max_cache_len is not None else "from max_position_embeddings: pass --max-cache-len to choose"
    lines.append(f"  kv_dtype {cache.fmt.name}, max_batch_size {cache.max_batch_size}, "
                 f"max_cache_len {cache.max_cache_len} ({src})")
    groups: dict = {}  # layers alike (kind, bytes, shape, window), in order of first appearance
    for i, (layer, size) in enumerate(zip(cache.layers, sizes)):
        key = (type(layer), size, layer.num_heads, layer.head_dim, layer.slots, layer.ring, layer.sliding_window)
        groups.setdefault(key, []).append(i)
    for (_, size, *_), idx in groups.items():
        layer = cache.layers[idx[0]]
        span = _layer_span(idx)
        if len(span) > 14:  # a recurring pattern: the layers on a line of their own, the bytes under them
            lines.append(f"  {span}:")
            span = ""
        if isinstance(layer, NoKVLayer):
            lines.append(f"  {span:14s} {0:>14,d} bytes: no K/V of their own (they reuse an earlier layer's "
                         "K/V, or have no attention)")
        elif isinstance(layer, StateLayer):
            lines.append(f"  {span:14s} {0:>14,d} bytes: no K/V; a recurrent / conv state instead, which "
                         "transformers' own layer allocates on the first forward (not quantized; not in the totals)")
        else:
            lines.append(f"  {span:14s} {size:>14,d} bytes ({_mib(size)}) each: "
                         f"{layer.num_heads} kv heads x head_dim {layer.head_dim} x {layer.slots} positions"
                         + (f" (a ring: sliding window {layer.sliding_window})" if layer.ring else "")
                         + (", and a recurrent state (not in the totals)" if isinstance(layer, HybridLayer) else ""))
    lines.append(f"  total          {total:>14,d} bytes ({_mib(total)}); a bf16 cache of the same capacity: "
                 f"{_mib(bf16)} ({total / bf16:.3f}x)")
    per_row = total / cache.max_batch_size
    # a sliding layer's ring holds its window whatever the context: only the other layers grow with it
    ring = sum(size for layer, size in zip(cache.layers, sizes) if layer.ring) / cache.max_batch_size
    if ring == per_row:
        lines.append(f"  per sequence (batch row): {_mib(per_row)}, fixed: every K/V layer is a sliding window's ring, "
                     "which does not grow with the context")
    else:
        fixed = f", plus {_mib(ring)} fixed in the sliding layers' rings" if ring else ""
        per_position = (per_row - ring) / cache.max_cache_len
        lines.append(f"  per sequence (batch row): {_mib(per_row)}, {per_position:,.0f} bytes per position of "
                     f"context{fixed}")
    return lines


def _kv_dtype(text: str) -> str:
    """An argparse ``type``: one of :data:`kvcompile.KV_DTYPES`."""
    from . import formats

    try:
        formats.get_format(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _parser() -> argparse.ArgumentParser:
    from .formats import SCALE_GRANULARITIES

    p = argparse.ArgumentParser(prog="python -m kvcompile", description="kvcompile utilities")
    sub = p.add_subparsers(dest="cmd")
    ip = sub.add_parser("info", help="GPU/arch, attention tiles per head dim and format, KV formats; with --config: "
                                     "the bytes a cache for that model would hold")
    ip.add_argument("--config", default=None, metavar="MODEL_OR_CONFIG",
                    help="a local model directory or config.json (no network): print the cache's bytes per layer and "
                         "in total instead of the device report")
    ip.add_argument("--max-cache-len", type=positive_int_arg, default=None,
                    help="positions per sequence (default: the config's max_position_embeddings, what QuantizedCache "
                         "allocates when max_cache_len is omitted)")
    ip.add_argument("--batch", type=positive_int_arg, default=1, help="max_batch_size (default 1)")
    ip.add_argument("--kv-dtype", type=_kv_dtype, default=None, help="cache format (default: QuantizedCache's default)")
    ip.add_argument("--granularity", choices=SCALE_GRANULARITIES, default=None,
                    help="token / block32 / static (default: the format's)")
    ip.add_argument("--calibration", default=None,
                    help="calibration file or shipped name (static scales need one)")
    sp = sub.add_parser("sass", help="compile the attention (or store) kernel for an arch (no GPU) and summarize "
                                     "its SASS")
    sp.add_argument("--kernel", choices=("attention", "store"), default="attention",
                    help="store: quantize-on-store of a --tokens-long write (default attention)")
    sp.add_argument("--tokens", type=positive_int_arg, default=16384, help="store: tokens written by the launch")
    sp.add_argument("--arch", default="90", help="compute capability, e.g. 90 or 89 (default 90)")
    sp.add_argument("--kv-dtype", type=_kv_dtype, default=None, help="cache format (default: the registry's first, id 0)")
    sp.add_argument("--granularity", choices=SCALE_GRANULARITIES, default=None,
                    help="token / block32 / static (default: the format's)")
    sp.add_argument("--head-dim", type=positive_int_arg, default=128)
    sp.add_argument("--group", type=positive_int_arg, default=4, help="query heads per kv head")
    sp.add_argument("--q-len", type=positive_int_arg, default=1,
                    help="<= 16: split-K decode launch; longer: fused prefill")
    sp.add_argument("--no-v-pin", action="store_true", help="let Triton place the V conversion (for A/B)")
    sp.add_argument("--v-layout", choices=("auto", "keys", "head_dim"), default="auto",
                    help="V codes key- or head_dim-contiguous (auto: QuantizedCache's choice for the format)")
    sp.add_argument("--top", type=positive_int_arg, default=24, help="opcodes to list")
    return p


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.cmd == "info" and args.config is not None:
        if args.calibration is not None:  # before the config is read
            from .calibration import _resolve_path

            try:
                _resolve_path(args.calibration)
            except ValueError as e:
                p.error(f"argument --calibration: {e}")
        config = _load_config(args.config)
        try:
            lines = cache_size_lines(config, max_cache_len=args.max_cache_len, batch=args.batch,
                                     kv_dtype=args.kv_dtype, granularity=args.granularity,
                                     calibration=args.calibration)
        except (TypeError, ValueError) as e:
            p.error(str(e))
        print("\n".join(lines))
        return 0
    if args.cmd in (None, "info"):
        info()
        return 0
    if args.cmd == "sass":
        from .kernels import aot

        if not (args.arch.isdigit() and len(args.arch) >= 2):
            p.error(f"--arch takes a compute capability such as 90 or 89, got {args.arch!r}")
        from . import formats

        cc = (int(args.arch[:-1]), int(args.arch[-1]))
        args.kv_dtype = args.kv_dtype or formats.KV_DTYPES[0]
        try:
            fmt = formats.get_format(args.kv_dtype, args.granularity)
        except ValueError as e:
            p.error(f"arguments --kv-dtype / --granularity: {e}")
        v_keys = fmt.v_keys_contiguous if args.v_layout == "auto" else args.v_layout == "keys"
        if args.kernel == "store":
            r = aot.compile_store(cc, args.kv_dtype, args.granularity, args.head_dim, args.tokens, v_keys)
        else:
            r = aot.compile_attention(cc, args.kv_dtype, args.granularity, args.head_dim, args.group, args.q_len,
                                      v_pin=False if args.no_v_pin else None, v_keys=v_keys)
        print(r.summary(args.top))
        return 0
    return 1  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
