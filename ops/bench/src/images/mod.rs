//! `opendsec-bench images`: OCI images through a real `opendsec up`, beside the raw
//! tools (issue 16). [`run`] does, in order:
//!
//! 1. [`layout`]: the ~500 MB image, made from the store's own `base` (built first if
//!    the store lacks it or it is stale), pushed with `skopeo` to a Debian
//!    `docker-registry` on a free loopback port ([`registry`]).
//! 2. [`cold`]: the image's first use on an empty store, `--runs` times, interleaved:
//!    OpenDsec's registered pull then create, OpenDsec's create naming the reference,
//!    and `skopeo copy` + `umoci unpack` + `crun run`.
//! 3. [`warm`]: create -> first output from the stored image beside `base`.
//! 4. [`disk`]: `--sandboxes` sandboxes of the image at once, and what they take on disk.
//!
//! Steps 3 and 4 run on one `opendsec up` over the store given (`--image-dir`, where
//! `base` is); the image is pulled into it for them, and the records and layers the
//! benchmark added there are removed at the end. [`report`] prints the table and the JSON.
//!
//! Where the figures come from matters more than usual here: unpacking 20,000 files is
//! mostly the kernel's work, and on ext4 without a journal that work grows with every
//! file deleted on the machine in the last 12 hours ([`cpu::journalless_ext4`]; seen
//! here: the same `tar -xzf` took 6 s of CPU on a fresh ext4 and 40 s on a busy root
//! file system). The report warns when `--data-dir` or `--image-dir` is on one; give
//! both a journaled (or fresh) file system for figures that compare across runs.

mod cold;
mod cpu;
mod disk;
mod layout;
mod registry;
mod report;
mod warm;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use opendsec_edge::images::{Image, ImageStore};
use serde_json::{Value, json};

pub use report::Report;

use crate::sandboxes::{UpConfig, UpGuard};

/// The name the image is registered under (`POST /v1/images`).
pub const IMAGE_NAME: &str = "bench-500m";
/// The image it is made from, and the warm runs' other image.
pub const BASE: &str = "base";
/// Where it lives in the registry, and its tag.
const REPOSITORY: &str = "bench/base";
const TAG: &str = "500m";
/// Flags of every `opendsec up` here: the microVM driver would prepare its kernel and
/// disks in each fresh store at start, beside the measurements; only containers are measured.
const UP_ARGS: &[&str] = &["--microvm", "off"];

#[derive(Clone, Debug)]
pub struct Options {
    /// Cold runs (each moves the whole image three times).
    pub runs: usize,
    /// Warm create -> first output runs per image.
    pub warm_runs: usize,
    /// Sandboxes for the disk measurement.
    pub sandboxes: usize,
    pub data_dir: PathBuf,
    pub opendsec_bin: PathBuf,
    pub agent_bin: PathBuf,
    /// The store that holds (or will build) `base`; the warm and disk steps run on it.
    pub image_dir: PathBuf,
}

/// A sandbox of `image` as every step here creates it (the sandboxes benchmark's shape).
fn sandbox_body(image: &str) -> Value {
    json!({"image": image, "memory_mb": 64, "cpu_millis": 100})
}

/// Bytes `du -sx` gives for `paths` together (hard links counted once, other file
/// systems under them skipped).
fn du(paths: &[PathBuf]) -> Result<u64, String> {
    if paths.is_empty() {
        return Ok(0);
    }
    let out = Command::new("du")
        .args(["-sxcB1"])
        .args(paths)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("du: {e}"))?;
    if !out.status.success() {
        return Err(format!("du: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| "du printed no total".to_string())
}

/// Apparent bytes (`du -sx --apparent-size`) of `paths` together.
fn du_apparent(paths: &[PathBuf]) -> Result<u64, String> {
    let out = Command::new("du")
        .args(["-sxcb"])
        .args(paths)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("du: {e}"))?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("du: {}", String::from_utf8_lossy(&out.stderr).trim()))
}

