//! How an OCI image's layers get into the store, whatever their source (`registry.rs`,
//! `import.rs`): the source plans the image (`ImagePlan`: verified config, each layer's
//! blob digest and diff_id) and fetches blobs on demand; [`ImageStore::install`] does the
//! rest, the same way for both.
//!
//! Several edges on several machines may share one store directory (a network file
//! system), so an install:
//! 1. locks every layer it lacks (`locks/sha256-<hex>.lock`, flock, in sorted order so
//!    that two installs never wait on each other in a cycle); a second puller of the
//!    same layer waits here and then finds it published;
//! 2. fetches each missing blob (its digest and size checked) into a private staging
//!    directory `tmp/pull.<pid>.<random>.<host>/` and unpacks it there (`unpack.rs`),
//!    checking the unpacked stream against the config's diff_id;
//! 3. only when every layer is verified, syncs the file system and renames each layer
//!    into `layers/sha256-<hex>` (a layer that appeared meanwhile, published by an edge
//!    whose locks we do not see, wins: ours is discarded), then writes the record.
//!
//! A failure at any step removes the staging directory: nothing new under `layers/` or
//! `images/`, nothing left in `tmp/`. Staging left by a process that died (same host,
//! pid gone) is removed by the next install. Within one process, concurrent pulls of
//! one reference through one store (or its clones) share one pull ([`Flights`]).

use std::cell::Cell;
use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

use super::{Image, ImageConfig, ImageError, ImageStore, io_err, unpack};

/// Where an OCI pull or import is: layers and compressed bytes, done out of total (the
/// totals count only what must be fetched: a layer already stored costs no bytes), and
/// what it does now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PullProgress {
    pub layers_total: usize,
    pub layers_done: usize,
    pub bytes_total: u64,
    pub bytes_done: u64,
    /// The current step, for people (`fetching layer sha256:… (N bytes)`).
    pub current: String,
}

/// One layer as the manifest and config describe it.
#[derive(Clone, Debug)]
pub(super) struct LayerPlan {
    /// Digest of the blob as stored (compressed or not): `sha256:<hex>`.
    pub(super) blob: String,
    /// The blob's size in bytes.
    pub(super) size: u64,
    /// Digest of the uncompressed tar (the config's `rootfs.diff_ids`): names the layer.
    pub(super) diff_id: String,
}

/// An image ready to install: its config and blobs verified, its layers' blobs not yet.
pub(super) struct ImagePlan {
    /// The store name or canonical reference to record it under.
    pub(super) name: String,
    pub(super) reference: Option<String>,
    pub(super) digest: Option<String>,
    pub(super) config: ImageConfig,
    /// Bottom first.
    pub(super) layers: Vec<LayerPlan>,
}

/// Writes a layer's blob into the (empty) file, failing unless it has the plan's size
/// and digest; reports the bytes received since its last report.
pub(super) type FetchBlob<'a> = dyn FnMut(&LayerPlan, &mut File, &dyn Fn(u64)) -> Result<(), ImageError> + 'a;

/// Fetched bytes between two progress reports.
const PROGRESS_BYTES: u64 = 1 << 20;

/// The store's id of an OCI layer: `sha256-<hex>` of its diff_id.
pub(super) fn layer_id(diff_id: &str) -> String {
    diff_id.replacen(':', "-", 1)
}

