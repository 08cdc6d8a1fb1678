"""Policies that turn predictions, acks and fleet state into signed, idempotent commands."""

from fleetwise.actuators.config import PolicyConfig, PolicyFileError, parse_policy, policy_yaml
from fleetwise.actuators.fleet import FleetState, PendingCommand
from fleetwise.actuators.ids import command_id
from fleetwise.actuators.policy import ActionPolicy
from fleetwise.actuators.signing import (
    Keyring,
    KeyringError,
    Verdict,
    sign,
    verify,
    verify_command,
)

__all__ = [
    "ActionPolicy", "FleetState", "Keyring", "KeyringError", "PendingCommand", "PolicyConfig",
    "PolicyFileError", "Verdict", "command_id", "parse_policy", "policy_yaml",
    "sign", "verify", "verify_command",
]
