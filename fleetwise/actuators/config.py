"""The operator's policy: thresholds, which actions run on their own, rails, command lifetimes.

Read from a YAML file (`fleetwise policy check FILE`, `fleetwise worker --policy FILE`,
`fleetwise replay --policy FILE`); every field has a default, unknown fields are refused, and
an error names the field path (``rails.max_drain_share_per_job: ...``). See docs/actuators.md.
"""

from __future__ import annotations

from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fleetwise.schemas import describe_error

# auto: the command is emitted when decided; approve: held until `fleetwise approve ID`;
# off: decided and audited, never emitted.
Mode = Literal["auto", "approve", "off"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FailureActions(_Section):
    mode: Mode = "auto"
    # Act only on alerts whose horizon is at most this (a failure further out can wait).
    max_horizon_h: float = Field(default=72.0, gt=0)
    resize_after_drain: bool = True


class StragglerActions(_Section):
    mode: Mode = "auto"
    # A rank counts as slow below this measured/expected speed, and as recovered above
    # `recover_above` (hysteresis: between the two its last state holds).
    slow_below: float = Field(default=0.95, gt=0, le=1)
    recover_above: float = Field(default=0.98, gt=0, le=1)
    # Rebalance only when the predicted step-time gain is at least this share.
    min_gain: float = Field(default=0.03, ge=0, lt=1)
    cooldown_s: float = Field(default=900.0, ge=0)  # per job, between two rebalances

    @model_validator(mode="after")
    def _hysteresis(self) -> StragglerActions:
        if self.recover_above < self.slow_below:
            raise ValueError(
                f"recover_above ({self.recover_above}) must be >= slow_below ({self.slow_below})")
        return self


class ResizeActions(_Section):
    mode: Mode = "auto"  # resize up when GPUs join or return and the job's intent allows
    # Grow a job beyond its plan (up to its intent's max_gpus) only when the re-plan's predicted
    # step is at least this share faster: a resize restarts the job from a checkpoint.
    min_gain: float = Field(default=0.05, ge=0, lt=1)


class ConsolidateActions(_Section):
    mode: Mode = "approve"
    utilisation_below: float = Field(default=0.3, gt=0, lt=1)  # a node's GPUs all below this ...
    sustained_s: float = Field(default=3600.0, gt=0)  # ... for this long (event time)
    check_every_s: float = Field(default=3600.0, gt=0)
    max_moves: int = Field(default=16, ge=0)  # jobs moved per consolidation


class MigrateActions(_Section):
    mode: Mode = "approve"
    min_saving: float = Field(default=0.2, gt=0, lt=1)  # share of the placement cost a move must save
    check_every_s: float = Field(default=6 * 3600.0, gt=0)
    remaining_s: float = Field(default=24 * 3600.0, gt=0)  # assumed remaining run time of a job


class Rails(_Section):
    max_drain_share_per_job: float = Field(default=0.25, gt=0, le=1)
    max_drained_gpus_fleet: int = Field(default=16, ge=0)
    max_drained_share_fleet: float = Field(default=0.05, gt=0, le=1)
    # Circuit breaker (NVSentinel's lesson from XID storms): more than `breaker_drains` drain
    # decisions within `breaker_window_s` opens it; while open no drain is emitted; it closes
    # after `breaker_cooldown_s` without a new attempt.
    breaker_drains: int = Field(default=8, ge=1)
    breaker_window_s: float = Field(default=600.0, gt=0)
    breaker_cooldown_s: float = Field(default=3600.0, gt=0)
    max_disruptive_per_job_per_hour: int = Field(default=4, ge=1)
    # No action on a prediction older than this behind the newest event time seen.
    stale_after_s: float = Field(default=900.0, gt=0)

    def fleet_drain_cap(self, fleet_gpus: int) -> int:
        """GPUs that may be out at once in a fleet of ``fleet_gpus`` (0: size unknown, the
        absolute cap alone); a fleet of any size may have one out."""
        if not fleet_gpus:
            return self.max_drained_gpus_fleet
        return min(self.max_drained_gpus_fleet, max(1, int(self.max_drained_share_fleet * fleet_gpus)))


class CommandLifetimes(_Section):
    """Seconds a command stays valid (its `expires_ts` = ts + lifetime) before it is re-decided."""

    checkpoint: float = Field(default=1800.0, gt=0)
    drain: float = Field(default=3600.0, gt=0)
    rebalance: float = Field(default=600.0, gt=0)
    resize: float = Field(default=3600.0, gt=0)
    migrate: float = Field(default=7200.0, gt=0)
    consolidate: float = Field(default=7200.0, gt=0)
    envelope: float = Field(default=3600.0, gt=0)


class PolicyConfig(_Section):
    dry_run: bool = False
    failure: FailureActions = FailureActions()
    straggler: StragglerActions = StragglerActions()
    resize: ResizeActions = ResizeActions()
    consolidate: ConsolidateActions = ConsolidateActions()
    migrate: MigrateActions = MigrateActions()
    rails: Rails = Rails()
    lifetimes: CommandLifetimes = CommandLifetimes()


class PolicyFileError(ValueError):
    """A policy file that cannot be used; the message names each wrong field."""


def parse_policy(text: str, source: str = "policy") -> PolicyConfig:
    """A PolicyConfig from YAML text (an empty document means every default)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PolicyFileError(f"{source}: not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyFileError(f"{source}: expected a mapping at the top, got {type(data).__name__}")
    if "signing_key" in data:
        raise PolicyFileError(f"{source}: signing_key: keys never go in a policy file "
                              "(FLEETWISE_SIGNING_KEYS or FLEETWISE_SIGNING_KEYS_FILE)")
    try:
        return PolicyConfig.model_validate(data)
    except ValidationError as exc:
        raise PolicyFileError(f"{source}: {describe_error(exc)}") from exc


def policy_yaml(config: PolicyConfig) -> str:
    """The policy as YAML (every field, defaults included): a starting file for operators."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
