//! The local image store: layers are complete, read-only directory trees and an image is
//! an ordered list of layers (bottom first) plus a small run config. The container
//! backend stacks the layers with overlayfs, so nothing is copied per sandbox. Images
//! come from two sources: the project's own builders (`build.rs`) and OCI images, pulled
//! from a registry (`registry.rs`) or imported from a `docker save` or OCI-layout tarball
//! (`import.rs`), one layer per OCI diff.
//!
//! Layout under the store root:
//! - `layers/<id>/`: one finished tree; only ever created by an atomic rename. Built
//!   layers are named `<recipe>-<hash>`; OCI layers `sha256-<hex>`, `<hex>` being the
//!   layer's diff_id (the SHA-256 of its uncompressed tar), so one layer shared by many
//!   images, or pulled by many edges sharing the store, is stored once.
//! - `images/<name>.json`: [`Image`]. A store name is its own file name; a registry
//!   reference is stored under its canonical form (`host/repo:tag`), every byte outside
//!   `[A-Za-z0-9._-]` written `%XX` (`localhost%3A5000%2Fapp%3Av1.json`): injective, and
//!   never equal to a store name (which has no `%`).
//! - `tmp/`: work under way: builds (`<layer>.<pid>`), OCI pulls and imports
//!   (`pull.<pid>.<random>.<host>/`, `import.…`), packs (`pack.…`) and image records
//!   before their rename (`record.…`). A pull's leftovers are removed by the next pull on the same host once
//!   their process is gone.
//! - `inuse/<edge>.json`: what each edge sharing the store uses ([`InUse`], `gc.rs`),
//!   the roots of garbage collection beside the records; `vmdisks/`: VM root and boot
//!   disks built per image (`crate::vm`).
//! - `locks/<name>.lock`: serialises builds of one image across processes;
//!   `locks/sha256-<hex>.lock` the unpacking of one OCI layer (flock: several edges on
//!   one shared file system unpack a layer once; the others wait and then find it).
//!
//! An image built on another (`code-interpreter-v1` on `base`) lists the parent's
//! layers and then its own; a layer id hashes its recipe and the layers below it, and
//! `ensure` rebuilds an image whose stored record no longer matches its recipe.
//!
//! The builders: `busybox` (Debian busybox-static), `base` (debootstrap bookworm, then
//! apt's python-is-python3, python3-pip, sudo, nodejs and npm in a build root bound over
//! that tree; `user` has passwordless sudo and pip may install outside a venv) and
//! `code-interpreter-v1` (`base`'s layer plus one: python3-numpy/-pandas/-matplotlib
//! installed in a build root, `build_root.rs`, and our code-interpreter server,
//! `edge/images/code-interpreter/server.py`, embedded and hashed into the layer id). An
//! image's `ImageConfig.start` (`StartSpec`) is the agent's `--start-file`; for the code
//! interpreter it starts the server as `user` with `ready_port` 49999. Store names are
//! E2B's template names; `canonical_name` maps the other references SDKs send
//! (`:latest`/`:default` tags, `code-interpreter`). CLI: `opendsec-image build|list`.
//!
//! OCI images: [`ImageStore::pull`] and [`ImageStore::import`] (`layers.rs` says how a
//! pull stages, locks and publishes; `unpack.rs` how a layer's tar is written). Layers
//! made here from a sandbox's files (a pack): [`write_layer`] and
//! [`ImageStore::add_layer`] (`pack.rs`), stored as OCI layers are.
//!
//! **Architecture Invariant:** a layer id hashes its recipe (packages, the files it adds)
//! and the ids of the layers below it; `ensure` rebuilds an image whose stored record
//! differs from what its recipe gives, so a changed recipe never reuses a stale layer.
//! An OCI layer's id is its verified diff_id.
//!
//! **Architecture Invariant:** nothing half-written is ever visible under `layers/` or
//! `images/`: layers are renamed in once complete (and synced), records are written in
//! `tmp/` and renamed. An OCI pull publishes only after every blob matched its digest
//! (manifest, config, compressed layers) and every layer's contents its diff_id; a
//! failed pull leaves `layers/`, `images/` and `tmp/` as they were.
//!
//! **Architecture Invariant:** unpacking an image's layer never writes outside the layer
//! directory: paths are walked from the layer's root without following symlinks, `..`
//! and links leaving the layer are refused, and nothing the image carries can make
//! overlayfs metadata (whiteouts and opaque marks are made by us from OCI's `.wh.`
//! names; `trusted.*` xattrs and device files from images are refused or dropped).
//!
//! **Architecture Invariant:** a build's mounts exist only in a private mount namespace of
//! one builder thread (`build_root.rs`); build tools die with the builder (PDEATHSIG).
//!
//! **Architecture Invariant:** the code-interpreter server never holds a cell's whole
//! output: output is cut into pieces of at most 64 KiB and forwarded as it comes, with
//! backpressure from the client down to the cell's `print`.

