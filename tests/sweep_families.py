"""Every causal LM of the installed transformers through kvcompile, the way a new user tries one
(a developer tool, not collected by pytest: about a minute per 8 families on two CPU cores).

    PYTHONPATH=. python tests/sweep_families.py                  # families outside tests/families.py
    PYTHONPATH=. python tests/sweep_families.py --all --kv-dtype q8_0
    PYTHONPATH=. python tests/sweep_families.py --only GraniteSWAConfig OPTConfig

For each config class in transformers' causal-LM mapping it builds the tiny config of
tests/models.py (``BASE`` over the class's defaults), then classifies the family:

* ``refused``: :func:`kvcompile.hf.check_config` names why the cache cannot serve it;
* ``not built``: the tiny config or its model could not be built from ``BASE`` (a family that needs
  other sizes: not a kvcompile result);
* ``ok``: the checks of tests/test_families.py pass: every compiled graph rewritten, compiled =
  eager over the same cache, eager = transformers' DynamicCache on the same 8-bit values;
* ``FAIL`` / ``error``: a check failed, or the eager run over the cache raised; the message says
  which. A family whose attention the pass leaves alone lands here with the pass's reason.

Each family runs in its own process (``--timeout`` seconds), so one hang or crash costs one row.
A family that passes here earns its row in tests/families.py, which CI runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# what a family needs beyond BASE to build tiny (its defaults assume the real sizes)
TINY = {
    "CodeGenConfig": dict(rotary_dim=16),  # rotary dims within head_dim 32
    "DoryConfig": dict(num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1),
    # hybrids: a state layer (Mamba / gated delta net / conv) and an attention layer, in the family's own terms
    **{name: dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
       for name in ("Qwen3NextConfig", "Qwen3_5TextConfig", "Qwen3_5MoeTextConfig", "GraniteMoeHybridConfig",
                    "LaraMiniConfig")},
    "Lfm3Config": dict(num_hidden_layers=2, layer_types=["conv", "full_attention"]),
    "JambaConfig": dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                        expert_layer_offset=1),
    "BambaConfig": dict(num_hidden_layers=2, attn_layer_indices=[1]),
    "RecurrentGemmaConfig": dict(num_hidden_layers=3),
    "Dots3NoteTextConfig": dict(num_key_value_heads=4),  # multi-head: as many kv heads as query heads
    # multimodal wrappers of a hybrid text model: a tiny text config (their defaults build the full size)
    **{name: dict(text_config=dict(vocab_size=96, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=64,
                                   layer_types=["linear_attention", "full_attention"]),
                  vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=128))
       for name in ("Qwen3_5Config", "Qwen3_5MoeConfig")},
    # multimodal wrappers of an attention text model: a tiny text config and encoder (their defaults are the full
    # sizes, where compiled and eager part after tens of layers by compounding 8-bit code flips)
    **{name: dict(text_config=dict(vocab_size=96, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, **text), **encoder)
       for name, text, encoder in (
           ("Gemma3Config", {}, dict(vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, image_size=32, patch_size=8),
                                 mm_tokens_per_image=4)),
           ("Gemma4Config", dict(layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=96,
                                 hidden_size_per_layer_input=16), {}),
           ("GotOcr2Config", {}, dict(vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                     image_size=64, patch_size=16))),
           ("MossTranscribeDiarizeConfig", {}, dict(audio_config=dict(hidden_size=32, d_model=32, num_hidden_layers=1,
                                                                  encoder_layers=1, intermediate_size=32,
                                                                  num_attention_heads=2))))},
    "OlmoHybridConfig": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
    # Zamba ties its hybrid layers' shared block to the first one's: it builds with two of them
    "ZambaConfig": dict(num_hidden_layers=6, attn_layer_period=2, attn_layer_offset=1),
    "Zamba2Config": dict(num_hidden_layers=2, layers_block_type=["linear_attention", "hybrid"], hybrid_layer_ids=[1]),
    "ZayaConfig": dict(num_hidden_layers=2, layer_types=["hybrid", "hybrid"]),
    **{name: dict(num_hidden_layers=2, layer_types=["hybrid_sliding", "hybrid"])
       for name in ("InklingTextConfig", "Inkling2TextConfig", "Inkling2LoopTextConfig")},
}


def _classes(include_matrix: bool) -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    sys.path.insert(0, HERE)
    from models import FAMILIES

    matrix = {cls for cls, _ in FAMILIES.values()}
    names = sorted({CONFIG_MAPPING_NAMES[k] for k in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if k in CONFIG_MAPPING_NAMES})
    return [n for n in names if include_matrix or n not in matrix]


def _one(name: str, kv_dtype: str) -> dict:
    """Classify one config class (run in a child process)."""
    sys.path.insert(0, HERE)
    import transformers

    import families
    import models
    import test_families as tf
    from kvcompile import hf

    cls = getattr(transformers, name)
    # a family without num_key_value_heads (MHA: GPT-NeoX, OPT, ...) must not get BASE's, which its
    # config would keep as a stray attribute that the cache reads
    extra = {} if models._has_field(cls, "num_key_value_heads") else {"num_key_value_heads": None}
    extra.update(TINY.get(name, {}))
    models.FAMILIES["sweep"] = (name, extra)
    try:
        cfg = models.tiny_config("sweep")
    except Exception as e:
        return {"status": "not built", "why": f"config: {type(e).__name__}: {e}"}
    try:
        hf.check_config(cfg)
    except hf.UnsupportedModelError as e:
        return {"status": "refused", "why": e.reason}
    model, attn = None, None
    for attn in ("sdpa", "eager"):
        try:
            model = models.tiny_model(cfg, attn)
            break
        except Exception as e:
            why = f"model: {type(e).__name__}: {e}"
    if model is None:
        return {"status": "not built", "why": why}
    row = families.Row("sweep", "sweep", name, "", {})
    case = tf.Case(row, attn, kv_dtype)
    tf._MODELS[("sweep", attn, True)] = model
    try:
        tf._result(case)
    except Exception as e:
        return {"status": "error", "attn": attn, "why": f"eager run: {type(e).__name__}: {e}"}
    failed, flips = [], []
    for check in (tf.test_every_graph_is_rewritten, tf.test_compiled_equals_eager,
                  tf.test_eager_equals_transformers_cache):
        try:
            check(case)
        except tf.pytest.xfail.Exception as e:  # a code one rounding apart (test_families): said, not failed
            flips.append(f"{check.__name__} xfail: {str(e).splitlines()[0]}")
        except Exception as e:
            failed.append(f"{check.__name__}: {e}")
    if failed:
        return {"status": "FAIL", "attn": attn, "why": " | ".join(failed + flips)}
    return {"status": "ok", "attn": attn, "why": " | ".join(flips)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--all", action="store_true", help="also the families tests/families.py already runs")
    p.add_argument("--only", nargs="+", help="these config classes (e.g. OPTConfig)")
    p.add_argument("--kv-dtype", default="int8")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per family")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child process
    args = p.parse_args(argv)
    if args.one:
        print("SWEEP " + json.dumps(_one(args.one, args.kv_dtype)), flush=True)
        return 0
    names = args.only or _classes(args.all)
    rows = []
    for name in names:
        t0 = time.perf_counter()
        try:
            out = subprocess.run([sys.executable, __file__, "--one", name, "--kv-dtype", args.kv_dtype],
                                 capture_output=True, text=True, timeout=args.timeout)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("SWEEP ")), None)
            res = json.loads(line[6:]) if line else {"status": "error",
                                                     "why": f"exit {out.returncode}: {out.stderr.strip()[-300:]}"}
        except subprocess.TimeoutExpired:
            res = {"status": "error", "why": f"no result in {args.timeout:.0f} s"}
        res.update(config=name, seconds=round(time.perf_counter() - t0, 1))
        rows.append(res)
        why = " ".join(res["why"].split())
        print(f"{name:<32} {res['status']:<9} {res.get('attn') or '':<6} {why[:160]}", flush=True)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "refused", "not built", "FAIL", "error")}
    print("\n" + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return 1 if counts["FAIL"] or counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
