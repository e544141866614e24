//! Packs: an image made from one of this edge's container sandboxes (`PackSandbox`,
//! reported as `ReportImage` like a pull): the sandbox's own layers (the snapshot chain or
//! fork copies it starts from, then what it wrote, read frozen) become image-store layers
//! on top of the layers its image stacks.
//!
//! Each own layer is written as an OCI layer tar without residue ([`Residue`]), its
//! setuid and setgid bits and file capabilities dropped (a sandbox's files never land on
//! the host with privilege), then stored under its diff_id (`images::write_layer`,
//! `ImageStore::add_layer`). The image record lists the store's layers and the new ones,
//! the parent image's config, and labels saying where it came from
//! (`org.opendsec.pack.*`); its digest is the SHA-256 of that record. A pack runs on a
//! thread beside the loop and is listed with the pulls (one name is made once at a time;
//! its phase shows in heartbeats).
//!
//! Only what the sandbox wrote is scrubbed: files of the image it started from are that
//! image's (to leave one out, delete it in the sandbox before packing: the deletion is
//! packed, and a deletion is never residue).

use super::{Edge, EdgeError};
use crate::images::{Image, LayerTar, PullProgress, write_layer};
use opendsec_commands::ImageResult;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Names of shell and tool histories left out of home directories (`/root`, `/home/*`).
const HISTORIES: &[&str] = &[
    ".bash_history",
    ".ash_history",
    ".sh_history",
    ".zsh_history",
    ".python_history",
    ".node_repl_history",
    ".psql_history",
    ".mysql_history",
    ".sqlite_history",
    ".lesshst",
    ".viminfo",
    ".wget-hsts",
];

/// What a pack leaves out of a sandbox's layers: what the agent and the runtime put there
/// (`/.opendsec`), what is volatile (what `/tmp`, `/var/tmp` and `/run` hold; the
/// directories stay), shell histories in home directories, caches (`~/.cache`, apt's
/// downloaded packages and lists, `__pycache__`), and the caller's paths.
pub(super) struct Residue {
    /// The caller's paths, relative to the root.
    scrub: Vec<PathBuf>,
}

impl Residue {
    /// `scrub`: absolute paths, as `PackSandbox` checked them.
    pub(super) fn new(scrub: &[String]) -> Residue {
        Residue {
            scrub: scrub.iter().map(|p| PathBuf::from(p.trim_start_matches('/'))).collect(),
        }
    }

    /// Whether `path` (relative to the sandbox's root: `root/.cache`) is left out, with
    /// everything it holds.
    pub(super) fn skips(&self, path: &Path) -> bool {
        let c: Vec<&[u8]> = path.iter().map(|c| c.as_bytes()).collect();
        let residue = match c.as_slice() {
            [b".opendsec", ..] => true,
            [b"tmp" | b"run", _, ..] | [b"var", b"tmp", _, ..] => true,
            [b"root", b".cache", ..] | [b"home", _, b".cache", ..] => true,
            [b"root", name] | [b"home", _, name] => HISTORIES.iter().any(|h| h.as_bytes() == *name),
            [b"var", b"cache", b"apt", b"archives", name] => name.ends_with(b".deb"),
            [b"var", b"cache", b"apt", name] => name.ends_with(b".bin"),
            [b"var", b"lib", b"apt", b"lists", b"partial", _, ..] => true,
            [b"var", b"lib", b"apt", b"lists", name, ..] => !matches!(*name, b"lock" | b"partial"),
            _ => false,
        };
        residue || c.contains(&b"__pycache__".as_slice()) || self.scrub.iter().any(|s| path.starts_with(s))
    }
}

/// The edge that packed the image sandbox `d` names, when it names a packed image: the
/// log names the edge holding the state a sandbox starts from, and a plain create (no
/// snapshot, fork or transfer) starts from such state only when its image was packed.
pub(super) fn packed_on(d: &crate::desired::DesiredSandbox) -> Option<&str> {
    let plain = d.snapshot.is_none() && d.fork_of.is_none() && d.transfer.is_none();
    d.source_edge.as_deref().filter(|_| plain && d.image_source.is_none())
}