/// `base` from the store at `image_dir`, built first if need be (minutes: debootstrap and apt).
async fn ensure_base(image_dir: &Path) -> Result<(Image, Vec<PathBuf>), String> {
    let dir = image_dir.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let store = ImageStore::open(&dir).map_err(|e| e.to_string())?;
        let image = store
            .ensure(BASE, &|p| eprintln!("   building base: {:?}: {}", p.phase, p.message))
            .map_err(|e| e.to_string())?;
        let layers = store.layer_dirs(&image).map_err(|e| e.to_string())?;
        Ok((image, layers))
    })
    .await
    .map_err(|e| e.to_string())?
}

/// The image records under `store/images/` and the layer directories under `layers/`.
fn store_entries(store: &Path) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let list = |sub: &str| -> Vec<PathBuf> {
        std::fs::read_dir(store.join(sub))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .collect()
    };
    (list("images"), list("layers"))
}

/// Removes what the warm and disk steps added to the store: the records that appeared
/// and name the benchmark's registry, then those of their layers no record names any more.
fn remove_added(store: &Path, records_before: &[PathBuf], registry_host: &str) -> Vec<String> {
    let mut removed = Vec::new();
    let mut layers = Vec::new();
    for path in store_entries(store).0 {
        if records_before.contains(&path) {
            continue;
        }
        let Some(image) = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<Image>(&b).ok())
        else {
            continue;
        };
        if image
            .reference
            .as_deref()
            .is_some_and(|r| r.starts_with(&format!("{registry_host}/")))
            && std::fs::remove_file(&path).is_ok()
        {
            removed.push(path.display().to_string());
            layers.extend(image.layers);
        }
    }
    let still_named: Vec<String> = ImageStore::open(store)
        .and_then(|s| s.list())
        .map(|l| l.into_iter().flat_map(|i| i.layers).collect())
        .unwrap_or_else(|_| layers.clone()); // cannot tell: keep them all
    for layer in layers {
        let dir = store.join("layers").join(&layer);
        if !still_named.contains(&layer) && dir.is_dir() && std::fs::remove_dir_all(&dir).is_ok() {
            removed.push(dir.display().to_string());
        }
    }
    removed
}

