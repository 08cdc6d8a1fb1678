"""verify_command: the one check every consumer runs (DESIGN.md, "Command lifecycle")."""

from __future__ import annotations

import pytest

from fleetwise.actuators import Keyring, KeyringError, sign, verify_command
from fleetwise.schemas import Ack, Command, topic
from fleetwise.streams.keys import keyring_from_env

OLD = Keyring.parse("k1=first-secret-0123456789")
ROTATED = Keyring.parse("k2=second-secret-0123456789,k1=first-secret-0123456789")


def _cmd(**kw) -> Command:
    base = dict(id="rebalance-1", type="rebalance", ts=100.0, job="llm", reason="rank 3 slow",
                seq=5, expires_ts=700.0, params={"micro_batches": {"0": 4, "1": 2}})
    base.update(kw)
    return Command(**base)


def test_a_signed_command_verifies_and_carries_its_key_id() -> None:
    cmd = sign(_cmd(), OLD)
    assert cmd.key_id == "k1" and cmd.signature.startswith("hmac-sha256:")
    assert verify_command(cmd, OLD, now=200.0, last_seq=4, job="llm")


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda c: c.model_copy(update={"signature": ""}), "unsigned"),
        (lambda c: c.model_copy(update={"params": {"micro_batches": {"0": 6}}}), "bad signature"),
        (lambda c: c.model_copy(update={"key_id": "k9"}), "unknown key id 'k9'"),
        (lambda c: sign(c, Keyring.parse("k1=an-attackers-secret-0000")), "bad signature"),
    ],
)
def test_forged_altered_or_unsigned_commands_are_refused(tamper, reason: str) -> None:
    verdict = verify_command(tamper(sign(_cmd(), OLD)), OLD, now=200.0)
    assert not verdict and reason in verdict.reason


def test_expired_replayed_and_foreign_commands_are_refused_each_with_its_reason() -> None:
    cmd = sign(_cmd(), OLD)
    assert "expired" in verify_command(cmd, OLD, now=700.5).reason
    assert verify_command(cmd, OLD, now=700.0)  # the deadline itself is still valid
    assert "out of sequence" in verify_command(cmd, OLD, now=200.0, last_seq=5).reason
    assert "out of sequence" in verify_command(sign(_cmd(seq=None), OLD), OLD, now=1, last_seq=0).reason
    assert "not 'other'" in verify_command(cmd, OLD, now=200.0, job="other").reason


def test_rotation_keeps_old_commands_valid_while_new_ones_use_the_new_key() -> None:
    old = sign(_cmd(), OLD)
    new = sign(_cmd(id="rebalance-2", seq=6), ROTATED)
    assert new.key_id == "k2"
    assert verify_command(old, ROTATED, now=200.0) and verify_command(new, ROTATED, now=200.0)
    assert "unknown key id 'k2'" in verify_command(new, OLD, now=200.0).reason


def test_keyring_specifications_are_checked_and_read_from_env_or_file(tmp_path) -> None:
    with pytest.raises(KeyringError, match="entry 1: expected 'id=secret'"):
        Keyring.parse("no-equals-sign")
    with pytest.raises(KeyringError, match="appears twice"):
        Keyring.parse("a=0123456789abcdef0,a=0123456789abcdef1")
    with pytest.raises(KeyringError, match=">= 16 bytes"):
        Keyring.parse("a=short")
    assert Keyring.parse("h=hex:" + "ab" * 16).keys["h"] == b"\xab" * 16
    secret_file = tmp_path / "keys"
    secret_file.write_text("# mounted secret\nk2=second-secret-0123456789\nk1=first-secret-0123456789\n")
    ring = keyring_from_env({"FLEETWISE_SIGNING_KEYS_FILE": str(secret_file)})
    assert ring.active == "k2" and set(ring.keys) == {"k1", "k2"}
    assert keyring_from_env({"FLEETWISE_SIGNING_KEYS": "k1=first-secret-0123456789"}).active == "k1"
    with pytest.raises(KeyringError, match="FLEETWISE_SIGNING_KEYS_FILE"):
        keyring_from_env({"FLEETWISE_SIGNING_KEYS_FILE": str(tmp_path / "missing")})


def test_ack_record_and_topic() -> None:
    ack = Ack(command_id="checkpoint-1", ts=5.0, job="llm", by="training-plugin", status="done",
              step=120, result={"checkpoint_uri": "file:///ckpt/120", "step": 120})
    assert Ack.model_validate_json(ack.to_json()) == ack
    assert topic("fleetwise.acks").value_type is Ack
    with pytest.raises(ValueError, match="status"):
        Ack(command_id="x", ts=1.0, by="kube-consumer", status="maybe")
