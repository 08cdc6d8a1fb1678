#!/usr/bin/env bash
# Fleetwise: a real single-node Apache Kafka broker (KRaft) for tests and local use,
# built from Maven Central jars -- no tarball, no Docker.
#
#   kafka.sh fetch              resolve the pinned Kafka release into the cache (idempotent)
#   kafka.sh start [DIR]        fetch if needed, format + start a broker, wait until it
#                               answers a Metadata request; prints the bootstrap address last
#   kafka.sh start --secure [DIR]  the same with SASL_SSL (SCRAM-SHA-512 over TLS) only, a
#                               throwaway CA, one SCRAM user per component, StandardAuthorizer
#                               and least-privilege ACLs (docs/security.md); DIR/env/<user>.env
#                               holds each component's client settings
#   kafka.sh stop [DIR]         SIGTERM (30 s) then SIGKILL; removes DIR; 0 if nothing runs
#   kafka.sh bootstrap [DIR]    print the bootstrap address of the running broker
#   kafka.sh status [DIR]       exit 0 when the broker in DIR answers, 1 otherwise
#   kafka.sh probe HOST:PORT    exit 0 when a broker at HOST:PORT answers a Metadata request
#   kafka.sh probe-secure DIR [USER]  the same over TLS + SCRAM as USER (default admin)
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
#   FLEETWISE_KAFKA_APP_ID (--secure) the workers' faust app id: their consumer group and
#                          internal-topic prefix in the ACLs (default fleetwise)
#   FLEETWISE_KAFKA_AGENT_BYTE_RATE, FLEETWISE_KAFKA_PLUGIN_BYTE_RATE (--secure) produce quota
#                          in bytes/s of each agent / plugin client id (default 1048576)
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
SECURE=0  # 1: start --secure (SASL_SSL, ACLs); see the "secure" section
FORMAT_EXTRA=()

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

# ---------------------------------------------------------------------------- secure (--secure)
# One SASL_SSL listener for clients (SCRAM-SHA-512 over TLS; also the inter-broker listener, as
# admin) and an SSL controller listener that demands the broker's own certificate (mutual TLS):
# no listener accepts an unauthenticated client. KRaft's StandardAuthorizer denies what no ACL
# allows; admin and the broker's certificate are super users. Docs: docs/security.md.
SECURE_USERS="admin agent worker plugin kube-consumer"
BROKER_CN="fleetwise-broker"

# ACL table: USER RESOURCE PATTERN NAME OPERATIONS (comma-separated). @APP@ is the workers'
# faust app id (FLEETWISE_KAFKA_APP_ID). Topic names are fleetwise/schemas/topics.py's
# (tests/test_kafka_secure.py checks they match). docs/security.md has the same table.
acl_table() {
  local app="${FLEETWISE_KAFKA_APP_ID:-fleetwise}"
  sed "s/@APP@/$app/g" <<'EOF'
agent          topic literal   fleetwise.telemetry.gpu      Write,Describe
agent          topic literal   fleetwise.inventory          Write,Describe
worker         topic literal   fleetwise.telemetry.gpu      Read,Describe,Create
worker         topic literal   fleetwise.telemetry.steps    Read,Describe,Create
worker         topic literal   fleetwise.inventory          Read,Describe,Create
worker         topic literal   fleetwise.plans              Read,Describe,Create
worker         topic literal   fleetwise.acks               Read,Describe,Create
worker         topic literal   fleetwise.operator           Read,Describe,Create
worker         topic literal   fleetwise.features           Write,Describe,Create
worker         topic literal   fleetwise.predictions        Write,Describe,Create
worker         topic literal   fleetwise.commands.training  Read,Write,Describe,Create
worker         topic literal   fleetwise.commands.kube      Read,Write,Describe,Create
worker         topic literal   fleetwise.audit              Write,Describe,Create
worker         topic literal   fleetwise.deadletter         Write,Describe,Create
worker         topic prefixed  @APP@-                       Read,Write,Describe,Create
worker         group literal   @APP@                        Read,Describe
plugin         topic literal   fleetwise.commands.training  Read,Describe
plugin         topic literal   fleetwise.acks               Read,Write,Describe
plugin         topic literal   fleetwise.telemetry.steps    Write,Describe
plugin         group prefixed  fleetwise-plugin             Read,Describe
kube-consumer  topic literal   fleetwise.commands.kube      Read,Describe
kube-consumer  topic literal   fleetwise.acks               Read,Write,Describe
kube-consumer  topic literal   fleetwise.operator           Read,Describe
kube-consumer  topic literal   fleetwise.plans              Read,Describe
kube-consumer  group prefixed  fleetwise-kube               Read,Describe
EOF
}

