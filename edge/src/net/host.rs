//! The host around the edge's network: forwarding and sysctls, the edge's tag, a
//! sandbox's hosts file, and what a stopped edge's network left behind ([`forget`]).

use super::*;

/// A short hash of the edge's identity (its name and data directory).
pub(super) fn tag_of(name: &str, data_dir: &Path) -> String {
    use sha2::Digest;
    let dir = std::fs::canonicalize(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
    let h = sha2::Sha256::digest(format!("{name}\n{}", dir.display()).as_bytes());
    hex::encode(h)[..5].to_string()
}

pub(super) fn write_sysctl(path: &str, value: &str) -> Result<(), NetError> {
    std::fs::write(path, value).map_err(|e| NetError::io(format!("writing {path}"), e))
}

pub(super) fn read_sysctl(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// Whether this network namespace has IPv6.
pub(super) fn ipv6_usable() -> bool {
    read_sysctl(Path::new("/proc/sys/net/ipv6/conf/all/disable_ipv6")).as_deref() == Some("0")
}

/// Turns on forwarding (IPv6 too when `v6`), keeping router advertisements where they
/// were accepted.
pub(super) fn enable_forwarding(v6: bool) -> Result<(), NetError> {
    if read_sysctl(Path::new("/proc/sys/net/ipv4/ip_forward")).as_deref() != Some("1") {
        write_sysctl("/proc/sys/net/ipv4/ip_forward", "1")?;
        tracing::info!("IPv4 forwarding turned on for sandbox egress");
    }
    if v6 && read_sysctl(Path::new("/proc/sys/net/ipv6/conf/all/forwarding")).as_deref() != Some("1") {
        for e in std::fs::read_dir("/proc/sys/net/ipv6/conf")
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            if matches!(name.as_str(), "all" | "default" | "lo") {
                continue;
            }
            if read_sysctl(&e.path().join("accept_ra")).as_deref() == Some("1") {
                let _ = std::fs::write(e.path().join("accept_ra"), "2");
            }
        }
        write_sysctl("/proc/sys/net/ipv6/conf/all/forwarding", "1")?;
        tracing::info!("IPv6 forwarding turned on for sandbox egress (accept_ra=2 where RAs were accepted)");
    }
    Ok(())
}

pub(super) fn hosts_text(hostname: &str, slot: &Slot) -> String {
    let mut s = format!(
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n{}\t{hostname}\n",
        slot.v4
    );
    if let Some(v6) = slot.v6 {
        s.push_str(&format!("{v6}\t{hostname}\n"));
    }
    s
}

/// In the edge's data directory: its network's tag, table and files directory, for
/// [`forget`].
pub(super) const OWNER_FILE: &str = "net.owner";

/// Removes everything the network of a stopped edge (data directory `data_dir`) left on
/// this host, in the caller's network namespace: its table, its sandboxes' namespaces,
/// veths and sysfs mounts, its address claims and records under `state_dir`. For a
/// test's end, or an edge retired for good; nothing if it never had a network.
pub fn forget(data_dir: &Path, state_dir: &Path) {
    let Some((tag, table, files)) = std::fs::read_to_string(data_dir.join(OWNER_FILE)).ok().and_then(|t| {
        let mut w = t.trim_end().splitn(3, ' ');
        Some((w.next()?.to_string(), w.next()?.to_string(), PathBuf::from(w.next()?)))
    }) else {
        return;
    };
    for e in std::fs::read_dir(files.join("sys")).into_iter().flatten().flatten() {
        link::unmount_sysfs(&e.path());
    }
    for n in link::netns_with_prefix(&format!("opendsec-{tag}-")) {
        let _ = link::delete_netns(&n);
    }
    for l in link::links_with_prefix(&format!("od{tag}")).unwrap_or_default() {
        let _ = link::delete_veth(&l);
    }
    let _ = nft::delete_table(&table);
    for e in std::fs::read_dir(state_dir.join("claims"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if std::fs::read_to_string(e.path()).is_ok_and(|t| t == tag) {
            let _ = std::fs::remove_file(e.path());
        }
    }
    let _ = std::fs::remove_dir_all(state_dir.join("edges").join(&tag));
    let _ = std::fs::remove_file(state_dir.join("edges").join(format!("{tag}.lock")));
}
