#!/usr/bin/env bash
# Five benchmarks, each one command:
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
#
#   sudo ops/bench.sh images [--runs 3] [--warm-runs 20] [--sandboxes 100] [--json out.json] [--data-dir D] [--image-dir S]
#     Builds `opendsec`, `opendsec-shim`, the static agent and the harness in release,
#     then runs opendsec-bench images (issue 16) with a ~500 MB OCI image made from the
#     store's own `base` (built first if the store lacks it: debootstrap and apt, minutes),
#     tarred, gzipped, written as an OCI layout and pushed with skopeo to Debian's
#     docker-registry on a free loopback port. Cold (each run on an empty store):
#     POST /v1/images until ready, then create -> first output of `echo hi`; a create
#     naming the registry reference; beside them `skopeo copy` + `umoci unpack` (+ syncfs)
#     + `crun run`. Warm: create -> first output from the stored image beside `base`.
#     Disk: --sandboxes sandboxes of the image at once, `du -sx` of the store's layers
#     (stored once: they do not grow) and of the sandboxes' directories, beside that many
#     umoci bundles. Medians; --json writes every figure. Needs root; installs the edge
#     and image packages (docker-registry, skopeo, umoci) if missing. The image is pulled
#     into the store S (default /var/lib/opendsec/images) for the warm and disk steps and
#     removed from it afterwards. About 5 minutes with the defaults on 2 cores (first
#     try `--runs 1 --warm-runs 5 --sandboxes 10`). Put --data-dir and --image-dir on a
#     journaled file system: on ext4 without a journal, creating files costs CPU in
#     proportion to the files deleted there in the last 12 hours, and the cold figures
#     measure that (the benchmark warns; ops/bench/src/images/mod.rs says more).
#
#   sudo ops/bench.sh network [--runs 50] [--create-runs 20] [--iperf-rounds 3] [--iperf-seconds 5] [--json out.json] [--data-dir D]
#     Builds `opendsec`, `opendsec-shim`, the static agent and the harness in release,
#     then runs opendsec-bench network in an internet of its own made of network
#     namespaces (an edge namespace with a management veth to this one and an uplink to
#     an "internet" namespace whose loopback holds 11.0.0.x servers: TCP accept and echo,
#     `iperf3 -s`, an authoritative DNS server for *.test; and a raw namespace routed and
#     masqueraded through the edge namespace without OpenDsec's table). `opendsec up
#     --microvm off --upstream-dns 11.0.0.53` runs in the edge namespace (nsenter) and is
#     driven over REST. Measures: policy update to enforcement (PUT
#     /v1/sandboxes/{id}/network -> the change seen by TCP connects every 1 ms from the
#     sandbox's namespace, and by an open connection; p50/p99 each way, goal p50 < 100 ms);
#     iperf3 -t 5 both ways from the sandbox's namespace through its policy beside the raw
#     namespace (goal: within 10%); UDP A queries through the edge's DNS proxy (a name's
#     first answer, a repeated one, a refused one) beside the same query straight to the
#     server; create -> first output of `echo hi` with networking and then on an
#     `opendsec up --no-sandbox-network` (default --warm-sandboxes 2), back to back and
#     spaced (each create once the warm pool is full again). Every namespace, the
#     servers, `opendsec up` and its containers and sandbox network are removed at the
#     end, also on error or Ctrl-C. Needs root and the busybox image; installs the edge
#     packages and iperf3 if missing. About 2 minutes with the defaults on 2 cores, after
#     the build.
#
#   sudo ops/bench.sh e2b [--runs 20] [--json out.json] [--data-dir D]
#     Builds `opendsec`, `opendsec-shim` and the static agent in release, makes the E2B
#     SDK venvs (ops/e2b-venv.sh), then runs ops/bench/e2b_bench.py with e2b 2.63.0: p50/p90
#     of Sandbox.create(), the first commands.run("echo hi"), files.write + read of
#     1 MiB, pause + connect (a freeze, and file-system only), code_interpreter
#     Sandbox.create() and its first run_code("1+1") through the unmodified SDK,
#     beside the same create through the native /v1 API, against the goals (create
#     < 150 ms, first command < 20 ms; code interpreter create < 100 ms, its first
#     run_code < 20 ms).
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

