"""The Helm chart (deploy/helm/fleetwise; issue 18 item 4).

helm is built from its Go module by ``deploy/helm/build-helm.sh`` (cached; ``make test`` runs
it first, the fixture again: a no-op when cached). Nothing here skips.

- ``helm lint`` (default values and everything on, ``--strict``) and ``helm template``;
- checks on the rendered objects: the consumer's RBAC is exactly what its code calls (derived
  from ``fleetwise/kube/consumer.py`` and equal to ``required_rbac()``), no other component can
  reach the API server, worker replicas <= partitions, secrets mounted and never inlined, the
  topic list equals the registry, the dashboard ConfigMap is deploy/grafana/fleetwise.json,
  every container's arguments parse with the real ``fleetwise`` CLI;
- the rendered chart, with every optional part on, is created with server-side dry-run on a
  real API server (``kube_api``). ServiceMonitor, PrometheusRule and KafkaTopic need CRDs:
  on a test API server (the fixture's own, or the one ``make test`` starts and names in
  FLEETWISE_KUBECONFIG) minimal CRDs for them are installed unless real ones are there (a
  schema that accepts any spec: the dry run checks the objects' names, kinds, metadata and
  namespaces; their specs are checked above). On a user's cluster (KUBECONFIG) nothing
  cluster-wide is installed: parts whose CRD is missing there are rendered off for the dry run.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "deploy" / "helm" / "fleetwise"
BUILD_HELM = REPO / "deploy" / "helm" / "build-helm.sh"
SIGNING = "k2=rotated-secret-number-two\nk1=old-secret-number-one\n"
OPERATOR_KEYS = "ops1=an-operators-secret-number-one\n"
SASL_PASSWORD = "sasl-pa55word-xyz"
POLICY = "failure:\n  mode: approve\nrails:\n  breaker_drains: 4\n"

ALL_ON = [
    "--set", "strimzi.enabled=true", "--set", "serviceMonitor.enabled=true",
    "--set", "prometheusRule.enabled=true", "--set", "kafka.security=SASL_SSL",
    "--set", "kafka.sasl.username=fleetwise", "--set", f"kafka.sasl.password={SASL_PASSWORD}",
    "--set", "kafka.tls.caSecret=fleetwise-cluster-ca-cert",
    "--set-string", f"signing.keys={SIGNING}", "--set-string", f"signing.operatorKeys={OPERATOR_KEYS}",
    "--set-string", f"worker.policy={POLICY}",
    "--set", "agent.labels.team=ml",
]


@pytest.fixture(scope="session")
def helm() -> str:
    """The helm binary (built from the Go module proxy on first use, then cached)."""
    proc = subprocess.run(["bash", str(BUILD_HELM)], capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        pytest.fail(f"build-helm.sh failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]


def run_helm(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([helm, *args], capture_output=True, text=True, timeout=120,
                          env={"HOME": "/tmp/fleetwise-helm", "PATH": "/usr/bin:/bin",
                               "HELM_CACHE_HOME": "/tmp/fleetwise-helm/cache",
                               "HELM_CONFIG_HOME": "/tmp/fleetwise-helm/config",
                               "HELM_DATA_HOME": "/tmp/fleetwise-helm/data"})
    if check:
        assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def render(helm: str, *args: str, namespace: str = "fleetwise", release: str = "fw") -> list[dict[str, Any]]:
    out = run_helm(helm, "template", release, str(CHART), "--namespace", namespace, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(objs: Iterable[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: Iterable[dict], kind: str, name_suffix: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"{kind} *{name_suffix}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


# --------------------------------------------------------------------------- lint, template
def test_helm_lint_default_and_all_on(helm: str) -> None:
    for args in ([], ALL_ON, ["--set", "agent.source=dcgm", "--set", "consumer.jobNamespace=training"]):
        proc = run_helm(helm, "lint", "--strict", str(CHART), *args)
        assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout, proc.stdout


def test_default_render_has_the_components(helm: str) -> None:
    objs = render(helm)
    kinds = sorted({o["kind"] for o in objs})
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet", "Deployment", "Role",
                     "RoleBinding", "Service", "ServiceAccount"]
    assert {o["metadata"]["name"] for o in by_kind(objs, "Deployment")} == {"fw-fleetwise-worker",
                                                                            "fw-fleetwise-consumer"}
    ds = one(objs, "DaemonSet", "-agent")
    assert pod_spec(ds)["containers"][0]["args"][:1] == ["agent"]
    # Optional CRD-backed objects are off by default; no Secret is made without a value.
    assert not [o for o in objs if o["kind"] in ("KafkaTopic", "ServiceMonitor", "PrometheusRule", "Secret")]


def _args_parse(args: list[str]) -> None:
    """The real CLI accepts the container's arguments (options exist, values have their types)."""
    import typer.main

    from fleetwise.cli import app

    cmd = typer.main.get_command(app)
    words = list(args)
    path = []
    while hasattr(cmd, "commands") and words and words[0] in cmd.commands:
        path.append(words[0])
        cmd = cmd.commands[words.pop(0)]
    assert path, f"no fleetwise subcommand in {args}"
    cmd.make_context(" ".join(["fleetwise", *path]), words)  # raises on an unknown option or bad value