mod build;
mod build_root;
mod gc;
mod import;
mod layers;
mod oci;
mod pack;
mod push;
mod registry;
mod unpack;

/// Entry points for the fuzz targets (`fuzz/`): what the image store reads from a
/// registry or a tarball (manifests, indexes, configs, layer blobs), over arbitrary
/// bytes. Not an API: nothing else calls these.
#[doc(hidden)]
pub mod fuzzing {
    use super::*;

    /// A layer blob as an OCI pull installs it: decompressed by its magic (gzip, zstd or
    /// none) and unpacked into the new directory `dest`, held to `max_bytes` (of its tar
    /// stream, and of the file contents written) and `max_entries`. Gives its diff_id.
    pub fn unpack_layer(
        blob: std::fs::File,
        dest: &Path,
        max_bytes: u64,
        max_entries: u64,
    ) -> Result<String, ImageError> {
        let reader = unpack::decompress(blob).map_err(|e| ImageError::BadLayer {
            layer: "fuzz".into(),
            reason: format!("cannot decompress: {e}"),
        })?;
        let limits = unpack::Limits {
            bytes: max_bytes,
            entries: max_entries,
        };
        unpack::unpack_layer(reader, dest, "fuzz", limits).map(|u| u.diff_id)
    }

    /// A manifest as a pull reads it: an index gives its linux/amd64 manifest's digest,
    /// an image manifest is checked against the limits and gives its layers' blobs
    /// (digest, size), as [`plan_config`] takes them.
    pub fn read_manifest(bytes: &[u8]) -> Result<Vec<(String, u64)>, ImageError> {
        match oci::parse_manifest("fuzz", bytes)? {
            oci::Manifest::Index(index) => {
                let chosen = oci::select_platform("fuzz", &index)?;
                oci::sha256_hex("fuzz", "its linux/amd64 manifest", chosen.digest().as_ref())?;
                Ok(Vec::new())
            }
            oci::Manifest::Image(manifest) => {
                oci::check_manifest("fuzz", &manifest)?;
                Ok(manifest
                    .layers()
                    .iter()
                    .map(|l| (l.digest().to_string(), l.size()))
                    .collect())
            }
        }
    }

    /// An image config read against the layers its manifest named: its run settings.
    pub fn plan_config(bytes: &[u8], blobs: &[(String, u64)]) -> Result<ImageConfig, ImageError> {
        oci::plan_image("fuzz", bytes, blobs).map(|(config, _)| config)
    }
}

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use build::{
    BuildPhase, BuildProgress, CODE_INTERPRETER_PORT, CODE_INTERPRETER_SERVER_PATH, builder_names,
    code_interpreter_start,
};
pub use gc::{GC_REFRESH, GcOptions, GcReport, Holder, InUse};
pub use layers::{PullProgress, TmpPath};
pub use pack::{LayerTar, ScratchDir, write_layer};
pub use push::Pushed;
pub use registry::{PullOptions, RegistryAuth};

/// Default location of the store on an edge machine.
pub const DEFAULT_STORE: &str = "/var/lib/opendsec/images";

/// An image: layers bottom first, and how to run a process in it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Image {
    /// A store name (`base`) or, for a pulled image, its canonical reference
    /// (`registry.example:5000/app:v1`).
    pub name: String,
    /// Layer ids, bottom (base) layer first.
    pub layers: Vec<String>,
    pub config: ImageConfig,
    /// The registry reference the image was pulled from, canonical (absent for built
    /// and imported images).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    /// The digest (`sha256:…`) of the image manifest it was made from: for a reference
    /// naming an index, the linux/amd64 manifest's; for a `docker save` archive (which has
    /// no manifest) its config's, Docker's image id (absent for built images).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

/// Defaults for processes started in an image.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageConfig {
    /// `KEY=value` entries.
    pub env: Vec<String>,
    /// The unprivileged user sessions run as (`user`, uid 1000).
    pub user: String,
    pub workdir: String,
    pub shell: String,
    /// The template's long-running process, started by the agent at boot (the code
    /// interpreter's server); absent for plain images.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<StartSpec>,
    /// An OCI image's Entrypoint, as in its config (empty for none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entrypoint: Vec<String>,
    /// An OCI image's Cmd (the entrypoint's default arguments, or the command).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cmd: Vec<String>,
    /// An OCI image's ExposedPorts (`8080/tcp`), sorted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exposed_ports: Vec<String>,
    /// An OCI image's labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// How the agent starts a template's process at boot. Serialised, it is exactly the
/// agent's `--start-file` (`start.json`), e.g. for `code-interpreter-v1`:
/// `{"cmd":"/usr/bin/python3","args":["/opt/opendsec/code-interpreter/server.py",
/// "--port","49999"],"envs":{},"cwd":"/home/user","user":"user","ready_port":49999}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartSpec {
    pub cmd: String,
    pub args: Vec<String>,
    pub envs: BTreeMap<String, String>,
    pub cwd: String,
    pub user: String,
    /// A port on 127.0.0.1 that accepts connections once the process is ready.
    pub ready_port: Option<u16>,
    /// A shell command run (as `user`, in `cwd`) until it exits 0: then the process is
    /// ready (a template's `readyCmd`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_cmd: Option<String>,
    /// It reads the sandbox's variables on its stdin (the agent's `claim_stdin`), so a
    /// warm container of the image may run it before a sandbox claims the container
    /// (`node/warm.rs`). Only the code-interpreter server does; a template's own start
    /// command runs at the sandbox's start, with the sandbox's variables.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub claim_stdin: bool,
}

impl ImageConfig {
    /// Who processes naming no user run as, from the image's User (`name`, `uid`,
    /// `name:group` or `uid:gid`): its user part, a name or a uid (`user` when absent).
    /// The agent finds the account in the sandbox's /etc/passwd (a uid by its number; the
    /// account's own groups apply) and falls back to `user` where there is none.
    pub fn account(&self) -> Option<&str> {
        let u = self.user.split(':').next().unwrap_or_default();
        let valid = !u.is_empty()
            && u.len() <= 64
            && !u.starts_with('-')
            && u.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
        valid.then_some(u)
    }

    /// The config a packed image gets from its parent's and a template build's changes:
    /// variables set over the parent's, the working directory and user replaced where
    /// given, and the start command (run by `/bin/bash -l -c`, as E2B runs commands,
    /// `/bin/sh` where the image has no bash) with its ready command.
    pub fn apply(&mut self, c: &opendsec_projections::ConfigOverride) {
        for (k, v) in &c.env {
            let prefix = format!("{k}=");
            self.env.retain(|e| !e.starts_with(&prefix));
            self.env.push(format!("{k}={v}"));
        }
        if !c.workdir.is_empty() {
            self.workdir = c.workdir.clone();
        }
        if !c.user.is_empty() {
            self.user = c.user.clone();
        }
        let ready = (!c.ready_cmd.is_empty()).then(|| c.ready_cmd.clone());
        if !c.start_cmd.is_empty() {
            self.start = Some(StartSpec {
                cmd: "/bin/bash".into(),
                args: vec!["-l".into(), "-c".into(), c.start_cmd.clone()],
                envs: BTreeMap::new(),
                cwd: self.workdir.clone(),
                user: self.user.clone(),
                ready_port: None,
                ready_cmd: ready,
                claim_stdin: false,
            });
        } else if let (Some(start), Some(ready)) = (self.start.as_mut(), ready) {
            start.ready_cmd = Some(ready);
        }
    }
}

