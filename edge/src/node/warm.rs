//! Warm containers (`opendsec edge|up --warm-sandboxes N`, kept for the images created
//! from most recently; the pool itself is `container::warm`). The runtime has `create`d
//! them (the shim with `--create-only`) in `<sandboxes>/.warmc-<pid>-<n>/`, with their
//! agent's socket `agents/warmc-*.sock` and an empty `config/warmc-*/`; PID 1 waits for
//! `<runtime> start`. A plain create (no fork, snapshot or transfer) of that image claims
//! one: the config directory and socket are renamed to the sandbox's and the agent's files
//! written, then the backend renames, limits and starts the container. That takes the
//! runtime's `create` (20-30 ms here, mostly a kernel RCU grace period in the first
//! cgroup v1 attach) off a create's path. The one filler thread (nice 19, idle I/O) makes
//! them only after no create has been under way for [`WARM_QUIET`], so bursts have the
//! machine to themselves. One started ahead (the code interpreter's) also runs at the
//! least CPU weight until claimed, so its start command's seconds of CPU never compete
//! with sandboxes.
//!
//! **Architecture Invariant:** a warm container is in the pool, or being made or claimed
//! by one thread; an edge that stops discards its warm containers, and one that starts
//! discards those a killed edge left (`adoption.rs`).

use super::{Edge, EdgeError};
use crate::container::Limits;
use crate::container::warm::{Claim, WARM_ID_PREFIX};
use crate::desired::DesiredSandbox;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long no create must have been under way before a warm container is made.
const WARM_QUIET: Duration = Duration::from_millis(20);

/// What the edge holds of a warm container's agent until a sandbox claims it.
pub(super) enum WarmAgent {
    /// Not started: the write end of its configuration pipe (written at claim).
    Unstarted(OwnedFd),
    /// Started ahead of its sandbox, its start command ready: the sandbox's token and
    /// variables go to its agent as a claim request.
    Started,
}

/// Memory a started warm container must leave free under a claim's limit (what its
/// processes use grows with the sandbox's first work).
const CLAIM_HEADROOM: u64 = 64 << 20;
/// How long a started warm container may stay busy after it is ready before it is
/// offered anyway, and the window its CPU use is judged over.
const QUIET_WAIT: Duration = Duration::from_secs(15);
const QUIET_SAMPLE: Duration = Duration::from_millis(200);
/// How long a claim request to a warm container's agent may take.
const CLAIM_TIMEOUT: Duration = Duration::from_secs(5);

impl Edge {
    /// Makes warm container `<prefix><pid>-<n>` of `image` (see `container::warm`): its
    /// agent's socket and an empty config directory under the warm id, the agent's
    /// files come at claim. An image whose start command reads the sandbox's variables
    /// at claim (`StartSpec::claim_stdin`: the code interpreter) is started too, under
    /// a configuration of its own, and kept once its start command is ready.
    pub(super) fn make_warm(&self, image_name: &str) -> Result<String, EdgeError> {
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let wid = format!("{WARM_ID_PREFIX}{}-{n}", std::process::id());
        let image = self.images.ensure(
            image_name,
            &|p| tracing::info!(image = %image_name, progress = ?p, "building image"),
        )?;
        let start_ahead = image.config.start.as_ref().is_some_and(|s| s.claim_stdin);
        let made = (|| {
            // Memory and CPU are the default's until a sandbox claims it and sets its own.
            // One started ahead has the least CPU weight meanwhile (its agent keeps the
            // default class): its start command (a Jupyter server and kernels, seconds
            // of CPU) runs on what sandboxes leave, not beside the one that just claimed
            // its predecessor.
            let limits = Limits {
                pids: self.cfg.pids,
                io_weight: Some(100),
                disk_bytes: self.cfg.disk_bytes,
                best_effort: start_ahead,
                ..Limits::default()
            };
            let mut launch = self.agent_spec(&wid, &image, limits)?;
            // A network whose chain drops everything until a sandbox claims it.
            self.attach_network(&wid, &mut launch.spec, None)?;
            {
                let _one_at_a_time = self.create_lock.lock().expect("create lock");
                self.containers.create_unstarted(&launch.spec)?;
            }
            let agent = if start_ahead {
                super::agent::send_config(launch.config.write, &self.warm_boot_config(&wid, &image))?;
                self.containers.start_unstarted(&wid)?;
                let t = Instant::now();
                wait_healthy(&self.socket_path(&wid), super::agent::START_TIMEOUT)
                    .map_err(|e| EdgeError::Store(format!("warm container {wid} did not get ready: {e}")))?;
                // What its start command does after it is ready (kernels started ahead of
                // use) is done before a sandbox claims it, not on the sandbox's time.
                self.wait_cpu_quiet(&wid);
                tracing::debug!(%wid, image = %image_name, took = ?t.elapsed(), "warm container started ahead");
                WarmAgent::Started
            } else {
                // The configuration is written at claim, when the sandbox is known.
                WarmAgent::Unstarted(launch.config.write)
            };
            self.warm_config
                .lock()
                .expect("warm config lock")
                .insert(wid.clone(), agent);
            Ok::<(), EdgeError>(())
        })();
        match made {
            Ok(()) => Ok(wid),
            Err(e) => {
                self.discard_warm(&wid);
                Err(e)
            }
        }
    }

