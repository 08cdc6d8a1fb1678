"""Policies that turn predictions, acks and fleet state into signed, idempotent commands."""

from fleetwise.actuators.config import PolicyConfig, PolicyFileError, parse_policy, policy_yaml
from fleetwise.actuators.fleet import FleetState, PendingCommand
from fleetwise.actuators.ids import command_id
from fleetwise.actuators.policy import ActionPolicy
from fleetwise.actuators.signing import (
    Keyring,
    KeyringError,
    Verdict,
    generate_ed25519_entries,
    operator_keyring,
    sign,
    verify,
    verify_command,
    verify_operator,
)

__all__ = [
    "ActionPolicy", "FleetState", "Keyring", "KeyringError", "PendingCommand", "PolicyConfig",
    "PolicyFileError", "Verdict", "command_id", "generate_ed25519_entries", "parse_policy", "policy_yaml",
    "operator_keyring", "sign", "verify", "verify_command", "verify_operator",
]
