//! The agent channel: each VM has a network namespace of its own (`/run/netns/<name>`)
//! holding one persistent tap device owned by the VM's uid, with the host's side of a
//! /30 and, until the edge's `net` room gives a microVM its link out (a veth into this
//! namespace, see `Network::attach_machine`), no route anywhere else. QEMU runs inside
//! that namespace; the edge reaches the
//! guest's agent by connecting from a short-lived thread that enters the namespace (the
//! socket keeps its namespace after the thread is gone). Every namespace looks the same,
//! so the guest's configuration (address, MAC, ARP entry) survives a restore into a new
//! QEMU and is shared by every fork copy.

use std::io::{self, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::{AGENT_PORT, GUEST_IP, HOST_IP, VmError, require_tool};

/// The tap device's name inside each namespace.
pub const TAP: &str = "tap0";
/// The guest NIC's MAC and the tap's (fixed: each pair lives in its own namespace).
pub const GUEST_MAC: &str = "02:4f:44:00:00:02";
const HOST_MAC: &str = "02:4f:44:00:00:01";

/// Where namespace `name` is bound.
pub fn netns_path(name: &str) -> PathBuf {
    Path::new("/run/netns").join(name)
}

fn ip(args: &[&str], stdin: Option<&str>) -> Result<(), VmError> {
    let program = require_tool("ip", "iproute2")?;
    let mut child = Command::new(&program)
        .args(args)
        .env_clear()
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| VmError::io("running ip", e))?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input.as_bytes())
            .map_err(|e| VmError::io("writing to ip -batch", e))?;
    }
    let out = child.wait_with_output().map_err(|e| VmError::io("waiting for ip", e))?;
    if !out.status.success() {
        return Err(VmError::Prerequisite(format!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Creates namespace `name` with its tap (owned by `uid`) addressed and up. An old
/// namespace of the same name (a crashed create) is replaced.
pub fn create(name: &str, uid: u32) -> Result<(), VmError> {
    if netns_path(name).exists() {
        delete(name)?;
    }
    ip(&["netns", "add", name], None)?;
    let [a, b, c, d] = HOST_IP;
    let script = format!(
        "link set lo up\n\
         tuntap add dev {TAP} mode tap user {uid}\n\
         link set {TAP} address {HOST_MAC}\n\
         addr add {a}.{b}.{c}.{d}/30 dev {TAP}\n\
         link set {TAP} up\n"
    );
    let result = ip(&["-n", name, "-batch", "-"], Some(&script));
    if result.is_err() {
        let _ = delete(name);
    }
    result
}

/// Removes namespace `name` (and with it the tap); absent is fine.
pub fn delete(name: &str) -> Result<(), VmError> {
    if !netns_path(name).exists() {
        return Ok(());
    }
    ip(&["netns", "delete", name], None)
}

/// The guest agent's address, as seen from inside the VM's namespace.
pub fn agent_addr() -> SocketAddr {
    let [a, b, c, d] = GUEST_IP;
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(a, b, c, d), AGENT_PORT))
}

/// Connects to `addr` from inside the network namespace at `netns`.
pub(crate) fn connect_in(netns: &Path, addr: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    crate::ns::in_namespace(netns, libc::CLONE_NEWNET, "vm-netns-connect", move || {
        let stream = TcpStream::connect_timeout(&addr, timeout)?;
        stream.set_nodelay(true)?;
        Ok(stream)
    })
}
