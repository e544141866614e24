//! Images crossing the edge's boundary as files: imported from tarballs, and pushed to
//! registries ([`Edge::pusher`], the proxy's `POST /images/push`).
//!
//! Imports (`ImportImage`, reported as `ReportImage`): the log has
//! this edge import image `name`, and the gateway then streams the caller's tarball (a
//! docker-archive or an OCI layout) to the edge proxy's `PUT /images/import`. The proxy
//! writes it to a private file of the store's `tmp/` ([`Edge::import_hooks`]), then the
//! store verifies and installs it (`images/import.rs`) and the result is reported, before
//! the proxy answers, so the caller's request ends with the image ready or failed.
//!
//! An import is under way (in `Pulls`, shown with each heartbeat) from the first byte to
//! the report: one upload per name at a time. One the log asked for whose upload never
//! comes (the caller or the gateway went away) is reported failed after
//! [`UPLOAD_GRACE`] (`reconcile::plan_imports`).

use super::Edge;
use crate::images::{PullProgress, TmpPath};
use crate::proxy;
use opendsec_commands::ImageResult;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long an import the log asked for may wait for its upload to start.
pub(super) const UPLOAD_GRACE: Duration = Duration::from_secs(120);

/// Imports the log asked for and this edge awaits an upload of, and uploads in flight.
#[derive(Default)]
pub(super) struct Imports {
    /// When this run first saw each awaited import not under way.
    awaited_since: Mutex<BTreeMap<String, Instant>>,
    /// The files uploads are written to, by image name.
    files: Mutex<BTreeMap<String, TmpPath>>,
}

impl Imports {
    /// Which of the awaited imports (`awaited`, those not under way) have waited longer
    /// than [`UPLOAD_GRACE`] for their upload, counting from when this run first saw them
    /// (a restarted edge gives a cut-off upload the grace again).
    pub(super) fn overdue(&self, awaited: &BTreeSet<String>, under_way: &BTreeSet<String>) -> BTreeSet<String> {
        let now = Instant::now();
        let mut since = self.awaited_since.lock().expect("imports lock");
        since.retain(|name, _| awaited.contains(name) && !under_way.contains(name));
        for name in awaited.iter().filter(|n| !under_way.contains(*n)) {
            since.entry(name.clone()).or_insert(now);
        }
        since
            .iter()
            .filter(|(_, at)| now.duration_since(**at) > UPLOAD_GRACE)
            .map(|(name, _)| name.clone())
            .collect()
    }
}

impl Edge {
    /// The proxy's side of imports: begin (check and mark under way), progress, finish.
    pub(super) fn import_hooks(self: &Arc<Self>) -> proxy::Imports {
        let (b, r, f) = (self.clone(), self.clone(), self.clone());
        proxy::Imports {
            begin: Arc::new(move |name, index| b.begin_import(name, index)),
            received: Arc::new(move |name, done, total| {
                r.pulls.update(
                    name,
                    &PullProgress {
                        bytes_done: done,
                        bytes_total: total.unwrap_or(done),
                        current: "receiving the tarball".into(),
                        ..PullProgress::default()
                    },
                )
            }),
            finish: Arc::new(move |name, upload| {
                let edge = f.clone();
                Box::pin(async move { edge.finish_import(name, upload).await })
            }),
        }
    }

    /// Whether an upload of image `name` may start: the slice (once past `index`, the
    /// log index of the import request) awaits it and no other upload of it is under
    /// way. Where to write the tarball, or why not.
    fn begin_import(&self, name: &str, index: u64) -> Result<PathBuf, proxy::ImportRefused> {
        let (awaited, caught_up) = {
            let slice = self.slice.lock().expect("slice lock");
            (slice.imports.contains(name), slice.next_index > index)
        };
        if !awaited {
            return Err(if caught_up {
                proxy::ImportRefused::Refused(
                    409,
                    format!(
                        "edge {} awaits no upload of image {name}: it was imported already, failed or \
                         was deleted; import it again",
                        self.cfg.name
                    ),
                )
            } else {
                proxy::ImportRefused::NotYet
            });
        }
        if !self.pulls.begin(name) {
            return Err(proxy::ImportRefused::Refused(
                409,
                format!(
                    "an upload of image {name} is already under way on edge {}",
                    self.cfg.name
                ),
            ));
        }
        let tmp = self.images.tmp_path("import");
        let path = tmp.path().to_path_buf();
        self.imports
            .files
            .lock()
            .expect("imports lock")
            .insert(name.to_string(), tmp);
        Ok(path)
    }