/// The store's name for an image reference (E2B's template names and aliases): one
/// definition, shared with the control plane.
pub use opendsec_commands::images::canonical_name;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// image {0:?} is not in the store
    #[error("image {0:?} is not in the store")]
    NotFound(String),
    /// no builder knows image {0:?}
    #[error("unknown image {0:?}: the builders are {known}", known = builder_names().join(", "))]
    UnknownImage(String),
    #[error("invalid image name {0:?}: use letters, digits, '-', '_' and '.'")]
    InvalidName(String),
    #[error("image {image:?} refers to missing layer {layer}")]
    MissingLayer { image: String, layer: String },
    #[error("building image {image:?} failed in phase {phase}: {message}")]
    Build {
        image: String,
        phase: BuildPhase,
        message: String,
    },
    #[error("{context}: {source}")]
    Io { context: String, source: io::Error },
    #[error("corrupt image record {path}: {source}")]
    Corrupt { path: PathBuf, source: serde_json::Error },
    /// `reference` cannot be pulled or stored as given.
    #[error("invalid image reference {reference:?}: {reason}")]
    InvalidReference { reference: String, reason: String },
    /// The registry wants other credentials (or some, where none were given).
    #[error("registry {registry} refused {who}: {hint}")]
    Unauthorized {
        registry: String,
        who: String,
        hint: String,
    },
    /// The registry could not be reached or answered with an error.
    #[error("pulling {reference}: {message}")]
    Registry { reference: String, message: String },
    /// A push to the registry failed (`push.rs`).
    #[error("pushing to {reference}: {message}")]
    Push { reference: String, message: String },
    /// A blob (manifest, config, layer) or a layer's contents are not what its digest says.
    #[error("{what} does not match its digest: expected {expected}, got {actual}")]
    DigestMismatch {
        what: String,
        expected: String,
        actual: String,
    },
    /// The image is malformed, unsupported or over a limit.
    #[error("image {image}: {reason}")]
    BadImage { image: String, reason: String },
    /// A layer's tar stream is malformed or over a limit.
    #[error("layer {layer}: {reason}")]
    BadLayer { layer: String, reason: String },
    /// A layer's entry would write outside the layer or make something we refuse.
    #[error("layer {layer}: refusing entry {entry:?}: {reason}")]
    UnsafeEntry {
        layer: String,
        entry: String,
        reason: String,
    },
    /// A concurrent pull of the same reference, which this call waited for, failed.
    #[error("pulling {reference} (the pull this call waited for) failed: {message}")]
    SharedPull { reference: String, message: String },
}

pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> ImageError {
    let context = context.into();
    move |source| ImageError::Io { context, source }
}

/// A store rooted at one directory; cheap to clone, safe to share between processes
/// (and machines, on a shared file system). Clones share one set of pulls in flight.
#[derive(Clone, Debug)]
pub struct ImageStore {
    root: PathBuf,
    pulls: std::sync::Arc<layers::Flights>,
}

impl ImageStore {
    /// A private path in the store's `tmp/` for work of `kind` (`import`: an uploaded
    /// tarball), removed when dropped; the store's collection leaves it alone while this
    /// process lives.
    pub fn tmp_path(&self, kind: &'static str) -> TmpPath {
        TmpPath::new(self, kind)
    }

    /// Opens (creating if needed) the store at `root`.
    pub fn open(root: impl AsRef<Path>) -> Result<Self, ImageError> {
        let root = root.as_ref().to_path_buf();
        for sub in ["layers", "images", "tmp", "locks"] {
            let dir = root.join(sub);
            fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        }
        Ok(Self {
            root,
            pulls: Default::default(),
        })
    }

    /// Whether `name` is a registry reference (`host[:port]/repo[:tag][@digest]`, or
    /// anything with `@sha256:`) rather than a store name like `base`: its first path
    /// component is a host (has a `.` or a `:`, or is `localhost`). `ubuntu:22.04` and
    /// `library/ubuntu` are not: name their registry (`docker.io/library/ubuntu:22.04`).
    pub fn is_reference(name: &str) -> bool {
        oci::is_reference(name)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Directory of a layer (whether or not it exists).
    pub fn layer_path(&self, id: &str) -> PathBuf {
        self.root.join("layers").join(id)
    }

    /// The image's layer directories, bottom first; fails if one is missing.
    ///
    /// A layer an image lists twice (two identical diffs) is stacked once, at its upper
    /// place: overlayfs refuses a lower directory given twice, and the lower copy can
    /// change nothing the upper one does not decide again.
    pub fn layer_dirs(&self, image: &Image) -> Result<Vec<PathBuf>, ImageError> {
        image
            .layers
            .iter()
            .enumerate()
            .filter(|(i, id)| !image.layers[i + 1..].contains(id))
            .map(|(_, id)| {
                let path = self.layer_path(id);
                if path.is_dir() {
                    Ok(path)
                } else {
                    Err(ImageError::MissingLayer {
                        image: image.name.clone(),
                        layer: id.clone(),
                    })
                }
            })
            .collect()
    }

    /// The image's name in the store (a canonical store name or reference) and the path
    /// of its record.
    fn record_path(&self, name: &str) -> Result<(String, PathBuf), ImageError> {
        let (name, file) = oci::record_file(name)?;
        Ok((name, self.root.join("images").join(file)))
    }

    /// The stored image `name` (a store name or an alias of one, see [`canonical_name`],
    /// or a registry reference it was pulled or imported as), with all its layers present.
    pub fn get(&self, name: &str) -> Result<Image, ImageError> {
        let (name, path) = self.record_path(name)?;
        match self.read_record(&path)? {
            Some(image) => {
                self.layer_dirs(&image)?;
                Ok(image)
            }
            None => Err(ImageError::NotFound(name)),
        }
    }

    fn read_record(&self, path: &Path) -> Result<Option<Image>, ImageError> {
        let bytes = match fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(format!("reading {}", path.display()))(e)),
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|source| ImageError::Corrupt {
                path: path.to_path_buf(),
                source,
            })
    }

    /// All stored images, sorted by name.
    pub fn list(&self) -> Result<Vec<Image>, ImageError> {
        let dir = self.root.join("images");
        let mut out = Vec::new();
        for entry in fs::read_dir(&dir).map_err(io_err(format!("listing {}", dir.display())))? {
            let entry = entry.map_err(io_err("listing images"))?;
            if entry.path().extension().is_none_or(|x| x != "json") {
                continue;
            }
            let Some(image) = self.read_record(&entry.path())? else {
                continue; // removed meanwhile
            };
            match self.layer_dirs(&image) {
                Ok(_) => out.push(image),
                // A record whose layer vanished is not usable: leave it out of the list.
                Err(ImageError::MissingLayer { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Returns image `name` (or an alias of it), building it first if it is not stored
    /// yet or its record no longer matches its recipe (a changed recipe, or a parent
    /// rebuilt). Concurrent callers (threads or processes) build it once: the others
    /// wait on the lock file and then find it stored. An image with a parent builds
    /// the parent first.
    pub fn ensure(&self, name: &str, progress: &dyn Fn(&BuildProgress)) -> Result<Image, ImageError> {
        let name = canonical_name(name);
        // A reference names no recipe: only what is stored (`get` checks it).
        if !Self::is_reference(name) {
            validate_name(name)?;
        }
        let Some(recipe) = build::recipe(name) else {
            // Not one of ours: only what is stored.
            return match self.get(name) {
                Err(ImageError::NotFound(_) | ImageError::MissingLayer { .. }) => {
                    Err(ImageError::UnknownImage(name.into()))
                }
                other => other,
            };
        };
        let wanted = Image {
            name: name.to_string(),
            layers: build::layer_ids(name).expect("a recipe's parents have recipes"),
            config: recipe.config(),
            ..Image::default()
        };
        match self.get(name) {
            Ok(image) if image == wanted => return Ok(image),
            Ok(_) | Err(ImageError::NotFound(_) | ImageError::MissingLayer { .. }) => {}
            Err(e) => return Err(e),
        }
        // The parent first, under its own lock (never both locks at once).
        let lower = match recipe.parent {
            Some(parent) => {
                let parent = self.ensure(parent, progress)?;
                self.layer_dirs(&parent)?
            }
            None => Vec::new(),
        };
        let lock_path = self.root.join("locks").join(format!("{name}.lock"));
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_err(format!("opening {}", lock_path.display())))?;
        progress(&BuildProgress::new(
            BuildPhase::Lock,
            format!("waiting for {}", lock_path.display()),
        ));
        // SAFETY: flock on an fd we own; released when `lock` is dropped.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(io_err("locking the image store")(io::Error::last_os_error()));
        }
        // Someone else may have built it while we waited.
        if let Ok(image) = self.get(name)
            && image == wanted
        {
            progress(&BuildProgress::new(BuildPhase::Done, "built by another process"));
            return Ok(image);
        }
        let layer_id = wanted.layers.last().expect("an image has a layer");
        // Held until the record is written: a GC judges the layer under this lock.
        let _layer_lock = self.lock_layer(layer_id)?;
        if !self.layer_path(layer_id).is_dir() {
            // Under the lock nobody else builds this layer: scratch of a build that
            // was killed is stale.
            self.remove_stale_scratch(layer_id);
            let tmp = self.root.join("tmp").join(format!("{layer_id}.{}", std::process::id()));
            let result = build::build_layer(&recipe, &lower, &tmp, progress).and_then(|()| {
                fs::rename(&tmp, self.layer_path(layer_id)).map_err(io_err(format!("publishing layer {layer_id}")))
            });
            if let Err(e) = result {
                let _ = remove_tree(&tmp);
                return Err(e);
            }
        }
        self.put(&wanted)?;
        progress(&BuildProgress::new(BuildPhase::Done, format!("image {name} ready")));
        Ok(wanted)
    }

    fn remove_stale_scratch(&self, layer_id: &str) {
        let prefix = format!("{layer_id}.");
        let Ok(entries) = fs::read_dir(self.root.join("tmp")) else {
            return;
        };
        for entry in entries.filter_map(Result::ok) {
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = remove_tree(&entry.path());
            }
        }
    }

    /// Writes an image record atomically (written and synced in `tmp/`, then renamed
    /// into `images/`). Its name is a store name or a registry reference.
    pub fn put(&self, image: &Image) -> Result<(), ImageError> {
        let (_, path) = self.record_path(&image.name)?;
        self.layer_dirs(image)?;
        let json = serde_json::to_vec_pretty(image).expect("image serialises");
        let tmp = layers::TmpPath::new(self, "record");
        let write = || -> io::Result<()> {
            use std::io::Write;
            let mut file = fs::File::create(tmp.path())?;
            file.write_all(&json)?;
            file.sync_all()
        };
        write().map_err(io_err(format!("writing {}", tmp.path().display())))?;
        fs::rename(tmp.path(), &path).map_err(io_err(format!("writing {}", path.display())))
    }
}

pub(super) fn validate_name(name: &str) -> Result<(), ImageError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'));
    if ok {
        Ok(())
    } else {
        Err(ImageError::InvalidName(name.to_string()))
    }
}

