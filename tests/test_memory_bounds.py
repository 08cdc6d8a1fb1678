"""Long-lived containers of the stream worker stay bounded over long runs (issue 17, item 4).

A worker runs for weeks: any per-key structure that only ever grows with the jobs it has seen
(rather than with the fleet it serves now) is a leak. Each test drives weeks of synthetic event
time with job churn and checks the structure's size against what is live, not against a
hard-coded count.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from fleetwise.actuators import ActionPolicy
from fleetwise.actuators.policy import RETIRE_JOB_S, RETIRE_SWEEP_MARGIN_S
from fleetwise.schemas import AuditEvent, Prediction
from fleetwise.schemas import topics as T
from fleetwise.streams.app import StreamProcessor, decode_entry, state_partition
from fleetwise.streams.pipeline import ControlPlane, ControlPlaneConfig

T0 = 1_764_547_200.0
HOUR = 3600.0


class _Table:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}


async def _send(topic: str, key: bytes, value: bytes, headers: list) -> asyncio.Future:
    done = asyncio.get_running_loop().create_future()
    done.set_result(None)
    return done


def _step_messages(job: str, node: str, ts: float, step: int,
                   offsets: dict[int, int]) -> list[SimpleNamespace]:
    """One step record per rank (4 ranks on GPUs 0-3 of `node`), keyed by job like the agent's."""
    partition = state_partition(job, T.TELEMETRY_STEPS.partitions)
    out = []
    for rank in range(4):
        value = json.dumps({"ts": ts + rank * 0.01, "job": job, "rank": rank, "node": node, "gpu": rank,
                            "step": step, "step_time_s": 1.0, "compute_s": 0.8}).encode()
        offset = offsets.get(partition, 0)
        offsets[partition] = offset + 1
        out.append(SimpleNamespace(topic="steps", partition=partition, offset=offset, value=value,
                                   headers=[], timestamp=0))
    return out


def test_worker_caches_follow_the_live_keys_not_every_job_ever_seen() -> None:
    """120 jobs, one after the other, each running 2 hours (event time): the straggler detector
    retires each 6 h after its last step. The worker's per-key caches (placement, the last saved
    JSON of small processors) must hold the live keys only, and the table must not keep the
    state of retired jobs (a restore would bring them back)."""
    control = ControlPlane(ControlPlaneConfig(failure_predictor=False))
    proc = StreamProcessor(control, _Table(), _send, changelog=lambda p, k, v: None)
    offsets: dict[int, int] = {}
    n_jobs = 120

    async def run() -> None:
        for i in range(n_jobs):
            job = f"job-{i:03d}"
            start = T0 + i * 2 * HOUR
            for k in range(12):  # a step record every 10 minutes for 2 hours
                msgs = _step_messages(job, f"node-{i % 5}", start + k * 600.0, k, offsets)
                await proc.process_messages(T.TELEMETRY_STEPS.name, msgs)
            await proc.checkpoint()

    asyncio.run(run())
    live = control.keys()
    assert len(control.stragglers.keys()) < 10  # the detector itself retires silent jobs
    live_inner = {full.partition(":")[2] for full in live}
    # Every cache entry is a live key; before, each held one entry per job ever seen.
    assert set(proc._small_text) <= set(live)
    assert set(proc._full_place) <= set(live)
    assert set(proc._place) <= live_inner
    assert len(proc._place) < n_jobs // 4
    # The saved table holds no state of a retired job.
    saved = {full for value in proc.table.data.values() for full in decode_entry(value)[0]["other"]}
    assert saved <= set(live)


def _prediction(job: str, rank: int, ts: float, *, alert: bool = False, n: int = 0) -> Prediction:
    return Prediction(id=f"p-{job}-{rank}-{n}", type="failure", ts=ts, node=f"node-{rank % 7}", gpu=rank % 8,
                      job=job, rank=rank, probability=0.9 if alert else 0.01, horizon_h=6.0, alert=alert)


def _job_stream(n_jobs: int, hours_each: float = 2.0) -> list[Prediction]:
    """Each job named by a prediction per rank every 10 minutes while it runs; jobs back to back."""
    out = []
    for i in range(n_jobs):
        start = T0 + i * hours_each * HOUR
        for k in range(int(hours_each * 6)):
            out.extend(_prediction(f"job-{i:03d}", r, start + k * 600.0 + r, n=k) for r in range(4))
    return out


def test_policy_jobs_known_only_from_predictions_are_retired_when_silent() -> None:
    """300 jobs over 25 days of event time: the policy keeps the jobs named within the last
    day (plus the sweep's margin), not all 300."""
    policy = ActionPolicy()
    stream = _job_stream(300)
    for i in range(0, len(stream), 48):
        policy.process(stream[i:i + 48])
    window = (RETIRE_JOB_S + 2 * RETIRE_SWEEP_MARGIN_S) / (2 * HOUR) + 1  # jobs named within it
    assert len(policy.jobs) <= window
    assert policy.retired_jobs >= 300 - window
    assert "job-299" in policy.jobs  # the running job stays


