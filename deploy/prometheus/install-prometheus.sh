#!/usr/bin/env bash
# Fleetwise: a Prometheus server and promtool for tests and local use, cached.
#
#   install-prometheus.sh          install if missing; print the folder holding
#                                  `prometheus` and `promtool` last
#   install-prometheus.sh path     print that folder (exit 1 when not installed)
#
# In this order:
#   1. the cache, FLEETWISE_CACHE/prometheus/{prometheus,promtool} (from an earlier run);
#   2. `prometheus` and `promtool` already on PATH (e.g. `apt-get install prometheus`);
#   3. Debian's `prometheus` package: `apt-get download` + `dpkg-deb -x` into the cache. The
#      binaries are static Go programs, so the package is unpacked rather than installed:
#      installing it would start a system daemon on :9090 through its init script, and
#      needs root; unpacking needs neither. (`apt-get update` runs first when apt knows no
#      candidate and we are root.)
#   4. built from its Go module: `go install github.com/prometheus/prometheus/cmd/...@VER`
#      (no web UI assets; the HTTP API, rules and scraping are all there).
# Environment:
#   FLEETWISE_CACHE               cache root (default ~/.cache/fleetwise)
#   FLEETWISE_PROMETHEUS_MODULE   Go module version for step 4 (default v0.316.0)
#   FLEETWISE_PROMETHEUS_SOURCE   force a step: cache|path|debian|go (default: first that works)
set -euo pipefail

CACHE="${FLEETWISE_CACHE:-$HOME/.cache/fleetwise}"
DEST="$CACHE/prometheus"
MODULE_VERSION="${FLEETWISE_PROMETHEUS_MODULE:-v0.316.0}"
FORCE="${FLEETWISE_PROMETHEUS_SOURCE:-}"

log() { echo "install-prometheus.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

works() {  # works DIR: both binaries there and runnable
  [ -x "$1/prometheus" ] && [ -x "$1/promtool" ] \
    && "$1/prometheus" --version >/dev/null 2>&1 && "$1/promtool" --version >/dev/null 2>&1
}

from_cache() { works "$DEST"; }

from_path() {
  local p t
  p=$(command -v prometheus || true); t=$(command -v promtool || true)
  [ -n "$p" ] && [ -n "$t" ] || return 1
  mkdir -p "$DEST"
  ln -sf "$p" "$DEST/prometheus"; ln -sf "$t" "$DEST/promtool"
  works "$DEST"
}

from_debian() {
  command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || return 1
  if ! apt-cache policy prometheus 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    [ "$(id -u)" = 0 ] || { log "apt knows no prometheus package and we are not root to apt-get update"; return 1; }
    apt-get update -qq >&2 || return 1
  fi
  local work
  work=$(mktemp -d)
  # _apt cannot write into a root-owned mktemp dir: let it.
  chmod 0777 "$work"
  if ! (cd "$work" && apt-get download -qq prometheus >&2 2>/dev/null); then
    rm -rf "$work"; return 1
  fi
  dpkg-deb -x "$work"/prometheus_*.deb "$work/root" || { rm -rf "$work"; return 1; }
  mkdir -p "$DEST"
  install -m 0755 "$work/root/usr/bin/prometheus" "$work/root/usr/bin/promtool" "$DEST/"
  dpkg-deb -f "$work"/prometheus_*.deb Version >"$DEST/VERSION"
  rm -rf "$work"
  works "$DEST"
}

from_go() {
  local go_bin="${GO:-$(command -v go || true)}"
  [ -n "$go_bin" ] || go_bin=/usr/local/go/bin/go
  [ -x "$go_bin" ] || { log "no go toolchain to build Prometheus"; return 1; }
  mkdir -p "$DEST"
  log "building Prometheus $MODULE_VERSION from its Go module (first time: several minutes)"
  GOBIN="$DEST" GOFLAGS="${GOFLAGS:-} -buildvcs=false" "$go_bin" install -trimpath -ldflags "-s -w" \
    "github.com/prometheus/prometheus/cmd/prometheus@$MODULE_VERSION" \
    "github.com/prometheus/prometheus/cmd/promtool@$MODULE_VERSION" >&2 || return 1
  echo "go module $MODULE_VERSION" >"$DEST/VERSION"
  works "$DEST"
}

if [ "${1:-}" = "path" ]; then
  from_cache || exit 1
  echo "$DEST"; exit 0
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.prometheus-install.lock"
if command -v flock >/dev/null; then flock 9; fi

if [ -n "$FORCE" ]; then
  case "$FORCE" in
    cache|path|debian|go) "from_$FORCE" || die "FLEETWISE_PROMETHEUS_SOURCE=$FORCE did not give a working prometheus" ;;
    *) die "FLEETWISE_PROMETHEUS_SOURCE must be cache, path, debian or go; got $FORCE" ;;
  esac
else
  from_cache || from_path || from_debian || from_go \
    || die "no Prometheus: not cached, not on PATH, no Debian package, and the Go build failed"
fi
echo "$DEST"
