"""kvcompile kernel benchmarks on one GPU: decode, prefill, store, read (subjects), vs bf16 SDPA in the same run.

Llama-3-8B attention shape: 32 query heads, 8 kv heads, head_dim 128, one layer.

    python benchmarks/bench_kv.py --subjects decode,prefill,store --out bench.csv [--sweep]
    python benchmarks/bench_kv.py --subjects window --window 4096 --window-context 32768 --formats fp8,q8_0

Timing: every provider is captured in a CUDA graph and timed by replays (triton.testing
.do_bench_cudagraph, median), so Python launch overhead is out of all numbers alike. Each call
rotates over enough copies of its inputs (>= 256 MB) that the 50 MB L2 cannot serve repeats.
Bandwidth = the fewest bytes the provider must move (each input read once, output written once)
over the time. Ratios are SDPA-bf16 time / provider time (> 1: faster than bf16 SDPA).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvcompile import formats, ring, rotation, tiles  # noqa: E402
from kvcompile.cache import v_codes_buffer  # noqa: E402
from kvcompile import kernels  # noqa: E402
from kvcompile.kernels import attention_launcher as launcher  # noqa: E402
from kvcompile.kernels import plan as plan_mod  # noqa: E402
from kvcompile.kernels import store as store_launcher  # noqa: E402


def fmt_of(codes, scale):
    """The format of a cache built here, read off its tensors (:func:`kvcompile.formats.of_tensors`)."""
    return formats.of_tensors(codes, scale)


def fmts_of(k_codes, k_scale, v_codes, v_scale) -> dict:
    """The launchers' ``k_fmt`` / ``v_fmt`` of a cache built here."""
    return {"k_fmt": fmt_of(k_codes, k_scale), "v_fmt": fmt_of(v_codes, v_scale)}


HQ, HKV, D = 32, 8, 128
DEVICE = "cuda"  # the smoke's and make_cache's device (tests/test_bench_kv.py runs the smoke on the CPU)
ROTATE_BYTES = 256 << 20
ROWS: list[dict] = []
VARIANTS = None  # --variants: a regex that sweep labels must match
SPLITS = {}  # --splits: shape label -> explicit split counts timed as sweep variants
AB_KERNEL = None  # --ab-kernel: another _attention_kernel.py (e.g. from git show), timed as a sweep variant


LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg", "enable_fp_fusion")  # kept for --ab-kernel launches


def load_kernel_file(path):
    """The ``_attention_kernel`` of another version of kvcompile/kernels/_attention_kernel.py."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvcompile.kernels._attention_kernel_ab", path)
    mod = importlib.util.module_from_spec(spec)  # package kvcompile.kernels: its relative imports resolve
    spec.loader.exec_module(mod)
    kernel = mod._attention_kernel

    class OlderArgs:  # the launcher passes today's keyword arguments: drop those the other version lacks
        def __getitem__(self, grid):
            return lambda *a, **kw: kernel[grid](*a, **{k: v for k, v in kw.items()
                                                         if k in kernel.arg_names or k in LAUNCH_OPTIONS})

    return OlderArgs()


def bench(fn_list, n_items):
    """Median ms per item of calling every fn in ``fn_list`` once (graph-captured)."""
    import triton.testing

    def run_all():
        for f in fn_list:
            f()

    run_all()  # compile / autotune outside capture
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(run_all, rep=200, return_mode="median")
    return ms / n_items


def copies_for(nbytes: int) -> int:
    return max(1, min(64, math.ceil(ROTATE_BYTES / max(nbytes, 1))))


def record(subject, shape, provider, ms, nbytes, flops=0.0, base_ms=None, **extra):
    row = dict(subject=subject, shape=shape, provider=provider, us=ms * 1e3,
               tbps=nbytes / (ms * 1e-3) / 1e12 if nbytes else 0.0,
               tflops=flops / (ms * 1e-3) / 1e12 if flops else 0.0,
               vs_sdpa=(base_ms / ms) if base_ms else 1.0, **extra)
    ROWS.append(row)
    print(f"{subject:8s} {shape:22s} {provider:26s} {row['us']:10.1f} us  {row['tbps']:6.2f} TB/s  "
          f"{row['tflops']:7.1f} TF/s  x{row['vs_sdpa']:.2f}", flush=True)
    return row


def make_cache(kv_dtype, gran, B, L, gen_scale=1.0, R=(None, None)):
    """Codes and scales as QuantizedCache holds them (V key-contiguous for token scales); ``R``: (K's,
    V's) rotation, a side stored rotated as a rotated cache stores it (codes of x @ R)."""
    fmt = formats.get_format(kv_dtype, gran)
    k = torch.randn(B, HKV, L, D, device=DEVICE, dtype=torch.bfloat16) * gen_scale
    v = torch.randn(B, HKV, L, D, device=DEVICE, dtype=torch.bfloat16)
    kc = torch.empty(B, HKV, L, D, dtype=fmt.code_dtype, device=DEVICE)
    vc = v_codes_buffer((B, HKV, L, D), fmt.code_dtype, DEVICE, fmt.v_keys_contiguous)
    if fmt.is_static:
        ks = k.float().abs().amax(dim=(0, 2, 3)) / fmt.qmax
        vs = v.float().abs().amax(dim=(0, 2, 3)) / fmt.qmax
    else:
        ks = torch.empty(fmt.scale_shape(B, HKV, L, D), dtype=fmt.scale_dtype, device=DEVICE)
        vs = torch.empty_like(ks)
    kernels.store_kv(kc, ks, vc, vs, k, v, torch.tensor(0, device=DEVICE), None, *R, **fmts_of(kc, ks, vc, vs))
    return (kc, ks, vc, vs), (k, v)


def other_v_layout(vc):
    """The same V codes in the other layout (key-contiguous <-> head_dim-contiguous)."""
    if launcher.v_keys_contiguous(vc):
        return vc.contiguous()
    out = v_codes_buffer(vc.shape, vc.dtype, vc.device, keys=True)
    out.copy_(vc)
    return out


def v_layout_name(vc):
    return "keys" if launcher.v_keys_contiguous(vc) else "head_dim"


def cache_bytes(c):
    return sum(t.numel() * t.element_size() for t in c)


FORMATS = {"fp8": ("fp8_e4m3", "token"), "fp8/block32": ("fp8_e4m3", "block32"),
           "fp8/static": ("fp8_e4m3", "static"), "q8_0": ("q8_0", "block32"), "int8": ("int8", "token"),
           "int8+rot": ("int8", "token"), "int8+krot": ("int8", "token")}
# +rot: K and V stored rotated (the kernels rotate q and the output); +krot: K only (int8's default)


def rot(name):
    """(K's, V's) rotation matrix of a format name (None: that side is not rotated): the caches'
    shared matrix, whose entries the kernels generate."""
    R = rotation.shared(D, DEVICE)
    return {"+rot": (R, R), "+krot": (R, None)}.get(name[name.rfind("+"):] if "+" in name else "", (None, None))


def sdpa_decode_baseline(B, L, store=False):
    """(the rotated bf16 queries, ms per call) of bf16 SDPA decode over a bf16 K/V of length L (GQA by
    enable_gqa, no mask: its fastest decode configuration). ``store``: each call first writes the
    step's K and V token into the cache by ``index_copy_``, as transformers' StaticCache layer does."""
    n = copies_for(4 * B * HKV * L * D)
    qs = [torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    kvs = [(torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16),
            torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16)) for _ in range(n)]
    new = torch.randn(2, B, HKV, 1, D, device="cuda", dtype=torch.bfloat16)
    pos = torch.tensor([L - 1], device="cuda")

    def step(q, k, v):
        if store:
            k.index_copy_(2, pos, new[0])
            v.index_copy_(2, pos, new[1])
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    base = bench([lambda q=q, k=k, v=v: step(q, k, v) for q, (k, v) in zip(qs, kvs)], n)
    return qs, base


