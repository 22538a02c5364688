"""Mismatch metrics and corrections on log-probs from your own trainer and engine (no opdjax model involved).

    python examples/mismatch_metrics.py

`student_logp_BT`: your learner's log-prob of each sampled token; `rollout_logp_BT`: the engine's (e.g. vLLM's
returned logprobs) for the same tokens; `mask_BT`: the response tokens. Here both come from two slightly different
random "models" so the script runs anywhere.
"""
import sys

import numpy as np

import opdjax


def main() -> dict:
    rng = np.random.default_rng(0)
    B, T, V = 4, 32, 100
    logits_BTV = rng.normal(size=(B, T, V))
    engine_logits_BTV = logits_BTV + rng.normal(scale=0.05, size=(B, T, V))  # e.g. an FP8 engine's numerics
    tokens_BT = rng.integers(0, V, (B, T))
    log_softmax = lambda z: z - np.log(np.exp(z).sum(-1, keepdims=True))  # noqa: E731
    pick = lambda z: np.take_along_axis(log_softmax(z), tokens_BT[..., None], -1)[..., 0]  # noqa: E731
    student_logp_BT, rollout_logp_BT = pick(logits_BTV), pick(engine_logits_BTV)
    mask_BT = np.broadcast_to(np.arange(T) >= 8, (B, T))  # the first 8 positions are the prompt

    m = opdjax.mismatch.metrics(student_logp_BT, rollout_logp_BT, mask_BT)
    print(f"k3 KL(engine||learner) = {float(m['k3']):.2e}, k1 = {float(m['k1']):.2e}, "
          f"|log ratio| p95 = {float(m['abs_log_ratio_p95']):.3f}")
    w_BT, cm = opdjax.corrections.apply_correction(opdjax.Correction("token_tis", cap=2.0), student_logp_BT,
                                                   rollout_logp_BT, mask_BT)
    print("token-level truncated IS weights:", {k: round(float(v), 4) for k, v in cm.items()})
    return {**{k: float(v) for k, v in m.items()}, "w_BT": np.asarray(w_BT)}


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit("usage: python examples/mismatch_metrics.py   (no arguments)")
    main()
