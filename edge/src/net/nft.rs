//! Applying rules: each script goes whole to libnftables in-process (`libnft.rs`), or to
//! `nft -f -` where the library cannot be opened (and for another namespace's table);
//! the kernel takes it as one transaction (all of it or none of it), and what nftables
//! says on failure is the error.

use super::NetError;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// The `nft` binary.
pub fn binary() -> Result<PathBuf, NetError> {
    ["/usr/sbin/nft", "/sbin/nft", "/usr/bin/nft", "/bin/nft"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or_else(|| {
            NetError::Config(
                "nft is missing: sandbox egress is enforced with nftables; install the nftables package".into(),
            )
        })
}

fn failed(script: &str, stderr: &[u8]) -> NetError {
    let first: String = script.lines().take(3).collect::<Vec<_>>().join("; ");
    NetError::Nft(format!(
        "{} (script beginning: {first})",
        String::from_utf8_lossy(stderr).trim()
    ))
}

/// Applies `script` in one transaction.
pub fn apply(script: &str) -> Result<(), NetError> {
    // On the one netns worker: libnftables' allocations (its ruleset cache) stay in that
    // thread's arena rather than in one per calling thread.
    let owned = script.to_string();
    match super::link::on_worker(None, move || Ok(super::libnft::run(&owned)))? {
        Some(Ok(_)) => Ok(()),
        Some(Err(e)) => Err(failed(script, e.as_bytes())),
        None => apply_in(None, script),
    }
}

/// Applies `script` in one transaction inside network namespace `netns` (`None`: the
/// edge's own).
pub fn apply_in(netns: Option<&std::path::Path>, script: &str) -> Result<(), NetError> {
    let mut cmd = Command::new(binary()?);
    if let Some(path) = netns {
        let ns = std::fs::File::open(path).map_err(|e| NetError::io(format!("opening {}", path.display()), e))?;
        // SAFETY: between fork and exec the child only calls setns, which is
        // async-signal-safe; `ns` stays open in the parent until the child has run it.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                if libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut child = cmd
        .args(["-f", "-"])
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| NetError::io("running nft", e))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(|e| NetError::io("writing to nft", e))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| NetError::io("waiting for nft", e))?;
    if !out.status.success() {
        return Err(failed(script, &out.stderr));
    }
    Ok(())
}

/// Applies `script` in one transaction, from async code (the DNS proxy).
pub async fn apply_async(script: &str) -> Result<(), NetError> {
    let script = script.to_string();
    tokio::task::spawn_blocking(move || apply(&script))
        .await
        .unwrap_or_else(|e| Err(NetError::Nft(format!("the nft task failed: {e}"))))
}

/// `nft -j <args>` as JSON (`None`: the object does not exist).
fn json(args: &[&str]) -> Result<Option<serde_json::Value>, NetError> {
    let out = Command::new(binary()?)
        .arg("-j")
        .args(args)
        .env_clear()
        .stdin(Stdio::null())
        .output()
        .map_err(|e| NetError::io("running nft", e))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("No such file or directory") || err.contains("does not exist") {
            return Ok(None);
        }
        return Err(NetError::Nft(format!("nft -j {}: {}", args.join(" "), err.trim())));
    }
    serde_json::from_slice(&out.stdout)
        .map(Some)
        .map_err(|e| NetError::Nft(format!("nft -j {}: {e}", args.join(" "))))
}

/// The objects of `kind` (`chain`, `set`, `counter`) in table `inet <table>`, by name.
pub fn names(table: &str, kind: &str) -> Result<Vec<String>, NetError> {
    let Some(v) = json(&["list", "table", "inet", table])? else {
        return Ok(vec![]);
    };
    Ok(v["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|o| o[kind]["name"].as_str().map(str::to_string))
        .collect())
}

/// The packets each named counter of table `inet <table>` counted, by name.
pub fn counters(table: &str) -> Result<Vec<(String, u64)>, NetError> {
    let Some(v) = json(&["list", "counters", "table", "inet", table])? else {
        return Ok(vec![]);
    };
    Ok(v["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|o| {
            let c = &o["counter"];
            Some((c["name"].as_str()?.to_string(), c["packets"].as_u64()?))
        })
        .collect())
}

/// Deletes table `inet <table>` (absent is fine).
pub fn delete_table(table: &str) -> Result<(), NetError> {
    match apply(&format!("delete table inet {table}\n")) {
        Err(NetError::Nft(e)) if e.contains("No such file or directory") => Ok(()),
        other => other,
    }
}
