//! Importing an image from a tarball ([`ImageStore::import`]): a docker-archive (`docker
//! save`, `skopeo copy … docker-archive:`: `manifest.json`, a config JSON, one tar per
//! layer) or an OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/…`), either
//! of them gzipped or not. Verified as a pull is (digests of every blob the format
//! names, sizes, each layer's diff_id) and installed the same way (`layers.rs`).
//!
//! The tarball is read in place: its members are indexed once (offset and size), then
//! read by offset; a gzipped tarball is first uncompressed into `tmp/`.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use super::layers::{ImagePlan, LayerPlan, PullProgress, TmpPath};
use super::oci::{self, Manifest};
use super::{Image, ImageError, ImageStore, io_err, unpack};

/// Members a tarball may have (an image of 128 layers has a few hundred).
const MAX_MEMBERS: usize = 100_000;

/// A member of the tarball: a file at an offset, or a symlink to another member (older
/// `docker save` links a layer it holds twice).
enum Member {
    File { offset: u64, size: u64 },
    Link(String),
}

struct Tarball {
    file: File,
    members: HashMap<String, Member>,
    /// For errors.
    image: String,
}

impl ImageStore {
    /// Imports the image in `tarball` (a docker-archive or an OCI-layout tarball, see
    /// `import.rs`) under `name`, a store name or a registry reference. The tarball must
    /// hold one image (an OCI index of several platforms counts as one: linux/amd64 is
    /// taken). Blocking.
    pub fn import(&self, tarball: &Path, name: &str, progress: &dyn Fn(&PullProgress)) -> Result<Image, ImageError> {
        let (name, _) = oci::record_file(name)?;
        progress(&PullProgress {
            current: format!("reading {}", tarball.display()),
            ..PullProgress::default()
        });
        let mut file = File::open(tarball).map_err(io_err(format!("opening {}", tarball.display())))?;
        let mut magic = [0u8; 2];
        let gzipped = file.read_exact_at(&mut magic, 0).is_ok() && magic == [0x1f, 0x8b];
        // Kept until the import ends: the uncompressed copy is read by offset.
        let _uncompressed = if gzipped {
            let tmp = TmpPath::new(self, "import");
            let mut out = File::create_new(tmp.path()).map_err(io_err(format!("creating {}", tmp.path().display())))?;
            let limit = unpack::MAX_IMAGE_BYTES + (1 << 30);
            let n = io::copy(
                &mut flate2::read::MultiGzDecoder::new(io::BufReader::new(&file)).take(limit + 1),
                &mut out,
            )
            .map_err(io_err(format!("uncompressing {}", tarball.display())))?;
            if n > limit {
                return Err(bad(
                    &name,
                    format!("the tarball uncompresses to more than {limit} bytes"),
                ));
            }
            file = File::open(tmp.path()).map_err(io_err(format!("opening {}", tmp.path().display())))?;
            Some(tmp)
        } else {
            None
        };
        let tarball = Tarball::index(file, &name)?;
        let (plan, paths) = if tarball.has("oci-layout") && tarball.has("index.json") {
            tarball.oci_layout_plan(&name)?
        } else if tarball.has("manifest.json") {
            tarball.docker_archive_plan(&name)?
        } else {
            return Err(bad(
                &name,
                "the tarball is neither an OCI layout (oci-layout, index.json) nor a docker-archive (manifest.json)",
            ));
        };
        let mut fetch = |layer: &LayerPlan, out: &mut File, report: &dyn Fn(u64)| {
            let member = tarball.member(&paths[&layer.blob])?;
            tarball.copy_verified(&member, layer, out, report)
        };
        self.install(plan, &mut fetch, progress)
    }
}

fn bad(image: &str, reason: impl Into<String>) -> ImageError {
    ImageError::BadImage {
        image: image.to_string(),
        reason: reason.into(),
    }
}

/// A member name as a path in the tarball: `./` and empty components dropped, `..`
/// taken back (names are only looked up, never written).
fn member_name(raw: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in raw.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    parts.join("/")
}

