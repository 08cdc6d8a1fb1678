#!/usr/bin/env bash
# Fleetwise: a real single-node Apache Kafka broker (KRaft) for tests and local use,
# built from Maven Central jars -- no tarball, no Docker.
#
#   kafka.sh fetch              resolve the pinned Kafka release into the cache (idempotent)
#   kafka.sh start [DIR]        fetch if needed, format + start a broker, wait until it
#                               answers a Metadata request; prints the bootstrap address last
#   kafka.sh stop [DIR]         SIGTERM (30 s) then SIGKILL; removes DIR; 0 if nothing runs
#   kafka.sh bootstrap [DIR]    print the bootstrap address of the running broker
#   kafka.sh status [DIR]       exit 0 when the broker in DIR answers, 1 otherwise
#   kafka.sh probe HOST:PORT    exit 0 when a broker at HOST:PORT answers a Metadata request
#
# Environment:
#   FLEETWISE_CACHE        cache root (default ~/.cache/fleetwise); jars in kafka-<ver>/libs
#   FLEETWISE_KAFKA_VERSION  Kafka release (default 3.9.1; 4.x also works)
#   KAFKA_HEAP_OPTS        JVM heap (default -Xms128m -Xmx512m)
#   KAFKA_JVM_OPTS         extra JVM options
#   KAFKA_START_TIMEOUT    seconds to wait for readiness (default 90)
#   KAFKA_WATCH_PID        if set, the broker is stopped when this process exits
#                          (used by the pytest fixture so a crashed test run leaks nothing)
#   MAVEN_REPO_LOCAL       optional -Dmaven.repo.local for the fetch
set -euo pipefail

KAFKA_VERSION="${FLEETWISE_KAFKA_VERSION:-3.9.1}"
SCALA_VERSION="2.13"
CACHE="${FLEETWISE_CACHE:-$HOME/.cache/fleetwise}"
KAFKA_HOME="$CACHE/kafka-$KAFKA_VERSION"
LIBS="$KAFKA_HOME/libs"
MARKER="$LIBS/.fleetwise-complete"
DEFAULT_DIR="$CACHE/run/kafka"
START_TIMEOUT="${KAFKA_START_TIMEOUT:-90}"
STATE_MARKER=".fleetwise-kafka"

log() { echo "kafka.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

kafka_major() { echo "${KAFKA_VERSION%%.*}"; }

# ---------------------------------------------------------------------------- fetch
logging_deps() {
  if [ "$(kafka_major)" -ge 4 ]; then
    # Kafka 4.x logs through log4j2; SLF4J 1.7 binding.
    cat <<'EOF'
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j-impl</artifactId><version>2.24.3</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-api</artifactId><version>2.24.3</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-core</artifactId><version>2.24.3</version></dependency>
EOF
  else
    cat <<'EOF'
    <dependency><groupId>org.slf4j</groupId><artifactId>slf4j-reload4j</artifactId><version>1.7.36</version></dependency>
    <dependency><groupId>ch.qos.reload4j</groupId><artifactId>reload4j</artifactId><version>1.2.25</version></dependency>
EOF
  fi
}

is_fetched() {
  [ -f "$MARKER" ] && [ -f "$LIBS/kafka_${SCALA_VERSION}-${KAFKA_VERSION}.jar" ]
}

do_fetch() {
  if is_fetched; then
    return 0
  fi
  command -v mvn >/dev/null || die "mvn (Maven) is required to fetch Kafka jars"
  command -v java >/dev/null || die "java (17+) is required"
  mkdir -p "$KAFKA_HOME"
  # Serialise concurrent fetches (e.g. parallel test workers).
  exec 8>"$KAFKA_HOME/.fetch.lock"
  if command -v flock >/dev/null; then flock 8; fi
  if is_fetched; then exec 8>&-; return 0; fi

  local t0 work
  t0=$(date +%s)
  work=$(mktemp -d "$KAFKA_HOME/.fetch.XXXXXX")
  cat >"$work/pom.xml" <<EOF
<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0"
         xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance"
         xsi:schemaLocation="http://maven.apache.org/POM/4.0.0 http://maven.apache.org/xsd/maven-4.0.0.xsd">
  <modelVersion>4.0.0</modelVersion>
  <groupId>dev.fleetwise</groupId>
  <artifactId>kafka-broker-classpath</artifactId>
  <version>${KAFKA_VERSION}</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_${SCALA_VERSION}</artifactId><version>${KAFKA_VERSION}</version></dependency>
$(logging_deps)
  </dependencies>
</project>
EOF
  log "fetching Apache Kafka ${KAFKA_VERSION} (kafka_${SCALA_VERSION}) from Maven Central into $LIBS"
  local mvn_args=(-B -q -Dstyle.color=never -f "$work/pom.xml")
  if [ -n "${MAVEN_REPO_LOCAL:-}" ]; then mvn_args+=("-Dmaven.repo.local=$MAVEN_REPO_LOCAL"); fi
  if ! mvn "${mvn_args[@]}" \
      org.apache.maven.plugins:maven-dependency-plugin:3.6.1:copy-dependencies \
      -DincludeScope=runtime -DoutputDirectory="$work/libs" >"$work/mvn.log" 2>&1; then
    tail -n 40 "$work/mvn.log" >&2
    rm -rf "$work"
    exec 8>&-
    die "maven could not resolve org.apache.kafka:kafka_${SCALA_VERSION}:${KAFKA_VERSION}"
  fi
  [ -f "$work/libs/kafka_${SCALA_VERSION}-${KAFKA_VERSION}.jar" ] \
    || { rm -rf "$work"; exec 8>&-; die "kafka jar missing after maven copy-dependencies"; }
  rm -rf "$LIBS"
  mv "$work/libs" "$LIBS"
  cp "$work/pom.xml" "$KAFKA_HOME/pom.xml"
  rm -rf "$work"
  {
    echo "version=$KAFKA_VERSION"
    echo "scala=$SCALA_VERSION"
    echo "jars=$(find "$LIBS" -maxdepth 1 -name '*.jar' | wc -l)"
    echo "fetched_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  } >"$MARKER"
  exec 8>&-
  log "fetched $(grep '^jars=' "$MARKER" | cut -d= -f2) jars in $(( $(date +%s) - t0 ))s"
}

# ---------------------------------------------------------------------------- helpers
free_ports() {  # prints two distinct free TCP ports on 127.0.0.1
  if command -v python3 >/dev/null; then
    python3 - <<'EOF'
import socket
socks = []
for _ in range(2):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
for s in socks:
    s.close()
EOF
  else
    local out=() p
    while [ "${#out[@]}" -lt 2 ]; do
      p=$(( 20000 + RANDOM % 40000 ))
      if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && [[ " ${out[*]:-} " != *" $p "* ]]; then
        out+=("$p")
      fi
    done
    echo "${out[@]}"
  fi
}

random_cluster_id() {  # 22-char URL-safe base64 of 16 random bytes, not starting with '-'
  local id
  while :; do
    id=$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n' | cut -c1-22)
    [ "${id:0:1}" != "-" ] && [ "${#id}" -eq 22 ] && { echo "$id"; return; }
  done
}

# Ask HOST:PORT for cluster metadata (Metadata v4 over the Kafka wire protocol) and succeed
# only when the broker lists at least one live broker. Pure python3, no client library.
probe() {
  local hostport="$1"
  if command -v python3 >/dev/null; then
    python3 - "$hostport" <<'EOF'
import socket, struct, sys
host, _, port = sys.argv[1].rpartition(":")
def s16(b): return struct.pack(">h", len(b)) + b
try:
    # Request header v1 (api_key=3 Metadata, api_version=4), body: topics=[] , allow_auto_create=false
    body = struct.pack(">hhi", 3, 4, 7) + s16(b"fleetwise-probe") + struct.pack(">i", 0) + b"\x00"
    with socket.create_connection((host, int(port)), timeout=3) as s:
        s.settimeout(5)
        s.sendall(struct.pack(">i", len(body)) + body)
        def read(n):
            buf = b""
            while len(buf) < n:
                chunk = s.recv(n - len(buf))
                if not chunk:
                    raise EOFError("connection closed")
                buf += chunk
            return buf
        (size,) = struct.unpack(">i", read(4))
        resp = read(size)
    corr, _throttle, nbrokers = struct.unpack(">iii", resp[:12])
    sys.exit(0 if corr == 7 and nbrokers >= 1 else 1)
except Exception:
    sys.exit(1)
EOF
  else
    local cls
    for cls in org.apache.kafka.tools.BrokerApiVersionsCommand kafka.admin.BrokerApiVersionsCommand; do
      if java -cp "$LIBS/*" "$cls" --bootstrap-server "$hostport" >/dev/null 2>&1; then return 0; fi
    done
    return 1
  fi
}

pid_alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

state_dir() {
  local d="${1:-$DEFAULT_DIR}"
  mkdir -p "$d" 2>/dev/null || true
  (cd "$d" 2>/dev/null && pwd) || echo "$d"
}

write_configs() {  # DIR PORT CPORT
  local dir="$1" port="$2" cport="$3"
  cat >"$dir/server.properties" <<EOF
# Written by deploy/kafka/kafka.sh -- single-node KRaft broker for tests and local use.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:${cport}
listeners=PLAINTEXT://127.0.0.1:${port},CONTROLLER://127.0.0.1:${cport}
advertised.listeners=PLAINTEXT://127.0.0.1:${port}
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
controller.listener.names=CONTROLLER
log.dirs=${dir}/data
num.partitions=4
default.replication.factor=1
auto.create.topics.enable=true
delete.topic.enable=true
offsets.topic.replication.factor=1
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
min.insync.replicas=1
group.initial.rebalance.delay.ms=0
# small machine: few threads, small buffers
num.network.threads=2
num.io.threads=2
num.recovery.threads.per.data.dir=1
background.threads=2
log.cleaner.threads=1
log.cleaner.dedupe.buffer.size=4194304
socket.request.max.bytes=104857600
log.retention.hours=24
log.segment.bytes=67108864
EOF
  # reload4j (Kafka 3.x)
  cat >"$dir/log4j.properties" <<'EOF'
log4j.rootLogger=INFO, stdout
log4j.appender.stdout=org.apache.log4j.ConsoleAppender
log4j.appender.stdout.layout=org.apache.log4j.PatternLayout
log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka=INFO
log4j.logger.org.apache.kafka=INFO
log4j.logger.kafka.request.logger=WARN
log4j.logger.state.change.logger=WARN
log4j.logger.kafka.log.LogCleaner=WARN
EOF
  # log4j2 (Kafka 4.x)
  cat >"$dir/log4j2.properties" <<'EOF'
status = warn
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.stdout.ref = STDOUT
logger.request.name = kafka.request.logger
logger.request.level = warn
logger.statechange.name = state.change.logger
logger.statechange.level = warn
EOF
}

java_opts() {  # DIR
  local dir="$1"
  # shellcheck disable=SC2206
  local heap=(${KAFKA_HEAP_OPTS:--Xms128m -Xmx512m})
  # shellcheck disable=SC2206
  local extra=(${KAFKA_JVM_OPTS:-})
  JOPTS=("${heap[@]}" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExitOnOutOfMemoryError
         -XX:CICompilerCount=2 -Djava.awt.headless=true
         "-Dkafka.logs.dir=$dir/logs"
         "-Dlog4j.configuration=file:$dir/log4j.properties"
         "-Dlog4j2.configurationFile=$dir/log4j2.properties"
         ${extra[@]+"${extra[@]}"})
}

# ---------------------------------------------------------------------------- start
start_once() {  # DIR -> 0 ready, 1 failed, 2 port clash (retry)
  local dir="$1" port cport cid pid deadline
  read -r port cport < <(free_ports)
  rm -rf "$dir/data" "$dir/logs"
  mkdir -p "$dir/data" "$dir/logs"
  write_configs "$dir" "$port" "$cport"
  java_opts "$dir"
  cid=$(random_cluster_id)
  echo "$cid" >"$dir/cluster.id"
  if ! java "${JOPTS[@]}" -cp "$LIBS/*" kafka.tools.StorageTool format \
        -t "$cid" -c "$dir/server.properties" >"$dir/format.log" 2>&1; then
    cat "$dir/format.log" >&2
    die "kafka.tools.StorageTool format failed"
  fi
  : >"$dir/kafka.log"
  # Detach: own session, no stdin, logs to a file.
  nohup setsid java "${JOPTS[@]}" -cp "$LIBS/*" kafka.Kafka "$dir/server.properties" \
    >"$dir/kafka.log" 2>&1 </dev/null &
  pid=$!
  echo "$pid" >"$dir/kafka.pid"
  echo "127.0.0.1:$port" >"$dir/bootstrap"
  deadline=$(( $(date +%s) + START_TIMEOUT ))
  while :; do
    if ! pid_alive "$pid"; then
      if grep -q "Address already in use" "$dir/kafka.log"; then
        log "port clash on $port/$cport, retrying"
        return 2
      fi
      log "broker exited during startup; last log lines:"
      tail -n 60 "$dir/kafka.log" >&2
      rm -f "$dir/kafka.pid" "$dir/bootstrap"
      return 1
    fi
    if probe "127.0.0.1:$port"; then
      return 0
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      log "broker did not answer a Metadata request within ${START_TIMEOUT}s; last log lines:"
      tail -n 60 "$dir/kafka.log" >&2
      stop_pid "$pid"
      rm -f "$dir/kafka.pid" "$dir/bootstrap"
      return 1
    fi
    sleep 0.5
  done
}

start_watchdog() {  # DIR BROKER_PID WATCH_PID
  local dir="$1" bpid="$2" wpid="$3"
  nohup setsid bash -c '
    while kill -0 "$1" 2>/dev/null && kill -0 "$2" 2>/dev/null; do sleep 2; done
    if kill -0 "$2" 2>/dev/null; then
      kill -TERM "$2" 2>/dev/null
      for _ in $(seq 1 60); do kill -0 "$2" 2>/dev/null || break; sleep 0.5; done
      kill -KILL "$2" 2>/dev/null
      if [ -f "$3/.fleetwise-kafka" ]; then rm -rf "$3"; fi
    fi' watchdog "$wpid" "$bpid" "$dir" >/dev/null 2>&1 </dev/null &
  echo $! >"$dir/watchdog.pid"
}

do_start() {
  local dir rc t0
  t0=$(date +%s)
  dir=$(state_dir "${1:-}")
  if [ -f "$dir/kafka.pid" ] && pid_alive "$(cat "$dir/kafka.pid")"; then
    if probe "$(cat "$dir/bootstrap")"; then
      log "broker already running in $dir"
      cat "$dir/bootstrap"
      return 0
    fi
    die "a broker process ($(cat "$dir/kafka.pid")) runs in $dir but does not answer; run: $0 stop $dir"
  fi
  if [ ! -f "$dir/$STATE_MARKER" ] && [ -n "$(ls -A "$dir" 2>/dev/null)" ]; then
    die "$dir is not empty and is not a kafka.sh state dir; refusing to use it"
  fi
  command -v java >/dev/null || die "java (17+) is required"
  do_fetch
  touch "$dir/$STATE_MARKER"
  for _attempt in 1 2 3; do
    set +e
    start_once "$dir"
    rc=$?
    set -e
    [ "$rc" -eq 2 ] && continue
    break
  done
  [ "$rc" -eq 0 ] || die "could not start Kafka $KAFKA_VERSION (state dir $dir, log $dir/kafka.log)"
  if [ -n "${KAFKA_WATCH_PID:-}" ]; then
    start_watchdog "$dir" "$(cat "$dir/kafka.pid")" "$KAFKA_WATCH_PID"
  fi
  log "Kafka $KAFKA_VERSION ready in $(( $(date +%s) - t0 ))s (pid $(cat "$dir/kafka.pid"), state $dir)"
  cat "$dir/bootstrap"
}

# ---------------------------------------------------------------------------- stop
stop_pid() {
  local pid="$1" i
  pid_alive "$pid" || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 1 60); do
    pid_alive "$pid" || return 0
    sleep 0.5
  done
  log "broker $pid did not stop within 30s; sending SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
  for i in $(seq 1 20); do
    pid_alive "$pid" || return 0
    sleep 0.1
  done
}

do_stop() {
  local dir="${1:-$DEFAULT_DIR}" pid
  if [ ! -d "$dir" ]; then
    return 0
  fi
  if [ -f "$dir/watchdog.pid" ]; then
    kill -TERM "$(cat "$dir/watchdog.pid")" 2>/dev/null || true
  fi
  if [ -f "$dir/kafka.pid" ]; then
    pid=$(cat "$dir/kafka.pid")
    # Only signal it if it really is our broker (pid reuse guard).
    if pid_alive "$pid" && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "kafka.Kafka"; then
      stop_pid "$pid"
      log "stopped broker $pid"
    fi
  fi
  if [ -f "$dir/$STATE_MARKER" ]; then
    rm -rf "$dir"
  fi
  return 0
}

do_bootstrap() {
  local dir="${1:-$DEFAULT_DIR}"
  [ -f "$dir/bootstrap" ] && [ -f "$dir/kafka.pid" ] && pid_alive "$(cat "$dir/kafka.pid")" \
    || die "no running broker in $dir"
  cat "$dir/bootstrap"
}

do_status() {
  local dir="${1:-$DEFAULT_DIR}"
  [ -f "$dir/bootstrap" ] && [ -f "$dir/kafka.pid" ] && pid_alive "$(cat "$dir/kafka.pid")" \
    && probe "$(cat "$dir/bootstrap")"
}

usage() {
  sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  fetch) do_fetch; echo "$LIBS" ;;
  start) do_start "${1:-}" ;;
  stop) do_stop "${1:-}" ;;
  bootstrap) do_bootstrap "${1:-}" ;;
  status) do_status "${1:-}" ;;
  probe) [ -n "${1:-}" ] || die "usage: $0 probe HOST:PORT"; probe "$1" ;;
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac
