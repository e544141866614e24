//! Images from registries: the pulls the log asks this edge to make (`ImageRequested`,
//! reported as `ReportImage`), and the image a sandbox names when the store lacks it.
//!
//! A pull runs on a thread of its own beside the loop; its progress is kept here and
//! sent with each heartbeat (soft state: `GET /v1/images/{name}` shows it). Concurrent
//! pulls of one reference share one download (the store's single-flight), whether they
//! come from the log or from creates. Registry settings (plain-HTTP registries the
//! operator names, credentials per registry) are the edge's own: they never enter the log.

use super::{Edge, EdgeError};
use crate::desired::DesiredSandbox;
use crate::images::{Image, ImageStore, PullOptions, PullProgress, RegistryAuth};
use opendsec_commands::ImageResult;
use opendsec_commands::images::{Reference, is_builtin, names_a_registry};
use opendsec_edge_api::pb::ImagePull;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

/// The edge's registry settings.
#[derive(Clone, Debug, Default)]
pub struct RegistrySettings {
    /// `host[:port]` of registries spoken to over plain HTTP although not on loopback.
    pub insecure: Vec<String>,
    /// Credentials per registry host, from a Docker `config.json` (`auths`).
    pub auths: BTreeMap<String, (String, String)>,
}

impl RegistrySettings {
    /// Reads credentials from a Docker client configuration file (what `docker login`
    /// writes): `{"auths": {"<host>": {"auth": base64("user:password")}}}`, or
    /// `username`/`password` fields instead of `auth`.
    pub fn read_auth_file(path: &Path) -> Result<BTreeMap<String, (String, String)>, String> {
        use base64::Engine;
        #[derive(serde::Deserialize)]
        struct File {
            #[serde(default)]
            auths: BTreeMap<String, Entry>,
        }
        #[derive(serde::Deserialize)]
        struct Entry {
            auth: Option<String>,
            username: Option<String>,
            password: Option<String>,
        }
        let text = std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        let file: File = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut out = BTreeMap::new();
        for (host, e) in file.auths {
            let pair = match (e.auth, e.username, e.password) {
                (Some(auth), _, _) => {
                    let raw = base64::engine::general_purpose::STANDARD
                        .decode(auth.trim())
                        .map_err(|_| format!("{}: auths.{host}.auth is not base64", path.display()))?;
                    let raw = String::from_utf8(raw)
                        .map_err(|_| format!("{}: auths.{host}.auth is not UTF-8", path.display()))?;
                    let (u, p) = raw
                        .split_once(':')
                        .ok_or_else(|| format!("{}: auths.{host}.auth is not user:password", path.display()))?;
                    (u.to_string(), p.to_string())
                }
                (None, Some(u), Some(p)) => (u, p),
                _ => {
                    return Err(format!(
                        "{}: auths.{host} has neither auth nor username and password",
                        path.display()
                    ));
                }
            };
            // Docker writes Docker Hub as a URL; the rest as host[:port].
            let host = host
                .trim_start_matches("https://")
                .trim_start_matches("http://")
                .split('/')
                .next()
                .unwrap_or_default()
                .to_string();
            let host = if host == "index.docker.io" {
                "docker.io".to_string()
            } else {
                host
            };
            out.insert(host, pair);
        }
        Ok(out)
    }

    /// What a pull of `reference` is made with.
    pub fn options_for(&self, reference: &str) -> PullOptions {
        let registry = Reference::parse(reference).map(|r| r.registry).unwrap_or_default();
        PullOptions {
            auth: match self.auths.get(&registry) {
                Some((u, p)) => RegistryAuth::Basic {
                    username: u.clone(),
                    password: p.clone(),
                },
                None => RegistryAuth::Anonymous,
            },
            insecure_http_registries: self.insecure.clone(),
        }
    }
}

