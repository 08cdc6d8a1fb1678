"""Command signatures: HMAC-SHA256 over the command's canonical JSON (without the signature).

Consumers verify with the same key before acting, so a command on a decision topic cannot be
forged or altered by anyone who can only write to Kafka.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from fleetwise.schemas import Command

# A development key so replays and demos are signed and verifiable; deployments set their own
# (FLEETWISE_SIGNING_KEY, read by the adapters, never by the core).
DEV_SIGNING_KEY = b"fleetwise-dev-key-not-for-production"


def canonical_bytes(command: Command) -> bytes:
    data = command.model_dump(mode="json", exclude={"signature"}, exclude_none=True)
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def sign(command: Command, key: bytes = DEV_SIGNING_KEY) -> Command:
    """Return a copy of the command carrying its signature ("hmac-sha256:<hex>")."""
    digest = hmac.new(key, canonical_bytes(command), hashlib.sha256).hexdigest()
    return command.model_copy(update={"signature": f"hmac-sha256:{digest}"})


def verify(command: Command, key: bytes = DEV_SIGNING_KEY) -> bool:
    expected = sign(command, key).signature
    return hmac.compare_digest(expected, command.signature)