pub async fn run(o: Options) -> Report {
    let mut report = Report::default();
    let work = o.data_dir.join(format!("images-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    if let Err(e) = std::fs::create_dir_all(&work) {
        report.fail(format!("create {work:?}: {e}"));
        return report;
    }
    let r = run_in(&o, &work, &mut report).await;
    if let Err(e) = r {
        report.fail(e);
    }
    if std::env::var_os("OPENDSEC_BENCH_KEEP").is_some() {
        eprintln!("kept {} (OPENDSEC_BENCH_KEEP)", work.display());
    } else if crate::sandboxes::mounts_under(&work).is_empty() {
        let _ = std::fs::remove_dir_all(&work);
    } else {
        report.fail(format!("mounts left under {}; not removed", work.display()));
    }
    report
}

async fn run_in(o: &Options, work: &Path, report: &mut Report) -> Result<(), String> {
    for (what, dir) in [("--data-dir", work), ("--image-dir", o.image_dir.as_path())] {
        if let Some(device) = cpu::journalless_ext4(dir) {
            report.warn(format!(
                "{what} {} is on {device}, ext4 without a journal: creating files there passes over every inode \
                 deleted in the last vm.dirtytime_expire_seconds, so unpacking costs CPU in proportion to the \
                 machine's recent file churn (see opendsec_bench::images); use a journaled file system for stable \
                 cold and disk figures",
                dir.display()
            ));
        }
    }
    // 1. The image.
    eprintln!(
        "== base from the store {} (built if missing or stale)",
        o.image_dir.display()
    );
    let (base, base_layers) = ensure_base(&o.image_dir).await?;
    eprintln!(
        "== writing an OCI layout of base's {} layer(s) (tar, gzip)",
        base_layers.len()
    );
    let t0 = Instant::now();
    let layout_dir = work.join("layout");
    let made = {
        let (layers, config, dir) = (base_layers.clone(), base.config.clone(), layout_dir.clone());
        tokio::task::spawn_blocking(move || layout::write(&layers, &config, &dir, TAG))
            .await
            .map_err(|e| e.to_string())??
    };
    eprintln!(
        "   {} compressed, {} of tar, in {:.1} s",
        report::fmt_bytes(made.compressed_bytes()),
        report::fmt_bytes(made.tar_bytes()),
        t0.elapsed().as_secs_f64()
    );
    let registry = registry::Registry::start(&work.join("registry"))?;
    let t0 = Instant::now();
    let reference = registry.push(&layout_dir, TAG, REPOSITORY)?;
    eprintln!("   pushed as {reference} in {:.1} s", t0.elapsed().as_secs_f64());
    let _ = std::fs::remove_dir_all(&layout_dir);
    report.image(&reference, &made, du_apparent(&base_layers).unwrap_or(0));

    // 2. Cold.
    for run in 0..o.runs {
        // A rotated order each run: no way always goes first.
        for k in 0..3 {
            match (k + run) % 3 {
                0 => {
                    eprintln!("== cold {}/{}: OpenDsec, POST /v1/images then create", run + 1, o.runs);
                    let r = cold::registered(o, work, &reference, run).await;
                    report.cold_registered(r);
                }
                1 => {
                    eprintln!("== cold {}/{}: OpenDsec, create naming the reference", run + 1, o.runs);
                    let r = cold::by_reference(o, work, &reference, run).await;
                    report.cold_by_reference(r);
                }
                _ => {
                    eprintln!("== cold {}/{}: skopeo copy + umoci unpack + crun run", run + 1, o.runs);
                    let (work, reference) = (work.to_path_buf(), reference.clone());
                    let r = tokio::task::spawn_blocking(move || cold::raw(&work, &reference, run))
                        .await
                        .map_err(|e| e.to_string())?;
                    report.cold_raw(r);
                }
            }
        }
    }

    // 3 and 4, on the given store.
    let records_before = store_entries(&o.image_dir).0;
    let r = warm_and_disk(o, work, &reference, report).await;
    for removed in remove_added(&o.image_dir, &records_before, &registry_host(&reference)) {
        eprintln!("   removed {removed}");
    }
    drop(registry);
    r
}

fn registry_host(reference: &str) -> String {
    reference.split('/').next().unwrap_or_default().to_string()
}

async fn warm_and_disk(o: &Options, work: &Path, reference: &str, report: &mut Report) -> Result<(), String> {
    let capacity = (o.sandboxes + 16) as u64;
    eprintln!(
        "== opendsec up on the store {} (capacity {capacity} sandboxes)",
        o.image_dir.display()
    );
    let up = Arc::new(
        UpGuard::start(
            &UpConfig {
                dir: work.join("warm"),
                opendsec_bin: o.opendsec_bin.clone(),
                agent_bin: o.agent_bin.clone(),
                image_dir: o.image_dir.clone(),
                extra_args: UP_ARGS.iter().map(|s| s.to_string()).collect(),
                netns: None,
            },
            capacity,
        )
        .await?,
    );
    up.wait_warm_disks().await;
    let (pull, _, steps) = up.pull_image(reference, IMAGE_NAME).await?;
    let store = ImageStore::open(&o.image_dir).map_err(|e| e.to_string())?;
    let image_layers = store
        .get(IMAGE_NAME)
        .and_then(|i| store.layer_dirs(&i))
        .map_err(|e| e.to_string())?;
    eprintln!(
        "   pulled into it in {:.1} s ({}): {} layer(s), {} on disk",
        pull.as_secs_f64(),
        report::fmt_steps(&steps),
        image_layers.len(),
        report::fmt_bytes(du(&image_layers).unwrap_or(0))
    );
    report.unpacked(du(&image_layers).unwrap_or(0), du_apparent(&image_layers).unwrap_or(0));

    if o.warm_runs > 0 {
        eprintln!(
            "== warm: create -> first output, {IMAGE_NAME} and {BASE} interleaved, {} runs each (+1 warm-up)",
            o.warm_runs
        );
        report.warm(warm::warm(&up, o.warm_runs).await);
    }

    if o.sandboxes > 0 {
        eprintln!("== disk: {} sandboxes of {IMAGE_NAME} at once", o.sandboxes);
        report.disk(disk::disk(&up, &o.image_dir, &image_layers, o.sandboxes).await);
    }
    Ok(())
}
