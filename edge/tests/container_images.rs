//! The image store: the busybox image is built from the Debian package, published
//! atomically, reused from cache, and built once when several callers ask at once; the
//! `base` image has what E2B code calls (`python`, `pip`, `sudo` for `user`, `node`,
//! `npm`), checked by running each in the image as `user`.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opendsec_edge::images::{BuildPhase, ImageError, ImageStore};

fn require_prerequisites() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "building images needs root (file ownership)"
    );
    for (bin, package) in [("apt-get", "apt"), ("dpkg-deb", "dpkg")] {
        let found = ["/usr/bin", "/bin"].iter().any(|d| Path::new(d).join(bin).is_file());
        assert!(found, "{bin} is missing: install the {package} package");
    }
}

#[test]
fn busybox_image_builds_once_and_is_reused_from_cache() {
    require_prerequisites();
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();
    assert!(matches!(store.get("busybox"), Err(ImageError::NotFound(_))));

    // Three concurrent callers: one download, the same image for all.
    let downloads = Arc::new(Mutex::new(0));
    let images: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let (store, downloads) = (store.clone(), downloads.clone());
                s.spawn(move || {
                    store
                        .ensure("busybox", &|p| {
                            if p.phase == BuildPhase::Download && p.message.starts_with("apt-get download") {
                                *downloads.lock().unwrap() += 1;
                            }
                        })
                        .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(*downloads.lock().unwrap(), 1, "built more than once");
    assert!(images.windows(2).all(|w| w[0] == w[1]));
    let image = &images[0];
    assert_eq!(image.layers.len(), 1);
    let layer = store.layer_path(&image.layers[0]);
    for path in ["bin/busybox", "bin/sh", "etc/passwd", "etc/group"] {
        assert!(layer.join(path).symlink_metadata().is_ok(), "{path} missing");
    }
    let passwd = std::fs::read_to_string(layer.join("etc/passwd")).unwrap();
    assert!(passwd.contains("user:x:1000:1000:user:/home/user:/bin/sh"), "{passwd}");
    assert_eq!(std::fs::metadata(layer.join("home/user")).unwrap().uid(), 1000);
    assert_eq!(std::fs::metadata(layer.join("tmp")).unwrap().mode() & 0o7777, 0o1777);
    assert!(
        std::fs::read_dir(tmp.path().join("tmp")).unwrap().next().is_none(),
        "build leftovers in tmp/"
    );

    // Cached: the second ensure is instant and builds nothing.
    let start = Instant::now();
    let again = store.ensure("busybox", &|p| panic!("rebuilt: {p:?}")).unwrap();
    assert!(
        start.elapsed() < Duration::from_millis(50),
        "cached ensure took {:?}",
        start.elapsed()
    );
    assert_eq!(&again, image);
    assert_eq!(store.list().unwrap(), vec![again]);
    // A reopened store sees the same.
    assert_eq!(ImageStore::open(tmp.path()).unwrap().get("busybox").unwrap(), *image);
}

#[test]
fn unknown_or_invalid_image_names_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();
    assert!(matches!(
        store.ensure("nosuch", &|_| {}),
        Err(ImageError::UnknownImage(_))
    ));
    assert!(matches!(
        store.ensure("../etc", &|_| {}),
        Err(ImageError::InvalidName(_))
    ));
    assert!(matches!(store.get("nosuch"), Err(ImageError::NotFound(_))));
    assert!(store.list().unwrap().is_empty());
}

/// Images other than busybox are built once per machine and shared by the tests (as on
/// an edge; `code_interpreter.rs` builds on the same `base`).
const TEST_STORE: &str = "/var/tmp/opendsec-test-images";

fn require_base_prerequisites() {
    require_prerequisites();
    for (bin, package) in [
        ("debootstrap", "debootstrap"),
        ("chroot", "coreutils"),
        ("unshare", "util-linux"),
        ("mount", "mount"),
    ] {
        let found = ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
            .iter()
            .any(|d| Path::new(d).join(bin).is_file());
        assert!(found, "{bin} is missing: install the {package} package");
    }
}

/// Runs `script` with `sh -c` as `userspec` (`uid:gid`) chrooted into the image's layers:
/// an overlay with a throwaway upper dir under `scratch`, /proc and the host's /dev, in
/// a private mount namespace that ends with the process. The layers stay as built.
fn in_image(layers: &[PathBuf], scratch: &Path, userspec: &str, script: &str) -> Output {
    let (upper, work, root) = (scratch.join("upper"), scratch.join("work"), scratch.join("root"));
    for d in [&upper, &work, &root] {
        std::fs::create_dir_all(d).unwrap();
    }
    let lower: Vec<String> = layers.iter().rev().map(|p| p.display().to_string()).collect();
    let setup = format!(
        "set -e\n\
         mount -t overlay overlay -o lowerdir={},upperdir={},workdir={} {root}\n\
         mount -t proc proc {root}/proc\n\
         mount --bind /dev {root}/dev\n\
         exec chroot --userspec={userspec} {root} /usr/bin/env -i HOME=/home/user LANG=C.UTF-8 \
         PATH=/usr/local/bin:/usr/bin:/bin /bin/sh -c \"$1\"",
        lower.join(":"),
        upper.display(),
        work.display(),
        root = root.display(),
    );
    Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            &setup,
            "sh",
            script,
        ])
        .stdin(Stdio::null())
        .output()
        .expect("run unshare")
}

