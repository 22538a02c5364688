"""The admission check: is a rollout configuration within a mismatch budget B, judged without training
(`opdjax admit | sensitivity | recipe-search | capacity | measure | bench | plan`).

    budget       the budget file a study writes: `Budget` (B, its interval, B per kind, `TrainingView`: a kind's B
                 on training's M with the training/probe M ratio per level), `load_budget` (its one reader),
                 `setup_fingerprint` (the setup a budget was calibrated on), `calibration_warning`; `AdmissionError`
    probe        the mismatch M of an engine configuration: `probe` (fixed batches, bootstrap CI),
                 `probe_sequential` (batch by batch until M's bounds clear B), `rescore`, KV-scale calibration
    sequential   the sequential probe's bounds, valid under optional stopping
    admit        candidates as config overrides, `admit` (ADMIT / REJECT / UNCERTAIN against B's interval), the
                 verdict table, `view_line` / `training_view` (the M training sees: the verdict's, for a kind
                 judged on training's M; otherwise a note, where a study trained the candidate's kind)
    plan         `bench` (phase times of a few OPD steps per candidate), `plan` (steps factor x per-step cost =
                 the predicted time-to-quality factor of each admitted candidate)
    search       layer sensitivity, the greedy FP8 recipe search, KV-cache capacity
    records      `ProbeResult`, `AdmitRow`, the `Record` base and `write_json` (every opdjax record's JSON writer)

The study (`opdjax.study`) sits above: it measures each point's M with `probe.probe` and writes the budget file this
package reads. The entry points share their modules' names (`admit.admit`, `probe.probe`), so they are imported
from their modules, not from here.
"""