def test_container_args_parse_with_the_cli(helm: str) -> None:
    for extra in ([], ALL_ON, ["--set", "agent.source=dcgm", "--set", "kafka.topicPrefix=t-",
                               "--set", "consumer.dryRun=true"]):
        objs = render(helm, *extra)
        workloads = by_kind(objs, "DaemonSet") + by_kind(objs, "Deployment")
        assert len(workloads) == 3
        for w in workloads:
            for c in pod_spec(w)["containers"]:
                _args_parse(c["args"])


def test_agent_sources(helm: str) -> None:
    nvml = pod_spec(one(render(helm), "DaemonSet", "-agent"))
    env = {e["name"]: e for e in nvml["containers"][0]["env"]}
    assert nvml["runtimeClassName"] == "nvidia"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # The agent watches GPUs, it does not take one from the jobs.
    resources = nvml["containers"][0]["resources"]
    assert not any("nvidia.com" in k for part in resources.values() for k in part)
    assert nvml["nodeSelector"] == {"nvidia.com/gpu.present": "true"}

    dcgm = pod_spec(one(render(helm, "--set", "agent.source=dcgm"), "DaemonSet", "-agent"))
    args = dcgm["containers"][0]["args"]
    assert args[args.index("--source") + 1] == "dcgm"
    assert args[args.index("--dcgm-url") + 1] == "http://$(NODE_IP):9400/metrics"
    assert "runtimeClassName" not in dcgm
    assert "NVIDIA_VISIBLE_DEVICES" not in {e["name"] for e in dcgm["containers"][0]["env"]}

    bad = run_helm(helm, "template", "fw", str(CHART), "--set", "agent.source=rocm", check=False)
    assert bad.returncode != 0 and "agent.source must be nvml or dcgm" in bad.stderr


# --------------------------------------------------------------------------- replicas
def test_worker_replicas_at_most_partitions(helm: str) -> None:
    from fleetwise.schemas import topics as T

    n = T.TELEMETRY_GPU.partitions
    ok = one(render(helm, "--set", f"worker.replicas={n}"), "Deployment", "-worker")
    assert ok["spec"]["replicas"] == n
    too_many = run_helm(helm, "template", "fw", str(CHART), "--set", f"worker.replicas={n + 1}", check=False)
    assert too_many.returncode != 0
    message = f"worker.replicas ({n + 1}) must be <= the partitions of fleetwise.telemetry.gpu ({n})"
    assert message in too_many.stderr
    zero = run_helm(helm, "template", "fw", str(CHART), "--set", "worker.replicas=0", check=False)
    assert zero.returncode != 0 and "worker.replicas must be at least 1" in zero.stderr
    two = run_helm(helm, "template", "fw", str(CHART), "--set", "consumer.replicas=2", check=False)
    assert two.returncode != 0 and "consumer.replicas must be 1, got 2" in two.stderr
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert 1 <= values["worker"]["replicas"] <= n


