"""Command signatures and the one check every consumer runs before acting (`verify_command`).

HMAC-SHA256 over the command's canonical JSON (without the signature), under a key named by
the command's `key_id`. Keys rotate: a `Keyring` signs with its active key and verifies with
any key it holds, so two keys are valid at once while consumers pick up the new one.

Operator actions (`fleetwise approve`, `fleetwise gpu return`) are signed the same way under
the operators' own keyring (`verify_operator`), so a command-signing host cannot approve its
own held commands, and an operator's machine holds no command key.

Producers' messages (agents' telemetry and inventories, plugins' step records and acks, the kube
consumer's acks) carry an HMAC over their bytes under the producer's own identity key, derived
from the deployment's identity master key (`identity_key`): the workers hold the master, each
producer only its own key, so a compromised node or training job cannot write under another
node's or job's name (`IdentityVerifier`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from fleetwise.schemas import Command, OperatorAction
from fleetwise.schemas.topics import ACKS, INVENTORY, TELEMETRY_GPU, TELEMETRY_STEPS

# A development key so replays and demos are signed and verifiable; deployments set their own
# (FLEETWISE_SIGNING_KEYS or FLEETWISE_SIGNING_KEYS_FILE, read by
# `fleetwise.streams.keys.keyring_from_env`: reading the environment is the adapters' job).
DEV_SIGNING_KEY = b"fleetwise-dev-key-not-for-production"
DEV_KEY_ID = "dev"

ENV_KEYS = "FLEETWISE_SIGNING_KEYS"
ENV_KEYS_FILE = "FLEETWISE_SIGNING_KEYS_FILE"
# The operators' keyring (its own secrets; the development one when unset).
DEV_OPERATOR_KEY = b"fleetwise-dev-operator-key-not-for-production"
DEV_OPERATOR_KEY_ID = "dev-operator"
ENV_OPERATOR_KEYS = "FLEETWISE_OPERATOR_KEYS"
ENV_OPERATOR_KEYS_FILE = "FLEETWISE_OPERATOR_KEYS_FILE"
# The identity master key (workers; simulators publishing many nodes) and one producer's own key
# (`identity=hex:<key>`, as `fleetwise keys identity ID` prints it).
ENV_IDENTITY_MASTER_KEY = "FLEETWISE_IDENTITY_MASTER_KEY"
ENV_IDENTITY_MASTER_KEY_FILE = "FLEETWISE_IDENTITY_MASTER_KEY_FILE"
ENV_IDENTITY_KEY = "FLEETWISE_IDENTITY_KEY"
ENV_IDENTITY_KEY_FILE = "FLEETWISE_IDENTITY_KEY_FILE"
# The Kafka header of a signed message: `<identity>;hmac-sha256:<hex over the value's bytes>`.
SIGNATURE_HEADER = "fleetwise-signature"
_IDENTITY_KEY_CONTEXT = b"fleetwise producer identity key v1\x00"


class KeyringError(ValueError):
    """A key specification that cannot be used (names the entry that is wrong)."""


ED25519 = "ed25519:"  # a private key entry's prefix (base64 of the 32-byte seed), and a signature's
ED25519_PUBLIC = "ed25519-pub:"  # a public key entry's prefix (base64 of the 32-byte key)


@dataclass(frozen=True)
class Keyring:
    """Signing keys by id; `active` signs, every key verifies (rotation: two keys at once).

    `keys` are HMAC secrets (a verifier can also sign). `private` / `public` are Ed25519 keys
    (raw 32 bytes): a holder of only the public key verifies and cannot sign, so consumers need
    no secret. A keyring with no key that can sign has `active` "" (it only verifies)."""

    keys: Mapping[str, bytes] = field(default_factory=lambda: {DEV_KEY_ID: DEV_SIGNING_KEY})
    active: str = DEV_KEY_ID
    private: Mapping[str, bytes] = field(default_factory=dict)
    public: Mapping[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (self.keys or self.private or self.public):
            raise KeyringError("a keyring needs at least one key")
        if self.active and self.active not in self.keys and self.active not in self.private:
            raise KeyringError(f"active key id {self.active!r} is not among {sorted(self.ids())}")
        for key_id, secret in self.keys.items():
            if not key_id or len(secret) < 16:
                raise KeyringError(f"key {key_id!r}: a key id must be non-empty and its secret >= 16 bytes")
        for key_id, raw in {**self.private, **self.public}.items():
            if not key_id or len(raw) != 32:
                raise KeyringError(f"key {key_id!r}: an Ed25519 key is 32 bytes, got {len(raw)}")

    def ids(self) -> list[str]:
        return sorted({*self.keys, *self.private, *self.public})

    @classmethod
    def parse(cls, text: str) -> Keyring:
        """`id=secret` entries separated by commas or newlines; the first entry that can sign is
        active (none: the keyring only verifies).

        A secret is taken as UTF-8 text, or as hex when prefixed with `hex:`; `ed25519:<base64>`
        is an Ed25519 private key (signs and verifies), `ed25519-pub:<base64>` a public one
        (verifies only); `fleetwise keys generate` prints a pair.
        """
        keys: dict[str, bytes] = {}
        private: dict[str, bytes] = {}
        public: dict[str, bytes] = {}
        signers: list[str] = []
        for n, raw in enumerate(text.replace(",", "\n").splitlines(), start=1):
            entry = raw.strip()
            if not entry or entry.startswith("#"):
                continue
            key_id, sep, secret = entry.partition("=")
            key_id, secret = key_id.strip(), secret.strip()
            if not sep or not key_id or not secret:
                raise KeyringError(f"signing key entry {n}: expected 'id=secret', got {entry[:40]!r}")
            if key_id in keys or key_id in private or key_id in public:
                raise KeyringError(f"signing key entry {n}: key id {key_id!r} appears twice")
            if secret.startswith((ED25519, ED25519_PUBLIC)):
                is_public = secret.startswith(ED25519_PUBLIC)
                raw_key = _b64_key(key_id, secret[len(ED25519_PUBLIC if is_public else ED25519):])
                if is_public:
                    public[key_id] = raw_key
                    continue
                private[key_id] = raw_key
                public[key_id] = ed25519_public_key(raw_key)
            elif secret.startswith("hex:"):
                try:
                    keys[key_id] = bytes.fromhex(secret[4:])
                except ValueError as exc:
                    raise KeyringError(f"signing key {key_id!r}: not hex after 'hex:'") from exc
            else:
                keys[key_id] = secret.encode()
            signers.append(key_id)
        if not (keys or public):
            raise KeyringError("no signing keys in the specification")
        return cls(keys=keys, active=signers[0] if signers else "", private=private, public=public)


def _b64_key(key_id: str, text: str) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise KeyringError(f"signing key {key_id!r}: not base64 after the ed25519 prefix") from exc
    if len(raw) != 32:
        raise KeyringError(f"signing key {key_id!r}: an Ed25519 key is 32 bytes, got {len(raw)}")
    return raw


def ed25519_public_key(private: bytes) -> bytes:
    """The raw public key of a raw Ed25519 private key (seed)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    public = Ed25519PrivateKey.from_private_bytes(private).public_key()
    return public.public_bytes(Encoding.Raw, PublicFormat.Raw)


