"""One rank of the tensor-parallel test (no tests here): started by tests/test_tp.py under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/tp_worker.py MODEL_DIR OUT_DIR

One launch (each costs CI ~15 s of imports), two phases:

* match: load MODEL_DIR with ``DistributedConfig(tp_plan="auto")`` (gloo on CPU, nccl on CUDA), store K/V in a
  ``QuantizedCache(tp_size=model.tp_size)``, prefill eagerly and decode ``STEPS`` tokens through
  ``torch.compile(model.forward, backend=kvcompile.backend())`` (one graph); the same prompt and
  tokens through the unsharded model in this process, eagerly, with a cache of the same format.
  Writes ``OUT_DIR/rank{r}.pt``: the logits of both runs, the backend's report, the local kv heads.
* then a bad input: rank 0 builds a cache for a model whose kv heads do not divide among the ranks (it raises);
  the others wait in a collective that only rank 0 could complete. torchrun must end them all
  (the launch exits non-zero by design).
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
import transformers

import kvcompile
from models import cache_kwarg, tiny_config

PROMPT, STEPS, MAX_LEN = 5, 3, 16


def tokens(vocab: int) -> torch.Tensor:
    """The prompt and then the decode tokens (fed in order: both runs see the same inputs)."""
    return torch.randint(3, vocab, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))


def run(model, forward_decode, cache, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[PROMPT + STEPS, vocab]``: an eager prefill, then one decode call per token."""
    kw = cache_kwarg(model)
    with torch.no_grad():
        out = [model(input_ids=ids[:, :PROMPT], use_cache=True, **{kw: cache}).logits[0]]
        for t in range(PROMPT, PROMPT + STEPS):
            out.append(forward_decode(input_ids=ids[:, t : t + 1], use_cache=True, **{kw: cache}).logits[0])
    return torch.cat(out).float().cpu()


def match(model_dir: str, out_dir: str) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, distributed_config=transformers.DistributedConfig(tp_plan="auto"), dtype=torch.float32).eval()
    rank, device = dist.get_rank(), model.device  # transformers put this rank on cuda:LOCAL_RANK (or cpu)
    ids = tokens(model.config.vocab_size).to(device)
    cache = kvcompile.QuantizedCache(model.config, max_batch_size=1, max_cache_len=MAX_LEN, tp_size=model.tp_size)
    backend = kvcompile.backend()
    tp_logits = run(model, torch.compile(model.forward, backend=backend), cache, ids)

    single = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    ref_cache = kvcompile.QuantizedCache(single.config, max_batch_size=1, max_cache_len=MAX_LEN)
    ref_logits = run(single, single, ref_cache, ids)
    exact = run(single, single, transformers.DynamicCache(config=single.config), ids)  # unquantized K/V
    torch.save(
        {
            "tp": tp_logits, "single": ref_logits, "exact": exact, "report": backend.report(), "tp_size": model.tp_size,
            "local_heads": cache.layers[0].num_heads, "heads": single.config.num_key_value_heads,
            "k_codes": tuple(cache.layers[0].k_codes.shape),
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


def bad() -> None:
    if dist.get_rank() == 0:  # 3 kv heads over 2 ranks
        kvcompile.QuantizedCache(tiny_config("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3),
                                 max_cache_len=8, tp_size=dist.get_world_size())
    dist.barrier()  # never completes: rank 0 is gone


def main() -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:  # scalar C++ kernels: Inductor's CPU compile (the test's main cost) takes half as long
        torch._inductor.config.cpp.vec_isa_ok = False
    # a collective that waits longer than this raises instead of hanging (the test's own timeout is the backstop)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    try:
        match(sys.argv[1], sys.argv[2])
        dist.barrier()  # every rank has written its results
        bad()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
