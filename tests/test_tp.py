"""Tensor parallelism on CPU: transformers' ``tp_plan="auto"`` over two torchrun processes (gloo; transformers
needs accelerate to load a sharded model, in kvcompile's ``test`` extra).

Each rank's ``QuantizedCache(tp_size=model.tp_size)`` stores its own kv heads, the backend compiles
each rank's decode graph and rewrites its attention, and the logits equal one process running the
unsharded model with the same cache format. A bad input on one rank ends every rank with its
message. The ranks run tests/tp_worker.py; each launch is bounded by a timeout that kills the
whole process group, so a hang fails the test instead of CI.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

import kvcompile
from kvcompile import tp
from models import tiny_config, tiny_model

TESTS = pathlib.Path(__file__).resolve().parent
WORKER = TESTS / "tp_worker.py"
RANKS = 2
TIMEOUT_S = 240  # a launch takes ~40 s on 2 busy cores; a hang is killed here

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or sys.platform == "win32", reason="needs torch.distributed and torchrun"
)


def torchrun(*args: str) -> tuple[int, str, float]:
    """Run the worker on RANKS processes; (exit status, merged output, seconds)."""
    root = pathlib.Path(kvcompile.__file__).resolve().parent.parent  # the kvcompile this test imported
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), str(TESTS), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
           str(WORKER), *args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank it started
        out, _ = proc.communicate()
        pytest.fail(f"torchrun {' '.join(args)} did not finish in {TIMEOUT_S} s (a rank hung):\n{out[-4000:]}")
    return proc.returncode, out, time.perf_counter() - t0


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """One torchrun of the worker: the match phase's results per rank, then the bad input's exit."""
    tmp = tmp_path_factory.mktemp("tp")
    tiny_model("llama", num_hidden_layers=2).save_pretrained(tmp / "model")
    rc, out, seconds = torchrun(str(tmp / "model"), str(tmp))
    return tmp, rc, out, seconds


def test_tp_ranks_match_one_process_and_rewrite_every_site(launch):
    """Two gloo ranks, 2 layers, 4 q / 2 kv heads: each rank stores 1 kv head, compiles one decode
    graph with every attention site rewritten, and its logits (prefill + 3 decode steps, int8) equal
    the unsharded model's with the same cache format.

    Tolerance: TP changes only the order of float sums (o_proj / down_proj partial products are
    all-reduced; 4e-7 on fp32 logits without quantization). Both runs quantize the same K/V with the
    same int8 format (per token and kv head, Hadamard-rotated per head: nothing depends on which
    heads a rank holds), so the difference is that reordering (measured 3e-7) unless a reordered value
    lands across an int8 rounding boundary and one code moves by one step. 1e-4 allows that; it is
    checked to be under a tenth of the format's own error here (int8 vs unquantized K/V)."""
    tmp, rc, out, seconds = launch
    for rank in range(RANKS):
        path = tmp / f"rank{rank}.pt"
        assert path.exists(), out[-6000:]
        got = torch.load(path)
        assert got["tp_size"] == RANKS and got["local_heads"] == got["heads"] // RANKS == 1
        assert got["k_codes"][1] == 1
        report = got["report"]
        assert len(report) == 1, report  # one decode graph per rank
        assert report[0]["found"] == report[0]["rewritten"] == 2 and not report[0]["skipped"], report
        diff = (got["tp"] - got["single"]).abs().max().item()
        format_err = (got["single"] - got["exact"]).abs().max().item()
        assert 1e-4 < format_err / 10, format_err
        assert diff <= 1e-4, f"rank {rank}: TP logits differ from one process by {diff:.3g} (int8: {format_err:.3g})"
    print(f"torchrun: {seconds:.1f} s, max |TP - one process| {diff:.2g}, int8 vs unquantized {format_err:.2g}")


def test_an_error_on_one_rank_ends_every_rank_with_its_message(launch):
    """After the match phase, rank 0 builds a cache for 3 kv heads over 2 ranks and raises; rank 1
    waits in a barrier only rank 0 could complete. torchrun must end both, non-zero, with rank 0's
    message, well before the timeout."""
    _, rc, out, seconds = launch
    assert rc != 0
    assert "3 kv heads, which do not divide among tp_size=2 ranks" in out, out[-6000:]
    assert seconds < TIMEOUT_S


# -- in one process: the sharding arithmetic ----------------------------------------------------


