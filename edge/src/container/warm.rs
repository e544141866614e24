//! Warm containers: a sandbox's container made ahead of need, up to the point where
//! only its identity is missing. The runtime has created it (namespaces, cgroups,
//! mounts, its overlay on a size-limited disk) and its PID 1 waits for `<runtime>
//! start`. A create that finds one *claims* it: the directory is renamed to the
//! sandbox's, its record rewritten, its memory and CPU limits set, its hostname set to
//! the sandbox's id, and the runtime starts it. That takes the runtime's `create` (and
//! the kernel's cgroup and mount work in it) off the path of a create.
//!
//! A warm container lives in `<sandboxes root>/.warmc-<pid>-<n>/` (hidden from
//! [`ContainerBackend::list`]) under the runtime id `warmc-<pid>-<n>`, which it keeps
//! when claimed (`SandboxRecord::runtime_id`), as it keeps its cgroup path.
//!
//! **Invariant**: a warm container is either listed in a [`WarmPool`] or being made or
//! claimed by exactly one thread; one that is neither (left by an edge that was killed)
//! is discarded when the next edge starts ([`ContainerBackend::unstarted`]).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

use super::{
    ContainerBackend, ContainerError, Handle, Limits, SandboxSpec, cgroup, disk, read_pid, validate, validate_id,
    write_json_atomic,
};

/// Runtime ids of warm containers start with this (their directories with a dot before it).
pub const WARM_ID_PREFIX: &str = "warmc-";

/// What a warm container becomes when a sandbox claims it.
pub struct Claim<'a> {
    pub id: &'a str,
    /// Memory, CPU and CPU class are set at claim; pids and disk must equal the warm
    /// container's.
    pub limits: &'a Limits,
    pub labels: &'a BTreeMap<String, String>,
    /// Its PID 1 was started ahead of the claim ([`ContainerBackend::start_unstarted`]).
    pub started: bool,
}

impl ContainerBackend {
    fn warm_dir(&self, warm_id: &str) -> PathBuf {
        self.config.sandboxes_root.join(format!(".{warm_id}"))
    }

    /// Creates a warm container from `spec` (whose id must start with [`WARM_ID_PREFIX`]):
    /// everything a create does but starting PID 1.
    pub fn create_unstarted(&self, spec: &SandboxSpec) -> Result<(), ContainerError> {
        validate(spec)?;
        if !spec.id.starts_with(WARM_ID_PREFIX) {
            return Err(ContainerError::Invalid(format!(
                "a warm container's id starts with {WARM_ID_PREFIX:?}, not {:?}",
                spec.id
            )));
        }
        self.create_at(spec, &self.warm_dir(&spec.id), false).map(drop)
    }

    /// Starts warm container `warm_id`'s PID 1 ahead of its claim (an image whose start
    /// command can wait for its sandbox: see `node/warm.rs`).
    pub fn start_unstarted(&self, warm_id: &str) -> Result<(), ContainerError> {
        let record = self.unstarted_record(warm_id)?;
        record.runtime.run(&["start", warm_id]).map(drop)
    }

    /// Memory in use by warm container `warm_id`'s processes (its page cache left out),
    /// if its cgroup can be read.
    pub fn unstarted_memory(&self, warm_id: &str) -> Option<u64> {
        let usage = self.unstarted_usage(warm_id)?;
        Some(usage.memory_bytes.saturating_sub(usage.cache_bytes))
    }

    /// CPU time used by warm container `warm_id`'s processes so far, in microseconds.
    pub fn unstarted_cpu_usec(&self, warm_id: &str) -> Option<u64> {
        Some(self.unstarted_usage(warm_id)?.cpu_usec)
    }

    fn unstarted_usage(&self, warm_id: &str) -> Option<cgroup::Usage> {
        let record = self.unstarted_record(warm_id).ok()?;
        cgroup::usage(&record.cgroups_path)
    }

    /// The record of warm container `warm_id` (its layers, limits and runtime).
    pub fn unstarted_record(&self, warm_id: &str) -> Result<super::SandboxRecord, ContainerError> {
        Ok(Self::handle_at(warm_id, self.warm_dir(warm_id))?.record)
    }

    /// Makes warm container `warm_id` sandbox `claim.id` and starts its PID 1. On error
    /// the warm container is gone (whatever of it was renamed is deleted too).
    pub fn claim(&self, warm_id: &str, claim: &Claim) -> Result<Handle, ContainerError> {
        validate_id(claim.id)?;
        let from = self.warm_dir(warm_id);
        let dir = self.dir(claim.id);
        let mut record = match Self::handle_at(warm_id, from.clone()) {
            Ok(h) => h.record,
            Err(e) => {
                self.discard_unstarted(warm_id);
                return Err(e);
            }
        };
        if record.limits.pids != claim.limits.pids || record.limits.disk_bytes != claim.limits.disk_bytes {
            self.discard_unstarted(warm_id);
            return Err(ContainerError::Invalid(format!(
                "warm container {warm_id} has other pids or disk limits than sandbox {}",
                claim.id
            )));
        }
        if let Err(e) = disk::rename_noreplace(&from, &dir) {
            self.discard_unstarted(warm_id);
            return Err(if e.kind() == std::io::ErrorKind::AlreadyExists {
                ContainerError::AlreadyExists(claim.id.into())
            } else {
                ContainerError::io(format!("renaming {} to {}", from.display(), dir.display()), e)
            });
        }
        let made_with = record.limits.clone();
        record.id = claim.id.to_string();
        record.runtime_id = Some(warm_id.to_string());
        record.labels = claim.labels.clone();
        record.limits.memory_bytes = claim.limits.memory_bytes;
        record.limits.cpu_millis = claim.limits.cpu_millis;
        record.limits.best_effort = claim.limits.best_effort;
        record.created_unix_ms = super::now_unix_ms();
        // As many CPUs as the claim's quota: a new cpuset when that is another number.
        // (None where the host has no cpusets: an empty host list.)
        let new_cpus = (!self.cpus.host().is_empty()
            && super::cpus::count(made_with.cpu_millis) != super::cpus::count(claim.limits.cpu_millis))
        .then(|| (record.cpus.take(), self.cpus.allocate(claim.limits.cpu_millis)));
        if let Some((_, cpus)) = &new_cpus {
            record.cpus = cpus.clone();
        }
        let started = (|| {
            if let Err(e) = write_json_atomic(&dir.join("sandbox.json"), &record) {
                // The delete below releases what the old record holds, not the new set.
                if let Some((_, Some(set))) = &new_cpus {
                    self.cpus.release(set);
                }
                return Err(e);
            }
            // From here on the record holds the new set (the delete below releases it).
            if let Some((old, cpus)) = &new_cpus {
                if let Some(set) = old {
                    self.cpus.release(set);
                }
                let list = cpus.clone().unwrap_or_else(|| super::cpus::format(self.cpus.host()));
                cgroup::set_cpus(&record.cgroups_path, &list)
                    .map_err(|e| ContainerError::io(format!("setting the cpuset of {}", record.cgroups_path), e))?;
            }
            if made_with.memory_bytes != record.limits.memory_bytes
                || made_with.cpu_millis != record.limits.cpu_millis
                || made_with.best_effort != record.limits.best_effort
            {
                let period = super::oci::CPU_PERIOD_US;
                cgroup::set_memory_cpu(
                    &record.cgroups_path,
                    record.limits.memory_bytes,
                    record.limits.cpu_millis as u64 * period / 1000,
                    period,
                    super::oci::cpu_shares(&record.limits),
                    self.host.swap_limit,
                )
                .map_err(|e| ContainerError::io(format!("setting the limits of {}", record.cgroups_path), e))?;
            }
            let pid = read_pid(&dir.join("init.pid"))
                .ok_or_else(|| ContainerError::Storage(format!("{} has no init.pid", dir.display())))?;
            set_hostname(pid, claim.id)?;
            if !claim.started {
                record.runtime.run(&["start", warm_id])?;
            }
            Ok(Handle {
                id: claim.id.to_string(),
                dir: dir.clone(),
                record: record.clone(),
            })
        })();
        if started.is_err() {
            let _ = self.delete(claim.id);
        }
        started
    }

    /// Deletes warm container `warm_id` (its container, mounts, cgroup and directory).
    pub fn discard_unstarted(&self, warm_id: &str) {
        let dir = self.warm_dir(warm_id);
        match Self::handle_at(warm_id, dir.clone()) {
            Ok(h) => {
                if let Err(e) = self.delete_handle(&h) {
                    tracing::warn!(warm = %warm_id, error = %e, "cannot discard a warm container");
                }
            }
            Err(_) => {
                // Half made (no record): the runtime may still know it.
                let _ = self.runtime.run(&["delete", "--force", warm_id]);
                let _ = disk::Storage::in_dir(&dir).teardown();
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }

    /// The warm containers found on disk (all of them left by an edge that did not stop,
    /// when called before this edge makes its own).
    pub fn unstarted(&self) -> Vec<String> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&self.config.sandboxes_root)
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(id) = name.strip_prefix('.')
                && id.starts_with(WARM_ID_PREFIX)
            {
                out.push(id.to_string());
            }
        }
        out.sort();
        out
    }
}

/// Sets the hostname in the UTS namespace of process `pid` (a container's PID 1).
fn set_hostname(pid: i32, name: &str) -> Result<(), ContainerError> {
    let name = name.to_string();
    let ns = PathBuf::from(format!("/proc/{pid}/ns/uts"));
    crate::ns::in_namespace(&ns, libc::CLONE_NEWUTS, "set-hostname", move || {
        // SAFETY: sethostname copies the name.
        if unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    })
    .map_err(|e| ContainerError::io(format!("setting the hostname of {pid}'s UTS namespace"), e))
}

/// The bookkeeping of warm containers: which are ready for which key (an image), which
/// keys are wanted, and whether a filler is at work. Holds no container itself: the
/// edge makes, claims and discards them.
pub struct WarmPool {
    /// Warm containers kept per wanted key.
    per_key: usize,
    /// Keys kept warm at most (the most recently used).
    max_keys: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    ready: BTreeMap<String, Vec<String>>,
    /// Wanted keys with when they were last used.
    wanted: BTreeMap<String, Instant>,
    /// Ready containers of keys no longer wanted, until [`WarmPool::want`] or
    /// [`WarmPool::close`] hands them out for discarding.
    evicted: Vec<String>,
    filling: bool,
    closed: bool,
}

impl WarmPool {
    pub fn new(per_key: usize, max_keys: usize) -> Self {
        Self {
            per_key,
            max_keys,
            inner: Mutex::new(Inner::default()),
        }
    }

    pub fn enabled(&self) -> bool {
        self.per_key > 0 && self.max_keys > 0
    }

    /// A ready warm container for `key`, if any; `key` is marked used either way.
    pub fn take(&self, key: &str) -> Option<String> {
        let mut g = self.inner.lock().expect("warm pool lock");
        if g.closed || !self.enabled() {
            return None;
        }
        self.touch(&mut g, key);
        g.ready.get_mut(key).and_then(Vec::pop)
    }

    /// Marks `key` used now: it is kept warm. The least recently used keys beyond
    /// `max_keys` are dropped; their ready containers (also those a [`WarmPool::take`]
    /// dropped) are returned for discarding.
    pub fn want(&self, key: &str) -> Vec<String> {
        let mut g = self.inner.lock().expect("warm pool lock");
        if g.closed || !self.enabled() {
            return Vec::new();
        }
        self.touch(&mut g, key);
        std::mem::take(&mut g.evicted)
    }

    fn touch(&self, g: &mut Inner, key: &str) {
        g.wanted.insert(key.to_string(), Instant::now());
        while g.wanted.len() > self.max_keys {
            let oldest = g
                .wanted
                .iter()
                .min_by_key(|(_, t)| **t)
                .map(|(k, _)| k.clone())
                .expect("not empty");
            g.wanted.remove(&oldest);
            let dropped = g.ready.remove(&oldest).unwrap_or_default();
            g.evicted.extend(dropped);
        }
    }

    /// The key the filler should make a warm container for next (the most recently used
    /// one below its target), or None when every wanted key is full.
    pub fn next_job(&self) -> Option<String> {
        let g = self.inner.lock().expect("warm pool lock");
        if g.closed {
            return None;
        }
        let mut keys: Vec<(&String, &Instant)> = g.wanted.iter().collect();
        keys.sort_by_key(|(_, t)| std::cmp::Reverse(**t));
        keys.into_iter()
            .find(|(k, _)| g.ready.get(*k).map_or(0, Vec::len) < self.per_key)
            .map(|(k, _)| k.clone())
    }

