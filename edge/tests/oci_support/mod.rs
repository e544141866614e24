//! What the OCI image suites share: the prerequisites, a `docker-registry` on loopback
//! seeded with `skopeo`, OCI layouts written by hand from tar layers built entry by
//! entry, and ways to watch a store (its steps, its directories, its overlay).
#![allow(dead_code)] // not every suite uses every part

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use opendsec_edge::images::{Image, ImageError, ImageStore, PullOptions, PullProgress};
use serde_json::json;
use sha2::{Digest, Sha256};

// ---- prerequisites -------------------------------------------------------------------

pub fn require(what: &str) {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "the OCI image tests need root ({what}: layer owners, whiteout devices)"
    );
    for (bin, package) in [
        ("docker-registry", "docker-registry"),
        ("skopeo", "skopeo"),
        ("htpasswd", "apache2-utils"),
        ("unshare", "util-linux"),
    ] {
        let found = ["/usr/bin", "/bin", "/usr/sbin"]
            .iter()
            .any(|d| Path::new(d).join(bin).is_file());
        assert!(
            found,
            "{bin} is missing: install the {package} package (ops/lib.sh IMAGE_TEST_PACKAGES)"
        );
    }
}

// ---- a registry on loopback ----------------------------------------------------------

/// A `docker-registry` on 127.0.0.1, killed when dropped.
pub struct Registry {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
    creds: Option<(String, String)>,
}

impl Registry {
    pub fn start() -> Self {
        Self::start_with(None)
    }

    pub fn start_with_auth(user: &str, password: &str) -> Self {
        Self::start_with(Some((user.to_string(), password.to_string())))
    }

    pub fn start_with(creds: Option<(String, String)>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let mut config = format!(
            "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
            dir.path().join("data").display()
        );
        if let Some((user, password)) = &creds {
            let out = Command::new("htpasswd")
                .args(["-Bbn", user, password])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "htpasswd: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let file = dir.path().join("htpasswd");
            std::fs::write(&file, &out.stdout).unwrap();
            config.push_str(&format!(
                "auth:\n  htpasswd:\n    realm: opendsec-test\n    path: {}\n",
                file.display()
            ));
        }
        let config_path = dir.path().join("config.yml");
        std::fs::write(&config_path, config).unwrap();
        let log = std::fs::File::create(dir.path().join("registry.log")).unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config_path)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting docker-registry (the docker-registry package)");
        let registry = Self {
            child,
            port,
            dir,
            creds,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "docker-registry did not listen on {port}: {}",
                registry.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        registry
    }

    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("registry.log")).unwrap_or_default()
    }

    /// Pushes the OCI layout `layout` (tag `v1`) as `<repo>:<tag>`; returns the reference.
    pub fn push(&self, layout: &Path, repo: &str, tag: &str) -> String {
        let reference = format!("{}/{repo}:{tag}", self.host());
        let mut command = Command::new("skopeo");
        // --all: an index is copied with every image it names.
        command.args([
            "copy",
            "--all",
            "--quiet",
            "--insecure-policy",
            "--dest-tls-verify=false",
        ]);
        if let Some((user, password)) = &self.creds {
            command.arg(format!("--dest-creds={user}:{password}"));
        }
        let out = command
            .arg(format!("oci:{}:v1", layout.display()))
            .arg(format!("docker://{reference}"))
            .output()
            .expect("running skopeo (the skopeo package)");
        assert!(
            out.status.success(),
            "skopeo copy to {reference}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
        reference
    }

    /// The file holding blob `digest` on the registry's disk.
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap();
        self.dir
            .path()
            .join("data/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

// ---- images written by hand ----------------------------------------------------------

/// An uncompressed layer tar, written entry by entry (raw names: hostile ones included).
pub struct LayerTar(tar::Builder<Vec<u8>>);

impl LayerTar {
    pub fn new() -> Self {
        Self(tar::Builder::new(Vec::new()))
    }

    pub fn entry(mut self, kind: tar::EntryType, path: &str, link: &str, data: &[u8], mode: u32) -> Self {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_size(data.len() as u64);
        header.set_mode(mode);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(1_700_000_000);
        header.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
        header.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        header.set_cksum();
        self.0.append(&header, data).unwrap();
        self
    }

    pub fn file(self, path: &str, data: &[u8]) -> Self {
        self.entry(tar::EntryType::Regular, path, "", data, 0o644)
    }

    pub fn dir(self, path: &str) -> Self {
        self.entry(tar::EntryType::Directory, path, "", b"", 0o755)
    }

    pub fn bytes(self) -> Vec<u8> {
        self.0.into_inner().unwrap()
    }
}

pub fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(bytes).unwrap();
    encoder.finish().unwrap()
}

/// An image to write as an OCI layout: its layers (uncompressed tars, gzipped in the
/// layout) and its config's `config` object.
pub struct TestImage {
    pub layers: Vec<Vec<u8>>,
    pub run: serde_json::Value,
    /// Replaces the config's diff_ids (to make them lie).
    pub diff_ids: Option<Vec<String>>,
}

impl TestImage {
    pub fn new(layers: Vec<Vec<u8>>) -> Self {
        Self {
            layers,
            run: json!({}),
            diff_ids: None,
        }
    }
}

/// What an OCI layout holds, by digest.
pub struct Layout {
    pub dir: tempfile::TempDir,
    pub manifest: String,
    pub config: String,
    /// The compressed layer blobs, bottom first.
    pub blobs: Vec<String>,
    pub diff_ids: Vec<String>,
}

pub fn write_layout(image: &TestImage) -> Layout {
    let dir = tempfile::tempdir().unwrap();
    let (manifest, written) = write_image(dir.path(), image, "amd64");
    let index = json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest.0, "size": manifest.1,
            "annotations": {"org.opencontainers.image.ref.name": "v1"},
        }],
    });
    finish_layout(dir.path(), &index);
    Layout { dir, ..written }
}

