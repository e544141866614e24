#!/usr/bin/env bash
# Creates the Python environments the unmodified E2B SDKs run from:
#
#   ops/e2b-venv.sh [DIR]        the E2B conformance suite's (server/tests/e2b_sdk.rs) and
#                                the E2B benchmark's (ops/bench.sh e2b); default
#                                /var/lib/opendsec/test/e2b:
#     DIR/2.63  e2b 2.63.0 + e2b-code-interpreter 2.11.5 + pytest: the current SDK
#               (POST /v2/sandboxes), sync and async clients, the code interpreter;
#               with mcp 2.3.0, the official MCP client the MCP tests call the gateway with.
#     DIR/2.50  e2b 2.50.0 + pytest: the last SDK that creates through POST /sandboxes (v1).
#
#   ops/e2b-venv.sh --sdk [DIR]  one venv with the current SDK for your own code (what
#                                ./ops/up.sh makes for the README's example); default
#                                /var/lib/opendsec/e2b: `. DIR/bin/activate`.
#
# Idempotent: a venv whose pinned versions are already installed is left as it is.
# pip runs with its default configuration (the public index).
set -euo pipefail
cd "$(dirname "$0")/.."
source ops/lib.sh

SDK_ONLY=""
if [ "${1:-}" = "--sdk" ]; then
  SDK_ONLY=1
  shift
  DIR="${1:-/var/lib/opendsec/e2b}"
else
  DIR="${1:-${OPENDSEC_E2B_VENV:-/var/lib/opendsec/test/e2b}}"
fi

SDK=(e2b==2.63.0 e2b-code-interpreter==2.11.5)
PYTEST=(pytest==9.2.0)
SET_263=("${SDK[@]}" "${PYTEST[@]}" pytest-asyncio==1.5.0 mcp==2.3.0)
SET_250=(e2b==2.50.0 "${PYTEST[@]}")

if ! command -v python3 >/dev/null 2>&1; then
  ensure_packages python3
fi
# Debian splits venv (and ensurepip) out of python3.
if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
  ensure_packages python3-venv
fi

# True when every `name==version` in the list is what the venv at $1 has installed.
pinned_present() {
  local venv="$1"; shift
  [ -x "$venv/bin/python" ] || return 1
  "$venv/bin/python" - "$@" <<'EOF'
import sys
from importlib.metadata import version, PackageNotFoundError
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    try:
        if version(name) != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
EOF
}

make_venv() {
  local venv="$1"; shift
  if pinned_present "$venv" "$@"; then
    echo "==> $venv: $* already installed"
    return
  fi
  if [ ! -x "$venv/bin/python" ]; then
    echo "==> creating venv $venv"
    mkdir -p "$(dirname "$venv")"
    python3 -m venv "$venv"
  fi
  echo "==> installing into $venv: $*"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
  if ! pinned_present "$venv" "$@"; then
    echo "error: $venv does not have $* after pip install" >&2
    exit 1
  fi
  echo "==> $venv ready"
}

if [ -n "$SDK_ONLY" ]; then
  make_venv "$DIR" "${SDK[@]}"
else
  make_venv "$DIR/2.63" "${SET_263[@]}"
  make_venv "$DIR/2.50" "${SET_250[@]}"
  echo "==> E2B SDK venvs ready under $DIR (OPENDSEC_E2B_VENV=$DIR)"
fi