def decode(args):
    shapes = [tuple(int(x) for x in sh.split("x")) for sh in args.decode_shapes.split(",")]
    for B, L in shapes:
        shape = f"B={B} L={L}"
        kv_len = torch.full((B,), L, device="cuda", dtype=torch.long)
        qs, base = sdpa_decode_baseline(B, L)
        record("decode", shape, "sdpa-bf16", base, 4 * B * HKV * L * D + 4 * B * HQ * D)
        for name in args.formats:
            kv_dtype, gran = FORMATS[name]
            R = rot(name)
            c0, _ = make_cache(kv_dtype, gran, B, L, R=R)
            nb = cache_bytes(c0)
            n = copies_for(nb)
            caches = [c0] + [make_cache(kv_dtype, gran, B, L, R=R)[0] for _ in range(n - 1)]
            fns = [lambda q=q, c=c: kernels.attention(q, c[0], c[1], c[2], c[3], kv_len, None, False, None,
                                                      0, 0.0, None, *R, **fmts_of(c[0], c[1], c[2], c[3]))
                   for q, c in zip(qs, caches)]
            ms = bench(fns, len(fns))
            splits = splits_used(fns[0])
            record("decode", shape, f"kvcompile-{name}", ms, nb + 4 * B * HQ * D, base_ms=base, splits=splits)
            if R != (None, None):  # A/B: another matrix (same values, not the shared tensor): R read from memory,
                # q rotated by a launch before the kernel and the output by the merge (or a launch) after it
                Rm = tuple(r if r is None else r.clone() for r in R)
                fns_m = [lambda q=q, c=c: kernels.attention(q, c[0], c[1], c[2], c[3], kv_len, None, False, None,
                                                            0, 0.0, None, *Rm, **fmts_of(c[0], c[1], c[2], c[3])) for q, c in zip(qs, caches)]
                record("decode", shape, f"kvcompile-{name} R-launches", bench(fns_m, len(fns_m)),
                       nb + 4 * B * HQ * D, base_ms=base, splits=splits)
                del fns_m
            if args.sweep and ((B, L) in ((1, 4096), (8, 4096), (8, 32768), (1, 32768), (4, 131072), (32, 8192),
                                          (32, 32768)) or shape in SPLITS):
                sweep_decode(shape, qs, caches, kv_len, base, nb, name, tiles_sweep=args.tile_sweep, R=R)
            del caches, fns
        torch.cuda.empty_cache()


