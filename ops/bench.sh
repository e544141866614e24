#!/usr/bin/env bash
# Builds the `opendsec` server and the benchmark harness in release, then runs
#   opendsec-bench log "$@"
# (append commit latency/throughput of OpenDsec 1-node and 3-node beside a raw durable
# redb commit and etcd 1- and 3-member, plus replay speed). Installs etcd-server if it
# is missing. Example: ops/bench.sh --concurrency 1,16 --ops 1000 --json bench.json
set -euo pipefail
cd "$(dirname "$0")/.."
source ops/lib.sh

ensure_rust
ensure_packages "${BUILD_PACKAGES[@]}" etcd-server

TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
echo "==> building opendsec and opendsec-bench (release, into $TARGET_DIR)"
cargo build --release --locked -p opendsec -p opendsec-bench

echo "==> running opendsec-bench log $*"
exec "$TARGET_DIR/release/opendsec-bench" log --opt "opendsec_bin=$TARGET_DIR/release/opendsec" "$@"
