//! Pushing a stored image to an OCI registry ([`ImageStore::push`]): a packed or imported
//! image leaves the edge that made it, to be pulled by any edge, Docker or Kubernetes.
//!
//! The store keeps layers unpacked (directories), not the blobs they came from, so each
//! layer is written again as a tar (`pack::write_stored_layer`: deterministic, setuid bits
//! kept as stored) and gzipped; the config is written from the image's run settings (Env,
//! User, WorkingDir, Entrypoint, Cmd, ExposedPorts, labels) with the new diff_ids; the
//! manifest is an OCI image manifest. Blobs the registry has already are not sent again.
//! Credentials and plain-HTTP registries are the pull's (`registry.rs`). Blocking.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use oci_client::Reference;
use oci_client::client::PushBlobStreamChunkedResponse;
use sha2::{Digest as _, Sha256};

use super::layers::PullProgress;
use super::registry::{PullOptions, Remote};
use super::{ImageError, ImageStore, io_err, oci, pack};

/// The media types of what a push writes.
const MANIFEST_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
const CONFIG_TYPE: &str = "application/vnd.oci.image.config.v1+json";
const LAYER_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// What a push wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pushed {
    /// The canonical reference pushed to.
    pub reference: String,
    /// The manifest's digest (`reference@digest` pulls exactly this).
    pub digest: String,
    pub layers: usize,
    /// Bytes of the compressed layers (sent or found there already).
    pub bytes: u64,
}

/// A layer blob ready to send.
struct Blob {
    path: std::path::PathBuf,
    digest: String,
    size: u64,
    diff_id: String,
}

impl ImageStore {
    /// Pushes stored image `name` to `reference` (`host[:port]/repo[:tag]`). Blocking.
    pub fn push(
        &self,
        name: &str,
        reference: &str,
        opts: &PullOptions,
        progress: &dyn Fn(&PullProgress),
    ) -> Result<Pushed, ImageError> {
        let image = self.get(name)?;
        let target = oci::parse_reference(reference)?;
        if target.digest().is_some() {
            return Err(ImageError::InvalidReference {
                reference: reference.to_string(),
                reason: "a push names a tag, not a digest (the registry computes the digest)".into(),
            });
        }
        let whole = target.whole();
        let dirs = self.layer_dirs(&image)?;
        let scratch = self.scratch_dir()?;
        let mut report = PullProgress {
            layers_total: dirs.len(),
            current: format!("writing the layers of {name}"),
            ..PullProgress::default()
        };
        progress(&report);
        let mut blobs = Vec::with_capacity(dirs.len());
        for (i, dir) in dirs.iter().enumerate() {
            let tar = scratch.path().join(format!("{i}.tar"));
            let written = pack::write_stored_layer(dir, &tar)?;
            let gz = scratch.path().join(format!("{i}.tar.gz"));
            let (digest, size) = gzip_file(&tar, &gz)?;
            std::fs::remove_file(&tar).map_err(io_err(format!("removing {}", tar.display())))?;
            report.bytes_total += size;
            report.current = format!("wrote layer {} of {}", i + 1, dirs.len());
            progress(&report);
            blobs.push(Blob {
                path: gz,
                digest,
                size,
                diff_id: written.diff_id,
            });
        }
        let config = config_json(&image.config, &blobs);
        let config_digest = oci::sha256_digest(&config);
        let manifest = manifest_json(&config_digest, config.len() as u64, &blobs);
        let manifest_digest = oci::sha256_digest(&manifest);

        let remote = Remote::new(&target, opts)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(io_err("starting the push's runtime"))?;
        let failed = |e: oci_client::errors::OciDistributionError| push_error(&remote, &whole, e);
        report.current = format!("reaching {}", target.registry());
        progress(&report);
        runtime.block_on(async {
            remote
                .client
                .auth(&target, &remote.auth, oci_client::RegistryOperation::Push)
                .await
                .map_err(failed)?;
            for (i, blob) in blobs.iter().enumerate() {
                report.current = format!("sending layer {} of {}", i + 1, blobs.len());
                progress(&report);
                if !remote.has_blob(&target, &blob.digest).await {
                    send_file(&remote, &target, &blob.path, &blob.digest)
                        .await
                        .map_err(failed)?;
                }
                report.layers_done = i + 1;
                report.bytes_done += blob.size;
                progress(&report);
            }
            if !remote.has_blob(&target, &config_digest).await {
                remote
                    .client
                    .push_blob(&target, config.clone(), &config_digest)
                    .await
                    .map_err(failed)?;
            }
            report.current = format!("writing the manifest of {whole}");
            progress(&report);
            remote
                .client
                .push_manifest_raw(
                    &target,
                    manifest.clone(),
                    MANIFEST_TYPE.parse().expect("a header value"),
                )
                .await
                .map_err(failed)?;
            Ok::<(), ImageError>(())
        })?;
        Ok(Pushed {
            reference: whole,
            digest: manifest_digest,
            layers: blobs.len(),
            bytes: report.bytes_total,
        })
    }
}

