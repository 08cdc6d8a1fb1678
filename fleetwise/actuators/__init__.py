"""Policies that turn predictions and fleet state into signed, idempotent commands."""

from fleetwise.actuators.policy import ActionPolicy, PolicyConfig, command_id
from fleetwise.actuators.signing import sign, verify

__all__ = ["ActionPolicy", "PolicyConfig", "command_id", "sign", "verify"]
