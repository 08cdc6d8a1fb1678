"""Failure-predictor evaluation on held-out simulator traces: recall/precision and false alarms.

Sets of traces, none used in training (the packaged model: members 0-11 of the randomised
"train" family; see the model metadata). The plain-simulator sets (the previous model's):
- "val": validation traces (raised failure rate) used to choose the alert policy;
- "test": held-out traces (raised failure rate, seeds and fleet mixes never used in training
  or tuning, GPU models absent from training, other sample intervals) for recall/precision;
- "fa-val": two 512-GPU 30-day traces at the published failure rate (0.5 per 1,000 GPU-days),
  other seeds and mixes than "fa": the false-alarm side of choosing the alert policy;
- "fa": two 1,024-GPU 30-day traces at the published rate and 300 s sampling (held out):
  false alarms per 1,000 GPU-days with enough exposure.

The randomised-family sets (issue 16): "val-dr" (tuning: members never trained on),
"fa-val-dr-wide" (more false-alarm exposure of the same family at a realistic failure rate),
"test-dr" (held out, same family) and "shifted" (another family, never trained or tuned on:
the evaluation that can fail), with "shifted-fresh", "shifted-final" and "shifted-new",
members of the same family drawn later, each looked at by fewer decisions (see their comments
in SETS). For a model trained on the "wide" family (`predictor train --family wide`): "val-wide"
(its tuning set), "far" and "far-fresh" (the "far" family, beyond it on every range). The
judgements of the six-hour hold, on members drawn after it was chosen: "judge", then
"judge2", "judge3", ... (shifted and far members, two 512-GPU x 21-day traces each; SETS lists
them, each drawn for one decision):

    .venv/bin/python bench/failure_eval.py --tune --tune-sets val-dr   # the packaged policy's sweep
    .venv/bin/python bench/failure_eval.py --targets test-dr,shifted   # every target with 95% CIs
    .venv/bin/python bench/failure_eval.py --targets shifted-final --explain   # + every false alarm
    .venv/bin/python bench/failure_eval.py --tune            # policy sweep on val + fa-val
    .venv/bin/python bench/failure_eval.py --sets val,test [--cache /tmp/fleetwise-eval] [--explain]
    .venv/bin/python bench/failure_eval.py --sets fa

`--tune` scores every hop once per model (HopScores, cached next to the traces) and replays
each policy over the stored probabilities with FailurePredictor.advance_policy.

Traces are generated in memory and cached (raw sample arrays + labels) under --cache, so a
re-run after a model change only recomputes features and predictions. Prints tables; copy
them into docs/benchmarks.md ("Predictors").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

import fleetwise.predictors.features as feature_code
from fleetwise.predictors.backtest import LEAD_12H, LEAD_30MIN_H, score_failures
from fleetwise.predictors.failure import (
    ALERT_RULES,
    RULE_NAMES,
    AlertPolicy,
    FailurePredictor,
    feature_schema_hash,
    policy_from_spec,
)
from fleetwise.predictors.features import FEATURE_NAMES
from fleetwise.predictors.policy_choice import HopScores, poisson_upper, replay_policy
from fleetwise.predictors.policy_choice import score_hops as score_hops_raw
from fleetwise.predictors.training import (
    FeatureTable,
    RawSamples,
    compute_features_raw,
    covered_gpu_days,
    hop_chunks,
    hop_extent,
    label_rows,
    raw_samples,
    slot_key,
)
from fleetwise.sim.randomize import family_key


@dataclass(frozen=True)
class TraceSpec:
    name: str
    mix: str
    days: float
    seed: int
    failure_rate: float
    interval_s: float
    family: str = ""  # a configuration family of fleetwise.sim.randomize (seed = member index)

    def key(self) -> str:
        mix = self.mix.replace(":", "x").replace(",", "_")
        if self.family:
            return family_key(self.family, self.seed, mix, self.days, self.failure_rate, self.interval_s)
        return f"{mix}-d{self.days:g}-s{self.seed}-r{self.failure_rate:g}-i{self.interval_s:g}"

    def config(self) -> Any:
        from fleetwise.sim import SimConfig
        from fleetwise.sim.randomize import family_config

        if self.family:
            return family_config(self.family, self.seed, days=self.days, failure_rate=self.failure_rate,
                                 gpus=self.mix or None, interval_s=self.interval_s or None)
        return SimConfig(gpus=self.mix, days=self.days, seed=self.seed, sample_interval_s=self.interval_s,
                         failure_rate_per_1000_gpu_days=self.failure_rate)




def _judgement(shifted: tuple[int, int, int], shifted_mix: str, far: tuple[int, int, int],
               far_mix: str) -> list[TraceSpec]:
    """A judgement set: per family ("shifted", "far") two 10-day members of the family's own
    fleet and one 21-day member of 512 GPUs (the private hold-out's size) with the given mix."""
    return [spec for family, seeds, mix in (("shifted", shifted, shifted_mix), ("far", far, far_mix))
            for spec in (TraceSpec(f"{family}-{seeds[0]}", "", 10, seeds[0], 40, 300, family),
                         TraceSpec(f"{family}-{seeds[1]}", "", 10, seeds[1], 40, 300, family),
                         TraceSpec(f"{family}-{seeds[2]}", mix, 21, seeds[2], 9, 300, family))]


SETS: dict[str, list[TraceSpec]] = {
    "val": [
        TraceSpec("val-201", "b200:64,h100-sxm:32,v100-sxm2-32gb:32", 7, 201, 40, 60),
        TraceSpec("val-203", "h200:64,a100-sxm-80gb:32,b300:32", 7, 203, 40, 120),
    ],
    "test": [
        # the previous engineer's held-out trace, kept for comparison
        TraceSpec("test-202", "b200:64,h100-sxm:32,v100-sxm2-32gb:32", 7, 202, 40, 60),
        # mixes with GPU models absent from training, other sample intervals
        TraceSpec("test-302", "b300:64,h20:32,a100-sxm-40gb:32", 7, 302, 40, 120),
        TraceSpec("test-303", "h200:32,b200:64,v100-sxm2-32gb:32", 7, 303, 40, 300),
        TraceSpec("test-304", "h100-sxm:64,b100:64", 7, 304, 40, 60),
    ],
    # Tuning set at the published failure rate (not the held-out "fa" set): the alert policy
    # is chosen on "val" + "fa-val" together; other seeds and mixes than "fa", half the size.
    "fa-val": [
        TraceSpec("fa-val-501", "h100-sxm:192,b200:128,a100-sxm-40gb:128,h20:64", 30, 501, 0.5, 300),
        TraceSpec("fa-val-502", "h200:192,a100-sxm-80gb:128,b300:128,v100-sxm2-32gb:64", 30, 502, 0.5, 300),
    ],
    "fa": [
        TraceSpec("fa-401", "h100-sxm:384,a100-sxm-80gb:256,b200:256,v100-sxm2-32gb:128", 30, 401, 0.5, 300),
        TraceSpec("fa-402", "h200:384,b300:256,a100-sxm-40gb:256,h20:128", 30, 402, 0.5, 300),
    ],
    # Domain-randomised tuning set: members of the "train" family (fleetwise.sim.randomize)
    # that training does not use (the packaged model: members 0-11); the alert policy is tuned here.
    "val-dr": [
        TraceSpec("val-dr-100", "", 7, 100, 40, 60, "train"),
        TraceSpec("val-dr-101", "", 7, 101, 40, 120, "train"),
        TraceSpec("val-dr-102", "", 7, 102, 40, 300, "train"),
        TraceSpec("fa-val-dr-110", "h100-sxm:192,a100-sxm-80gb:128,h200:192", 14, 110, 3, 300, "train"),
    ],
    # More false-alarm exposure from the training family (members neither trained on nor in
    # val-dr/test-dr), at a realistic failure rate: 21,500 GPU-days, twice val-dr's, so that
    # choices no longer hinge on one false alarm (docs/benchmarks.md, "fit seeds").
    "fa-val-dr-wide": [
        TraceSpec("fa-val-dr-111", "h100-sxm:192,a100-sxm-80gb:192,h200:128", 21, 111, 3, 300, "train"),
        TraceSpec("fa-val-dr-112", "h200:256,a100-sxm-80gb:128,h100-sxm:128", 21, 112, 3, 300, "train"),
    ],
    # In-distribution held-out set of the randomised family: members neither trained on
    # (0-11) nor tuned on (100-110), so the shifted family's figures have a baseline beside them.
    "test-dr": [
        TraceSpec("test-dr-200", "", 7, 200, 40, 60, "train"),
        TraceSpec("test-dr-201", "", 7, 201, 40, 120, "train"),
        TraceSpec("test-dr-202", "", 7, 202, 40, 300, "train"),
        TraceSpec("fa-test-dr-210", "h200:192,a100-sxm-80gb:128,h100-sxm:192", 14, 210, 3, 300, "train"),
    ],
    # The evaluation that can fail: the "shifted" family, never used for training or tuning
    # (other parameter ranges, trap mix and GPU models; 5-minute samples). The last trace is
    # shaped like the private hold-out of issue 16 (512 GPUs x 21 days, ~9 failures / 1,000
    # GPU-days).
    "shifted": [
        TraceSpec("shifted-0", "", 10, 0, 40, 300, "shifted"),
        TraceSpec("shifted-1", "", 10, 1, 40, 300, "shifted"),
        TraceSpec("shifted-2", "", 10, 2, 40, 300, "shifted"),
        TraceSpec("shifted-10", "b200:192,h100-sxm:128,a100-sxm-40gb:128,h20:64", 21, 10, 9, 300, "shifted"),
    ],
    # Fresh members of the shifted family, drawn (2026-12-04) after "shifted" had been used to
    # turn down ten candidate models and rules: the packaged model was kept because each of
    # them did worse there, which makes its own "shifted" figures the best of several looks.
    # These members were never looked at before its one run here, so they estimate it without
    # that selection (docs/benchmarks.md, "Fresh members of the shifted family").
    "shifted-fresh": [
        TraceSpec("shifted-3", "", 10, 3, 40, 300, "shifted"),
        TraceSpec("shifted-4", "", 10, 4, 40, 300, "shifted"),
        TraceSpec("shifted-5", "", 10, 5, 40, 300, "shifted"),
        TraceSpec("shifted-11", "b300:128,h200:128,b100:128,v100-sxm2-32gb:64,a100-sxm-80gb:64",
                  21, 11, 9, 300, "shifted"),
    ],
    # Drawn after "shifted-fresh" was looked at (its false alarms led to a trial of a gate on each
    # GPU's own history, not shipped): the packaged model and that trial's policy were each run
    # here once (docs/benchmarks.md, "Fresh members of the shifted family").
    "shifted-final": [
        TraceSpec("shifted-6", "", 10, 6, 40, 300, "shifted"),
        TraceSpec("shifted-7", "", 10, 7, 40, 300, "shifted"),
        TraceSpec("shifted-8", "", 10, 8, 40, 300, "shifted"),
        TraceSpec("shifted-12", "h100-sxm:128,b200:128,h20:128,a100-sxm-80gb:64,v100-sxm2-32gb:64",
                  21, 12, 9, 300, "shifted"),
    ],
    # Tuning set of the "wide" training family (its members 0-11 trained on; these never).
    "val-wide": [
        TraceSpec("val-wide-100", "", 7, 100, 40, 60, "wide"),
        TraceSpec("val-wide-101", "", 7, 101, 40, 120, "wide"),
        TraceSpec("val-wide-102", "", 7, 102, 40, 300, "wide"),
        TraceSpec("fa-val-wide-110", "h100-sxm:192,a100-sxm-80gb:128,h200:192", 14, 110, 3, 300, "wide"),
    ],
    # Members of the shifted family drawn (2026-12-04) for the "wide" training trial, after the
    # sets above: nothing had looked at them. A model trained on "wide" has seen the shifted
    # family's parameter ranges (not its GPU models), so for it these are near-shift.
    "shifted-new": [
        TraceSpec("shifted-13", "", 10, 13, 40, 300, "shifted"),
        TraceSpec("shifted-14", "", 10, 14, 40, 300, "shifted"),
        TraceSpec("shifted-15", "", 10, 15, 40, 300, "shifted"),
        TraceSpec("shifted-16", "b200:128,h100-sxm:128,b300:128,a100-sxm-40gb:64,h20:64", 21, 16, 9, 300,
                  "shifted"),
    ],
    # The "far" family: beyond "wide" (and so beyond "train") on every noise and trap range,
    # another failure-class mix, GPU models no training mix has; never trained or tuned on.
    "far": [
        TraceSpec("far-0", "", 10, 0, 40, 300, "far"),
        TraceSpec("far-1", "", 10, 1, 40, 300, "far"),
        TraceSpec("far-2", "", 10, 2, 40, 300, "far"),
        TraceSpec("far-10", "b200:192,h20:128,b300:128,v100-sxm2-32gb:64", 21, 10, 9, 300, "far"),
    ],
    # Drawn after "far" and "shifted-new" had been looked at (their false alarms led to a trial
    # without the absolute thermal-throttle features): that trial's one held-out run.
    "far-fresh": [
        TraceSpec("far-3", "", 10, 3, 40, 300, "far"),
        TraceSpec("far-4", "", 10, 4, 40, 300, "far"),
        TraceSpec("far-5", "", 10, 5, 40, 300, "far"),
        TraceSpec("far-11", "b300:192,b100:128,h20:128,a100-sxm-40gb:64", 21, 11, 9, 300, "far"),
        TraceSpec("shifted-17", "", 10, 17, 40, 300, "shifted"),
        TraceSpec("shifted-18", "b300:128,h20:128,b200:128,h100-sxm:64,v100-sxm2-32gb:64", 21, 18, 9, 300,
                  "shifted"),
    ],
    # Drawn (2026-12-04) after every set above had been looked at, once the long-persistence
    # policy (0.97 held 36 hops) had been chosen on the shifted sets before: its one judgement.
    "judge": _judgement((19, 20, 21), "h200:192,b100:128,h20:128,a100-sxm-40gb:64",
                        (6, 7, 12), "b200:128,b300:128,h20:128,v100-sxm2-32gb:64,a100-sxm-40gb:64"),
    # Drawn (2026-12-04, sixteenth session) after "judge" had been run three times: a second
    # judgement of the default (0.97 held 36 hops), run once, nothing chosen on it
    # (docs/benchmarks.md, "A second judgement").
    "judge2": _judgement((22, 23, 24), "b300:192,h100-sxm:128,b100:128,a100-sxm-80gb:64",
                        (13, 14, 15), "h200:128,b200:128,h20:128,v100-sxm2-32gb:64,a100-sxm-80gb:64"),
    # Drawn (2026-12-04, sixteenth session) before the full-power-drift candidate with a shorter
    # hold was looked at anywhere: that candidate's one judgement, and the default's beside it
    # (docs/benchmarks.md, "Tried and dropped: the full-power drift with a hold").
    "judge3": _judgement((25, 26, 27), "h100-sxm:192,b200:128,h20:128,v100-sxm2-32gb:64",
                        (16, 17, 18), "b100:192,h200:128,b300:128,a100-sxm-40gb:64"),
    # Drawn (2026-12-05, eighteenth session) before anything ran on them: the judgement of the
    # model trained with an independent generator's traces beside the simulator's, and of the
    # default beside it (docs/benchmarks.md, "Generators written apart from the simulator").
    "judge4": _judgement((28, 29, 30), "h100-sxm:192,b300:128,h20:128,a100-sxm-80gb:64",
                        (19, 20, 21), "h200:192,b200:128,b100:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-05, nineteenth session) before anything ran on them: the judgement of the
    # model trained with a second independent generator's traces, and of the default beside it.
    "judge5": _judgement((31, 32, 33), "b200:192,h100-sxm:128,h20:128,v100-sxm2-32gb:64",
                        (22, 23, 24), "b300:192,h200:128,b100:128,a100-sxm-80gb:64"),
    # Drawn (2026-12-05, twentieth session) after judge5 had judged the single-bit node-peer hold
    # once (rule 2 in docs/benchmarks.md, "Shared single-bit errors"), before anything ran on them.
    "judge6": _judgement((34, 35, 36), "h200:192,b200:128,a100-sxm-40gb:128,h20:64",
                        (25, 26, 27), "b200:192,h100-sxm:128,b300:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-05, twenty-first session) for the judgement of the restart of a GPU's
    # feature history after its failure (rule 4 in docs/benchmarks.md), before anything ran on them.
    "judge7": _judgement((37, 38, 39), "b300:192,h200:128,a100-sxm-80gb:128,h20:64",
                        (28, 29, 30), "h100-sxm:192,b200:128,b100:128,a100-sxm-40gb:64"),
    # Drawn (2026-12-05, twenty-first session) after rule 4 had shipped, for rule 5 (the XIDs
    # after which an outage restarts a GPU's history), before anything ran on them.
    "judge8": _judgement((40, 41, 42), "h100-sxm:192,b300:128,a100-sxm-40gb:128,h20:64",
                        (31, 32, 33), "b200:192,h200:128,b100:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-05, twenty-first session) after rule 5's result, for rule 6 (trends scaled
    # by the time observed), before anything ran on them.
    "judge9": _judgement((43, 44, 45), "b200:192,h100-sxm:128,a100-sxm-80gb:128,h20:64",
                        (34, 35, 36), "h200:192,b300:128,b100:128,a100-sxm-40gb:64"),
    # Drawn (2026-12-05, twenty-second session) for rule 7 (rule 6's trends with the model
    # retrained on them), before anything ran on them.
    "judge10": _judgement((46, 47, 48), "h200:192,b300:128,a100-sxm-80gb:128,h20:64",
                         (37, 38, 39), "b300:192,h100-sxm:128,b200:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-05, twenty-second session) after rule 7's result, for rule 8 (a GPU's
    # single-bit-driven risk held while its history is short), before anything ran on them.
    "judge11": _judgement((49, 50, 51), "b200:192,h200:128,a100-sxm-40gb:128,h20:64",
                         (40, 41, 42), "h100-sxm:192,b300:128,b100:128,a100-sxm-80gb:64"),
    # Drawn (2026-12-05, twenty-second session) for rule 9 (a raise streak broken by an hour
    # below the threshold, not one hop), before anything ran on them.
    "judge12": _judgement((52, 53, 54), "h200:192,b200:128,a100-sxm-80gb:128,h20:64",
                         (43, 44, 45), "b300:192,h200:128,b100:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-05, twenty-third session) for rule 10 (sustained NVLink / PCIe error surges
    # as rules), before anything ran on them.
    "judge13": _judgement((55, 56, 57), "b300:192,h100-sxm:128,a100-sxm-40gb:128,h20:64",
                         (46, 47, 48), "h200:192,b200:128,b100:128,a100-sxm-80gb:64"),
    # Drawn (2026-12-05, twenty-third session) after rule 10's result, for rule 11 (the NVLink
    # error surge alone), before anything ran on them.
    "judge14": _judgement((58, 59, 60), "h100-sxm:192,h200:128,a100-sxm-80gb:128,h20:64",
                         (49, 50, 51), "b300:192,b200:128,b100:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-05, twenty-fourth session) for rule 12 (a 6-hour tier of NVLink / PCIe error
    # rises), before anything ran on them.
    "judge15": _judgement((61, 62, 63), "b200:192,h100-sxm:128,a100-sxm-80gb:128,h20:64",
                         (52, 53, 54), "h200:192,b300:128,b100:128,a100-sxm-40gb:64"),
    # Drawn (2026-12-05, twenty-fourth session) after rule 12 shipped, for rule 13 (a single-bit
    # error rise held a day), before anything ran on them.
    "judge16": _judgement((64, 65, 66), "h100-sxm:192,b200:128,a100-sxm-40gb:128,h20:64",
                         (55, 56, 57), "b300:192,h200:128,b100:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-05, twenty-fifth session) for link-error surges the node does not share,
    # before anything ran on them.
    "judge17": _judgement((67, 68, 69), "b200:192,a100-sxm-80gb:128,h100-sxm:128,h20:64",
                         (58, 59, 60), "h200:192,b100:128,b300:128,a100-sxm-40gb:64"),
    # Drawn (2026-12-06, twenty-sixth session) for the model's alerts as the default with longer
    # holds for thermal- and single-bit-driven risk, before anything ran on them.
    "judge18": _judgement((70, 71, 72), "h100-sxm:192,b300:128,a100-sxm-40gb:128,h20:64",
                         (61, 62, 63), "b200:192,h200:128,b100:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-06, twenty-seventh session) for a rule on power-brake episodes the node does
    # not share, before anything ran on them.
    "judge19": _judgement((73, 74, 75), "b200:192,h100-sxm:128,h20:128,a100-sxm-80gb:64",
                         (64, 65, 66), "h200:192,b300:128,a100-sxm-40gb:128,b100:64"),
    # Drawn (2026-12-06, twenty-eighth session) for a rule on a thermal residual the node does not
    # share, before anything ran on them.
    "judge20": _judgement((76, 77, 78), "h200:192,b200:128,a100-sxm-80gb:128,h20:64",
                         (67, 68, 69), "b300:192,h100-sxm:128,b100:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-06, twenty-eighth session) after judge20's result, for the next judgement,
    # before anything ran on them.
    "judge21": _judgement((79, 80, 81), "b200:192,h200:128,a100-sxm-40gb:128,h20:64",
                         (70, 71, 72), "h100-sxm:192,b300:128,b200:128,a100-sxm-80gb:64"),
    # Drawn (2026-12-06, twenty-ninth session) for reading the sample's uuid (a new board's
    # history restarts), before anything ran on them.
    "judge22": _judgement((82, 83, 84), "h100-sxm:192,h200:128,a100-sxm-40gb:128,h20:64",
                         (73, 74, 75), "b200:192,b300:128,b100:128,a100-sxm-80gb:64"),
    # Drawn (2026-12-06, twenty-ninth session) after judge22's result, for rule 16 at a lower
    # level and a shorter hold now that a replaced board starts afresh, before anything ran on them.
    "judge23": _judgement((85, 86, 87), "b300:192,h100-sxm:128,a100-sxm-80gb:128,h20:64",
                         (76, 77, 78), "h200:192,b200:128,b100:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-06, thirtieth session) for rule 20 (memory repairs the node does not share),
    # before anything ran on them.
    "judge24": _judgement((88, 89, 90), "h200:192,b300:128,a100-sxm-40gb:128,h20:64",
                         (79, 80, 81), "b300:192,h200:128,b100:128,a100-sxm-40gb:64"),
    # Drawn (2026-12-06, thirtieth session) for rule 21 (a GSP error), before anything ran on them.
    "judge25": _judgement((91, 92, 93), "b200:192,h100-sxm:128,a100-sxm-40gb:128,h20:64",
                         (82, 83, 84), "h100-sxm:192,b200:128,b300:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-06, thirtieth session) for rule 22 (NVLink errors hop after hop), before
    # anything ran on them.
    "judge26": _judgement((94, 95, 96), "h100-sxm:192,h200:128,a100-sxm-80gb:128,h20:64",
                         (85, 86, 87), "b200:192,b300:128,h200:128,a100-sxm-80gb:64"),
    # Drawn (2026-12-06, thirty-first session) for heat the node shares read by removal
    # (AlertPolicy.shared_heat_by_removal), before anything ran on them.
    "judge27": _judgement((97, 98, 99), "b300:192,h200:128,a100-sxm-80gb:128,h20:64",
                         (88, 89, 90), "h200:192,b200:128,b300:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-06, thirty-first session) for a second judgement of rule 22 (its first,
    # judge26, failed on false alarms both arms shared), before anything ran on them.
    "judge28": _judgement((100, 101, 102), "h100-sxm:192,b200:128,a100-sxm-40gb:128,h20:64",
                         (91, 92, 93), "b300:192,h200:128,b100:128,a100-sxm-80gb:64"),
    # Drawn (2026-12-06, thirty-second session) for rule 23 (a memory warning XID), before anything
    # ran on them.
    "judge29": _judgement((103, 104, 105), "b200:192,h200:128,a100-sxm-80gb:128,h20:64",
                         (94, 95, 96), "h100-sxm:192,b300:128,b100:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-06, thirty-second session) for rule 19's sharing read at its own level
    # (node_heat_peers_1h) and rule 23's second judgement, before anything ran on them.
    "judge30": _judgement((106, 107, 108), "h200:192,b200:128,a100-sxm-40gb:128,h20:64",
                         (97, 98, 99), "b300:192,h100-sxm:128,b200:128,a100-sxm-80gb:64"),
    # Drawn (2026-12-07, thirty-fourth session) for rule 25 (PCIe replays hop after hop), before
    # anything ran on them.
    "judge32": _judgement((109, 110, 111), "b300:192,h100-sxm:128,a100-sxm-40gb:128,h20:64",
                         (100, 101, 102), "h200:192,b200:128,b100:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-07, thirty-fourth session) for the sparse-trend hold and rule 25's second
    # judgement, before anything ran on them.
    "judge33": _judgement((112, 113, 114), "h200:192,b300:128,a100-sxm-80gb:128,h20:64",
                         (103, 104, 105), "b200:192,h100-sxm:128,b100:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-07, thirty-fifth session) for rule 26 (a double-bit error counted), before
    # anything ran on them.
    "judge34": _judgement((115, 116, 117), "b300:192,h200:128,a100-sxm-40gb:128,v100-sxm2-32gb:64",
                         (106, 107, 108), "h200:192,b300:128,b100:128,a100-sxm-80gb:64"),
    # Drawn (2026-12-07, thirty-fifth session) for rule 14's NVLink gate (`AlertRule.active`),
    # before anything ran on them.
    "judge35": _judgement((118, 119, 120), "h100-sxm:192,b200:128,a100-sxm-80gb:128,h20:64",
                         (109, 110, 111), "b300:192,h200:128,a100-sxm-40gb:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-07, thirty-sixth session) for rule 27 (a single-bit error rise the node does
    # not share), before anything ran on them.
    "judge36": _judgement((121, 122, 123), "h200:192,h100-sxm:128,a100-sxm-40gb:128,h20:64",
                         (112, 113, 114), "b300:192,b200:128,v100-sxm2-32gb:128,a100-sxm-80gb:64"),
    # Drawn (2026-12-07, thirty-seventh session) for rule 20 with one node peer erring allowed,
    # before anything ran on them.
    "judge37": _judgement((124, 125, 126), "b200:192,h100-sxm:128,h20:128,a100-sxm-40gb:64",
                         (115, 116, 117), "b300:192,a100-sxm-80gb:128,h200:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-07, thirty-seventh session) for rule 27 with one node peer erring allowed,
    # before anything ran on them.
    "judge38": _judgement((127, 128, 129), "h100-sxm:192,h200:128,b200:128,h20:64",
                         (118, 119, 120), "b200:192,b300:128,a100-sxm-40gb:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-07, forty-first session) for the model's heat-driven raises held 6 h like
    # every other model raise (AlertPolicy.k_raise_thermal 108 -> 36, or 72), before anything ran
    # on them.
    "judge39": _judgement((130, 131, 132), "b300:192,h100-sxm:128,a100-sxm-80gb:128,h20:64",
                         (121, 122, 123), "h200:192,b200:128,a100-sxm-40gb:128,v100-sxm2-32gb:64"),
    # Drawn (2026-12-07, forty-second session) for rule 19 on the residual as a share of the GPU's
    # own fitted rise (`temp_residual_cool_24h` / `rth_slow`), before anything ran on them.
    "judge40": _judgement((133, 134, 135), "h100-sxm:192,b300:128,a100-sxm-40gb:128,h20:64",
                         (124, 125, 126), "b300:192,h200:128,b100:128,v100-sxm2-32gb:64"),
}


def load_raw(spec: TraceSpec, cache: Path) -> tuple[RawSamples, list[dict[str, Any]]]:
    """Raw sample arrays and labels of a simulator trace (generated once, then cached)."""
    base = cache / spec.key()
    npz, lab = base.with_suffix(".npz"), base.with_suffix(".labels.json")
    if npz.exists() and lab.exists():
        d = np.load(npz)
        meta = json.loads(str(d["meta"]))
        return RawSamples(meta, d["slots"], d["ts"], d["rows"]), json.loads(lab.read_text())
    from fleetwise.sim import FleetSimulator

    sim = FleetSimulator(spec.config())
    raw = raw_samples(s for tick in sim.ticks() for s in tick.samples)
    labels = sim.labels()
    cache.mkdir(parents=True, exist_ok=True)
    np.savez(npz, meta=json.dumps(raw.meta), slots=raw.slots, ts=raw.ts, rows=raw.rows)
    lab.write_text(json.dumps(labels))
    return raw, labels


def evaluate(
    spec: TraceSpec, predictor: FailurePredictor, cache: Path
) -> tuple[dict, FeatureTable, list, np.ndarray]:
    raw, labels = load_raw(spec, cache)
    table = compute_features_raw(raw, stagger=STAGGER_HOPS)
    lab = label_rows(table, labels, predictor.model.horizon_h)
    fresh = FailurePredictor(predictor.model, predictor.policy)  # no alert state from another trace
    preds, probs = fresh.process_arrays(table.keys, table.ts, table.features)
    m = lab.score_mask
    metrics = score_failures(preds, labels, gpu_days=table.gpu_days, horizon_h=predictor.model.horizon_h,
                             hop_labels=lab.y[m], hop_probs=probs[m], first_seen=table.first_seen(),
                             trace_end=float(table.ts.max()))
    return metrics, table, preds, probs


def evaluate_stream(spec: TraceSpec, predictor: FailurePredictor) -> tuple[dict, None, list, None]:
    """Like `evaluate` for traces too large to hold: simulate, window and score in chunks,
    keeping only alert predictions (the feature table of 30,000 GPU-days would not fit)."""
    from fleetwise.predictors.features import GpuFeatureWindows
    from fleetwise.sim import FleetSimulator

    sim = FleetSimulator(spec.config())
    windows = GpuFeatureWindows(stagger=STAGGER_HOPS)
    pred = FailurePredictor(predictor.model, predictor.policy)
    hop_slots: list[np.ndarray] = []
    hop_ts: list[np.ndarray] = []
    kept: list = []
    for cs, cts, cf in hop_chunks((s for tick in sim.ticks() for s in tick.samples), windows):
        if len(cs) == 0:
            continue
        hop_slots.append(cs)
        hop_ts.append(cts)
        preds, _ = pred.process_arrays([slot_key(windows, i) for i in cs.tolist()], cts, cf)
        kept.extend(p for p in preds if p.alert or p.reason == "cleared")
    extent = hop_extent(np.concatenate(hop_slots), np.concatenate(hop_ts))
    seen = {slot_key(windows, sl): first - windows.hop_s for sl, (first, _) in extent.items()}
    metrics = score_failures(kept, sim.labels(), gpu_days=covered_gpu_days(extent, windows.hop_s),
                             horizon_h=predictor.model.horizon_h, first_seen=seen,
                             trace_end=max(last for _, last in extent.values()))
    return metrics, None, kept, None


# Staggered hops (`--stagger-hops`): every GPU's hop grid shifted by its phase, as
# `fleetwise worker/replay --stagger-hops` run the windows. Set once from the command line.
STAGGER_HOPS = False

def model_tag(predictor: FailurePredictor) -> str:
    """Identifies the fitted model (not its policy), the rules and the feature code, so cached
    scores follow all three."""
    import hashlib

    meta = {k: v for k, v in predictor.model.metadata.items() if k != "policy"}
    probe = predictor.model.predict_proba(np.zeros((1, len(predictor.model.feature_names))))
    # The rules' bits (and the surge levels) are stored with the scores: a change of rules is a
    # change of tag.
    # The rows' columns and how they are computed: a change to the feature code rescores.
    code = hashlib.sha256(Path(feature_code.__file__).read_bytes()).hexdigest()
    text = (json.dumps(meta, sort_keys=True, default=str) + repr(probe.tolist()) + repr(RULE_NAMES)
            + repr(ALERT_RULES) + feature_schema_hash(FEATURE_NAMES) + code)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def score_hops(spec: TraceSpec, predictor: FailurePredictor, cache: Path) -> tuple[HopScores, list[dict]]:
    """HopScores of a trace (`fleetwise.predictors.policy_choice.score_hops`), cached per model."""
    path = cache / f"{spec.key()}.scores-{model_tag(predictor)}{'-staggered' if STAGGER_HOPS else ''}.npz"
    raw, labels = load_raw(spec, cache)
    keys = [(m["node"], int(m["gpu"])) for m in raw.meta]
    if path.exists():
        d = np.load(path)
        return HopScores(keys, d["slots"], d["ts"], d["prob"], d["rules"], d["watch"], d["watch_x"],
                         float(d["gpu_days"])), labels
    s = score_hops_raw(raw, predictor, stagger=STAGGER_HOPS)
    np.savez(path, slots=s.slots, ts=s.ts, prob=s.prob, rules=s.rules, watch=s.watch, watch_x=s.watch_x,
             gpu_days=s.gpu_days)
    return s, labels


def explain_scores(name: str, scores: HopScores, metrics: dict, preds: list[dict],
                   predictor: FailurePredictor) -> None:
    """Every false alarm of a policy replay with the top signals of its raising hop."""
    watch_pos = {int(r): i for i, r in enumerate(scores.watch.tolist())}
    raise_row = {(p["node"], p["gpu"], p["ts"]): p["row"] for p in preds if p["alert"]}
    for fa in metrics["false_alert_list"]:
        row = raise_row.get((fa["node"], fa["gpu"], fa["raised_ts"]))
        sig = ""
        if row is not None and row in watch_pos:
            xf = scores.watch_x[watch_pos[row]].astype(np.float64)
            x = xf[predictor.model.cols][None, :]
            c = predictor.model.contributions(x)[0]
            top = np.argsort(-c)[:6]
            sig = ", ".join(f"{predictor.model.feature_names[i]}={x[0, i]:.3g}" for i in top if c[i] > 0)
            sig += f"; mem share {predictor.model.memory_share(x)[0]:.2f}"
        p = scores.prob[row] if row is not None else float("nan")
        print(f"  FALSE {name} {fa['node']}/{fa['gpu']} at {fa['raised_ts']:.0f} ({fa['source']}) "
              f"p={p:.2f}: {sig}")


RULES_ONLY = {"model_alerts": False}  # the rules layer alone (`--rules-only`)
WITH_MODEL = {"model_alerts": True}  # the model's alerts beside the rules


def pooled_targets(set_name: str, predictor: FailurePredictor, cache: Path, rules_only: bool = False,
                   verbose: bool = True) -> dict[str, Any]:
    """All issue-16 targets pooled over a set, from stored hop scores (memory-light: works on
    the 512-GPU x 21-day trace), with 95% confidence intervals: Wilson for recall, precision
    and the hot-but-healthy share, an exact Poisson upper bound for false alarms."""

    policy = replace(predictor.policy, **(RULES_ONLY if rules_only else WITH_MODEL))
    tot = dict.fromkeys(("long_c", "long_n", "pre_c", "pre_n", "call_c", "call_n", "all_c", "all_n", "true",
                         "false", "hot_f", "hot_n", "fails"), 0)
    gpu_days = 0.0
    by_class: dict[str, list[int]] = {}
    for spec in SETS[set_name]:
        scores, labels = score_hops(spec, predictor, cache)
        m, preds = replay_policy(scores, labels, predictor, policy)
        if verbose:
            explain_scores(spec.name, scores, m, preds, predictor)
        tot["long_c"] += m["recall_long_precursor_12h"]["caught"]
        tot["long_n"] += m["recall_long_precursor_12h"]["n"]
        tot["pre_c"] += m["recall_with_precursor_30min"]["caught"]
        tot["pre_n"] += m["recall_with_precursor_30min"]["n"]
        # Precursors visible for less than the lead plus one hop cannot be called 30 min ahead
        # by any hop-based detector: the figure beside the target says how much of the miss that is.
        callable_rows = [r for r in m["failure_rows"]
                         if r["precursor_h"] is not None and r["precursor_h"] >= CALLABLE_PRECURSOR_H]
        tot["call_n"] += len(callable_rows)
        tot["call_c"] += sum(1 for r in callable_rows if (r["lead_h"] or 0.0) >= 0.5)
        for r in m["failure_rows"]:
            if r["precursor_h"] is None:
                continue
            c = by_class.setdefault(r["class"], [0, 0, 0, 0, 0])  # n, short, @30 min, long n, long @12 h
            c[0] += 1
            c[1] += r["precursor_h"] < CALLABLE_PRECURSOR_H
            c[2] += (r["lead_h"] or 0.0) >= 0.5
            c[3] += r["precursor_h"] >= 18.0
            c[4] += r["precursor_h"] >= 18.0 and (r["lead_h"] or 0.0) >= 12.0
        tot["all_c"] += m["recall_all_30min"]["caught"]
        tot["all_n"] += m["recall_all_30min"]["n"]
        tot["true"] += m["true_alerts"]
        tot["false"] += m["false_alerts"]
        tot["fails"] += m["failures"]
        hot_n = m["hot_healthy_gpus"]
        tot["hot_n"] += hot_n
        tot["hot_f"] += round((m["hot_healthy_flagged_share"] or 0.0) * hot_n)
        gpu_days += scores.gpu_days
        if verbose:
            lp, wp = m["recall_long_precursor_12h"], m["recall_with_precursor_30min"]
            print(f"  {spec.name}: {scores.gpu_days:.0f} GPU-days, {m['failures']} failures; long@12h "
                  f"{_rec(lp['caught'], lp['n'])}; precursor@30m {_rec(wp['caught'], wp['n'])}; "
                  f"precision {_rec(m['true_alerts'], m['true_alerts'] + m['false_alerts'])}; "
                  f"false {m['false_alerts']}; hot flagged {m['hot_healthy_flagged_share']}", flush=True)
    if verbose:
        print("  by class (failures with a precursor): " + "; ".join(
            f"{cls} {c[2]}/{c[0]} @30 min ({c[1]} shorter than {CALLABLE_PRECURSOR_H * 60:.0f} min), "
            f"{c[4]}/{c[3]} long @12 h" for cls, c in sorted(by_class.items())), flush=True)
    eps = tot["true"] + tot["false"]
    out = {
        "set": set_name, "policy": "rules only" if rules_only else "model + rules", "gpu_days": gpu_days,
        "failures": tot["fails"],
        "recall_long_12h": (tot["long_c"], tot["long_n"], wilson(tot["long_c"], tot["long_n"])),
        "recall_precursor_30min": (tot["pre_c"], tot["pre_n"], wilson(tot["pre_c"], tot["pre_n"])),
        "recall_callable_30min": (tot["call_c"], tot["call_n"], wilson(tot["call_c"], tot["call_n"])),
        "recall_all_30min": (tot["all_c"], tot["all_n"], wilson(tot["all_c"], tot["all_n"])),
        "precision": (tot["true"], eps, wilson(tot["true"], eps)),
        "false_alarms": tot["false"],
        "fa_per_1000_gpu_days": tot["false"] / gpu_days * 1000 if gpu_days else None,
        "fa_upper95_per_1000_gpu_days": poisson_upper(tot["false"]) / gpu_days * 1000 if gpu_days else None,
        "hot_flagged": (tot["hot_f"], tot["hot_n"], wilson(tot["hot_f"], tot["hot_n"])),
    }
    return out


def targets_row(t: dict[str, Any]) -> str:
    """One markdown table row of `pooled_targets`."""
    def frac(v: tuple) -> str:
        k, n, (lo, hi) = v
        return f"{k / n:.2f} ({k}/{n}) [{lo:.2f}-{hi:.2f}]" if n else "-"
    return (f"| {t['set']} | {t['policy']} | {t['gpu_days']:.0f} | {t['failures']} | "
            f"{frac(t['recall_long_12h'])} | {frac(t['recall_precursor_30min'])} | "
            f"{frac(t['recall_callable_30min'])} | {frac(t['precision'])} | "
            f"{t['fa_per_1000_gpu_days']:.2f} ({t['false_alarms']}) "
            f"[<= {t['fa_upper95_per_1000_gpu_days']:.2f}] | {frac(t['hot_flagged'])} |")


TARGETS_HEADER = ("| set | alerts from | GPU-days | failures | recall, precursor >= 18 h @ 12 h | "
                  "recall, any precursor @ 30 min | recall, precursor >= 40 min @ 30 min | "
                  "precision (episodes) | false alarms / 1,000 GPU-days (n) [95% upper] | "
                  "hot-but-healthy flagged |\n"
                  "|---|---|---|---|---|---|---|---|---|---|")
CALLABLE_PRECURSOR_H = 0.5 + 600.0 / 3600.0  # the 30-min lead plus one 10-min feature hop


def _rec(caught: int, n: int) -> str:
    return f"{caught / n:.2f} ({caught}/{n})" if n else "-"


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion k/n."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def explain(spec: TraceSpec, metrics: dict, table: FeatureTable | None, preds: list, probs: Any) -> None:
    """Print every miss (with the highest probability it reached) and every false alarm (signals)."""
    rows_by_key: dict[tuple[str, int], np.ndarray] = {}
    keys = np.array([f"{n}/{g}" for n, g in table.keys]) if table is not None else np.array([])
    for f in metrics["failure_rows"] if table is not None else ():
        pre = f["precursor_h"]
        ok = f["lead_h"] is not None and f["lead_h"] >= (LEAD_12H if (pre or 0) >= 18 else LEAD_30MIN_H)
        if ok or pre is None:
            continue
        k = f"{f['node']}/{f['gpu']}"
        idx = rows_by_key.setdefault(k, np.flatnonzero(keys == k))
        near = idx[(table.ts[idx] <= f["ts"]) & (table.ts[idx] > f["ts"] - 48 * 3600)]
        pmax = float(probs[near].max()) if len(near) else float("nan")
        # hours before the failure at which p first reached 0.5
        hit = near[probs[near] >= 0.5]
        first = (f["ts"] - table.ts[hit[0]]) / 3600 if len(hit) else None
        print(f"  MISS {spec.name} {f['class']:18s} {k:14s} precursor {pre:6.1f} h lead "
              f"{f['lead_h'] if f['lead_h'] is None else round(f['lead_h'], 1)} pmax48h {pmax:.2f} "
              f"p>=.5 first at {None if first is None else round(first, 1)} h")
    first_pred: dict[tuple[str, float], Any] = {}
    for p in preds:
        if p.alert:
            first_pred.setdefault((f"{p.node}/{p.gpu}", p.ts), p)
    for fa in metrics["false_alert_list"]:
        p = first_pred.get((f"{fa['node']}/{fa['gpu']}", fa["raised_ts"]))
        sig = ", ".join(f"{s.name}={s.value}" for s in (p.signals if p else [])[:5])
        prob = f"{p.probability:.2f}" if p else "-"
        print(f"  FALSE {spec.name} {fa['node']}/{fa['gpu']} at {fa['raised_ts']:.0f} p={prob}: {sig}")


# Policies as `--policy` specs 'hi,k,k_memory,hi_memory': the general rule, and the memory tier
# (off where it equals the general rule).
POLICY_GRID = [f"{hi},{k},{km},{him}" for hi in (0.9, 0.95, 0.97) for k in (3, 4, 6)
               for km, him in [(k, hi)] + [(km, him) for him in (0.5, 0.6, 0.7, 0.8)
                                           for km in (12, 18, 24, 36)]]


def tune(sets: list[str], predictor: FailurePredictor, cache: Path, grid: list[str] | None = None) -> None:
    """Sweep the alert policy on the tuning sets (val: recall and precision at a raised
    failure rate; fa-val: false alarms at the published rate); print the trade-offs."""

    data = {name: [score_hops(spec, predictor, cache) for spec in SETS[name]] for name in sets}
    cols = ["hi", "k", "k memory", "hi memory"]
    for name in sets:
        cols += [f"{name} long@12h", f"{name} precursor@30m", f"{name} precision", f"{name} FA/1k GPU-d"]
    print(" | ".join(cols))
    for spec in grid or POLICY_GRID:
        pol = policy_from_spec(spec, predictor.policy)
        cells = [f"{pol.hi:g}", str(pol.k_raise), str(pol.k_raise_memory), f"{pol.hi_memory:g}"]
        for name in sets:
            tot = np.zeros(6)
            gd = 0.0
            for scores, labels in data[name]:
                m, _ = replay_policy(scores, labels, predictor, pol)
                tot += [m["recall_long_precursor_12h"]["caught"], m["recall_long_precursor_12h"]["n"],
                        m["recall_with_precursor_30min"]["caught"], m["recall_with_precursor_30min"]["n"],
                        m["true_alerts"], m["false_alerts"]]
                gd += scores.gpu_days
            cells += [_rec(int(tot[0]), int(tot[1])), _rec(int(tot[2]), int(tot[3])),
                      _rec(int(tot[4]), int(tot[4] + tot[5])), f"{tot[5] / gd * 1000:.2f} ({int(tot[5])})"]
        print(" | ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="val,test", help="comma-separated: val, test, fa")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/fleetwise-eval"))
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--explain", action="store_true", help="list every miss and false alarm")
    ap.add_argument("--policy", default=None,
                    help="override the alert policy: 'hi,k,k_memory[,hi_memory]' (lo = hi/2)")
    ap.add_argument("--only", default=None, help="comma-separated trace names (e.g. fa-401)")
    ap.add_argument("--stagger-hops", action="store_true",
                    help="evaluate on staggered hops (fleetwise worker/replay --stagger-hops)")
    ap.add_argument("--tune", action="store_true",
                    help="sweep the alert policy on the tuning sets (--tune-sets, default val,fa-val)")
    ap.add_argument("--tune-sets", default="val,fa-val")
    ap.add_argument("--targets", default=None,
                    help="pooled issue-16 targets with 95%% CIs per set (e.g. test,shifted), model and "
                    "rules-only, from stored hop scores")
    ap.add_argument("--grid", default=None,
                    help="policies to sweep: 'hi,k,k_memory[,hi_memory];...' (default POLICY_GRID)")
    ap.add_argument("--policy-set", default=None,
                    help="other AlertPolicy fields for every policy run or swept, "
                    "e.g. 'rearm_hops=1008,m_clear=12'")
    args = ap.parse_args()
    global STAGGER_HOPS
    STAGGER_HOPS = args.stagger_hops
    predictor = FailurePredictor.load(args.model_dir)
    # This bench measures the model: its alerts on, beside the rules, whatever the model's stored
    # policy says (`--targets` reports the rules alone too).
    predictor = FailurePredictor(predictor.model, replace(predictor.policy, **WITH_MODEL))
    if args.policy:
        predictor = FailurePredictor(predictor.model, policy_from_spec(args.policy, predictor.policy))
    if args.policy_set:
        fields = {f.name for f in dataclasses.fields(AlertPolicy)}
        extra: dict[str, Any] = {}
        for item in args.policy_set.split(","):
            name, _, value = item.partition("=")
            if name not in fields:
                ap.error(f"--policy-set: AlertPolicy has no field {name!r}; fields: {sorted(fields)}")
            kind = type(getattr(predictor.policy, name))
            if kind is bool and value.lower() not in ("true", "false"):
                ap.error(f"--policy-set: {name} is true or false, got {value!r}")
            extra[name] = value.lower() == "true" if kind is bool else kind(value)
        predictor = FailurePredictor(predictor.model, replace(predictor.policy, **extra))
    if args.targets:
        print(TARGETS_HEADER)
        for set_name in args.targets.split(","):
            for rules_only in (False, True):
                t = pooled_targets(set_name, predictor, args.cache, rules_only=rules_only,
                                   verbose=args.explain)
                print(targets_row(t), flush=True)
        return
    if args.tune:
        grid = None
        if args.grid:
            grid = args.grid.split(";")
        tune(args.tune_sets.split(","), predictor, args.cache, grid)
        return
    meta = predictor.model.metadata
    print(f"model {meta.get('version')}: {meta.get('training_command')}")
    print(f"policy {predictor.policy}; {len(predictor.model.feature_names)} model features")
    for set_name in args.sets.split(","):
        pooled: dict[str, list[int]] = {}
        gpu_days = 0.0
        false_alerts = 0
        print(f"\n== {set_name} ==")
        header = ("trace", "GPU-days", "fail", "long>=18h @12h", "precursor @30m", "abrupt @30m",
                  "precision", "FA/1k GPU-d", "hot flagged", "AUPRC", "lead p10/med/p90 h", "cpu s")
        print(" | ".join(header))
        for spec in SETS[set_name]:
            if args.only and spec.name not in args.only.split(","):
                continue
            t0 = time.process_time()
            if set_name.startswith("fa"):  # too large for a full feature table
                metrics, table, preds, probs = evaluate_stream(spec, predictor)
            else:
                metrics, table, preds, probs = evaluate(spec, predictor, args.cache)
            cpu = time.process_time() - t0
            f = metrics
            for name in ("recall_long_precursor_12h", "recall_with_precursor_30min", "recall_abrupt_30min"):
                acc = pooled.setdefault(name, [0, 0])
                acc[0] += f[name]["caught"]
                acc[1] += f[name]["n"]
            for name in ("true_alerts", "false_alerts"):
                pooled.setdefault(name, [0])[0] += f[name]
            gpu_days += f["gpu_days"]
            false_alerts += f["false_alerts"]
            hot = f"{f['hot_healthy_flagged_share'] or 0:.2f} of {f['hot_healthy_gpus']}"
            lt = f["lead_time_h"]
            lead = "/".join("-" if lt[k] is None else f"{lt[k]:.1f}" for k in ("p10", "median", "p90"))
            print(" | ".join([
                spec.name, f"{f['gpu_days']:.0f}", str(f["failures"]),
                _rec(f["recall_long_precursor_12h"]["caught"], f["recall_long_precursor_12h"]["n"]),
                _rec(f["recall_with_precursor_30min"]["caught"], f["recall_with_precursor_30min"]["n"]),
                _rec(f["recall_abrupt_30min"]["caught"], f["recall_abrupt_30min"]["n"]),
                _rec(f["true_alerts"], f["true_alerts"] + f["false_alerts"]),
                f"{f['false_alarms_per_1000_gpu_days']:.2f} ({f['false_alerts']})", hot,
                "-" if f["auprc"] is None else f"{f['auprc']:.2f}", lead, f"{cpu:.0f}",
            ]))
            by_class = {c: f"{d['caught']}/{d['n']}" for c, d in f["recall_by_class_30min"].items()}
            by_class12 = {c: f"{d['caught']}" for c, d in f["recall_by_class_12h"].items()}
            print("    long precursors (>= 18 h) not visible >= 18 h in the trace: "
                  f"{f['long_precursor_not_visible']}")
            print("    by class, caught >=30 min / >=12 h of n: "
                  + ", ".join(f"{c} {by_class[c]} / {by_class12[c]}" for c in by_class))
            if args.explain:
                explain(spec, metrics, table, preds, probs)
        lp, wp, ab = (pooled[k] for k in ("recall_long_precursor_12h", "recall_with_precursor_30min",
                                          "recall_abrupt_30min"))
        ta, ae = pooled["true_alerts"][0], pooled["true_alerts"][0] + pooled["false_alerts"][0]
        fa_rate = false_alerts / gpu_days * 1000
        print(f"pooled {set_name}: {gpu_days:.0f} GPU-days; recall long>=18h @12h {_rec(*lp)} "
              f"[95% CI {wilson(*lp)[0]:.2f}-{wilson(*lp)[1]:.2f}]; precursor @30min {_rec(*wp)} "
              f"[{wilson(*wp)[0]:.2f}-{wilson(*wp)[1]:.2f}]; abrupt @30min {_rec(*ab)}; "
              f"precision {_rec(ta, ae)}; false alarms {false_alerts} = {fa_rate:.3f} per 1,000 GPU-days "
              f"(95% upper bound {poisson_upper(false_alerts) / gpu_days * 1000:.3f})")


if __name__ == "__main__":
    main()
