"""Families whose attention the pass reaches through less common spellings, on a GPU in bf16: the
Triton kernels behind every rewritten site. GPT-J computes its scores in float32 from
``query.to(torch.float32)`` (the op takes the bf16 query), Falcon-7b's 71 query heads share one kv
head (broadcast, not ``enable_gqa``), GPT-2 casts P with ``.type``. Skipped without CUDA (CPU CI
covers the same graphs with the reference op: tests/test_families.py); run on the device machine.
"""

from __future__ import annotations

import pytest
import torch

import kvcompile
from models import cache_kwarg, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = {  # per layer: falcon-7b's heads and head_dim; GPT-J's and GPT-2's head_dim with fewer heads
    "falcon": dict(hidden_size=71 * 64, num_attention_heads=71),
    "gptj": dict(hidden_size=8 * 256, num_attention_heads=8, rotary_dim=64),
    "gpt2": dict(hidden_size=12 * 64, num_attention_heads=12),
}


# GPT-J's float32 scores are its eager attention (the device's transformers 5.17 has no SDPA path for it)
CASES = [("falcon", "sdpa"), ("falcon", "eager"), ("gptj", "eager"), ("gpt2", "sdpa"), ("gpt2", "eager")]


@pytest.mark.parametrize("family, attn", CASES)
def test_compiled_decode_matches_eager(family, attn):
    """Prefill of 40 tokens (batch 2) and 24 decode steps, teacher-forced: every site rewritten, and
    the compiled logits within a sanity bound of the eager model over the same cache format. The two
    compute attention differently in bf16 (the eager path dequantizes to bf16 and keeps bf16 P), so
    the bound is the one tests/test_cudagraphs.py measures for that difference (1e-1: catches O(1)
    defects such as a wrong head mapping, not rounding)."""
    torch._dynamo.reset()
    model = tiny_model(family, attn, dtype=torch.bfloat16, device="cuda", vocab_size=1024, num_hidden_layers=2,
                       max_position_embeddings=256, **SHAPES[family])
    kw = cache_kwarg(model)
    backend = kvcompile.backend("int8")
    compiled = torch.compile(model.forward, backend=backend, fullgraph=True)
    caches = [kvcompile.QuantizedCache(model.config, max_batch_size=2, max_cache_len=128, kv_dtype="int8",
                                       device="cuda") for _ in range(2)]
    ids = torch.randint(3, 1024, (2, 40), device="cuda")
    worst = 0.0
    with torch.no_grad():
        outs = [fn(input_ids=ids, **{kw: c}).logits[:, -1].float() for fn, c in zip((model.forward, compiled), caches)]
        for _ in range(24):
            worst = max(worst, ((outs[1] - outs[0]).norm() / outs[0].norm()).item())
            tok = outs[0].argmax(-1, keepdim=True)
            outs = [fn(input_ids=tok, **{kw: c}).logits[:, -1].float() for fn, c in zip((model.forward, compiled), caches)]
    report = backend.report()
    assert report and all(r["found"] == r["rewritten"] == 2 and not r["skipped"] for r in report), report
    assert worst < 1e-1, f"compiled vs eager logits: {worst:.3e}"