def test_topics_equal_the_registry_and_make_kafkatopics(helm: str) -> None:
    from fleetwise.schemas import topics as T

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    registry = [{"name": t.name, "partitions": t.partitions, "compacted": t.compacted} for t in T.TOPICS]
    assert values["kafka"]["topics"] == registry
    objs = render(helm, *ALL_ON, "--set", "kafka.topicPrefix=prod.")
    topics = {o["spec"]["topicName"]: o for o in by_kind(objs, "KafkaTopic")}
    assert set(topics) == {f"prod.{t.name}" for t in T.TOPICS}
    for t in T.TOPICS:
        kt = topics[f"prod.{t.name}"]
        assert kt["spec"]["partitions"] == t.partitions
        assert kt["spec"]["config"]["cleanup.policy"] == ("compact" if t.compacted else "delete")
        assert kt["metadata"]["labels"]["strimzi.io/cluster"] == "fleetwise"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", kt["metadata"]["name"])
    # With Strimzi managing topics, the agents must not try to create them.
    agent_args = pod_spec(one(objs, "DaemonSet", "-agent"))["containers"][0]["args"]
    assert "--no-create-topics" in agent_args


# --------------------------------------------------------------------------- RBAC
_CLIENT_CALLS = {  # official-client method -> (API group, resource, verb)
    "read_node": ("", "nodes", "get"),
    "list_node": ("", "nodes", "list"),
    "patch_node": ("", "nodes", "patch"),
    "list_namespaced_pod": ("", "pods", "list"),
    "create_namespaced_pod": ("", "pods", "create"),
    "read_namespaced_pod": ("", "pods", "get"),
    "create_namespaced_pod_eviction": ("", "pods/eviction", "create"),
    "create_namespaced_event": ("", "events", "create"),
    "read_namespaced_config_map": ("", "configmaps", "get"),
    "patch_namespaced_config_map": ("", "configmaps", "patch"),
}
# Custom objects: the verb from the method, the group and resource from its arguments.
_CUSTOM_VERBS = {"list_namespaced_custom_object": "list", "get_namespaced_custom_object": "get",
                 "patch_namespaced_custom_object": "patch", "create_namespaced_custom_object": "create",
                 "delete_namespaced_custom_object": "delete"}


def _permissions(rules: Iterable[dict]) -> set[tuple[str, str, str]]:
    out = set()
    for r in rules:
        for g in r["apiGroups"]:
            for res in r["resources"]:
                for v in r["verbs"]:
                    out.add((g, res, v))
    return out


def _code_permissions() -> set[tuple[str, str, str]]:
    """What the consumer's API adapter calls, read from its source."""
    source = (REPO / "fleetwise" / "kube" / "consumer.py").read_text()
    calls = set(re.findall(r"self\.core\.([a-z_]+)\(", source))
    unknown = calls - set(_CLIENT_CALLS)
    assert not unknown, f"consumer calls {sorted(unknown)}: add them to _CLIENT_CALLS and the chart's RBAC"
    call = r'self\.custom\.([a-z_]+)\(\s*"([a-z0-9.-]+)",\s*"\w+",\s*[\w.]+,\s*"([a-z]+)"'
    custom = re.findall(call, source)
    # Every custom-object call names its group and resource literally (else it would go unseen).
    assert len(custom) == len(re.findall(r"self\.custom\.[a-z_]+\(", source)), custom
    return {_CLIENT_CALLS[c] for c in calls} | {(g, plural, _CUSTOM_VERBS[m]) for m, g, plural in custom}


