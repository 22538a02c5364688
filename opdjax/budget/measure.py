"""`opdjax measure`: the mismatch probe behind the admission check.

Sample completions with a rollout engine (the embedded JAX engine or vLLM, with any engine options such as
`dtype=bfloat16 kv_cache_dtype=fp8` or `recipe=fp8_w8a8`), rescore exactly those tokens with the learner's JAX
forward in float32 (`Learner.logp`, logits / T), and report `mismatch.metrics(student_logp, rollout_logp, mask)`:
k1/k2/k3 KL estimates of KL(mu‖pi), |log-ratio| mean/p95/max, chi², perplexity ratio, IS diagnostics.

At temperature 0 (greedy) the engine reports the log-softmax at temperature 1, and the learner scores at 1 too.
Top-k/top-p truncation renormalises the engine's distribution but not the learner's; it shows up as mismatch and
is recorded in the report.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["parse_options", "load_prompts", "make_engine", "measure", "format_table", "run"]

TABLE_KEYS = ("k1", "k3", "abs_log_ratio_mean", "abs_log_ratio_p95", "abs_log_ratio_max", "chi2_token",
              "ppl_ratio", "ess", "num_tokens")


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """["kv_cache_dtype=fp8", "max_num_seqs=8"] -> {"kv_cache_dtype": "fp8", "max_num_seqs": 8}."""
    out = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise ValueError(f"engine option {item!r} is not key=value (e.g. kv_cache_dtype=fp8)")
        out[key.strip()] = _value(val.strip())
    return out


def load_prompts(tokenizer, *, prompts_file: str | None = None, task: str | None = None, n: int = 64,
                 seed: int = 0, task_options: Mapping[str, Any] | None = None) -> list[list[int]]:
    """Token ids of n prompts: the first n rows of a JSONL file ("prompt" key), or n held-out task prompts."""
    from opdjax.data import tasks
    from opdjax.data.prompts import encode_prompts

    if (prompts_file is None) == (task is None):
        raise ValueError("give exactly one of --prompts FILE.jsonl or --task NAME")
    if prompts_file is not None:
        examples = list(tasks.JsonlTask(prompts_file).rows)[:n]
    else:
        examples = tasks.get_task(task, **dict(task_options or {})).examples(n, seed, "heldout")
    if not examples:
        raise ValueError(f"no prompts in {prompts_file or task!r}")
    return encode_prompts(tokenizer, examples)


def make_engine(kind: str, student: str | pathlib.Path, options: Mapping[str, Any]):
    """A rollout engine serving the student checkpoint: "jax" (JaxEngine options: dtype, recipe, weight_noise,
    cache_dtype, ...) or "vllm" (VllmEngine / vllm.LLM options: dtype, kv_cache_dtype, kv_cache_memory_bytes, ...)."""
    opts = dict(options)
    if kind == "vllm":
        from opdjax.rollout.vllm_engine import VllmEngine

        return VllmEngine(student, **opts)
    if kind == "jax":
        import jax.numpy as jnp

        from opdjax.rollout.jax_engine import JaxEngine

        for k in ("dtype", "cache_dtype"):
            if k in opts:
                opts[k] = jnp.dtype(opts[k])
        return JaxEngine.from_pretrained(student, **opts)
    raise ValueError(f"unknown engine {kind!r}; choose jax or vllm")


def measure(engine, learner, params, prompts: Sequence[Sequence[int]], sampling, *, seed: int = 0,
            batch_size: int = 32) -> dict[str, Any]:
    """Sample with `engine`, rescore with `learner` (float32 JAX forward) and return the mismatch report."""
    from opdjax.core import mismatch

    temperature = sampling.temperature if sampling.temperature > 0 else 1.0
    student, rollout, mask = [], [], []
    t_gen = t_score = 0.0
    L = 0
    for i in range(0, len(prompts), batch_size):
        t0 = time.perf_counter()
        batch = engine.generate(prompts[i:i + batch_size], sampling, seed=seed + i)
        t1 = time.perf_counter()
        lp = learner.logp(params, batch.tokens_BL, batch.valid_BL, temperature=temperature)
        t_gen += t1 - t0
        t_score += time.perf_counter() - t1
        student.append(lp)
        rollout.append(batch.rollout_logp_BL)
        mask.append(batch.completion_mask_BL)
        L = max(L, batch.tokens_BL.shape[1])
    pad = lambda arrs, v: np.concatenate([np.pad(a, ((0, 0), (0, L - a.shape[1])), constant_values=v)  # noqa: E731
                                          for a in arrs])
    s, r, m = pad(student, 0.0), pad(rollout, 0.0), pad(mask, False)
    metrics = {k: float(v) for k, v in mismatch.metrics(s, r, m).items()}
    return {"metrics": metrics, "num_prompts": len(prompts), "seconds_generate": t_gen, "seconds_rescore": t_score}


def format_table(rows: Sequence[tuple[str, Mapping[str, float]]], keys: Sequence[str] = TABLE_KEYS) -> str:
    """A fixed-width table: one row per (label, metrics)."""
    w = max([len("engine")] + [len(label) for label, _ in rows])
    head = f"{'engine':<{w}}  " + "  ".join(f"{k:>18}" for k in keys)
    lines = [head, "-" * len(head)]
    for label, m in rows:
        cells = []
        for k in keys:
            v = m.get(k, float("nan"))
            cells.append(f"{int(v):>18d}" if k == "num_tokens" else f"{v:>18.3e}")
        lines.append(f"{label:<{w}}  " + "  ".join(cells))
    return "\n".join(lines)


def run(student: str, *, engine: str = "jax", options: Mapping[str, Any] | None = None,
        prompts_file: str | None = None, task: str | None = None, n: int = 64, max_new_tokens: int = 16,
        temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, batch_size: int = 32,
        out: str | None = None, log=print) -> dict[str, Any]:
    """The whole probe: load student + tokenizer, build the engine, measure, print the table, save the report."""
    from flax import nnx  # noqa: F401  (nnx state types)

    from opdjax.learner.learner import Learner
    from opdjax.models import ModelConfig, hf
    from opdjax.models.tiny import load_tokenizer
    from opdjax.rollout import SamplingParams

    options = dict(options or {})
    tok = load_tokenizer(student)
    cfg = ModelConfig.from_dir(student)
    prompts = load_prompts(tok, prompts_file=prompts_file, task=task, n=n, seed=seed)
    graphdef, params = hf.load_state(student, cfg)
    learner = Learner(graphdef, temperature=max(temperature, 1e-6))
    eng = make_engine(engine, student, options)
    stop = (tok.eos_token_id,) if tok.eos_token_id is not None else ()
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                              stop_token_ids=stop)
    rep = measure(eng, learner, params, prompts, sampling, seed=seed, batch_size=batch_size)
    label = engine + ("" if not options else " " + " ".join(f"{k}={v}" for k, v in sorted(options.items())))
    rep.update({"student": str(student), "engine": engine, "engine_options": options, "label": label,
                "sampling": {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k,
                             "top_p": top_p}, "seed": seed, "prompts": prompts_file or f"task:{task}"})
    log(format_table([(label, rep["metrics"])]))
    if out:
        p = pathlib.Path(out)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(rep, indent=2, default=str) + "\n")
        log(f"wrote {p}")
    return rep