    /// Imports the uploaded tarball (or notes that the upload failed: `Err(why)`),
    /// reports the result to the log and answers the caller: the result and the index
    /// of the report, or (status, why).
    async fn finish_import(
        self: Arc<Self>,
        name: String,
        upload: Result<u64, String>,
    ) -> Result<serde_json::Value, (u16, String)> {
        let tmp = self.imports.files.lock().expect("imports lock").remove(&name);
        let result = match (upload, tmp) {
            (Err(why), _) => ImageResult::Failed {
                reason: super::fit_reason(&format!("the upload of the tarball failed: {why}")),
            },
            (Ok(_), None) => ImageResult::Failed {
                reason: "the uploaded tarball was lost on the edge".into(),
            },
            (Ok(bytes), Some(tmp)) => {
                let edge = self.clone();
                let n = name.clone();
                tracing::info!(image = %name, bytes, "importing an uploaded tarball");
                let imported = tokio::task::spawn_blocking(move || {
                    let progress = |p: &PullProgress| edge.pulls.update(&n, p);
                    let r = edge.images.import(tmp.path(), &n, &progress);
                    drop(tmp);
                    r
                })
                .await;
                match imported {
                    Ok(Ok(image)) => ImageResult::Ready {
                        digest: image.digest.clone().unwrap_or_default(),
                        size_bytes: super::pulls::image_bytes(&self.images, &image),
                        layers: image.layers.len() as u32,
                    },
                    Ok(Err(e)) => ImageResult::Failed {
                        reason: super::fit_reason(&e.to_string()),
                    },
                    Err(e) => ImageResult::Failed {
                        reason: super::fit_reason(&format!("the import stopped: {e}")),
                    },
                }
            }
        };
        tracing::info!(image = %name, ?result, "import done");
        // The report is what the caller waits for: tried a few times before giving up
        // (then the import is failed once overdue, and the caller imports again).
        let key = self.image_report_key(&name);
        let mut index = None;
        for attempt in 0..5 {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(500 << attempt.min(3))).await;
            }
            index = self.report_image_at(&name, &result, &key).await;
            if index.is_some() {
                break;
            }
        }
        self.pulls.end(&name, index.is_some());
        self.wake.notify_one();
        let Some(index) = index else {
            return Err((
                503,
                format!(
                    "edge {} could not report image {name} to the control plane; import it again",
                    self.cfg.name
                ),
            ));
        };
        Ok(match result {
            ImageResult::Ready {
                digest,
                size_bytes,
                layers,
            } => serde_json::json!({
                "state": "ready", "index": index, "digest": digest, "size_bytes": size_bytes, "layers": layers,
            }),
            ImageResult::Failed { reason } => serde_json::json!({
                "state": "failed", "index": index, "reason": reason,
            }),
        })
    }
}

impl Edge {
    /// The proxy's `POST /images/push`: pushes stored image `name` to `reference` with
    /// this edge's registry settings (credentials, plain-HTTP registries); and its
    /// `GET /images/push/{id}`: the progress of the push asked with that `id`, while it runs.
    pub(super) fn pusher(self: &Arc<Self>) -> (proxy::Pusher, proxy::PushProgress) {
        let edge = self.clone();
        let running: Arc<Mutex<HashMap<String, PullProgress>>> = Arc::default();
        let reader = running.clone();
        let progress_of: proxy::PushProgress = Arc::new(move |id: &str| {
            let p = reader.lock().expect("pushes lock").get(id)?.clone();
            Some(serde_json::json!({
                "layers_done": p.layers_done, "layers_total": p.layers_total,
                "bytes_done": p.bytes_done, "bytes_total": p.bytes_total, "current": p.current,
            }))
        });
        let pusher: proxy::Pusher = Arc::new(move |ask: &serde_json::Value| {
            let (Some(name), Some(reference)) = (ask["name"].as_str(), ask["reference"].as_str()) else {
                return Err((400, "a push names the image (name) and where to (reference)".into()));
            };
            // At most one push per id at once; ids are the callers' (random), and bounded.
            let id = ask["id"]
                .as_str()
                .filter(|i| !i.is_empty() && i.len() <= 64)
                .map(str::to_string);
            if let Some(id) = &id {
                let mut all = running.lock().expect("pushes lock");
                if all.contains_key(id) || all.len() >= PUSHES_WATCHED {
                    return Err((
                        409,
                        format!("push {id} runs already, or too many pushes run on this edge"),
                    ));
                }
                all.insert(id.clone(), PullProgress::default());
            }
            tracing::info!(image = %name, %reference, "pushing");
            let opts = edge.cfg.registries.options_for(reference);
            let progress = |p: &PullProgress| {
                tracing::debug!(image = %name, step = %p.current, "pushing");
                if let Some(id) = &id {
                    running.lock().expect("pushes lock").insert(id.clone(), p.clone());
                }
            };
            let pushed = edge.images.push(name, reference, &opts, &progress);
            if let Some(id) = &id {
                running.lock().expect("pushes lock").remove(id);
            }
            match pushed {
                Ok(p) => {
                    tracing::info!(image = %name, reference = %p.reference, digest = %p.digest, "pushed");
                    Ok(serde_json::json!({
                        "reference": p.reference, "digest": p.digest, "layers": p.layers, "bytes": p.bytes,
                    }))
                }
                Err(e) => {
                    use crate::images::ImageError as E;
                    let code = match &e {
                        E::NotFound(_) => 404,
                        E::InvalidReference { .. } => 400,
                        _ => 502,
                    };
                    Err((code, e.to_string()))
                }
            }
        });
        (pusher, progress_of)
    }
}

/// Pushes whose progress an edge keeps at once (each a few hundred bytes).
const PUSHES_WATCHED: usize = 256;

#[cfg(test)]
mod tests {
    use super::Imports;
    use std::collections::BTreeSet;

    #[test]
    fn an_awaited_import_is_overdue_only_after_the_grace_and_never_while_under_way() {
        let imports = Imports::default();
        let awaited: BTreeSet<String> = ["a".to_string(), "b".into()].into();
        let under_way: BTreeSet<String> = ["b".to_string()].into();
        assert!(imports.overdue(&awaited, &under_way).is_empty(), "just seen");
        let long_ago = std::time::Instant::now() - super::UPLOAD_GRACE - std::time::Duration::from_secs(1);
        for at in imports.awaited_since.lock().unwrap().values_mut() {
            *at = long_ago;
        }
        assert_eq!(imports.overdue(&awaited, &under_way), ["a".to_string()].into());
        assert!(
            !imports.awaited_since.lock().unwrap().contains_key("b"),
            "an import under way is not awaited"
        );
        assert!(
            imports.overdue(&BTreeSet::new(), &under_way).is_empty(),
            "reported: forgotten"
        );
        assert!(imports.awaited_since.lock().unwrap().is_empty());
    }
}
