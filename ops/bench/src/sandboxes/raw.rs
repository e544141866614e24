//! The raw OCI runtime baseline: `crun run` and `runc run` of the bundle the edge wrote
//! (its `config.json`, with the process set to `echo hi`), on an overlay of the same
//! image layers prepared beforehand (no disk image, no mount timed), from spawn to the
//! first stdout byte.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::host::{host_is_cgroup_hybrid, is_mounted, runtime_cmd, umount_detach};
use super::report::Results;
use crate::load::percentile;

/// A bundle for a raw `crun run`/`runc run`: the edge's config.json, rootfs = overlay
/// of the image layers (upper/work on the bench data dir's disk). Drop unmounts and
/// removes it, and deletes the container if it is still there.
struct RawBundle {
    dir: PathBuf,
    rootfs: PathBuf,
    rt: &'static str,
    root: PathBuf,
    id: String,
    hybrid: bool,
}

impl RawBundle {
    fn prepare(
        base: &Path,
        rt: &'static str,
        i: usize,
        layers: &[PathBuf],
        config: &Value,
        hybrid: bool,
    ) -> Result<RawBundle, String> {
        let dir = base.join(format!("{rt}-{i}"));
        let id = format!("bench-{}-{rt}-{i}", std::process::id());
        let b = RawBundle {
            rootfs: dir.join("rootfs"),
            root: base.join(format!("state-{rt}")),
            dir,
            rt,
            id,
            hybrid,
        };
        for d in [
            b.rootfs.clone(),
            b.dir.join("upper"),
            b.dir.join("work"),
            b.root.clone(),
        ] {
            std::fs::create_dir_all(&d).map_err(|e| format!("create {d:?}: {e}"))?;
        }
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(b.dir.join("upper"), std::fs::Permissions::from_mode(0o755));
        // The edge's bundle runs in a user namespace of its own: the overlay's root (the
        // upper dir) belongs to the namespace's root, as the edge's idmapped one does, so
        // the runtime can make the bundle's mount points in it.
        if let Some(host_root) = config["linux"]["uidMappings"][0]["hostID"].as_u64() {
            std::os::unix::fs::chown(b.dir.join("upper"), Some(host_root as u32), Some(host_root as u32))
                .map_err(|e| format!("chown the raw bundle's upper dir: {e}"))?;
        }
        let lower = layers
            .iter()
            .rev()
            .map(|p| p.to_string_lossy().to_string())
            .collect::<Vec<_>>()
            .join(":");
        let opts = format!(
            "lowerdir={lower},upperdir={},workdir={}",
            b.dir.join("upper").display(),
            b.dir.join("work").display()
        );
        let c = |s: &str| std::ffi::CString::new(s).unwrap();
        let (src, target, fstype, data) = (c("overlay"), c(&b.rootfs.to_string_lossy()), c("overlay"), c(&opts));
        // SAFETY: valid C strings for the duration of the call.
        if unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                0,
                data.as_ptr() as *const libc::c_void,
            )
        } != 0
        {
            return Err(format!(
                "mount overlay on {:?}: {}",
                b.rootfs,
                std::io::Error::last_os_error()
            ));
        }
        let mut cfg = config.clone();
        cfg["root"] = json!({"path": "rootfs", "readonly": false});
        cfg["process"]["args"] = json!(["/bin/sh", "-c", "echo hi"]);
        cfg["process"]["terminal"] = json!(false);
        cfg["linux"]["cgroupsPath"] = json!(format!("/opendsec-bench/{}", b.id));
        if let Some(o) = cfg.as_object_mut() {
            o.remove("annotations");
        }
        // The sandbox's network namespace (and the sysfs of it the edge bound at /sys) are
        // its own, gone by now: the raw run gets a new, empty namespace and its own sysfs,
        // as `crun run` of a plain bundle does.
        if let Some(nss) = cfg["linux"]["namespaces"].as_array_mut() {
            for ns in nss.iter_mut() {
                if ns["type"] == "network"
                    && let Some(o) = ns.as_object_mut()
                {
                    o.remove("path");
                }
            }
        }
        if let Some(mounts) = cfg["mounts"].as_array_mut() {
            for m in mounts.iter_mut() {
                if m["destination"] == "/sys" {
                    *m = json!({"destination": "/sys", "type": "sysfs", "source": "sysfs",
                                "options": ["nosuid", "noexec", "nodev", "ro"]});
                }
            }
            mounts.retain(|m| !matches!(m["destination"].as_str(), Some("/etc/resolv.conf" | "/etc/hosts")));
        }
        std::fs::write(b.dir.join("config.json"), serde_json::to_vec(&cfg).unwrap()).map_err(|e| e.to_string())?;
        Ok(b)
    }

    /// Spawn `rt run` and time it to the first stdout byte; then wait for it to finish.
    fn run(&self) -> Result<Duration, String> {
        let mut cmd = runtime_cmd(self.rt, &self.root, self.hybrid);
        cmd.args(["run", "--bundle"]).arg(&self.dir).arg(&self.id);
        time_first_stdout(cmd, self.rt)
    }
}

