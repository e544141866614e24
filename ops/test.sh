#!/usr/bin/env bash
# Installs what the tests need, builds, runs the gates (rustfmt, clippy), every test
# of the workspace (the README's examples included: server/tests/readme.rs), checks the
# E2B SDK call table of docs/e2b-compatibility.md against the calls the E2B suites
# recorded, runs the fuzz targets (fuzz/) for a short time each, then ends with a
# summary. A test whose prerequisite is missing fails; the one exception, checks that
# need hardware KVM, are counted and named in the last lines, never skipped silently.
set -euo pipefail
cd "$(dirname "$0")/.."
source ops/lib.sh

# Incremental state doubles the target directory and buys nothing in a one-off build.
export CARGO_INCREMENTAL=0

ensure_rust
ensure_rust_gates
ensure_packages "${BUILD_PACKAGES[@]}" "${EDGE_PACKAGES[@]}" "${VM_PACKAGES[@]}" \
  "${CODE_INTERPRETER_TEST_PACKAGES[@]}" "${AGENT_TEST_PACKAGES[@]}" "${APPARMOR_TEST_PACKAGES[@]}" \
  "${README_PACKAGES[@]}" "${IMAGE_TEST_PACKAGES[@]}" "${NETWORK_TEST_PACKAGES[@]}"
ensure_firecracker
ensure_jjava

echo "==> building"
cargo build --workspace --all-targets --locked
echo "==> building the static agent"
export OPENDSEC_TEST_AGENT="$PWD/target/agent-static/opendsec-agent"
build_static_agent "$OPENDSEC_TEST_AGENT"

echo "==> the E2B SDKs (pinned venvs: the suite's, and the README's) and the images the suites use"
./ops/e2b-venv.sh
./ops/e2b-venv.sh --sdk
./ops/e2b-js.sh
IMAGES="${OPENDSEC_IMAGE_DIR:-/var/lib/opendsec/images}"
for image in busybox base code-interpreter-v1 mcp-gateway; do
  "${CARGO_TARGET_DIR:-$PWD/target}/debug/opendsec-image" build "$image" --store "$IMAGES"
done

LOGS="$(mktemp -d /tmp/opendsec-test.XXXXXX)"
# Tests append `check<TAB>reason` here for each check that needs hardware KVM this host
# lacks (edge/tests/support: not_run_needs_hardware_kvm); summarised below.
export OPENDSEC_NOT_RUN_FILE="$LOGS/not-run.tsv"
: >"$OPENDSEC_NOT_RUN_FILE"
# The E2B suites record here which SDK calls their passing tests made
# (server/tests/support/e2b_calls.rs); checked against the doc's table below.
export OPENDSEC_E2B_CALLS_DIR="$LOGS/e2b-calls"

RESULTS=()
FAILED=0
# Runs "$@" as the step named $1 and notes its result; every step runs, whatever failed.
step() {
  local name="$1"
  shift
  echo "==> $name"
  if "$@"; then
    RESULTS+=("ok      $name")
  else
    RESULTS+=("FAILED  $name")
    FAILED=1
  fi
}

run_tests() {
  # One test at a time within a binary: the cluster tests start real Raft nodes and
  # processes whose election timers must not starve on a 2-core machine.
  cargo test --workspace --locked --no-fail-fast -- --test-threads=1 2>&1 | tee "$LOGS/cargo-test.log"
}

