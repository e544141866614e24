//! Real agents for the tests of the layers above the edge (proxy, gateway, SDK): the
//! `opendsec-agent` binary the workspace built, started on a Unix socket. No mocks.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// `target/<profile>/opendsec-agent`, next to `target/<profile>/deps/<the test>`.
pub fn agent_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let bin = exe.parent().and_then(Path::parent).expect("target/<profile>").join("opendsec-agent");
    assert!(bin.exists(), "{} is missing: build it first with `cargo build --workspace` (or `cargo build -p opendsec-agent`)", bin.display());
    bin
}

/// Starts an agent (default user root) listening on `socket`; it dies with the handle.
pub async fn start_agent(socket: &Path) -> tokio::process::Child {
    let child = tokio::process::Command::new(agent_binary())
        .args(["serve", "--listen", &format!("unix:{}", socket.display()), "--default-user", "root"])
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

/// A loopback port nothing listens on (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind a loopback port").local_addr().expect("its address").port()
}