def generate_ed25519_entries(key_id: str, seed: bytes | None = None) -> tuple[str, str]:
    """A new Ed25519 key as keyring entries: (`id=ed25519:<private>` for the signers,
    `id=ed25519-pub:<public>` for the verifiers). `seed`: 32 bytes (tests), else random."""
    import os

    private = seed if seed is not None else os.urandom(32)
    pub = ed25519_public_key(private)
    return (f"{key_id}={ED25519}{base64.b64encode(private).decode()}",
            f"{key_id}={ED25519_PUBLIC}{base64.b64encode(pub).decode()}")


def operator_keyring() -> Keyring:
    """The development operators' keyring (deployments set FLEETWISE_OPERATOR_KEYS[_FILE])."""
    return Keyring(keys={DEV_OPERATOR_KEY_ID: DEV_OPERATOR_KEY}, active=DEV_OPERATOR_KEY_ID)


Signed = TypeVar("Signed", Command, OperatorAction)


def canonical_bytes(record: Command | OperatorAction) -> bytes:
    data = record.model_dump(mode="json", exclude={"signature"}, exclude_none=True)
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def _digest(record: Command | OperatorAction, key: bytes) -> str:
    return "hmac-sha256:" + hmac.new(key, canonical_bytes(record), hashlib.sha256).hexdigest()


def sign(record: Signed, key: bytes | Keyring = DEV_SIGNING_KEY) -> Signed:
    """A copy of the command (or operator action) carrying `key_id` and its signature
    ("hmac-sha256:<hex>", or "ed25519:<base64>" under an Ed25519 key).

    With raw key bytes (an HMAC secret) the record keeps the key id it has (the dev key's id
    when none).
    """
    if isinstance(key, Keyring):
        if not key.active:
            raise KeyringError(f"this keyring only verifies (public keys {sorted(key.public)}): "
                               "it cannot sign")
        key_id = key.active
        unsigned = record.model_copy(update={"key_id": key_id, "signature": ""})
        if key_id in key.private:
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

            sig = Ed25519PrivateKey.from_private_bytes(key.private[key_id]).sign(canonical_bytes(unsigned))
            return unsigned.model_copy(update={"signature": ED25519 + base64.b64encode(sig).decode()})
        return unsigned.model_copy(update={"signature": _digest(unsigned, key.keys[key_id])})
    unsigned = record.model_copy(update={"key_id": record.key_id or DEV_KEY_ID, "signature": ""})
    return unsigned.model_copy(update={"signature": _digest(unsigned, key)})


