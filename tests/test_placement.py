"""Placement (fleetwise/planner/placement.py, docs/placement.md): exactness against brute force,
hard constraints under random fleets (hypothesis), the cross-site rule, outputs and the CLI."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from fleetwise.cli import app
from fleetwise.planner.placement import (
    PRESETS,
    TERMS,
    FleetIndex,
    GpuState,
    PlacementError,
    PlacementSettings,
    carbon_intensity,
    choose_gpus,
    parse_weights,
    place_job,
    placement_envelope,
    pool_models,
    rack_power_w,
    selection_cost,
    telemetry_from_samples,
)
from fleetwise.schemas import GpuInventory, JobIntent, ModelShape, Nic, NodeInventory

TINY = ModelShape(name="tiny", layers=4, hidden=256, heads=4, seq_len=256, vocab=1000)
TYPES = ("h100-sxm", "a100-sxm-80gb", "b200")


def intent(n: int, job: str = "j", **constraints) -> JobIntent:
    return JobIntent(job=job, model=TINY, global_batch=16, constraints={"max_gpus": n, **constraints})


def random_fleet(rng: random.Random, max_gpus_per_node: int = 4) -> list[NodeInventory]:
    """1-2 sites, 1-3 racks each, 1-2 nodes per rack, 2-4 GPUs per node of one of two types,
    sometimes explicit NVLink groups, NIC speeds, rack budgets and shared power domains."""
    invs = []
    types = rng.sample(TYPES, 2)
    for s in range(rng.randint(1, 2)):
        racks = rng.randint(1, 3)
        shared_domain = rng.random() < 0.3
        for r in range(racks):
            rack = f"s{s}r{r}"
            budget = rng.choice([None, rng.uniform(500.0, 4500.0)])
            domain = f"s{s}pd" if shared_domain else rack
            for k in range(rng.randint(1, 2)):
                count = rng.randint(2, max_gpus_per_node)
                nvl = [[0, 1], list(range(2, count))] if count > 2 and rng.random() < 0.5 else []
                nvl = [g for g in nvl if g]
                speed = rng.choice([100.0, 200.0, 400.0])
                nics = [Nic(name="ib0", speed_gbps=speed)] if rng.random() < 0.7 else []
                invs.append(NodeInventory(
                    ts=0, node=f"{rack}n{k}", rack=rack, site=f"site{s}", rack_power_budget_w=budget,
                    gpus=[GpuInventory(index=i, model=types[(s + r + k) % 2]) for i in range(count)],
                    nvlink_groups=nvl, nics=nics, labels={"power_domain": domain},
                ))
    return invs


def random_telemetry(rng: random.Random, invs: list[NodeInventory], job: str = "j") -> dict:
    out = {}
    for inv in invs:
        for g in inv.gpus:
            if rng.random() < 0.15:
                continue  # no reading
            owner = rng.choices([None, "other", job], weights=[6, 2, 1])[0]
            out[(inv.node, g.index)] = GpuState(
                util_pct=rng.uniform(0, 100) if rng.random() < 0.9 else None,
                temp_c=rng.uniform(25, 95) if rng.random() < 0.9 else None,
                power_w=rng.uniform(40, 700) if rng.random() < 0.7 else None,
                job=owner, slowdown_c=rng.choice([None, 90.0]), ts=1.0,
            )
    return out


def random_settings(rng: random.Random, tel: dict, n: int) -> PlacementSettings:
    current = sorted(k for k, s in tel.items() if s.job == "j")
    preset = rng.choice(sorted(PRESETS))
    weights = {t: rng.choice([PRESETS[preset][t], rng.uniform(0, 2)]) for t in TERMS}
    return PlacementSettings(
        weights=weights, preset="random", max_rack_share=rng.choice([0.34, 0.5, 0.75, 1.0]),
        max_domain_share=rng.choice([None, 0.5, 1.0]), current=current,
        current_step_s=rng.choice([None, 0.01, 1.0]), remaining_s=rng.choice([60.0, 3600.0, 86400.0]),
        carbon={"site0": rng.uniform(10, 800)}, min_planned=1, max_planned=50,
    )


# ---- brute force ---------------------------------------------------------------------------------


def stated_rack_ok(
    index: FleetIndex, pool, tel: dict, chosen: tuple, share_cap: int, domain_cap: int,
) -> bool:
    """The documented hard constraints, computed here from the inventory and telemetry:
    <= share cap per rack, <= domain cap per power domain, and per rack with a budget the
    power now + k x TDP - (the k least powers now of the pool's candidates there) <= budget."""
    racks = Counter(index.node_of(k).rack for k in chosen)
    domains = Counter(index.node_of(k).domain for k in chosen)
    if any(c > share_cap for c in racks.values()) or any(c > domain_cap for c in domains.values()):
        return False
    for rack, k in racks.items():
        budget = index.rack_budget[rack]
        if budget is None:
            continue
        now = 0.0
        cands = []
        for node in index.rack_nodes[rack]:
            for slot in index.nodes[node].slots:
                s = tel.get(slot.key)
                w = s.power_w if s is not None and s.power_w is not None else (
                    slot.spec.tdp_w if s is not None and s.job not in (None, "j") else 0.0)
                now += w
                if slot.key in pool.unit:
                    cands.append(w)
        if now + k * pool.spec.tdp_w - sum(sorted(cands)[:k]) > budget + 1e-9:
            return False
    return True


def brute_force(index: FleetIndex, pool, tel: dict) -> float:
    best = math.inf
    for chosen in itertools.combinations(sorted(pool.keys), pool.n):
        if stated_rack_ok(index, pool, tel, chosen, pool.share_cap, pool.domain_cap):
            best = min(best, selection_cost(pool, list(chosen), index))
    return best


def test_gpu_choice_is_the_true_minimum_over_every_subset():
    """>= 100 seeded random pools with a feasible choice (and the infeasible ones met on the way):
    the DP's GPUs cost exactly the minimum over all feasible subsets."""
    cases = feasible = 0
    seed = 0
    while feasible < 100 and seed < 2000:
        rng = random.Random(seed)
        seed += 1
        invs = random_fleet(rng)
        index = FleetIndex(invs)
        tel = random_telemetry(rng, invs)
        n = rng.randint(1, 4)
        pools, _ = pool_models(intent(n), index, tel, random_settings(rng, tel, n))
        for pool in pools:
            if math.comb(len(pool.keys), n) > 3000:
                continue
            cases += 1
            got, chosen = choose_gpus(pool, index)
            want = brute_force(index, pool, tel)
            if math.isinf(want):
                assert chosen == [] and math.isinf(got), f"seed {seed - 1}: infeasible pool got {chosen}"
                continue
            feasible += 1
            assert len(set(chosen)) == n
            assert stated_rack_ok(index, pool, tel, tuple(chosen), pool.share_cap, pool.domain_cap)
            assert selection_cost(pool, chosen, index) == pytest.approx(got, rel=1e-9, abs=1e-12)
            assert got == pytest.approx(want, rel=1e-9, abs=1e-12), f"seed {seed - 1}"
    assert feasible >= 100 and cases > feasible  # both outcomes are exercised


def test_ranking_is_the_minimum_over_all_pools_and_pruning_is_safe():
    """>= 100 seeded fleets: with branch and bound the first option's total equals the least
    total when every pool is planned; the estimate never exceeds the planner's step."""
    checked = 0
    for seed in range(400):
        rng = random.Random(1000 + seed)
        invs = random_fleet(rng)
        tel = random_telemetry(rng, invs)
        n = rng.randint(1, 4)
        base = random_settings(rng, tel, n)
        base.min_planned, base.max_planned = 1, 50
        every = PlacementSettings(**{**base.__dict__, "min_planned": 50, "max_planned": 50})
        job = intent(n)
        try:
            pruned = place_job(job, invs, tel, base)
            full = place_job(job, invs, tel, every)
        except PlacementError:
            continue
        planned = [o for o in full.options if o.step_source == "planner"]
        if not planned:
            assert not [o for o in pruned.options if o.step_source == "planner"]
            continue
        checked += 1
        assert pruned.optimal and full.optimal
        assert pruned.options[0].step_source == "planner"
        assert pruned.options[0].total == pytest.approx(min(o.total for o in planned), rel=1e-9)
        for o in planned:
            assert sum(o.weighted.values()) == pytest.approx(o.total)
            assert o.weighted == pytest.approx({t: full.weights[t] * o.terms[t] for t in TERMS})
        # every planned pool's step is at least its estimate (what makes the pruning safe)
        pools = {(p.site, p.spec.id): p for p in pool_models(job, FleetIndex(invs), tel, every)[0]}
        for o in planned:
            assert pools[(o.site, o.gpu_type)].step_est_s <= o.step_s * (1 + 1e-9)
        if checked >= 110:
            break
    assert checked >= 100


def test_comm_and_latency_terms_match_a_pairwise_sum():
    rng = random.Random(7)
    for _ in range(20):
        invs = random_fleet(rng)
        index = FleetIndex(invs)
        tel = random_telemetry(rng, invs)
        res = place_job(intent(3), index, tel, PlacementSettings(min_planned=1, max_planned=20))
        pools = {(p.site, p.spec.id): p for p in pool_models(intent(3), index, tel)[0]}
        for opt in res.options:
            pool = pools[(opt.site, opt.gpu_type)]
            pairs = [pool.level_d(a, b, index) for a, b in itertools.combinations(opt.gpus, 2)]
            assert opt.terms["comm"] == pytest.approx(sum(p[0] for p in pairs))
            assert opt.terms["latency"] == pytest.approx(sum(p[1] for p in pairs))


# ---- hard constraints (hypothesis) ---------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**9), n=st.integers(1, 6), share=st.sampled_from([0.2, 0.34, 0.5, 1.0]),
       dshare=st.sampled_from([None, 0.5, 1.0]))
