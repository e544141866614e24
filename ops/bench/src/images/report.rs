//! The images benchmark's figures: gathered as the steps finish (each echoed to stderr),
//! then printed as one table (our figure, the figure beside it, the ratio; medians)
//! with notes, and written as JSON for `--json`.

use std::fmt::Write;
use std::time::Duration;

use serde_json::{Value, json};

use super::cold::{Raw, Registered};
use super::disk::Disk;
use super::layout::Made;
use super::warm::Warm;
use super::{BASE, IMAGE_NAME};
use crate::load::percentile;
use crate::report::{fmt_dur, markdown_table};

#[derive(Default)]
pub struct Report {
    reference: String,
    made: Option<Made>,
    /// `du --apparent-size` of base's layers (what was tarred).
    base_apparent: u64,
    /// The pulled image's layers in the store: `du` and apparent.
    unpacked_du: u64,
    unpacked_apparent: u64,
    registered: Vec<Registered>,
    by_reference: Vec<Duration>,
    raw: Vec<Raw>,
    warm: Option<Warm>,
    disk: Option<Disk>,
    /// Warnings about the machine that change what the figures mean.
    warnings: Vec<String>,
    pub failures: Vec<String>,
}

/// `1.23 GiB`, `456.7 MiB`, `12.0 KiB`.
pub(super) fn fmt_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1u64 << 20) as f64 {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", b / 1024.0)
    }
}

/// Seconds from one second up, else [`fmt_dur`].
fn fmt_long(d: Duration) -> String {
    if d >= Duration::from_secs(1) {
        format!("{:.2} s", d.as_secs_f64())
    } else {
        fmt_dur(d)
    }
}