impl ImageStore {
    /// Installs a planned image: see the module doc.
    pub(super) fn install(
        &self,
        plan: ImagePlan,
        fetch: &mut FetchBlob<'_>,
        progress: &dyn Fn(&PullProgress),
    ) -> Result<Image, ImageError> {
        let ids: Vec<String> = plan.layers.iter().map(|l| layer_id(&l.diff_id)).collect();
        let mut state = PullProgress {
            layers_total: ids.len(),
            ..PullProgress::default()
        };
        remove_stale_tmp(self);

        // What is missing, each layer once, bottom first.
        let mut todo: Vec<(&str, &LayerPlan)> = Vec::new();
        for (id, layer) in ids.iter().zip(&plan.layers) {
            if !self.layer_path(id).is_dir() && !todo.iter().any(|(t, _)| t == id) {
                todo.push((id, layer));
            }
        }
        // Every layer is locked, present or not, until the record is written: a GC
        // (`gc.rs`) judges a layer under its lock, so it sees this record or finds the
        // layer still wanted.
        let mut order: Vec<&str> = ids.iter().map(String::as_str).collect();
        order.sort_unstable();
        order.dedup();
        let mut locks = Vec::with_capacity(order.len());
        for id in order {
            state.current = format!("waiting for the lock of layer {id}");
            progress(&state);
            locks.push(self.lock_layer(id)?);
        }
        // Published by another puller while we waited (or collected meanwhile)?
        todo.retain(|(id, _)| !self.layer_path(id).is_dir());
        for (id, layer) in ids.iter().zip(&plan.layers) {
            if !self.layer_path(id).is_dir() && !todo.iter().any(|(t, _)| t == id) {
                todo.push((id, layer));
            }
        }
        state.layers_done = ids.iter().filter(|id| !todo.iter().any(|(t, _)| t == id)).count();
        state.bytes_total = todo.iter().map(|(_, l)| l.size).sum();
        state.current = format!("{} of {} layers already stored", state.layers_done, ids.len());
        progress(&state);

        let staging = match todo.is_empty() {
            true => None,
            false => {
                let tmp = TmpPath::new(self, "pull");
                fs::create_dir(tmp.path()).map_err(io_err(format!("creating {}", tmp.path().display())))?;
                Some(tmp)
            }
        };
        let mut image_bytes = 0u64;
        for (id, layer) in &todo {
            let dir = staging.as_ref().expect("staging exists when layers are missing").path();
            let blob_path = dir.join("blob");
            let mut blob = File::options()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&blob_path)
                .map_err(io_err(format!("creating {}", blob_path.display())))?;
            state.current = format!("fetching layer {} ({} bytes)", layer.blob, layer.size);
            progress(&state);
            let (done, reported) = (Cell::new(state.bytes_done), Cell::new(state.bytes_done));
            fetch(layer, &mut blob, &|n| {
                done.set(done.get() + n);
                // At most one report per MiB (and the last), whatever the chunk size.
                if done.get() - reported.get() >= PROGRESS_BYTES || done.get() == state.bytes_total {
                    reported.set(done.get());
                    progress(&PullProgress {
                        bytes_done: done.get(),
                        ..state.clone()
                    });
                }
            })?;
            state.bytes_done = done.get();

            state.current = format!("unpacking layer {}", layer.blob);
            progress(&state);
            blob.seek(SeekFrom::Start(0)).map_err(io_err("rewinding a blob"))?;
            let reader = unpack::decompress(blob).map_err(|e| ImageError::BadLayer {
                layer: layer.blob.clone(),
                reason: format!("cannot decompress: {e}"),
            })?;
            let limits = unpack::Limits::for_image(image_bytes);
            let unpacked = unpack::unpack_layer(reader, &dir.join(id), &layer.blob, limits)?;
            if unpacked.diff_id != layer.diff_id {
                return Err(ImageError::DigestMismatch {
                    what: format!("the uncompressed contents of layer {} (its diff_id)", layer.blob),
                    expected: layer.diff_id.clone(),
                    actual: unpacked.diff_id,
                });
            }
            image_bytes += unpacked.bytes;
            fs::remove_file(&blob_path).map_err(io_err(format!("removing {}", blob_path.display())))?;
            state.layers_done += ids.iter().filter(|i| *i == id).count();
        }

        if let Some(staging) = &staging {
            state.current = "publishing the layers".into();
            progress(&state);
            sync_file_system(staging.path())?;
            for (id, _) in &todo {
                match fs::rename(staging.path().join(id), self.layer_path(id)) {
                    Ok(()) => {}
                    // Published meanwhile by an edge whose lock we could not see: the
                    // same contents (same diff_id); ours goes with the staging dir.
                    Err(e) if matches!(e.raw_os_error(), Some(libc::EEXIST | libc::ENOTEMPTY)) => {}
                    Err(e) => return Err(io_err(format!("publishing layer {id}"))(e)),
                }
            }
        }
        let image = Image {
            name: plan.name,
            layers: ids,
            config: plan.config,
            reference: plan.reference,
            digest: plan.digest,
        };
        self.put(&image)?;
        drop(locks);
        state.current = format!("image {} ready", image.name);
        progress(&state);
        Ok(image)
    }

    /// Holds `locks/<id>.lock` exclusively until the file is dropped.
    pub(super) fn lock_layer(&self, id: &str) -> Result<File, ImageError> {
        let path = self.root.join("locks").join(format!("{id}.lock"));
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io_err(format!("opening {}", path.display())))?;
        loop {
            // SAFETY: flock on an fd we own; released when `file` is dropped.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(file);
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(io_err(format!("locking {}", path.display()))(err));
            }
        }
    }
}