def test_no_option_breaks_a_power_budget_or_a_failure_domain_share(seed, n, share, dshare):
    rng = random.Random(seed)
    invs = random_fleet(rng, max_gpus_per_node=8)
    index = FleetIndex(invs)
    tel = random_telemetry(rng, invs)
    s = PlacementSettings(max_rack_share=share, max_domain_share=dshare, min_planned=1, max_planned=4,
                          current=sorted(k for k, v in tel.items() if v.job == "j"), current_step_s=1.0)
    try:
        res = place_job(intent(n), index, tel, s)
    except PlacementError:
        return
    rack_cap = max(1, math.floor(share * n + 1e-9))
    dom_cap = max(1, math.floor((dshare or share) * n + 1e-9))
    for opt in res.options:
        assert len(opt.gpus) == len(set(opt.gpus)) == n
        assert all(tel.get(k) is None or tel[k].job in (None, "j") for k in opt.gpus), "a busy GPU was chosen"
        racks = Counter(index.node_of(k).rack for k in opt.gpus)
        domains = Counter(index.node_of(k).domain for k in opt.gpus)
        assert max(racks.values()) <= rack_cap and max(domains.values()) <= dom_cap
        assert {index.node_of(k).site for k in opt.gpus} == {opt.site}
        for rack in racks:
            budget = index.rack_budget[rack]
            if budget is not None:
                # exact power under the plan: chosen GPUs at TDP, every other GPU at its power now
                assert rack_power_w(index, rack, opt.gpus, tel, "j") <= budget + 1e-6


