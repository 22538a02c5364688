"""The OPD pipeline, in data-flow order: `phases` (a step's phase timing and the run's clocks), `quality`
(time-/steps-to-quality and the area under the quality-versus-time curve of an evaluation curve), `opd` (the public
step: generate -> score -> Batch -> train -> publish, with explicit components), `evaluate` (held-out quality with a
given engine), `prepare` (the built-in teacher/student pair, trained once and cached), `inputs` (what a config
names, checked and resolved before anything is built), `components` (one component from its config section),
`build` (config -> typed Run, assembled in one function), `logger` (metrics), `rundir` (run directories),
`rollouts` (one rollout source for both modes: sampled on demand, or ahead by a worker), `loop` (sync/async
training, checkpoints, resume).
"""
