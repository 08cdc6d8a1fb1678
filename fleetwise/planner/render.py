"""Readable views of a `Plan`: a rich table, a text summary, and a PNG plot.

`plan_table` shows one row per GPU, or for plans over `GROUP_ABOVE_RANKS` ranks one row per
group of identical GPUs (same GPU model, stage, layers and micro-batch) with a count, so the
terminal stays readable at 1,000 GPUs. `plan_figure` draws the per-GPU work and the pipeline
schedule (1F1B) of the plan with matplotlib's Agg backend.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from rich import box
from rich.table import Table

from fleetwise.schemas import Plan, RankPlan

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["GROUP_ABOVE_RANKS", "plan_summary", "plan_table", "plan_figure", "rank_ranges", "simulate_1f1b"]

GROUP_ABOVE_RANKS = 64


def rank_ranges(ranks: Iterable[int]) -> str:
    """Compact rank list: [0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    values = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(parts)


def _layers(rank: RankPlan) -> str:
    first, last = rank.layers
    return f"{first}-{last}" if last != first else str(first)


def _memory(used: float, capacity: float) -> str:
    return f"{used:.0f}/{capacity:.0f}"


def plan_table(plan: Plan, group: bool | None = None) -> Table:
    """Per-GPU table of the plan; grouped by identical GPUs when `group` (default: > 64 ranks)."""
    if group is None:
        group = len(plan.ranks) > GROUP_ABOVE_RANKS
    title = f"{plan.job}: {plan.model or 'model'} on {len(plan.ranks)} GPUs"
    table = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True)
    if group:
        table.add_column("ranks", overflow="fold", min_width=7, max_width=20)
        table.add_column("GPUs", justify="right", no_wrap=True, min_width=4)
    else:
        table.add_column("rank", justify="right", no_wrap=True, min_width=4)
        table.add_column("node:gpu", no_wrap=True, min_width=8)
    table.add_column("model", no_wrap=True, min_width=5)
    table.add_column("TFLOP/s", justify="right", no_wrap=True, min_width=7)
    table.add_column("mb x n", justify="right", no_wrap=True, min_width=6)
    table.add_column("dp", justify="right", overflow="fold", min_width=2, max_width=12)
    table.add_column("stage", justify="right", no_wrap=True, min_width=5)
    table.add_column("layers", justify="right", no_wrap=True, min_width=6)
    table.add_column("mem GB", justify="right", no_wrap=True, min_width=6)
    table.caption = "mb x n: micro-batch x micro-batches per step; mem GB: used/available"

    ranks = sorted(plan.ranks, key=lambda r: r.rank)
    if not group:
        for r in ranks:
            table.add_row(
                str(r.rank),
                f"{r.node}:{r.gpu}",
                r.model,
                f"{r.capability_tflops:.0f}",
                f"{r.micro_batch} x {r.num_micro_batches}",
                str(r.dp_rank),
                str(r.stage),
                _layers(r),
                _memory(r.memory_gb, r.memory_capacity_gb),
            )
        return table

    groups: dict[tuple[Any, ...], list[RankPlan]] = defaultdict(list)
    for r in ranks:
        key = (r.model, r.stage, r.layers, r.micro_batch, r.num_micro_batches, round(r.capability_tflops, 1))
        groups[key].append(r)
    for members in sorted(groups.values(), key=lambda m: m[0].rank):
        first = members[0]
        used = max(m.memory_gb for m in members)
        table.add_row(
            rank_ranges(m.rank for m in members),
            str(len(members)),
            first.model,
            f"{first.capability_tflops:.0f}",
            f"{first.micro_batch} x {first.num_micro_batches}",
            rank_ranges(m.dp_rank for m in members),
            str(first.stage),
            _layers(first),
            _memory(used, first.memory_capacity_gb),
        )
    return table