def test_policy_retirement_does_not_depend_on_batching() -> None:
    """The same predictions one per call or in large calls give the same commands and the same
    saved state for every key: retirement is decided in event time. One job comes back after
    3 days of silence (starts over: only its new rank is known), one after half a day (kept)."""
    stream = _job_stream(40)
    end = stream[-1].ts
    stream += [_prediction("job-000", 5, end + 0.25 * RETIRE_JOB_S, n=99),
               _prediction("job-039", 5, end + 0.5 * RETIRE_JOB_S, n=99)]
    stream.sort(key=lambda p: p.ts)

    def run(chunk: int) -> tuple[list, dict]:
        policy = ActionPolicy()
        out = []
        for i in range(0, len(stream), chunk):
            out.extend(r.model_dump(mode="json") for r in policy.process(stream[i:i + chunk]))
        return out, {key: policy.state(key) for key in policy.keys()}

    one_by_one, many = run(1), run(500)
    assert one_by_one == many
    state = many[1]
    assert sorted(state["job-000"]["job"]["ranks"]) == ["5"]  # started over
    assert sorted(state["job-039"]["job"]["ranks"]) == ["0", "1", "2", "3", "5"]  # kept


def test_policy_keeps_jobs_it_sent_commands_for() -> None:
    """A job the policy sent a command for (its `seq` orders the job's commands at the
    consumers) is never dropped for silence: a restart of its numbering would be refused."""
    policy = ActionPolicy()
    out = policy.process([_prediction("job-cmd", 0, T0, alert=True)])
    assert any(getattr(r, "job", None) == "job-cmd" and r.kind == "command" for r in out)
    for day in range(1, 6):
        policy.process([_prediction(f"other-{day}", 0, T0 + day * RETIRE_JOB_S * 1.2)])
    assert "job-cmd" in policy.jobs and policy.jobs["job-cmd"].seq >= 1


def test_planned_jobs_are_forgotten_after_their_plan_tombstone() -> None:
    """Planned jobs pin their state (a plan says the job exists) until the plan is withdrawn:
    a tombstone under the job's key on the compacted plans topic, as a job's owner writes it
    when the job ends. 60 planned jobs back to back, 2 hours each: with the tombstones nothing
    of them is left (no command was in flight); without them the worker keeps every one."""
    from fleetwise.planner import PlanRequest, parse_gpu_spec, plan_job, resolve_model

    def run(tombstones: bool) -> tuple[ControlPlane, StreamProcessor]:
        control = ControlPlane(ControlPlaneConfig(failure_predictor=False))
        proc = StreamProcessor(control, _Table(), _send, changelog=lambda p, k, v: None)
        offsets: dict[int, int] = {}

        async def go() -> None:
            for i in range(60):
                job, start = f"job-{i:03d}", T0 + i * 2 * HOUR
                plan = plan_job(PlanRequest(model=resolve_model("llama-7b"), global_batch=64, job=job,
                                            strategy=(1, 1, 4)), parse_gpu_spec("h100-sxm:4"))
                control.handle(T.PLANS.name, control.decode(T.PLANS.name, plan.to_json_bytes(),
                                                            source=f"plans:{i}", key=job.encode()))
                for k in range(12):
                    msgs = _step_messages(job, f"node-{i % 5}", start + k * 600.0, k, offsets)
                    await proc.process_messages(T.TELEMETRY_STEPS.name, msgs)
                if tombstones:
                    tombstone = control.decode(T.PLANS.name, None, source=f"plans:end:{i}", key=job.encode())
                    routed = control.handle(T.PLANS.name, tombstone)
                    # Audited with its reason (the detector's closing feature windows route beside it).
                    assert [r.event for _t, _k, r in routed if isinstance(r, AuditEvent)] == ["job_ended"]
                await proc.checkpoint()

        asyncio.run(go())
        return control, proc

    kept, _ = run(tombstones=False)
    assert len(kept.policy.jobs) == 60 and len(kept.plans) == 60  # the leak the tombstone closes
    control, proc = run(tombstones=True)
    assert control.policy.jobs == {} and control.policy.ended_jobs == 60
    assert control.plans == {}  # withdrawn plans are gone at once
    assert control.stragglers.keys() == []  # the detector retires an ended job at its tombstone
    saved = {full for value in proc.table.data.values() for full in decode_entry(value)[0]["other"]}
    assert saved <= set(control.keys())


def test_a_job_end_line_in_a_replay_file_is_read_as_the_tombstone() -> None:
    control = ControlPlane(ControlPlaneConfig(failure_predictor=False))
    items = control.decode_obj(None, {"kind": "job_end", "job": "llm", "ts": T0}, source="line 1")
    assert [type(i).__name__ for i in items] == ["JobEnd"] and items[0].ts == T0
    bad = control.decode(T.PLANS.name, None, source="plans:0:7")  # a null value with no key
    assert bad[0].reason == "empty message (no value)"
