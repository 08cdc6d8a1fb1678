#!/usr/bin/env bash
# Fleetwise: build the helm CLI from its Go module (the Go module proxy) and cache it.
#
#   build-helm.sh            build if missing; print the binary's path last
#   build-helm.sh path       print the cached binary's path (exit 1 when not built)
#
# `go install helm.sh/helm/v3/cmd/helm@<version>` with GOBIN set to the cache, so nothing
# but the Go toolchain and the module proxy is needed (no release tarball download).
# Environment:
#   FLEETWISE_CACHE          cache root (default ~/.cache/fleetwise); binary in helm-<ver>/helm
#   FLEETWISE_HELM_VERSION   helm release (default v3.19.0)
#   GO                       go binary (default: go on PATH, else /usr/local/go/bin/go)
set -euo pipefail

HELM_VERSION="${FLEETWISE_HELM_VERSION:-v3.19.0}"
CACHE="${FLEETWISE_CACHE:-$HOME/.cache/fleetwise}"
DEST="$CACHE/helm-$HELM_VERSION"
BIN="$DEST/helm"

log() { echo "build-helm.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

# The stamp records the Kubernetes version compiled in (see below); a binary without it
# is from an older version of this script and is rebuilt.
built() { [ -x "$BIN" ] && [ -s "$DEST/.k8s-version" ] && "$BIN" version --short >/dev/null 2>&1; }

if [ "${1:-}" = "path" ]; then
  built || exit 1
  echo "$BIN"
  exit 0
fi

if built; then
  echo "$BIN"
  exit 0
fi

GO_BIN="${GO:-$(command -v go || true)}"
[ -n "$GO_BIN" ] || GO_BIN=/usr/local/go/bin/go
[ -x "$GO_BIN" ] || die "go is required to build helm (none on PATH nor at /usr/local/go/bin/go)"

mkdir -p "$DEST"
# Serialise concurrent builds (parallel test workers, make and pytest at once).
exec 9>"$DEST/.build.lock"
if command -v flock >/dev/null; then flock 9; fi
if built; then echo "$BIN"; exit 0; fi

t0=$(date +%s)
log "building helm $HELM_VERSION from the Go module proxy (first time: several minutes)"
# As helm's Makefile: the Kubernetes version `helm template` / `helm lint` assume
# (.Capabilities.KubeVersion) is client-go's minor + 1.x; without these ldflags it is v1.20.
gomod=$(GOFLAGS=-mod=mod "$GO_BIN" mod download -json "helm.sh/helm/v3@$HELM_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
[ -f "$gomod" ] || die "go mod download helm.sh/helm/v3@$HELM_VERSION failed"
client_go=$(sed -n 's/^[[:space:]]*k8s.io\/client-go v\([0-9][0-9]*\)\.\([0-9][0-9]*\)\..*/\1 \2/p' "$gomod" | head -1)
[ -n "$client_go" ] || die "no k8s.io/client-go requirement in $gomod"
k8s_major=$(( ${client_go% *} + 1 )); k8s_minor=${client_go#* }
ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  ldflags="$ldflags -X $pkg.k8sVersionMajor=$k8s_major -X $pkg.k8sVersionMinor=$k8s_minor"
done
GOBIN="$DEST" GOFLAGS="${GOFLAGS:-} -buildvcs=false" "$GO_BIN" install -trimpath -ldflags "$ldflags" \
  "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2 || die "go install helm.sh/helm/v3/cmd/helm@$HELM_VERSION failed"
echo "v$k8s_major.$k8s_minor" >"$DEST/.k8s-version"
built || die "built $BIN but it does not run"
log "built $BIN in $(( $(date +%s) - t0 )) s"
echo "$BIN"
