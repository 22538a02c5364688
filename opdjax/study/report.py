"""Rendering a study's budget.json: points.csv, the budget plot, summary.md and the admission-validity table.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import pathlib
import statistics
from typing import Any, Mapping, Sequence

from opdjax.pipeline.rundir import write_text
from opdjax.study import dose
from opdjax.study.fit import straddles

__all__ = ["CSV_FIELDS", "plot", "summary_markdown", "validity_markdown", "write_csv"]


CSV_FIELDS = ["id", "group", "knob", "value", "m_probe", "m_probe_ci_low", "m_probe_ci_high", "m_train",
              "m_train_k1", "m_train_abs_log_ratio_p95", "q_reverse_kl", "q_accuracy", "q_loss", "q_loss_ci_low",
              "q_loss_ci_high", "q_loss_std", "q_loss_min", "q_loss_max", "n_seeds", "within_budget", "admissible", "seconds"]


def write_csv(path: pathlib.Path, rows: Sequence[Mapping]) -> None:
    """points.csv: one row per study point (built in memory, written atomically)."""
    f = io.StringIO(newline="")
    w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
    w.writeheader()
    for r in rows:
        ci = r["m_probe_ci"] or [None, None]
        sp, qci = r["q_loss_spread"], r.get("q_loss_ci") or [None, None]
        w.writerow({**{k: r.get(k) for k in CSV_FIELDS}, "m_probe_ci_low": ci[0], "m_probe_ci_high": ci[1],
                    "q_loss_ci_low": qci[0], "q_loss_ci_high": qci[1],
                    "q_loss_std": sp["std"], "q_loss_min": sp["min"], "q_loss_max": sp["max"],
                    "n_seeds": len(r["seeds"])})
    write_text(path, f.getvalue())


_STYLE = {"baseline": ("k", "o"), "weight_noise": ("tab:blue", "o"), "staleness": ("tab:orange", "s"),
          "recipe": ("tab:green", "^")}


def plot(path: pathlib.Path, result: Mapping[str, Any]) -> None:
    """Quality loss (and final accuracy) versus M on a log axis: per-seed dots, mean with seed range and probe CI,
    the tolerance delta and the budget B; knobs by colour and marker. The baseline (M ~ 0) sits at the left edge."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["points"]
    ms = [r["m_probe"] for r in rows if r["m_probe"] is not None and r["knob"] != "baseline" and r["m_probe"] > 0]
    lo = min(ms + [result["budget"]] if result["budget"] > 0 else ms) if ms else 1e-6
    floor = lo / 10
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, ylab in ((axes[0], "q_loss", "quality loss (held-out reverse KL + 0.1: GM ratio - 1)"
                           if result["config"]["study"]["quality"] == "reverse_kl" else "accuracy drop"),
                          (axes[1], "accuracy", "final held-out accuracy")):
        seen = set()
        for r in rows:
            m = r["m_probe"] if r["m_probe"] is not None else float("nan")
            x = max(m, floor) if r["knob"] == "baseline" else m
            if not x > 0:
                continue
            colour, marker = _STYLE.get(r["knob"], ("tab:gray", "x"))
            ys = [s["q_loss"] if key == "q_loss" else s["accuracy"] for s in r["seeds"]]
            y = r["q_loss"] if key == "q_loss" else r["q_accuracy"]
            ci = r["m_probe_ci"] or [m, m]
            xerr = None if r["knob"] == "baseline" else [[max(x - max(ci[0], floor), 0)], [max(ci[1] - x, 0)]]
            fin = [v for v in ys if math.isfinite(v)]
            span = r.get("q_loss_ci") if key == "q_loss" else None  # the point's CI; accuracy: the seeds' range
            span = span if span and all(math.isfinite(v) for v in span) else ([min(fin), max(fin)] if fin else None)
            yerr = [[max(y - span[0], 0.0)], [max(span[1] - y, 0.0)]] if span and math.isfinite(y) else None
            label = r["knob"] if r["knob"] not in seen else None
            seen.add(r["knob"])
            ax.errorbar([x], [y], xerr=xerr, yerr=yerr, fmt=marker, color=colour, ms=8, capsize=3, label=label,
                        mfc="white" if not r.get("within_budget", True) else colour)
            ax.scatter([x] * len(fin), fin, s=10, color=colour, alpha=0.4)
            tag = "baseline" if r["knob"] == "baseline" else f"{r['value']}"
            ax.annotate(tag, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel(f"M = probe {result['metric']} (engine vs learner, log scale; baseline at left edge)")
        ax.set_ylabel(ylab)
        if result["budget"] > 0 and math.isfinite(result["budget"]):
            resolved = result.get("status", "RESOLVED") == "RESOLVED"
            ax.axvline(result["budget"], color="tab:red" if resolved else "tab:gray", ls="--",
                       label=f"budget B = {result['budget']:.3g}" if resolved else
                       f"UNRESOLVED (the fit's B = {result['budget']:.3g} is not a budget)")
        if key == "q_loss":
            ax.axhline(result["delta"], color="tab:red", ls=":", label=f"tolerance delta = {result['delta']}")
            ax.set_yscale("symlog", linthresh=1.0)  # linear near the tolerance, log for diverged runs
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="best")
    fig.suptitle("Mismatch budget: quality vs mismatch (quality loss ± its 95% CI, accuracy ± seed range; "
                 "hollow = outside tolerance)")
    fig.tight_layout()
    tmp = pathlib.Path(path).with_name(f".{pathlib.Path(path).name}.tmp{pathlib.Path(path).suffix}")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    plt.close(fig)