    /// Stops keeping `key` warm (its image is gone): its ready containers are returned
    /// for discarding.
    pub fn forget(&self, key: &str) -> Vec<String> {
        let mut g = self.inner.lock().expect("warm pool lock");
        g.wanted.remove(key);
        g.ready.remove(key).unwrap_or_default()
    }

    /// Adds a made warm container; false (the caller discards it) when the pool is
    /// closed or `key` is no longer wanted.
    pub fn add(&self, key: &str, warm_id: String) -> bool {
        let mut g = self.inner.lock().expect("warm pool lock");
        if g.closed || !g.wanted.contains_key(key) {
            return false;
        }
        g.ready.entry(key.to_string()).or_default().push(warm_id);
        true
    }

    /// Claims the filler role: true if no filler runs (the caller must then run one and
    /// call [`WarmPool::filler_done`] when it stops).
    pub fn start_filling(&self) -> bool {
        let mut g = self.inner.lock().expect("warm pool lock");
        if g.closed || g.filling {
            return false;
        }
        g.filling = true;
        true
    }

    pub fn filler_done(&self) {
        self.inner.lock().expect("warm pool lock").filling = false;
    }

    pub fn filling(&self) -> bool {
        self.inner.lock().expect("warm pool lock").filling
    }

    /// How many warm containers are ready for `key`.
    pub fn ready(&self, key: &str) -> usize {
        self.inner
            .lock()
            .expect("warm pool lock")
            .ready
            .get(key)
            .map_or(0, Vec::len)
    }

    /// Closes the pool and returns every ready warm container, for discarding.
    pub fn close(&self) -> Vec<String> {
        let mut g = self.inner.lock().expect("warm pool lock");
        g.closed = true;
        let mut all: Vec<String> = std::mem::take(&mut g.ready).into_values().flatten().collect();
        all.append(&mut g.evicted);
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_hands_out_what_was_added_for_a_key_and_asks_for_the_most_recent_key_first() {
        let pool = WarmPool::new(2, 2);
        assert_eq!(pool.take("base"), None, "nothing is ready at first");
        assert_eq!(
            pool.next_job().as_deref(),
            Some("base"),
            "a key that was asked for is wanted"
        );
        assert!(pool.add("base", "warmc-1".into()));
        assert!(pool.add("base", "warmc-2".into()));
        assert_eq!(pool.next_job(), None, "full at two per key");
        std::thread::sleep(std::time::Duration::from_millis(2));
        pool.want("busybox");
        assert_eq!(pool.next_job().as_deref(), Some("busybox"));
        assert_eq!(pool.take("base").as_deref(), Some("warmc-2"));
        assert_eq!(pool.ready("base"), 1);
        assert!(!pool.add("python", "warmc-3".into()), "a key nobody wants is not kept");
    }

    #[test]
    fn the_least_recently_used_key_is_dropped_with_its_containers_and_close_returns_the_rest() {
        let pool = WarmPool::new(1, 2);
        pool.want("a");
        assert!(pool.add("a", "warmc-a".into()));
        std::thread::sleep(std::time::Duration::from_millis(2));
        pool.want("b");
        assert!(pool.add("b", "warmc-b".into()));
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert_eq!(pool.want("c"), vec!["warmc-a".to_string()], "a was used least recently");
        assert!(pool.start_filling());
        assert!(!pool.start_filling(), "one filler at a time");
        pool.filler_done();
        assert_eq!(pool.close(), vec!["warmc-b".to_string()]);
        assert_eq!(pool.take("b"), None, "a closed pool hands out nothing");
        assert!(!pool.add("c", "warmc-c".into()));
        assert!(!pool.start_filling());
    }

    #[test]
    fn containers_a_take_drops_are_handed_out_by_the_next_want() {
        let pool = WarmPool::new(1, 1);
        pool.want("a");
        assert!(pool.add("a", "warmc-a".into()));
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert_eq!(pool.take("b"), None, "b has none ready; a is dropped for it");
        assert_eq!(
            pool.want("b"),
            vec!["warmc-a".to_string()],
            "so that it is discarded, not lost"
        );
        assert!(pool.close().is_empty());
    }

    #[test]
    fn a_pool_of_size_zero_keeps_nothing() {
        let pool = WarmPool::new(0, 2);
        assert!(!pool.enabled());
        pool.want("a");
        assert_eq!(pool.next_job(), None);
    }
}