# ---- behaviour -----------------------------------------------------------------------------------


def two_site_fleet(budget: float | None = None) -> list[NodeInventory]:
    invs = []
    for site, model in (("east", "a100-sxm-80gb"), ("west", "b200")):
        for r in range(2):
            for k in range(2):
                invs.append(NodeInventory(
                    ts=0, node=f"{site}-r{r}-n{k}", rack=f"{site}-r{r}", site=site,
                    rack_power_budget_w=budget,
                    gpus=[GpuInventory(index=i, model=model) for i in range(8)],
                    nics=[Nic(name="ib0", speed_gbps=400.0)],
                ))
    return invs


def test_cross_site_move_only_when_the_gain_pays_for_the_transfer():
    invs = two_site_fleet()
    job = JobIntent(job="big", model=ModelShape(name="m", layers=32, hidden=4096, heads=32, seq_len=2048),
                    global_batch=256, constraints={"max_gpus": 8})
    current = [("east-r0-n0", i) for i in range(8)]
    # the job's own utilisation is not load against staying
    tel = {k: GpuState(util_pct=95, power_w=380, job="big") for k in current}
    long = place_job(job, invs, tel, PlacementSettings(current=current, remaining_s=7 * 86400.0))
    assert long.options[0].site == "west" and long.options[0].cross_site  # b200s pay back in a week
    # 5 minutes left: even an infinitely fast destination saves < the 300 s restart
    short = place_job(job, invs, tel, PlacementSettings(current=current, remaining_s=300.0))
    assert all(o.site == "east" for o in short.options)
    assert any("cross-site move does not pay" in r["reason"] for r in short.rejected)
    # with the default rack share (<= 4 of 8 per rack) half the job must move inside the site,
    # and the half that stays is on GPUs it runs on now
    east = short.options[0]
    assert east.terms["move"] > 0 and {k for k in east.gpus if k[0].startswith("east-r0")} <= set(current)
    # when one rack may hold it all, staying put costs no move and wins
    stay = PlacementSettings(current=current, remaining_s=300.0, max_rack_share=1.0)
    whole = place_job(job, invs, tel, stay)
    assert set(whole.options[0].gpus) == set(current) and whole.options[0].terms["move"] == 0.0


