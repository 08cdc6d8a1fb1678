"""Policies that turn predictions and fleet state into signed, idempotent commands."""

from fleetwise.actuators.policy import ActionPolicy, PolicyConfig, command_id
from fleetwise.actuators.signing import (
    Keyring,
    KeyringError,
    Verdict,
    keyring_from_env,
    sign,
    verify,
    verify_command,
)

__all__ = [
    "ActionPolicy", "Keyring", "KeyringError", "PolicyConfig", "Verdict", "command_id",
    "keyring_from_env", "sign", "verify", "verify_command",
]