# Client quotas: USER CLIENT_ID(<default>: each client id of the user on its own) KEY VALUE.
# The nodes' agents share the `agent` user but each has its own client id
# (fleetwise-agent-<node>), so one flooding agent is throttled without slowing the others;
# plugins the same. Workers and the kube consumer are not limited. docs/security.md.
quota_table() {
  cat <<EOF
agent   <default>  producer_byte_rate  ${FLEETWISE_KAFKA_AGENT_BYTE_RATE:-1048576}
plugin  <default>  producer_byte_rate  ${FLEETWISE_KAFKA_PLUGIN_BYTE_RATE:-1048576}
EOF
}

random_secret() {  # 32 URL-safe characters
  head -c 48 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' | cut -c1-32
}

# TLS material, passwords and client settings; files holding secrets are 0600.
secure_prepare() {  # DIR
  local dir="$1" u
  command -v openssl >/dev/null || die "openssl is required for --secure"
  command -v python3 >/dev/null || die "python3 is required for --secure (readiness probe)"
  rm -rf "$dir/tls" "$dir/users" "$dir/env"
  mkdir -p "$dir/tls" "$dir/users" "$dir/env"
  chmod 700 "$dir/tls" "$dir/users"
  touch "$dir/secure"
  (
    umask 077
    cd "$dir/tls"
    # Throwaway CA (30 days), EC P-256. Its key stays here (0600) only to sign the broker cert.
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 30 \
      -keyout ca.key -out ca.pem -subj "/CN=fleetwise-throwaway-ca" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      >openssl.log 2>&1
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
      -keyout broker.key -out broker.csr -subj "/CN=${BROKER_CN}" >>openssl.log 2>&1
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n' >broker.ext
    openssl x509 -req -in broker.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 30 \
      -extfile broker.ext -out broker.pem >>openssl.log 2>&1
    random_secret >store.pass
    openssl pkcs12 -export -in broker.pem -inkey broker.key -certfile ca.pem -name broker \
      -out broker.p12 -passout file:store.pass >>openssl.log 2>&1
    chmod 644 ca.pem
  ) || die "could not create the TLS material (see $dir/tls/openssl.log)"
  chmod 755 "$dir/tls"  # ca.pem is public; keys and store password are 0600
  for u in $SECURE_USERS; do
    (umask 077; random_secret >"$dir/users/$u.password")
    cat >"$dir/env/$u.env" <<EOF
# Kafka client settings for the fleetwise "$u" component (source it: set -a; . $dir/env/$u.env)
FLEETWISE_KAFKA_SECURITY=SASL_SSL
FLEETWISE_KAFKA_SASL_MECHANISM=SCRAM-SHA-512
FLEETWISE_KAFKA_USER=$u
FLEETWISE_KAFKA_PASSWORD_FILE=$dir/users/$u.password
FLEETWISE_KAFKA_CA_FILE=$dir/tls/ca.pem
EOF
  done
  # Only admin is created at format time (it must exist before the broker can be reached);
  # the components' users are created over the Admin API (secure_setup), so their passwords
  # never appear on a command line.
  FORMAT_EXTRA=(--add-scram "SCRAM-SHA-512=[name=admin,password=$(cat "$dir/users/admin.password")]")
  acl_table >"$dir/acls.txt"
  quota_table >"$dir/quotas.txt"
}

write_secure_configs() {  # DIR PORT CPORT
  local dir="$1" port="$2" cport="$3" store_pass admin_pass
  store_pass=$(cat "$dir/tls/store.pass")
  admin_pass=$(cat "$dir/users/admin.password")
  write_configs "$dir" "$port" "$cport"
  (umask 077; sed -e '/^listeners=/d' -e '/^advertised.listeners=/d' -e '/^listener.security.protocol.map=/d' \
      -e '/^inter.broker.listener.name=/d' -e '/^auto.create.topics.enable=/d' \
      "$dir/server.properties" >"$dir/server.properties.new")
  mv "$dir/server.properties.new" "$dir/server.properties"
  chmod 600 "$dir/server.properties"
  cat >>"$dir/server.properties" <<EOF
# --secure: SASL_SSL (SCRAM-SHA-512) for clients and between brokers, mutual TLS to the controller
listeners=SASL_SSL://127.0.0.1:${port},CONTROLLER://127.0.0.1:${cport}
advertised.listeners=SASL_SSL://127.0.0.1:${port}
listener.security.protocol.map=SASL_SSL:SASL_SSL,CONTROLLER:SSL
inter.broker.listener.name=SASL_SSL
sasl.enabled.mechanisms=SCRAM-SHA-512
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="${admin_pass}";
ssl.keystore.type=PKCS12
ssl.keystore.location=${dir}/tls/broker.p12
ssl.keystore.password=${store_pass}
ssl.key.password=${store_pass}
ssl.truststore.type=PEM
ssl.truststore.location=${dir}/tls/ca.pem
ssl.enabled.protocols=TLSv1.3,TLSv1.2
listener.name.controller.ssl.client.auth=required
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:admin;User:CN=${BROKER_CN}
auto.create.topics.enable=false
EOF
}

