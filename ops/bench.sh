#!/usr/bin/env bash
# Two benchmarks, each one command:
#
#   ops/bench.sh [log] [log options]
#     Builds the `opendsec` server and the harness in release, then runs
#     opendsec-bench log "$@": append commit latency/throughput of OpenDsec 1-node and
#     3-node beside a raw durable redb commit and etcd 1- and 3-member, plus replay
#     speed. Installs etcd-server if it is missing.
#     Example: ops/bench.sh --concurrency 1,16 --ops 1000 --json bench.json
#
#   sudo ops/bench.sh sandboxes [--runs 50] [--bursts 200,1000] [--image busybox] [--data-dir D]
#     Builds `opendsec`, `opendsec-shim`, the static agent and the harness in release,
#     then runs opendsec-bench sandboxes: create -> first exec output through the REST
#     API of a real `opendsec up` beside raw `crun run`/`runc run` of the same bundle,
#     pause/resume latency, and bursts of concurrent creates (total time, failures, peak
#     memory). Needs root, crun/runc and the busybox image (`opendsec-image build busybox`
#     or a first `opendsec up` builds it). Installs the edge packages if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
source ops/lib.sh

ensure_rust
TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"

# `ops/bench.sh log ...` and `ops/bench.sh ...` both run the log benchmark.
if [ "${1:-}" = "log" ]; then
  shift
fi
if [ "${1:-}" = "sandboxes" ]; then
  shift
  if [ "$(id -u)" -ne 0 ]; then
    echo "error: the sandboxes benchmark runs containers: run it as root" >&2
    exit 1
  fi
  ensure_packages "${BUILD_PACKAGES[@]}" "${EDGE_PACKAGES[@]}"
  # One cargo invocation for all three packages: one feature resolution, so a second
  # run rebuilds nothing.
  echo "==> building opendsec, opendsec-shim, opendsec-bench (release, into $TARGET_DIR)"
  cargo build --release --locked -p opendsec -p opendsec-edge -p opendsec-bench --bins
  echo "==> building the static agent"
  AGENT="$(CARGO_TARGET_DIR="$TARGET_DIR" bash edge/agent/build-static.sh | tail -n 1)"
  echo "==> running opendsec-bench sandboxes $*"
  exec "$TARGET_DIR/release/opendsec-bench" sandboxes \
    --opendsec-bin "$TARGET_DIR/release/opendsec" --agent "$AGENT" "$@"
fi

ensure_packages "${BUILD_PACKAGES[@]}" etcd-server
echo "==> building opendsec and opendsec-bench (release, into $TARGET_DIR)"
cargo build --release --locked -p opendsec -p opendsec-bench

echo "==> running opendsec-bench log $*"
exec "$TARGET_DIR/release/opendsec-bench" log --opt "opendsec_bin=$TARGET_DIR/release/opendsec" "$@"
