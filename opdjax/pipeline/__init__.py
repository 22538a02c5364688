"""The OPD pipeline, in data-flow order: `build` (config -> typed Run), `steps` (generate -> score -> Batch ->
publish), `evaluate` (held-out quality), `logger` (metrics), `loop` (sync/async training, checkpoints, resume)."""
