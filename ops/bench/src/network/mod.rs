//! `opendsec-bench network`: container sandboxes' network through a real `opendsec up`,
//! beside the raw path. Everything runs in an internet of the benchmark's own, in
//! network namespaces ([`internet`]): `opendsec up` (the release binary, `--microvm
//! off`, `--upstream-dns` the internet's DNS server) runs in the edge's namespace under
//! `nsenter --net`, listening on the management link, and is driven over REST with the
//! admin token. [`run`] does, in order:
//!
//! 1. [`create`]: create -> first output of `echo hi`, networking on (warm containers
//!    at their default).
//! 2. [`enforce`]: on one busybox sandbox ([`sandbox`]), policy update to enforcement,
//!    both ways, observed from inside its network namespace (goal: p50 under
//!    [`ENFORCE_GOAL`]).
//! 3. [`throughput`]: iperf3 from the sandbox's namespace through its policy, beside the
//!    same from a raw namespace masqueraded by the edge's namespace without OpenDsec's
//!    table (goal: within 10%, [`THROUGHPUT_GOAL`]).
//! 4. [`lookup`]: DNS answers through the edge's proxy ([`dns`] is the internet's
//!    authoritative server) beside a direct query.
//! 5. That `opendsec up` stops; one with `--no-sandbox-network` starts in the same
//!    namespace, and [`create`] runs again on it.
//!
//! [`report`] prints the table and the JSON. Everything made is removed at the end, also
//! on error or Ctrl-C: `opendsec up` and its containers and sandbox network by
//! `crate::sandboxes::UpGuard`, the namespaces and servers by [`internet::Internet`]
//! (and their `emergency_teardown`s from a signal handler, see [`emergency_teardown`]).

mod create;
mod dns;
mod enforce;
mod internet;
mod lookup;
mod netns;
mod report;
mod sandbox;
mod throughput;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;

pub use report::Report;

use crate::sandboxes::{UpConfig, UpGuard, UpNetns};
use internet::{IPERF, Internet, TARGET};

/// Goal: a policy update is enforced on the data path within this long (p50).
pub const ENFORCE_GOAL: Duration = Duration::from_millis(100);
/// Goal: throughput through the policy is at least this fraction of the raw path's.
pub const THROUGHPUT_GOAL: f64 = 0.9;
/// Sandboxes an edge here holds at once (the probe, a create's, the warm pool).
const CAPACITY: u64 = 16;

#[derive(Clone, Debug)]
pub struct Options {
    /// Policy updates each way, and DNS queries of each kind.
    pub runs: usize,
    /// Create -> first output runs per `opendsec up`.
    pub create_runs: usize,
    /// iperf3 rounds (each: four tests).
    pub iperf_rounds: usize,
    /// iperf3's `-t`.
    pub iperf_seconds: u32,
    pub data_dir: PathBuf,
    pub opendsec_bin: PathBuf,
    pub agent_bin: PathBuf,
    pub image_dir: PathBuf,
}

/// For a signal handler: stops `opendsec up` (its containers and sandbox network go),
/// then removes the namespaces.
pub fn emergency_teardown() {
    crate::sandboxes::emergency_teardown();
    internet::emergency_teardown();
}

/// The run's directory: removed on drop (also when the run is dropped on a signal),
/// unless `OPENDSEC_BENCH_KEEP` is set or mounts are left under it.
struct WorkDir(PathBuf);