def plan_summary(plan: Plan) -> str:
    """A few lines: fleet, parallelism, batch, and what the cost model predicts."""
    fleet = Counter(r.model for r in plan.ranks)
    fleet_text = " + ".join(f"{n} x {model}" for model, n in sorted(fleet.items()))
    samples = sorted({r.samples for r in plan.ranks})
    share = (
        f"{samples[0]} per replica"
        if len(samples) == 1
        else f"{samples[0]}-{samples[-1]} per replica (uneven)"
    )
    lines = [
        f"plan for {plan.job} ({plan.model or 'model'}, {plan.dtype}) on {fleet_text}",
        f"  parallelism  DP={plan.dp} TP={plan.tp} PP={plan.pp} ZeRO={plan.zero_stage}"
        f" recompute={plan.recompute}" + (" +SP" if plan.sequence_parallel else ""),
        f"  batch        {plan.global_batch} x {plan.seq_len} tokens; {share}",
        f"  predicted    step {plan.predicted_step_s:.3f} s, {plan.tokens_per_s:,.0f} tokens/s,"
        f" MFU {plan.mfu:.1%}",
    ]
    if plan.uniform_step_s is not None and plan.speedup is not None:
        lines.append(
            f"  uniform      step {plan.uniform_step_s:.3f} s (equal shares on the same GPUs):"
            f" speedup {plan.speedup:.2f}x"
        )
    lines.extend(f"  note         {note}" for note in plan.notes)
    return "\n".join(lines)


# ---- pipeline schedule -----------------------------------------------------------------------

# Backward pass costs about twice the forward (two matmuls per forward one: grads w.r.t.
# inputs and weights), the 1:2 split behind the 6N-FLOPs-per-token rule (arXiv 2104.04473).
BACKWARD_OVER_FORWARD = 2.0