def test_rack_budget_spreads_the_job_and_racks_never_exceed_it():
    invs = two_site_fleet(budget=4 * 700.0 + 1.0)  # room for 4 A100s (400 W) ... but not 8 B200s
    res = place_job(intent(8, gpu_types=["a100-sxm-80gb"]), invs, None, PlacementSettings(max_rack_share=1.0))
    best = res.options[0]
    for power, budget in best.rack_power.values():
        assert power <= budget
    assert len(best.racks) >= 2 or max(best.racks.values()) * 400.0 <= 2801.0


def test_busy_and_hot_gpus_are_avoided_and_carbon_moves_batch_jobs():
    invs = two_site_fleet()
    job = JobIntent(job="b", model=TINY, global_batch=16, workload="batch", constraints={"max_gpus": 4})
    tel = {("east-r0-n0", i): GpuState(job="other", power_w=400) for i in range(8)}
    tel.update({("east-r0-n1", i): GpuState(temp_c=86.0, util_pct=80) for i in range(8)})
    weights = {**PRESETS["compute-dense"], "compute": 0.0}
    res = place_job(job, invs, tel, PlacementSettings(weights=weights, max_rack_share=1.0,
                                                      carbon={"east": 20.0, "west": 900.0}))
    east = [o for o in res.options if o.site == "east"][0]
    assert not {k for k in east.gpus if k[0] in ("east-r0-n0", "east-r0-n1")}
    assert res.options[0].site == "east"  # clean power wins when compute is not weighted
    dirty = place_job(job, invs, tel, PlacementSettings(weights=weights, max_rack_share=1.0,
                                                        carbon={"east": 900.0, "west": 20.0}))
    assert dirty.options[0].site == "west"


def test_presets_and_weight_overrides():
    assert parse_weights(None, "batch") == ("compute-dense", PRESETS["compute-dense"])
    preset, w = parse_weights("latency-bound,carbon=2", "training")
    assert preset == "latency-bound" and w["carbon"] == 2.0
    assert w["latency"] == PRESETS["latency-bound"]["latency"]
    for bad, msg in (("fast", "unknown preset"), ("speed=1", "unknown term"), ("comm=x", "not a number"),
                     ("comm=-1", ">= 0")):
        with pytest.raises(PlacementError, match=msg):
            parse_weights(bad)


def test_carbon_series_is_averaged_over_the_window():
    series = [(0.0, 100.0), (3600.0, 300.0)]
    assert carbon_intensity(series, 0.0, 7200.0) == pytest.approx(200.0)
    assert carbon_intensity(series, -3600.0, 3600.0) == pytest.approx(100.0)  # before the first point
    assert carbon_intensity(series, 5000.0, 0.0) == 300.0
    with pytest.raises(PlacementError, match="now_ts"):
        carbon_intensity(series, None, 60.0, "x")


def test_telemetry_keeps_the_latest_sample():
    rows = [{"ts": 2, "node": "a", "gpu": 0, "model": "h100-sxm", "metrics": {"DCGM_FI_DEV_GPU_TEMP": 70.0}},
            {"ts": 1, "node": "a", "gpu": 0, "model": "h100-sxm", "metrics": {"DCGM_FI_DEV_GPU_TEMP": 50.0}}]
    assert telemetry_from_samples(rows)[("a", 0)].temp_c == 70.0