def window(args):
    """A sliding layer (context ``--window-context``, window ``--window``) against a full-attention
    layer at context = window and bf16 SDPA decode over the window's keys only (what a sliding bf16
    cache holds). The sliding layer's decode should track the window, not the context: its row's
    ``vs_full`` is the full layer's time over its own (1.0: as fast as a cache of the window's length).
    Two sliding rows: ``sliding``, the op over a cache of every position with the window (``ring=False``),
    and ``ring``, what ``QuantizedCache`` stores by default (W slots) and runs: ``attention_ring``, which
    also stores the step's token. A decode step of any layer stores its token, so two more rows time
    that step whole: ``full L=W + store`` (``store_kv`` then the attention, as a full layer runs) and
    ``sdpa-bf16 over W + store`` (``index_copy_`` of the token, then SDPA); the ring's ``vs_full_step``
    and ``vs_sdpa_step`` compare it with them. ``ring, store launched``: the ring's step with the token
    stored by a launch of its own instead of inside the attention kernel (``plan.override(store="launch")``)."""
    W, ctx = args.window, args.window_context
    for B in (int(b) for b in args.window_batches.split(",")):
        shape = f"B={B} L={ctx} W={W}"
        qs, base = sdpa_decode_baseline(B, W)
        record("window", shape, "sdpa-bf16 over W", base, 4 * B * HKV * W * D + 4 * B * HQ * D)
        _, base_step = sdpa_decode_baseline(B, W, store=True)
        record("window", shape, "sdpa-bf16 over W + store", base_step, 4 * B * HKV * W * D + 4 * B * HQ * D,
               base_ms=base)
        kv_new = torch.randn(2, B, HKV, 1, D, device="cuda", dtype=torch.bfloat16)
        for name in args.formats:
            kv_dtype, gran = FORMATS[name]
            R = rot(name)
            times = {}
            for label, L, win in (("full L=W", W, 0), ("sliding", ctx, W)):
                c0, _ = make_cache(kv_dtype, gran, B, L, R=R)
                nb = cache_bytes(c0) * W // L  # the bytes a call reads: the window's keys
                n = copies_for(nb)  # enough copies that the window's keys do not stay in L2
                caches = [c0] + [make_cache(kv_dtype, gran, B, L, R=R)[0] for _ in range(n - 1)]
                kv_len = torch.full((B,), L, device="cuda", dtype=torch.long)
                fns = [lambda q=q, c=c, kv_len=kv_len, win=win: kernels.attention(
                           q, c[0], c[1], c[2], c[3], kv_len, None, False, None, win, 0.0, None, *R, **fmts_of(c[0], c[1], c[2], c[3]))
                       for q, c in zip(qs * (-(-n // len(qs))), caches)]
                times[label] = ms = bench(fns, len(fns))
                extra = {"vs_full": times["full L=W"] / ms} if label == "sliding" else {}
                record("window", shape, f"kvcompile-{name} {label}", ms, nb + 4 * B * HQ * D, base_ms=base,
                       splits=splits_used(fns[0]), **extra)
                if label == "full L=W":  # the whole step of a full layer: store the token, then attend
                    last = torch.tensor(W - 1, device="cuda")
                    fns = [lambda q=q, c=c, kv_len=kv_len: (
                               kernels.store_kv(c[0], c[1], c[2], c[3], kv_new[0], kv_new[1], last, None, *R, **fmts_of(c[0], c[1], c[2], c[3])),
                               kernels.attention(q, c[0], c[1], c[2], c[3], kv_len, None, False, None, 0, 0.0, None,
                                                 *R, **fmts_of(c[0], c[1], c[2], c[3])))
                           for q, c in zip(qs * (-(-n // len(qs))), caches)]
                    times["full step"] = ms = bench(fns, len(fns))
                    record("window", shape, f"kvcompile-{name} full L=W + store", ms, nb + 4 * B * HQ * D,
                           base_ms=base_step)
                del caches, fns
            # the sliding layer as QuantizedCache stores it: a ring of W slots after ctx tokens; one decode
            # step = attention_ring (the new token's store, then attention over the ring)
            c0, _ = make_cache(kv_dtype, gran, B, W, R=R)
            nb = cache_bytes(c0)
            n = copies_for(nb)
            caches = [c0] + [make_cache(kv_dtype, gran, B, W, R=R)[0] for _ in range(n - 1)]
            cache_len = torch.tensor(ctx, device="cuda")
            fns = [lambda q=q, c=c: ring.attention(q, c[0], c[1], c[2], c[3], cache_len, kv_new[0], kv_new[1], None,
                                                   None, None, False, None, 0.0, None, *R, **fmts_of(c[0], c[1], c[2], c[3]))
                   for q, c in zip(qs * (-(-n // len(qs))), caches)]
            ms = bench(fns, len(fns))
            record("window", shape, f"kvcompile-{name} ring", ms, nb + 4 * B * HQ * D, base_ms=base,
                   vs_full=times["full L=W"] / ms, vs_full_step=times["full step"] / ms, vs_sdpa_step=base_step / ms)
            with plan_mod.override(store="launch"):  # the token stored by a launch of its own (A/B)
                ms = bench(fns, len(fns))
            record("window", shape, f"kvcompile-{name} ring, store launched", ms, nb + 4 * B * HQ * D, base_ms=base,
                   vs_full=times["full L=W"] / ms, vs_full_step=times["full step"] / ms, vs_sdpa_step=base_step / ms)
            del caches, fns
            torch.cuda.empty_cache()


def splits_used(fn) -> int:
    """The split count of the plan the launcher ran for this call (observed)."""
    seen, orig = [], launcher.plan_of
    launcher.plan_of = lambda call: seen.append(orig(call)) or seen[-1]
    try:
        fn()
    finally:
        launcher.plan_of = orig
    return seen[-1].splits if seen else 1


def sweep_decode(shape, qs, caches, kv_len, base, nb, name, tiles_sweep=False, R=(None, None)):
    """A/B of launch-plan variants on one shape (``plan.override``): V widened after its smem read,
    int8 widened by Triton's arithmetic, forced decode tiles and split counts, V in the other layout."""
    variants = [("vpin-off", dict(v_pin=False))]
    # a split of one key tile read through the loops, its reads after q's prologue (the plan issues them first)
    variants.append(("preload-off", dict(preload=False)))
    if name.startswith("int8"):
        # K unwidened into int8 MMAs (q in two int8 halves) forced on / off (off: K and V widened to
        # 1152 + code and the products corrected, the plan before 5b0f37b); V biased beside it
        variants.append(("int8mma-on", dict(int8_mma=True)))
        variants.append(("int8mma-off", dict(int8_mma=False, int8_bias=True)))
        variants.append(("int8mma-off exact", dict(int8_mma=False, int8_bias=False)))
        variants.append(("int8bias-on", dict(int8_bias=True)))
    if R[0] is not None:  # q rotated by a launch before the kernel instead of in its prologue
        variants.append(("q-launch", dict(q_rotation="launch")))
    if name == "q8_0":
        variants.append(("int8ptx-off", dict(int8_ptx=False)))
    if name.startswith("fp8"):  # e4m3 as archs below sm_89 take it: uint8 bits widened by integer ops
        variants.append(("fp8bits", dict(k_fp8_bits=True, v_fp8_bits=True, v_pin=False)))
    if tiles_sweep and name in ("fp8", "q8_0"):
        for bn, w, st in ((128, 4, 2), (128, 4, 3), (128, 4, 4), (64, 4, 3), (64, 4, 4), (128, 8, 2), (256, 4, 2),
                          (64, 2, 3), (16, 1, 3), (32, 1, 3), (32, 1, 4), (64, 1, 3)):  # 1 warp: no cross-warp reductions
            variants.append((f"tile{bn}x{w}w{st}s", dict(_tile=(bn, w, st))))
        # a register cap so that 3 (168 registers) or 4 (128) programs of 4 warps fit one SM, and
        # the split count aimed at that many resident programs
        for bn, w, st, r in ((128, 4, 3, 168), (128, 4, 2, 168), (128, 4, 2, 128), (64, 4, 3, 168), (64, 4, 3, 128),
                             (64, 4, 4, 168)):
            variants.append((f"tile{bn}x{w}w{st}s r{r}", dict(_tile=(bn, w, st, r))))
    for want in SPLITS.get(shape, ()):  # explicit split counts (what decode_splits would pick instead: see its model)
        variants.append((f"splits{want}", dict(splits=want)))
    # V in the layout the cache does not use for this format (key- vs head_dim-contiguous)
    other = "V " + ("head_dim" if v_layout_name(caches[0][2]) == "keys" else "keys")
    variants.append((other, dict(_vswap=True)))
    if tiles_sweep and name in ("fp8", "q8_0"):
        for bn, w, st in ((128, 4, 3), (128, 4, 4), (64, 4, 4), (256, 4, 2)):
            variants.append((f"{other} tile{bn}x{w}w{st}s", dict(_vswap=True, _tile=(bn, w, st))))
    # fp16 queries: the kernel skips the bf16 -> fp16 range check (one max-reduction over the q block)
    variants.append(("qfp16", dict(_qfp16=True)))
    variants.append((f"{other} qfp16", dict(_vswap=True, _qfp16=True)))
    if AB_KERNEL is not None:
        variants.append((f"kernel {os.path.basename(AB_KERNEL)}", dict(_kernel=AB_KERNEL)))
    if VARIANTS is not None:
        variants = [(lb, ch) for lb, ch in variants if VARIANTS.search(lb)]
    swapped = None
    for label, changes in variants:
        changes = dict(changes)
        tile = changes.pop("_tile", None)
        kernel_file = changes.pop("_kernel", None)
        use = caches
        qv = [q.half() for q in qs] if changes.pop("_qfp16", False) else qs
        if changes.pop("_vswap", False):
            if swapped is None:
                swapped = [(c[0], c[1], other_v_layout(c[2]), c[3]) for c in caches]
            use = swapped
        if tile is not None:
            changes["tile"] = tiles.Tile(16, *tile)
        saved_kernel = launcher._attention_kernel
        try:
            if kernel_file is not None:
                launcher._attention_kernel = load_kernel_file(kernel_file)
            fns = [lambda q=q, c=c: kernels.attention(q, c[0], c[1], c[2], c[3], kv_len, None, False, None,
                                                      0, 0.0, None, *R, **fmts_of(c[0], c[1], c[2], c[3]))
                   for q, c in zip(qv, use)]
            with plan_mod.override(**changes):
                ms = bench(fns, len(fns))
            if launcher._SHRUNK:  # Triton refused the tile; say what ran instead
                label += " (ran " + ",".join(f"{t.block_n}x{t.num_warps}w{t.num_stages}s" for t in launcher._SHRUNK.values()) + ")"
            record("sweep", shape, f"kvcompile-{name} {label}", ms, nb, base_ms=base)
        except Exception as e:
            print("sweep skip", label, type(e).__name__, str(e)[:120])
        finally:
            launcher._attention_kernel = saved_kernel
            launcher._SHRUNK.clear()


def bf16_causal_paths(q, k, v):
    """Every SDPA form of causal attention for Tq new queries at the end of L keys: ``is_causal``
    (Tq == L), the lower-right causal bias (dispatch, then flash and cuDNN forced), each with the
    keys repeated or enable_gqa where the form takes it. The fastest differs per shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    Tq, L = q.shape[2], k.shape[2]
    sd = F.scaled_dot_product_attention
    kk, vv = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    if Tq == L:
        forms = {"is_causal": lambda: sd(q, k, v, is_causal=True, enable_gqa=True),
                 "is_causal repeated": lambda: sd(q, kk, vv, is_causal=True)}
    else:
        bias = causal_lower_right(Tq, L)
        forms = {"lower-right": lambda: sd(q, kk, vv, attn_mask=bias)}
    for name, fn in list(forms.items()):
        for label, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            def forced(fn=fn, backend=backend):
                with sdpa_kernel(backend):
                    return fn()
            forms[f"{name} {label}"] = forced
    return forms


def prefill(args):
    L = args.prefill_L
    cases = [(int(t), True) for t in args.prefill_q.split(",")]  # Tq new tokens at the end of an L-key cache
    for Tq, causal in cases:
        shape = f"Tq={Tq} L={L}"
        q = torch.randn(1, HQ, Tq, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, HKV, L, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, HKV, L, D, device="cuda", dtype=torch.bfloat16)
        # causal FLOPs: the (Tq x L) score and PV products over the visible (lower-right) part
        vis = Tq * L - Tq * (Tq - 1) / 2
        flops = 4 * HQ * D * vis
        timed = {}
        for name, fn in bf16_causal_paths(q, k, v).items():
            try:
                timed[name] = bench([fn], 1)
            except Exception as e:  # a backend that refuses the shape is named, not hidden
                print("prefill skip sdpa-bf16", name, type(e).__name__, str(e)[:120])
        for name, ms in timed.items():
            record("sweep", shape, f"sdpa-bf16 {name}", ms, 0, flops)
        best = min(timed, key=timed.get)
        base = timed[best]
        sd = bf16_causal_paths(q, k, v)[best]
        record("prefill", shape, "sdpa-bf16", base, 0, flops, path=best)
        # the dense path cannot be graph-captured (its host sync): SDPA timed the same way, for scale
        record("prefill", shape, "sdpa-bf16 eager", time_eager(sd), 0, flops, base_ms=base)
        kv_len = torch.tensor(L, device="cuda")
        for fname, path in [(f, p) for f in args.prefill_formats.split(",") for p in ("fused", "dense")]:
            R = rot(fname)
            c, _ = make_cache(*FORMATS[fname], 1, L, R=R)
            os.environ["KVCOMPILE_PREFILL"] = path
            fn = lambda: kernels.attention(q, c[0], c[1], c[2], c[3], kv_len, None, causal, None, 0, 0.0, None, *R, **fmts_of(c[0], c[1], c[2], c[3]))
            try:
                ms = bench([fn], 1) if path == "fused" else time_eager(fn)
            except Exception as e:
                print("prefill skip", path, type(e).__name__, str(e)[:200])
                continue
            record("prefill", shape, f"kvcompile-{fname}-{path}", ms, 0, flops, base_ms=base)
            if path == "fused":  # timed as the dense path is too: the crossover compares like with like
                record("prefill", shape, f"kvcompile-{fname}-fused eager", time_eager(fn), 0, flops, base_ms=base)
            if path == "fused" and args.sweep and fname.startswith("int8"):
                # K widened exactly instead of scored by int8 MMAs (the plan before 9e48688), and the
                # decode tiles' int8 bias beside the widening, forced
                for label, changes in (("int8mma-off", dict(int8_mma=False)),
                                       ("int8bias-on", dict(int8_mma=False, int8_bias=True))):
                    with plan_mod.override(**changes):
                        record("sweep", shape, f"kvcompile-{fname}-fused {label}", bench([fn], 1), 0, flops,
                               base_ms=base)
            if path == "fused" and args.prefill_variants:
                prefill_variants(args, shape, fname, fn, flops, base)
            if fname != "fp8":
                continue
            if path == "fused" and AB_KERNEL is not None:
                saved_kernel = launcher._attention_kernel
                launcher._attention_kernel = load_kernel_file(AB_KERNEL)
                try:
                    record("sweep", shape, f"kvcompile-fp8-fused kernel {os.path.basename(AB_KERNEL)}", bench([fn], 1), 0,
                           flops, base_ms=base)
                finally:
                    launcher._attention_kernel = saved_kernel
            if path == "fused" and args.sweep:
                with plan_mod.override(v_pin=False):
                    record("sweep", shape, "kvcompile-fp8-fused vpin-off", bench([fn], 1), 0, flops, base_ms=base)
            if path == "fused" and args.tile_sweep:
                # fused prefill tiles, V in the cache's layout and in the other one
                vt = other_v_layout(c[2])
                fnt = lambda: kernels.attention(q, c[0], c[1], vt, c[3], kv_len, None, causal, None, **fmts_of(c[0], c[1], vt, c[3]))
                for vk, f in ((" V " + v_layout_name(c[2]), fn), (" V " + v_layout_name(vt), fnt)):
                    for t in (None, (128, 128, 8, 3), (128, 64, 8, 3), (64, 128, 4, 2), (64, 128, 4, 3), (64, 64, 4, 2),
                              (128, 128, 8, 2), (64, 128, 8, 2), (32, 128, 4, 2)):
                        launcher._SHRUNK.clear()
                        label = "default" if t is None else "tile{}x{}x{}w{}s".format(*t)
                        try:
                            with plan_mod.override(**({} if t is None else {"tile": tiles.Tile(*t)})):
                                ms = bench([f], 1)
                            ran = ",".join(f"{r.block_m}x{r.block_n}x{r.num_warps}w{r.num_stages}s" for r in launcher._SHRUNK.values())
                            record("sweep", shape, f"kvcompile-fp8-fused{vk} {label}" + (f" (ran {ran})" if ran else ""),
                                   ms, 0, flops, base_ms=base)
                        except Exception as e:
                            print("sweep skip", vk, label, type(e).__name__, str(e)[:120])
                        finally:
                            launcher._SHRUNK.clear()
                os.environ["KVCOMPILE_PREFILL"] = "dense"
                try:
                    record("sweep", shape, "kvcompile-fp8-dense V " + v_layout_name(vt), time_eager(fnt), 0, flops,
                           base_ms=base)
                finally:
                    os.environ["KVCOMPILE_PREFILL"] = "fused"
                del vt
        os.environ.pop("KVCOMPILE_PREFILL", None)
        del q, k, v, c
        torch.cuda.empty_cache()


# --prefill-variants: the fused prefill's plan variants (plan.override), each with the tiles of --prefill-tiles
# (default: the plan's, and 128 x 64 / 8 warps / 3 stages: no spills under Triton 3.9, tests/test_sass.py)
PREFILL_VARIANTS = {"exact": {}, "q8": dict(q_quant=True, p_fp8=False),
                    "q8+p8": dict(q_quant=True, p_fp8=True, p_int8=True)}  # P as V's code type: e4m3 or int8


def prefill_variants(args, shape, fname, fn, flops, base):
    """Time each --prefill-variants entry (q quantized per row, 8-bit P: plan.LaunchPlan.q_quant / p_fp8 / p_int8;
    a suffix ``/accN``: the fp8 dots promote to fp32 every N products, plan.LaunchPlan.fp8_acc; ``/acctile``:
    once per dot, so P V once per key tile)."""
    for name in args.prefill_variants.split(","):
        base_name, _, acc = name.partition("/acc")
        for tile_name in args.prefill_tiles.split(","):
            t = None if tile_name == "plan" else tuple(int(x) for x in tile_name.split("x"))
            tname = "" if t is None else " t{}x{}w{}s{}".format(*t)
            fields = dict(PREFILL_VARIANTS[base_name], **({"tile": tiles.Tile(*t)} if t else {}),
                          **({"fp8_acc": plan_mod.FP8_ACC_PER_DOT if acc == "tile" else int(acc)} if acc else {}))
            launcher._SHRUNK.clear()
            try:
                with plan_mod.override(**fields):
                    record("sweep", shape, f"kvcompile-{fname}-fused {name}{tname}", bench([fn], 1), 0, flops,
                           base_ms=base)
            except Exception as e:  # a variant that fails to compile is named, not hidden
                print("prefill variant skip", fname, name, tname, type(e).__name__, str(e)[:160])
            launcher._SHRUNK.clear()


def time_eager(fn):
    """The dense path syncs once (prefix length) and cannot be graph-captured: time it eagerly."""
    import triton.testing

    fn()
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def store(args):
    cases = [(1, 16384), (8, 1)]  # (B, T): a 16k prefill of one layer; a decode step
    L = 16384
    for B, T in cases:
        shape = f"B={B} T={T}"
        nel = B * HKV * T * D
        n = copies_for(2 * nel * 2 * 2)
        ks = [torch.randn(B, HKV, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
        vs = [torch.randn(B, HKV, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
        kb = torch.empty(B, HKV, L, D, device="cuda", dtype=torch.bfloat16)
        vb = torch.empty_like(kb)
        start = torch.tensor(7 if T == 1 else 0, device="cuda")
        pos = torch.arange(T, device="cuda") + start

        def bf16_write(k, v):  # what HF's StaticLayer does: index_copy_ of K and V
            kb.index_copy_(2, pos, k)
            vb.index_copy_(2, pos, v)

        base = bench([lambda k=k, v=v: bf16_write(k, v) for k, v in zip(ks, vs)], n)
        record("store", shape, "bf16-index_copy", base, 2 * nel * 4)
        for name in args.formats:
            kv_dtype, gran = FORMATS[name]
            R = rot(name)
            fmt = formats.get_format(kv_dtype, gran)
            kc = torch.empty(B, HKV, L, D, dtype=fmt.code_dtype, device="cuda")
            vc = v_codes_buffer((B, HKV, L, D), fmt.code_dtype, "cuda", fmt.v_keys_contiguous)  # the cache's layout
            if fmt.is_static:
                sk = torch.full((HKV,), 0.01, device="cuda")
                sv = sk.clone()
            else:
                sk = torch.empty(fmt.scale_shape(B, HKV, L, D), dtype=fmt.scale_dtype, device="cuda")
                sv = torch.empty_like(sk)
            fns = [lambda k=k, v=v: kernels.store_kv(kc, sk, vc, sv, k, v, start, None, *R, **fmts_of(kc, sk, vc, sv)) for k, v in zip(ks, vs)]
            g = fmt.groups(D)
            nb = 2 * nel * (2 + 1) + 2 * B * HKV * T * g * (2 if kv_dtype == "q8_0" else 4)
            record("store", shape, f"kvcompile-{name}", bench(fns, len(fns)), nb, base_ms=base)
            if args.sweep and kv_dtype == "fp8_e4m3":  # A/B: e4m3 encoded by integer arithmetic, not cvt
                hw, store_launcher.hw_e4m3 = store_launcher.hw_e4m3, lambda device: False
                try:
                    record("sweep", shape, f"store-{name} e4m3 bits", bench(fns, len(fns)), nb, base_ms=base)
                finally:
                    store_launcher.hw_e4m3 = hw
        del ks, vs, kb, vb
        torch.cuda.empty_cache()


def _read_probe_kernel():
    """A kernel that only reads K and V tile by tile (no math), on the decode launch's grid."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_kv(K, V, OUT, L, split_len, nsplits, V_LAYOUT: tl.constexpr, BT: tl.constexpr,
                BLOCK_N: tl.constexpr, D: tl.constexpr):
        pid_bh = tl.program_id(1)
        split = tl.program_id(2)
        k_base = K + pid_bh.to(tl.int64) * L * D
        v_base = V + pid_bh.to(tl.int64) * L * D
        n_lo = split * split_len
        n_hi = tl.minimum(L, n_lo + split_len)
        d = tl.arange(0, D)
        acc = tl.zeros([BLOCK_N, D], tl.uint8)
        for start in range(n_lo, n_hi, BLOCK_N):  # L and split_len are multiples of BLOCK_N: no masks
            n = start + tl.arange(0, BLOCK_N)
            kc = tl.load(k_base + n[:, None] * D + d[None, :])
            if V_LAYOUT == 0:  # [L, D]: head_dim-contiguous, each tile one 16 KB run (as K)
                vp = v_base + n[:, None] * D + d[None, :]
            elif V_LAYOUT == 1:  # [D, L]: key-contiguous rows (the cache's layout for token scales)
                vp = v_base + n[:, None] + d[None, :] * L
            else:  # [L / BT, D, BT]: key-contiguous blocks of BT keys
                vp = v_base + ((n // BT) * BT * D + n % BT)[:, None] + d[None, :] * BT
            acc = acc ^ kc ^ tl.load(vp)
        tl.store(OUT + pid_bh * nsplits + split, tl.sum(acc.to(tl.int32)))

    return read_kv


def read(args):
    """How fast can the decode grid read an 8-bit K + V at all? The same bytes and splits as the fp8
    decode launch, V in five layouts, no math: the ceiling each layout leaves the attention kernel."""
    read_kv = _read_probe_kernel()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for sh in args.decode_shapes.split(","):
        B, L = (int(x) for x in sh.split("x"))
        if L % 256:
            continue
        shape = f"B={B} L={L}"
        nb = 2 * B * HKV * L * D
        _, base = sdpa_decode_baseline(B, L)
        record("read", shape, "sdpa-bf16", base, 2 * nb)
        n = copies_for(nb)
        kv = [(torch.randint(0, 255, (B * HKV * L * D,), dtype=torch.uint8, device="cuda"),
               torch.randint(0, 255, (B * HKV * L * D,), dtype=torch.uint8, device="cuda")) for _ in range(n)]
        splits, split_len = plan_mod.decode_splits(B * HKV, L, 128, sms, 3)  # the fp8 decode tile's 3 per SM
        out = torch.empty(B * HKV * splits, dtype=torch.int32, device="cuda")
        for layout, bt, label in ((0, 1, "V [L, D]"), (1, 1, "V [D, L] (cache)"), (2, 16, "V [L/16, D, 16]"),
                                  (2, 128, "V [L/128, D, 128]"), (2, 256, "V [L/256, D, 256]")):
            for warps in (4, 8):
                fns = [lambda k=k, v=v: read_kv[(1, B * HKV, splits)](
                           k, v, out, L, split_len, splits, V_LAYOUT=layout, BT=bt, BLOCK_N=128, D=D,
                           num_warps=warps, num_stages=3) for k, v in kv]
                record("read", shape, f"read K + {label} {warps}w", bench(fns, len(fns)), nb, base_ms=base)
        del kv
        torch.cuda.empty_cache()


def smoke(args):
    """Every kernel once on small odd shapes (for compute-sanitizer memcheck)."""
    os.environ["KVCOMPILE_PREFILL"] = "fused"
    for name in args.formats:
        kv_dtype, gran = FORMATS[name]
        R = rot(name)
        (kc, ks, vc, vs), _ = make_cache(kv_dtype, gran, 3, 301, R=R)
        kv_len = torch.tensor([301, 77, 5], device=DEVICE)
        for v in (vc, other_v_layout(vc)):  # key-contiguous V: 16-key chunk reads up to the padded 304
            for Tq in (1, 7, 40):
                q = torch.randn(3, HQ, Tq, D, device=DEVICE, dtype=torch.bfloat16)
                m = torch.rand(3, 1, Tq, 301, device=DEVICE) > 0.2
                kernels.attention(q, kc, ks, v, vs, kv_len, m, True, None, 0, 0.0, None, *R, **fmts_of(kc, ks, v, vs))
                kernels.attention(q, kc, ks, v, vs, kv_len, None, False, None, 0, 0.0, None, *R, **fmts_of(kc, ks, v, vs))
                kernels.attention(q, kc, ks, v, vs, kv_len, None, True, None, 0, 0.0, None, *R, **fmts_of(kc, ks, v, vs))  # unmasked + diagonal
                sinks = torch.randn(HQ, device=DEVICE)
                kernels.attention(q, kc, ks, v, vs, kv_len, None, True, None, 37, 20.0, sinks, *R, **fmts_of(kc, ks, v, vs))  # window edges
            os.environ["KVCOMPILE_PREFILL"] = "dense"  # the one-launch K + V dequantize, both V layouts
            kernels.attention(q, kc, ks, v, vs, kv_len, m, True, None, 0, 0.0, None, *R, **fmts_of(kc, ks, v, vs))
            os.environ["KVCOMPILE_PREFILL"] = "fused"
            kernels.dequantize(v, vs, None, kv_len, torch.bfloat16, fmt=fmt_of(v, vs))
        kernels.dequantize(kc, ks, None, kv_len, torch.bfloat16, fmt=fmt_of(kc, ks))
    os.environ.pop("KVCOMPILE_PREFILL")
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    print("smoke done")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--subjects", default="decode,prefill,store")
    p.add_argument("--formats", default="fp8,fp8/block32,fp8/static,q8_0")
    p.add_argument("--out", default="bench.csv")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--tile-sweep", action="store_true",
                   help="decode tiles and programs per SM (with --sweep), fused prefill tiles")
    p.add_argument("--decode-shapes", default="1x4096,1x32768,8x32768,32x8192,4x131072")
    p.add_argument("--prefill-q", default="16384,4096,1024")
    p.add_argument("--prefill-L", type=int, default=16384, help="subject prefill: the cache's keys (new ones last)")
    p.add_argument("--prefill-formats", default="fp8", help="formats timed by subject prefill (fused and dense)")
    p.add_argument("--prefill-variants", default="", help=f"fused prefill plan variants, of {list(PREFILL_VARIANTS)}, each optionally /accN (fp8_acc)")
    p.add_argument("--prefill-tiles", default="plan,128x64x8x3",
                   help="tiles of each --prefill-variants entry: plan (the plan's), or MxNxWARPSxSTAGES")
    p.add_argument("--window", type=int, default=4096, help="subject window: the sliding layer's window")
    p.add_argument("--window-context", type=int, default=32768, help="subject window: the sliding layer's context")
    p.add_argument("--window-batches", default="1,8,32", help="subject window: batch sizes")
    p.add_argument("--splits", default=None, help="explicit decode split counts per sweep shape, e.g. 8x32768:6,12,19")
    p.add_argument("--variants", default=None, help="a regex: run only the --sweep variants whose label matches")
    p.add_argument("--ab-kernel", default=None,
                   help="another _attention_kernel.py (e.g. `git show REV:kvcompile/kernels/_attention_kernel.py`), "
                        "timed as a --sweep variant beside the current one")
    args = p.parse_args()
    global VARIANTS, AB_KERNEL
    AB_KERNEL = args.ab_kernel
    for item in filter(None, (args.splits or "").split(";")):  # "8x32768:6,12,19;4x131072:24,49"
        sh, counts = item.split(":")
        b, l = sh.split("x")
        SPLITS[f"B={b} L={l}"] = [int(c) for c in counts.split(",")]
    if args.variants:
        import re

        VARIANTS = re.compile(args.variants)
    args.formats = args.formats.split(",")
    print(torch.cuda.get_device_name(0), "torch", torch.__version__)
    for subject in args.subjects.split(","):
        {"decode": decode, "prefill": prefill, "store": store, "smoke": smoke, "read": read,
         "window": window}[subject](args)
    keys = sorted({k for r in ROWS for k in r})
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(ROWS)
    if any(r["subject"] == "sweep" for r in ROWS):
        print("\n| sweep shape | variant | us | TB/s | vs SDPA bf16 |")
        print("|---|---|---:|---:|---:|")
        for r in ROWS:
            if r["subject"] == "sweep":
                print(f"| {r['shape']} | {r['provider']} | {r['us']:.1f} | {r['tbps']:.2f} | {r['vs_sdpa']:.2f} |")
    print("\n| subject | shape | provider | us | TB/s | TFLOP/s | vs SDPA bf16 |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in ROWS:
        if r["subject"] == "sweep":
            continue
        print(f"| {r['subject']} | {r['shape']} | {r['provider']} | {r['us']:.1f} | {r['tbps']:.2f} | "
              f"{r['tflops']:.0f} | {r['vs_sdpa']:.2f} |")


if __name__ == "__main__":
    main()