#[test]
fn base_image_runs_python_pip_node_npm_and_sudo_as_user() {
    require_base_prerequisites();
    let store = ImageStore::open(TEST_STORE).unwrap();
    let started = Instant::now();
    let image = store
        .ensure("base", &|p| eprintln!("[base] {}: {}", p.phase, p.message))
        .expect("build base");
    eprintln!("base ready in {:?}", started.elapsed());
    assert_eq!(image.config.user, "user");
    assert_eq!(image.config.shell, "/bin/bash");
    let layers = store.layer_dirs(&image).unwrap();
    let layer = &layers[0];
    let passwd = std::fs::read_to_string(layer.join("etc/passwd")).unwrap();
    assert!(
        passwd.contains("\nuser:x:1000:1000::/home/user:/bin/bash\n"),
        "{passwd}"
    );
    let home = std::fs::metadata(layer.join("home/user")).unwrap();
    assert_eq!((home.uid(), home.gid()), (1000, 1000));
    // sudo reads a drop-in only if root owns it and nobody may write it.
    let sudoers = layer.join("etc/sudoers.d/user");
    let meta = std::fs::symlink_metadata(&sudoers).expect("/etc/sudoers.d/user");
    assert_eq!((meta.uid(), meta.mode() & 0o7777), (0, 0o440));
    assert_eq!(
        std::fs::read_to_string(&sudoers).unwrap(),
        "user ALL=(ALL:ALL) NOPASSWD: ALL\n"
    );
    for dir in ["var/lib/apt/lists", "var/cache/apt/archives"] {
        for entry in std::fs::read_dir(layer.join(dir)).unwrap().filter_map(Result::ok) {
            let name = entry.file_name().to_string_lossy().into_owned();
            assert!(
                !entry.path().is_file() || name == "lock",
                "{dir}/{name} left in the layer"
            );
        }
    }

    let scratch = tempfile::tempdir_in("/var/tmp").unwrap();
    let check = |n: usize, userspec: &str, script: &str, wants: &str| {
        let out = in_image(&layers, &scratch.path().join(n.to_string()), userspec, script);
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            out.status.success(),
            "`{script}` as {userspec} failed ({}): {stdout}{stderr}",
            out.status
        );
        assert!(
            stdout.contains(wants),
            "`{script}` printed {stdout:?}{stderr:?}, not {wants:?}"
        );
        eprintln!("{script}: {}", stdout.trim());
    };
    let user = "1000:1000";
    check(0, user, "id -un; echo $HOME", "user\n/home/user");
    check(1, user, "python --version", "Python 3.");
    check(
        2,
        user,
        "python3 -c 'import sys; print(sys.executable)'",
        "/usr/bin/python3",
    );
    check(3, user, "pip --version", "(python 3.");
    check(4, user, "node --version", "v");
    check(5, user, "npm --version", ".");
    check(6, user, "sudo -n true && sudo -n id -u", "0");
    check(
        7,
        "0:0",
        "/usr/sbin/visudo -cf /etc/sudoers.d/user && /usr/sbin/visudo -c",
        "parsed OK",
    );
    // PEP 668 does not stop pip: `pip install --user` of a local package (no network).
    check(
        8,
        user,
        "mkdir /tmp/demo && cd /tmp/demo && echo 'X = 42' > demo.py && \
         printf 'from setuptools import setup\\nsetup(name=\"demo\", version=\"1.0\", py_modules=[\"demo\"])\\n' > setup.py && \
         pip install -q --user --no-index --no-build-isolation /tmp/demo && cd / && python -c 'import demo; print(demo.X)'",
        "42",
    );
}