def _f(x, fmt=".3g") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return format(x, fmt)


def _calibrated_on_lines(on: Mapping[str, Any] | None) -> list[str]:
    if not on:
        return []
    return [f"Calibrated on: student weights sha256 `{on['student_sha256'][:16]}`, "
            f"teacher `{on['teacher_sha256'][:16]}` (jax {on.get('jax', '?')}, {on.get('machine', '?')}). "
            "The built-in pair is trained locally, so it can differ between machines; `opdjax admit` warns when it "
            "probes other weights.", ""]


def _budget_lines(result: Mapping[str, Any]) -> list[str]:
    """The headline: B with its interval and the knee bracket, or UNRESOLVED (budget.json of earlier versions has
    neither: B alone)."""
    what = (f"({result['metric']} of engine vs learner on sampled tokens, measured by the admission probe) at "
            f"tolerance delta = {result['delta']}")
    br, iv = result.get("bracket"), result.get("budget_interval")
    if br is None:
        return [f"**Budget B = {result['budget']:.4g}** {what}.", ""]
    ends = f"[{_f(br['within'], '.4g')}, {_f(br['beyond'], '.4g')}]"
    if not br["resolved"] and br.get("method") == "hinge":
        return [f"**Budget UNRESOLVED** {what}: {br['why']}; the dose-response fit does not locate a knee that "
                f"its runs pin down within a factor {br['factor']:g}, so no B is reported and `opdjax admit` refuses "
                f"this file. Add levels around the fitted B ({_f(result['budget'], '.4g')}) or seeds.", ""]
    if br.get("method") == "hinge":
        return [f"**Budget B = {result['budget']:.4g}** {what}; from a dose-response (hinge) fit over every run "
                f"of the baseline and the weight-noise levels (every run when there are none), "
                f"95% interval over runs resampled within every point, the baseline's too [{iv[0]:.3g}, "
                f"{iv[1]:.3g}] (x{br['ratio']:.2g} ≤ {br['factor']:g}); the runs' M nearest it {ends}.", ""]
    if not br["resolved"]:
        return [f"**Budget UNRESOLVED** {what}: the knee bracket {ends} (largest M within tolerance, smallest M "
                f"beyond) is not narrower than a factor {br['factor']:g} ({br['why']}), so no B is reported and "
                f"`opdjax admit` refuses this file. Rerun with `knee.enabled=true` (levels chosen from this pair) "
                f"or with levels inside the bracket.", ""]
    return [f"**Budget B = {result['budget']:.4g}** {what}; 95% interval over resampled seeds "
            f"[{iv[0]:.3g}, {iv[1]:.3g}]; the knee lies in the bracket {ends} (factor {br['ratio']:.2g} ≤ "
            f"{br['factor']:g}).", ""]


