#!/usr/bin/env bash
# Builds opendsec-agent as a fully static binary (glibc, static-pie, stripped).
# The agent resolves users from /etc/passwd itself and does no DNS, so glibc's
# NSS (which a static binary cannot load) is never needed.
#
# Usage: edge/agent/build-static.sh [OUT]   (prints the binary's path; copies it to OUT if given)
# Honours CARGO_TARGET_DIR. Note that a plain `cargo build --release` of the
# workspace writes the same path with a dynamic binary: copy to OUT to keep it.
set -euo pipefail
cd "$(dirname "$0")/../.."
target_dir="${CARGO_TARGET_DIR:-$PWD/target}"
cargo rustc -p opendsec-agent --release --bin opendsec-agent -- \
    -C target-feature=+crt-static -C strip=symbols
bin="$target_dir/release/opendsec-agent"
# ldd says "statically linked" (static-pie) or "not a dynamic executable"
# (non-PIE static); any "=>" line means shared libraries are needed.
if ldd "$bin" 2>/dev/null | grep -q '=>'; then
    echo "build-static.sh: $bin is dynamically linked" >&2
    exit 1
fi
if [ $# -ge 1 ]; then
    install -m 0755 "$bin" "$1"
    bin="$1"
fi
echo "$bin"