def test_consumer_rbac_is_exactly_what_it_calls(helm: str) -> None:
    from fleetwise.kube.consumer import required_rbac

    for ns_args, job_ns in (([], "fleetwise"), (["--set", "consumer.jobNamespace=training"], "training")):
        objs = render(helm, *ns_args)
        sa = "fw-fleetwise-consumer"
        roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
                 for o in objs if o["kind"] in ("Role", "ClusterRole")}
        granted: set[tuple[str, str, str]] = set()
        where: dict[tuple[str, str, str], set[str | None]] = {}
        for b in by_kind(objs, "RoleBinding") + by_kind(objs, "ClusterRoleBinding"):
            subjects = {(s["kind"], s["name"], s.get("namespace")) for s in b["subjects"]}
            assert subjects == {("ServiceAccount", sa, "fleetwise")}, "only the consumer is bound"
            ns = b["metadata"].get("namespace")
            role = roles[(b["roleRef"]["kind"], ns if b["roleRef"]["kind"] == "Role" else None,
                          b["roleRef"]["name"])]
            perms = _permissions(role["rules"])
            granted |= perms
            for p in perms:
                where.setdefault(p, set()).add(ns)
        # Exactly what the code calls, and what its own required_rbac() says.
        assert granted == _code_permissions() == _permissions(required_rbac())
        # Cluster-wide: nodes only; everything else in the jobs' namespace (events also in
        # `default`, where Node events go).
        cluster_wide = {p for p, nss in where.items() if None in nss}
        assert cluster_wide == {("", "nodes", "get"), ("", "nodes", "list"), ("", "nodes", "patch")}
        for p, nss in where.items():
            if p[1] != "nodes":
                assert job_ns in nss and nss <= {job_ns, "default"}, (p, nss)
                assert "default" not in nss or p[1] == "events" or job_ns == "default", (p, nss)
        for role in roles.values():
            text = json.dumps(role["rules"])
            assert "*" not in text and "secrets" not in text


def test_only_the_consumer_can_reach_the_api_server(helm: str) -> None:
    objs = render(helm)
    accounts = {o["metadata"]["name"]: o for o in by_kind(objs, "ServiceAccount")}
    assert set(accounts) == {"fw-fleetwise-agent", "fw-fleetwise-worker", "fw-fleetwise-consumer"}
    for w in by_kind(objs, "DaemonSet") + by_kind(objs, "Deployment"):
        spec = pod_spec(w)
        mounts = spec["automountServiceAccountToken"]
        assert accounts[spec["serviceAccountName"]]["automountServiceAccountToken"] is mounts
        assert mounts is spec["serviceAccountName"].endswith("-consumer")


# --------------------------------------------------------------------------- secrets
def _volume_for_path(spec: dict, container: dict, path: str) -> dict:
    """The volume mounted where `path` lives."""
    mounts = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, (path, container["volumeMounts"])
    return next(v for v in spec["volumes"] if v["name"] == mounts[0]["name"])


