#!/usr/bin/env bash
# The microVM driver's benchmark, one command:
#
#   sudo ops/vm-bench.sh [--rounds N] [--forks N] [--memory MIB] [--root DIR]
#
# Installs QEMU and the guest tools if missing, builds the static agent, the `base`
# image and opendsec-vm-bench/opendsec-vm-shim (release), then prints, each beside raw
# QEMU on the same files where that means something: cold boot to first command
# (through the agent), pause (snapshot, QEMU exit, RAM written back and dropped),
# resume to first command, fork xN (source pause, every copy answering, memory).
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
