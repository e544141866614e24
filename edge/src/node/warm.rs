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
//! machine to themselves.
//!
//! **Architecture Invariant:** a warm container is in the pool, or being made or claimed
//! by one thread; an edge that stops discards its warm containers, and one that starts
//! discards those a killed edge left (`adoption.rs`).

use super::{Edge, EdgeError};
use crate::container::Limits;
use crate::container::warm::{Claim, WARM_ID_PREFIX};
use crate::desired::DesiredSandbox;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long no create must have been under way before a warm container is made.
const WARM_QUIET: Duration = Duration::from_millis(20);

impl Edge {
    /// Makes warm container `<prefix><pid>-<n>` of `image` (see `container::warm`): its
    /// agent's socket and an empty config directory under the warm id, the agent's
    /// files come at claim.
    pub(super) fn make_warm(&self, image_name: &str) -> Result<String, EdgeError> {
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let wid = format!("{WARM_ID_PREFIX}{}-{n}", std::process::id());
        let image = self.images.ensure(
            image_name,
            &|p| tracing::info!(image = %image_name, progress = ?p, "building image"),
        )?;
        let made = (|| {
            // Memory and CPU are the default's until a sandbox claims it and sets its own.
            let limits = Limits {
                pids: self.cfg.pids,
                io_weight: Some(100),
                disk_bytes: self.cfg.disk_bytes,
                ..Limits::default()
            };
            let mut launch = self.agent_spec(&wid, &image, limits)?;
            // A network whose chain drops everything until a sandbox claims it.
            self.attach_network(&wid, &mut launch.spec, None)?;
            {
                let _one_at_a_time = self.create_lock.lock().expect("create lock");
                self.containers.create_unstarted(&launch.spec)?;
            }
            // The configuration is written at claim, when the sandbox is known.
            self.warm_config
                .lock()
                .expect("warm config lock")
                .insert(wid.clone(), launch.config.write);
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
    /// backend renames, limits and starts it. On error nothing of either is left.
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
        let claimed = (|| {
            let pipe = self
                .warm_config
                .lock()
                .expect("warm config lock")
                .remove(wid)
                .ok_or_else(|| EdgeError::Store(format!("warm container {wid} has no configuration pipe")))?;
            self.send_agent_config(d, image, pipe)?;
            let _ = std::fs::remove_file(&sock);
            std::fs::rename(self.socket_path(wid), &sock)?;
            // Its policy is in force before its PID 1 runs.
            self.hand_over_network(wid, &d.id, d.network.as_deref())?;
            let limits = self.limits(d);
            self.containers.claim(
                wid,
                &Claim {
                    id: &d.id,
                    limits: &limits,
                    labels: &d.labels,
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