def simulate_1f1b(
    forward_s: Sequence[float], micro_batches: int, backward_s: Sequence[float] | None = None
) -> list[list[tuple[str, int, float, float]]]:
    """Event times of a 1F1B pipeline (PipeDream-Flush / Megatron's default schedule).

    Stage s runs min(p - s - 1, m) warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards. F(s, j) waits for F(s-1, j); B(s, j)
    waits for B(s+1, j). Returns per stage a list of (kind "F"/"B", micro-batch, start, end).
    """
    p, m = len(forward_s), micro_batches
    if backward_s is None:
        backward_s = [f * BACKWARD_OVER_FORWARD for f in forward_s]
    orders: list[list[tuple[str, int]]] = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        order = [("F", j) for j in range(warmup)]
        f_next, b_next = warmup, 0
        while f_next < m:
            order.append(("F", f_next))
            f_next += 1
            order.append(("B", b_next))
            b_next += 1
        order.extend(("B", j) for j in range(b_next, m))
        orders.append(order)
    done: dict[tuple[str, int, int], float] = {}
    events: list[list[tuple[str, int, float, float]]] = [[] for _ in range(p)]
    position = [0] * p
    clock = [0.0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while position[s] < len(orders[s]):
                kind, j = orders[s][position[s]]
                dep = ("F", s - 1, j) if kind == "F" and s > 0 else ("B", s + 1, j) if kind == "B" else None
                if kind == "B" and s == p - 1:
                    dep = ("F", s, j)
                if dep is not None and dep not in done:
                    break
                start = max(clock[s], done.get(dep, 0.0) if dep else 0.0)
                end = start + (forward_s[s] if kind == "F" else backward_s[s])
                done[(kind, s, j)] = end
                events[s].append((kind, j, start, end))
                clock[s] = end
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the 1F1B order above never deadlocks
            raise RuntimeError("1F1B schedule deadlocked")
    return events


def _stage_compute(plan: Plan, timeline: list[dict[str, Any]] | None) -> dict[int, dict[int, float]]:
    """Busy seconds per (dp_rank, stage) over all micro-batches: the planner timeline's
    compute_s + comm_s (TP collectives and stage sends) when given, else proportional work
    samples x layers / capability (relative units)."""
    out: dict[int, dict[int, float]] = defaultdict(dict)
    if timeline:
        for row in timeline:
            busy = float(row.get("compute_s", 0.0) or 0.0) + float(row.get("comm_s", 0.0) or 0.0)
            out[int(row["dp_rank"])][int(row["stage"])] = busy
        return out
    for r in plan.ranks:
        work = _work(r)
        out[r.dp_rank][r.stage] = max(out[r.dp_rank].get(r.stage, 0.0), work)
    return out


def _work(r: RankPlan) -> float:
    layers = r.layers[1] - r.layers[0] + 1
    return r.samples * layers / r.capability_tflops if r.capability_tflops > 0 else 0.0


def plan_figure(plan: Plan, timeline: list[dict[str, Any]] | None, max_replicas: int = 4) -> Figure:
    """The plan as a figure: per-GPU work bars (top) and the pipeline schedule per replica
    (bottom). Callers save it (`fig.savefig(path)`); this module does no I/O.

    Work = samples x layers / capability: equal bars mean a balanced plan. The schedule is
    a 1F1B Gantt per shown data-parallel replica (the slowest and fastest when there are
    more than `max_replicas`), built from `plan_timeline`'s compute_s + comm_s per
    (dp_rank, stage), with its sync_s (gradient synchronisation + optimizer step) hatched.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted(plan.ranks, key=lambda r: r.rank)
    models = sorted({r.model for r in ranks})
    palette = plt.get_cmap("tab10")
    color_of = {m: palette(i % 10) for i, m in enumerate(models)}

    compute = _stage_compute(plan, timeline)
    sync: dict[tuple[int, int], float] = {}
    if timeline:
        for row in timeline:
            sync[(int(row["dp_rank"]), int(row["stage"]))] = float(row.get("sync_s", 0.0) or 0.0)
    replica_total = {dp: sum(stages.values()) for dp, stages in compute.items()}
    order = sorted(replica_total, key=lambda dp: -replica_total[dp])
    if len(order) > max_replicas:
        shown = sorted({*order[: max(1, max_replicas - 1)], order[-1]})
    else:
        shown = sorted(order)
    mbs_of = {r.dp_rank: max(1, r.num_micro_batches) for r in ranks}
    model_of = {(r.dp_rank, r.stage): r.model for r in ranks}

    rows = len(shown) * plan.pp
    fig_height = 3.2 + max(2.0, 0.35 * rows)
    fig, (ax_work, ax_gantt) = plt.subplots(
        2, 1, figsize=(12, fig_height), gridspec_kw={"height_ratios": [3.2, max(2.0, 0.35 * rows)]}
    )

    # Per-GPU work bars.
    works = [_work(r) for r in ranks]
    peak = max(works) if works and max(works) > 0 else 1.0
    ax_work.bar(
        range(len(ranks)),
        [w / peak for w in works],
        color=[color_of[r.model] for r in ranks],
        width=0.85 if len(ranks) <= 128 else 1.0,
    )
    ax_work.set_xlim(-0.6, len(ranks) - 0.4)
    ax_work.set_ylim(0, 1.12)
    ax_work.set_xlabel("rank")
    ax_work.set_ylabel("work / max")
    ax_work.set_title(
        f"{plan.job}: work per GPU = samples x layers / capability (DP={plan.dp} TP={plan.tp} PP={plan.pp}, "
        f"step {plan.predicted_step_s:.3f} s"
        + (f", {plan.speedup:.2f}x vs uniform" if plan.speedup else "")
        + ")",
        fontsize=10,
    )
    ax_work.legend(
        handles=[Patch(color=color_of[m], label=m) for m in models], loc="lower right", fontsize=8
    )

    # Pipeline Gantt.
    labels = []
    y = 0
    for dp in shown:
        stages = compute.get(dp, {})
        m = mbs_of.get(dp, 1)
        per_stage = [stages.get(s, 0.0) for s in range(plan.pp)]
        # Busy time covers forward + backward of all micro-batches.
        forward = [c / (m * (1 + BACKWARD_OVER_FORWARD)) for c in per_stage]
        events = simulate_1f1b(forward, m)
        for s in range(plan.pp):
            color = color_of.get(model_of.get((dp, s), models[0]), "grey")
            for kind, _j, start, end in events[s]:
                ax_gantt.barh(
                    y,
                    end - start,
                    left=start,
                    height=0.8,
                    color=color,
                    alpha=1.0 if kind == "F" else 0.55,
                    edgecolor="white",
                    linewidth=0.3 if m <= 16 else 0.0,
                )
            finish = events[s][-1][3] if events[s] else 0.0
            tail = sync.get((dp, s), 0.0)
            if tail > 0:
                ax_gantt.barh(y, tail, left=finish, height=0.8, color="none", edgecolor="black", hatch="///")
            labels.append(f"dp{dp} stage{s}")
            y += 1
    ax_gantt.set_yticks(range(len(labels)))
    ax_gantt.set_yticklabels(labels, fontsize=8)
    ax_gantt.invert_yaxis()
    unit = "s" if timeline else "relative time"
    ax_gantt.set_xlabel(unit)
    hidden = ""
    if len(shown) < len(order):
        hidden = f" ({len(shown)} of {len(order)} replicas: slowest and fastest)"
    ax_gantt.set_title(
        f"1F1B pipeline schedule per replica{hidden}: "
        "dark = forward, light = backward, hatched = gradient sync + optimizer",
        fontsize=10,
    )
    fig.tight_layout()
    return fig