/// The pulls (and packs, `packs.rs`) under way here, by image name.
#[derive(Default)]
pub(super) struct Pulls {
    active: std::sync::Mutex<BTreeMap<String, ImagePull>>,
    /// Pulls and packs reported lately, with when: not made again until the slice has
    /// had time to show the report (a pack made twice would store a second, different
    /// record under a name the log says is the first).
    reported: std::sync::Mutex<BTreeMap<String, std::time::Instant>>,
}

/// How long a reported pull or pack is not made again while the slice catches up.
const REPORTED_QUIET: std::time::Duration = std::time::Duration::from_secs(30);

impl Pulls {
    /// The pulls and packs under way, or reported within [`REPORTED_QUIET`].
    pub(super) fn names(&self) -> BTreeSet<String> {
        let mut names: BTreeSet<String> = self.active.lock().expect("pulls lock").keys().cloned().collect();
        let mut reported = self.reported.lock().expect("pulls lock");
        reported.retain(|_, at| at.elapsed() < REPORTED_QUIET);
        names.extend(reported.keys().cloned());
        names
    }

    /// Progress of every pull, for the heartbeat.
    pub(super) fn progress(&self) -> Vec<ImagePull> {
        self.active.lock().expect("pulls lock").values().cloned().collect()
    }

    pub(super) fn begin(&self, name: &str) -> bool {
        let mut active = self.active.lock().expect("pulls lock");
        if active.contains_key(name) {
            return false;
        }
        active.insert(
            name.to_string(),
            ImagePull {
                name: name.to_string(),
                phase: "resolving".into(),
                started_ms: opendsec_edge_api::now_ms(),
                ..Default::default()
            },
        );
        true
    }

    pub(super) fn update(&self, name: &str, p: &PullProgress) {
        if let Some(x) = self.active.lock().expect("pulls lock").get_mut(name) {
            x.layers_total = p.layers_total as u32;
            x.layers_done = p.layers_done as u32;
            x.bytes_total = p.bytes_total;
            x.bytes_done = p.bytes_done;
            x.phase = p.current.clone();
        }
    }

    /// The pull or pack of `name` ended; `reported`: the log has its result.
    pub(super) fn end(&self, name: &str, reported: bool) {
        if reported {
            self.reported
                .lock()
                .expect("pulls lock")
                .insert(name.to_string(), std::time::Instant::now());
        }
        self.active.lock().expect("pulls lock").remove(name);
    }
}

impl Edge {
    /// Starts pulling image `name` from `reference` (unless it is already being pulled);
    /// the result is reported to the log.
    pub(super) fn start_pull(self: &Arc<Self>, name: String, reference: String) {
        if !self.pulls.begin(&name) {
            return;
        }
        let edge = self.clone();
        std::thread::Builder::new()
            .name(format!("pull {name}"))
            .spawn(move || {
                tracing::info!(image = %name, %reference, "pulling");
                let progress = |p: &PullProgress| edge.pulls.update(&name, p);
                let result = match edge.pull_as(&name, &reference, &progress) {
                    Ok(image) => ImageResult::Ready {
                        digest: image.digest.clone().unwrap_or_default(),
                        size_bytes: image_bytes(&edge.images, &image),
                        layers: image.layers.len() as u32,
                    },
                    Err(e) => ImageResult::Failed {
                        reason: super::fit_reason(&e.to_string()),
                    },
                };
                tracing::info!(image = %name, ?result, "pull done");
                let reported = edge.rt.block_on(edge.report_image(&name, &result));
                edge.pulls.end(&name, reported);
                edge.wake.notify_one();
            })
            .expect("spawning a pull thread");
    }

    /// Pulls `reference` and stores it under `name` too (a registered name for it).
    fn pull_as(&self, name: &str, reference: &str, progress: &dyn Fn(&PullProgress)) -> Result<Image, EdgeError> {
        let image = self
            .images
            .pull(reference, &self.cfg.registries.options_for(reference), progress)?;
        if image.name != name {
            let mut named = image.clone();
            named.name = name.to_string();
            self.images.put(&named)?;
            return Ok(named);
        }
        Ok(image)
    }