def verify(command: Command, key: bytes = DEV_SIGNING_KEY) -> bool:
    """True when the signature matches under this key (no lifecycle checks: see verify_command)."""
    return bool(command.signature) and hmac.compare_digest(_digest(command, key), command.signature)


def _verify_signature(record: Command | OperatorAction, keys: Keyring | Mapping[str, bytes],
                      default_id: str, what: str) -> Verdict:
    if not record.signature:
        return Verdict(False, f"unsigned: the {what} carries no signature")
    ring, public = (keys.keys, keys.public) if isinstance(keys, Keyring) else (keys, {})
    key_id = record.key_id or default_id
    if key_id not in ring and key_id not in public:
        held = keys.ids() if isinstance(keys, Keyring) else sorted(ring)
        return Verdict(False, f"unknown key id {key_id!r} (this consumer holds {held})")
    forged = Verdict(False, f"bad signature under key {key_id!r}: forged or altered")
    if record.signature.startswith(ED25519):
        if key_id not in public:
            return forged
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            sig = base64.b64decode(record.signature[len(ED25519):], validate=True)
            Ed25519PublicKey.from_public_bytes(public[key_id]).verify(sig, canonical_bytes(record))
        except (InvalidSignature, ValueError):
            return forged
        return Verdict(True)
    if key_id not in ring or not hmac.compare_digest(_digest(record, ring[key_id]), record.signature):
        return forged
    return Verdict(True)


@dataclass(frozen=True)
class Verdict:
    """`verify_command`'s answer: act, or refuse with the reason the `rejected` ack carries."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def verify_command(
    command: Command,
    keys: Keyring | Mapping[str, bytes],
    now: float,
    last_seq: int | None = None,
    job: str | None = None,
) -> Verdict:
    """The only way a consumer decides to act on a command (DESIGN.md, "Command lifecycle").

    Refuses, each with its own reason: unsigned, unknown key id, forged or altered (bad HMAC),
    expired (`now` past `expires_ts`), out of sequence (`seq` not above the last one this
    consumer applied for the job: a replayed or late command), and, when `job` is given, a
    command for another job. Duplicates of an applied command are the consumer's to detect by
    id before calling this (they are acked `done`/"duplicate", not rejected).
    """
    signed = _verify_signature(command, keys, DEV_KEY_ID, "command")
    if not signed:
        return signed
    if job is not None and command.job != job:
        return Verdict(False, f"command is for job {command.job!r}, not {job!r}")
    if command.expires_ts is not None and now > command.expires_ts:
        return Verdict(False, f"expired at {command.expires_ts:.3f} (now {now:.3f})")
    if last_seq is not None and (command.seq is None or command.seq <= last_seq):
        return Verdict(False, f"out of sequence: seq {command.seq} is not after the last applied {last_seq}")
    return Verdict(True)


def verify_operator(action: OperatorAction, keys: Keyring | Mapping[str, bytes]) -> Verdict:
    """Whether an operator action may be acted on: signed under a key of the operators'
    keyring and unaltered (an approval names its command, a return its GPU: replaying one
    changes nothing that the command's or the GPU's own state has not already settled)."""
    return _verify_signature(action, keys, DEV_OPERATOR_KEY_ID, "operator action")


# -- producers' identities: node agents, training plugins, the kube consumer -------------------
NODE_PREFIX, JOB_PREFIX = "node/", "job/"
KUBE_CONSUMER_IDENTITY = "kube-consumer"


def node_identity(node: str) -> str:
    return NODE_PREFIX + node


def job_identity(job: str) -> str:
    return JOB_PREFIX + job


def expected_identities(topic: str, key: str | None) -> tuple[str, ...]:
    """Who may write a message of `topic` (a registry name) under message key `key`: the node
    its telemetry or inventory is keyed by, the job its step records or its plugin's acks are
    keyed by, or the kube consumer (its acks, keyed by job or node). () for other topics and
    for a message without a key."""
    if not key:
        return ()
    if topic in (TELEMETRY_GPU.name, INVENTORY.name):
        return (node_identity(key),)
    if topic == TELEMETRY_STEPS.name:
        return (job_identity(key),)
    if topic == ACKS.name:
        return (job_identity(key), KUBE_CONSUMER_IDENTITY)
    return ()


SIGNED_TOPICS = frozenset({TELEMETRY_GPU.name, INVENTORY.name, TELEMETRY_STEPS.name, ACKS.name})


def identity_key(master: bytes, identity: str) -> bytes:
    """A producer's own key: HMAC-SHA256(master, context || identity). Knowing one identity's
    key tells nothing about another's or the master (HMAC as a PRF, as in HKDF's expand step)."""
    if len(master) < 16:
        raise KeyringError("the identity master key must be >= 16 bytes")
    if not identity or identity in (NODE_PREFIX, JOB_PREFIX):
        raise KeyringError(f"an identity key needs a name, got {identity!r}")
    return hmac.new(master, _IDENTITY_KEY_CONTEXT + identity.encode(), hashlib.sha256).digest()


@dataclass(frozen=True)
class IdentityKeys:
    """What a producer signs its messages with: its own identity's key (`identity`, `key`: an
    agent `node/<node>`, a plugin `job/<job>`, the `kube-consumer`), or the master (a simulator
    publishing many nodes, a test), from which each identity's key is derived."""

    master: bytes | None = None
    identity: str = ""
    key: bytes = b""

    def __post_init__(self) -> None:
        if self.master is None and not (self.identity and len(self.key) >= 16):
            raise KeyringError("identity keys need the master key, or an identity and its key (>= 16 bytes)")

    @classmethod
    def parse(cls, text: str) -> IdentityKeys:
        """One identity's key: `identity=hex:<key>` (what `fleetwise keys identity` prints)."""
        ring = Keyring.parse(text)
        if len(ring.keys) != 1 or ring.private or ring.public:
            raise KeyringError(f"a producer holds exactly one `identity=hex:<key>` entry, got "
                               f"{len(ring.ids())} or an Ed25519 key")
        return cls(identity=ring.active, key=ring.keys[ring.active])

    def signs_as(self, topic: str, key: str) -> str:
        """The identity a message of `topic` under `key` is signed as: this producer's own, or,
        holding the master, the first that may write it."""
        if self.master is None:
            return self.identity
        allowed = expected_identities(topic, key)
        if not allowed:
            raise KeyringError(f"{topic} messages are not signed by producers")
        return allowed[0]

    def header(self, value: bytes, identity: str) -> bytes:
        """The `SIGNATURE_HEADER` value of a message signed as `identity`."""
        if self.master is not None:
            key = identity_key(self.master, identity)
        elif identity == self.identity:
            key = self.key
        else:
            raise KeyringError(f"this key signs as {self.identity!r}, not {identity!r}")
        return f"{identity};hmac-sha256:{hmac.new(key, value, hashlib.sha256).hexdigest()}".encode()