def test_heads_that_do_not_divide_are_refused_before_anything_runs():
    cfg = tiny_config("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"3 kv heads, which do not divide among tp_size=2 ranks.*one of \[1, 3\]"):
        kvcompile.QuantizedCache(cfg, max_cache_len=8, tp_size=2)


def test_tp_size_without_torch_distributed_names_the_fix():
    with pytest.raises(ValueError, match="torch.distributed is not initialized.*torchrun"):
        kvcompile.QuantizedCache(tiny_config("llama"), max_cache_len=8, tp_size=2)


def _fake_rank(monkeypatch, rank: int, world: int) -> None:
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: rank)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: world)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_keeps_its_heads_of_the_calibration(monkeypatch, rank):
    """Static scales and K offsets of a whole-model calibration, sliced to the rank's kv heads."""
    cfg = tiny_config("llama", num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=32)
    L, H, D = 2, 4, 32
    calib = {"k_scale": torch.rand(L, H) + 0.5, "v_scale": torch.rand(L, H) + 0.5, "k_offset": torch.randn(L, H, D)}
    _fake_rank(monkeypatch, rank, 2)
    cache = kvcompile.QuantizedCache(cfg, max_cache_len=8, kv_dtype="fp8_e4m3", granularity="static",
                                     rotate=False, calibration=calib, tp_size=2, device="cpu")
    heads = slice(2 * rank, 2 * rank + 2)
    for i, layer in enumerate(cache.layers):
        assert layer.k_codes.shape == (1, 2, 8, D) and layer.tp_shard == tp.TPShard(2, rank, 2)
        torch.testing.assert_close(layer.k_scales, calib["k_scale"][i, heads], rtol=0, atol=0)
        torch.testing.assert_close(layer.v_scales, calib["v_scale"][i, heads], rtol=0, atol=0)
        torch.testing.assert_close(layer.k_offset, calib["k_offset"][i, heads], rtol=0, atol=0)


def test_rotated_offsets_are_sliced_after_rotation(monkeypatch):
    """int8 rotates K per head (head_dim only): a rank's rotated offsets are the whole model's, sliced."""
    cfg = tiny_config("llama", num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4, head_dim=32)
    calib = {"k_offset": torch.randn(1, 4, 32)}
    whole = kvcompile.QuantizedCache(cfg, max_cache_len=8, calibration=calib, device="cpu")
    _fake_rank(monkeypatch, 1, 2)
    part = kvcompile.QuantizedCache(cfg, max_cache_len=8, calibration=calib, tp_size=2, device="cpu")
    torch.testing.assert_close(part.layers[0].k_offset, whole.layers[0].k_offset[2:], rtol=0, atol=0)
    torch.testing.assert_close(part.layers[0].k_rotation, whole.layers[0].k_rotation, rtol=0, atol=0)


def test_a_calibration_made_on_one_rank_is_refused(monkeypatch):
    """Fewer kv heads than the model's: under tensor parallelism, a rank's calibration (the fix: the whole
    model's); in one process, a calibration of another model's shapes, not a word of tensor parallelism."""
    cfg = tiny_config("llama", num_hidden_layers=2)  # 2 kv heads
    per_rank = {"k_offset": torch.randn(2, 1, 32)}
    with pytest.raises(ValueError, match=r"has shape \(2, 1, 32\), the model needs \(2, 2, 32\)") as e:
        kvcompile.QuantizedCache(cfg, max_cache_len=8, calibration=per_rank)
    assert "tensor-parallel" not in str(e.value) and "rank" not in str(e.value)
    _fake_rank(monkeypatch, 0, 2)
    with pytest.raises(ValueError, match="holds 1 kv heads per layer, the model has 2: it was made for one rank"):
        kvcompile.QuantizedCache(cfg, max_cache_len=8, calibration=per_rank, tp_size=2)


def test_without_tp_size_the_first_update_sets_the_local_heads(monkeypatch):
    """Like transformers' StaticLayer: a lazily allocated cache learns the rank's head count from the
    first K/V it stores (here rank 1 of 2: 1 of 2 kv heads) and slices its calibration to match."""
    cfg = tiny_config("llama")
    calib = {"k_offset": torch.randn(1, 2, 32)}
    whole = kvcompile.QuantizedCache(cfg, max_cache_len=8, calibration=calib, device="cpu")
    _fake_rank(monkeypatch, 1, 2)
    cache = kvcompile.QuantizedCache(cfg, max_cache_len=8, calibration=calib)
    k = torch.randn(1, 1, 3, 32)
    out_k, _ = cache.update(k, k.clone(), 0)
    layer = cache.layers[0]
    assert layer.k_codes.shape == (1, 1, 8, 32) and layer.tp_shard == tp.TPShard(2, 1, 1)
    torch.testing.assert_close(layer.k_offset, whole.layers[0].k_offset[1:], rtol=0, atol=0)
    torch.testing.assert_close(out_k[:, :, :3], k, atol=0.05, rtol=0.05)


def test_fewer_heads_in_one_process_names_the_config_not_tensor_parallelism():
    """Outside torch.distributed, a first update with fewer kv heads than the config says is a config
    that does not describe the model (not a rank's shard): the message says so and names the fix."""
    cache = kvcompile.QuantizedCache(tiny_config("llama"), max_cache_len=8)  # 2 kv heads, allocated lazily
    k = torch.randn(1, 1, 3, 32)
    with pytest.raises(ValueError, match=r"got K/V of 1 kv heads, but the cache was built for 2.*QuantizedCache\(model.config"):
        cache.update(k, k.clone(), 0)


def test_an_eagerly_allocated_cache_names_tp_size_when_a_rank_writes_fewer_heads():
    cache = kvcompile.QuantizedCache(tiny_config("llama"), max_cache_len=8, device="cpu")
    k = torch.randn(1, 1, 3, 32)
    with pytest.raises(ValueError, match="tp_size=model.tp_size"):
        cache.update(k, k.clone(), 0)
