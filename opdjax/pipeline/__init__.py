"""The OPD pipeline, in data-flow order: `opd` (the public step: generate -> score -> Batch -> train -> publish, with
explicit components), `evaluate` (held-out quality with a given engine), `build` (config -> typed Run, the one reader
of `TrainConfig`), `logger` (metrics), `rundir` (run directories), `loop` (sync/async training, checkpoints, resume).
"""
