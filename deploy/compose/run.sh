#!/usr/bin/env bash
# The compose cluster (deploy/docker-compose.yaml) on one host, with Docker Compose v2 or with podman:
#   deploy/compose/run.sh up      base image (made when none is given), images (built once, cached after), start,
#                                 wait on health, print where to look
#   deploy/compose/run.sh demo    `kvloop demo` turn by turn inside the router container (extra args go to it)
#   deploy/compose/run.sh down    stop and remove every container, network and volume of the project
#   deploy/compose/run.sh all     up, demo, down
#   deploy/compose/run.sh build | status | logs [SERVICE] | exec SERVICE CMD... | compose ARGS...
# Settings (environment):
#   KVLOOP_COMPOSE_ENGINE   docker | podman (default: Docker when `docker compose` reaches a daemon, else podman)
#   KVLOOP_BASE_IMAGE       base of every image (build argument PYTHON_IMAGE). Default with Docker: the Dockerfile's
#                           own (python:3.11.13-slim-bookworm); with podman: kvloop-base:bookworm, made here with
#                           debootstrap from Debian's mirror (KVLOOP_DEBIAN_MIRROR) when it does not exist
#   KVLOOP_STANDINS         1 = deploy/compose/standins.yaml (etcd, Prometheus, Phoenix built from packages);
#                           default 1 with podman, 0 with Docker
#   TORCH_INDEX_URL         where torch +cpu comes from; default "" when the machine's pip find-links hold it
# See deploy/README.md ("Compose on this machine: podman").
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
STATE=$ROOT/.kvloop/compose
PROJECT=kvloop
VERSION=0.1.0
mkdir -p "$STATE"
NICE=(nice -n "${KVLOOP_NICE:-10}")
log() { printf '== %s %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# --- engine ----------------------------------------------------------------------------------------------------------
ENGINE=${KVLOOP_COMPOSE_ENGINE:-}
if [ -z "$ENGINE" ]; then
  if command -v docker >/dev/null && docker compose version >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    ENGINE=docker
  else
    ENGINE=podman
  fi
fi
STANDINS=${KVLOOP_STANDINS:-$([ "$ENGINE" = podman ] && echo 1 || echo 0)}
SOCK=/run/kvloop-podman.sock

FILES=(-f "$ROOT/deploy/docker-compose.yaml")
[ "$STANDINS" = 1 ] && FILES+=(-f "$HERE/standins.yaml")
[ "$ENGINE" = podman ] && FILES+=(-f "$HERE/podman.yaml")

setup_podman() {
  # Debian's podman with runc (crun's rlimit handling is refused here), docker-compose v1 for the compose files over
  # podman's Docker-compatible API, debootstrap for the base image, the dnsname CNI plugin.
  local need=()
  command -v podman >/dev/null || need+=(podman)
  command -v runc >/dev/null || need+=(runc)
  command -v docker-compose >/dev/null || need+=(docker-compose)
  command -v debootstrap >/dev/null || need+=(debootstrap)
  # Service names resolve on podman's CNI networks only with the dnsname plugin (Docker has its own DNS).
  [ -x /usr/lib/cni/dnsname ] || need+=(golang-github-containernetworking-plugin-dnsname)
  if [ ${#need[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || die "install ${need[*]} (Debian packages), or run as root"
    log "apt-get install ${need[*]}"
    "${NICE[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${NICE[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}" \
      uidmap slirp4netns containernetworking-plugins iptables >/dev/null
  fi
  export DOCKER_HOST=unix://$SOCK
  if ! curl -sf --unix-socket "$SOCK" http://d/_ping >/dev/null 2>&1; then
    log "podman system service on $SOCK (runtime runc)"
    rm -f "$SOCK"
    setsid podman --runtime runc system service --time=0 "unix://$SOCK" >"$STATE/podman-service.log" 2>&1 &
    echo $! >"$STATE/podman-service.pid"
    for _ in $(seq 50); do curl -sf --unix-socket "$SOCK" http://d/_ping >/dev/null 2>&1 && break; sleep 0.2; done
    curl -sf --unix-socket "$SOCK" http://d/_ping >/dev/null || die "podman system service did not answer"
  fi
}

compose() {
  if [ "$ENGINE" = docker ]; then
    docker compose -p "$PROJECT" "${FILES[@]}" "$@"
  else
    # docker-compose v1 refuses the Compose specification's top-level `name:` (v2 takes it): it gets a copy of the
    # base file without that line, with deploy/ as its project directory so relative paths stay the same.
    local v1=("${FILES[@]}")
    sed '/^name:/d' "$ROOT/deploy/docker-compose.yaml" >"$STATE/docker-compose.v1.yaml"
    v1[1]=$STATE/docker-compose.v1.yaml
    DOCKER_HOST=unix://$SOCK docker-compose -p "$PROJECT" --project-directory "$ROOT/deploy" "${v1[@]}" "$@"
  fi
}

# --- images ----------------------------------------------------------------------------------------------------------
base_image() {
  if [ -n "${KVLOOP_BASE_IMAGE:-}" ]; then echo "$KVLOOP_BASE_IMAGE"; return; fi
  if [ "$ENGINE" = docker ]; then echo ""; return; fi
  local tag=kvloop-base:bookworm
  if ! podman image exists "$tag"; then
    local mirror=${KVLOOP_DEBIAN_MIRROR:-$(grep -hoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' \
      /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null | head -1 | awk '{print $2}')}
    mirror=${mirror:-http://deb.debian.org/debian}
    log "base image $tag: debootstrap --variant=minbase bookworm from $mirror"
    local rootfs=$STATE/rootfs
    rm -rf "$rootfs"
    local t0=$SECONDS
    "${NICE[@]}" debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" \
      "$mirror" >"$STATE/debootstrap.log" 2>&1 || die "debootstrap failed: see $STATE/debootstrap.log"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | podman import \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$tag" >/dev/null
    rm -rf "$rootfs"
    log "base image $tag made in $((SECONDS - t0)) s"
  fi
  echo "$tag"
}

build_one() {  # TAG DOCKERFILE TARGET
  local tag=$1 file=$2 target=$3 t0=$SECONDS
  local args=(--build-arg "PIP_DIR=.kvloop/compose/pip" --build-arg "TORCH_INDEX_URL=$TORCH_INDEX")
  [ -n "$BASE" ] && args+=(--build-arg "PYTHON_IMAGE=$BASE")
  if [ "$ENGINE" = podman ]; then
    local v
    for v in "${PIP_VOLUMES[@]}"; do args+=(--volume "$v:$v:ro"); done
    "${NICE[@]}" podman --runtime runc build --layers --pull=never --ulimit "nofile=$NOFILE:$NOFILE" \
      --ulimit "nproc=$NPROC:$NPROC" --ignorefile "$ROOT/$file.dockerignore" "${args[@]}" \
      -f "$ROOT/$file" --target "$target" -t "$tag" "$ROOT" >>"$STATE/build.log" 2>&1 \
      || die "building $tag failed: see $STATE/build.log"
  else
    "${NICE[@]}" docker build "${args[@]}" -f "$ROOT/$file" --target "$target" -t "$tag" "$ROOT" \
      >>"$STATE/build.log" 2>&1 || die "building $tag failed: see $STATE/build.log"
  fi
  log "image $tag ($target) in $((SECONDS - t0)) s"
}

build() {
  local t0=$SECONDS
  BASE=$(base_image)
  # The machine's pip configuration (index, find-links, certificate, constraints), staged into the build context.
  mapfile -t PIP_VOLUMES < <(python3 "$HERE/pipconf.py" "$STATE/pip" --builder "$ENGINE" | sed -n 's/^volume //p')
  if [ -n "${TORCH_INDEX_URL+x}" ]; then
    TORCH_INDEX=$TORCH_INDEX_URL
  elif compgen -G "$STATE/pip/files/find-links-*/torch-*+cpu-*.whl" >/dev/null; then
    TORCH_INDEX=""        # the machine's find-links hold torch +cpu: no PyTorch index needed (nor reachable here)
  else
    TORCH_INDEX=https://download.pytorch.org/whl/cpu
  fi
  : >"$STATE/build.log"
  log "building images (base ${BASE:-the Dockerfile default}; log $STATE/build.log)"
  build_one "kvloop:$VERSION" deploy/docker/Dockerfile kvloop
  build_one "kvloop-engine-cpu:$VERSION" deploy/docker/Dockerfile engine-cpu
  if [ "$STANDINS" = 1 ]; then
    build_one kvloop-etcd:3.4-bookworm deploy/compose/Dockerfile.standins etcd
    build_one kvloop-prometheus:2.42-bookworm deploy/compose/Dockerfile.standins prometheus
    build_one kvloop-phoenix:20.26.1 deploy/compose/Dockerfile.standins phoenix
  fi
  sources_hash >"$STATE/images.stamp"
  log "images built in $((SECONDS - t0)) s"
}

# --- health ----------------------------------------------------------------------------------------------------------
# Podman runs health checks from systemd timers; without systemd (this machine) none runs by itself, so compose's
# `condition: service_healthy` would wait forever. While run.sh waits, it runs each unhealthy container's check.
HEALTH_PID=
start_health_ticker() {
  [ "$ENGINE" = podman ] || return 0
  (
    while true; do
      for id in $(podman ps -q --filter "label=com.docker.compose.project=$PROJECT" 2>/dev/null); do
        status=$(podman inspect -f '{{.State.Health.Status}}' "$id" 2>/dev/null || true)
        case "$status" in starting|unhealthy) podman healthcheck run "$id" >/dev/null 2>&1 || true ;; esac
      done
      sleep 5
    done
  ) &
  HEALTH_PID=$!
}
stop_health_ticker() { [ -n "$HEALTH_PID" ] && kill "$HEALTH_PID" 2>/dev/null; HEALTH_PID=; return 0; }

cid() { compose ps -q "$1" | head -1; }
engine_cli() { if [ "$ENGINE" = docker ]; then docker "$@"; else podman "$@"; fi; }

wait_healthy() {  # every service with a health check healthy, and the router's /health 200
  local deadline=$((SECONDS + ${KVLOOP_UP_TIMEOUT_S:-1200})) pending
  while true; do
    pending=()
    local id name status
    for id in $(compose ps -q); do
      name=$(engine_cli inspect -f '{{index .Config.Labels "com.docker.compose.service"}}' "$id")
      status=$(engine_cli inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}' "$id")
      case "$status" in healthy|none|"") ;; *) pending+=("$name:$status") ;; esac
    done
    if [ ${#pending[@]} -eq 0 ] && curl -sf http://127.0.0.1:8080/health >/dev/null; then return 0; fi
    [ $SECONDS -lt $deadline ] || { compose ps >&2; die "not healthy in time: ${pending[*]}"; }
    sleep 5
  done
}

sources_hash() {  # what the images are built from: the package, the Dockerfiles, the pip configuration, the base
  (
    cd "$ROOT"
    # (kvloop/broker, kvloop/engines, kvloop/router are links to folders: their files are hashed under broker/ ...)
    git ls-files -z -- pyproject.toml README.md kvloop broker engines router deploy/docker 'deploy/compose/Dockerfile.*' \
      | xargs -0 sha256sum 2>/dev/null || true
    echo "${KVLOOP_BASE_IMAGE:-} $STANDINS"
    python3 -m pip config list 2>/dev/null || true
  ) | sha256sum | cut -d' ' -f1
}

images_current() {  # every image exists and was built from these sources (else `up` builds; cached layers reused)
  [ "$(cat "$STATE/images.stamp" 2>/dev/null)" = "$(sources_hash)" ] || return 1
  local tag
  for tag in "kvloop:$VERSION" "kvloop-engine-cpu:$VERSION"; do engine_cli image inspect "$tag" >/dev/null 2>&1 || return 1; done
}

# CNI's host-local IPAM hands out addresses after the last one it gave, across runs, and keeps that in
# /var/lib/cni/networks/NETWORK: on a later run the dynamic addresses of the brokers, sidecars ... reach the engines'
# static ones (172.30.0.21/.22/.31: "requested IP address ... is not available"). With no network of the project
# left, its leases are stale: forget them, so dynamic addresses start again at .2.
forget_cni_leases() {
  local net=${PROJECT}_kvloop
  if ! podman network exists "$net" 2>/dev/null; then rm -rf "/var/lib/cni/networks/$net"; fi
}

up() {
  [ "$ENGINE" = podman ] && setup_podman
  if [ "${KVLOOP_BUILD:-auto}" = 1 ] || ! images_current; then build; else log "images current (KVLOOP_BUILD=1 rebuilds)"; fi
  local t0=$SECONDS
  log "starting the cluster (${FILES[*]})"
  [ "$ENGINE" = podman ] && forget_cni_leases
  start_health_ticker
  trap stop_health_ticker EXIT
  if [ "$ENGINE" = docker ]; then
    compose up -d --no-build --wait --wait-timeout "${KVLOOP_UP_TIMEOUT_S:-1200}"
  else
    NOFILE=$NOFILE NPROC=$NPROC compose up -d --no-build
  fi
  wait_healthy
  stop_health_ticker
  echo "$((SECONDS - t0))" >"$STATE/healthy_s"
  log "healthy in $((SECONDS - t0)) s"
  where
}

where() {
  cat <<EOF
Router (OpenAI API, model "tiny"): http://127.0.0.1:8080   (health /health, metrics /metrics)
Demo through the router container:  deploy/compose/run.sh demo
Prometheus:                         http://127.0.0.1:9090/targets
EOF
  if [ "$STANDINS" = 1 ]; then
    cat <<EOF
Traces (Arize Phoenix, stand-in for Jaeger): http://127.0.0.1:16686   (project "default"; spans kvloop.turn ...;
                                    API: curl http://127.0.0.1:16686/v1/projects/default/spans)
Grafana and the OTel collector: not run (no package on this machine; profile upstream-images)
EOF
  else
    cat <<EOF
Jaeger: http://127.0.0.1:16686 (service kvloop-router, operation kvloop.turn)
Grafana: http://127.0.0.1:3000 (dashboard kvloop)
EOF
  fi
  echo "Logs: deploy/compose/run.sh logs [SERVICE]; stop: deploy/compose/run.sh down"
}

demo() {
  [ "$ENGINE" = podman ] && setup_podman
  local router
  router=$(cid router)
  [ -n "$router" ] || die "no router container: run deploy/compose/run.sh up first"
  engine_cli exec "$router" kvloop demo --router http://127.0.0.1:8080 "$@" | tee "$STATE/demo.txt"
}

down() {
  if [ "$ENGINE" = podman ]; then
    command -v podman >/dev/null || { log "no podman: nothing to stop"; return 0; }
    setup_podman
  fi
  compose down -v --remove-orphans --timeout 20 || true
  if [ "$ENGINE" = podman ]; then
    # Left-overs of an interrupted run (compose down only knows the services it was given).
    local ids
    ids=$(podman ps -aq --filter "label=com.docker.compose.project=$PROJECT")
    [ -z "$ids" ] || podman rm -f $ids >/dev/null
    ids=$(podman volume ls -q --filter "label=com.docker.compose.project=$PROJECT")
    [ -z "$ids" ] || podman volume rm -f $ids >/dev/null
    podman network ls -q --filter "label=com.docker.compose.project=$PROJECT" | xargs -r podman network rm -f >/dev/null
    forget_cni_leases
    if [ -f "$STATE/podman-service.pid" ]; then
      kill "$(cat "$STATE/podman-service.pid")" 2>/dev/null || true
      rm -f "$STATE/podman-service.pid" "$SOCK"
    fi
  fi
  leftovers
}

leftovers() {  # prints what of the project is still there; exit 1 if anything
  local left
  left=$(
    engine_cli ps -aq --filter "label=com.docker.compose.project=$PROJECT" | sed 's/^/container /'
    engine_cli network ls -q --filter "label=com.docker.compose.project=$PROJECT" | sed 's/^/network /'
    engine_cli volume ls -q --filter "label=com.docker.compose.project=$PROJECT" | sed 's/^/volume /'
  )
  if [ -n "$left" ]; then echo "left behind: $left" >&2; return 1; fi
  log "down: no container, network or volume of project $PROJECT left"
}

# Podman here: explicit ulimits (the service's hard limits, capped) for builds and containers (podman.yaml).
NOFILE=${KVLOOP_NOFILE:-16384}
NPROC=${KVLOOP_NPROC:-16384}
export KVLOOP_NOFILE=$NOFILE KVLOOP_NPROC=$NPROC

case "${1:-}" in
  build) [ "$ENGINE" = podman ] && setup_podman; build ;;
  up) up ;;
  demo) shift; demo "$@" ;;
  down) down ;;
  all) up; demo; down ;;
  status) [ "$ENGINE" = podman ] && setup_podman; compose ps ;;
  logs) shift; [ "$ENGINE" = podman ] && setup_podman; compose logs --no-color "$@" ;;
  compose) shift; [ "$ENGINE" = podman ] && setup_podman; compose "$@" ;;
  exec) shift; [ "$ENGINE" = podman ] && setup_podman; svc=$1; shift; id=$(cid "$svc")
        [ -n "$id" ] || die "no container for $svc"; engine_cli exec "$id" "$@" ;;
  where) where ;;
  *) sed -n '2,20p' "$0" >&2; exit 2 ;;
esac