impl Image {
    /// The environment of a sandbox of this image: the image's Env (`KEY=value`), with
    /// the sandbox's own variables over it.
    pub fn env_with(&self, own: &BTreeMap<String, String>) -> BTreeMap<String, String> {
        let mut env: BTreeMap<String, String> = self
            .config
            .env
            .iter()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        env.extend(own.iter().map(|(k, v)| (k.clone(), v.clone())));
        env
    }

    /// The image's name as part of a file name: references hold '/', which a file name
    /// cannot (every byte outside `[A-Za-z0-9._-]` becomes '_'; file names that use it
    /// also carry a key of the image's contents).
    pub fn file_stem(&self) -> String {
        self.name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    }
}

/// Removes a tree that may hold read-only directories.
pub(crate) fn remove_tree(path: &Path) -> io::Result<()> {
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_image_user_is_followed_by_its_user_part_a_name_or_a_uid() {
        let with = |user: &str| ImageConfig {
            user: user.into(),
            ..ImageConfig::default()
        };
        for (user, account) in [
            ("user", Some("user")),
            ("root", Some("root")),
            ("node", Some("node")),
            ("app_1.x-y", Some("app_1.x-y")),
            ("1000", Some("1000")),
            ("1000:1000", Some("1000")),
            ("app:staff", Some("app")),
            ("", None),
            ("-rf", None),
            ("a b", None),
        ] {
            assert_eq!(with(user).account(), account, "{user:?}");
        }
    }

    #[test]
    fn start_spec_serialises_to_the_agents_start_file() {
        let json = serde_json::to_value(code_interpreter_start()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "cmd": "/usr/bin/python3",
                "args": ["/opt/opendsec/code-interpreter/server.py", "--port", "49999", "--claim-stdin"],
                "envs": {},
                "cwd": "/home/user",
                "user": "user",
                "ready_port": 49999,
                "claim_stdin": true
            })
        );
    }

    #[test]
    fn records_without_start_still_read_and_plain_images_write_none() {
        let old = r#"{"name":"base","layers":["base-2e93d6b548f8b8b0"],"config":{"env":[],"user":"user","workdir":"/home/user","shell":"/bin/bash"}}"#;
        let image: Image = serde_json::from_str(old).unwrap();
        assert_eq!(image.config.start, None);
        let written = serde_json::to_string(&image).unwrap();
        assert!(!written.contains("start"), "{written}");
        assert_eq!(serde_json::from_str::<Image>(&written).unwrap(), image);
    }

    #[test]
    fn code_interpreter_is_base_plus_one_layer_that_starts_the_server() {
        let base = build::layer_ids("base").unwrap();
        let ci = build::layer_ids("code-interpreter-v1").unwrap();
        assert_eq!(ci.len(), base.len() + 1);
        assert_eq!(ci[..base.len()], base[..]);
        assert!(ci[base.len()].starts_with("code-interpreter-v1-"), "{ci:?}");
        let config = build::recipe("code-interpreter-v1").unwrap().config();
        assert_eq!(config.start, Some(code_interpreter_start()));
        assert_eq!(config.shell, "/bin/bash");
        assert_eq!(build::recipe("base").unwrap().config().start, None);
        assert!(builder_names().contains(&"code-interpreter-v1"));
    }

    #[test]
    fn mcp_gateway_is_base_plus_the_gateway_and_its_pinned_packages() {
        let base = build::layer_ids("base").unwrap();
        let mcp = build::layer_ids(build::MCP_GATEWAY_IMAGE).unwrap();
        assert_eq!(mcp[..base.len()], base[..]);
        assert_eq!(mcp.len(), base.len() + 1);
        // Nothing runs until the SDK runs `mcp-gateway --config ...`.
        assert_eq!(build::recipe(build::MCP_GATEWAY_IMAGE).unwrap().config().start, None);
        assert!(opendsec_commands::images::is_builtin(build::MCP_GATEWAY_IMAGE));
        // Every package of the gateway is pinned by version and digest.
        let requirements = include_str!("../../images/mcp-gateway/requirements.txt");
        let pins: Vec<&str> = requirements.lines().filter(|l| !l.starts_with('#')).collect();
        assert!(pins.iter().any(|l| l.starts_with("fastmcp==")), "{requirements}");
        for pin in &pins {
            let (spec, hash) = pin.split_once(" --hash=sha256:").expect(pin);
            assert!(spec.contains("=="), "{pin}");
            assert_eq!(hash.len(), 64, "{pin}");
        }
    }

    #[test]
    fn existing_layer_ids_are_unchanged() {
        // Layers already built on edges keep their names (the ids before recipes had
        // files and parents). `base` changed on purpose (version 2: python, pip, sudo,
        // node, npm): edges build it anew once, beside the old `base-2e93d6b548f8b8b0`.
        assert_eq!(build::layer_ids("base").unwrap(), ["base-57d8053fdb7d4f18"]);
        assert_eq!(build::layer_ids("busybox").unwrap(), ["busybox-ae34b4981a7c75f2"]);
    }

    #[test]
    fn the_layer_id_hashes_the_server_the_packages_and_the_layers_below() {
        let recipe = build::recipe("code-interpreter-v1").unwrap();
        let base = build::layer_ids("base").unwrap();
        let id = recipe.layer_id(&base);
        assert_eq!(id, recipe.layer_id(&base), "deterministic");
        assert_ne!(id, recipe.layer_id(&["base-0000000000000000".into()]));

        static CHANGED: &[build::LayerFile] = &[build::LayerFile {
            path: CODE_INTERPRETER_SERVER_PATH,
            contents: b"print('a different server')\n",
            mode: 0o644,
        }];
        let changed_server = build::Recipe {
            files: CHANGED,
            ..build::recipe("code-interpreter-v1").unwrap()
        };
        assert_ne!(id, changed_server.layer_id(&base));
        let changed_packages = build::Recipe {
            inputs: "python3-numpy,python3-pandas".into(),
            ..build::recipe("code-interpreter-v1").unwrap()
        };
        assert_ne!(id, changed_packages.layer_id(&base));
        assert_eq!(
            build::CODE_INTERPRETER_SERVER,
            include_bytes!("../../images/code-interpreter/server.py")
        );
    }

    #[test]
    fn ensure_returns_a_stored_pulled_image_by_its_reference() {
        // Warm containers of an image created by its reference are made through `ensure`.
        let tmp = tempfile::tempdir().unwrap();
        let store = ImageStore::open(tmp.path()).unwrap();
        fs::create_dir_all(store.layer_path("sha256-00")).unwrap();
        let pulled = Image {
            name: "127.0.0.1:5000/bench/base:500m".into(),
            layers: vec!["sha256-00".into()],
            ..Image::default()
        };
        store.put(&pulled).unwrap();
        let got = store.ensure("127.0.0.1:5000/bench/base:500m", &|_| {}).unwrap();
        assert_eq!(got.layers, pulled.layers);
        assert!(matches!(
            store.ensure("127.0.0.1:5000/not/here:1", &|_| {}),
            Err(ImageError::UnknownImage(_))
        ));
    }

    #[test]
    fn a_layer_listed_twice_is_stacked_once_at_its_upper_place() {
        let tmp = tempfile::tempdir().unwrap();
        let store = ImageStore::open(tmp.path()).unwrap();
        for id in ["a", "b"] {
            fs::create_dir_all(store.layer_path(id)).unwrap();
        }
        let image = Image {
            name: "twice".into(),
            layers: vec!["a".into(), "b".into(), "a".into()],
            ..Image::default()
        };
        assert_eq!(
            store.layer_dirs(&image).unwrap(),
            vec![store.layer_path("b"), store.layer_path("a")]
        );
        assert_eq!(image.file_stem(), "twice");
        let pulled = Image {
            name: "127.0.0.1:5000/python:3.12-slim".into(),
            ..Image::default()
        };
        assert_eq!(pulled.file_stem(), "127.0.0.1_5000_python_3.12-slim");
    }

    #[test]
    fn e2b_template_references_resolve_to_store_names() {
        for (reference, name) in [
            ("base", "base"),
            ("base:latest", "base"),
            ("code-interpreter-v1", "code-interpreter-v1"),
            ("code-interpreter-v1:default", "code-interpreter-v1"),
            ("code-interpreter", "code-interpreter-v1"),
            ("busybox", "busybox"),
            ("other:v2", "other:v2"),
        ] {
            assert_eq!(canonical_name(reference), name, "{reference}");
        }
        let tmp = tempfile::tempdir().unwrap();
        let store = ImageStore::open(tmp.path()).unwrap();
        assert!(matches!(
            store.get("code-interpreter"),
            Err(ImageError::NotFound(n)) if n == "code-interpreter-v1"
        ));
        assert!(matches!(store.get("other:v2"), Err(ImageError::NotFound(_))));
        assert!(matches!(store.get("../x"), Err(ImageError::InvalidName(_))));
    }

    #[test]
    fn a_record_that_no_longer_matches_its_recipe_is_not_returned_as_is() {
        // A stored busybox record naming an old layer: ensure must not hand it out.
        let tmp = tempfile::tempdir().unwrap();
        let store = ImageStore::open(tmp.path()).unwrap();
        fs::create_dir_all(store.layer_path("busybox-old")).unwrap();
        let stale = Image {
            name: "busybox".into(),
            layers: vec!["busybox-old".into()],
            config: build::recipe("busybox").unwrap().config(),
            ..Image::default()
        };
        store.put(&stale).unwrap();
        let current = build::layer_ids("busybox").unwrap();
        fs::create_dir_all(store.layer_path(&current[0])).unwrap();
        let image = store
            .ensure("busybox", &|p| {
                assert_ne!(p.phase, BuildPhase::Download, "the layer exists: {p:?}")
            })
            .unwrap();
        assert_eq!(image.layers, current);
        assert_eq!(store.get("busybox").unwrap(), image);
    }
}
