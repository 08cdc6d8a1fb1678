"""The deployment's command-signing keys, read from the environment (the one place keys are read).

Shared by the worker, the training plugin and the kube consumer; the keyring itself and the
checks over it are core (`fleetwise.actuators.signing`), which does no I/O.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from fleetwise.actuators.signing import ENV_KEYS, ENV_KEYS_FILE, Keyring, KeyringError


def keyring_from_env(environ: Mapping[str, str] | None = None) -> Keyring:
    """FLEETWISE_SIGNING_KEYS (`id=secret,...`), else the file named by FLEETWISE_SIGNING_KEYS_FILE
    (a mounted secret, one `id=secret` per line), else the development key."""
    env = os.environ if environ is None else environ
    if env.get(ENV_KEYS):
        return Keyring.parse(env[ENV_KEYS])
    if env.get(ENV_KEYS_FILE):
        path = Path(env[ENV_KEYS_FILE])
        try:
            return Keyring.parse(path.read_text())
        except OSError as exc:
            raise KeyringError(f"{ENV_KEYS_FILE}={path}: {exc.strerror}") from exc
    return Keyring()