/// A pull's steps: `pending: fetching at 0.0 s, ...`.
pub(super) fn fmt_steps(steps: &[(Duration, String)]) -> String {
    steps
        .iter()
        .map(|(t, s)| format!("{s} at {:.1} s", t.as_secs_f64()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The median (the mean of the middle two for an even count).
fn median(v: impl IntoIterator<Item = Duration>) -> Option<Duration> {
    let mut v: Vec<Duration> = v.into_iter().collect();
    v.sort_unstable();
    match v.len() {
        0 => None,
        n if n % 2 == 1 => Some(v[n / 2]),
        n => Some((v[n / 2 - 1] + v[n / 2]) / 2),
    }
}

fn median_u64(v: impl IntoIterator<Item = u64>) -> Option<u64> {
    let mut v: Vec<u64> = v.into_iter().collect();
    v.sort_unstable();
    (!v.is_empty()).then(|| v[(v.len() - 1) / 2])
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

fn ratio(ours: f64, beside: f64) -> String {
    match ours / beside {
        r if !r.is_finite() => String::new(),
        r if r < 0.01 => format!("{r:.5}x"),
        r => format!("{r:.2}x"),
    }
}

/// A table row of durations: what, ours, beside, ratio (empty where one side is missing).
fn dur_row(what: &str, ours: Option<Duration>, beside: Option<Duration>) -> Vec<String> {
    vec![
        what.to_string(),
        ours.map(fmt_long).unwrap_or_else(|| "n/a".into()),
        beside.map(fmt_long).unwrap_or_else(|| "n/a".into()),
        match (ours, beside) {
            (Some(o), Some(b)) => ratio(o.as_secs_f64(), b.as_secs_f64()),
            _ => String::new(),
        },
    ]
}

impl Report {
    pub fn failed(&self) -> bool {
        !self.failures.is_empty()
    }

    pub(super) fn fail(&mut self, s: String) {
        eprintln!("   FAILED: {s}");
        self.failures.push(s);
    }

    pub(super) fn warn(&mut self, s: String) {
        eprintln!("   WARNING: {s}");
        self.warnings.push(s);
    }

    pub(super) fn image(&mut self, reference: &str, made: &Made, base_apparent: u64) {
        self.reference = reference.to_string();
        self.made = Some(made.clone());
        self.base_apparent = base_apparent;
    }

    pub(super) fn unpacked(&mut self, du: u64, apparent: u64) {
        (self.unpacked_du, self.unpacked_apparent) = (du, apparent);
    }

    pub(super) fn cold_registered(&mut self, r: Result<Registered, String>) {
        match r {
            Ok(r) => {
                eprintln!(
                    "   POST /v1/images -> ready {} ({}; opendsec up used {} of CPU, its threads waited {} for one), then create -> first output {}: {}",
                    fmt_long(r.pull),
                    fmt_steps(&r.steps),
                    fmt_long(r.cpu),
                    fmt_long(r.cpu_wait),
                    fmt_long(r.create),
                    fmt_long(r.pull + r.create)
                );
                self.registered.push(r);
            }
            Err(e) => self.fail(format!("cold, registered image: {e}")),
        }
    }

    pub(super) fn cold_by_reference(&mut self, r: Result<Duration, String>) {
        match r {
            Ok(d) => {
                eprintln!("   create naming the reference -> first output {}", fmt_long(d));
                self.by_reference.push(d);
            }
            Err(e) => self.fail(format!("cold, create naming the reference: {e}")),
        }
    }

    pub(super) fn cold_raw(&mut self, r: Result<Raw, String>) {
        match r {
            Ok(r) => {
                eprintln!(
                    "   skopeo copy {} (CPU {}), umoci unpack {} (CPU {}), syncfs {}, (tar -xzf + syncfs {}, CPU {}), crun run -> first byte {}; bundle {}",
                    fmt_long(r.copy),
                    fmt_long(r.copy_cpu),
                    fmt_long(r.unpack),
                    fmt_long(r.unpack_cpu),
                    fmt_long(r.sync),
                    fmt_long(r.tar),
                    fmt_long(r.tar_cpu),
                    fmt_dur(r.run),
                    fmt_bytes(r.bundle_bytes)
                );
                self.raw.push(r);
            }
            Err(e) => self.fail(format!("cold, skopeo + umoci + crun: {e}")),
        }
    }

    pub(super) fn warm(&mut self, w: Warm) {
        eprintln!(
            "   {IMAGE_NAME} p50 {}, {BASE} p50 {} (n={}, {}; errors {})",
            fmt_dur(percentile(&w.pulled, 0.5)),
            fmt_dur(percentile(&w.base, 0.5)),
            w.pulled.len(),
            w.base.len(),
            w.errors.len()
        );
        for e in w.errors.iter().take(3) {
            self.fail(format!("warm: {e}"));
        }
        if w.pulled.is_empty() || w.base.is_empty() {
            self.fail("warm: no run succeeded for one of the images".into());
        }
        self.warm = Some(w);
    }

    pub(super) fn disk(&mut self, d: Disk) {
        eprintln!(
            "   {} running: {} per sandbox; store layers/ {} -> {}; the image's layers {} -> {}; layer dirs {} -> {}",
            d.running,
            fmt_bytes(d.per_sandbox()),
            fmt_bytes(d.store_layers_before),
            fmt_bytes(d.store_layers_after),
            fmt_bytes(d.image_layers_before),
            fmt_bytes(d.image_layers_after),
            d.layer_dirs_before,
            d.layer_dirs_after
        );
        for e in d.errors.iter().take(3) {
            self.fail(format!("disk: {e}"));
        }
        if d.running < d.n {
            self.fail(format!("disk: only {} of {} sandboxes ran", d.running, d.n));
        }
        if d.left_over > 0 {
            self.fail(format!("disk: {} sandboxes not freed within 300 s", d.left_over));
        }
        self.disk = Some(d);
    }

    /// skopeo copy + umoci unpack + syncfs (our pull syncs before it publishes).
    fn raw_pull(r: &Raw) -> Duration {
        r.copy + r.unpack + r.sync
    }

    /// The figures as a table with notes.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        if let Some(m) = &self.made {
            let _ = writeln!(
                out,
                "image {} ({} layer(s), made from the store's base: {} apparent): {} compressed, {} of tar; unpacked in the store {} on disk ({} apparent)",
                self.reference,
                m.layers.len(),
                fmt_bytes(self.base_apparent),
                fmt_bytes(m.compressed_bytes()),
                fmt_bytes(m.tar_bytes()),
                fmt_bytes(self.unpacked_du),
                fmt_bytes(self.unpacked_apparent),
            );
        }
        let reg_pull = median(self.registered.iter().map(|r| r.pull));
        let reg_create = median(self.registered.iter().map(|r| r.create));
        let reg_total = median(self.registered.iter().map(|r| r.pull + r.create));
        let by_ref = median(self.by_reference.iter().copied());
        let raw_pull = median(self.raw.iter().map(Self::raw_pull));
        let raw_run = median(self.raw.iter().map(|r| r.run));
        let raw_total = median(self.raw.iter().map(|r| Self::raw_pull(r) + r.run));
        let tar_floor = median(self.raw.iter().map(|r| r.copy + r.tar));
        let of = |f: fn(&Raw) -> Duration| median(self.raw.iter().map(f)).map(fmt_long).unwrap_or_default();
        let mut rows = vec![
            dur_row(
                "cold: pull + unpack (POST /v1/images until ready vs skopeo copy + umoci unpack + syncfs)",
                reg_pull,
                raw_pull,
            ),
            vec![
                "  of which skopeo copy + umoci unpack + syncfs".into(),
                String::new(),
                format!("{} + {} + {}", of(|r| r.copy), of(|r| r.unpack), of(|r| r.sync)),
                String::new(),
            ],
            dur_row(
                "  the floor: skopeo copy + GNU tar -xzf + syncfs (no umoci)",
                reg_pull,
                tar_floor,
            ),
            dur_row(
                "  CPU time of it (opendsec up vs skopeo + umoci)",
                median(self.registered.iter().map(|r| r.cpu)),
                median(self.raw.iter().map(|r| r.copy_cpu + r.unpack_cpu)),
            ),
            dur_row(
                "  CPU time of it (opendsec up vs skopeo + GNU tar and gzip)",
                median(self.registered.iter().map(|r| r.cpu)),
                median(self.raw.iter().map(|r| r.copy_cpu + r.tar_cpu)),
            ),
            dur_row(
                "cold: then create -> first output (REST + agent vs crun run of umoci's bundle)",
                reg_create,
                raw_run,
            ),
            dur_row(
                "cold: image to first output, registered (POST /v1/images ... echo hi vs all of the raw)",
                reg_total,
                raw_total,
            ),
            dur_row(
                "cold: image to first output, create naming the reference vs all of the raw",
                by_ref,
                raw_total,
            ),
        ];
        if let Some(w) = &self.warm {
            rows.push(dur_row(
                &format!("warm: create -> first output, p50 ({IMAGE_NAME} vs {BASE})"),
                (!w.pulled.is_empty()).then(|| percentile(&w.pulled, 0.5)),
                (!w.base.is_empty()).then(|| percentile(&w.base, 0.5)),
            ));
            rows.push(dur_row(
                &format!("warm: create -> first output, p90 ({IMAGE_NAME} vs {BASE})"),
                (!w.pulled.is_empty()).then(|| percentile(&w.pulled, 0.9)),
                (!w.base.is_empty()).then(|| percentile(&w.base, 0.9)),
            ));
        }
        let bundle = median_u64(self.raw.iter().map(|r| r.bundle_bytes));
        if let Some(d) = &self.disk {
            let n = d.running as u64;
            let bytes_row = |what: String, ours: u64, beside: Option<u64>| {
                vec![
                    what,
                    fmt_bytes(ours),
                    beside.map(fmt_bytes).unwrap_or_else(|| "n/a".into()),
                    beside.map(|b| ratio(ours as f64, b as f64)).unwrap_or_default(),
                ]
            };
            rows.push(bytes_row(
                format!("disk: per sandbox, {n} running (its directory vs one umoci bundle)"),
                d.per_sandbox(),
                bundle,
            ));
            rows.push(bytes_row(
                format!("disk: {n} sandboxes + the image's layers once vs {n} umoci bundles"),
                d.sandboxes_bytes + d.image_layers_after,
                bundle.map(|b| b * n),
            ));
            rows.push(vec![
                format!("disk: store layers/ before vs with {n} sandboxes running"),
                fmt_bytes(d.store_layers_before),
                fmt_bytes(d.store_layers_after),
                String::new(),
            ]);
            rows.push(vec![
                format!("disk: the image's layers before vs with {n} sandboxes running"),
                fmt_bytes(d.image_layers_before),
                fmt_bytes(d.image_layers_after),
                String::new(),
            ]);
        }
        let _ = writeln!(
            out,
            "cold: median of {} run(s) per way (registered {}, by reference {}, raw {} succeeded); warm: {} runs per image",
            self.registered.len().max(self.by_reference.len()).max(self.raw.len()),
            self.registered.len(),
            self.by_reference.len(),
            self.raw.len(),
            self.warm.as_ref().map(|w| w.pulled.len()).unwrap_or(0)
        );
        out.push_str(&markdown_table(&["measurement", "opendsec", "beside", "ratio"], &rows));
        out.push_str(
            "notes: cold runs each start on an empty store (a fresh `opendsec up` and image store; a fresh directory for the raw tools), \
             in a rotated order, after a `sync`; our pull syncs the file system before it publishes a layer, skopeo and umoci do not, \
             so the raw side gets a syncfs of the bundle; umoci also hashes the whole unpacked tree into an mtree manifest (for a \
             later repack), which the floor row leaves out; the raw `crun run` is umoci's bundle as root (no user namespace, no \
             disk image, no agent).\n",
        );
        if let Some(d) = &self.disk {
            let _ = writeln!(
                out,
                "disk: du -sx (blocks allocated, mounts inside left out); a sandbox's writable layer lives in its sparse ext4 file; \
                 the edge's sandboxes directory took {} idle, {} with them (warm disks and containers included); layer directories \
                 in the store {} -> {}; the raw figure for {} is that many umoci bundles (computed: each container of the raw tools \
                 gets its own unpacked copy)",
                fmt_bytes(d.edge_dir_before),
                fmt_bytes(d.edge_dir_after),
                d.layer_dirs_before,
                d.layer_dirs_after,
                d.running
            );
        }
        for w in &self.warnings {
            let _ = writeln!(out, "WARNING: {w}");
        }
        for f in &self.failures {
            let _ = writeln!(out, "FAILED: {f}");
        }
        out
    }

    pub fn json(&self) -> Value {
        json!({
            "image": {
                "reference": self.reference,
                "manifest": self.made.as_ref().map(|m| m.manifest.clone()),
                "layers": self.made.as_ref().map(|m| m.layers.clone()),
                "compressed_bytes": self.made.as_ref().map(|m| m.compressed_bytes()),
                "tar_bytes": self.made.as_ref().map(|m| m.tar_bytes()),
                "base_apparent_bytes": self.base_apparent,
                "unpacked_du_bytes": self.unpacked_du,
                "unpacked_apparent_bytes": self.unpacked_apparent,
            },
            "cold": {
                "registered": self.registered.iter().map(|r| json!({
                    "pull_ms": ms(r.pull), "create_ms": ms(r.create), "total_ms": ms(r.pull + r.create),
                    "size_bytes": r.size_bytes,
                    "cpu_ms": ms(r.cpu), "cpu_wait_ms": ms(r.cpu_wait),
                    "steps": r.steps.iter().map(|(t, s)| json!({"at_ms": ms(*t), "step": s})).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
                "by_reference_ms": self.by_reference.iter().map(|d| ms(*d)).collect::<Vec<_>>(),
                "raw": self.raw.iter().map(|r| json!({
                    "skopeo_copy_ms": ms(r.copy), "umoci_unpack_ms": ms(r.unpack), "syncfs_ms": ms(r.sync),
                    "tar_xzf_syncfs_ms": ms(r.tar),
                    "skopeo_copy_cpu_ms": ms(r.copy_cpu), "umoci_unpack_cpu_ms": ms(r.unpack_cpu), "tar_xzf_cpu_ms": ms(r.tar_cpu), "crun_run_ms": ms(r.run), "bundle_bytes": r.bundle_bytes,
                })).collect::<Vec<_>>(),
            },
            "warm": self.warm.as_ref().map(|w| json!({
                "pulled_ms": w.pulled.iter().map(|d| ms(*d)).collect::<Vec<_>>(),
                "base_ms": w.base.iter().map(|d| ms(*d)).collect::<Vec<_>>(),
                "pulled_p50_ms": ms(percentile(&w.pulled, 0.5)),
                "base_p50_ms": ms(percentile(&w.base, 0.5)),
            })),
            "disk": self.disk.as_ref().map(|d| json!({
                "sandboxes": d.n, "running": d.running, "failed": d.failed,
                "per_sandbox_bytes": d.per_sandbox(), "sandboxes_bytes": d.sandboxes_bytes,
                "store_layers_before_bytes": d.store_layers_before, "store_layers_after_bytes": d.store_layers_after,
                "image_layers_before_bytes": d.image_layers_before, "image_layers_after_bytes": d.image_layers_after,
                "layer_dirs_before": d.layer_dirs_before, "layer_dirs_after": d.layer_dirs_after,
                "edge_dir_before_bytes": d.edge_dir_before, "edge_dir_after_bytes": d.edge_dir_after,
                "left_over": d.left_over,
            })),
            "warnings": self.warnings,
            "failed": self.failures,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median([ms(4), ms(1), ms(3), ms(2)]), Some(Duration::from_micros(2500)));
        assert_eq!(median([ms(9), ms(1), ms(5)]), Some(ms(5)));
        assert_eq!(median(Vec::new()), None);
    }

    #[test]
    fn ratios_keep_small_figures_readable() {
        assert_eq!(ratio(1.0, 4.0), "0.25x");
        assert_eq!(ratio(364.0, 600_000.0), "0.00061x");
        assert_eq!(ratio(1.0, 0.0), "");
    }

    #[test]
    fn a_row_missing_a_side_says_so_and_has_no_ratio() {
        assert_eq!(
            dur_row("warm", Some(ms(1500)), None),
            vec!["warm".to_string(), "1.50 s".into(), "n/a".into(), String::new()]
        );
    }
}
