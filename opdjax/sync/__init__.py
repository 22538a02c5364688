"""The weight-sync bridge: JAX learner params -> a running inference engine (vLLM or the JaxEngine).

Learner side: `Publisher(cfg, transport, dtype=..., recipe=...)` turns params into a layer-ordered stream of
HF-named tensors (`publisher.hf_stream`, the HF interop name table; bf16/f32, or pre-quantized FP8 + scales from
`quant.quantize_named`) with a versioned `Manifest` (names, shapes, dtypes, CRC-32s). Engine side:
`WeightReceiver(target, ModelSpec)` validates a publish completely before touching the engine and applies it all
or nothing. Transports: in-process (DLPack, no copy), atomic file/shared-memory snapshots, TCP with a shared-secret
token. `open_link(sync.transport, receiver)` pairs a transport with its engine-side end for a run (`links`).
See each module's docstring.
"""

from opdjax.sync.links import TRANSPORTS, Link, engine_publisher, open_link
from opdjax.sync.manifest import BridgeError, Manifest, ModelSpec, TensorEntry, build_manifest, validate
from opdjax.sync.publisher import Publisher, hf_stream, prepare
from opdjax.sync.receiver import ArrayTarget, WeightReceiver, payload_views
from opdjax.sync.tcp import TcpReceiverServer, TcpTransport
from opdjax.sync.transports import (
                                    InProcessTransport,
                                    SnapshotTransport,
                                    SnapshotWatcher,
                                    default_snapshot_root,
                                    snapshot_payload,
)

__all__ = ["TRANSPORTS", "ArrayTarget", "BridgeError", "InProcessTransport", "Link", "Manifest", "ModelSpec",
           "Publisher",
           "SnapshotTransport", "SnapshotWatcher", "TcpReceiverServer", "TcpTransport", "TensorEntry",
           "WeightReceiver", "build_manifest", "default_snapshot_root", "engine_publisher", "hf_stream", "open_link", "payload_views",
           "prepare",
           "snapshot_payload", "validate"]
