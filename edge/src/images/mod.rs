//! The local image store: layers are complete, read-only directory trees and an image is
//! an ordered list of layers (bottom first) plus a small run config. The container
//! backend stacks the layers with overlayfs, so nothing is copied per sandbox; OCI
//! import can later add layers (one per OCI diff) without changing this layout.
//!
//! Layout under the store root:
//! - `layers/<id>/`: one finished tree; only ever created by an atomic rename.
//! - `images/<name>.json`: [`Image`].
//! - `tmp/`: layers under construction (removed on failure).
//! - `locks/<name>.lock`: serialises builds of one image across processes.

mod build;

use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use build::{BuildPhase, BuildProgress, builder_names};

/// Default location of the store on an edge machine.
pub const DEFAULT_STORE: &str = "/var/lib/opendsec/images";

/// An image: layers bottom first, and how to run a process in it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Image {
    pub name: String,
    /// Layer ids, bottom (base) layer first.
    pub layers: Vec<String>,
    pub config: ImageConfig,
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
    /// The template's start command, run by the agent when the sandbox boots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<StartSpec>,
}

/// A template's start command (the agent's `--start-file` format). The sandbox is ready
/// once `ready_port` accepts connections.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartSpec {
    pub cmd: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub envs: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: String,
    #[serde(default)]
    pub user: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_port: Option<u16>,
}

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
    Corrupt {
        path: PathBuf,
        source: serde_json::Error,
    },
}

pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> ImageError {
    let context = context.into();
    move |source| ImageError::Io { context, source }
}

/// A store rooted at one directory; cheap to clone, safe to share between processes.
#[derive(Clone, Debug)]
pub struct ImageStore {
    root: PathBuf,
}

impl ImageStore {
    /// Opens (creating if needed) the store at `root`.
    pub fn open(root: impl AsRef<Path>) -> Result<Self, ImageError> {
        let root = root.as_ref().to_path_buf();
        for sub in ["layers", "images", "tmp", "locks"] {
            let dir = root.join(sub);
            fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        }
        Ok(Self { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Directory of a layer (whether or not it exists).
    pub fn layer_path(&self, id: &str) -> PathBuf {
        self.root.join("layers").join(id)
    }

    /// The image's layer directories, bottom first; fails if one is missing.
    pub fn layer_dirs(&self, image: &Image) -> Result<Vec<PathBuf>, ImageError> {
        image
            .layers
            .iter()
            .map(|id| {
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

    fn record_path(&self, name: &str) -> PathBuf {
        self.root.join("images").join(format!("{name}.json"))
    }

    /// The stored image `name` (all its layers present).
    pub fn get(&self, name: &str) -> Result<Image, ImageError> {
        validate_name(name)?;
        let path = self.record_path(name);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(ImageError::NotFound(name.to_string()));
            }
            Err(e) => return Err(io_err(format!("reading {}", path.display()))(e)),
        };
        let image: Image = serde_json::from_slice(&bytes)
            .map_err(|source| ImageError::Corrupt { path, source })?;
        self.layer_dirs(&image)?;
        Ok(image)
    }

    /// All stored images, sorted by name.
    pub fn list(&self) -> Result<Vec<Image>, ImageError> {
        let dir = self.root.join("images");
        let mut out = Vec::new();
        for entry in fs::read_dir(&dir).map_err(io_err(format!("listing {}", dir.display())))? {
            let entry = entry.map_err(io_err("listing images"))?;
            let file = entry.file_name().to_string_lossy().into_owned();
            if let Some(name) = file.strip_suffix(".json") {
                match self.get(name) {
                    Ok(image) => out.push(image),
                    // A record whose layer vanished is not usable: leave it out of the list.
                    Err(ImageError::MissingLayer { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Returns image `name`, building it first if it is not stored yet. Concurrent
    /// callers (threads or processes) build it once: the others wait on the lock file
    /// and then find it stored.
    pub fn ensure(
        &self,
        name: &str,
        progress: &dyn Fn(&BuildProgress),
    ) -> Result<Image, ImageError> {
        validate_name(name)?;
        match self.get(name) {
            Ok(image) => return Ok(image),
            Err(ImageError::NotFound(_) | ImageError::MissingLayer { .. }) => {}
            Err(e) => return Err(e),
        }
        let recipe = build::recipe(name).ok_or_else(|| ImageError::UnknownImage(name.into()))?;
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
        if let Ok(image) = self.get(name) {
            progress(&BuildProgress::new(
                BuildPhase::Done,
                "built by another process",
            ));
            return Ok(image);
        }
        let layer_id = recipe.layer_id();
        if !self.layer_path(&layer_id).is_dir() {
            let tmp = self
                .root
                .join("tmp")
                .join(format!("{layer_id}.{}", std::process::id()));
            let _ = remove_tree(&tmp);
            let result = build::build_layer(name, &tmp, progress).and_then(|()| {
                fs::rename(&tmp, self.layer_path(&layer_id))
                    .map_err(io_err(format!("publishing layer {layer_id}")))
            });
            if let Err(e) = result {
                let _ = remove_tree(&tmp);
                return Err(e);
            }
        }
        let image = Image {
            name: name.to_string(),
            layers: vec![layer_id],
            config: recipe.config(),
        };
        self.put(&image)?;
        progress(&BuildProgress::new(
            BuildPhase::Done,
            format!("image {name} ready"),
        ));
        Ok(image)
    }

    /// Writes an image record atomically.
    pub fn put(&self, image: &Image) -> Result<(), ImageError> {
        validate_name(&image.name)?;
        self.layer_dirs(image)?;
        let path = self.record_path(&image.name);
        let tmp = path.with_extension(format!("json.tmp{}", std::process::id()));
        let json = serde_json::to_vec_pretty(image).expect("image serialises");
        fs::write(&tmp, json).map_err(io_err(format!("writing {}", tmp.display())))?;
        fs::rename(&tmp, &path).map_err(io_err(format!("writing {}", path.display())))
    }
}

fn validate_name(name: &str) -> Result<(), ImageError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(ImageError::InvalidName(name.to_string()))
    }
}

/// Removes a tree that may hold read-only directories.
pub(crate) fn remove_tree(path: &Path) -> io::Result<()> {
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}
