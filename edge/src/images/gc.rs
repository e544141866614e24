//! Garbage collection of a store that several edges on several machines may share.
//!
//! What keeps a layer or a VM disk (the roots):
//! - every image record under `images/` (built-in, pulled, imported, packed): its layers;
//! - every live edge's **in-use set**, `inuse/<edge>.json`: the layers and disk files
//!   its sandboxes (running, paused, starting), snapshots, forks and warm containers
//!   use, whether or not an image record still names them. An edge rewrites its set
//!   (atomically, by rename) at least every [`GC_REFRESH`], and before it starts a sandbox
//!   of an image; a set not rewritten for [`GcOptions::lease`] is the set of an edge that
//!   is gone, and no longer counts;
//! - a grace period ([`GcOptions::grace`]): a layer or disk made less than that ago is
//!   kept, so that a pull, pack or build between publishing its layer and writing its
//!   record is never raced.
//!
//! [`ImageStore::collect`] removes a layer only under the layer's lock (the lock a pull,
//! import or pack takes to publish it), after reading every record and every in-use set
//! again under that lock, and by renaming it into `tmp/` first: a reader on another
//! machine sees the whole layer or none of it. A disk file goes the same way under its
//! builder's lock. Stale scratch in `tmp/` (of processes gone on this host, or older
//! than [`STALE_SCRATCH`] when its process cannot be told) goes too.
//!
//! `vmdisks/` holds, per image, a microVM root disk (`<stem>-<key>.erofs`) and a full
//! VM boot disk (`<stem>-<key>.qcow2` + `.json`), keyed by what they were built from: a
//! disk is kept when an in-use set names it, or when it is the newest of its kind for
//! an image that has a record (older keys are what a changed recipe or kernel left).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::{Image, ImageError, ImageStore, io_err, layers};

/// How often an edge rewrites its in-use set, at the least.
pub const GC_REFRESH: Duration = Duration::from_secs(30);

/// Scratch in `tmp/` whose owner cannot be told (builds: `<layer>.<pid>`, disks) is
/// removed once this old.
pub const STALE_SCRATCH: Duration = Duration::from_secs(24 * 3600);

/// What one edge (or any process sharing the store) uses: kept by every GC while the set
/// is fresh.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InUse {
    /// Layer ids (`sha256-<hex>`, `base-<hash>`).
    pub layers: BTreeSet<String>,
    /// File names under `vmdisks/`.
    #[serde(default)]
    pub disks: BTreeSet<String>,
    /// The layers each user (a sandbox or snapshot id) was started from: kept while the
    /// user lives, even after its image's record is gone.
    #[serde(default)]
    pub users: BTreeMap<String, Vec<String>>,
    /// The machine and directory of the edge whose set it is: a set of this machine
    /// whose directory is gone (and with it every sandbox record there) keeps nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<Holder>,
}

/// Where an in-use set's edge keeps its sandboxes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    pub host: String,
    pub data_dir: PathBuf,
}

impl Holder {
    /// This machine's `data_dir`.
    pub fn here(data_dir: &Path) -> Self {
        Self {
            host: layers::host_name(),
            data_dir: data_dir.to_path_buf(),
        }
    }

    fn is_gone(&self) -> bool {
        self.host == layers::host_name() && !self.data_dir.exists()
    }
}

impl InUse {
    fn merge(&mut self, other: &InUse) {
        self.layers.extend(other.layers.iter().cloned());
        self.disks.extend(other.disks.iter().cloned());
    }

    /// Adds what a JSON file of a sandbox, snapshot or VM names: any string that is a
    /// path under the store's `layers/` or `vmdisks/`, or the id of a stored layer.
    pub fn add_references_in(&mut self, store: &ImageStore, value: &serde_json::Value) {
        match value {
            serde_json::Value::String(s) => self.add_reference(store, s),
            serde_json::Value::Array(a) => a.iter().for_each(|v| self.add_references_in(store, v)),
            serde_json::Value::Object(o) => o.values().for_each(|v| self.add_references_in(store, v)),
            _ => {}
        }
    }

    fn add_reference(&mut self, store: &ImageStore, s: &str) {
        let path = Path::new(s);
        let first = |dir: &str| {
            path.strip_prefix(store.root().join(dir))
                .ok()
                .and_then(|rest| rest.components().next())
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
        };
        if let Some(id) = first("layers") {
            self.layers.insert(id);
        } else if let Some(file) = first("vmdisks") {
            self.disks.insert(file);
        } else if !s.is_empty()
            && !s.contains('/')
            && s.len() <= 200
            && !s.starts_with('.')
            && store.layer_path(s).is_dir()
        {
            self.layers.insert(s.to_string());
        }
    }