impl Tarball {
    fn index(file: File, image: &str) -> Result<Self, ImageError> {
        let mut members = HashMap::new();
        {
            let mut archive = tar::Archive::new(&file);
            let malformed = |e: io::Error| bad(image, format!("the tarball is malformed: {e}"));
            for entry in archive.entries_with_seek().map_err(malformed)? {
                let entry = entry.map_err(malformed)?;
                if members.len() >= MAX_MEMBERS {
                    return Err(bad(image, format!("the tarball has more than {MAX_MEMBERS} members")));
                }
                let name = member_name(&String::from_utf8_lossy(&entry.path_bytes()));
                let kind = entry.header().entry_type();
                if kind.is_file() || kind == tar::EntryType::Continuous {
                    let member = Member::File {
                        offset: entry.raw_file_position(),
                        size: entry.size(),
                    };
                    members.insert(name, member);
                } else if kind.is_symlink() || kind.is_hard_link() {
                    let Some(target) = entry.link_name_bytes() else {
                        continue;
                    };
                    let target = String::from_utf8_lossy(&target).into_owned();
                    // A symlink is relative to its directory; a hard link to the root.
                    let target = match (kind.is_symlink(), name.rsplit_once('/')) {
                        (true, Some((dir, _))) => member_name(&format!("{dir}/{target}")),
                        _ => member_name(&target),
                    };
                    members.insert(name, Member::Link(target));
                }
            }
        }
        Ok(Self {
            file,
            members,
            image: image.to_string(),
        })
    }

    fn has(&self, name: &str) -> bool {
        self.members.contains_key(name)
    }

    /// Offset and size of member `name`, links followed.
    fn member(&self, name: &str) -> Result<(u64, u64), ImageError> {
        let mut name = member_name(name);
        for _ in 0..8 {
            match self.members.get(&name) {
                Some(Member::File { offset, size }) => return Ok((*offset, *size)),
                Some(Member::Link(target)) => name = target.clone(),
                None => break,
            }
        }
        Err(bad(&self.image, format!("the tarball has no file {name}")))
    }

    /// Member `name` whole, if it has at most `limit` bytes.
    fn read(&self, name: &str, limit: u64) -> Result<Vec<u8>, ImageError> {
        let (offset, size) = self.member(name)?;
        if size > limit {
            return Err(bad(
                &self.image,
                format!("{name} has {size} bytes, over the limit of {limit}"),
            ));
        }
        let mut bytes = vec![0u8; size as usize];
        self.file
            .read_exact_at(&mut bytes, offset)
            .map_err(io_err(format!("reading {name} from the tarball")))?;
        Ok(bytes)
    }

    /// Blob `digest`, checked against it and its descriptor's size.
    fn read_blob(&self, what: &str, digest: &str, size: u64, limit: u64) -> Result<Vec<u8>, ImageError> {
        let hex = oci::sha256_hex(&self.image, what, digest)?;
        let bytes = self.read(&format!("blobs/sha256/{hex}"), limit)?;
        if bytes.len() as u64 != size {
            return Err(bad(
                &self.image,
                format!(
                    "{what} {digest} has {} bytes, not the {size} its descriptor says",
                    bytes.len()
                ),
            ));
        }
        oci::verify_digest(format!("{what} {digest}"), digest, &bytes)?;
        Ok(bytes)
    }

    /// Copies a layer's member into `out`, failing unless it has the plan's size and digest.
    fn copy_verified(
        &self,
        (offset, size): &(u64, u64),
        layer: &LayerPlan,
        out: &mut File,
        report: &dyn Fn(u64),
    ) -> Result<(), ImageError> {
        if *size != layer.size {
            return Err(bad(
                &self.image,
                format!(
                    "layer {} has {size} bytes, not the {} its manifest says",
                    layer.blob, layer.size
                ),
            ));
        }
        let mut hash = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut done = 0u64;
        while done < *size {
            let want = buf.len().min((*size - done) as usize);
            self.file
                .read_exact_at(&mut buf[..want], offset + done)
                .map_err(io_err(format!("reading layer {} from the tarball", layer.blob)))?;
            hash.update(&buf[..want]);
            out.write_all(&buf[..want])
                .map_err(io_err(format!("writing layer {}", layer.blob)))?;
            done += want as u64;
            report(want as u64);
        }
        let actual = format!("sha256:{}", hex::encode(hash.finalize()));
        if actual != layer.blob {
            return Err(ImageError::DigestMismatch {
                what: format!("layer {} of the tarball", layer.blob),
                expected: layer.blob.clone(),
                actual,
            });
        }
        Ok(())
    }

