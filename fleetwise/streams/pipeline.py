"""The control plane as one object: validation, processors and routing, in event time.

The same `ControlPlane` runs inside the embedded runtime (replay, demo, tests) and inside each
faust agent, so one trace gives the same features and decisions both ways. It holds no I/O:
callers hand it raw bytes or records and publish what it returns.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Any, NamedTuple

from pydantic import BaseModel, ValidationError
from threadpoolctl import threadpool_limits

from fleetwise.actuators import ActionPolicy, Keyring, PolicyConfig
from fleetwise.catalog import UnknownGpuError, lookup
from fleetwise.planner.exports import rank_layer_counts
from fleetwise.predictors.failure import FailurePredictor
from fleetwise.predictors.features import FEATURE_NAMES, SAMPLE_DECODER, GpuFeatureWindows, sample_columns
from fleetwise.predictors.stragglers import StragglerDetector
from fleetwise.predictors.trends import FleetTrends, GroupTrend, HopHeadroom, ThermalHeadroom
from fleetwise.schemas import (
    Ack,
    AuditEvent,
    Command,
    DeadLetter,
    FeatureVector,
    GpuSample,
    JobEnd,
    NodeInventory,
    OperatorAction,
    Plan,
    Prediction,
    Record,
    TrainingStep,
    describe_error,
    plans_message,
)
from fleetwise.schemas import topics as T
from fleetwise.schemas.fast import (
    FastGpuSample,
    FastTrainingStep,
    SampleColumns,
    TraceBlock,
    training_step,
    training_steps,
)
from fleetwise.streams.limits import SampleGate

# What decoding yields: records, or GPU samples validated on the fast path.
Item = Record | FastGpuSample | FastTrainingStep | SampleColumns
_MODEL = attrgetter("model")
_UTIL_MEAN = FEATURE_NAMES.index("util_mean")
_FULL_POWER = FEATURE_NAMES.index("temp_at_tdp_c")


class Routed(NamedTuple):
    topic: str
    key: str
    record: Record


@dataclass
class ControlPlaneConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    keyring: Keyring | None = None  # signing keys (None: the development key)
    operator_keys: Keyring | None = None  # verify operator actions (None: the development key)
    # Failure alerts from the model beside the rules (None: as the packaged model's policy says,
    # which is the rules alone: docs/predictors.md, "An evaluation that can fail").
    model_alerts: bool | None = None
    failure_predictor: bool = True
    straggler_detector: bool = True
    # Publish feature vectors on fleetwise.features, per GPU-hop and per rank window (off:
    # the predictors still run on the same features, which saves building those records).
    publish_features: bool = True
    # Shift each GPU's hop grid by a phase from its key (GpuFeatureWindows.hop_phase), so a
    # fleet's hops close spread over the hop, not all in one tick: with aligned hops a
    # worker builds and sends every GPU's feature record at once (p99 latency ~1 s at
    # 25,000 samples/s). The shipped model scores the same on held-out traces either way
    # (bench/failure_eval.py --stagger-hops, docs/benchmarks.md).
    stagger_hops: bool = True
    # `thermal` predictions per GPU (headroom at full power running out: information, no command).
    thermal_headroom: bool = True
    # Hourly roll-ups per rack and site (`ControlPlane.trend_rows`): they need every GPU of a
    # group, so only where all telemetry passes (replay, demo), not in a stream worker.
    fleet_trends: bool = False


def _original(raw: bytes) -> tuple[str, str]:
    try:
        return raw.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(raw).decode("ascii"), "base64"


def classify_line(obj: dict[str, Any]) -> str:
    """Which topic a replay line belongs to, from its shape (DESIGN.md record formats)."""
    if "metrics" in obj:
        return T.TELEMETRY_GPU.name
    if "step_time_s" in obj:
        return T.TELEMETRY_STEPS.name
    if "samples" in obj and isinstance(obj["samples"], list):
        return T.TELEMETRY_GPU.name
    if "gpus" in obj:
        return T.INVENTORY.name
    if ("ranks" in obj and "dp" in obj) or obj.get("kind") == "job_end":
        return T.PLANS.name
    if "command_id" in obj and "status" in obj:
        return T.ACKS.name
    if obj.get("kind") == "operator":
        return T.OPERATOR.name
    raise ValueError("not a GPU sample, node batch, training step, inventory, plan, job end, ack or operator "
                     "record")


class ControlPlane:
    """Validate -> features -> predictors -> actuators, over records in event time."""

    def __init__(self, config: ControlPlaneConfig | None = None) -> None:
        self.config = config or ControlPlaneConfig()
        self.features = GpuFeatureWindows(stagger=self.config.stagger_hops)
        self.failure = FailurePredictor.load() if self.config.failure_predictor else None
        if self.failure is not None and self.config.model_alerts is not None:
            self.failure.policy = replace(self.failure.policy, model_alerts=self.config.model_alerts)
        if self.failure is not None:
            _one_native_thread()
        self.stragglers = (StragglerDetector(features=self.config.publish_features)
                           if self.config.straggler_detector else None)
        self.policy = ActionPolicy(self.config.policy, self.config.keyring, self.config.operator_keys)
        self.thermal = ThermalHeadroom() if self.config.thermal_headroom else None
        self.fleet_trends = FleetTrends() if self.config.fleet_trends else None
        self.trend_rows: list[GroupTrend] = []
        # Called with each call's closed hops: (keys, (rack, site) per row, hop-end times,
        # HopHeadroom). The stream worker sets its per-GPU Prometheus gauges here.
        self.hop_observers: list[Callable[[list[tuple[str, int]], list[tuple[str | None, str | None]],
                                           Any, HopHeadroom], None]] = []
        # Plausibility, clock-skew and rate limits before the windows (fleetwise/streams/limits.py)
        self.gate = SampleGate(self.features, self.dead_letter)
        self.inventory: dict[str, NodeInventory] = {}
        self.plans: dict[str, Plan] = {}
        self._model_ids: dict[str, str | None] = {}
        self._models_taught = 0  # feature-window slots whose GPU model the detector has learned
        self.counts: dict[str, int] = {"samples_in": 0, "steps_in": 0, "deadletter": 0}

    # -- validation --------------------------------------------------------------------------
    def dead_letter(self, source: str, reason: str, raw: bytes | str, ts: float = 0.0) -> DeadLetter:
        self.counts["deadletter"] += 1
        if isinstance(raw, str):
            text, enc = raw, "utf-8"
        else:
            text, enc = _original(raw)
        return DeadLetter(ts=ts, source=source, reason=reason, original=text, encoding=enc)

    def model_id(self, model: str) -> str | None:
        """Catalog id for a reported model name (cached); None when unknown."""
        try:
            return self._model_ids[model]
        except KeyError:
            try:
                found: str | None = lookup(model).id
            except UnknownGpuError:
                found = None
            self._model_ids[model] = found
            return found

    def _check_sample(self, sample: GpuSample, source: str, raw: Any) -> Record:
        if self.model_id(sample.model) is None:
            try:
                lookup(sample.model)
            except UnknownGpuError as exc:
                reason = exc.record_reason
            return self.dead_letter(source, reason, json.dumps(raw, default=str), sample.ts)
        return sample

    def decode(self, topic: str, raw: bytes | None, *, source: str, key: bytes | None = None) -> list[Item]:
        """Parse one message or replay line. Bad input becomes a DeadLetter, never an exception.

        `key`: the Kafka message key; a null value under a job's key on the compacted plans
        topic is that job's tombstone (a `JobEnd`)."""
        if raw is None and topic == T.PLANS.name and key:
            try:
                return [plans_message(None, key)]
            except (UnicodeDecodeError, ValidationError) as exc:
                return [self.dead_letter(source, f"plan tombstone with an unusable key: {exc}", key)]
        return self.decode_messages(topic, [raw], [source])[0]

    def decode_messages(
        self, topic: str, raws: Sequence[bytes | None], sources: Sequence[str]
    ) -> list[list[Item]]:
        """The items of each message (or replay line) of one topic, in order.

        GPU telemetry and training steps take the fast path first: all node batches (or all
        sample lines, or all steps) of the call validated in one msgspec call straight into
        `FastGpuSample`s (`FastTrainingStep`s). When that
        refuses the call, each message is tried alone, and one the fast path refuses takes
        the pydantic path, which accepts it or dead-letters it with the reason: one bad
        message never costs the good ones beside it."""
        if topic == T.TELEMETRY_STEPS.name and raws and None not in raws:
            steps = training_steps(raws)  # type: ignore[arg-type]
            if steps is not None:
                return [[s] for s in steps]
        if topic == T.TELEMETRY_GPU.name and raws and None not in raws:
            found = SAMPLE_DECODER.batches(raws)  # type: ignore[arg-type]
            if found is not None and self._models_known(s.model for items in found for s in items):
                return found  # type: ignore[return-value]
            flat = SAMPLE_DECODER.samples(raws)  # type: ignore[arg-type]
            if flat is not None and self._models_known(map(_MODEL, flat)):
                return [[s] for s in flat]
        return [self._decode_one(topic, raw, source) for raw, source in zip(raws, sources, strict=True)]

    def decode_lines(self, topic: str, lines: Sequence[bytes], sources: Sequence[str]) -> list[Item]:
        """`decode_messages` flattened, for replay lines: the chunk is tried whole as sample
        lines (what trace files hold) or step lines; a refused chunk goes line by line (each
        line still on the fast path first), never whole again."""
        if topic == T.TELEMETRY_GPU.name and lines:
            flat = SAMPLE_DECODER.samples(lines)
            if flat is not None and self._models_known(map(_MODEL, flat)):
                return flat  # type: ignore[return-value]
        elif topic == T.TELEMETRY_STEPS.name and lines:
            steps = training_steps(lines)
            if steps is not None:
                return steps  # type: ignore[return-value]
        # Dead letters keep the line, not its newline.
        return [item for line, source in zip(lines, sources, strict=True)
                for item in self._decode_one(topic, line.rstrip(b"\r\n"), source)]

    def decode_trace_text(self, text: bytes) -> TraceBlock | None:
        """A block of replay lines that are all GPU samples or training steps, decoded in one
        call (`SampleDecoder.trace_lines`); None when the fast path refuses any line or a GPU
        model is unknown (then go line by line: `decode_lines` accepts or dead-letters each one)."""
        found = SAMPLE_DECODER.trace_lines(text)
        if found is None or not self._models_known(found.samples.model):
            return None
        return found

    def _models_known(self, models: Iterable[str]) -> bool:
        model_id = self.model_id
        return all(model_id(m) is not None for m in set(models))

    def _decode_one(self, topic: str, raw: bytes | None, source: str) -> list[Item]:
        if raw is None:
            return [self.dead_letter(source, "empty message (no value)", b"")]
        if topic == T.TELEMETRY_GPU.name:
            if b'"samples"' in raw:
                found = SAMPLE_DECODER.batch(raw)
            else:
                one = SAMPLE_DECODER.sample(raw)
                found = None if one is None else [one]
            if found is not None and self._models_known(map(_MODEL, found)):
                return found  # type: ignore[return-value]
        elif topic == T.TELEMETRY_STEPS.name:
            step = training_step(raw)
            if step is not None:
                return [step]
        try:
            obj = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return [self.dead_letter(source, f"not valid JSON: {exc}", raw)]
        if not isinstance(obj, dict):
            return [self.dead_letter(source, f"expected a JSON object, got {type(obj).__name__}", raw)]
        return self.decode_obj(topic, obj, source=source, raw=raw)  # type: ignore[return-value]

    def decode_obj(
        self, topic: str | None, obj: dict, *, source: str, raw: bytes | None = None
    ) -> list[Record]:
        """Validate one parsed record; `topic` None means: infer it from the record's shape."""
        raw_text: bytes | str = raw if raw is not None else json.dumps(obj, default=str)
        try:
            kind = classify_line(obj) if topic is None else topic
        except ValueError as exc:
            return [self.dead_letter(source, str(exc), raw_text)]
        try:
            if kind == T.TELEMETRY_GPU.name:
                if "samples" in obj and "metrics" not in obj:
                    return self._decode_batch(obj, source, raw_text)
                sample = GpuSample.model_validate(obj)
                return [self._check_sample(sample, source, obj)]
            if kind == T.PLANS.name:
                return [plans_message(obj)]
            model: type[BaseModel] = {
                T.TELEMETRY_STEPS.name: TrainingStep,
                T.INVENTORY.name: NodeInventory,
                T.ACKS.name: Ack,
                T.OPERATOR.name: OperatorAction,
                T.PREDICTIONS.name: Prediction,
                T.COMMANDS_TRAINING.name: Command,
                T.COMMANDS_KUBE.name: Command,
            }[kind]
            return [model.model_validate(obj)]  # type: ignore[list-item]
        except ValidationError as exc:
            return [self.dead_letter(source, describe_error(exc), raw_text, _ts_of(obj))]
        except KeyError:
            return [self.dead_letter(source, f"no record type is read from topic {kind!r}", raw_text)]

    def _decode_batch(self, obj: dict, source: str, raw: bytes | str) -> list[Record]:
        # One bad sample must not cost the good ones beside it: validate samples one by one.
        samples = obj.get("samples")
        node = obj.get("node")
        if not isinstance(samples, list) or not isinstance(node, str):
            return [self.dead_letter(source, "node batch needs 'node' (string) and 'samples' (list)", raw)]
        out: list[Record] = []
        for i, item in enumerate(samples):
            if not isinstance(item, dict):
                bad = json.dumps(item)
                out.append(self.dead_letter(f"{source}#samples.{i}", "sample is not an object", bad))
                continue
            try:
                sample = GpuSample.model_validate(item)
            except ValidationError as exc:
                bad = json.dumps(item, default=str)
                out.append(self.dead_letter(f"{source}#samples.{i}", describe_error(exc), bad, _ts_of(item)))
                continue
            if sample.node != node:
                out.append(self.dead_letter(f"{source}#samples.{i}",
                                      f"node: sample node {sample.node!r} differs from batch node {node!r}",
                                      json.dumps(item, default=str), sample.ts))
                continue
            out.append(self._check_sample(sample, f"{source}#samples.{i}", item))
        return out

    # -- processing --------------------------------------------------------------------------
    def handle(self, topic: str, records: Sequence[Item]) -> list[Routed]:
        """Run the processors over records of one topic (event-time order); route the outputs."""
        out: list[Routed] = []
        # The types present, in one C-level pass: most calls hold neither dead letters nor
        # node batches, and then need no per-record loop.
        types = set(map(type, records))
        good: Sequence[Item] = records
        if any(issubclass(t, DeadLetter) for t in types):
            kept: list[Item] = []
            for r in records:
                if isinstance(r, DeadLetter):
                    out.append(Routed(T.DEADLETTER.name, r.source, r))
                else:
                    kept.append(r)
            good = kept
        if not good:
            return out
        if topic == T.TELEMETRY_GPU.name:
            # The gate looks each sample's GPU up; the windows reuse those slots.
            samples, refused, slots = self.gate.screen(sample_columns(good))  # type: ignore[arg-type]
            out.extend(Routed(T.DEADLETTER.name, r.source, r) for r in refused)
            self.counts["samples_in"] += len(samples)
            out.extend(self._gpu_outputs(*self.features.ingest_samples(samples, slots=slots)))
        elif topic == T.TELEMETRY_STEPS.name:
            self.counts["steps_in"] += len(good)
            if self.stragglers is not None:
                self._teach_gpu_models()
                out.extend(self._route_outputs(self.stragglers.process(good)))
        elif topic == T.INVENTORY.name:
            for r in good:
                self.inventory[r.node] = r  # type: ignore[attr-defined]
            if self.stragglers is not None:
                self.stragglers.learn_models((r.node, g.index, g.model)  # type: ignore[attr-defined]
                                             for r in good for g in r.gpus)  # type: ignore[attr-defined]
            out.extend(self._route_outputs(self.policy.process(good)))  # type: ignore[arg-type]
        elif topic == T.PLANS.name:
            for r in good:
                if isinstance(r, JobEnd):
                    # The job is over: nothing of it is kept (a later plan starts it afresh).
                    self.plans.pop(r.job, None)
                    if self.stragglers is not None:
                        out.extend(self._route_outputs(self.stragglers.end_job(r.job)))
                else:
                    self.plans[r.job] = r  # type: ignore[attr-defined]
                    if self.stragglers is not None:  # a pipeline stage's work is its layers
                        held = rank_layer_counts(r) if r.pp > 1 else {}  # type: ignore[arg-type,attr-defined]
                        self.stragglers.learn_layers(r.job, held)  # type: ignore[attr-defined]
            out.extend(self._route_outputs(self.policy.process(good)))  # type: ignore[arg-type]
        elif topic == T.PREDICTIONS.name:
            # Predictions made elsewhere (a file, another system): routed and acted on as ours.
            out.extend(self._route_outputs(good))  # type: ignore[arg-type]
        elif topic in (T.ACKS.name, T.OPERATOR.name, T.COMMANDS_TRAINING.name, T.COMMANDS_KUBE.name):
            if topic == T.ACKS.name and self.stragglers is not None:
                self._teach_moved_layers(good)  # type: ignore[arg-type]
            # The fleet state follows the consumers' acks and the operators' word; the commands
            # (every worker's, read back) tell each worker what the others are taking out.
            out.extend(self._route_outputs(self.policy.process(good)))  # type: ignore[arg-type]
        return out

    def _teach_moved_layers(self, acks: Sequence[Ack]) -> None:
        """A pipeline's stage boundaries moved (a rebalance's `done` ack names them): the
        straggler detector weighs each rank's work by its new layers."""
        for ack in acks:
            layout = ack.result.get("layers") if ack.status == "done" else None
            plan = self.plans.get(ack.job) if layout and ack.job else None
            if plan is None or plan.pp <= 1:
                continue
            try:
                held = rank_layer_counts(plan, layout)
            except (TypeError, ValueError, IndexError, AttributeError):
                continue  # not a layout: the ack's own business, nothing to learn
            self.stragglers.learn_layers(ack.job, held)  # type: ignore[union-attr]

    def _teach_gpu_models(self) -> None:
        """The straggler detector learns the GPU model of every GPU the feature windows have
        seen in samples since the last call (step records need not carry one: DESIGN.md's
        have none). Costs one look past the last slot when no GPU is new."""
        found = []
        slot = self._models_taught
        while True:
            try:
                meta = self.features.slot_meta(slot)
            except IndexError:
                break
            found.append((meta["node"], meta["gpu"], meta["model"]))
            slot += 1
        if found:
            self.stragglers.learn_models(found)  # type: ignore[union-attr]
            self._models_taught = slot

    def flush(self) -> list[Routed]:
        """End of input (replay): close open windows and route what they produce."""
        out = self._gpu_outputs(*self.features.flush_arrays())
        if self.fleet_trends is not None:
            self.trend_rows.extend(self.fleet_trends.flush())
        if self.stragglers is not None:
            out.extend(self._route_outputs(self.stragglers.flush()))
        return out

    def _gpu_outputs(self, slots: Any, ts: Any, feats: Any) -> list[Routed]:
        """Route closed GPU hops: feature records (optional) and the failure predictions on them.

        The predictor scores the feature arrays directly: no record round trip per GPU-hop."""
        routed: list[Routed] = []
        if len(slots) == 0:
            return routed
        if self.config.publish_features:
            routed.extend(self._route_outputs(self.features.to_records(slots, ts, feats)))
        keys = None
        if self.failure is not None or self.policy.wants_utilisation or self.thermal is not None:
            meta = self.features.slot_meta
            keys = [(m["node"], m["gpu"]) for m in map(meta, slots)]
        if self.failure is not None:
            predictions, _ = self.failure.process_arrays(
                keys, ts, feats, job_ranks=self.features.closed_job_ranks
            )
            routed.extend(self._route_outputs(predictions))
        if self.thermal is not None:
            predictions, hops = self.thermal.process_arrays(keys, ts, feats, self.features.closed_job_ranks)
            routed.extend(self._route_outputs(predictions))
            if self.fleet_trends is not None or self.hop_observers:
                places = self._places(slots)
                if self.fleet_trends is not None:
                    self.trend_rows.extend(self.fleet_trends.observe(keys, places, ts, hops))
                for observe in self.hop_observers:
                    observe(keys, places, ts, hops)
        if self.policy.wants_utilisation:
            # Consolidation watches each GPU's mean utilisation per hop and who runs there.
            job_ranks = self.features.closed_job_ranks
            routed.extend(self._route_outputs(self.policy.observe_utilisation(
                keys, ts, feats[:, _UTIL_MEAN], job_ranks.jobs, job_ranks.ranks, feats[:, _FULL_POWER])))
        return routed

    def _places(self, slots: Any) -> list[tuple[str | None, str | None]]:
        """(rack, site) per slot: as its samples name them, else as its node's inventory does."""
        out = []
        for m in map(self.features.slot_meta, slots):
            rack, site = m["rack"], m["site"]
            if rack is None or site is None:
                inv = self.inventory.get(m["node"])
                if inv is not None:
                    rack, site = rack or inv.rack, site or inv.site
            out.append((rack, site))
        return out

    def _route_outputs(self, outputs: Sequence[Record]) -> list[Routed]:
        routed: list[Routed] = []
        predictions: list[Prediction] = []
        for r in outputs:
            if isinstance(r, FeatureVector):
                key = r.job if r.scope == "rank" and r.job else f"{r.node}/{r.gpu}"
                routed.append(Routed(T.FEATURES.name, key, r))
            elif isinstance(r, Prediction):
                # Job-wide predictions (no GPU) are keyed by job, like the job's other records.
                key = f"{r.node}/{r.gpu}" if r.gpu is not None else (r.job or r.node)
                routed.append(Routed(T.PREDICTIONS.name, key, r))
                predictions.append(r)
            elif isinstance(r, Command):
                routed.extend(_route_command(r))
            elif isinstance(r, AuditEvent):
                routed.append(Routed(T.AUDIT.name, r.job or r.node or "", r))
        if predictions:
            routed.extend(self._route_outputs(self.policy.process(predictions)))
        return routed

    # -- state for changelogged tables -------------------------------------------------------
    def _processors(self) -> dict[str, Any]:
        procs: dict[str, Any] = {"features": self.features, "policy": self.policy}
        if self.failure is not None:
            procs["failure"] = self.failure
        if self.stragglers is not None:
            procs["stragglers"] = self.stragglers
        if self.thermal is not None:
            procs["thermal"] = self.thermal
        return procs

    def keys(self) -> list[str]:
        return sorted({f"{name}:{k}" for name, p in self._processors().items() for k in p.keys()})

    def state(self, key: str) -> dict:
        name, _, inner = key.partition(":")
        return self._processors()[name].state(inner)

    def restore(self, key: str, state: dict) -> None:
        name, _, inner = key.partition(":")
        self._processors()[name].restore(inner, state)

    def forget(self, key: str) -> None:
        """Drop a key's state (back to never seen), e.g. before its inputs are re-delivered."""
        name, _, inner = key.partition(":")
        self._processors()[name].forget(inner)