impl Drop for WorkDir {
    fn drop(&mut self) {
        if std::env::var_os("OPENDSEC_BENCH_KEEP").is_some() {
            eprintln!("kept {} (OPENDSEC_BENCH_KEEP)", self.0.display());
        } else if crate::sandboxes::mounts_under(&self.0).is_empty() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

pub async fn run(o: Options) -> Report {
    let mut report = Report::default();
    let work = WorkDir(o.data_dir.join(format!("network-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&work.0);
    if let Err(e) = std::fs::create_dir_all(&work.0) {
        report.fail(format!("create {:?}: {e}", work.0));
        return report;
    }
    eprintln!("== the benchmark's internet: namespaces for the edge, the internet and the raw path");
    match tokio::task::spawn_blocking(Internet::start).await {
        Ok(Ok(inet)) => {
            if let Err(e) = with_internet(&o, &work.0, &inet, &mut report).await {
                report.fail(e);
            }
            drop(inet);
        }
        Ok(Err(e)) => report.fail(format!("the benchmark's internet: {e}")),
        Err(e) => report.fail(format!("the benchmark's internet: {e}")),
    }
    if !crate::sandboxes::mounts_under(&work.0).is_empty() {
        report.fail(format!("mounts left under {}; not removed", work.0.display()));
    }
    report
}

/// An `opendsec up` in the edge's namespace, with `extra` flags.
async fn start_up(o: &Options, dir: &Path, inet: &Internet, extra: &[&str]) -> Result<UpGuard, String> {
    let mut args: Vec<String> = vec!["--microvm".into(), "off".into()];
    args.extend(extra.iter().map(|s| s.to_string()));
    UpGuard::start(
        &UpConfig {
            dir: dir.to_path_buf(),
            opendsec_bin: o.opendsec_bin.clone(),
            agent_bin: o.agent_bin.clone(),
            image_dir: o.image_dir.clone(),
            extra_args: args,
            netns: Some(UpNetns {
                name: inet.edge_ns.clone(),
                addr: inet.mgmt,
            }),
        },
        CAPACITY,
    )
    .await
}

async fn with_internet(o: &Options, work: &Path, inet: &Internet, report: &mut Report) -> Result<(), String> {
    let dns = internet::DNS.to_string();
    eprintln!(
        "== opendsec up in {} (API on {}), sandbox networking on, upstream DNS {dns}",
        inet.edge_ns, inet.mgmt
    );
    let up = start_up(o, &work.join("networked"), inet, &["--upstream-dns", &dns]).await?;

    // 1. Create -> first output, networking on.
    eprintln!(
        "== create -> first output (networking on, --warm-sandboxes 2), {} runs (+1 warm-up)",
        o.create_runs
    );
    report.creates(true, create::measure(&up, o.create_runs).await);

    // 2-4 on one sandbox.
    let probe = sandbox::Probe::create(&up, enforce::allow_policy()).await?;
    report.note(format!(
        "the probe sandbox {} has {} in namespace {}; the edge's DNS proxy is {}",
        probe.id, probe.v4, probe.netns, probe.proxy
    ));
    eprintln!(
        "== policy update to enforcement, {} updates each way (+1 warm-up pair)",
        o.runs
    );
    report.enforcement(enforce::measure(&up, &probe, o.runs).await);

    eprintln!(
        "== iperf3 -t {} to {IPERF}: sandbox (policy allowing it) and raw path, {} round(s)",
        o.iperf_seconds, o.iperf_rounds
    );
    match allow_iperf(&up, &probe).await {
        Ok(()) => {
            report.throughput(throughput::measure(&probe.netns, &inet.raw_ns, o.iperf_rounds, o.iperf_seconds).await)
        }
        Err(e) => report.fail(format!("iperf3: {e}")),
    }

    eprintln!(
        "== DNS A queries: through the proxy from the sandbox, directly from the edge's namespace, {} rounds (+1 warm-up)",
        o.runs
    );
    report.lookups(lookup::measure(&up, &probe, &inet.edge_ns, o.runs).await);

    let _ = up.remove(&probe.id).await;
    drop(up);

    // 5. The same create path without sandbox networking.
    eprintln!("== opendsec up --no-sandbox-network in {}", inet.edge_ns);
    let up = start_up(o, &work.join("plain"), inet, &["--no-sandbox-network"]).await?;
    eprintln!(
        "== create -> first output (--no-sandbox-network, --warm-sandboxes 2), {} runs (+1 warm-up)",
        o.create_runs
    );
    report.creates(false, create::measure(&up, o.create_runs).await);
    drop(up);
    Ok(())
}

/// Sets the probe's policy to allow the iperf3 server only, and waits until it is in
/// force: the target, which the policy before allowed, no longer answers (the chain is
/// replaced whole, in one transaction). Probing iperf3's own port would start a test.
async fn allow_iperf(up: &UpGuard, probe: &sandbox::Probe) -> Result<(), String> {
    probe.set_policy(up, &json!({"allow_out": [IPERF.to_string()]})).await?;
    let ns = probe.netns.clone();
    netns::run_in_async(&ns, || {
        let target = std::net::SocketAddrV4::new(TARGET, internet::CONNECT_PORT);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while internet::connect(target, Duration::from_millis(100)).is_ok() {
            if std::time::Instant::now() > deadline {
                return Err("the policy allowing only the iperf3 server was not in force after 10 s".to_string());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    })
    .await?
}