impl Edge {
    /// Starts packing image `name` from `sandbox` beside the loop (unless `name` is being
    /// made already); the result is reported to the log.
    pub(super) fn start_pack(self: &Arc<Self>, name: String, sandbox: String, scrub: Vec<String>) {
        if !self.pulls.begin(&name) {
            return;
        }
        let phase = PullProgress {
            current: format!("packing sandbox {sandbox}"),
            ..Default::default()
        };
        self.pulls.update(&name, &phase);
        let edge = self.clone();
        std::thread::Builder::new()
            .name(format!("pack {name}"))
            .spawn(move || {
                tracing::info!(image = %name, %sandbox, "packing");
                let result = match edge.pack(&name, &sandbox, &scrub) {
                    Ok(image) => ImageResult::Ready {
                        digest: image.digest.clone().unwrap_or_default(),
                        size_bytes: edge
                            .images
                            .layer_dirs(&image)
                            .map(|dirs| dirs.iter().map(|d| super::files::dir_size(d)).sum())
                            .unwrap_or(0),
                        layers: image.layers.len() as u32,
                    },
                    // A path in the sandbox may be in the reason: fitted to what the log takes.
                    Err(e) => ImageResult::Failed {
                        reason: super::fit_reason(&e.to_string()),
                    },
                };
                tracing::info!(image = %name, ?result, "pack done");
                let reported = edge.rt.block_on(edge.report_image(&name, &result));
                edge.pulls.end(&name, reported);
                edge.wake.notify_one();
            })
            .expect("spawning a pack thread");
    }

