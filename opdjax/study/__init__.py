"""The mismatch-budget study: how much training–inference mismatch OPD tolerates, and the budget B it writes
(`opdjax study`).

    study_config   `StudyConfig` (with `KneeConfig`, `RLConfig`, `ShiftConfig`) and its one loader `load_study`
    study          `run_study`: the sweep points, one short OPD run per (point, seed), the knee search, the outputs
    phenomena      the paper's other phenomena: OPD versus RL under weight noise, prefix shift and corrections
    fit            per-point quality losses and the fit of B with its interval
    dose           dose-response statistics over single runs: effects with CIs, the hinge fit, B's bootstrap
    scaling        across studies: power laws of B (and of a candidate's M) in response length or model size, with
                   intervals from each study's bootstrap draws, and the length at which M reaches B
    report         points.csv, the budget plot, summary.md and the admission-validity table
    records        `Point` (one configuration) and `RunResult` (one (point, seed), the resume record)

Each point's M is measured by the admission probe (`opdjax.admission.probe`), and budget.json carries the setup
fingerprint that `opdjax.admission.budget` reads back, so this package sits above `opdjax.admission`.
"""