/// Spawns `cmd` (stdin closed) and times it to its first stdout byte; then waits for it
/// to finish, which it must do successfully.
pub(crate) fn time_first_stdout(mut cmd: std::process::Command, what: &str) -> Result<Duration, String> {
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let t0 = Instant::now();
    let mut child = cmd.spawn().map_err(|e| format!("spawn {what}: {e}"))?;
    let mut stdout = child.stdout.take().unwrap();
    let mut byte = [0u8; 64];
    let n = stdout.read(&mut byte).map_err(|e| e.to_string())?;
    let el = t0.elapsed();
    let mut rest = Vec::new();
    let _ = stdout.read_to_end(&mut rest);
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    let st = child.wait().map_err(|e| e.to_string())?;
    if n == 0 || !st.success() {
        return Err(format!(
            "{what} run: {st}, stdout {:?}, stderr {}",
            String::from_utf8_lossy(&byte[..n]),
            err.trim()
        ));
    }
    Ok(el)
}

impl Drop for RawBundle {
    fn drop(&mut self) {
        let _ = runtime_cmd(self.rt, &self.root, self.hybrid)
            .args(["delete", "--force", &self.id])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        umount_detach(&self.rootfs);
        if !is_mounted(&self.rootfs) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn image_layers(image_dir: &Path, image: &str) -> Result<Vec<PathBuf>, String> {
    let p = image_dir.join("images").join(format!("{image}.json"));
    let v: Value = serde_json::from_slice(&std::fs::read(&p).map_err(|e| format!("read {p:?}: {e}"))?)
        .map_err(|e| format!("{p:?}: {e}"))?;
    let layers: Vec<PathBuf> = v["layers"]
        .as_array()
        .ok_or_else(|| format!("{p:?}: no layers"))?
        .iter()
        .filter_map(|l| l.as_str())
        .map(|l| image_dir.join("layers").join(l))
        .collect();
    if layers.is_empty() || layers.iter().any(|l| !l.is_dir()) {
        return Err(format!("{p:?}: missing layer directories"));
    }
    Ok(layers)
}

fn raw_runs(
    rt: &'static str,
    base: &Path,
    layers: &[PathBuf],
    config: &Value,
    runs: usize,
) -> Result<Vec<Duration>, String> {
    let hybrid = host_is_cgroup_hybrid();
    let mut v = Vec::new();
    // One warm-up (page cache, binary), not counted.
    for i in 0..=runs {
        let b = RawBundle::prepare(base, rt, i, layers, config, hybrid)?;
        let d = b.run()?;
        if i > 0 {
            v.push(d);
        }
    }
    v.sort_unstable();
    Ok(v)
}

/// Raw `crun run` (and `runc run` unless skipped) of `config` under `base`, each
/// runtime's line into `report`; returns crun's p50. Removes `base` and the runtimes'
/// parent cgroups afterwards.
pub(super) async fn baseline(
    base: &Path,
    image_dir: &Path,
    image: &str,
    runs: usize,
    skip_runc: bool,
    config: Option<&Value>,
    report: &mut Results,
) -> Option<Duration> {
    let layers = image_layers(image_dir, image);
    let mut crun_p50 = None;
    match (config, &layers) {
        (Some(cfg), Ok(layers)) => {
            let rts: &[&'static str] = if skip_runc { &["crun"] } else { &["crun", "runc"] };
            for &rt in rts {
                eprintln!(
                    "== raw `{rt} run` of the edge's bundle (overlay of the {image} layer, no disk image), {runs} runs (+1 warm-up)"
                );
                let (base, layers, cfg) = (base.to_path_buf(), layers.clone(), cfg.clone());
                match tokio::task::spawn_blocking(move || raw_runs(rt, &base, &layers, &cfg, runs)).await {
                    Ok(Ok(v)) => {
                        if rt == "crun" {
                            crun_p50 = Some(percentile(&v, 0.5));
                        }
                        report.raw_runs(rt, &v);
                    }
                    Ok(Err(e)) => report.failure(format!("raw `{rt} run`: FAILED: {e}")),
                    Err(e) => report.failure(format!("raw `{rt} run`: panicked: {e}")),
                }
            }
        }
        (None, _) => report.failure("raw crun/runc: n/a (no sandbox config.json was captured)".into()),
        (_, Err(e)) => report.failure(format!("raw crun/runc: n/a ({e})")),
    }
    let _ = std::fs::remove_dir_all(base);
    remove_bench_cgroups();
    crun_p50
}

/// The raw runs' containers live in cgroups under `/opendsec-bench`: the runtimes remove
/// each container's cgroup but not that (empty) parent, removed here.
pub(crate) fn remove_bench_cgroups() {
    for c in std::fs::read_dir("/sys/fs/cgroup").into_iter().flatten().flatten() {
        let _ = std::fs::remove_dir(c.path().join("opendsec-bench"));
    }
    let _ = std::fs::remove_dir("/sys/fs/cgroup/opendsec-bench");
}
