#!/usr/bin/env bash
# The microVM driver's benchmark, one command:
#
#   sudo ops/vm-bench.sh [--rounds N] [--forks N] [--restores N] [--memory MIB] [--root DIR]
#
# Installs QEMU and the guest tools if missing, builds the static agent, the `base`
# image and opendsec-vm-bench/opendsec-vm-shim (release), then prints medians over
# --rounds (5), each beside raw QEMU (started by the benchmark with the same machine
# and files, QMP driven by it): cold boot to first command (through the agent);
# restore from a snapshot to first command; pause; resume to first command; fork x8
# (source pause, all copies answering, the copies' PSS); 16 concurrent restores of one
# snapshot; and the issue's goals as PASS/MISS (restore <= 1.3x raw QEMU, fork source
# pause < 20 ms, 16 restores < 2x one). About 5-10 minutes under TCG.
# Guests run under KVM where a probe guest shows it works at hardware speed, else TCG.
set -euo pipefail
cd "$(dirname "$0")/.."
source ops/lib.sh

ensure_rust
ensure_packages "${BUILD_PACKAGES[@]}" "${EDGE_PACKAGES[@]}" "${VM_PACKAGES[@]}"
ensure_firecracker
agent="$PWD/target/agent-static/opendsec-agent"
build_static_agent "$agent"
cargo build --release -p opendsec-edge --bin opendsec-vm-bench --bin opendsec-vm-shim --bin opendsec-image
target_dir="${CARGO_TARGET_DIR:-$PWD/target}"
store="${OPENDSEC_IMAGE_DIR:-/var/lib/opendsec/images}"
"$target_dir/release/opendsec-image" build base --store "$store"
exec "$target_dir/release/opendsec-vm-bench" --store "$store" --agent "$agent" \
    --shim "$target_dir/release/opendsec-vm-shim" "$@"