    /// Reports a pull's or pack's result; whether the log took it.
    pub(super) async fn report_image(&self, name: &str, result: &ImageResult) -> bool {
        self.report_image_at(name, result, &self.image_report_key(name))
            .await
            .is_some()
    }

    /// A request id for one report of image `name`: its retries share it (the log applies
    /// it once), and no other report of the name has it. (A name pulled again to the same
    /// digest reports the same result; a fixed id would have the log take the second
    /// report for a retry of the first and never apply it. A report made again after a
    /// lost answer is refused as already reported, not applied twice.)
    pub(super) fn image_report_key(&self, name: &str) -> String {
        format!("{}:image:{name}:{:016x}", self.cfg.name, rand::random::<u64>())
    }

    /// Reports a pull's, pack's or import's result under request id `key`; the log
    /// index that took it (0 when an earlier report of it was taken, its answer lost).
    pub(super) async fn report_image_at(&self, name: &str, result: &ImageResult, key: &str) -> Option<u64> {
        let mut client = self.client.clone();
        match client.report_image(name, result, key).await {
            Ok(index) => {
                tracing::info!(image = %name, index, "reported");
                Some(index)
            }
            // An earlier report of this result was taken and its answer lost (the
            // request id differs per report): the log has it.
            Err(crate::slice::SliceError::Status(s)) if s.message().contains("was already reported") => {
                tracing::info!(image = %name, "reported already");
                Some(0)
            }
            // The log still has the pull pending: the next round pulls (from the store,
            // quickly) and reports again.
            Err(e) => {
                tracing::warn!(image = %name, error = %e, "cannot report an image; it is made again");
                None
            }
        }
    }

    /// The image sandbox `d` runs: a built-in one (built here if need be), the store's,
    /// or pulled now from where the log says (or from the name itself when it names a
    /// registry). Creates of one image that is not here wait for one pull.
    pub(super) fn image_for(&self, d: &DesiredSandbox) -> Result<Image, EdgeError> {
        if is_builtin(&d.image) {
            return Ok(self.images.ensure(
                &d.image,
                &|p| tracing::info!(image = %d.image, progress = ?p, "building image"),
            )?);
        }
        // The stored record serves unless the log pins another digest (the name was
        // pulled again and its tag had moved).
        let pinned = d
            .image_source
            .as_deref()
            .and_then(|s| s.rsplit_once('@'))
            .map(|(_, digest)| digest);
        if let Ok(image) = self.images.get(&d.image)
            && pinned.is_none_or(|p| image.digest.as_deref() == Some(p))
        {
            return Ok(image);
        }
        if let Some(holder) = super::packs::packed_on(d) {
            return Err(EdgeError::PackedElsewhere {
                image: d.image.clone(),
                edge: holder.to_string(),
            });
        }
        let source = match &d.image_source {
            Some(s) => s.clone(),
            None if names_a_registry(&d.image) => d.image.clone(),
            None => {
                return Err(EdgeError::Images(crate::images::ImageError::NotFound(d.image.clone())));
            }
        };
        self.pull_as(
            &d.image,
            &source,
            &|p| tracing::debug!(image = %d.image, done = p.bytes_done, total = p.bytes_total, "pulling for a create"),
        )
    }
}

/// What an image's layers take on disk (apparent sizes; shared layers counted in full).
pub(super) fn image_bytes(store: &ImageStore, image: &Image) -> u64 {
    store
        .layer_dirs(image)
        .map(|dirs| dirs.iter().map(|d| super::files::dir_size(d)).sum())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::Pulls;

    #[test]
    fn a_reported_pull_or_pack_is_not_made_again_while_the_slice_catches_up() {
        let pulls = Pulls::default();
        assert!(pulls.begin("packed"));
        assert!(!pulls.begin("packed"), "one at a time");
        pulls.end("packed", true);
        assert!(pulls.names().contains("packed"), "reported just now: left alone");
        assert!(pulls.begin("failed-report"));
        pulls.end("failed-report", false);
        assert!(!pulls.names().contains("failed-report"), "not reported: made again");
    }
}