    /// Adds the references in every `*.json` file under `dir` (at most `depth` levels
    /// down, never following a symlink nor entering another file system, such as a
    /// sandbox's mounted disk).
    pub fn scan_dir(&mut self, store: &ImageStore, dir: &Path, depth: usize) {
        let Ok(meta) = fs::symlink_metadata(dir) else { return };
        if !meta.is_dir() {
            return;
        }
        self.scan(store, dir, meta.dev(), depth);
    }

    fn scan(&mut self, store: &ImageStore, dir: &Path, dev: u64, depth: usize) {
        let Ok(entries) = fs::read_dir(dir) else { return };
        for entry in entries.filter_map(Result::ok) {
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            let path = entry.path();
            if meta.is_dir() && depth > 0 && meta.dev() == dev {
                self.scan(store, &path, dev, depth - 1);
            } else if meta.is_file()
                && meta.len() <= 4 << 20
                && path.extension().is_some_and(|x| x == "json")
                && let Ok(bytes) = fs::read(&path)
                && let Ok(value) = serde_json::from_slice::<serde_json::Value>(&bytes)
            {
                self.add_references_in(store, &value);
            }
        }
    }
}

/// How [`ImageStore::collect`] judges.
#[derive(Clone, Copy, Debug)]
pub struct GcOptions {
    /// An in-use set older than this is an edge that is gone.
    pub lease: Duration,
    /// A layer or disk younger than this is kept.
    pub grace: Duration,
}

impl Default for GcOptions {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(600),
            grace: Duration::from_secs(600),
        }
    }
}

/// What a collection freed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GcReport {
    pub layers: Vec<String>,
    pub disks: Vec<String>,
    pub scratch: Vec<String>,
    /// Bytes of the files removed (apparent sizes).
    pub bytes: u64,
}

impl GcReport {
    /// Entries removed.
    pub fn count(&self) -> usize {
        self.layers.len() + self.disks.len() + self.scratch.len()
    }
}

/// The name of an in-use set's file: the owner's name, any byte outside
/// `[A-Za-z0-9._-]` as `_`.
fn owner_file(owner: &str) -> String {
    let name: String = owner
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{}.json", name.trim_start_matches('.'))
}

impl ImageStore {
    fn in_use_dir(&self) -> PathBuf {
        self.root.join("inuse")
    }

    /// Writes `owner`'s in-use set (atomically: written in `tmp/`, synced, renamed).
    pub fn publish_in_use(&self, owner: &str, set: &InUse) -> Result<(), ImageError> {
        let dir = self.in_use_dir();
        fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let json = serde_json::to_vec(set).expect("an in-use set serialises");
        let tmp = layers::TmpPath::new(self, "record");
        let write = || -> io::Result<()> {
            use std::io::Write;
            let mut file = fs::File::create(tmp.path())?;
            // Not synced: a set cut short by a crash stops collections (unreadable)
            // until its edge rewrites it.
            file.write_all(&json)
        };
        write().map_err(io_err(format!("writing {}", tmp.path().display())))?;
        let path = dir.join(owner_file(owner));
        fs::rename(tmp.path(), &path).map_err(io_err(format!("writing {}", path.display())))
    }

