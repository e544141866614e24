//! Cold: the image's first use on a machine that has none of it, three ways, each on
//! an empty store and each timed from its first request to the first output of `echo hi`:
//!
//! - [`registered`]: `POST /v1/images` (the edge pulls and unpacks; `GET /v1/images/{name}`
//!   polled every 20 ms until `ready`), then `POST /v1/sandboxes` naming it and `echo hi`
//!   through the agent, as the sandboxes benchmark times a create.
//! - [`by_reference`]: `POST /v1/sandboxes` naming the registry reference itself (the
//!   edge pulls at create), `GET` polled every 20 ms until `running`, then `echo hi`.
//! - [`raw`]: `skopeo copy docker://… oci:…`, `umoci unpack`, a `syncfs` of the bundle
//!   (our pull syncs before it publishes; skopeo and umoci do not), and `crun run` of
//!   umoci's bundle with the process set to `echo hi`, to its first stdout byte.
//!
//! "Empty store" is a fresh `opendsec up` (data directory and image store of its own,
//! both removed afterwards) per OpenDsec run, and a fresh directory per raw run: nothing
//! of the image is on disk before a run. The registry's blobs are in the page cache for
//! every run alike (they were just pushed); `sync` runs before each timed step so that
//! no step pays for an earlier one's dirty pages.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::cpu::{children_cpu, process_cpu, run_queue_wait};
use super::{IMAGE_NAME, Options, du, sandbox_body};
use crate::sandboxes::host::{host_is_cgroup_hybrid, runtime_cmd};
use crate::sandboxes::raw::{remove_bench_cgroups, time_first_stdout};
use crate::sandboxes::{UpConfig, UpGuard};

/// How long a pull may take before the run counts as failed.
const PULL_TIMEOUT: Duration = Duration::from_secs(900);
const POLL: Duration = Duration::from_millis(20);

/// One registered-image run.
#[derive(Clone, Debug)]
pub(super) struct Registered {
    /// `POST /v1/images` until `GET` says ready.
    pub(super) pull: Duration,
    /// Then `POST /v1/sandboxes` to the first output.
    pub(super) create: Duration,
    /// The image's size as the API reports it.
    pub(super) size_bytes: u64,
    /// The pull's steps as `GET` showed them (the edge reports them with its heartbeat,
    /// every 2 s): when each was first seen.
    pub(super) steps: Vec<(Duration, String)>,
    /// CPU time `opendsec up` used during the pull, and the time its threads waited
    /// for a CPU meanwhile (the pull's thread is gone by then: only the others count).
    pub(super) cpu: Duration,
    pub(super) cpu_wait: Duration,
}

/// One run of the raw tools.
#[derive(Clone, Debug)]
pub(super) struct Raw {
    pub(super) copy: Duration,
    pub(super) unpack: Duration,
    pub(super) sync: Duration,
    /// The floor of unpacking: GNU `tar -xzf` of the same layer blobs (from skopeo's
    /// layout, bottom first; whiteouts left as files) into a fresh directory, then syncfs.
    pub(super) tar: Duration,
    /// CPU time (children's) of skopeo copy, umoci unpack and tar -xzf.
    pub(super) copy_cpu: Duration,
    pub(super) unpack_cpu: Duration,
    pub(super) tar_cpu: Duration,
    /// `crun run` spawn to its first stdout byte.
    pub(super) run: Duration,
    /// `du` of umoci's bundle: what each container costs when every one gets its own.
    pub(super) bundle_bytes: u64,
}

/// Flushes every dirty page (untimed), so the next timed step starts clean.
pub(super) fn sync_all() {
    // SAFETY: sync(2) has no preconditions.
    unsafe { libc::sync() };
}

/// A fresh `opendsec up` whose image store is empty, under `work/<name>/`.
async fn fresh_up(o: &Options, work: &Path, name: &str) -> Result<UpGuard, String> {
    let dir = work.join(name);
    let up = UpGuard::start(
        &UpConfig {
            image_dir: dir.join("store"),
            dir,
            opendsec_bin: o.opendsec_bin.clone(),
            agent_bin: o.agent_bin.clone(),
            extra_args: super::UP_ARGS.iter().map(|s| s.to_string()).collect(),
            netns: None,
        },
        8,
    )
    .await?;
    up.wait_warm_disks().await;
    Ok(up)
}