# The fuzz targets (fuzz/, its own workspace): built once by cargo-fuzz on the nightly
# toolchain, then each run for $OPENDSEC_FUZZ_SECONDS (20) from its committed seeds. A
# panic, a leak, an allocation over 512 MiB or a process over 512 MiB fails the step. The
# build, the corpus a run grows and any crash input go under the target dir, never the
# repository; each target's output is in the logs directory.
FUZZ_TARGETS=(event_batch peer_frames journal_recovery agent_connect layer_unpack oci_manifest)
run_fuzz() {
  ensure_cargo_fuzz || return 1
  cargo fmt --manifest-path fuzz/Cargo.toml --check || return 1
  local dir="${CARGO_TARGET_DIR:-$PWD/target}/fuzz"
  local seconds="${OPENDSEC_FUZZ_SECONDS:-20}"
  local started=$SECONDS failed=0 t
  cargo +nightly fuzz build --target-dir "$dir" || return 1
  echo "    built in $((SECONDS - started)) s"
  for t in "${FUZZ_TARGETS[@]}"; do
    rm -rf "$dir/runs/$t"
    mkdir -p "$dir/runs/$t/corpus" "$dir/runs/$t/artifacts"
    if cargo +nightly fuzz run --target-dir "$dir" "$t" "$dir/runs/$t/corpus" "fuzz/corpus/$t" -- \
      -max_total_time="$seconds" -rss_limit_mb=512 -malloc_limit_mb=512 \
      -artifact_prefix="$dir/runs/$t/artifacts/" >"$LOGS/fuzz-$t.log" 2>&1; then
      echo "    $t: $(grep -E '^#[0-9]+[[:space:]]+DONE' "$LOGS/fuzz-$t.log" | tail -n 1 | cut -c1-120)"
    else
      echo "    $t FAILED: input in $dir/runs/$t/artifacts/, output in $LOGS/fuzz-$t.log:"
      grep -E 'panicked|ERROR|SUMMARY' "$LOGS/fuzz-$t.log" | head -n 5 | sed 's/^/      /'
      failed=1
    fi
  done
  echo "    fuzz step: $((SECONDS - started)) s"
  return "$failed"
}

step "format (cargo fmt --all --check)" cargo fmt --all --check
step "lints (cargo clippy --workspace --all-targets -- -D warnings)" \
  cargo clippy --workspace --all-targets --locked -- -D warnings
step "tests (cargo test --workspace)" run_tests
# Only after the whole test step: the table needs every E2B suite's record of this run.
step "E2B SDK call table (ops/e2b-compat.py --check)" \
  python3 ops/e2b-compat.py --check --records "$OPENDSEC_E2B_CALLS_DIR"
step "fuzz (cargo +nightly fuzz run, ${OPENDSEC_FUZZ_SECONDS:-20} s a target)" run_fuzz

echo
echo "==> summary (logs in $LOGS)"
printf '  %s\n' "${RESULTS[@]}"
if printf '%s\n' "${RESULTS[@]}" | grep -q '^FAILED  E2B SDK call table'; then
  echo "    hint: once every E2B test passes, run ops/e2b-compat.py --records $OPENDSEC_E2B_CALLS_DIR to regenerate the table"
fi
if [ -s "$LOGS/cargo-test.log" ]; then
  awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
       END { printf "  tests: %d passed, %d failed\n", p, f }' "$LOGS/cargo-test.log"
  grep -E '^test .* \.\.\. FAILED$' "$LOGS/cargo-test.log" | sed -E 's/^test (.*) \.\.\. FAILED$/    failed: \1/' || true
  grep -E '^ +`-p .*`$' "$LOGS/cargo-test.log" | sed -E 's/^ +/    in: /' || true
fi
NOT_RUN="$(cut -f1 "$OPENDSEC_NOT_RUN_FILE" | sort -u)"
if [ -n "$NOT_RUN" ]; then
  count="$(printf '%s\n' "$NOT_RUN" | wc -l)"
  [ "$count" -eq 1 ] && checks="check" || checks="checks"
  echo "  why here: $(cut -f2 "$OPENDSEC_NOT_RUN_FILE" | sort -u | head -n 1 | cut -c1-160)"
  echo "  (each check and its reason: $OPENDSEC_NOT_RUN_FILE)"
  echo "$count $checks not run here: need hardware KVM: $(printf '%s\n' "$NOT_RUN" | paste -sd ';' - | sed 's/;/; /g')"
else
  echo "every check ran (none needed hardware KVM that this host lacks)"
fi
exit "$FAILED"