def summary_markdown(result: Mapping[str, Any]) -> str:
    """summary.md of a study's budget.json: the headline B, how the runs were made, the points table, each
    phenomenon that was measured ((a) RL vs OPD, (b) prefix shift, (b') corrections), admission validity and timing.
    """
    ph = result.get("phenomena", {})
    L = [f"# Mismatch budget study ({result['created']})", "", *_budget_lines(result), *_kind_lines(result),
         *_method_lines(result),
         *_calibrated_on_lines(result.get("calibrated_on")), "![quality vs mismatch](budget.png)", "",
         *_points_table(result["points"])]
    if "rl_vs_opd" in ph:
        L += _rl_vs_opd_lines(ph["rl_vs_opd"])
    if "prefix_shift" in ph:
        L += _prefix_shift_lines(ph["prefix_shift"])
    if "corrections" in ph:
        L += _corrections_lines(ph["corrections"], result["delta"])
    if result.get("validity"):
        L += ["", "## Admission validity", "", validity_markdown(result["validity"], result["budget"])]
    L += _timing_lines(result["timing"])
    return "\n".join(L) + "\n"


def _kind_lines(result: Mapping[str, Any]) -> list[str]:
    """One line per kind of mismatch the study fitted its own B for (`study.kind_budgets`)."""
    kinds = result.get("kinds") or {}
    if not kinds:
        return []
    items = [f"{k} (levels {', '.join(map(str, v['levels']))}): " + (
        f"no knee, harmless up to M {v['harmless_up_to']:.3g} ({v['why']})" if v["status"] == "NO_KNEE" else
        f"B = {v['budget']:.3g} [{v['budget_interval'][0]:.3g}, {v['budget_interval'][1]:.3g}], {v['status']}"
        + ("" if v["status"] == "RESOLVED" else f" ({v['why']})")) for k, v in kinds.items()]
    return ["B per kind of mismatch, each fitted on the baseline and that kind's own levels (the headline B is the "
            "weight-noise knob's; `opdjax admit` judges a candidate of a fitted kind against its kind's B, on "
            "training's M where the kind has one, and a combination of study knobs against its components' B mixed "
            "by their M shares, and other kinds against the envelope, the B with the lowest lower end): "
            + "; ".join(items) + ".", *_view_lines(kinds), ""]


def _view_lines(kinds: Mapping[str, Any]) -> list[str]:
    """One line per kind judged on training's M (`study.training_view_budget`): its B there and the training/probe
    M ratio at each level."""
    out = []
    for k, v in kinds.items():
        t = v.get("training")
        if not t:
            continue
        ratios = ", ".join(f"{x['level']:g}: {x['ratio']:.3g} [{x['ratio_interval'][0]:.3g}, "
                           f"{x['ratio_interval'][1]:.3g}]" for x in t["ratios"])
        out.append(f"{k} on training's M (the mean per-step M its runs logged): B = {t['budget']:.3g} "
                   f"[{t['budget_interval'][0]:.3g}, {t['budget_interval'][1]:.3g}], {t['status']} ({t['why']}); "
                   f"training/probe M ratio per level: {ratios}. `opdjax admit` multiplies a {k} candidate's probe "
                   f"M by the ratio at its level (log-log between levels; 1 outside them) and judges it there.")
    return out