if [ "${1:-}" = "images" ]; then
  shift
  if [ "$(id -u)" -ne 0 ]; then
    echo "error: the images benchmark runs containers and writes layers as root: run it as root" >&2
    exit 1
  fi
  ensure_packages "${BUILD_PACKAGES[@]}" "${EDGE_PACKAGES[@]}" "${IMAGE_BENCH_PACKAGES[@]}"
  echo "==> building opendsec, opendsec-shim, opendsec-bench (release, into $TARGET_DIR)"
  cargo build --release --locked -p opendsec -p opendsec-edge -p opendsec-bench --bins
  echo "==> building the static agent"
  AGENT="$(CARGO_TARGET_DIR="$TARGET_DIR" bash edge/agent/build-static.sh | tail -n 1)"
  echo "==> running opendsec-bench images $*"
  exec "$TARGET_DIR/release/opendsec-bench" images \
    --opendsec-bin "$TARGET_DIR/release/opendsec" --agent "$AGENT" "$@"
fi

if [ "${1:-}" = "network" ]; then
  shift
  if [ "$(id -u)" -ne 0 ]; then
    echo "error: the network benchmark makes network namespaces and runs containers: run it as root" >&2
    exit 1
  fi
  ensure_packages "${BUILD_PACKAGES[@]}" "${EDGE_PACKAGES[@]}" "${NETWORK_BENCH_PACKAGES[@]}"
  echo "==> building opendsec, opendsec-shim, opendsec-bench (release, into $TARGET_DIR)"
  cargo build --release --locked -p opendsec -p opendsec-edge -p opendsec-bench --bins
  echo "==> building the static agent"
  AGENT="$(CARGO_TARGET_DIR="$TARGET_DIR" bash edge/agent/build-static.sh | tail -n 1)"
  echo "==> running opendsec-bench network $*"
  exec "$TARGET_DIR/release/opendsec-bench" network \
    --opendsec-bin "$TARGET_DIR/release/opendsec" --agent "$AGENT" "$@"
fi

if [ "${1:-}" = "e2b" ]; then
  shift
  if [ "$(id -u)" -ne 0 ]; then
    echo "error: the E2B benchmark runs containers: run it as root" >&2
    exit 1
  fi
  ensure_packages "${BUILD_PACKAGES[@]}" "${EDGE_PACKAGES[@]}"
  echo "==> building opendsec, opendsec-shim (release, into $TARGET_DIR)"
  cargo build --release --locked -p opendsec -p opendsec-edge --bins
  echo "==> building the static agent"
  AGENT="$(CARGO_TARGET_DIR="$TARGET_DIR" bash edge/agent/build-static.sh | tail -n 1)"
  VENV="${OPENDSEC_E2B_VENV:-/var/lib/opendsec/test/e2b}"
  bash ops/e2b-venv.sh "$VENV"
  echo "==> running ops/bench/e2b_bench.py $*"
  exec "$VENV/2.63/bin/python" -B ops/bench/e2b_bench.py \
    --opendsec-bin "$TARGET_DIR/release/opendsec" --agent "$AGENT" "$@"
fi

ensure_packages "${BUILD_PACKAGES[@]}" etcd-server
echo "==> building opendsec and opendsec-bench (release, into $TARGET_DIR)"
cargo build --release --locked -p opendsec -p opendsec-bench

echo "==> running opendsec-bench log $*"
exec "$TARGET_DIR/release/opendsec-bench" log --opt "opendsec_bin=$TARGET_DIR/release/opendsec" "$@"