/// Flushes the file system holding `dir`, so that a layer renamed into `layers/` after
/// it is whole on disk even after a crash.
pub(super) fn sync_file_system(dir: &Path) -> Result<(), ImageError> {
    let fd = File::open(dir).map_err(io_err(format!("opening {}", dir.display())))?;
    nix::unistd::syncfs(&fd).map_err(|e| io_err(format!("syncing {}", dir.display()))(e.into()))
}

/// The kinds of `tmp/` entries made here; see [`TmpPath`].
const TMP_KINDS: &[&str] = &["pull", "import", "record", "pack", "gc"];

/// A private path in `tmp/`, `<kind>.<pid>.<random>.<host>`, removed (file or tree)
/// when dropped. The pid and host let a later process tell leftovers of dead processes
/// from work under way on any machine sharing the store.
pub struct TmpPath {
    path: PathBuf,
}

impl TmpPath {
    pub(super) fn new(store: &ImageStore, kind: &'static str) -> Self {
        debug_assert!(TMP_KINDS.contains(&kind));
        let name = format!(
            "{kind}.{}.{:016x}.{}",
            std::process::id(),
            rand::random::<u64>(),
            host_name()
        );
        Self {
            path: store.root.join("tmp").join(name),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TmpPath {
    fn drop(&mut self) {
        remove_any(&self.path);
    }
}

pub(super) fn remove_any(path: &Path) {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => {
            let _ = super::remove_tree(path);
        }
        Ok(_) => {
            let _ = fs::remove_file(path);
        }
        Err(_) => {}
    }
}

/// This machine's host name, as it appears in `tmp/` names (no `/`).
pub(super) fn host_name() -> String {
    nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().replace('/', "_"))
        .unwrap_or_else(|_| "unknown-host".into())
}

/// Removes `tmp/` entries of [`TmpPath`] left by processes of this host that are gone.
fn remove_stale_tmp(store: &ImageStore) {
    for name in stale_tmp(store, std::time::Duration::MAX) {
        remove_any(&store.root.join("tmp").join(name));
    }
}

/// The `tmp/` entries that are leftovers: [`TmpPath`]s of processes of this host that
/// are gone, and any other entry (a build's scratch, whose name tells no host) older
/// than `max_age`.
pub(super) fn stale_tmp(store: &ImageStore, max_age: std::time::Duration) -> Vec<String> {
    let Ok(entries) = fs::read_dir(store.root.join("tmp")) else {
        return Vec::new();
    };
    let (host, me) = (host_name(), std::process::id());
    let mut out = Vec::new();
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let mut parts = name.splitn(4, '.');
        let ours = match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(kind), Some(pid), Some(_random), Some(their_host)) if TMP_KINDS.contains(&kind) => {
                pid.parse::<u32>().ok().map(|pid| (pid, their_host == host))
            }
            _ => None,
        };
        let stale = match ours {
            Some((pid, true)) => pid != me && !process_alive(pid),
            // Another machine's work: only its age can tell.
            Some((_, false)) | None => entry
                .metadata()
                .ok()
                .and_then(|m| m.modified().ok())
                .and_then(|t| std::time::SystemTime::now().duration_since(t).ok())
                .is_some_and(|age| age > max_age),
        };
        if stale {
            out.push(name);
        }
    }
    out.sort();
    out
}

fn process_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else { return false };
    // Signal 0 checks existence; EPERM means it exists under another user.
    !matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
        Err(nix::errno::Errno::ESRCH)
    )
}

