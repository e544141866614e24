//! Real agents for the tests of the layers above the edge (proxy, gateway, SDK): the
//! `opendsec-agent` binary the workspace built, started on a Unix socket. No mocks.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// `target/<profile>/opendsec-agent`, next to `target/<profile>/deps/<the test>`.
pub fn agent_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .join("opendsec-agent");
    assert!(
        bin.exists(),
        "{} is missing: build it first with `cargo build --workspace` (or `cargo build -p opendsec-agent`)",
        bin.display()
    );
    bin
}

/// Starts an agent (default user root) listening on `socket`; it dies with the handle.
pub async fn start_agent(socket: &Path) -> tokio::process::Child {
    let child = tokio::process::Command::new(agent_binary())
        .args([
            "serve",
            "--listen",
            &format!("unix:{}", socket.display()),
            "--default-user",
            "root",
        ])
        .kill_on_drop(true)
        .spawn()
        .expect("start opendsec-agent");
    for _ in 0..200 {
        if tokio::net::UnixStream::connect(socket).await.is_ok() {
            return child;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("opendsec-agent did not listen on {} within 5 s", socket.display());
}

/// A loopback port nothing listens on (bound, then released), for a server a test
/// starts next. It is taken below the kernel's ephemeral range: a port from `bind(0)`
/// comes from that range, where any outgoing connection of a test running beside this
/// one may take it as its source port before the server binds it. Below the range only
/// another test's explicit bind can take it, and the start is random.
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    static TRIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    const FIRST: u16 = 10_000;
    if low > FIRST + 1000 {
        let span = u64::from(low - FIRST);
        for _ in 0..200 {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(TRIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
            h.write_u32(std::process::id());
            let port = FIRST + (h.finish() % span) as u16;
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind a loopback port")
        .local_addr()
        .expect("its address")
        .port()
}

/// A Python program for tests of memory state: a counter that lives only in the memory
/// of a guest process; each connection to 127.0.0.1:7777 adds one and reads the new
/// value back.
pub const COUNTER: &str = r#"
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 7777))
s.listen(8)
n = 0
while True:
    c, _ = s.accept()
    n += 1
    c.sendall(b"%d\n" % n)
    c.close()
"#;
