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
    ENV_KEYS,
    ENV_KEYS_FILE,
    ENV_OPERATOR_KEYS,
    ENV_OPERATOR_KEYS_FILE,
    Keyring,
    KeyringError,
    operator_keyring,
)


def _keyring(env: Mapping[str, str], keys_var: str, file_var: str) -> Keyring | None:
    if env.get(keys_var):
        return Keyring.parse(env[keys_var])
    if env.get(file_var):
        path = Path(env[file_var])
        try:
            return Keyring.parse(path.read_text())
        except OSError as exc:
            raise KeyringError(f"{file_var}={path}: {exc.strerror}") from exc
    return None


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