class IdentityVerifier:
    """The workers' check of producers' messages (`SIGNED_TOPICS`): signed as an identity that
    may write the message (by its topic and key: `expected_identities`; the worker also checks
    that the records name the node or job they are keyed by) under that identity's key."""

    def __init__(self, master: bytes) -> None:
        identity_key(master, KUBE_CONSUMER_IDENTITY)  # refuses a short master now, not at a message
        self._master = master
        self._keys: dict[str, bytes] = {}  # identity -> its key (derived once it signed a message)

    def check(self, topic: str, value: bytes | None, key: bytes | str | None,
              header: bytes | None) -> Verdict:
        """Whether the message may be read; the reason when not (the dead letter's)."""
        if header is None:
            return Verdict(False, f"unsigned: no {SIGNATURE_HEADER} header (the workers require signed "
                                  f"{topic} messages: FLEETWISE_IDENTITY_KEY on the producer)")
        text = header.decode("utf-8", "replace")
        identity, sep, signature = text.partition(";")
        if not sep or not identity or not signature.startswith("hmac-sha256:"):
            return Verdict(False, f"malformed {SIGNATURE_HEADER} header {text[:80]!r} "
                                  "(expected 'identity;hmac-sha256:<hex>')")
        keyed = key.decode("utf-8", "replace") if isinstance(key, bytes | bytearray) else key
        allowed = expected_identities(topic, keyed)
        if identity not in allowed:
            who = f"only {' or '.join(map(repr, allowed))}" if allowed else "no producer"
            return Verdict(False, f"signed as {identity!r} but keyed {keyed!r}: {who} may write it")
        own = self._keys.get(identity) or identity_key(self._master, identity)
        digest = "hmac-sha256:" + hmac.new(own, value or b"", hashlib.sha256).hexdigest()
        if not hmac.compare_digest(digest, signature):
            return Verdict(False, f"bad signature under {identity!r}'s key: forged or altered")
        # Kept only for identities that signed: forged messages under made-up keys must not
        # grow the cache.
        self._keys[identity] = own
        return Verdict(True)