    /// Deletes warm container `wid` with its agent's socket and configuration pipe.
    pub(super) fn discard_warm(&self, wid: &str) {
        self.containers.discard_unstarted(wid);
        self.detach_network(wid);
        let _ = std::fs::remove_file(self.socket_path(wid));
        self.warm_config.lock().expect("warm config lock").remove(wid);
    }

    /// Makes warm container `wid` sandbox `d`: its agent's files and socket take the
    /// sandbox's names (the container sees the same directory and socket), then the
    /// backend renames, limits and starts it. A container started ahead is claimed only
    /// when its start command is still healthy, the sandbox has the default CPU class and
    /// its memory limit leaves room over what the container uses; its agent then takes
    /// the sandbox's token and variables in one request. On error nothing of either is
    /// left.
    pub(super) fn claim_warm(
        &self,
        d: &DesiredSandbox,
        image: &crate::images::Image,
        wid: &str,
    ) -> Result<(), EdgeError> {
        let same_image = match self.containers.unstarted_record(wid) {
            Ok(r) => r.layers == self.images.layer_dirs(image)?,
            Err(_) => false,
        };
        if !same_image {
            self.discard_warm(wid);
            return Err(EdgeError::Store(format!(
                "warm container {wid} is not of image {}'s current layers",
                d.image
            )));
        }
        let sock = self.socket_path(&d.id);
        let limits = self.limits(d);
        let claimed = (|| {
            let agent = self
                .warm_config
                .lock()
                .expect("warm config lock")
                .remove(wid)
                .ok_or_else(|| EdgeError::Store(format!("warm container {wid} has no agent configuration")))?;
            let started = match agent {
                WarmAgent::Unstarted(pipe) => {
                    self.send_agent_config(d, image, pipe)?;
                    false
                }
                WarmAgent::Started => {
                    self.fits_started(d, wid, &limits)?;
                    true
                }
            };
            let _ = std::fs::remove_file(&sock);
            std::fs::rename(self.socket_path(wid), &sock)?;
            if started {
                let body = serde_json::json!({
                    "access_token": self.agent_token(&d.id),
                    "env": image.env_with(&d.env),
                });
                let claim = crate::agent_http::post_json(CLAIM_PATH, &self.agent_token(wid), &body);
                match agent_exchange(&sock, claim.as_bytes(), CLAIM_TIMEOUT) {
                    Ok(204) => {}
                    Ok(code) => {
                        return Err(EdgeError::Store(format!(
                            "the agent of warm container {wid} answered the claim with {code}"
                        )));
                    }
                    Err(e) => return Err(EdgeError::Store(format!("claiming warm container {wid}: {e}"))),
                }
            }
            // Its policy is in force before its PID 1 runs (or, started ahead, before it
            // runs anything of the sandbox's).
            self.hand_over_network(wid, &d.id, d.network.as_deref())?;
            self.containers.claim(
                wid,
                &Claim {
                    id: &d.id,
                    limits: &limits,
                    labels: &d.labels,
                    started,
                },
            )?;
            Ok::<(), EdgeError>(())
        })();
        if claimed.is_err() {
            // `claim` removed the container on its own error; before it, it is still warm.
            self.discard_warm(wid);
            self.detach_network(&d.id);
            let _ = std::fs::remove_file(&sock);
        }
        claimed
    }

    /// Waits (at most [`QUIET_WAIT`]) until warm container `wid` has used under 5% of a
    /// CPU over [`QUIET_SAMPLE`].
    fn wait_cpu_quiet(&self, wid: &str) {
        let deadline = Instant::now() + QUIET_WAIT;
        let Some(mut before) = self.containers.unstarted_cpu_usec(wid) else {
            return;
        };
        while Instant::now() < deadline {
            std::thread::sleep(QUIET_SAMPLE);
            let Some(now) = self.containers.unstarted_cpu_usec(wid) else {
                return;
            };
            if now.saturating_sub(before) < QUIET_SAMPLE.as_micros() as u64 / 20 {
                return;
            }
            before = now;
        }
    }

