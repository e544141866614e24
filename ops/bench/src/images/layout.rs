//! The benchmark's ~500 MB image, made without any network: the project's own `base`
//! image from the store, each of its layer directories tarred as it is on disk (numeric
//! owners, modes, mtimes, xattrs but `trusted.*`, hard links; device nodes and sockets
//! left out, as an OCI image has none: debootstrap leaves `/dev/null` and the like in
//! the layer, which a registry image never carries and the store's unpacker refuses),
//! gzipped, and written as an OCI image layout by hand (`index.json`, manifest, config
//! with the diff_ids). The tar is deterministic (sorted names, no atime/ctime), so the
//! same `base` gives the same digests on every run.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use opendsec_edge::images::ImageConfig;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";

/// Lists a layer's entries (no `.` and no `./` prefix, devices and sockets pruned,
/// sorted bytewise) and tars them to stdout without recursing; `$1` is the layer dir.
const TAR_SCRIPT: &str = r#"cd "$1" && find . -xdev -mindepth 1 \( -type c -o -type b -o -type s \) -prune -o -printf '%P\0' \
  | LC_ALL=C sort -z \
  | tar --create --file=- --null --no-recursion --files-from=- --numeric-owner --format=posix \
      --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
      --xattrs --xattrs-include='*' --xattrs-exclude='trusted.*'"#;

/// One layer as written.
#[derive(Clone, Debug, serde::Serialize)]
pub(super) struct LayerBlob {
    /// The gzipped blob's digest and size.
    pub(super) blob: String,
    pub(super) size: u64,
    /// The uncompressed tar's digest (the config's diff_id) and size.
    pub(super) diff_id: String,
    pub(super) tar_bytes: u64,
}

/// The image as written into the layout.
#[derive(Clone, Debug, serde::Serialize)]
pub(super) struct Made {
    pub(super) manifest: String,
    pub(super) layers: Vec<LayerBlob>,
}

impl Made {
    pub(super) fn compressed_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.size).sum()
    }

    pub(super) fn tar_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.tar_bytes).sum()
    }
}

/// A writer that hashes and counts what passes through it.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
    bytes: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn digest_of(hash: Sha256) -> String {
    format!("sha256:{}", hex::encode(hash.finalize()))
}

fn blobs_dir(layout: &Path) -> PathBuf {
    layout.join("blobs").join("sha256")
}

fn put_blob(layout: &Path, bytes: &[u8]) -> Result<(String, u64), String> {
    let digest = format!("sha256:{}", hex::encode(Sha256::digest(bytes)));
    let path = blobs_dir(layout).join(&digest[7..]);
    std::fs::write(&path, bytes).map_err(|e| format!("write {path:?}: {e}"))?;
    Ok((digest, bytes.len() as u64))
}

/// Tars and gzips `layer` into the layout's blobs.
fn write_layer(layer: &Path, layout: &Path) -> Result<LayerBlob, String> {
    let staging = blobs_dir(layout).join(".layer.tmp");
    let file = File::create(&staging).map_err(|e| format!("create {staging:?}: {e}"))?;
    let mut gz = flate2::write::GzEncoder::new(
        Hashing {
            inner: BufWriter::with_capacity(1 << 20, file),
            hash: Sha256::new(),
            bytes: 0,
        },
        flate2::Compression::default(),
    );
    let mut child = Command::new("sh")
        .args(["-c", TAR_SCRIPT, "sh"])
        .arg(layer)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawn find | sort | tar: {e}"))?;
    let mut stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    // stderr is read beside, so that a chatty tar cannot block on a full pipe.
    let errors = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let (mut diff, mut tar_bytes) = (Sha256::new(), 0u64);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = stdout.read(&mut buf).map_err(|e| format!("reading tar: {e}"))?;
        if n == 0 {
            break;
        }
        diff.update(&buf[..n]);
        tar_bytes += n as u64;
        gz.write_all(&buf[..n]).map_err(|e| format!("write {staging:?}: {e}"))?;
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    let errors = errors.join().unwrap_or_default();
    if !status.success() {
        return Err(format!("tar of {}: {status}: {}", layer.display(), errors.trim()));
    }
    let mut out = gz.finish().map_err(|e| format!("gzip: {e}"))?;
    out.flush().map_err(|e| format!("write {staging:?}: {e}"))?;
    let (blob, size) = (digest_of(out.hash), out.bytes);
    std::fs::rename(&staging, blobs_dir(layout).join(&blob[7..])).map_err(|e| e.to_string())?;
    Ok(LayerBlob {
        blob,
        size,
        diff_id: digest_of(diff),
        tar_bytes,
    })
}

/// Writes an OCI image layout at `layout` (emptied first) whose tag `tag` is an image of
/// `layers` (bottom first) run as `config` says.
pub(super) fn write(layers: &[PathBuf], config: &ImageConfig, layout: &Path, tag: &str) -> Result<Made, String> {
    let _ = std::fs::remove_dir_all(layout);
    std::fs::create_dir_all(blobs_dir(layout)).map_err(|e| format!("create {layout:?}: {e}"))?;
    let mut written = Vec::new();
    for l in layers {
        written.push(write_layer(l, layout)?);
    }
    let mut run = json!({"Env": config.env, "WorkingDir": config.workdir, "User": config.user});
    if !config.shell.is_empty() {
        run["Cmd"] = json!([config.shell]);
    }
    let image_config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": run,
        "rootfs": {"type": "layers", "diff_ids": written.iter().map(|l| l.diff_id.clone()).collect::<Vec<_>>()},
        "history": layers.iter().map(|l| json!({
            "created_by": format!("opendsec-bench: layer {} of the store's base image", l.file_name().unwrap_or_default().to_string_lossy()),
        })).collect::<Vec<_>>(),
    });
    let (config_digest, config_size) = put_blob(layout, &serde_json::to_vec(&image_config).unwrap())?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": config_digest, "size": config_size},
        "layers": written.iter().map(|l| json!({"mediaType": LAYER_MEDIA_TYPE, "digest": l.blob, "size": l.size})).collect::<Vec<Value>>(),
    });
    let (manifest_digest, manifest_size) = put_blob(layout, &serde_json::to_vec(&manifest).unwrap())?;
    let index = json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": MANIFEST_MEDIA_TYPE,
            "digest": manifest_digest,
            "size": manifest_size,
            "annotations": {"org.opencontainers.image.ref.name": tag},
        }],
    });
    std::fs::write(layout.join("index.json"), serde_json::to_vec(&index).unwrap()).map_err(|e| e.to_string())?;
    std::fs::write(layout.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).map_err(|e| e.to_string())?;
    Ok(Made {
        manifest: manifest_digest,
        layers: written,
    })
}