def _one_native_thread() -> None:
    """The model scores a few hundred GPU-hops per call and the feature windows work on arrays
    of one chunk: OpenMP and BLAS threads cost more than they give there (35x slower on a busy
    2-core machine for the model; 3-4% of a replay for BLAS) and would compete with the
    stream's own thread. Set once per process, for scikit-learn's OpenMP runtime and numpy's
    and scipy's BLAS."""
    global _NATIVE_LIMITED
    if not _NATIVE_LIMITED:
        threadpool_limits(limits=1)
        _NATIVE_LIMITED = True


_NATIVE_LIMITED = False


# Training-side commands go to the plugin, placement-side ones to the KAI consumer. Both act on
# a drain of a GPU a job runs on (the rank leaves; the node is cordoned) and on a resize (the
# process group is rebuilt; the PodGroup's gang changes). A migration's snapshot and restore are
# the plugin's, its transfer (the job's pods to the destination) the KAI consumer's.
TRAINING_COMMANDS = frozenset({"rebalance", "checkpoint"})


def command_topics(cmd: Command) -> list[str]:
    """The command topics a command is published on."""
    if cmd.type in TRAINING_COMMANDS:
        return [T.COMMANDS_TRAINING.name]
    if cmd.type == "migrate":
        phase = cmd.params.get("phase")
        return [T.COMMANDS_KUBE.name if phase == "transfer" else T.COMMANDS_TRAINING.name]
    if cmd.type in ("drain", "resize") and cmd.job:
        return [T.COMMANDS_TRAINING.name, T.COMMANDS_KUBE.name]
    return [T.COMMANDS_KUBE.name]


def _route_command(cmd: Command) -> list[Routed]:
    key = cmd.job or cmd.node or ""
    return [*(Routed(t, key, cmd) for t in command_topics(cmd)), Routed(T.AUDIT.name, key, cmd)]


def _ts_of(obj: Any) -> float:
    ts = obj.get("ts") if isinstance(obj, dict) else None
    return float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else 0.0
