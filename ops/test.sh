#!/usr/bin/env bash
# Installs what the tests need, builds, and runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
source ops/lib.sh

ensure_rust
ensure_packages "${BUILD_PACKAGES[@]}" "${EDGE_PACKAGES[@]}" "${VM_PACKAGES[@]}" "${CODE_INTERPRETER_TEST_PACKAGES[@]}"
ensure_firecracker

echo "==> building"
cargo build --workspace --all-targets --locked
echo "==> building the static agent"
export OPENDSEC_TEST_AGENT="$PWD/target/agent-static/opendsec-agent"
build_static_agent "$OPENDSEC_TEST_AGENT"

echo "==> the E2B SDKs (pinned venvs) and the images the suites use"
./ops/e2b-venv.sh
IMAGES="${OPENDSEC_IMAGE_DIR:-/var/lib/opendsec/images}"
for image in busybox base code-interpreter-v1; do
  "${CARGO_TARGET_DIR:-$PWD/target}/debug/opendsec-image" build "$image" --store "$IMAGES"
done

echo "==> testing"
# One test at a time within a binary: the cluster tests start real Raft nodes and
# processes whose election timers must not starve on a 2-core machine.
cargo test --workspace --locked --no-fail-fast -- --test-threads=1