def test_bad_input_names_the_field():
    invs = two_site_fleet()
    with pytest.raises(PlacementError, match="max_gpus"):
        place_job(JobIntent(job="x", model=TINY, global_batch=8), invs)
    with pytest.raises(PlacementError, match="constraints.gpu_types.0"):
        place_job(intent(4, gpu_types=["h900"]), invs)
    with pytest.raises(PlacementError, match="carbon: site 'mars'"):
        place_job(intent(4), invs, None, PlacementSettings(carbon={"mars": 1.0}))
    with pytest.raises(PlacementError, match="max_rack_share"):
        place_job(intent(4), invs, None, PlacementSettings(max_rack_share=0.0))
    odd = NodeInventory(ts=0, node="odd", rack="east-r0", site="west",
                        gpus=[GpuInventory(index=0, model="b200")])
    bad = [*invs, odd]
    with pytest.raises(PlacementError, match="rack 'east-r0' has site"):
        FleetIndex(bad)


def test_envelope_pins_pods_to_the_chosen_nodes():
    res = place_job(intent(16), two_site_fleet())
    best = res.options[0]
    env = placement_envelope(best, "j", "research")
    assert env["gpus"] == len(best.plan.ranks) and env["pod_group"]["spec"]["queue"] == "research"
    nodes = {r.node for r in best.plan.ranks}
    assert nodes <= {k[0] for k in best.gpus}
    hosts = set()
    for tmpl in env["pod_templates"]:
        term = tmpl["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        hosts |= set(term["nodeSelectorTerms"][0]["matchExpressions"][0]["values"])
    assert hosts == nodes and env["placement"]["site"] == best.site
    json.dumps(env)


# ---- CLI -----------------------------------------------------------------------------------------


@pytest.fixture()
def files(tmp_path):
    fleet = tmp_path / "fleet.jsonl"
    fleet.write_text("\n".join(inv.to_json() for inv in two_site_fleet(budget=20000.0)) + "\n")
    job = tmp_path / "job.yaml"
    job.write_text("job: demo\nmodel: gpt-1.3b\nglobal_batch: 64\nconstraints:\n  max_gpus: 8\n")
    trace = tmp_path / "trace.jsonl"
    rows = [{"ts": 10, "node": "west-r0-n0", "gpu": i, "model": "b200", "job": "other",
             "metrics": {"DCGM_FI_DEV_POWER_USAGE": 900.0}} for i in range(8)]
    rows.append({"ts": 10, "job": "demo", "rank": 0, "node": "east-r0-n0", "gpu": 0, "step": 1,
                 "step_time_s": 1.0, "compute_s": 0.9})
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return tmp_path, fleet, job, trace


def run(*args: str):
    return CliRunner().invoke(app, ["place", *args])


def test_cli_table_and_json(files):
    _, fleet, job, trace = files
    out = run(str(job), "--fleet", str(fleet), "--telemetry", str(trace))
    assert out.exit_code == 0, out.output
    assert "placement of demo on 8 GPUs" in out.stdout and "best:" in out.stdout
    data = json.loads(run(str(job), "--fleet", str(fleet), "--telemetry", str(trace), "--json",
                          "--weights", "compute-dense,carbon=3", "--carbon", "east=50").stdout)
    assert data["preset"] == "compute-dense" and data["weights"]["carbon"] == 3.0
    first = data["options"][0]
    assert set(first["terms"]) == set(TERMS) and first["rank"] == 1 and len(first["gpus"]) == 8
    assert not [g for g in first["gpus"] if g.startswith("west-r0-n0/")]  # busy with another job
    kai = json.loads(run(str(job), "--fleet", str(fleet), "--kai", "--queue", "q").stdout)
    assert kai["pod_group"]["spec"]["queue"] == "q" and kai["gpus"] == 8


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["job"].write_text("job: demo\nmodel: gpt-1.3b\nglobal_batch: 0\n"), "global_batch"),
    (lambda d: d["job"].write_text("job: [\n"), "not valid YAML"),
    (lambda d: d["fleet"].write_text('{"ts": 0, "node": "n"}\n'), "gpus"),
    (lambda d: d["fleet"].write_text("not json\n"), "line 1 is not valid JSON"),
    (lambda d: d["trace"].write_text('{"ts": 0, "node": "n", "gpu": -1, "model": "b200"}\n'), "gpu"),
])
def test_cli_bad_input_is_a_clear_error(files, mutate, message):
    _, fleet, job, trace = files
    mutate({"job": job, "fleet": fleet, "trace": trace})
    out = run(str(job), "--fleet", str(fleet), "--telemetry", str(trace))
    assert out.exit_code == 2 and "Traceback" not in out.output
    assert message in " ".join(out.stderr.split()), out.stderr