def _method_lines(result: Mapping[str, Any]) -> list[str]:
    """How a point is judged (mean loss over seeds vs delta, isotonic or first-failure fit) and how the runs were made
    (loss, steps, lr, batch, task), with the noise-free baseline's held-out reverse KL and accuracy."""
    s, b = result["config"]["study"], result["baseline"]
    base_cfg = result["config"]["base_train_config"]
    fits = {"hinge": "B comes from a dose-response fit over every run of the calibration knob (the baseline and "
                     "the weight-noise levels): its score (ln of reverse KL + 0.1, or minus "
                     "accuracy) = a + b·max(0, ln M − k), least squares; B is the M where the fit has risen delta "
                     "above its plateau, and its 95% interval refits runs resampled within every point, the "
                     "baseline's too. A point is within tolerance iff its M ≤ B.",
            "isotonic": "A point is within tolerance iff its quality loss is ≤ delta. B is the largest M at which "
                        "the isotonic (monotone non-decreasing in M) fit of the points' losses stays ≤ delta, so one "
                        "noisy point is pooled with its neighbours and a diverged point stops B.",
            "first_failure": "A point is within tolerance iff its quality loss is ≤ delta. B is the largest M "
                             "reached walking the points in increasing M until the first point outside the "
                             "tolerance (conservative: later points never raise B)."}
    seeds = f"seeds {s['seeds']}, baseline seeds {s.get('baseline_seeds') or s['seeds']}"
    return [f"Quality loss: {result['quality']}; {seeds}. " + fits.get(s.get("fit", "isotonic"), ""), "",
            f"Runs: OPD ({base_cfg['loss']['name']}), {base_cfg['pipeline']['steps']} steps, "
            f"lr {base_cfg['optim']['lr']}, "
            f"batch {base_cfg['rollout']['batch_size']}, task {base_cfg['task']['name']}. Baseline (no mismatch): "
            f"held-out reverse KL {b['initial_reverse_kl']:.2f} → {b['reverse_kl']:.3f} (seeds "
            f"{', '.join(f'{x:.3f}' for x in b['reverse_kl_seeds'])}), accuracy {b['initial_accuracy']:.2f} → "
            f"{b['accuracy']:.3f}; {_stalls_text(b)}.{_movement_text(b)}", ""]


def _movement_text(b: Mapping[str, Any]) -> str:
    """The baseline's per-step movement: per seed the median over steps of policy/step_k3 (k3 between consecutive
    student versions on the learner's samples); their median and range. Empty when no seed logged it."""
    m = sorted(x for x in b.get("policy_step_k3_median_seeds") or [] if x is not None)
    if not m:
        return ""
    return (f" Per-step movement of the student (median policy/step_k3 over steps): {statistics.median(m):.2g} over seeds "
            f"(range {m[0]:.2g}–{m[-1]:.2g}; at LLM scale ≤ 1e-3).")


def _stalls_text(b: Mapping[str, Any]) -> str:
    """How many baseline seeds stalled, counted from its seeds (so budget.json of earlier versions reads the same)."""
    return (f"{dose.stalls(b['reverse_kl_seeds'])} of {len(b['reverse_kl_seeds'])} baseline seeds stalled (final reverse KL > {dose.STALL_FACTOR:g}x "
            f"their median)")


