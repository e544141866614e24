#!/usr/bin/env bash
# Installs the unmodified E2B JS SDKs the JS suite (server/tests/e2b_js.rs) runs, from
# the lockfiles in server/tests/e2b-js/{current,previous} (`npm ci`: exactly the locked
# versions, checked against their integrity hashes):
#
#   ops/e2b-js.sh [DIR]   default /var/lib/opendsec/test/e2b-js (or OPENDSEC_E2B_JS):
#     DIR/current   e2b 2.51.0 + @e2b/code-interpreter 2.8.0
#     DIR/previous  e2b 2.50.0 + @e2b/code-interpreter 2.7.2
#
# Idempotent: a directory whose lockfile is the one installed is left as it is. npm runs
# with its default configuration (its default registry).
set -euo pipefail
cd "$(dirname "$0")/.."
source ops/lib.sh

DIR="${1:-${OPENDSEC_E2B_JS:-/var/lib/opendsec/test/e2b-js}}"

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  ensure_packages "${E2B_JS_TEST_PACKAGES[@]}"
fi
major="$(node -p 'process.versions.node.split(".")[0]')"
if [ "$major" -lt 18 ]; then
  echo "error: node $(node --version) is too old for the JS suite (node --test needs 18 or later)" >&2
  exit 1
fi

for set in current previous; do
  src="server/tests/e2b-js/$set"
  dst="$DIR/$set"
  if [ -d "$dst/node_modules" ] && cmp -s "$src/package-lock.json" "$dst/package-lock.json"; then
    echo "==> $dst is up to date"
    continue
  fi
  echo "==> installing the E2B JS SDK ($set) into $dst"
  mkdir -p "$dst"
  cp "$src/package.json" "$src/package-lock.json" "$dst/"
  (cd "$dst" && npm ci --no-audit --no-fund --ignore-scripts)
done
