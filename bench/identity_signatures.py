"""The worker's cost of producer identities: checking a node batch's signature
(`IdentityVerifier.check`, docs/security.md "Producer identities") against decoding the same
message (`ControlPlane.decode_messages`), and an Ed25519 verification of the same bytes (the
asymmetric alternative, not used), per message, CPU time, best of `--repeat`:

    .venv/bin/python bench/identity_signatures.py --messages 3000 --gpus 8

Node batches of `--gpus` GPUs with the usual DCGM fields, as an agent encodes them; at 25,000
samples/s of 8-GPU nodes a worker reads ~3,100 such messages per second.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from fleetwise.actuators.signing import IdentityKeys, IdentityVerifier, node_identity
from fleetwise.schemas import topics as T
from fleetwise.streams.pipeline import ControlPlane

MASTER = b"the-identity-master-key-0123456789"


def node_batches(messages: int, gpus: int) -> list[tuple[bytes, bytes]]:
    """(node, value) of `messages` batches over 1,000 nodes."""
    out = []
    for n in range(messages):
        node, ts = f"node-{n % 1000:04d}", 1764547200.0 + 10 * (n // 1000)
        samples = [{"ts": ts, "node": node, "gpu": g, "model": "NVIDIA H100 80GB HBM3",
                    "metrics": {"DCGM_FI_DEV_GPU_TEMP": 60 + g, "DCGM_FI_DEV_POWER_USAGE": 500.5,
                                "DCGM_FI_DEV_SM_CLOCK": 1980, "DCGM_FI_DEV_GPU_UTIL": 97,
                                "DCGM_FI_DEV_MEMORY_TEMP": 70, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 0,
                                "DCGM_FI_DEV_XID_ERRORS": 0}} for g in range(gpus)]
        out.append((node.encode(), json.dumps({"node": node, "ts": ts, "samples": samples}).encode()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=3000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    batches = node_batches(args.messages, args.gpus)
    signer = IdentityKeys(master=MASTER)
    headers = [signer.header(value, node_identity(key.decode())) for key, value in batches]
    size = sum(len(v) for _, v in batches) / len(batches)

    def verify() -> None:
        check = IdentityVerifier(MASTER).check  # a fresh worker: each node's key derived once
        topic = T.TELEMETRY_GPU.name
        for (key, value), header in zip(batches, headers, strict=True):
            assert check(topic, value, key, header)

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.from_private_bytes(bytes(32))
    public = private.public_key()
    ed_signatures = [private.sign(value) for _, value in batches]

    def ed25519() -> None:  # the asymmetric alternative, for comparison (not what the worker runs)
        for (_, value), sig in zip(batches, ed_signatures, strict=True):
            public.verify(sig, value)

    def decode() -> None:
        ControlPlane().decode_messages(T.TELEMETRY_GPU.name, [v for _, v in batches],
                                       [f"bench:{i}" for i in range(len(batches))])

    print(f"# {len(batches)} node batches of {args.gpus} GPUs ({size:,.0f} bytes each); "
          f"{platform.machine()}, Python {platform.python_version()}, CPU time of one thread, "
          f"best of {args.repeat}")
    results = {}
    for name, fn in (("signature check", verify), ("decode", decode), ("ed25519 verify", ed25519)):
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.process_time()
            fn()
            best = min(best, time.process_time() - t0)
        results[name] = best / len(batches) * 1e6
        print(f"{name:16s} {results[name]:7.1f} us per message")
    print(f"signature check / decode: {results['signature check'] / results['decode']:.2f}")


if __name__ == "__main__":
    main()