def test_cli_bad_options(files):
    _, fleet, job, _ = files
    for args, message in ((["--weights", "nope"], "unknown preset"), (["--carbon", "east"], "SITE=GRAMS"),
                          (["--max-rack-share", "2"], "max_rack_share"), (["--gpus", "999"], "max_gpus")):
        out = run(str(job), "--fleet", str(fleet), *args)
        assert out.exit_code == 2, (args, out.output)
        assert message in " ".join(out.stderr.split()), (args, out.stderr)
    out = run(str(job), "--fleet", str(fleet.parent / "missing.jsonl"))
    assert out.exit_code == 2 and "--fleet" in out.stderr


def test_cli_help():
    out = run("--help")
    assert out.exit_code == 0 and "--fleet" in out.stdout and "--weights" in out.stdout


def test_thermal_term_weighs_how_hot_a_gpu_runs_at_full_power():
    """An idle GPU in a hot aisle reads cool now; where a job lands it runs at full power, so
    the GPUs' temperature at full power (their own fit), when known, decides the thermal term."""
    invs = [inv for inv in two_site_fleet() if inv.site == "east"]
    job = intent(8, gpu_types=["a100-sxm-80gb"])
    # r0's GPUs idle and cool now but 84 C at full power; r1's warmer now (busy a moment ago)
    # but 62 C at full power.
    tel = {(f"east-r{r}-n{k}", i): GpuState(temp_c=now, full_power_c=full)
           for r, now, full in ((0, 32.0, 84.0), (1, 55.0, 62.0)) for k in range(2) for i in range(8)}
    weights = {**PRESETS["compute-dense"], "thermal": 5.0}
    best = place_job(job, invs, tel, PlacementSettings(weights=weights, max_rack_share=1.0)).options[0]
    assert {k[0] for k in best.gpus} <= {"east-r1-n0", "east-r1-n1"}
    # Without the full-power figures the temperature now decides: the other rack.
    now_only = {k: GpuState(temp_c=s.temp_c) for k, s in tel.items()}
    best = place_job(job, invs, now_only, PlacementSettings(weights=weights, max_rack_share=1.0)).options[0]
    assert {k[0] for k in best.gpus} <= {"east-r0-n0", "east-r0-n1"}


def test_cli_weighs_the_full_power_temperature_of_feature_records(files):
    """Feature records in --telemetry (as `replay --features` writes them) give each GPU's
    temperature at full power: the hot-aisle rack loses the thermal term though idle and cool now."""
    tmp, fleet, _, _ = files
    job = tmp / "a100.yaml"
    job.write_text("job: demo\nmodel: gpt-1.3b\nglobal_batch: 64\n"
                   "constraints:\n  max_gpus: 8\n  gpu_types: [a100-sxm-80gb]\n")

    def best_racks(hot: str) -> set[str]:
        trace = tmp / f"features-{hot}.jsonl"
        rows = [{"kind": "features", "scope": "gpu", "ts": 600.0 * h, "window_s": 600.0,
                 "node": f"east-{r}-n{k}", "gpu": i,
                 "values": {"temp_at_tdp_c": (84.0 if r == hot else 62.0) if h else 70.0, "util_mean": 0.0}}
                for h in range(2) for r in ("r0", "r1") for k in range(2) for i in range(8)]
        trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        out = run(str(job), "--fleet", str(fleet), "--telemetry", str(trace), "--json",
                  "--max-rack-share", "1", "--weights", "compute-dense,thermal=5")
        assert out.exit_code == 0, out.output
        return {g.split("/")[0].rsplit("-", 1)[0] for g in json.loads(out.stdout)["options"][0]["gpus"]}

    assert best_racks("r0") == {"east-r1"}  # the latest record of each GPU counts, not the first
    assert best_racks("r1") == {"east-r0"}