    /// Makes image `name` from `sandbox` and stores it (see the module doc).
    fn pack(&self, name: &str, sandbox: &str, scrub: &[String]) -> Result<Image, EdgeError> {
        let d = self
            .slice
            .lock()
            .expect("slice lock")
            .sandboxes
            .get(sandbox)
            .cloned()
            .ok_or_else(|| EdgeError::Store(format!("sandbox {sandbox} is not on this edge")))?;
        // Only its config is taken: the stored record as it is (a built-in image whose
        // recipe changed since is not rebuilt for it), else whatever a create would use.
        let parent = match self.images.get(&d.image) {
            Ok(image) => image,
            Err(_) => self.image_for(&d)?,
        };
        let residue = Residue::new(scrub);
        let skip = |p: &Path| residue.skips(p);
        let scratch = self.images.scratch_dir()?;
        let mut written = 0;
        let mut write = |layer: &Path| -> Result<(PathBuf, LayerTar), EdgeError> {
            let tar = scratch.path().join(format!("layer-{written}.tar"));
            written += 1;
            let made = write_layer(layer, &tar, &skip)?;
            tracing::debug!(image = %name, layer = %layer.display(), ?made, "layer written");
            Ok((tar, made))
        };
        let store_layers = self.images.root().join("layers");
        let (mut layers, own) = self
            .backend(d.isolation)
            .pack_layers(sandbox, &store_layers, &mut write)?;
        for (tar, made) in &own {
            layers.push(self.images.add_layer(tar, &made.diff_id)?);
            std::fs::remove_file(tar)?;
        }
        let mut config = parent.config.clone();
        let changes = self
            .slice
            .lock()
            .expect("slice lock")
            .packs
            .get(name)
            .and_then(|p| p.config.clone());
        if let Some(c) = &changes {
            config.apply(c);
        }
        config.labels.extend([
            ("org.opendsec.pack.sandbox".to_string(), sandbox.to_string()),
            ("org.opendsec.pack.image".to_string(), d.image.clone()),
            ("org.opendsec.pack.project".to_string(), d.project.clone()),
            (
                "org.opendsec.pack.created-ms".to_string(),
                opendsec_edge_api::now_ms().to_string(),
            ),
            (
                "org.opendsec.pack.scrubbed".to_string(),
                serde_json::to_string(scrub).expect("strings serialise"),
            ),
        ]);
        let mut image = Image {
            name: name.to_string(),
            layers,
            config,
            reference: None,
            digest: None,
        };
        use sha2::Digest;
        let record = serde_json::to_vec(&image).expect("an image serialises");
        image.digest = Some(format!("sha256:{}", hex::encode(sha2::Sha256::digest(record))));
        self.images.put(&image)?;
        Ok(image)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::images::ImageStore;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn residue() -> Residue {
        Residue::new(&["/etc/token".into(), "/srv/secrets".into()])
    }

    #[test]
    fn residue_is_what_the_agent_the_shell_and_caches_leave_and_the_callers_paths() {
        let r = residue();
        for left_out in [
            ".opendsec",
            ".opendsec/agent",
            "tmp/secret",
            "tmp/a/b",
            "var/tmp/x",
            "run/lock",
            "root/.bash_history",
            "root/.ash_history",
            "home/user/.bash_history",
            "home/user/.python_history",
            "home/user/.node_repl_history",
            "root/.lesshst",
            "root/.viminfo",
            "root/.cache",
            "root/.cache/pip/x",
            "home/user/.cache",
            "var/cache/apt/archives/hello_1.0_amd64.deb",
            "var/cache/apt/pkgcache.bin",
            "var/lib/apt/lists/deb.debian.org_debian_dists_bookworm_InRelease",
            "var/lib/apt/lists/partial/x",
            "usr/lib/python3/dist-packages/x/__pycache__",
            "home/user/app/__pycache__/m.cpython-311.pyc",
            "etc/token",
            "srv/secrets",
            "srv/secrets/key",
        ] {
            assert!(r.skips(Path::new(left_out)), "{left_out} is kept");
        }
        for kept in [
            "tmp",
            "var/tmp",
            "run",
            "root",
            "root/.bashrc",
            "home/user",
            "home/user/project/.bash_history",
            "usr/local/bin/hello",
            "var/cache/apt/archives",
            "var/cache/apt/archives/lock",
            "var/lib/apt/lists",
            "var/lib/apt/lists/lock",
            "var/lib/apt/lists/partial",
            "var/lib/dpkg/status",
            "etc/token2",
            "etc",
            "srv",
            "opendsec",
        ] {
            assert!(!r.skips(Path::new(kept)), "{kept} is left out");
        }
    }

    /// A sandbox's writable layer as overlayfs leaves it, packed through the store: the
    /// package stays, residue goes, deletions and opaque directories stay, setuid goes.
    #[test]
    fn a_packed_layer_keeps_what_was_installed_and_deletions_and_loses_residue_and_privileges() {
        use std::ffi::CString;
        let tmp = tempfile::tempdir().unwrap();
        let upper = tmp.path().join("upper");
        let mk = |p: &str, contents: &[u8], mode: u32| {
            let path = upper.join(p);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, contents).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        mk("usr/local/bin/hello", b"#!/bin/sh\necho packed\n", 0o755);
        mk("usr/local/bin/rootshell", b"#!/bin/sh\n", 0o4755);
        mk("usr/local/bin/groupshell", b"#!/bin/sh\n", 0o2711);
        mk("tmp/secret", b"s", 0o600);
        mk("var/tmp/x", b"x", 0o600);
        mk("run/agent.pid", b"1", 0o644);
        mk(".opendsec/agent", b"agent", 0o755);
        mk("root/.bash_history", b"echo secret", 0o600);
        mk("root/.cache/x", b"x", 0o600);
        mk("home/user/.cache/pip/y", b"y", 0o600);
        mk("home/user/.python_history", b"h", 0o600);
        mk("home/user/notes", b"kept", 0o640);
        mk("var/cache/apt/archives/hello_1.0_amd64.deb", b"deb", 0o644);
        mk("var/lib/apt/lists/deb.debian.org_InRelease", b"l", 0o644);
        mk("var/lib/apt/lists/lock", b"", 0o640);
        mk("usr/lib/python3/x/__pycache__/m.pyc", b"c", 0o644);
        mk("etc/token", b"t0ken", 0o600);
        mk("etc/hostname", b"box", 0o644);
        std::fs::create_dir_all(upper.join("var/lib/apt/lists/partial")).unwrap();
        std::fs::create_dir_all(upper.join("usr/bin")).unwrap();
        std::fs::hard_link(upper.join("usr/local/bin/hello"), upper.join("usr/bin/hello-again")).unwrap();
        std::os::unix::fs::symlink("/usr/local/bin/hello", upper.join("usr/local/bin/hi")).unwrap();
        // A deletion of a lower file (a whiteout) in a kept place and in /tmp, and an
        // opaque directory: overlayfs's own marks.
        for wh in ["etc/motd", "tmp/.X11-unix"] {
            let c = CString::new(upper.join(wh).as_os_str().as_bytes()).unwrap();
            assert_eq!(
                unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR, 0) },
                0,
                "mknod (needs root)"
            );
        }
        std::fs::create_dir_all(upper.join("opt/app")).unwrap();
        std::fs::write(upper.join("opt/app/new"), b"n").unwrap();
        let c = CString::new(upper.join("opt/app").as_os_str().as_bytes()).unwrap();
        let set = unsafe {
            libc::setxattr(
                c.as_ptr(),
                c"trusted.overlay.opaque".as_ptr(),
                b"y".as_ptr().cast(),
                1,
                0,
            )
        };
        assert_eq!(
            set,
            0,
            "marking opaque (needs root): {}",
            std::io::Error::last_os_error()
        );
        // A file capability on the installed program.
        let mut cap = [0u8; 20];
        cap[0..4].copy_from_slice(&0x0200_0000u32.to_le_bytes());
        cap[4..8].copy_from_slice(&(1u32 << 7).to_le_bytes());
        let c = CString::new(upper.join("usr/local/bin/hello").as_os_str().as_bytes()).unwrap();
        let set = unsafe {
            libc::lsetxattr(
                c.as_ptr(),
                c"security.capability".as_ptr(),
                cap.as_ptr().cast(),
                cap.len(),
                0,
            )
        };
        assert_eq!(set, 0, "setting a capability: {}", std::io::Error::last_os_error());
        std::os::unix::fs::chown(upper.join("home/user/notes"), Some(1000), Some(1000)).unwrap();

