"""Quantize your own weights with an FP8 recipe and measure what it costs: per-tensor error, then k3 between the
quantized engine and the clean learner on the engine's own samples (the mismatch OPD will see).

    python examples/quantize_weights.py [HF_MODEL_DIR]   (default: a random tiny Qwen3 made locally)
"""
import sys
import tempfile

import numpy as np

import opdjax
from opdjax.models import hf
from opdjax.models.tiny import make_tiny


def main(model_dir: str | None = None, recipe: str = "fp8_w8a8") -> dict:
    model_dir = model_dir or str(make_tiny(tempfile.mkdtemp(), "qwen3", "tiny", seed=0, corpus=["1+2=3"]))
    named = hf.read_tensors(model_dir)  # your weights: HF name -> array
    r = opdjax.quant.get_recipe(recipe)
    kernels = {n: a.T for n, a in named.items() if opdjax.quant.weight_spec(r, n, a.ndim) is not None}
    quantized = opdjax.quant.apply_to_named(r, kernels)  # opdjax layout: kernels [in, out]
    err = {n: float(np.linalg.norm(quantized[n] - a) / np.linalg.norm(a)) for n, a in kernels.items()}
    print(f"{len(err)} kernels quantized by {recipe}; relative error {min(err.values()):.4f}..{max(err.values()):.4f}")

    clean = opdjax.JaxEngine.from_pretrained(model_dir)
    # weights, activations (and KV) as served
    engine = opdjax.JaxEngine.from_pretrained(model_dir, mismatch=opdjax.EngineMismatch(recipe=recipe))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, engine.cfg.usable_size, 6).tolist() for _ in range(16)]  # ids the tokenizer has
    batch = engine.generate(prompts, opdjax.SamplingParams(max_new_tokens=16), seed=0)
    learner_logp_BT = clean.score(batch.tokens_BT, batch.valid_BT)["logp_BT"]
    m = opdjax.mismatch.metrics(learner_logp_BT, batch.rollout_logp_BT, batch.completion_mask_BT)
    print(f"k3 KL(engine||learner) on the engine's samples: {float(m['k3']):.2e}")
    return {"relative_error": err, "k3": float(m["k3"])}


if __name__ == "__main__":
    if len(sys.argv) > 2 or sys.argv[1:2] in (["-h"], ["--help"]):
        sys.exit("usage: python examples/quantize_weights.py [HF_MODEL_DIR]   (default: a random tiny Qwen3 made here)")
    main(*sys.argv[1:2])