ready_probe() {  # DIR HOST:PORT -- the readiness test for the broker in DIR
  if [ -f "$1/secure" ]; then
    probe_secure "$2" "$1/tls/ca.pem" admin "$1/users/admin.password"
  else
    probe "$2"
  fi
}

# TLS (verified against CAFILE, hostname included), SASL SCRAM-SHA-512 as USER (the server's
# signature checked too), then the same Metadata request as `probe`. Pure python3.
probe_secure() {  # HOST:PORT CAFILE USER PASSWORD_FILE
  python3 - "$@" <<'EOF'
import base64, hashlib, hmac, os, socket, ssl, struct, sys
hostport, cafile, user, pwfile = sys.argv[1:5]
host, _, port = hostport.rpartition(":")
password = open(pwfile).read().strip()
def s16(b): return struct.pack(">h", len(b)) + b
corr = [0]
def request(sock, api, version, body):
    corr[0] += 1
    msg = struct.pack(">hhi", api, version, corr[0]) + s16(b"fleetwise-probe") + body
    sock.sendall(struct.pack(">i", len(msg)) + msg)
    def read(n):
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("connection closed")
            buf += chunk
        return buf
    (size,) = struct.unpack(">i", read(4))
    resp = read(size)
    if struct.unpack(">i", resp[:4])[0] != corr[0]:
        raise ValueError("correlation id mismatch")
    return resp[4:]
def authenticate(sock, payload):  # SaslAuthenticate v0 -> server bytes
    resp = request(sock, 36, 0, struct.pack(">i", len(payload)) + payload)
    (err, mlen) = struct.unpack(">hh", resp[:4])
    at = 4 + max(mlen, 0)
    if err:
        raise PermissionError(resp[4:at].decode(errors="replace"))
    (n,) = struct.unpack(">i", resp[at:at + 4])
    return resp[at + 4:at + 4 + n]
try:
    ctx = ssl.create_default_context(cafile=cafile)
    with socket.create_connection((host, int(port)), timeout=3) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as s:
        s.settimeout(5)
        resp = request(s, 17, 1, s16(b"SCRAM-SHA-512"))  # SaslHandshake v1
        if struct.unpack(">h", resp[:2])[0] != 0:
            sys.exit(1)
        nonce = base64.b64encode(os.urandom(18)).decode()
        first_bare = f"n={user.replace('=', '=3D').replace(',', '=2C')},r={nonce}"
        server_first = authenticate(s, ("n,," + first_bare).encode()).decode()
        attrs = dict(kv.split("=", 1) for kv in server_first.split(","))
        if not attrs["r"].startswith(nonce):
            sys.exit(1)
        salted = hashlib.pbkdf2_hmac("sha512", password.encode(), base64.b64decode(attrs["s"]), int(attrs["i"]))
        client_key = hmac.new(salted, b"Client Key", hashlib.sha512).digest()
        final_bare = f"c=biws,r={attrs['r']}"
        auth_message = f"{first_bare},{server_first},{final_bare}".encode()
        signature = hmac.new(hashlib.sha512(client_key).digest(), auth_message, hashlib.sha512).digest()
        proof = base64.b64encode(bytes(a ^ b for a, b in zip(client_key, signature))).decode()
        server_final = authenticate(s, f"{final_bare},p={proof}".encode()).decode()
        server_key = hmac.new(salted, b"Server Key", hashlib.sha512).digest()
        expected = base64.b64encode(hmac.new(server_key, auth_message, hashlib.sha512).digest()).decode()
        if server_final != f"v={expected}":
            sys.exit(1)
        resp = request(s, 3, 4, struct.pack(">i", 0) + b"\x00")  # Metadata v4, no topics
        sys.exit(0 if struct.unpack(">i", resp[4:8])[0] >= 1 else 1)
except SystemExit:
    raise
except Exception:
    sys.exit(1)
EOF
}

