#!/usr/bin/env bash
# Installs what every README example needs (containers, QEMU for microVMs and full VMs,
# Firecracker where /dev/kvm exists, jq, the E2B SDK), builds, and starts the embedded
# single-node OpenDsec (control node, gateway, edge) on 127.0.0.1:7400, then prints how
# to use it.
set -euo pipefail
cd "$(dirname "$0")/.."
source ops/lib.sh

ensure_rust
ensure_packages "${BUILD_PACKAGES[@]}" "${EDGE_PACKAGES[@]}" "${VM_PACKAGES[@]}" "${README_PACKAGES[@]}"
# Firecracker runs microVMs only under KVM: without /dev/kvm the edge uses QEMU alone.
if [ -e /dev/kvm ]; then
  ensure_firecracker
fi
# The E2B SDK for the README's E2B example and your own E2B code.
E2B_SDK=/var/lib/opendsec/e2b
./ops/e2b-venv.sh --sdk "$E2B_SDK"

echo "==> building (release)"
cargo build --release --locked -p opendsec -p opendsec-sdk -p opendsec-edge --bins
# The agent runs inside sandboxes of any image: built static, next to `opendsec`.
bash edge/agent/build-static.sh >/dev/null

BIN="${CARGO_TARGET_DIR:-$PWD/target}/release"
IMAGES="${OPENDSEC_IMAGE_DIR:-/var/lib/opendsec/images}"

# The default images, built once per machine and cached (base takes a minute or two,
# code-interpreter-v1 adds numpy, pandas and matplotlib on top of it; mcp-gateway, the
# template of E2B's `Sandbox.create(mcp=...)`, adds FastMCP and two MCP servers).
for image in busybox base code-interpreter-v1 mcp-gateway; do
  echo "==> image $image"
  "$BIN/opendsec-image" build "$image" --store "$IMAGES"
done
DATA="${OPENDSEC_DATA_DIR:-$PWD/.data/opendsec}"
LOG="$DATA.log"
PIDFILE="$DATA.pid"
TOKEN_FILE="${OPENDSEC_TOKEN_FILE:-$HOME/.config/opendsec/token}"
mkdir -p "$DATA"

if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
  echo "==> OpenDsec already runs (pid $(cat "$PIDFILE")); stop it with: kill $(cat "$PIDFILE")"
else
  echo "==> starting opendsec up (log: $LOG)"
  OPENDSEC_IMAGE_DIR="$IMAGES" nohup "$BIN/opendsec" up --data-dir "$DATA" >"$LOG" 2>&1 &
  echo $! >"$PIDFILE"
fi

for _ in $(seq 1 100); do
  curl -fsS http://127.0.0.1:7400/health >/dev/null 2>&1 && break
  sleep 0.1
done
if ! curl -fsS http://127.0.0.1:7400/health >/dev/null 2>&1; then
  echo "error: OpenDsec did not come up on 127.0.0.1:7400; see $LOG" >&2
  exit 1
fi

if [ ! -s "$TOKEN_FILE" ]; then
  "$BIN/opendsec" init --data-dir "$DATA" --token-file "$TOKEN_FILE"
else
  echo "==> already initialised; the admin token is in $TOKEN_FILE"
fi

# An E2B API key for code written for the E2B SDK, issued once and kept beside the token.
E2B_ENV_FILE="$(dirname "$TOKEN_FILE")/e2b.env"
if [ ! -s "$E2B_ENV_FILE" ]; then
  ( umask 077; OPENDSEC_URL=http://127.0.0.1:7400 OPENDSEC_TOKEN_FILE="$TOKEN_FILE" "$BIN/opendsecctl" e2b env >"$E2B_ENV_FILE" )
fi

cat <<INFO

OpenDsec runs on http://127.0.0.1:7400 (REST under /v1, OpenAPI at /v1/openapi.json).
  export PATH="$BIN:\$PATH"
  export OPENDSEC_URL=http://127.0.0.1:7400
  export OPENDSEC_TOKEN_FILE=$TOKEN_FILE
  id=\$(opendsecctl sandbox create --image base --output json | jq -r .sandbox.id)
  opendsecctl sandbox exec \$id -- python3 -c 'print(6*7)'
More in the README's "Use" section.

E2B SDK code runs against it with these three variables (kept in $E2B_ENV_FILE),
the SDK itself in the venv $E2B_SDK:
$(grep '^export' "$E2B_ENV_FILE" | sed 's/^/  /')
  . $E2B_SDK/bin/activate
INFO
