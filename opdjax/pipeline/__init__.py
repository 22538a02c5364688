"""The OPD pipeline, in data-flow order: `opd` (the public step: generate -> score -> Batch -> train -> publish, with
explicit components), `evaluate` (held-out quality with a given engine), `prepare` (the built-in teacher/student
pair, trained once and cached), `build` (config -> typed Run, the one reader of `TrainConfig`), `logger` (metrics),
`rundir` (run directories), `loop` (sync/async training, checkpoints, resume).
"""