    /// `owner`'s last published set, if any.
    pub fn in_use_of(&self, owner: &str) -> Option<InUse> {
        let bytes = fs::read(self.in_use_dir().join(owner_file(owner))).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Withdraws `owner`'s in-use set.
    pub fn withdraw_in_use(&self, owner: &str) -> Result<(), ImageError> {
        let path = self.in_use_dir().join(owner_file(owner));
        match fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err(format!("removing {}", path.display()))(e)),
            _ => Ok(()),
        }
    }

    /// Removes the record of image `name` (the layers stay until [`collect`](Self::collect)).
    /// Whether there was one.
    pub fn remove(&self, name: &str) -> Result<bool, ImageError> {
        let (_, path) = self.record_path(name)?;
        match fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io_err(format!("removing {}", path.display()))(e)),
        }
    }

    /// Every record, readable or not (an unreadable one stops a collection: it may name
    /// anything).
    fn all_records(&self) -> Result<Vec<Image>, ImageError> {
        let dir = self.root.join("images");
        let mut out = Vec::new();
        for entry in fs::read_dir(&dir).map_err(io_err(format!("listing {}", dir.display())))? {
            let entry = entry.map_err(io_err("listing images"))?;
            if entry.path().extension().is_none_or(|x| x != "json") {
                continue;
            }
            if let Some(image) = self.read_record(&entry.path())? {
                out.push(image);
            }
        }
        Ok(out)
    }

    /// Every in-use set younger than `lease`. An unreadable fresh set stops a collection.
    fn fresh_in_use(&self, lease: Duration) -> Result<InUse, ImageError> {
        let mut all = InUse::default();
        let Ok(entries) = fs::read_dir(self.in_use_dir()) else {
            return Ok(all);
        };
        for entry in entries.filter_map(Result::ok) {
            let path = entry.path();
            let Ok(meta) = fs::metadata(&path) else { continue };
            if age(&meta) > lease {
                continue;
            }
            let bytes = fs::read(&path).map_err(io_err(format!("reading {}", path.display())))?;
            let set: InUse = serde_json::from_slice(&bytes).map_err(|source| ImageError::Corrupt {
                path: path.clone(),
                source,
            })?;
            if set.holder.as_ref().is_some_and(Holder::is_gone) {
                continue;
            }
            all.merge(&set);
            all.layers.extend(set.users.values().flatten().cloned());
        }
        Ok(all)
    }

    /// What is referenced now: every record's layers, every fresh in-use set.
    fn roots(&self, lease: Duration) -> Result<(Vec<Image>, InUse), ImageError> {
        let records = self.all_records()?;
        let mut used = self.fresh_in_use(lease)?;
        for image in &records {
            used.layers.extend(image.layers.iter().cloned());
        }
        Ok((records, used))
    }

    /// Removes every layer, VM disk and stale scratch entry nothing references (see the
    /// module doc), and says what it freed.
    pub fn collect(&self, options: GcOptions) -> Result<GcReport, ImageError> {
        let mut report = GcReport::default();
        let (records, used) = self.roots(options.lease)?;

        // Layers: candidates from one look, each judged again under its lock.
        let layers_dir = self.root.join("layers");
        let mut candidates: Vec<String> = fs::read_dir(&layers_dir)
            .map_err(io_err(format!("listing {}", layers_dir.display())))?
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|id| !used.layers.contains(id))
            .collect();
        candidates.sort();
        for id in candidates {
            let path = self.layer_path(&id);
            let Ok(meta) = fs::symlink_metadata(&path) else {
                continue;
            };
            if made_within(&meta, options.grace) {
                continue;
            }
            let _lock = self.lock_layer(&id)?;
            let (_, used) = self.roots(options.lease)?;
            if used.layers.contains(&id) || !path.is_dir() {
                continue;
            }
            report.bytes += self.discard(&path, "layer")?;
            report.layers.push(id);
        }

        // VM disks.
        let disks_dir = self.root.join("vmdisks");
        if let Ok(entries) = fs::read_dir(&disks_dir) {
            let stems: BTreeSet<String> = records.iter().map(Image::file_stem).collect();
            let mut files = Vec::new();
            for entry in entries.filter_map(Result::ok) {
                let name = entry.file_name().to_string_lossy().into_owned();
                let Ok(meta) = entry.path().symlink_metadata() else {
                    continue;
                };
                files.push((name, meta));
            }
            for name in stale_disks(&files, &stems, &used.disks, options.grace) {
                let path = disks_dir.join(&name);
                let key = disk_key(&name).unwrap_or_default();
                let lock_name = match name.rsplit_once('.').map(|(_, x)| x) {
                    Some("erofs") => format!("vmdisk-{key}"),
                    _ => format!("bootdisk-{key}"),
                };
                let _lock = self.lock_layer(&lock_name)?;
                let (_, used) = self.roots(options.lease)?;
                if used.disks.contains(&name) || !path.exists() {
                    continue;
                }
                report.bytes += self.discard(&path, "disk")?;
                report.disks.push(name);
            }
        }

        // Scratch.
        for name in layers::stale_tmp(self, STALE_SCRATCH) {
            let path = self.root.join("tmp").join(&name);
            report.bytes += tree_bytes(&path);
            layers::remove_any(&path);
            report.scratch.push(name);
        }
        Ok(report)
    }

    /// Renames `path` into `tmp/` (so that nobody sees part of it), removes it there and
    /// returns the bytes it held.
    fn discard(&self, path: &Path, what: &str) -> Result<u64, ImageError> {
        let bytes = tree_bytes(path);
        let away = layers::TmpPath::new(self, "gc");
        fs::rename(path, away.path()).map_err(io_err(format!("moving {what} {} away", path.display())))?;
        drop(away);
        Ok(bytes)
    }
}

