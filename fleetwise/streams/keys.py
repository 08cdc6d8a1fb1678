"""The deployment's signing keys (commands, operator actions), read from the environment (the one
place keys are read).

Shared by the worker, the training plugin and the kube consumer; the keyring itself and the
checks over it are core (`fleetwise.actuators.signing`), which does no I/O.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from fleetwise.actuators.signing import (
    ENV_IDENTITY_KEY,
    ENV_IDENTITY_KEY_FILE,
    ENV_IDENTITY_MASTER_KEY,
    ENV_IDENTITY_MASTER_KEY_FILE,
    ENV_KEYS,
    ENV_KEYS_FILE,
    ENV_OPERATOR_KEYS,
    ENV_OPERATOR_KEYS_FILE,
    IdentityKeys,
    IdentityVerifier,
    Keyring,
    KeyringError,
    operator_keyring,
)


def _setting(env: Mapping[str, str], var: str, file_var: str) -> str | None:
    """The variable's text, else the text of the file the `_FILE` variable names, else None."""
    if env.get(var):
        return env[var]
    if env.get(file_var):
        path = Path(env[file_var])
        try:
            return path.read_text()
        except OSError as exc:
            raise KeyringError(f"{file_var}={path}: {exc.strerror}") from exc
    return None


def _keyring(env: Mapping[str, str], keys_var: str, file_var: str) -> Keyring | None:
    text = _setting(env, keys_var, file_var)
    return None if text is None else Keyring.parse(text)


def identity_master_key_from_env(environ: Mapping[str, str] | None = None) -> bytes | None:
    """FLEETWISE_IDENTITY_MASTER_KEY (a secret as text, or `hex:...`), else the file named by
    FLEETWISE_IDENTITY_MASTER_KEY_FILE; None when neither is set (producers' messages unsigned)."""
    env = os.environ if environ is None else environ
    text = _setting(env, ENV_IDENTITY_MASTER_KEY, ENV_IDENTITY_MASTER_KEY_FILE)
    if text is None:
        return None
    text = text.strip()
    if text.startswith("hex:"):
        try:
            return bytes.fromhex(text[4:])
        except ValueError as exc:
            raise KeyringError(f"{ENV_IDENTITY_MASTER_KEY}: not hex after 'hex:'") from exc
    return text.encode()


def identity_verifier_from_env(environ: Mapping[str, str] | None = None) -> IdentityVerifier | None:
    """The workers' check of producers' messages when an identity master key is set (then every
    telemetry batch, inventory, step record and ack must be signed by its writer), else None."""
    master = identity_master_key_from_env(environ)
    return None if master is None else IdentityVerifier(master)


def identity_keys_from_env(environ: Mapping[str, str] | None = None) -> IdentityKeys | None:
    """What a producer signs with: FLEETWISE_IDENTITY_KEY[_FILE] (its own `identity=hex:<key>`),
    else the master key (a simulator publishing many nodes), else None (unsigned)."""
    env = os.environ if environ is None else environ
    text = _setting(env, ENV_IDENTITY_KEY, ENV_IDENTITY_KEY_FILE)
    if text is not None:
        return IdentityKeys.parse(text)
    master = identity_master_key_from_env(env)
    return None if master is None else IdentityKeys(master=master)


def keyring_from_env(environ: Mapping[str, str] | None = None) -> Keyring:
    """FLEETWISE_SIGNING_KEYS (`id=secret,...`), else the file named by FLEETWISE_SIGNING_KEYS_FILE
    (a mounted secret, one `id=secret` per line), else the development key."""
    return _keyring(os.environ if environ is None else environ, ENV_KEYS, ENV_KEYS_FILE) or Keyring()


def operator_keyring_from_env(environ: Mapping[str, str] | None = None) -> Keyring:
    """The operators' keys: FLEETWISE_OPERATOR_KEYS, else FLEETWISE_OPERATOR_KEYS_FILE, else the
    development operator key. `fleetwise approve` / `gpu return` sign with its active key; the
    worker and the kube consumer verify with all of them."""
    env = os.environ if environ is None else environ
    return _keyring(env, ENV_OPERATOR_KEYS, ENV_OPERATOR_KEYS_FILE) or operator_keyring()
