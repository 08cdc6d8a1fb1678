"""Checkpoints and membership changes around torch's elastic agent (torchrun, c10d rendezvous).

How a membership change happens (torch/distributed/elastic/agent/server/api.py, `_invoke_run`,
and rendezvous/dynamic_rendezvous.py):

- every agent (`torchrun --nnodes MIN:MAX --rdzv-backend c10d`, one per node) watches its
  workers; when one exits non-zero it restarts its workers (counted against
  `--max-restarts`), which means a new rendezvous round;
- a round forms only when every participant of the previous one has left it (each agent
  restarting its workers leaves and re-joins) or has been declared dead: an agent whose
  heartbeats stop for `keep_alive_interval x keep_alive_max_attempt` is removed;
- while a round is running, a new agent joining goes to the wait list, and every running
  agent, seeing `num_nodes_waiting() > 0`, restarts its workers (not counted as a failure);
- an agent that ends because its workers all exited 0 closes the rendezvous for good
  (`launch_agent`'s `rdzv_handler.shutdown()`), while one ended by a signal does not
  ("when the agent dies with a signal do NOT shutdown the rdzv_handler").

So the plugin changes membership like this, always from a checkpoint taken at one step
boundary on every rank (`save_checkpoint`, torch.distributed.checkpoint, with the sampler's
position and the command consumer's state beside it):

- drain / resize down: the leaving rank signals its own agent (SIGTERM: the node leaves,
  the rendezvous stays open) and exits; the staying ranks exit with `RESTART_EXIT_CODE`, their
  agents restart them, and the next round forms without the leaver once its heartbeats
  lapse. The new workers load the checkpoint resharded (`load_checkpoint`) and continue at the
  same step and data position;
- resize up: the ranks checkpoint and park at the boundary; the orchestrator starts the new
  node's agent, which joins the wait list; the running agents restart their workers and the
  round forms at the larger size (a parked worker that is never restarted gives up after
  `park_timeout_s` and exits for a re-rendezvous at whatever size there is);
- failure (a rank or node SIGKILLed): the survivors' collectives fail, they exit non-zero,
  their agents restart them, and the group resumes from the last periodic checkpoint, at
  the smaller size when the node is gone.

The rendezvous store must outlive any one node: run it apart from the agents
(`serve_store`, or `python -m fleetwise.training.elastic store --port P`) and give the agents
`--rdzv-conf is_host=false` (`agent_command` does); and each round's workers need a store of
their own (`agent_env`: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "META_FILE",
    "RESTART_EXIT_CODE",
    "agent_command",
    "agent_env",
    "checkpoint_dir_for",
    "latest_checkpoint",
    "leave_agent",
    "load_checkpoint",
    "path_of",
    "resolve_checkpoint_uri",
    "read_meta",
    "save_checkpoint",
    "serve_store",
    "under_elastic_agent",
]

# A worker exiting with this code asks its agent for a restart, i.e. a new rendezvous round
# (EX_TEMPFAIL: "try again").
RESTART_EXIT_CODE = 75
META_FILE = "fleetwise.json"


def path_of(uri: str | os.PathLike[str]) -> Path:
    """A checkpoint URI as a local (or shared file system) path: `file:///x` or a plain path."""
    text = os.fspath(uri)
    if text.startswith("file://"):
        return Path(text[len("file://"):])
    if "://" in text:
        raise ValueError(f"checkpoint URI {text!r}: only file:// URIs and paths are supported here")
    return Path(text)


JOB_STORE = "fleetwise://checkpoints/"  # the policy's URIs: a job's own checkpoint store


def resolve_checkpoint_uri(uri: str | os.PathLike[str], *, job: str,
                           root: str | os.PathLike[str] | None) -> Path:
    """A checkpoint URI as a path. `fleetwise://checkpoints/<job>/<entry>` (what the control
    plane puts in a migration, which cannot know where each job keeps its checkpoints) is
    `<entry>` under this job's checkpoint directory `root`; `file://` URIs and paths as
    `path_of`."""
    text = os.fspath(uri)
    if not text.startswith(JOB_STORE):
        return path_of(text)
    owner, _, entry = text[len(JOB_STORE):].partition("/")
    if owner != job:
        raise ValueError(f"checkpoint URI {text!r} is job {owner!r}'s store, not {job!r}'s")
    if not entry or "/" in entry or entry in (".", ".."):
        raise ValueError(f"checkpoint URI {text!r}: expected {JOB_STORE}<job>/<name>")
    if root is None:
        raise ValueError(f"checkpoint URI {text!r} is in the job's checkpoint store, and the plugin "
                         "has no checkpoint_dir")
    return path_of(root) / entry


def checkpoint_dir_for(root: str | os.PathLike[str], step: int) -> Path:
    """Where the checkpoint taken after `step` steps goes under `root`."""
    return path_of(root) / f"step-{step:09d}"


# A key only the older, unflattened optimizer state has: the list of each group's parameters.
_GROUP_PARAMS = re.compile(r"optim\.param_groups\.\d+\.params$")


def _state_dict_options() -> Any:
    """Optimizer state flattened to one entry per parameter name (`param_groups.<fqn>.lr`,
    `state.<fqn>.momentum_buffer`): ranks holding different parameters (pipeline stages)
    then save no conflicting `param_groups` list, and a load under other stage boundaries
    finds every parameter's hyperparameters and state by its name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def save_checkpoint(path: str | os.PathLike[str], model: Any, optimizer: Any, meta: Mapping[str, Any],
                    group: Any = None) -> str:
    """Save model and optimizer with torch.distributed.checkpoint (every rank calls it), then
    rank 0 writes `meta` (plain JSON: step, sampler, consumer state) beside them, last, so a
    checkpoint directory with META_FILE is complete. Returns its file:// URI."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    target = path_of(path)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_state_dict_options())
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(target), process_group=group)
    dist.barrier(group=group)
    if dist.get_rank(group) == 0:
        tmp = target / (META_FILE + ".tmp")
        tmp.write_text(json.dumps(dict(meta), sort_keys=True))
        os.replace(tmp, target / META_FILE)
    dist.barrier(group=group)
    return target.resolve().as_uri()


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A complete checkpoint's meta (KeyError-free: raises FileNotFoundError when incomplete)."""
    return json.loads((path_of(path) / META_FILE).read_text())


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under `root` (the highest step in its meta file, periodic
    `step-*` or named, such as a migration's snapshot; ties by name), or None."""
    base = path_of(root)
    if not base.is_dir():
        return None
    done = []
    for p in base.iterdir():
        if (p / META_FILE).is_file():
            try:
                done.append((int(read_meta(p)["step"]), p.name, p))
            except (ValueError, KeyError, TypeError):
                continue  # not a checkpoint's meta
    return max(done)[2] if done else None


def load_checkpoint(path: str | os.PathLike[str], model: Any, optimizer: Any,
                    group: Any = None) -> dict[str, Any]:
    """Load a checkpoint into `model` and `optimizer` at this world size (DCP reshards: any
    number of ranks may load what any number saved); returns its meta."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    target = path_of(path)
    meta = read_meta(target)
    options = _state_dict_options()
    saved = dcp.FileSystemReader(str(target)).read_metadata().state_dict_metadata
    if any(_GROUP_PARAMS.match(key) for key in saved):
        options = None  # written before optimizer state was saved per parameter name (groups as a list)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(target), process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    return meta


def under_elastic_agent() -> bool:
    """True when this process is a worker started by torch's elastic agent (torchrun)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def leave_agent() -> bool:
    """Make this worker's node leave the job: SIGTERM its elastic agent (the parent process).

    A signalled agent stops its workers and exits without closing the rendezvous, so the
    other nodes re-rendezvous without it (an agent whose workers exit 0 would close it).
    Returns False when not under an agent."""
    if not under_elastic_agent():
        return False
    os.kill(os.getppid(), signal.SIGTERM)
    return True


def serve_store(port: int, host: str = "127.0.0.1", timeout_s: float = 300.0) -> Any:
    """A TCPStore server for the c10d rendezvous, outside every agent (keep the returned object
    alive as long as the job runs)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                    timeout=timedelta(seconds=timeout_s))


def agent_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """Environment for an agent: `base` (default os.environ) plus
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so each rendezvous round's workers get a fresh store
    from their rank 0. Shared, the rank-0 agent's store keeps the previous round's keys (the
    same process-group keys, no per-round prefix), and a new worker can read a departed
    worker's address and hang in its first collective."""
    env = dict(os.environ if base is None else base)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.update(extra)
    return env


def agent_command(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    endpoint: str,
    run_id: str,
    nnodes: str = "1:4",
    max_restarts: int = 20,
    monitor_interval: float = 0.2,
    keep_alive_interval: int = 1,
    keep_alive_max_attempt: int = 5,
    last_call_timeout: int = 1,
    join_timeout: int = 120,
    module: bool = False,
    python: str | None = None,
) -> list[str]:
    """The torchrun command line for one node's agent (`--nproc-per-node 1`): c10d rendezvous
    at `endpoint` (a store from `serve_store`), fast heartbeats so a departed node is noticed
    in ~keep_alive_interval x keep_alive_max_attempt seconds, a short last call. A node only
    refreshes its heartbeat when it is older than the interval, so in practice every ~2
    intervals: keep_alive_max_attempt < 3 declares live nodes dead (a joining node then forms a
    round of its own). `module`: `script`
    is a module name (`python -m`)."""
    conf = (f"is_host=false,keep_alive_interval={keep_alive_interval},"
            f"keep_alive_max_attempt={keep_alive_max_attempt},last_call_timeout={last_call_timeout},"
            f"join_timeout={join_timeout}")
    return [
        python or sys.executable, "-m", "torch.distributed.run",
        "--nnodes", nnodes, "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--rdzv-conf", conf, "--max-restarts", str(max_restarts),
        "--monitor-interval", str(monitor_interval), *(["--module"] if module else []),
        str(script), *args,
    ]


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetwise.training.elastic",
                                     description="Host a c10d rendezvous store apart from the agents.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    store = sub.add_parser("store", help="serve a TCPStore for --rdzv-endpoint HOST:PORT until killed")
    store.add_argument("--port", type=int, required=True)
    store.add_argument("--host", default="127.0.0.1")
    ns = parser.parse_args(argv)
    server = serve_store(ns.port, ns.host)
    print(f"rendezvous store on {ns.host}:{ns.port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        del server


if __name__ == "__main__":
    raise SystemExit(_main())