def test_secrets_are_mounted_not_inlined(helm: str) -> None:
    out = run_helm(helm, "template", "fw", str(CHART), "--namespace", "fleetwise", *ALL_ON).stdout
    # The secret values are in the Secrets' data (base64) and nowhere else.
    for secret in ("rotated-secret-number-two", "old-secret-number-one", "an-operators-secret",
                   SASL_PASSWORD):
        assert secret not in out
    objs = [d for d in yaml.safe_load_all(out) if d]
    secrets = {o["metadata"]["name"]: o for o in by_kind(objs, "Secret")}
    keys = base64.b64decode(secrets["fw-fleetwise-signing"]["data"]["keys"]).decode()
    assert keys == SIGNING
    from fleetwise.actuators.signing import Keyring

    assert Keyring.parse(keys).active == "k2"  # the file the workers and the consumer read
    operator_keys = base64.b64decode(secrets["fw-fleetwise-signing"]["data"]["operator-keys"]).decode()
    assert Keyring.parse(operator_keys).active == "ops1"
    sasl = secrets["fw-fleetwise-kafka-sasl"]["data"]
    assert base64.b64decode(sasl["password"]).decode() == SASL_PASSWORD
    assert base64.b64decode(sasl["username"]).decode() == "fleetwise"

    for w in by_kind(objs, "DaemonSet") + by_kind(objs, "Deployment"):
        spec = pod_spec(w)
        c = spec["containers"][0]
        env = {e["name"]: e for e in c["env"]}
        # No inline secrets, no env-var copies of them.
        assert not {"FLEETWISE_SIGNING_KEYS", "FLEETWISE_KAFKA_PASSWORD", "FLEETWISE_KAFKA_USER"} & set(env)
        assert env["FLEETWISE_KAFKA_SECURITY"]["value"] == "SASL_SSL"
        for name, secret, key in (("FLEETWISE_KAFKA_PASSWORD_FILE", "fw-fleetwise-kafka-sasl", "password"),
                                  ("FLEETWISE_KAFKA_USER_FILE", "fw-fleetwise-kafka-sasl", "username"),
                                  ("FLEETWISE_KAFKA_CA_FILE", "fleetwise-cluster-ca-cert", "ca.crt")):
            path = env[name]["value"]
            vol = _volume_for_path(spec, c, path)
            assert vol["secret"]["secretName"] == secret
            assert {"key": key, "path": Path(path).name} in vol["secret"]["items"]
        signs = w["kind"] == "Deployment"  # workers sign, the consumer verifies; agents need no keys
        assert ("FLEETWISE_SIGNING_KEYS_FILE" in env) is signs
        if signs:
            path = env["FLEETWISE_SIGNING_KEYS_FILE"]["value"]
            vol = _volume_for_path(spec, c, path)
            assert vol["secret"]["secretName"] == "fw-fleetwise-signing"
            assert vol["secret"]["items"] == [{"key": "keys", "path": Path(path).name},
                                              {"key": "operator-keys", "path": "operator-keys"}]
            assert all(m.get("readOnly") for m in c["volumeMounts"] if m["name"] == vol["name"])
            # Both the workers (approvals) and the consumer (GPU returns) verify operator actions.
            assert _volume_for_path(spec, c, env["FLEETWISE_OPERATOR_KEYS_FILE"]["value"]) == vol
        assert ("FLEETWISE_OPERATOR_KEYS" in env) is False
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
        assert spec["securityContext"]["runAsNonRoot"]

    # The operator policy reaches the workers, and the kube consumer (its fleet drain cap), as a
    # file they accept.
    from fleetwise.actuators import parse_policy

    policy = one(objs, "ConfigMap", "-policy")["data"]["policy.yaml"]
    assert parse_policy(policy).rails.breaker_drains == 4
    for component in ("-worker", "-consumer"):
        spec = pod_spec(one(objs, "Deployment", component))
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert _volume_for_path(spec, spec["containers"][0], env["FLEETWISE_POLICY"])["configMap"]["name"] \
            == "fw-fleetwise-policy", component

    # Workers off, the consumer on: the policy still reaches the consumer (its fleet drain cap).
    objs = render(helm, "--set", "worker.enabled=false", "--set-string", f"worker.policy={POLICY}")
    assert not [o for o in by_kind(objs, "Deployment") if o["metadata"]["name"].endswith("-worker")]
    assert parse_policy(one(objs, "ConfigMap", "-policy")["data"]["policy.yaml"]).rails.breaker_drains == 4
    spec = pod_spec(one(objs, "Deployment", "-consumer"))
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert _volume_for_path(spec, spec["containers"][0], env["FLEETWISE_POLICY"])["configMap"]["name"] \
        == "fw-fleetwise-policy"
    # Nothing that reads it: no policy ConfigMap.
    objs = render(helm, "--set", "worker.enabled=false", "--set", "consumer.enabled=false",
                  "--set-string", f"worker.policy={POLICY}")
    assert not [o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"].endswith("-policy")]

    # Without values the chart makes no Secret but still mounts the named one (the user's).
    objs = render(helm, "--set", "signing.secretName=my-keys")
    assert not by_kind(objs, "Secret")
    worker = pod_spec(one(objs, "Deployment", "-worker"))
    assert any(v.get("secret", {}).get("secretName") == "my-keys" for v in worker["volumes"])
    # Ed25519: the workers get the private entries, the kube consumer only the public ones.
    from fleetwise.actuators import generate_ed25519_entries

    private, public = generate_ed25519_entries("e1")
    objs = render(helm, "--set-string", f"signing.keys={private}",
                  "--set-string", f"signing.verifyKeys={public}")
    data = next(o for o in by_kind(objs, "Secret") if o["metadata"]["name"].endswith("-signing"))["data"]
    assert base64.b64decode(data["keys"]).decode() == private
    assert base64.b64decode(data["verify-keys"]).decode() == public
    for name, item in (("-worker", "keys"), ("-consumer", "verify-keys")):
        spec = pod_spec(one(objs, "Deployment", name))
        c = spec["containers"][0]
        path = {e["name"]: e.get("value") for e in c["env"]}["FLEETWISE_SIGNING_KEYS_FILE"]
        assert _volume_for_path(spec, c, path)["secret"]["items"] == [{"key": item, "path": Path(path).name}]

    # ... without operator keys unless told the user's Secret has them.
    assert "FLEETWISE_OPERATOR_KEYS_FILE" not in {e["name"] for e in worker["containers"][0]["env"]}
    worker = pod_spec(one(render(helm, "--set", "signing.secretName=my-keys",
                                 "--set", "signing.operatorKeysInSecret=true"), "Deployment", "-worker"))
    env = {e["name"]: e.get("value") for e in worker["containers"][0]["env"]}
    vol = _volume_for_path(worker, worker["containers"][0], env["FLEETWISE_OPERATOR_KEYS_FILE"])
    assert vol["secret"]["secretName"] == "my-keys"


def test_a_sites_catalog_rows_reach_the_agents_and_workers(helm: str, tmp_path: Path) -> None:
    from fleetwise.catalog import all_gpus
    from fleetwise.catalog import gpus as gpus_mod

    row = [f"{v:g}" if isinstance(v, float) else str(v) for v in (
        "tx1-80gb", "Testco TX1 80GB", "NVIDIA", "hopper", 2025, 80.0, 3.0, 700.0, 700.0, 1400.0, 50.0,
        400.0, 8, 5, 650.0, "SXM", "tx1", "NVIDIA TX1 80GB HBM3", "NVIDIA-TX1-80GB-HBM3",
        "https://example.com/tx1", "false", "test row")]
    site = tmp_path / "site-gpus.csv"
    site.write_text(",".join(gpus_mod._COLUMNS) + "\n" + ",".join(row) + "\n")
    objs = render(helm, "--set-file", f"catalog.extraRows={site}")  # as docs/deploy.md says
    text = one(objs, "ConfigMap", "-catalog")["data"]["gpus.csv"]
    (spec,) = gpus_mod._parse_csv(text, "configmap")  # the file the components read parses
    assert spec.id == "tx1-80gb" and spec.tdp_w == 650 and spec.id not in {s.id for s in all_gpus()}
    for kind, name in (("DaemonSet", "-agent"), ("Deployment", "-worker")):
        w = one(objs, kind, name)
        spec = pod_spec(w)
        c = spec["containers"][0]
        path = {e["name"]: e.get("value") for e in c["env"]}["FLEETWISE_CATALOG_EXTRA"]
        assert _volume_for_path(spec, c, path)["configMap"]["name"] == "fw-fleetwise-catalog", name
        assert Path(path).name == "gpus.csv"
        assert w["spec"]["template"]["metadata"]["annotations"]["checksum/catalog"]  # rolls on change
    consumer = pod_spec(one(objs, "Deployment", "-consumer"))["containers"][0]
    assert "FLEETWISE_CATALOG_EXTRA" not in {e["name"] for e in consumer["env"]}  # resolves no models
    # Unset: no ConfigMap, no variable.
    objs = render(helm)
    assert not [o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"].endswith("-catalog")]
    for w in by_kind(objs, "DaemonSet") + by_kind(objs, "Deployment"):
        assert "FLEETWISE_CATALOG_EXTRA" not in {e["name"] for e in pod_spec(w)["containers"][0]["env"]}


# --------------------------------------------------------------------------- observability
def test_dashboard_servicemonitor_and_rules(helm: str) -> None:
    objs = render(helm, *ALL_ON)
    cm = one(objs, "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((REPO / "deploy" / "grafana" / "fleetwise.json").read_text())
    assert json.loads(cm["data"]["fleetwise.json"]) == shipped

    sm = one(objs, "ServiceMonitor", "fw-fleetwise")
    selector = sm["spec"]["selector"]["matchLabels"]
    selected = [s for s in by_kind(objs, "Service")
                if all(s["metadata"]["labels"].get(k) == v for k, v in selector.items())]
    assert {s["metadata"]["name"] for s in selected} == {"fw-fleetwise-agent-metrics",
                                                          "fw-fleetwise-worker-metrics"}
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    # Each selected Service points at its workload's metrics port, the one its CLI serves on.
    for s in selected:
        component = s["metadata"]["labels"]["app.kubernetes.io/component"]
        workload = next(w for w in by_kind(objs, "DaemonSet") + by_kind(objs, "Deployment")
                        if w["spec"]["selector"]["matchLabels"] == s["spec"]["selector"])
        c = pod_spec(workload)["containers"][0]
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
        assert c["args"][c["args"].index("--metrics-port") + 1] == str(port), component
        assert s["spec"]["ports"][0]["targetPort"] == "metrics"

    rule = one(objs, "PrometheusRule", "fw-fleetwise")
    shipped_rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "rules.yml").read_text())
    assert rule["spec"]["groups"] == shipped_rules["groups"]


# --------------------------------------------------------------------------- real API server
_MINIMAL_CRDS = {  # kind -> (group, version, plural)
    "ServiceMonitor": ("monitoring.coreos.com", "v1", "servicemonitors"),
    "PrometheusRule": ("monitoring.coreos.com", "v1", "prometheusrules"),
    "KafkaTopic": ("kafka.strimzi.io", "v1beta2", "kafkatopics"),
}


def _minimal_crd(kind: str) -> dict:
    group, version, plural = _MINIMAL_CRDS[kind]
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {"group": group, "scope": "Namespaced",
                 "names": {"kind": kind, "plural": plural, "singular": kind.lower(),
                           "listKind": f"{kind}List"},
                 "versions": [{"name": version, "served": True, "storage": True,
                               "schema": {"openAPIV3Schema": {
                                   "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
    }


def _crd_present(kube_api: Any, kind: str) -> bool:
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    group, _version, plural = _MINIMAL_CRDS[kind]
    try:
        client.ApiextensionsV1Api(kube_api.api_client()).read_custom_resource_definition(f"{plural}.{group}")
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def test_rendered_chart_is_accepted_by_the_api_server(helm: str, kube_api: Any, kube_namespace: str,
                                                      tmp_path: Path) -> None:
    """Server-side dry-run of every rendered object: the API server validates each against
    its schema (built-in kinds: Kubernetes' own validation; RBAC: the rules' shape)."""
    args = list(ALL_ON) + ["--set", f"consumer.jobNamespace={kube_namespace}"]
    # A test API server (started by the fixture, or by `make test` for FLEETWISE_KUBECONFIG)
    # gets the minimal CRDs; a user's cluster (KUBECONFIG) gets nothing cluster-wide.
    if kube_api.source in ("local", "FLEETWISE_KUBECONFIG"):
        crds = []
        for kind in _MINIMAL_CRDS:
            path = tmp_path / f"{kind}.yaml"
            path.write_text(yaml.safe_dump(_minimal_crd(kind)))
            crds.append(path)
        kube_api.install_crds(crds)
        left_off: list[str] = []
    else:  # an existing cluster: install nothing cluster-wide, render absent kinds off
        left_off = [k for k in _MINIMAL_CRDS if not _crd_present(kube_api, k)]
        flags = {"ServiceMonitor": "serviceMonitor.enabled=false",
                 "PrometheusRule": "prometheusRule.enabled=false", "KafkaTopic": "strimzi.enabled=false"}
        for kind in left_off:
            args += ["--set", flags[kind]]
    release = f"fw{uuid.uuid4().hex[:6]}"
    objs = render(helm, *args, namespace=kube_namespace, release=release)
    kinds = {o["kind"] for o in objs}
    expected = {"ServiceAccount", "Secret", "ConfigMap", "Service", "DaemonSet", "Deployment", "ClusterRole",
                "ClusterRoleBinding", "Role", "RoleBinding"} | (set(_MINIMAL_CRDS) - set(left_off))
    assert kinds == expected
    created = kube_api.apply(objs, namespace=kube_namespace, dry_run=True)
    assert len(created) == len(objs)
    for obj, got in zip(objs, created, strict=True):
        got = got.to_dict() if hasattr(got, "to_dict") else got
        assert got["kind"] == obj["kind"] and got["metadata"]["name"] == obj["metadata"]["name"]
    # Dry run: nothing was stored.
    from kubernetes import client

    apps = client.AppsV1Api(kube_api.api_client())
    assert not apps.list_namespaced_deployment(kube_namespace).items

    # A broken object is refused, so the acceptance above means something.
    from kubernetes.client.rest import ApiException

    worker = json.loads(json.dumps(one(objs, "Deployment", "-worker")))
    worker["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = 70000
    with pytest.raises(ApiException) as refused:
        kube_api.apply([worker], namespace=kube_namespace, dry_run=True)
    assert refused.value.status == 422 and "containerPort" in refused.value.body


def test_producer_identities_give_workers_the_master_and_each_producer_its_own_key(helm: str) -> None:
    objs = render(helm, "--set", "identityKeys.masterSecret=fw-identity-master",
                  "--set", "identityKeys.kubeConsumerSecret=fw-kube-identity")
    worker = pod_spec(one(objs, "Deployment", "-worker"))
    c = worker["containers"][0]
    path = {e["name"]: e.get("value") for e in c["env"]}["FLEETWISE_IDENTITY_MASTER_KEY_FILE"]
    assert _volume_for_path(worker, c, path)["secret"]["secretName"] == "fw-identity-master"
    agent = pod_spec(one(objs, "DaemonSet", "-agent"))
    a = agent["containers"][0]
    env = {e["name"]: e.get("value") for e in a["env"]}
    assert "FLEETWISE_IDENTITY_MASTER_KEY_FILE" not in env  # an agent never holds the master
    volume = _volume_for_path(agent, a, env["FLEETWISE_IDENTITY_KEY_FILE"])
    assert volume["hostPath"] == {"path": "/etc/fleetwise/identity", "type": "Directory"}
    assert all(m.get("readOnly") for m in a["volumeMounts"] if m["name"] == volume["name"])
    consumer = pod_spec(one(objs, "Deployment", "-consumer"))
    k = consumer["containers"][0]
    env = {e["name"]: e.get("value") for e in k["env"]}
    assert "FLEETWISE_IDENTITY_MASTER_KEY_FILE" not in env
    assert _volume_for_path(consumer, k, env["FLEETWISE_IDENTITY_KEY_FILE"])["secret"]["secretName"] == (
        "fw-kube-identity")
    keys = {"FLEETWISE_IDENTITY_KEY_FILE", "FLEETWISE_IDENTITY_MASTER_KEY_FILE"}
    plain = render(helm)  # unset: nothing of it
    for w in by_kind(plain, "DaemonSet") + by_kind(plain, "Deployment"):
        assert not keys & {e["name"] for e in pod_spec(w)["containers"][0]["env"]}