/// Pulls in flight in one process, by canonical reference: the first caller pulls, the
/// others wait for its outcome (single flight).
#[derive(Default)]
pub(super) struct Flights {
    running: Mutex<HashMap<String, Arc<Flight>>>,
}

#[derive(Default)]
struct Flight {
    outcome: Mutex<Option<Result<Image, String>>>,
    done: Condvar,
}

impl std::fmt::Debug for Flights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let running = self.running.lock().map(|r| r.len()).unwrap_or(0);
        f.debug_struct("Flights").field("running", &running).finish()
    }
}

impl Flights {
    /// Runs `work` for `key` unless a call for `key` is running; then waits for that
    /// one and returns its image (or its error, as [`ImageError::SharedPull`]).
    pub(super) fn run(&self, key: &str, work: impl FnOnce() -> Result<Image, ImageError>) -> Result<Image, ImageError> {
        let (flight, leader) = {
            let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
            match running.get(key) {
                Some(flight) => (flight.clone(), false),
                None => {
                    let flight = Arc::new(Flight::default());
                    running.insert(key.to_string(), flight.clone());
                    (flight, true)
                }
            }
        };
        if !leader {
            let mut outcome = flight.outcome.lock().unwrap_or_else(|e| e.into_inner());
            while outcome.is_none() {
                outcome = flight.done.wait(outcome).unwrap_or_else(|e| e.into_inner());
            }
            let outcome = outcome.clone().expect("checked above");
            return outcome.map_err(|message| ImageError::SharedPull {
                reference: key.to_string(),
                message,
            });
        }
        // Waiters are released even if `work` panics.
        struct Finish<'a> {
            flights: &'a Flights,
            key: &'a str,
            flight: Arc<Flight>,
            outcome: Option<Result<Image, String>>,
        }
        impl Drop for Finish<'_> {
            fn drop(&mut self) {
                let mut running = self.flights.running.lock().unwrap_or_else(|e| e.into_inner());
                running.remove(self.key);
                drop(running);
                let outcome = self.outcome.take().unwrap_or_else(|| Err("the pull panicked".into()));
                *self.flight.outcome.lock().unwrap_or_else(|e| e.into_inner()) = Some(outcome);
                self.flight.done.notify_all();
            }
        }
        let mut finish = Finish {
            flights: self,
            key,
            flight,
            outcome: None,
        };
        let result = work();
        finish.outcome = Some(result.as_ref().map(Clone::clone).map_err(ToString::to_string));
        drop(finish);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[test]
    fn concurrent_calls_for_one_key_share_one_run_and_its_outcome() {
        let flights = Flights::default();
        let runs = AtomicUsize::new(0);
        let image = Image {
            name: "localhost:5000/app:v1".into(),
            ..Image::default()
        };
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        flights.run("k", || {
                            runs.fetch_add(1, Ordering::SeqCst);
                            std::thread::sleep(Duration::from_millis(300));
                            Ok(image.clone())
                        })
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert!(results.iter().all(|r| r.as_ref().ok() == Some(&image)));
        // Over: the next call runs again, and a failure reaches the waiters as SharedPull.
        let err = flights
            .run("k", || {
                Err(ImageError::BadImage {
                    image: "k".into(),
                    reason: "r".into(),
                })
            })
            .unwrap_err();
        assert!(matches!(err, ImageError::BadImage { .. }));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn leftovers_of_dead_processes_on_this_host_are_removed_and_others_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let store = ImageStore::open(tmp.path()).unwrap();
        let host = host_name();
        // A pid that cannot exist (above the kernel's pid_max limit of 2^22).
        let dead = format!("pull.{}.00000000000000aa.{host}", 1u32 << 23);
        let alive = format!("pull.1.00000000000000bb.{host}"); // init is alive
        let elsewhere = format!("pull.{}.00000000000000cc.another-host", 1u32 << 23);
        let build = "busybox-0123.77".to_string(); // a builder's scratch: not ours to judge
        for name in [&dead, &alive, &elsewhere, &build] {
            fs::create_dir_all(tmp.path().join("tmp").join(name).join("sub")).unwrap();
        }
        remove_stale_tmp(&store);
        let left: std::collections::BTreeSet<String> = fs::read_dir(tmp.path().join("tmp"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, [alive, elsewhere, build].into_iter().collect());
    }
}