def _points_table(points: Sequence[Mapping[str, Any]]) -> list[str]:
    """The points table, one row per point in increasing M probe (points without one first)."""
    L = ["| point | M probe (95% CI) | M train k3 | train k1 | train abs-log-ratio p95 | final RKL | accuracy | "
         "q_loss mean (seed min..max) | q_loss 95% CI (verdict of the runs) | monotone fit | within delta | M ≤ B |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(points, key=lambda r: (r["m_probe"] if r["m_probe"] is not None else -1)):
        ci = r["m_probe_ci"] or [None, None]
        sp = r["q_loss_spread"]
        qci = r.get("q_loss_ci")
        qv = f"[{qci[0]:+.2f}, {qci[1]:+.2f}] ({r['runs_verdict']})" if qci else "–"
        L.append(f"| {r['id']} | {_f(r['m_probe'])} ({_f(ci[0])}–{_f(ci[1])}) | {_f(r['m_train'])} | "
                 f"{_f(r['m_train_k1'])} | {_f(r['m_train_abs_log_ratio_p95'])} | {r['q_reverse_kl']:.3f} | "
                 f"{r['q_accuracy']:.3f} | {r['q_loss']:+.3f} ({sp['min']:+.3f}..{sp['max']:+.3f}) | {qv} | "
                 f"{_f(r.get('q_loss_monotone'), '+.3f')} | "
                 f"{'yes' if r['within_budget'] else '**no**'} | {'yes' if r['admissible'] else 'no'} |")
    return L


def _ci(x: Mapping[str, Any], key: str, fmt: str = "+.3f") -> str:
    """`x[key]` with its CI `x[key + "_ci"]` when there is one ("+0.120 [+0.050, +0.210]"), else "–"."""
    if x.get(key) is None:
        return "–"
    ci = x.get(f"{key}_ci")
    return f"{x[key]:{fmt}}" + (f" [{ci[0]:{fmt}}, {ci[1]:{fmt}}]" if ci else "")


def _rl_vs_opd_lines(rv: Mapping[str, Any]) -> list[str]:
    """Section (a): OPD and the RL baseline per weight-noise level, each against its own noise-free run."""
    L = ["", "## (a) OPD versus the RL baseline under weight noise", "",
         f"RL = task-reward policy gradient with overrides `{json.dumps(rv['overrides'])}`"
         + (f"; both methods with `{json.dumps(rv['common'])}`" if rv.get("common")
            else "; OPD = the sweep's runs")
         + ". Each method is compared with its own noise-free run (same seeds, same steps); [95% CI] resamples "
           "both groups' seeds; q_loss = GM(RKL + 0.1) / GM(RKL_0 + 0.1) - 1.", "",
         "| sigma | M probe | OPD RKL | OPD acc | OPD acc drop | OPD q_loss | RL acc | RL acc drop | "
         "RL reward (last 10%) | RL q_loss | non-finite steps (OPD/RL) |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in rv["levels"]:
        o, r = t["opd"] or {}, t["rl"]
        L.append(f"| {t['weight_noise']} | {_f(o.get('m_probe'))} | {_f(o.get('reverse_kl'), '.3f')} | "
                 f"{_f(o.get('accuracy'), '.3f')} | {_ci(o, 'accuracy_drop')} | {_ci(o, 'q_loss', '+.2f')} | "
                 f"{r['accuracy']:.3f} | {_ci(r, 'accuracy_drop')} | {_f(r.get('reward_last'), '.3f')} | "
                 f"{_ci(r, 'q_loss', '+.2f')} | {o.get('nonfinite_steps', '–')}/{r['nonfinite_steps']} |")
    return L + ["", _rl_verdict(rv)]


def _prefix_shift_lines(sh: Mapping[str, Any]) -> list[str]:
    """Section (b): one table per sampling mode of how far clean and perturbed completions agree, per noise level."""
    L = ["", "## (b) Prefix shift under weight noise", "",
         "Clean and perturbed engines sample the same held-out prompts with the same seed (same per-row keys), "
         "so completions coincide until the perturbation flips a sample. first div = mean first differing "
         "completion position among diverged rows; seq KL = mean Σ_t (log mu − log pi) on the perturbed "
         "samples."]
    for which, tab in sh.items():
        if which != "seconds":
            L += _prefix_shift_table(which, tab)
    return L


def _prefix_shift_table(which: str, tab: Sequence[Mapping[str, Any]]) -> list[str]:
    """One sampling mode's prefix-shift rows; N same-prefix columns, as many as the rows carry."""
    N = len([k for k in tab[0] if k.startswith("same_prefix_at_")]) if tab else 0
    L = ["", f"**{which.replace('_', ' ')}**", "",
         "| sigma | frac diverged | first div | answer changed | seq KL | token k3 | "
         + " | ".join(f"same prefix ≥{t}" for t in range(1, N + 1)) + " |",
         "|---|---|---|---|---|---|" + "---|" * N]
    for t in tab:
        L.append(f"| {t['weight_noise']} | {t['frac_diverged']:.3f} | {_f(t['first_div_mean'], '.2f')} | "
                 f"{t['answer_changed']:.3f} | {t['seq_kl']:.4f} | {t['token_k3']:.4g} | "
                 + " | ".join(f"{t[f'same_prefix_at_{k}']:.3f}" for k in range(1, N + 1)) + " |")
    return L


def _corrections_lines(c: Mapping[str, Any], delta: float) -> list[str]:
    """Section (b'): each per-token correction at one noise level beyond the budget, with its verdict."""
    L = ["", f"## (b') Per-token corrections at sigma = {c['weight_noise']} (beyond the budget)", "",
         "q_loss: against the mismatch-free baseline; vs uncorrected: the same effect against the uncorrected run at "
         "this noise (< 0 recovers); [95% CI] resamples both groups' seeds.", "",
         "| correction | final RKL (seeds) | accuracy (seeds) | q_loss vs baseline | vs uncorrected | M train k3 |",
         "|---|---|---|---|---|---|"]
    for t in c["rows"]:
        if "reverse_kl" not in t:
            continue
        rkl_seeds = ", ".join(f"{x:.2f}" for x in t["reverse_kl_seeds"])
        acc_seeds = ", ".join(f"{x:.2f}" for x in t["accuracy_seeds"])
        L.append(f"| {t['correction']} | {t['reverse_kl']:.3f} ({rkl_seeds}) | {t['accuracy']:.3f} ({acc_seeds}) | "
                 f"{_ci(t, 'q_loss')} | {_ci(t, 'vs_none')} | {_f(t.get('m_train'))} |")
    return L + ["", _corr_verdict(c, delta)]


def _timing_lines(tm: Mapping[str, Any]) -> list[str]:
    """The timing section: runs and compute minutes in all, and what this invocation ran (the rest reused)."""
    return ["", "## Timing", "",
            f"{tm['runs']} runs, {tm['compute_seconds'] / 60:.1f} min of probe+training in all; this invocation "
            f"{tm['wall_seconds_this_invocation'] / 60:.1f} min wall ({tm['runs_this_invocation']} runs, the rest "
            "reused from results/)."]


def validity_markdown(rep: Mapping[str, Any], current_budget: float | None = None) -> str:
    """The admission-validity table (benchmarks/admission_validity.py writes `validity.json`); files written
    before full-run verdicts had CIs (no "runs_verdict") keep their old table."""
    if rep["rows"] and "runs_verdict" in rep["rows"][0]:
        return _validity_with_ci(rep, current_budget)
    L = [f"Candidates that are not study points: the probe verdict of `opdjax admit` against B = {rep['budget']:.3g} "
         f"({rep['metric']}) versus the verdict of full runs at the candidate (the study's config and seeds "
         f"{rep['seeds']}; admit iff mean q_loss ≤ delta = {rep['delta']}). UNCERTAIN counts as not admitted.", ""]
    if current_budget is not None and not math.isclose(current_budget, rep["budget"], rel_tol=1e-9):
        L += [f"*Validated against B = {rep['budget']:.4g}; the study's B is now {current_budget:.4g} — rerun "
              "`python benchmarks/admission_validity.py`.*", ""]
    L += ["| candidate | probe M [95% CI] | probe verdict | full-run RKL per seed | q_loss per seed | q_loss | "
          "full run | agree |", "|---|---|---|---|---|---|---|---|"]
    split = {True: [0, 0], False: [0, 0]}  # straddles delta -> [agree, n]
    for r in rep["rows"]:
        rkl = " / ".join(f"{x:.2f}" for x in r["reverse_kl_seeds"])
        qs = " / ".join(f"{x:+.2f}" for x in r["q_loss_seeds"])
        st = straddles(r["q_loss_seeds"], rep["delta"])
        split[st][0] += bool(r["agree"])
        split[st][1] += 1
        L.append(f"| `{r['candidate']}` | {r['m']:.2e} [{r['ci'][0]:.2e}, {r['ci'][1]:.2e}] | {r['verdict']} | "
                 f"{rkl} | {qs} | {r['q_loss']:+.2f} | {'admit' if r['should_admit'] else 'reject'}"
                 f"{' (seeds straddle delta)' if st else ''} | {'yes' if r['agree'] else '**no**'} |")
    L += ["", f"Agreement: **{rep['agreement']}/{rep['n']}** (target ≥ 5 of 6): {split[False][0]}/{split[False][1]} "
          f"where every seed's q_loss falls on the same side of delta, {split[True][0]}/{split[True][1]} where the "
          "seeds straddle it (there the full-run verdict itself is decided by the seed draw).", "",
          f"Probe cost: `opdjax admit` took {rep['admit_wall_seconds']:.1f} s for {rep['n']} candidates "
          f"({rep['probe_seconds_per_candidate']:.1f} s each, model load and compilation included; slowest single "
          f"probe {rep['max_probe_seconds']:.1f} s) against {rep['mean_study_point_seconds']:.0f} s for one study "
          f"point ({len(rep['seeds'])} seeds, probe + training): **{100 * rep['probe_cost_ratio']:.1f}%** "
          "(target < 5%)."]
    return "\n".join(L)


def _validity_with_ci(rep: Mapping[str, Any], current_budget: float | None) -> str:
    iv = rep.get("budget_interval")
    L = [f"Candidates that are not study points: the sequential probe's verdict (`opdjax admit`, risk "
         f"{rep.get('risk', 0.05):g}) against B = {rep['budget']:.3g} ({rep['metric']}"
         + (f"; B's 95% interval over seeds [{iv[0]:.3g}, {iv[1]:.3g}]" if iv else "")
         + f") versus full runs at the candidate (the study's config; seeds {rep['seeds']}): their mean quality "
         f"loss with a 95% bootstrap CI over seeds is *admit* if the CI is within delta = {rep['delta']}, "
         "*reject* if beyond it, *borderline* if it contains delta (scored neither way). UNCERTAIN counts as not "
         "admitted.", ""]
    if current_budget is not None and not math.isclose(current_budget, rep["budget"], rel_tol=1e-9):
        L += [f"*Validated against B = {rep['budget']:.4g}; the study's B is now {current_budget:.4g} — rerun "
              "`python benchmarks/admission_validity.py`.*", ""]
    L += ["| candidate | probe M [bounds] | batches | probe verdict | full-run RKL per seed | q_loss mean [95% CI] | "
          "full runs | agree |", "|---|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        rkl = " / ".join(f"{x:.2f}" for x in r["reverse_kl_seeds"])
        lo, hi = r["q_loss_ci"]
        agree = "–" if r["agree"] is None else ("yes" if r["agree"] else "**no**")
        L.append(f"| `{r['candidate']}` | {r['m']:.2e} [{r['ci'][0]:.2e}, {r['ci'][1]:.2e}] | {r['batches']} | "
                 f"{r['verdict']} | {rkl} | {r['q_loss']:+.2f} [{lo:+.2f}, {hi:+.2f}] | {r['runs_verdict']} | "
                 f"{agree} |")
    nd = rep["n_decided"]
    L += ["", f"Agreement: **{rep['agreement']}/{nd}** of the decided candidates "
          f"({100 * rep['agreement'] / max(nd, 1):.0f}%; target ≥ 90%); borderline (not scored): "
          f"{len(rep['borderline'])} of {rep['n']}{': ' + ', '.join(rep['borderline']) if rep['borderline'] else ''}. "
          f"False ADMITs: {len(rep['false_admits'])}{' (' + ', '.join(rep['false_admits']) + ')' if rep['false_admits'] else ''}"
          f" (target 0). UNCERTAIN among the decided: {len(rep['uncertain_decided'])} (target ≤ 2).", "",
          f"Probe cost per candidate (model load, compilation and all batches; `opdjax admit` in a fresh process): "
          f"{rep['probe_seconds_per_candidate_cold']:.1f} s cold (empty compilation cache), "
          f"{rep['probe_seconds_per_candidate']:.1f} s warm, against {rep['mean_study_point_seconds']:.0f} s for one "
          f"study point ({len(rep.get('study_seeds', rep['seeds']))} seeds, probe + training): "
          f"**{100 * rep['probe_cost_ratio_cold']:.1f}% "
          f"cold, {100 * rep['probe_cost_ratio']:.1f}% warm** (target < 5%)."]
    if "always_admit" in rep:
        L += ["", f"The do-nothing rules on the same {nd} decided candidates: always ADMIT "
              f"{rep['always_admit']}/{nd}, always REJECT {rep['always_reject']}/{nd}."]
    if "max_m" in rep:
        L += ["", f"Range: {len(rep['below_b_over_3'])} candidates probe at ≤ B/3, {len(rep['above_3b'])} at ≥ 3·B; "
              f"the largest M is {rep['max_m']:.3g} ({rep['max_m'] / rep['budget']:.2f}·B)."]
    return "\n".join(L)


def _rl_verdict(rv) -> str:
    """One sentence on the largest level: each method's accuracy drop with its CI, and whether they separate."""
    worst = max(rv["levels"], key=lambda t: t["weight_noise"])
    o, r = worst["opd"] or {}, worst["rl"]
    head = (f"At the largest level (sigma = {worst['weight_noise']}): OPD accuracy drop {_ci(o, 'accuracy_drop')}, "
            f"q_loss {_ci(o, 'q_loss', '+.2f')}; RL accuracy drop {_ci(r, 'accuracy_drop')}, q_loss "
            f"{_ci(r, 'q_loss', '+.2f')}; non-finite RL steps {r['nonfinite_steps']}.")
    if o.get("accuracy_drop_ci") and r.get("accuracy_drop_ci"):
        if o["accuracy_drop_ci"][1] < r["accuracy_drop_ci"][0]:
            head += " OPD loses less accuracy than RL (the intervals are disjoint)."
        elif r["accuracy_drop_ci"][1] < o["accuracy_drop_ci"][0]:
            head += " RL loses less accuracy than OPD (the intervals are disjoint)."
        else:
            head += " The two accuracy drops are not separated (their intervals overlap)."
    return head


_WITHIN = {"admit": "within delta", "reject": "beyond delta", "borderline": "straddles delta"}


def _corr_verdict(c, delta) -> str:
    """One sentence per correction: within delta of the baseline (CI below delta), and recovered against the
    uncorrected run (CI of vs_none below 0), each only when its interval says so."""
    rows = [t for t in c["rows"] if "q_loss" in t]
    if not rows:
        return ""
    parts = []
    for t in rows:
        where = dose.runs_verdict(t.get("q_loss_ci") or (t["q_loss"], t["q_loss"]), delta)
        txt = f"{t['correction']}: {_WITHIN[where]}"
        if "vs_none" in t:
            vlo, vhi = t["vs_none_ci"]
            txt += (", better than uncorrected" if vhi < 0 else ", worse than uncorrected" if vlo > 0
                    else ", not separated from uncorrected")
        parts.append(txt)
    return "; ".join(parts) + "."