        let store = ImageStore::open(tmp.path().join("store")).unwrap();
        let r = residue();
        let skip = |p: &Path| r.skips(p);
        let tar = tmp.path().join("layer.tar");
        let made = write_layer(&upper, &tar, &skip).unwrap();
        let id = store.add_layer(&tar, &made.diff_id).unwrap();
        assert_eq!(id, made.diff_id.replace(':', "-"));
        let layer = store.layer_path(&id);

        // The same tree gives the same layer.
        let again = write_layer(&upper, &tmp.path().join("again.tar"), &skip).unwrap();
        assert_eq!(again.diff_id, made.diff_id);
        assert_eq!(
            store.add_layer(&tmp.path().join("again.tar"), &again.diff_id).unwrap(),
            id
        );

        let meta = |p: &str| std::fs::symlink_metadata(layer.join(p));
        assert_eq!(
            std::fs::read(layer.join("usr/local/bin/hello")).unwrap(),
            b"#!/bin/sh\necho packed\n"
        );
        assert_eq!(meta("usr/local/bin/hello").unwrap().mode() & 0o7777, 0o755);
        assert_eq!(
            meta("usr/local/bin/rootshell").unwrap().mode() & 0o7777,
            0o755,
            "setuid kept"
        );
        assert_eq!(
            meta("usr/local/bin/groupshell").unwrap().mode() & 0o7777,
            0o711,
            "setgid kept"
        );
        let c = CString::new(layer.join("usr/local/bin/hello").as_os_str().as_bytes()).unwrap();
        let n = unsafe { libc::lgetxattr(c.as_ptr(), c"security.capability".as_ptr(), std::ptr::null_mut(), 0) };
        assert_eq!(n, -1, "the capability was packed");
        assert_eq!(
            meta("usr/bin/hello-again").unwrap().ino(),
            meta("usr/local/bin/hello").unwrap().ino(),
            "a hard link stays one file"
        );
        assert_eq!(
            std::fs::read_link(layer.join("usr/local/bin/hi")).unwrap(),
            Path::new("/usr/local/bin/hello")
        );
        let notes = meta("home/user/notes").unwrap();
        assert_eq!((notes.uid(), notes.gid(), notes.mode() & 0o777), (1000, 1000, 0o640));
        assert_eq!(std::fs::read(layer.join("etc/hostname")).unwrap(), b"box");
        for gone in [
            "tmp/secret",
            "var/tmp/x",
            "run/agent.pid",
            ".opendsec",
            "root/.bash_history",
            "root/.cache",
            "home/user/.cache",
            "home/user/.python_history",
            "var/cache/apt/archives/hello_1.0_amd64.deb",
            "var/lib/apt/lists/deb.debian.org_InRelease",
            "usr/lib/python3/x/__pycache__",
            "etc/token",
        ] {
            assert!(meta(gone).is_err(), "{gone} was packed");
        }
        for kept in [
            "tmp",
            "var/tmp",
            "run",
            "var/lib/apt/lists/lock",
            "var/lib/apt/lists/partial",
        ] {
            assert!(meta(kept).is_ok(), "{kept} was left out");
        }
        // Deletions stay deletions, wherever they are; the opaque mark stays.
        for wh in ["etc/motd", "tmp/.X11-unix"] {
            let m = meta(wh).unwrap();
            assert!(
                std::os::unix::fs::FileTypeExt::is_char_device(&m.file_type()) && m.rdev() == 0,
                "{wh} is no whiteout"
            );
        }
        let c = CString::new(layer.join("opt/app").as_os_str().as_bytes()).unwrap();
        let mut v = [0u8; 4];
        let n = unsafe { libc::lgetxattr(c.as_ptr(), c"trusted.overlay.opaque".as_ptr(), v.as_mut_ptr().cast(), 4) };
        assert_eq!((n, &v[..1]), (1, &b"y"[..]), "the opaque mark was lost");
        assert_eq!(std::fs::read(layer.join("opt/app/new")).unwrap(), b"n");
        // Nothing of the work is left in the store's tmp/.
        assert_eq!(std::fs::read_dir(tmp.path().join("store/tmp")).unwrap().count(), 0);
    }

    #[test]
    fn only_a_plain_create_naming_a_source_edge_names_a_packed_image() {
        let mut d = crate::desired::DesiredSandbox {
            id: "s1".into(),
            project: "p".into(),
            image: "swe-env".into(),
            cpu_millis: 100,
            memory_mb: 64,
            labels: Default::default(),
            expires_at_ms: None,
            fork_of: None,
            desired: opendsec_projections::Desired::Running,
            observed: opendsec_projections::Observed::Pending,
            kill_reason: None,
            env: Default::default(),
            auto_pause_filesystem: false,
            pause_filesystem: false,
            auto_pause: false,
            snapshot: None,
            isolation: Default::default(),
            source_edge: Some("a".into()),
            transfer: None,
            oom_kills: 0,
            cpu_class: Default::default(),
            image_source: None,
            network: None,
        };
        assert_eq!(packed_on(&d), Some("a"));
        d.snapshot = Some("snap-0123456789abcdef".into());
        assert_eq!(packed_on(&d), None);
        d.snapshot = None;
        d.fork_of = Some("s0".into());
        assert_eq!(packed_on(&d), None);
        d.fork_of = None;
        d.source_edge = None;
        assert_eq!(packed_on(&d), None);
        let err = EdgeError::PackedElsewhere {
            image: "swe-env".into(),
            edge: "a".into(),
        };
        assert!(
            err.to_string()
                .starts_with("image swe-env was packed on edge a and is not in this edge's store"),
            "{err}"
        );
    }

    #[test]
    fn a_name_a_layer_cannot_hold_fails_the_pack_unless_it_is_scrubbed() {
        let tmp = tempfile::tempdir().unwrap();
        let upper = tmp.path().join("upper");
        std::fs::create_dir_all(upper.join("srv")).unwrap();
        std::fs::write(upper.join("srv/.wh.config"), b"x").unwrap();
        let err = write_layer(&upper, &tmp.path().join("a.tar"), &|_| false).unwrap_err();
        assert!(err.to_string().contains(".wh."), "{err}");
        let r = Residue::new(&["/srv/.wh.config".into()]);
        write_layer(&upper, &tmp.path().join("b.tar"), &|p| r.skips(p)).unwrap();
    }
}