    /// Whether warm container `wid`, started ahead, can become sandbox `d` with `limits`.
    fn fits_started(&self, d: &DesiredSandbox, wid: &str, limits: &Limits) -> Result<(), EdgeError> {
        if d.cpu_class != opendsec_projections::CpuClass::default() {
            return Err(EdgeError::Store(format!(
                "warm container {wid} runs in the default CPU class, not {}",
                d.cpu_class.as_str()
            )));
        }
        let used = self.containers.unstarted_memory(wid).unwrap_or(0);
        if used + CLAIM_HEADROOM > limits.memory_bytes {
            return Err(EdgeError::Store(format!(
                "warm container {wid} uses {} MiB, too close to the sandbox's {} MiB",
                used >> 20,
                limits.memory_bytes >> 20
            )));
        }
        match wait_healthy(&self.socket_path(wid), Duration::ZERO) {
            Ok(()) => Ok(()),
            Err(e) => Err(EdgeError::Store(format!(
                "warm container {wid}'s start command is not healthy: {e}"
            ))),
        }
    }

    /// Starts the filler thread unless one runs: it makes warm containers for the wanted
    /// images, one at a time, at the lowest priority, and only while no create is under
    /// way (warm containers are made in idle time, never at a create's expense).
    pub(super) fn refill_warm(self: &Arc<Self>) {
        if !self.warm.enabled() || self.warm.next_job().is_none() || !self.warm.start_filling() {
            return;
        }
        let edge = self.clone();
        let spawned = std::thread::Builder::new()
            .name("warm-containers".into())
            .spawn(move || {
                crate::container::lower_priority();
                loop {
                    // Quiet first: creates in flight (a burst) have the machine to themselves.
                    edge.wait_quiet();
                    let Some(image) = edge.warm.next_job() else {
                        edge.warm.filler_done();
                        // A take between `next_job` and `filler_done` would find no filler.
                        if edge.warm.next_job().is_some() && edge.warm.start_filling() {
                            continue;
                        }
                        return;
                    };
                    match edge.make_warm(&image) {
                        Ok(wid) => {
                            if !edge.warm.add(&image, wid.clone()) {
                                edge.discard_warm(&wid);
                            }
                        }
                        Err(e) => {
                            // Creates make their own containers meanwhile; the next one retries.
                            tracing::warn!(%image, error = %e, "cannot make a warm container");
                            edge.warm.filler_done();
                            return;
                        }
                    }
                }
            });
        if spawned.is_err() {
            self.warm.filler_done();
        }
    }

    /// Returns once no create has been under way for [`WARM_QUIET`].
    pub(super) fn wait_quiet(&self) {
        let mut idle_since = Instant::now();
        loop {
            if !self.creating.lock().expect("creating lock").is_empty() {
                idle_since = Instant::now();
            } else if idle_since.elapsed() >= WARM_QUIET {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Discards every warm container (the edge stops: none outlives it), waiting for the
    /// filler to finish the one it is making.
    pub(super) fn drain_warm(&self) {
        let ready = self.warm.close();
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.warm.filling() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        for wid in ready {
            self.discard_warm(&wid);
        }
    }
}

/// The agent's claim request (see the agent's `claim.rs`).
const CLAIM_PATH: &str = "/.opendsec/claim";

/// One blocking exchange with the agent listening at `sock` (`crate::agent_http`): the
/// filler thread and the claim run where no async runtime is at hand.
fn agent_exchange(sock: &Path, request: &[u8], timeout: Duration) -> std::io::Result<u16> {
    let stream = UnixStream::connect(sock)?;
    stream.set_read_timeout(Some(timeout.max(Duration::from_millis(500))))?;
    stream.set_write_timeout(Some(timeout.max(Duration::from_millis(500))))?;
    crate::agent_http::status(stream, request)
}

/// Waits up to `timeout` (at least one try) for the agent at `sock` to say its start
/// command is ready (`/health` 204); the last answer otherwise.
fn wait_healthy(sock: &Path, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    loop {
        let last = match agent_exchange(sock, crate::agent_http::HEALTH, Duration::from_secs(2)) {
            Ok(204) | Ok(200) => return Ok(()),
            Ok(code) => format!("/health answers {code}"),
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            return Err(last);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