# After the broker answers: the components' SCRAM users and the ACLs, over the Admin API as
# admin (one JVM, a single-file Java program), then a probe as every user.
secure_setup() {  # DIR
  local dir="$1" u deadline
  local admin_pass
  admin_pass=$(cat "$dir/users/admin.password")
  (umask 077; cat >"$dir/admin.properties" <<EOF
bootstrap.servers=$(cat "$dir/bootstrap")
security.protocol=SASL_SSL
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="${admin_pass}";
ssl.truststore.type=PEM
ssl.truststore.location=${dir}/tls/ca.pem
EOF
)
  cat >"$dir/SecureSetup.java" <<'EOF'
import java.nio.file.*;
import java.util.*;
import org.apache.kafka.clients.admin.*;
import org.apache.kafka.common.acl.*;
import org.apache.kafka.common.quota.*;
import org.apache.kafka.common.resource.*;

/** Creates the components' SCRAM users, the ACLs of acls.txt and the client quotas of
 *  quotas.txt (written by kafka.sh). */
public class SecureSetup {
  public static void main(String[] args) throws Exception {
    Path dir = Paths.get(args[0]);
    Properties props = new Properties();
    try (var in = Files.newInputStream(dir.resolve("admin.properties"))) { props.load(in); }
    try (Admin admin = Admin.create(props)) {
      List<UserScramCredentialAlteration> users = new ArrayList<>();
      for (String user : args[1].split(" ")) {
        if (user.equals("admin")) continue;
        String pw = Files.readString(dir.resolve("users/" + user + ".password")).trim();
        users.add(new UserScramCredentialUpsertion(user,
            new ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192), pw));
      }
      admin.alterUserScramCredentials(users).all().get();
      List<AclBinding> acls = new ArrayList<>();
      for (String line : Files.readAllLines(dir.resolve("acls.txt"))) {
        String[] f = line.trim().split("\\s+");
        if (f.length < 5 || f[0].startsWith("#") || f[4].equals("-")) continue;
        ResourceType type = ResourceType.fromString(f[1].toUpperCase());
        PatternType pattern = PatternType.fromString(f[2].toUpperCase());
        for (String op : f[4].split(",")) {
          AclOperation operation = AclOperation.fromString(op.toUpperCase());
          if (type == ResourceType.UNKNOWN || pattern == PatternType.UNKNOWN
              || operation == AclOperation.UNKNOWN) throw new IllegalArgumentException("bad ACL line: " + line);
          acls.add(new AclBinding(new ResourcePattern(type, f[3], pattern),
              new AccessControlEntry("User:" + f[0], "*", operation, AclPermissionType.ALLOW)));
        }
      }
      admin.createAcls(acls).all().get();
      // The authorizer applies ACLs from the metadata log: wait until it shows them all.
      long deadline = System.currentTimeMillis() + 30_000;
      while (true) {
        Collection<AclBinding> have = admin.describeAcls(AclBindingFilter.ANY).values().get();
        if (have.containsAll(acls)) break;
        if (System.currentTimeMillis() > deadline) throw new IllegalStateException("ACLs not visible after 30 s");
        Thread.sleep(200);
      }
      List<ClientQuotaAlteration> quotas = new ArrayList<>();
      for (String line : Files.readAllLines(dir.resolve("quotas.txt"))) {
        String[] f = line.trim().split("\\s+");
        if (f.length < 4 || f[0].startsWith("#")) continue;
        Map<String, String> entity = new HashMap<>();
        entity.put(ClientQuotaEntity.USER, f[0]);
        entity.put(ClientQuotaEntity.CLIENT_ID, f[1].equals("<default>") ? null : f[1]);
        quotas.add(new ClientQuotaAlteration(new ClientQuotaEntity(entity),
            List.of(new ClientQuotaAlteration.Op(f[2], Double.parseDouble(f[3])))));
      }
      admin.alterClientQuotas(quotas).all().get();
      deadline = System.currentTimeMillis() + 30_000;
      while (true) {
        var have = admin.describeClientQuotas(ClientQuotaFilter.all()).entities().get();
        if (have.keySet().containsAll(quotas.stream().map(ClientQuotaAlteration::entity).toList())) break;
        if (System.currentTimeMillis() > deadline) throw new IllegalStateException("quotas not visible after 30 s");
        Thread.sleep(200);
      }
      System.out.println("users: " + users.size() + ", acls: " + acls.size() + ", quotas: " + quotas.size());
    }
  }
}
EOF
  java_opts "$dir"
  if ! java -Xmx256m -XX:CICompilerCount=2 -XX:TieredStopAtLevel=1 "-Dlog4j.configuration=file:$dir/log4j.properties" \
      "-Dlog4j2.configurationFile=$dir/log4j2.properties" -Dlog4j.rootLogger=WARN \
      -cp "$LIBS/*" "$dir/SecureSetup.java" "$dir" "$SECURE_USERS" >"$dir/setup.log" 2>&1; then
    grep -v " INFO " "$dir/setup.log" | tail -n 30 >&2
    return 1
  fi
  log "secure setup: $(grep '^users:' "$dir/setup.log")"
  # SCRAM credentials reach the broker's authenticator through the metadata log too.
  deadline=$(( $(date +%s) + 30 ))
  for u in $SECURE_USERS; do
    until probe_secure "$(cat "$dir/bootstrap")" "$dir/tls/ca.pem" "$u" "$dir/users/$u.password"; do
      if [ "$(date +%s)" -ge "$deadline" ]; then
        log "user $u cannot log in after 30 s"
        return 1
      fi
      sleep 0.3
    done
  done
}

