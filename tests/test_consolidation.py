"""Consolidation and hibernation: rails hold on random fleets, savings add up, ids are stable."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetwise.actuators.consolidation import (
    DEFAULT_GCO2_PER_KWH,
    ConsolidationConfig,
    ConsolidationError,
    FleetSnapshot,
    JobState,
    NodeState,
    PendingJob,
    UtilSample,
    gpu_efficiency,
    nodes_from_inventory,
    plan_consolidation,
    sustained_low_nodes,
)
from fleetwise.catalog import lookup
from fleetwise.schemas import Command, NodeInventory

NOW = 1764547200.0
WINDOW = 3600.0
# (model, GPUs per node): mixed generations, different node sizes.
SHAPES = (("h100-sxm", 8), ("a100-sxm-80gb", 8), ("l40s", 4), ("h200", 8))


def samples_for(nodes, util_of, start=NOW - WINDOW - 120, step=60.0, end=NOW):
    """One sample per GPU per ``step`` seconds; ``util_of(node, gpu, ts)`` gives the value."""
    out = []
    t = start
    while t <= end:
        for n in nodes:
            if n.hibernating:
                continue
            for g in n.gpus:
                out.append(UtilSample(t, n.node, g, util_of(n.node, g, t)))
        t += step
    return tuple(out)


@st.composite
def fleets(draw):
    """A random mixed fleet with jobs placed on free GPUs, budgets loose or tight, and samples."""
    n_nodes = draw(st.integers(2, 9))
    n_racks = draw(st.integers(1, 4))
    nodes = []
    for i in range(n_nodes):
        model, size = SHAPES[draw(st.integers(0, len(SHAPES) - 1))]
        nodes.append(
            NodeState(
                node=f"n{i:02d}", rack=f"r{draw(st.integers(0, n_racks - 1))}", model=model,
                gpus=tuple(range(size)), site=f"s{i % 2}",
                hibernating=draw(st.booleans()) if i >= n_nodes - 2 else False,
            )
        )
    free = {n.node: list(n.gpus) for n in nodes if not n.hibernating}
    jobs, util = [], {}
    for j in range(draw(st.integers(0, 12))):
        size = draw(st.sampled_from([1, 1, 2, 4]))
        together = size > 1 and draw(st.booleans())
        if together:
            hosts = [n for n, f in free.items() if len(f) >= size]
            if not hosts:
                continue
            host = draw(st.sampled_from(sorted(hosts)))
            gpus = tuple((host, free[host].pop(0)) for _ in range(size))
        else:
            pool = sorted((n, g) for n, f in free.items() for g in f)
            if len(pool) < size:
                continue
            gpus = tuple(draw(st.lists(st.sampled_from(pool), min_size=size, max_size=size, unique=True)))
            for n, g in gpus:
                free[n].remove(g)
        u = draw(st.floats(0.05, 0.95))
        for g in gpus:
            util[g] = u
        jobs.append(
            JobState(
                job=f"j{j}", gpus=gpus, group_size=size if together else 1,
                movable=draw(st.booleans()) or draw(st.booleans()),
            )
        )
    racks = sorted({n.rack for n in nodes})
    budgets = {}
    for r in racks:
        if draw(st.booleans()):
            budgets[r] = draw(st.floats(1500.0, 30000.0))
    pending = tuple(
        PendingJob(f"q{k}", gpus=draw(st.sampled_from([1, 4, 8, 24, 48])), group_size=1)
        for k in range(draw(st.integers(0, 2)))
    )
    snap = FleetSnapshot(
        ts=NOW, nodes=tuple(nodes), jobs=tuple(jobs), rack_power_budget_w=budgets,
        samples=samples_for(nodes, lambda n, g, t: util.get((n, g), 0.0)), pending=pending,
    )
    cfg = ConsolidationConfig(
        low_util_threshold=draw(st.sampled_from([0.3, 0.6, 1.0])),
        max_moves=draw(st.integers(0, 8)),
        rack_share=draw(st.sampled_from([0.25, 0.5, 1.0])),
        spare_nodes=draw(st.integers(0, 1)),
        gco2_per_kwh={"s0": 50.0},
        pue=draw(st.sampled_from([1.0, 1.3])),
    )
    return snap, cfg, util


def final_placement(snap, plan):
    loc = {j.job: list(j.gpus) for j in snap.jobs}
    for m in plan.moves:
        for rank, src, dst in m.moves:
            assert loc[m.job][rank] == src, "a move's source is where the job's rank is"
            loc[m.job][rank] = dst
    return loc


def gpu_watts(spec, util):
    idle = spec.tdp_w * 0.10
    return idle + util * (spec.tdp_w - idle)


def cap(spec):
    return spec.capability_tflops("bf16" if spec.supports("bf16") else "fp16")


def power_by_rack_and_site(snap, util, loc, awake):
    """Independent power model (docs/consolidation.md): idle + utilisation x (TDP - idle)."""
    nodes = {n.node: n for n in snap.nodes}
    rack, site = Counter(), Counter()
    for name in awake:
        n = nodes[name]
        w = len(n.gpus) * lookup(n.model).tdp_w * 0.10
        rack[n.rack] += w
        site[n.site] += w
    for j in snap.jobs:
        for src, dst in zip(j.gpus, loc[j.job], strict=True):
            s, d = lookup(nodes[src[0]].model), lookup(nodes[dst[0]].model)
            u = min(1.0, util[src] * cap(s) / cap(d))
            extra = gpu_watts(d, u) - d.tdp_w * 0.10
            rack[nodes[dst[0]].rack] += extra
            site[nodes[dst[0]].site] += extra
    return rack, site


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets())
def test_plans_keep_every_rail_and_their_savings_add_up(case):
    snap, cfg, util = case
    plan = plan_consolidation(snap, cfg)
    nodes = {n.node: n for n in snap.nodes}
    loc = final_placement(snap, plan)
    hibernated = {a.node for a in plan.hibernate}
    woken = {a.node for a in plan.wake}
    awake_before = {n.node for n in snap.nodes if not n.hibernating}
    awake_after = (awake_before - hibernated) | woken

    # No GPU double-booked; every job GPU is in service on a node that stays awake.
    held = [g for gpus in loc.values() for g in gpus]
    assert len(held) == len(set(held))
    for node, gpu in held:
        assert node in awake_after and gpu in nodes[node].gpus
    # Moves: only jobs that may move, at most max_moves of them, one command each, off low nodes.
    assert len(plan.moves) <= cfg.max_moves
    assert len({m.job for m in plan.moves}) == len(plan.moves)
    jobs = {j.job: j for j in snap.jobs}
    for m in plan.moves:
        assert jobs[m.job].movable
        assert all(src[0] in plan.low_nodes for _, src, _ in m.moves)
    # Only low nodes hibernate, and only when nothing is left on them; only sleepers wake.
    assert hibernated <= set(plan.low_nodes)
    assert not any(node in hibernated for node, _ in held)
    assert all(nodes[n].hibernating for n in woken)

    # Failure domain: a moved job never gains GPUs in a rack beyond its share (or its old count).
    for m in plan.moves:
        j = jobs[m.job]
        limit = max(j.group_size, math.floor(cfg.rack_share * len(j.gpus) + 1e-9))
        before = Counter(nodes[n].rack for n, _ in j.gpus)
        after = Counter(nodes[n].rack for n, _ in loc[m.job])
        for rack, count in after.items():
            assert count <= max(limit, before[rack]), (m.job, rack, count, limit)
    # NVLink: a group that needs one domain and had it keeps it (node-wide domain here).
    for j in snap.jobs:
        for first in range(0, len(j.gpus), j.group_size):
            group = range(first, min(first + j.group_size, len(j.gpus)))
            if j.group_size > 1 and len({j.gpus[r][0] for r in group}) == 1:
                assert len({loc[j.job][r][0] for r in group}) == 1

    # Power: no rack ends above its budget unless it was above it already and did not grow.
    rack_before, site_before = power_by_rack_and_site(snap, util, {j.job: list(j.gpus) for j in snap.jobs},
                                                      awake_before)
    rack_after, site_after = power_by_rack_and_site(snap, util, loc, awake_before - hibernated)
    for rack, budget in snap.rack_power_budget_w.items():
        if any(d[0] in nodes and nodes[d[0]].rack == rack for m in plan.moves for _, _, d in m.moves):
            assert rack_after[rack] <= max(budget, rack_before[rack]) + 1e-6
        assert plan.rack_power_w[rack] == pytest.approx(
            rack_after[rack] + sum(len(nodes[n].gpus) * lookup(nodes[n].model).tdp_w * 0.10
                                   for n in woken if nodes[n].rack == rack), abs=1e-6)
    for n in woken:
        budget = snap.rack_power_budget_w.get(nodes[n].rack)
        assert budget is None or plan.rack_power_w[nodes[n].rack] <= budget + 1e-6

    # Savings are the difference of the two power states, and the other figures follow from it.
    s = plan.savings
    wake_w = sum(len(nodes[n].gpus) * lookup(nodes[n].model).tdp_w * 0.10 for n in woken)
    assert s.before_w == pytest.approx(sum(site_before.values()), abs=1e-6)
    assert s.after_w == pytest.approx(sum(site_after.values()) + wake_w, abs=1e-6)
    assert s.watts_saved == pytest.approx(s.before_w - s.after_w, abs=1e-6)
    assert s.gpu_hours_saved == pytest.approx(
        (sum(len(nodes[n].gpus) for n in hibernated) - sum(len(nodes[n].gpus) for n in woken)) * cfg.horizon_h
    )
    assert s.energy_kwh_saved == pytest.approx(s.watts_saved * cfg.pue * cfg.horizon_h / 1000)
    intensity = {"s0": 50.0, "s1": DEFAULT_GCO2_PER_KWH}
    assert s.gco2_saved == pytest.approx(
        sum(w * cfg.pue * cfg.horizon_h / 1000 * intensity[k] for k, w in s.watts_saved_by_site.items()),
        abs=1e-6,
    )
    assert plan.active_nodes_after == len(awake_after)

    # Commands: one per move, hibernation and wake; unsigned; stable ids across runs.
    assert all(isinstance(c, Command) and c.type == "consolidate" and not c.signature for c in plan.commands)
    assert len(plan.commands) == len(plan.moves) + len(plan.hibernate) + len(plan.wake)
    assert len({c.id for c in plan.commands}) == len(plan.commands)
    again = plan_consolidation(snap, cfg)
    assert [c.id for c in again.commands] == [c.id for c in plan.commands]


def uniform_fleet(n_nodes=4, model="h100-sxm", racks=2, hibernating=()):
    return tuple(
        NodeState(f"n{i}", f"r{i % racks}", model, tuple(range(8)), hibernating=f"n{i}" in hibernating)
        for i in range(n_nodes)
    )


def test_scattered_low_load_is_packed_and_emptied_nodes_hibernate():
    nodes = uniform_fleet(4, racks=1)
    jobs = tuple(JobState(f"j{i}", ((f"n{i}", 0),)) for i in range(4))
    samples = samples_for(nodes, lambda n, g, t: 0.4 if g == 0 else 0.0)
    plan = plan_consolidation(FleetSnapshot(NOW, nodes, jobs, samples=samples))
    assert plan.active_nodes_after == 1 and len(plan.hibernate) == 3 and len(plan.moves) == 3
    spec = lookup("h100-sxm")
    assert plan.savings.watts_saved == pytest.approx(3 * 8 * spec.tdp_w * 0.10)
    assert plan.savings.gpu_hours_saved == 24 * 24
    hib = next(c for c in plan.commands if c.params["action"] == "hibernate")
    move_ids = {c.id for c in plan.commands if c.params["action"] == "move"}
    assert hib.requires and set(hib.requires) <= move_ids  # hibernate after its jobs left


def test_work_goes_to_the_more_efficient_generation():
    nodes = (NodeState("old", "r0", "a100-sxm-80gb", tuple(range(8))), NodeState("new", "r0", "h100-sxm",
                                                                                  tuple(range(8))))
    assert gpu_efficiency("h100-sxm") > gpu_efficiency("a100-sxm-80gb")
    jobs = (JobState("a", (("old", 0),)), JobState("b", (("new", 0),)))
    samples = samples_for(nodes, lambda n, g, t: 0.3 if g == 0 else 0.0)
    plan = plan_consolidation(FleetSnapshot(NOW, nodes, jobs, samples=samples))
    assert [a.node for a in plan.hibernate] == ["old"]
    assert plan.moves[0].moves[0][2][0] == "new"


def test_busy_job_does_not_move_to_a_weaker_gpu():
    nodes = (NodeState("big", "r0", "h100-sxm", (0, 1)), NodeState("small", "r0", "a100-sxm-80gb",
                                                                  tuple(range(8))))
    jobs = (JobState("hot", (("big", 0),)),)
    samples = samples_for(nodes, lambda n, g, t: 0.9 if (n, g) == ("big", 0) else 0.0)
    plan = plan_consolidation(FleetSnapshot(NOW, nodes, jobs, samples=samples),
                              ConsolidationConfig(low_util_threshold=1.0))
    assert not any(m.job == "hot" for m in plan.moves)  # 0.9 x H100 exceeds an A100
    assert [a.node for a in plan.hibernate] == ["small"]


def test_power_budget_blocks_a_move_that_would_exceed_it():
    nodes = uniform_fleet(2, racks=2)
    jobs = (JobState("j", (("n0", 0),)), JobState("k", (("n1", 0),)))
    samples = samples_for(nodes, lambda n, g, t: 0.9 if g == 0 else 0.0)
    idle = 8 * 70.0
    loose = plan_consolidation(FleetSnapshot(NOW, nodes, jobs, samples=samples),
                               ConsolidationConfig(low_util_threshold=1.0))
    assert len(loose.hibernate) == 1
    # Each rack can hold its own node's load but not one more busy GPU.
    budgets = {"r0": idle + 0.9 * 630 + 100, "r1": idle + 0.9 * 630 + 100}
    tight = plan_consolidation(FleetSnapshot(NOW, nodes, jobs, budgets, samples=samples),
                               ConsolidationConfig(low_util_threshold=1.0))
    assert tight.moves == () and tight.hibernate == ()


def test_failure_domain_share_and_nvlink_group_are_respected():
    nodes = uniform_fleet(3, racks=3)
    # A 2-GPU data-parallel job across racks may not land both GPUs in one rack at share 0.5.
    spread = JobState("dp", (("n0", 0), ("n1", 0)))
    samples = samples_for(nodes, lambda n, g, t: 0.2 if g == 0 else 0.0)
    plan = plan_consolidation(FleetSnapshot(NOW, nodes, (spread,), samples=samples))
    assert plan.moves == ()
    plan = plan_consolidation(FleetSnapshot(NOW, nodes, (spread,), samples=samples),
                              ConsolidationConfig(rack_share=1.0))
    assert len(plan.moves) == 1
    # A tensor-parallel group of 4 on one NVLink domain moves as one piece or not at all.
    nvl = tuple(NodeState(f"m{i}", "r0", "h100-nvl", tuple(range(4)), nvlink_groups=((0, 1), (2, 3)))
                for i in range(2))
    tp = JobState("tp", (("m0", 0), ("m0", 1)), group_size=2)
    other = JobState("x", (("m1", 0),))
    samples = samples_for(nvl, lambda n, g, t: 0.2 if (n, g) in {("m0", 0), ("m0", 1), ("m1", 0)} else 0.0)
    plan = plan_consolidation(FleetSnapshot(NOW, nvl, (tp, other), samples=samples))
    loc = final_placement(FleetSnapshot(NOW, nvl, (tp, other)), plan)
    node = {n.node: n for n in nvl}
    a, b = loc["tp"]
    assert a[0] == b[0] and any({a[1], b[1]} <= set(grp) for grp in node[a[0]].nvlink_groups)
    assert len(plan.hibernate) == 1


def test_move_cap_limits_jobs_moved():
    nodes = uniform_fleet(6, racks=1)
    jobs = tuple(JobState(f"j{i}", ((f"n{i}", 0),)) for i in range(6))
    samples = samples_for(nodes, lambda n, g, t: 0.4 if g == 0 else 0.0)
    cfg = ConsolidationConfig(max_moves=2)
    plan = plan_consolidation(FleetSnapshot(NOW, nodes, jobs, samples=samples), cfg)
    assert len(plan.moves) == 2 and len(plan.hibernate) == 2


def test_queued_work_wakes_hibernating_nodes_only_when_free_capacity_is_short():
    nodes = uniform_fleet(3, racks=1, hibernating=("n1", "n2"))
    jobs = (JobState("run", tuple(("n0", g) for g in range(6))),)
    samples = samples_for(nodes, lambda n, g, t: 0.8 if g < 6 else 0.0)
    fits = plan_consolidation(FleetSnapshot(NOW, nodes, jobs, samples=samples, pending=(PendingJob("q", 2),)))
    assert fits.wake == () and fits.unplaced_pending == ()
    short = FleetSnapshot(NOW, nodes, jobs, samples=samples, pending=(PendingJob("q", 8, group_size=8),))
    plan = plan_consolidation(short)
    assert len(plan.wake) == 1 and plan.unplaced_pending == ()
    assert plan.savings.gpu_hours_saved == -8 * 24  # waking costs powered GPU-hours
    assert plan.savings.watts_saved < 0
    wake = next(c for c in plan.commands if c.params["action"] == "wake")
    assert wake.params["for"] == ["q"] and wake.node == plan.wake[0].node
    # Too much queued work for every node: wake what helps, report the rest.
    huge = FleetSnapshot(NOW, nodes, jobs, samples=samples,
                         pending=(PendingJob("q", 8, group_size=8), PendingJob("r", 8, group_size=8),
                                  PendingJob("s", 8, group_size=8)))
    plan = plan_consolidation(huge)
    assert len(plan.wake) == 2 and len(plan.unplaced_pending) == 1
    # A rack budget that cannot take a woken node at full power keeps it asleep.
    plan = plan_consolidation(FleetSnapshot(NOW, nodes, jobs, {"r0": 6000.0}, samples=samples,
                                            pending=short.pending))
    assert plan.wake == () and plan.unplaced_pending == ("q",)


def test_queued_work_keeps_an_emptied_node_awake_instead_of_hibernating_it():
    nodes = uniform_fleet(2, racks=1)
    jobs = (JobState("a", (("n0", 0),)), JobState("b", (("n1", 0),)))
    samples = samples_for(nodes, lambda n, g, t: 0.3 if g == 0 else 0.0)
    plan = plan_consolidation(FleetSnapshot(NOW, nodes, jobs, samples=samples,
                                            pending=(PendingJob("q", 8, group_size=8),)))
    assert len(plan.moves) == 1 and plan.hibernate == () and len(plan.kept_awake) == 1


def test_only_sustained_low_utilisation_counts():
    nodes = uniform_fleet(3, racks=1)
    cfg = ConsolidationConfig(low_util_threshold=0.3, window_s=WINDOW)
    steady = samples_for(nodes, lambda n, g, t: 0.1)
    assert set(sustained_low_nodes(steady, nodes, NOW, cfg)) == {"n0", "n1", "n2"}
    # A 10-minute burst inside the window on n0 disqualifies it.
    burst = samples_for(nodes, lambda n, g, t: 0.9 if n == "n0" and NOW - 1800 < t < NOW - 1200 else 0.1)
    assert set(sustained_low_nodes(burst, nodes, NOW, cfg)) == {"n1", "n2"}
    # The same burst before the window does not.
    early = samples_for(nodes, lambda n, g, t: 0.9 if n == "n0" and t < NOW - WINDOW - 600 else 0.1,
                        start=NOW - WINDOW - 1200)
    assert set(sustained_low_nodes(early, nodes, NOW, cfg)) == {"n0", "n1", "n2"}
    # Too short a history, a hole, or stale samples: not known to be low.
    short = samples_for(nodes, lambda n, g, t: 0.1, start=NOW - 1800)
    assert sustained_low_nodes(short, nodes, NOW, cfg) == {}
    holed = tuple(s for s in steady if not (s.node == "n1" and NOW - 2000 < s.ts < NOW - 1000))
    assert set(sustained_low_nodes(holed, nodes, NOW, cfg)) == {"n0", "n2"}
    stale = samples_for(nodes, lambda n, g, t: 0.1, end=NOW - 900)
    assert sustained_low_nodes(stale, nodes, NOW, cfg) == {}
    # A node that is not known to be low is never emptied.
    jobs = (JobState("a", (("n1", 0),)),)
    plan = plan_consolidation(FleetSnapshot(NOW, nodes, jobs, samples=holed))
    assert "n1" not in {a.node for a in plan.hibernate} and plan.moves == ()


def test_ids_are_stable_and_change_with_the_decision():
    nodes = uniform_fleet(4, racks=1)
    jobs = tuple(JobState(f"j{i}", ((f"n{i}", 0),)) for i in range(4))
    samples = samples_for(nodes, lambda n, g, t: 0.4 if g == 0 else 0.0)
    snap = FleetSnapshot(NOW, nodes, jobs, samples=samples)
    first = [c.id for c in plan_consolidation(snap).commands]
    assert first == [c.id for c in plan_consolidation(snap).commands]
    later = FleetSnapshot(NOW + 600, nodes, jobs, samples=samples_for(
        nodes, lambda n, g, t: 0.4 if g == 0 else 0.0, end=NOW + 600))
    assert set(first).isdisjoint(c.id for c in plan_consolidation(later).commands)
    dry = plan_consolidation(snap, ConsolidationConfig(dry_run=True))
    assert all(c.dry_run for c in dry.commands)


def test_bad_input_names_the_field():
    nodes = uniform_fleet(2)
    with pytest.raises(ConsolidationError, match=r"jobs\[0\]\.gpus\[0\]: n9/gpu0"):
        plan_consolidation(FleetSnapshot(NOW, nodes, (JobState("a", (("n9", 0),)),)))
    with pytest.raises(ConsolidationError, match=r"jobs\[1\]\.gpus\[0\]: n0/gpu0 already held by job 'a'"):
        twice = (JobState("a", (("n0", 0),)), JobState("b", (("n0", 0),)))
        plan_consolidation(FleetSnapshot(NOW, nodes, twice))
    with pytest.raises(ConsolidationError, match=r"nodes\[0\]\.model: unknown GPU"):
        plan_consolidation(FleetSnapshot(NOW, (NodeState("x", "r", "h900", (0,)),)))
    with pytest.raises(ConsolidationError, match=r"rack_power_budget_w\['r0'\]"):
        plan_consolidation(FleetSnapshot(NOW, nodes, rack_power_budget_w={"r0": 0.0}))
    with pytest.raises(ConsolidationError, match=r"samples\[0\]\.util=55"):
        plan_consolidation(FleetSnapshot(NOW, nodes, samples=(UtilSample(NOW, "n0", 0, 55.0),)))
    with pytest.raises(ConsolidationError, match=r"config\.rack_share"):
        ConsolidationConfig(rack_share=0)
    with pytest.raises(ConsolidationError, match=r"pending\[0\]"):
        plan_consolidation(FleetSnapshot(NOW, nodes, pending=(PendingJob("q", 3, group_size=2),)))


def test_nodes_from_inventory():
    inv = [
        NodeInventory.model_validate({
            "ts": NOW, "node": "a", "rack": "r1", "site": "eu", "rack_power_budget_w": 30000,
            "gpus": [{"index": i, "model": "NVIDIA H100 80GB HBM3"} for i in range(8)],
            "nvlink_groups": [list(range(8))],
        }),
        NodeInventory.model_validate({"ts": NOW, "node": "b", "gpus": [{"index": 0, "model": "l4"}]}),
    ]
    nodes, budgets = nodes_from_inventory(inv, hibernating=["b"], out_of_service=[("a", 3)])
    assert budgets == {"r1": 30000}
    a, b = nodes
    assert a.rack == "r1" and a.site == "eu" and 3 not in a.gpus and len(a.gpus) == 7
    assert b.rack == "b" and b.hibernating
    mixed = NodeInventory.model_validate({"ts": NOW, "node": "m", "gpus": [
        {"index": 0, "model": "l4"}, {"index": 1, "model": "h100-sxm"}]})
    with pytest.raises(ConsolidationError, match="mixes models"):
        nodes_from_inventory([mixed])