impl UpGuard {
    /// Waits (up to 15 s) until the edge has made its warm disks (4 by default), so a
    /// measurement does not share the machine with their `mkfs`.
    pub(super) async fn wait_warm_disks(&self) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            let warm = std::fs::read_dir(self.sandboxes_dir())
                .map(|d| {
                    d.flatten()
                        .filter(|e| e.file_name().to_string_lossy().starts_with(".warm-"))
                        .count()
                })
                .unwrap_or(0);
            if warm >= 4 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `POST /v1/images` of `reference` as `name`, then `GET` every 20 ms until it is
    /// ready: the time that took, the image's record, and the pull's steps as seen.
    pub(super) async fn pull_image(
        &self,
        reference: &str,
        name: &str,
    ) -> Result<(Duration, Value, Vec<(Duration, String)>), String> {
        let t0 = Instant::now();
        let (st, v) = self
            .send(
                reqwest::Method::POST,
                "/v1/images",
                Some(json!({"reference": reference, "name": name})),
            )
            .await?;
        if st >= 300 {
            return Err(format!("POST /v1/images: HTTP {st}: {v}"));
        }
        let mut steps: Vec<(Duration, String)> = Vec::new();
        loop {
            let (st, v) = self
                .send(reqwest::Method::GET, &format!("/v1/images/{name}"), None)
                .await?;
            if st != 200 {
                return Err(format!("GET /v1/images/{name}: HTTP {st}: {v}"));
            }
            let state = v["state"].as_str().unwrap_or("?");
            // A step is its first word ("fetching", "unpacking", "publishing"): the byte
            // counts in the rest change all along.
            let step = match v["progress"]["phase"].as_str() {
                Some(p) => format!("{state}: {}", p.split_whitespace().next().unwrap_or("")),
                None => state.to_string(),
            };
            if steps.last().is_none_or(|(_, s)| *s != step) {
                steps.push((t0.elapsed(), step));
            }
            match state {
                "ready" => return Ok((t0.elapsed(), v, steps)),
                "failed" => return Err(format!("the pull failed: {}", v["reason"])),
                _ => {}
            }
            if t0.elapsed() > PULL_TIMEOUT {
                return Err(format!("not ready after {PULL_TIMEOUT:?}: {v}"));
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

/// Registered image: pull through the API, then create and `echo hi`.
pub(super) async fn registered(o: &Options, work: &Path, reference: &str, run: usize) -> Result<Registered, String> {
    let up = fresh_up(o, work, &format!("cold-{run}-registered")).await?;
    sync_all();
    let r = async {
        let pid = up.pid().ok_or("opendsec up is not running")?;
        let (cpu0, wait0) = (process_cpu(pid), run_queue_wait(pid));
        let (pull, image, steps) = up.pull_image(reference, IMAGE_NAME).await?;
        let (cpu, cpu_wait) = (process_cpu(pid) - cpu0, run_queue_wait(pid).saturating_sub(wait0));
        let (id, created) = up
            .create_then_echo(&sandbox_body(IMAGE_NAME), Duration::from_secs(120))
            .await;
        if let Some(id) = id {
            up.remove(&id).await?;
        }
        Ok(Registered {
            pull,
            create: created?,
            size_bytes: image["size_bytes"].as_u64().unwrap_or(0),
            steps,
            cpu,
            cpu_wait,
        })
    }
    .await;
    r.map_err(|e: String| format!("{e}; up.log: {}", crate::log_tail(&up.log, 5)))
}

/// A create naming the reference: the edge pulls at create.
pub(super) async fn by_reference(o: &Options, work: &Path, reference: &str, run: usize) -> Result<Duration, String> {
    let up = fresh_up(o, work, &format!("cold-{run}-reference")).await?;
    sync_all();
    let r = async {
        let t0 = Instant::now();
        let id = up.create(&sandbox_body(reference)).await?;
        let first = async {
            up.wait_state(&id, "running", POLL, PULL_TIMEOUT).await?;
            let (first, out) = up.exec_first_output(&id, "echo hi", Duration::from_secs(60)).await?;
            if out != "hi\n" {
                return Err(format!("stdout {out:?}, expected \"hi\\n\""));
            }
            Ok(first - t0)
        }
        .await;
        up.remove(&id).await?;
        first
    }
    .await;
    r.map_err(|e: String| format!("{e}; up.log: {}", crate::log_tail(&up.log, 5)))
}

fn run_tool(cmd: &mut Command, what: &str) -> Result<Duration, String> {
    let t0 = Instant::now();
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running {what}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{what}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(t0.elapsed())
}

/// How long a syncfs of the file system holding `path` takes.
fn syncfs(path: &Path) -> Result<Duration, String> {
    let t0 = Instant::now();
    let f = std::fs::File::open(path).map_err(|e| format!("open {path:?}: {e}"))?;
    // SAFETY: syncfs on an fd we hold.
    if unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&f)) } != 0 {
        return Err(format!("syncfs: {}", std::io::Error::last_os_error()));
    }
    Ok(t0.elapsed())
}

/// GNU tar's extraction of the layout's layers (tag `x`, bottom first) into `dest`, as
/// root with numeric owners and xattrs, then syncfs: the least any unpacker must do.
/// The layout is skopeo's copy, already on disk (untimed here), and the result is removed.
fn tar_floor(layout: &Path, dest: &Path) -> Result<Duration, String> {
    let read_json = |p: PathBuf| -> Result<Value, String> {
        serde_json::from_slice(&std::fs::read(&p).map_err(|e| format!("read {p:?}: {e}"))?)
            .map_err(|e| format!("{p:?}: {e}"))
    };
    let blob = |digest: &str| layout.join("blobs").join(digest.replacen(':', "/", 1));
    let index = read_json(layout.join("index.json"))?;
    let manifest = index["manifests"][0]["digest"]
        .as_str()
        .ok_or("skopeo's index.json names no manifest")?;
    let manifest = read_json(blob(manifest))?;
    let layers: Vec<PathBuf> = manifest["layers"]
        .as_array()
        .ok_or("the manifest has no layers")?
        .iter()
        .filter_map(|l| l["digest"].as_str())
        .map(blob)
        .collect();
    std::fs::create_dir_all(dest).map_err(|e| format!("create {dest:?}: {e}"))?;
    sync_all();
    let t0 = Instant::now();
    for layer in &layers {
        run_tool(
            Command::new("tar").args(["-xzf"]).arg(layer).arg("-C").arg(dest).args([
                "--numeric-owner",
                "--xattrs",
                "--xattrs-include=*",
            ]),
            "tar -xzf",
        )?;
    }
    syncfs(dest)?;
    let took = t0.elapsed();
    let _ = std::fs::remove_dir_all(dest);
    Ok(took)
}

/// The raw tools on a fresh directory `work/raw-<run>` (removed afterwards).
pub(super) fn raw(work: &Path, reference: &str, run: usize) -> Result<Raw, String> {
    let dir = work.join(format!("raw-{run}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("create {dir:?}: {e}"))?;
    let id = format!("bench-{}-image-{run}", std::process::id());
    let hybrid = host_is_cgroup_hybrid();
    let state = dir.join("state");
    let r = (|| {
        let (layout, bundle) = (dir.join("oci"), dir.join("bundle"));
        sync_all();
        let cpu0 = children_cpu();
        let copy = run_tool(
            Command::new("skopeo")
                .args(["copy", "--quiet", "--insecure-policy", "--src-tls-verify=false"])
                .arg(format!("docker://{reference}"))
                .arg(format!("oci:{}:x", layout.display())),
            "skopeo copy",
        )?;
        let copy_cpu = children_cpu() - cpu0;
        sync_all();
        let cpu0 = children_cpu();
        let unpack = run_tool(
            Command::new("umoci")
                .args(["unpack", "--image"])
                .arg(format!("{}:x", layout.display()))
                .arg(&bundle),
            "umoci unpack",
        )?;
        let unpack_cpu = children_cpu() - cpu0;
        let sync = syncfs(&bundle)?;
        let cpu0 = children_cpu();
        let tar = tar_floor(&layout, &dir.join("tar"))?;
        let tar_cpu = children_cpu() - cpu0;
        // umoci's config runs an interactive `sh`: run `echo hi` instead, without a
        // terminal, in a cgroup the benchmark removes afterwards.
        let config_path = bundle.join("config.json");
        let mut config: Value = serde_json::from_slice(&std::fs::read(&config_path).map_err(|e| e.to_string())?)
            .map_err(|e| format!("{config_path:?}: {e}"))?;
        config["process"]["args"] = json!(["/bin/sh", "-c", "echo hi"]);
        config["process"]["terminal"] = json!(false);
        config["linux"]["cgroupsPath"] = json!(format!("/opendsec-bench/{id}"));
        std::fs::write(&config_path, serde_json::to_vec(&config).unwrap()).map_err(|e| e.to_string())?;
        std::fs::create_dir_all(&state).map_err(|e| e.to_string())?;
        let mut cmd = runtime_cmd("crun", &state, hybrid);
        cmd.args(["run", "--bundle"]).arg(&bundle).arg(&id);
        sync_all();
        let run = time_first_stdout(cmd, "crun")?;
        Ok(Raw {
            copy,
            unpack,
            sync,
            tar,
            copy_cpu,
            unpack_cpu,
            tar_cpu,
            run,
            bundle_bytes: du(&[bundle])?,
        })
    })();
    let _ = runtime_cmd("crun", &state, hybrid)
        .args(["delete", "--force", &id])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    remove_bench_cgroups();
    let _ = std::fs::remove_dir_all(&dir);
    r
}