# ---------------------------------------------------------------------------- start
start_once() {  # DIR -> 0 ready, 1 failed, 2 port clash (retry)
  local dir="$1" port cport cid pid deadline
  read -r port cport < <(free_ports)
  rm -rf "$dir/data" "$dir/logs"
  mkdir -p "$dir/data" "$dir/logs"
  if [ "$SECURE" = 1 ]; then
    write_secure_configs "$dir" "$port" "$cport"
  else
    write_configs "$dir" "$port" "$cport"
  fi
  java_opts "$dir"
  cid=$(random_cluster_id)
  echo "$cid" >"$dir/cluster.id"
  if ! java "${JOPTS[@]}" -cp "$LIBS/*" kafka.tools.StorageTool format \
        -t "$cid" -c "$dir/server.properties" ${FORMAT_EXTRA[@]+"${FORMAT_EXTRA[@]}"} \
        >"$dir/format.log" 2>&1; then
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
    if ready_probe "$dir" "127.0.0.1:$port"; then
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
    if [ "$SECURE" = 1 ] && [ ! -f "$dir/secure" ]; then
      die "a plain (not --secure) broker runs in $dir; run: $0 stop $dir"
    fi
    if ready_probe "$dir" "$(cat "$dir/bootstrap")"; then
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
  if [ "$SECURE" = 1 ]; then
    secure_prepare "$dir"
  fi
  for _attempt in 1 2 3; do
    set +e
    start_once "$dir"
    rc=$?
    set -e
    [ "$rc" -eq 2 ] && continue
    break
  done
  [ "$rc" -eq 0 ] || die "could not start Kafka $KAFKA_VERSION (state dir $dir, log $dir/kafka.log)"
  if [ "$SECURE" = 1 ] && ! secure_setup "$dir"; then
    stop_pid "$(cat "$dir/kafka.pid")"
    rm -f "$dir/kafka.pid" "$dir/bootstrap"
    die "secure setup (users, ACLs) failed; see $dir/setup.log and $dir/kafka.log"
  fi
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
    && ready_probe "$dir" "$(cat "$dir/bootstrap")"
}

usage() {
  sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  fetch) do_fetch; echo "$LIBS" ;;
  start)
    if [ "${1:-}" = "--secure" ]; then
      SECURE=1; shift
    elif [ "${2:-}" = "--secure" ]; then
      SECURE=1; set -- "$1"
    fi
    do_start "${1:-}" ;;
  probe-secure)
    [ -n "${1:-}" ] || die "usage: $0 probe-secure DIR [USER]"
    probe_secure "$(cat "$1/bootstrap")" "$1/tls/ca.pem" "${2:-admin}" "$1/users/${2:-admin}.password" ;;
  stop) do_stop "${1:-}" ;;
  bootstrap) do_bootstrap "${1:-}" ;;
  status) do_status "${1:-}" ;;
  probe) [ -n "${1:-}" ] || die "usage: $0 probe HOST:PORT"; probe "$1" ;;
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac
