#!/usr/bin/env bash
# A real Kubernetes control plane for tests, without Docker: etcd + kube-apiserver
# (+ kube-controller-manager) built from the Go module proxy, run on 127.0.0.1. The node
# lifecycle, node IPAM and taint-eviction controllers are off: Nodes are API objects without a
# kubelet, and they would mark them NotReady and evict their pods.
#
#   kube.sh build                 build (once) and cache the binaries; prints the bin dir
#   kube.sh start STATE_DIR       start etcd, kube-apiserver, kube-controller-manager on free
#                                 loopback ports, wait for /readyz; prints the kubeconfig path
#   kube.sh kubeconfig STATE_DIR  print the kubeconfig path of a running STATE_DIR
#   kube.sh stop STATE_DIR        stop them (apiserver and controller-manager before etcd)
#   kube.sh status STATE_DIR      exit 0 when the API server answers /readyz
#
# Binaries are cached under ${FLEETWISE_CACHE:-~/.cache/fleetwise}/kube-<version>-<hash>/,
# keyed by the Kubernetes version and a hash of this folder's go.mod/go.sum/main.go files.
# The build uses a throwaway GOCACHE (several GB) that is deleted afterwards.
# Environment: KUBE_BUILD_P (go build -p, default 1), KUBE_NO_CONTROLLER_MANAGER=1 (skip it),
# KUBE_WATCH_PID (stop everything when that process exits, like kafka.sh).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
KUBE_VERSION="v1.37.2"
ETCD_VERSION="v3.7.3"
CACHE_ROOT="${FLEETWISE_CACHE:-${HOME}/.cache/fleetwise}"
TOKEN="fleetwise-admin-token"   # static admin token, loopback-only test cluster

die() { echo "kube.sh: $*" >&2; exit 1; }

bin_dir() {
    local h
    h="$(cat "$HERE/go.mod" "$HERE/go.sum" "$HERE"/cmd/*/main.go "$HERE/etcd/go.mod" "$HERE/etcd/go.sum" \
        "$HERE/etcd/main.go" | sha256sum | cut -c1-12)"
    echo "$CACHE_ROOT/kube-$KUBE_VERSION-$h"
}

have_bins() {
    local d="$1"
    [[ -x "$d/etcd" && -x "$d/kube-apiserver" ]] && \
        { [[ -n "${KUBE_NO_CONTROLLER_MANAGER:-}" ]] || [[ -x "$d/kube-controller-manager" ]]; }
}