/// `<stem>-<key>.<ext>` → `<key>` (16 hex digits).
fn disk_key(name: &str) -> Option<&str> {
    let (base, _) = name.rsplit_once('.')?;
    let (_, key) = base.rsplit_once('-')?;
    (key.len() == 16 && key.bytes().all(|b| b.is_ascii_hexdigit())).then_some(key)
}

/// The disk files to remove: not in use, not young, and not the newest disk of its kind
/// of an image that has a record. Empty-disk templates (`empty-*`) stay; a boot disk's
/// manifest goes with its disk; a builder's `.tmp` goes once [`STALE_SCRATCH`] old.
fn stale_disks(
    files: &[(String, fs::Metadata)],
    stems: &BTreeSet<String>,
    used: &BTreeSet<String>,
    grace: Duration,
) -> Vec<String> {
    // The newest disk per (stem, kind).
    let mut newest: BTreeMap<(String, String), (SystemTime, String)> = BTreeMap::new();
    for (name, meta) in files {
        let Some((base, ext)) = name.rsplit_once('.') else {
            continue;
        };
        if !matches!(ext, "erofs" | "qcow2") || disk_key(name).is_none() {
            continue;
        }
        let stem = base.rsplit_once('-').map(|(s, _)| s).unwrap_or(base).to_string();
        let at = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        let slot = newest.entry((stem, ext.to_string())).or_insert((at, name.clone()));
        if at > slot.0 {
            *slot = (at, name.clone());
        }
    }
    let keep_disk = |name: &str| -> bool {
        let Some((base, ext)) = name.rsplit_once('.') else {
            return true;
        };
        let stem = base.rsplit_once('-').map(|(s, _)| s).unwrap_or(base);
        used.contains(name)
            || (stems.contains(stem)
                && newest
                    .get(&(stem.to_string(), ext.to_string()))
                    .is_some_and(|(_, n)| n == name))
    };
    let mut out = Vec::new();
    for (name, meta) in files {
        let young = made_within(meta, grace);
        let Some((base, ext)) = name.rsplit_once('.') else {
            continue;
        };
        let remove = match ext {
            "erofs" | "qcow2" if disk_key(name).is_some() => !young && !keep_disk(name),
            // A boot disk's manifest: with its disk.
            "json" if disk_key(name).is_some() => {
                let disk = format!("{base}.qcow2");
                !young && !used.contains(name) && !keep_disk(&disk)
            }
            "tmp" if name.starts_with('.') => age(meta) > STALE_SCRATCH,
            _ => false,
        };
        if remove {
            out.push(name.clone());
        }
    }
    out.sort();
    out
}

/// Whether the entry was made (or renamed into place) less than `grace` ago: its
/// modification time may come from an archive, its change time cannot.
fn made_within(meta: &fs::Metadata, grace: Duration) -> bool {
    let changed = SystemTime::UNIX_EPOCH + Duration::from_secs(meta.ctime().max(0) as u64);
    let changed_age = SystemTime::now().duration_since(changed).unwrap_or_default();
    age(meta) < grace || changed_age < grace
}

fn age(meta: &fs::Metadata) -> Duration {
    meta.modified()
        .ok()
        .and_then(|t| SystemTime::now().duration_since(t).ok())
        .unwrap_or_default()
}

/// Apparent bytes of the files under `path` (not following symlinks).
pub(crate) fn tree_bytes(path: &Path) -> u64 {
    let Ok(meta) = fs::symlink_metadata(path) else { return 0 };
    if !meta.is_dir() {
        return meta.len();
    }
    let Ok(entries) = fs::read_dir(path) else { return 0 };
    entries.filter_map(Result::ok).map(|e| tree_bytes(&e.path())).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_keys_are_read_from_file_names() {
        assert_eq!(disk_key("base-0123456789abcdef.erofs"), Some("0123456789abcdef"));
        assert_eq!(
            disk_key("127.0.0.1_5000_app_v1-0123456789abcdef.qcow2"),
            Some("0123456789abcdef")
        );
        assert_eq!(disk_key("empty-256M.ext4"), None);
    }

    #[test]
    fn owner_files_are_plain_names() {
        assert_eq!(owner_file("edge-1"), "edge-1.json");
        assert_eq!(owner_file("../x/y"), "_x_y.json");
    }
}