    /// An OCI image layout: `index.json` names one image (or one index, of which the
    /// linux/amd64 image is taken). Also returns where each layer blob is.
    fn oci_layout_plan(&self, name: &str) -> Result<(ImagePlan, BlobPaths), ImageError> {
        let index = match oci::parse_manifest(name, &self.read("index.json", oci::MAX_MANIFEST_BYTES)?)? {
            Manifest::Index(index) => index,
            Manifest::Image(_) => return Err(bad(name, "index.json is not an index")),
        };
        let mut chosen = match index.manifests().as_slice() {
            [one] => one.clone(),
            [] => return Err(bad(name, "index.json names no image")),
            _ => oci::select_platform(name, &index)?.clone(),
        };
        for _ in 0..2 {
            let digest = chosen.digest().to_string();
            let bytes = self.read_blob("manifest", &digest, chosen.size(), oci::MAX_MANIFEST_BYTES)?;
            match oci::parse_manifest(name, &bytes)? {
                Manifest::Image(manifest) => {
                    oci::check_manifest(name, &manifest)?;
                    let config = manifest.config();
                    let config_bytes =
                        self.read_blob("config", config.digest().as_ref(), config.size(), oci::MAX_CONFIG_BYTES)?;
                    let blobs: Vec<(String, u64)> = manifest
                        .layers()
                        .iter()
                        .map(|l| (l.digest().to_string(), l.size()))
                        .collect();
                    let (config, layers) = oci::plan_image(name, &config_bytes, &blobs)?;
                    let mut paths = BlobPaths::new();
                    for layer in &layers {
                        let hex = oci::sha256_hex(name, "a layer", &layer.blob)?;
                        paths.insert(layer.blob.clone(), format!("blobs/sha256/{hex}"));
                    }
                    let plan = ImagePlan {
                        name: name.to_string(),
                        reference: None,
                        digest: Some(digest),
                        config,
                        layers,
                    };
                    return Ok((plan, paths));
                }
                Manifest::Index(inner) => chosen = oci::select_platform(name, &inner)?.clone(),
            }
        }
        Err(bad(name, "its indexes nest more than two deep"))
    }

    /// A docker-archive: `manifest.json` lists one image's config and layer tars. The
    /// layer tars are uncompressed, so a layer's blob digest is its diff_id (unless the
    /// member is named by its digest, `blobs/sha256/<hex>`, as newer Docker writes).
    fn docker_archive_plan(&self, name: &str) -> Result<(ImagePlan, BlobPaths), ImageError> {
        #[derive(Deserialize)]
        #[serde(rename_all = "PascalCase")]
        struct Entry {
            config: String,
            layers: Vec<String>,
        }
        #[derive(Deserialize)]
        struct DiffIds {
            rootfs: RootFs,
        }
        #[derive(Deserialize)]
        struct RootFs {
            diff_ids: Vec<String>,
        }
        let manifest = self.read("manifest.json", oci::MAX_MANIFEST_BYTES)?;
        let entries: Vec<Entry> =
            serde_json::from_slice(&manifest).map_err(|e| bad(name, format!("malformed manifest.json: {e}")))?;
        let [entry] = entries.as_slice() else {
            return Err(bad(
                name,
                format!("the archive holds {} images; import takes one", entries.len()),
            ));
        };
        if entry.layers.len() > oci::MAX_LAYERS {
            return Err(bad(
                name,
                format!(
                    "it has {} layers, over the limit of {}",
                    entry.layers.len(),
                    oci::MAX_LAYERS
                ),
            ));
        }
        let config_bytes = self.read(&entry.config, oci::MAX_CONFIG_BYTES)?;
        // The config's name is its digest (`<hex>.json`, or `blobs/sha256/<hex>`).
        let config_name = member_name(&entry.config);
        let named_hex = config_name
            .strip_prefix("blobs/sha256/")
            .or_else(|| config_name.strip_suffix(".json"));
        if let Some(hex) = named_hex.filter(|h| h.len() == 64) {
            oci::verify_digest(format!("config {config_name}"), &format!("sha256:{hex}"), &config_bytes)?;
        }
        let diff_ids: DiffIds =
            serde_json::from_slice(&config_bytes).map_err(|e| bad(name, format!("malformed image config: {e}")))?;
        if diff_ids.rootfs.diff_ids.len() != entry.layers.len() {
            return Err(bad(
                name,
                format!(
                    "its config lists {} layer diff_ids for {} layers",
                    diff_ids.rootfs.diff_ids.len(),
                    entry.layers.len()
                ),
            ));
        }
        let mut blobs = Vec::with_capacity(entry.layers.len());
        let mut paths = BlobPaths::new();
        for (path, diff_id) in entry.layers.iter().zip(&diff_ids.rootfs.diff_ids) {
            let path = member_name(path);
            let (_, size) = self.member(&path)?;
            let digest = match path.strip_prefix("blobs/sha256/") {
                Some(hex) => format!("sha256:{hex}"),
                None => diff_id.clone(),
            };
            blobs.push((digest.clone(), size));
            paths.insert(digest, path);
        }
        let (config, layers) = oci::plan_image(name, &config_bytes, &blobs)?;
        // A docker-archive has no manifest: the image is named by its config's digest
        // (what Docker calls the image id).
        let config_digest = format!("sha256:{}", hex::encode(Sha256::digest(&config_bytes)));
        let plan = ImagePlan {
            name: name.to_string(),
            reference: None,
            digest: Some(config_digest),
            config,
            layers,
        };
        Ok((plan, paths))
    }
}

/// Where each layer blob (by digest) is in the tarball.
type BlobPaths = HashMap<String, String>;