cmd_build() {
    command -v go >/dev/null || die "go (>= 1.26) is needed to build kube-apiserver"
    local d; d="$(bin_dir)"
    mkdir -p "$CACHE_ROOT"
    # One build at a time per cache (concurrent test sessions wait for the first).
    exec 9>"$CACHE_ROOT/kube-build.lock"
    flock 9
    if have_bins "$d"; then echo "$d"; return 0; fi
    local work; work="$(mktemp -d "$CACHE_ROOT/kube-build.XXXXXX")"
    trap 'rm -rf "$work"' RETURN
    export GOCACHE="$work/gocache" GOFLAGS="-buildvcs=false -mod=mod" CGO_ENABLED=0
    local p="${KUBE_BUILD_P:-1}"
    local minor="${KUBE_VERSION#v1.}"; minor="${minor%%.*}"
    local ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$KUBE_VERSION"
    ldflags+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
    ldflags+=" -X k8s.io/component-base/version.gitTreeState=clean"
    mkdir -p "$work/bin"
    local t0=$SECONDS
    if [[ ! -x "$d/etcd" ]]; then
        echo "kube.sh: building etcd $ETCD_VERSION ..." >&2
        (cd "$HERE/etcd" && go build -p "$p" -trimpath -ldflags="-s -w" -o "$work/bin/etcd" .)
        echo "kube.sh: etcd built in $((SECONDS - t0)) s" >&2
    fi
    if [[ ! -x "$d/kube-apiserver" ]]; then
        echo "kube.sh: building kube-apiserver $KUBE_VERSION (several minutes the first time) ..." >&2
        (cd "$HERE" && go build -p "$p" -trimpath -ldflags="$ldflags" -o "$work/bin/kube-apiserver" ./cmd/kube-apiserver)
        echo "kube.sh: kube-apiserver built at $((SECONDS - t0)) s" >&2
    fi
    if [[ -z "${KUBE_NO_CONTROLLER_MANAGER:-}" && ! -x "$d/kube-controller-manager" ]]; then
        echo "kube.sh: building kube-controller-manager $KUBE_VERSION ..." >&2
        (cd "$HERE" && go build -p "$p" -trimpath -ldflags="$ldflags" \
            -o "$work/bin/kube-controller-manager" ./cmd/kube-controller-manager)
        echo "kube.sh: kube-controller-manager built at $((SECONDS - t0)) s" >&2
    fi
    mkdir -p "$d"
    for b in "$work"/bin/*; do mv -f "$b" "$d/"; done
    echo "$d"
}

free_port() {
    python3 - <<'PY'
import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
s.close()
PY
}

wait_http() {  # wait_http URL TIMEOUT_S [curl args...]
    local url="$1" timeout="$2"; shift 2
    local deadline=$((SECONDS + timeout))
    until curl -fsS --max-time 2 "$@" "$url" >/dev/null 2>&1; do
        (( SECONDS < deadline )) || return 1
        sleep 0.2
    done
}

make_certs() {  # a CA, a serving cert for 127.0.0.1/localhost, a service-account key pair
    local dir="$1"
    mkdir -p "$dir"
    (
        cd "$dir"
        openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=fleetwise-test-ca" \
            -keyout ca.key -out ca.crt 2>/dev/null
        openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" \
            -keyout apiserver.key -out apiserver.csr 2>/dev/null
        printf 'subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc,IP:10.0.0.1\n' > san.ext
        openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 30 \
            -extfile san.ext -out apiserver.crt 2>/dev/null
        openssl genrsa -out sa.key 2048 2>/dev/null
        openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    )
}

write_kubeconfig() {  # write_kubeconfig FILE SERVER CA TOKEN
    cat > "$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: fleetwise-local
  cluster:
    server: $2
    certificate-authority: $3
users:
- name: admin
  user:
    token: $4
contexts:
- name: fleetwise-local
  context:
    cluster: fleetwise-local
    user: admin
    namespace: default
current-context: fleetwise-local
EOF
}

stop_pid() {  # stop_pid PIDFILE
    local f="$1" pid
    [[ -f "$f" ]] || return 0
    pid="$(cat "$f")"
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}

cmd_start() {
    local state="${1:?usage: kube.sh start STATE_DIR}"
    mkdir -p "$state"; state="$(cd "$state" && pwd)"
    if [[ -f "$state/kubeconfig" ]] && cmd_status "$state" >/dev/null 2>&1; then
        echo "$state/kubeconfig"; return 0
    fi
    rm -f "$state/kubeconfig"   # a stale one must not point `kubeconfig` at a dead server
    local bins; bins="$(cmd_build)"
    have_bins "$bins" || die "binaries missing in $bins"
    make_certs "$state/pki"
    local ecp epp asp
    ecp="$(free_port)"; epp="$(free_port)"; asp="$(free_port)"
    rm -rf "$state/etcd-data"; mkdir -p "$state/logs"
    "$bins/etcd" --name fw --data-dir "$state/etcd-data" \
        --listen-client-urls "http://127.0.0.1:$ecp" --advertise-client-urls "http://127.0.0.1:$ecp" \
        --listen-peer-urls "http://127.0.0.1:$epp" --initial-advertise-peer-urls "http://127.0.0.1:$epp" \
        --initial-cluster "fw=http://127.0.0.1:$epp" --listen-metrics-urls "" \
        --unsafe-no-fsync --log-level warn >"$state/logs/etcd.log" 2>&1 &
    echo $! > "$state/etcd.pid"
    wait_http "http://127.0.0.1:$ecp/health" 60 || { cmd_stop "$state"; die "etcd did not start (see $state/logs/etcd.log)"; }

    printf '%s,admin,admin,system:masters\n' "$TOKEN" > "$state/pki/tokens.csv"
    "$bins/kube-apiserver" \
        --etcd-servers "http://127.0.0.1:$ecp" --bind-address 127.0.0.1 --advertise-address 127.0.0.1 \
        --secure-port "$asp" --cert-dir "$state/pki" \
        --tls-cert-file "$state/pki/apiserver.crt" --tls-private-key-file "$state/pki/apiserver.key" \
        --client-ca-file "$state/pki/ca.crt" \
        --token-auth-file "$state/pki/tokens.csv" --authorization-mode RBAC,Node \
        --service-account-issuer https://kubernetes.default.svc \
        --service-account-key-file "$state/pki/sa.pub" --service-account-signing-key-file "$state/pki/sa.key" \
        --service-cluster-ip-range 10.0.0.0/24 --endpoint-reconciler-type none \
        --allow-privileged --profiling=false >"$state/logs/kube-apiserver.log" 2>&1 &
    echo $! > "$state/kube-apiserver.pid"
    local server="https://127.0.0.1:$asp"
    wait_http "$server/readyz" 120 --cacert "$state/pki/ca.crt" -H "Authorization: Bearer $TOKEN" \
        || { cmd_stop "$state"; die "kube-apiserver not ready (see $state/logs/kube-apiserver.log)"; }
    write_kubeconfig "$state/kubeconfig" "$server" "$state/pki/ca.crt" "$TOKEN"

    if [[ -z "${KUBE_NO_CONTROLLER_MANAGER:-}" && -x "$bins/kube-controller-manager" ]]; then
        local kcmp; kcmp="$(free_port)"
        "$bins/kube-controller-manager" --kubeconfig "$state/kubeconfig" \
            --bind-address 127.0.0.1 --secure-port "$kcmp" \
            --authentication-kubeconfig "$state/kubeconfig" --authorization-kubeconfig "$state/kubeconfig" \
            --service-account-private-key-file "$state/pki/sa.key" --root-ca-file "$state/pki/ca.crt" \
            --use-service-account-credentials=false --leader-elect=false \
            --controllers '*,-node-ipam-controller,-node-lifecycle-controller,-taint-eviction-controller,-device-taint-eviction-controller' \
            >"$state/logs/kube-controller-manager.log" 2>&1 &
        echo $! > "$state/kube-controller-manager.pid"
        # It fails fast on a bad flag; give it a moment, then insist it is alive.
        sleep 3
        kill -0 "$(cat "$state/kube-controller-manager.pid")" 2>/dev/null || {
            tail -5 "$state/logs/kube-controller-manager.log" >&2
            cmd_stop "$state"; die "kube-controller-manager exited (see $state/logs/kube-controller-manager.log)"; }
    fi
    if [[ -n "${KUBE_WATCH_PID:-}" ]]; then
        # Stop the cluster if the process that asked for it dies without stopping it.
        ( while kill -0 "$KUBE_WATCH_PID" 2>/dev/null && [[ -f "$state/etcd.pid" ]]; do sleep 2; done
          [[ -f "$state/etcd.pid" ]] && bash "$HERE/kube.sh" stop "$state" >/dev/null 2>&1 ) \
          </dev/null >/dev/null 2>&1 &
        echo $! > "$state/watch.pid"
    fi
    echo "$state/kubeconfig"
}

cmd_stop() {
    local state="${1:?usage: kube.sh stop STATE_DIR}"
    [[ -d "$state" ]] || return 0
    stop_pid "$state/kube-controller-manager.pid"
    stop_pid "$state/kube-apiserver.pid"
    stop_pid "$state/etcd.pid"
    rm -f "$state/watch.pid" "$state/kubeconfig"
}

cmd_kubeconfig() {
    local state="${1:?usage: kube.sh kubeconfig STATE_DIR}"
    [[ -f "$state/kubeconfig" ]] || die "no kubeconfig in $state (not started?)"
    echo "$(cd "$state" && pwd)/kubeconfig"
}

cmd_status() {
    local state="${1:?usage: kube.sh status STATE_DIR}"
    [[ -f "$state/kubeconfig" ]] || die "no kubeconfig in $state"
    local server; server="$(awk '/server:/ {print $2; exit}' "$state/kubeconfig")"
    curl -fsS --max-time 3 --cacert "$state/pki/ca.crt" -H "Authorization: Bearer $TOKEN" "$server/readyz"
    echo
}

case "${1:-}" in
    build) cmd_build ;;
    start) cmd_start "${2:-}" ;;
    stop) cmd_stop "${2:-}" ;;
    kubeconfig) cmd_kubeconfig "${2:-}" ;;
    status) cmd_status "${2:-}" ;;
    *) echo "usage: kube.sh build | start DIR | stop DIR | kubeconfig DIR | status DIR" >&2; exit 2 ;;
esac
