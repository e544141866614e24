# Shared helpers for the ops scripts. Sourced, not run.

# Installs the Debian packages given that are not installed yet.
ensure_packages() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "==> installing ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
}

ensure_rust() {
  if ! command -v cargo >/dev/null 2>&1; then
    echo "error: cargo is not installed. Install Rust (rustup) and run this again." >&2
    exit 1
  fi
}

# The packages building and testing OpenDsec needs.
BUILD_PACKAGES=(build-essential pkg-config ca-certificates curl)
# What edges need to run container sandboxes and build their images.
EDGE_PACKAGES=(crun runc busybox-static debootstrap e2fsprogs util-linux mount iproute2)
# What edges need for microVM sandboxes (edge/src/vm): QEMU and the tools that make the
# guest's disks and kernel (the kernel package itself comes with `apt-get download`);
# cpio only reads our initramfs back in a test.
VM_PACKAGES=(qemu-system-x86 erofs-utils xz-utils cpio)
# What the code-interpreter server's tests (edge/tests/code_interpreter.rs) need on the
# host: Debian's python3 with the data stack the code-interpreter-v1 image carries.
CODE_INTERPRETER_TEST_PACKAGES=(python3 python3-matplotlib python3-numpy python3-pandas)

# Builds the static in-sandbox agent into $1 (it runs inside any image, so no shared libraries).
build_static_agent() {
  mkdir -p "$(dirname "$1")"
  bash edge/agent/build-static.sh "$1"
}