/// An OCI layout whose tag `v1` names an index of the images given, by architecture
/// (all linux); the layout returned describes the amd64 one (else the last).
pub fn write_layout_of_index(images: &[(&str, &TestImage)]) -> Layout {
    let dir = tempfile::tempdir().unwrap();
    let mut entries = Vec::new();
    let mut amd64 = None;
    for (arch, image) in images {
        let ((digest, size), written) = write_image(dir.path(), image, arch);
        entries.push(json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": digest, "size": size,
            "platform": {"os": "linux", "architecture": arch},
        }));
        if *arch == "amd64" || amd64.is_none() {
            amd64 = Some(written);
        }
    }
    let inner = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": entries,
    }))
    .unwrap();
    let digest = put_blob(dir.path(), &inner);
    let index = json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "digest": digest, "size": inner.len(),
            "annotations": {"org.opencontainers.image.ref.name": "v1"},
        }],
    });
    finish_layout(dir.path(), &index);
    Layout {
        dir,
        ..amd64.expect("at least one image")
    }
}

fn put_blob(layout: &Path, bytes: &[u8]) -> String {
    let digest = sha256(bytes);
    let blobs = layout.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::write(blobs.join(&digest[7..]), bytes).unwrap();
    digest
}

fn finish_layout(layout: &Path, index: &serde_json::Value) {
    std::fs::write(layout.join("index.json"), serde_json::to_vec(index).unwrap()).unwrap();
    std::fs::write(layout.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
}

/// Writes an image's blobs into a layout; returns its manifest's (digest, size) and
/// what it wrote (with a placeholder `dir`).
fn write_image(layout: &Path, image: &TestImage, arch: &str) -> ((String, usize), Layout) {
    let put = |bytes: &[u8]| (put_blob(layout, bytes), bytes.len());
    let mut descriptors = Vec::new();
    let mut blobs = Vec::new();
    for layer in &image.layers {
        let (digest, size) = put(&gzip(layer));
        descriptors
            .push(json!({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": digest, "size": size}));
        blobs.push(digest);
    }
    let diff_ids: Vec<String> = image.layers.iter().map(|l| sha256(l)).collect();
    let config = json!({
        "architecture": arch,
        "os": "linux",
        "config": image.run,
        "rootfs": {"type": "layers", "diff_ids": image.diff_ids.clone().unwrap_or_else(|| diff_ids.clone())},
    });
    let (config_digest, config_size) = put(&serde_json::to_vec(&config).unwrap());
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config_size},
        "layers": descriptors,
    });
    let manifest = put(&serde_json::to_vec(&manifest).unwrap());
    let written = Layout {
        dir: tempfile::tempdir().unwrap(),
        manifest: manifest.0.clone(),
        config: config_digest,
        blobs,
        diff_ids,
    };
    (manifest, written)
}

/// Pushes a one-layer image to `registry` as `<repo>:v1`.
pub fn push_layer(registry: &Registry, repo: &str, layer: Vec<u8>) -> String {
    let layout = write_layout(&TestImage::new(vec![layer]));
    registry.push(layout.dir.path(), repo, "v1")
}

// ---- watching a store -----------------------------------------------------------------

/// What a pull reported: each distinct step, in order.
#[derive(Default)]
pub struct Steps(pub Mutex<Vec<PullProgress>>);

impl Steps {
    pub fn record(&self, p: &PullProgress) {
        let mut steps = self.0.lock().unwrap();
        if steps.last().is_none_or(|last| last.current != p.current) {
            steps.push(p.clone());
        }
    }

    pub fn count(&self, prefix: &str) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|p| p.current.starts_with(prefix))
            .count()
    }

    pub fn last(&self) -> PullProgress {
        self.0.lock().unwrap().last().cloned().unwrap()
    }
}

/// The names under the store's `layers/`, `images/` and `tmp/`.
pub fn contents(store: &Path) -> BTreeMap<&'static str, Vec<String>> {
    ["layers", "images", "tmp"]
        .into_iter()
        .map(|sub| {
            let mut names: Vec<String> = std::fs::read_dir(store.join(sub))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            (sub, names)
        })
        .collect()
}

pub fn sorted(names: &[String]) -> Vec<String> {
    let mut names = names.to_vec();
    names.sort();
    names
}

pub fn pull(store: &ImageStore, reference: &str) -> Result<Image, ImageError> {
    store.pull(reference, &PullOptions::default(), &|_| {})
}

/// `find` over the overlay of `lowers` (bottom first), mounted read-only in a mount
/// namespace of its own: `path kind` lines, sorted.
pub fn merged_view(lowers: &[PathBuf]) -> String {
    let lowerdir: Vec<String> = lowers.iter().rev().map(|p| p.display().to_string()).collect();
    let mnt = tempfile::tempdir().unwrap();
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(format!(
            "mount -t overlay overlay -o ro,lowerdir={} {} && cd {} && find . -mindepth 1 -printf '%p %y\\n' | sort",
            lowerdir.join(":"),
            mnt.path().display(),
            mnt.path().display()
        ))
        .output()
        .expect("running unshare (the util-linux package)");
    assert!(
        out.status.success(),
        "overlay mount: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}