/// Gzips `from` into the new file `to`: the gzip's digest and size.
fn gzip_file(from: &Path, to: &Path) -> Result<(String, u64), ImageError> {
    struct Hashing<W> {
        inner: W,
        hash: Sha256,
        size: u64,
    }
    impl<W: Write> Write for Hashing<W> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let n = self.inner.write(buf)?;
            self.hash.update(&buf[..n]);
            self.size += n as u64;
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            self.inner.flush()
        }
    }
    let input = File::open(from).map_err(io_err(format!("opening {}", from.display())))?;
    let output = File::create_new(to).map_err(io_err(format!("creating {}", to.display())))?;
    let mut gz = flate2::write::GzEncoder::new(
        Hashing {
            inner: BufWriter::with_capacity(256 << 10, output),
            hash: Sha256::new(),
            size: 0,
        },
        flate2::Compression::fast(),
    );
    std::io::copy(&mut BufReader::with_capacity(256 << 10, input), &mut gz)
        .map_err(io_err(format!("compressing {}", from.display())))?;
    let mut hashing = gz.finish().map_err(io_err(format!("compressing {}", from.display())))?;
    hashing.flush().map_err(io_err(format!("writing {}", to.display())))?;
    Ok((format!("sha256:{}", hex::encode(hashing.hash.finalize())), hashing.size))
}

/// Streams the file at `path` to the registry as blob `digest`.
async fn send_file(
    remote: &Remote,
    target: &Reference,
    path: &Path,
    digest: &str,
) -> Result<(), oci_client::errors::OciDistributionError> {
    let file =
        File::open(path).map_err(|e| oci_client::errors::OciDistributionError::GenericError(Some(e.to_string())))?;
    let chunks = futures::stream::unfold(Some(file), |file| async move {
        let mut file = file?;
        let mut buf = vec![0u8; 4 << 20];
        match read_full(&mut file, &mut buf) {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok(bytes::Bytes::from(buf)), Some(file)))
            }
            Err(e) => Some((
                Err(oci_client::errors::OciDistributionError::GenericError(Some(
                    e.to_string(),
                ))),
                None,
            )),
        }
    });
    let sent: PushBlobStreamChunkedResponse = remote.client.push_blob_stream_chunked(target, chunks).await?;
    if sent.blob_digest != digest {
        return Err(oci_client::errors::OciDistributionError::GenericError(Some(format!(
            "the layer {} changed while it was sent (sent {})",
            digest, sent.blob_digest
        ))));
    }
    Ok(())
}

/// Reads until `buf` is full or the file ends.
fn read_full(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// A push's failure in the store's terms.
fn push_error(remote: &Remote, reference: &str, e: oci_client::errors::OciDistributionError) -> ImageError {
    match remote.error(e) {
        ImageError::Registry { message, .. } => ImageError::Push {
            reference: reference.to_string(),
            message,
        },
        other => other,
    }
}

/// The image config a push writes: the image's run settings and the new layers' diff_ids.
fn config_json(c: &super::ImageConfig, blobs: &[Blob]) -> Vec<u8> {
    let ports: HashMap<&str, serde_json::Value> = c
        .exposed_ports
        .iter()
        .map(|p| (p.as_str(), serde_json::json!({})))
        .collect();
    let mut run = serde_json::json!({
        "Env": c.env,
        "User": c.user,
        "WorkingDir": c.workdir,
    });
    if !c.entrypoint.is_empty() {
        run["Entrypoint"] = serde_json::json!(c.entrypoint);
    }
    if !c.cmd.is_empty() {
        run["Cmd"] = serde_json::json!(c.cmd);
    }
    if !ports.is_empty() {
        run["ExposedPorts"] = serde_json::json!(ports);
    }
    if !c.labels.is_empty() {
        run["Labels"] = serde_json::json!(c.labels);
    }
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": run,
        "rootfs": {
            "type": "layers",
            "diff_ids": blobs.iter().map(|b| b.diff_id.as_str()).collect::<Vec<_>>(),
        },
    });
    serde_json::to_vec(&config).expect("a config serialises")
}

fn manifest_json(config_digest: &str, config_size: u64, blobs: &[Blob]) -> Vec<u8> {
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": config_digest, "size": config_size},
        "layers": blobs
            .iter()
            .map(|b| serde_json::json!({"mediaType": LAYER_TYPE, "digest": b.digest, "size": b.size}))
            .collect::<Vec<_>>(),
    });
    serde_json::to_vec(&manifest).expect("a manifest serialises")
}
