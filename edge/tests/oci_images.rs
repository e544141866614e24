//! OCI images into the edge's image store, against a real registry on loopback (Debian's
//! `docker-registry`, seeded with `skopeo copy` from OCI layouts these tests write by
//! hand): pulls stack layers and keep the image's config, reuse and share layers, honour
//! basic auth, refuse corrupt and hostile images without leaving anything behind, and
//! are safe when several stores (threads, processes, two FUSE mounts of one directory
//! standing for a network file system) pull into one directory; tarballs (docker-archive,
//! OCI layout) import the same way.
//!
//! Needs root (layer owners, whiteout devices, overlay xattrs) and the packages
//! `docker-registry`, `skopeo`, `apache2-utils` (htpasswd), `util-linux` (unshare) and
//! `bindfs` (FUSE): `ops/lib.sh`'s IMAGE_TEST_PACKAGES.

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

use opendsec_edge::images::{ImageError, ImageStore, PullOptions, RegistryAuth};
use serde_json::json;
use sha2::{Digest, Sha256};

mod oci_support;

use oci_support::*;

// ---- the specifications ---------------------------------------------------------------

#[test]
fn a_pulled_image_stacks_its_layers_and_records_its_config_and_a_second_pull_fetches_nothing() {
    require("pull");
    let registry = Registry::start();
    let bottom = LayerTar::new()
        .dir("etc/")
        .file("etc/hello", b"hello")
        .file("etc/gone", b"deleted above")
        .dir("var/cache/")
        .file("var/cache/old", b"hidden by an opaque dir above")
        .entry(tar::EntryType::Regular, "usr/bin/sudo", "", b"#!/bin/true\n", 0o4755)
        .bytes();
    let top = LayerTar::new()
        .file("etc/.wh.gone", b"")
        .dir("var/cache/")
        .file("var/cache/.wh..wh..opq", b"")
        .file("var/cache/new", b"new")
        .file("/srv/absolute", b"a leading slash is dropped, as Docker does")
        .bytes();
    let mut image = TestImage::new(vec![bottom, top]);
    image.run = json!({
        "Env": ["PATH=/usr/bin:/bin", "GREETING=hi"],
        "WorkingDir": "/srv",
        "User": "1000:1000",
        "Entrypoint": ["/usr/bin/app"],
        "Cmd": ["--port", "8080"],
        "ExposedPorts": {"8080/tcp": {}, "53/udp": {}},
        "Labels": {"org.example.team": "sandboxes"},
    });
    let layout = write_layout(&image);
    let reference = registry.push(layout.dir.path(), "team/app", "v1");

    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();
    let steps = Steps::default();
    let pulled = store
        .pull(&reference, &PullOptions::default(), &|p| steps.record(p))
        .unwrap();

    // The record: layers by diff_id, the reference, the manifest's digest, the config.
    let ids: Vec<String> = layout.diff_ids.iter().map(|d| d.replace(':', "-")).collect();
    assert_eq!(pulled.layers, ids);
    assert_eq!(pulled.name, reference);
    assert_eq!(pulled.reference.as_deref(), Some(reference.as_str()));
    assert_eq!(pulled.digest.as_deref(), Some(layout.manifest.as_str()));
    assert_eq!(pulled.config.env, ["PATH=/usr/bin:/bin", "GREETING=hi"]);
    assert_eq!(pulled.config.workdir, "/srv");
    assert_eq!(pulled.config.user, "1000:1000");
    assert_eq!(pulled.config.entrypoint, ["/usr/bin/app"]);
    assert_eq!(pulled.config.cmd, ["--port", "8080"]);
    assert_eq!(pulled.config.exposed_ports, ["53/udp", "8080/tcp"]);
    assert_eq!(pulled.config.labels["org.example.team"], "sandboxes");
    assert_eq!(store.get(&reference).unwrap(), pulled);
    assert_eq!(store.list().unwrap(), vec![pulled.clone()]);
    let last = steps.last();
    assert_eq!((last.layers_done, last.layers_total), (2, 2));
    assert_eq!(last.bytes_done, last.bytes_total);
    assert_eq!(steps.count("fetching layer"), 2);

    // On disk: the whiteouts overlayfs reads, setuid kept, the absolute path inside.
    let layers = store.layer_dirs(&pulled).unwrap();
    let gone = std::fs::symlink_metadata(layers[1].join("etc/gone")).unwrap();
    assert!(gone.file_type().is_char_device() && gone.rdev() == 0, "no whiteout");
    let sudo = std::fs::metadata(layers[0].join("usr/bin/sudo")).unwrap();
    assert_eq!(sudo.permissions().mode() & 0o7777, 0o4755);
    assert!(layers[1].join("srv/absolute").is_file());
    assert!(!Path::new("/srv/absolute").exists(), "wrote outside the layer");
    // Stacked: what the upper layer deleted is gone, its opaque dir hides the lower one.
    let view = merged_view(&layers);
    for present in [
        "./etc/hello f",
        "./var/cache/new f",
        "./usr/bin/sudo f",
        "./srv/absolute f",
    ] {
        assert!(view.lines().any(|l| l == present), "{present} missing from:\n{view}");
    }
    for absent in ["./etc/gone", "./var/cache/old"] {
        assert!(!view.contains(absent), "{absent} shows through:\n{view}");
    }
    assert!(contents(tmp.path())["tmp"].is_empty());

    // Again: the manifest is read, no layer is fetched.
    let again = Steps::default();
    let repulled = store
        .pull(&reference, &PullOptions::default(), &|p| again.record(p))
        .unwrap();
    assert_eq!(repulled, pulled);
    assert_eq!(again.count("fetching layer"), 0);
    assert_eq!(again.last().bytes_total, 0);
    assert_eq!(again.last().layers_done, 2);
}

#[test]
fn a_layer_shared_by_two_images_is_stored_once() {
    require("pull");
    let registry = Registry::start();
    let base = LayerTar::new().file("etc/os-release", b"ID=test\n").bytes();
    let extra = LayerTar::new().file("opt/app", b"app").bytes();
    let one = write_layout(&TestImage::new(vec![base.clone()]));
    let two = write_layout(&TestImage::new(vec![base, extra]));
    let first = registry.push(one.dir.path(), "one", "v1");
    let second = registry.push(two.dir.path(), "two", "v1");

    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();
    let a = pull(&store, &first).unwrap();
    let steps = Steps::default();
    let b = store
        .pull(&second, &PullOptions::default(), &|p| steps.record(p))
        .unwrap();
    assert_eq!(b.layers[0], a.layers[0]);
    assert_eq!(steps.count("fetching layer"), 1, "the shared layer was fetched again");
    assert_eq!(contents(tmp.path())["layers"].len(), 2);
    assert_eq!(contents(tmp.path())["images"].len(), 2);
}

#[test]
fn basic_auth_refuses_missing_and_wrong_credentials_clearly_and_pulls_with_the_right_ones() {
    require("auth");
    let registry = Registry::start_with_auth("puller", "s3cret");
    let reference = push_layer(&registry, "private", LayerTar::new().file("secret", b"x").bytes());
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();

    let err = pull(&store, &reference).unwrap_err();
    eprintln!("no credentials: {err}");
    assert!(
        matches!(&err, ImageError::Unauthorized { who, .. } if who.contains("anonymous")),
        "{err}"
    );
    let wrong = PullOptions {
        auth: RegistryAuth::Basic {
            username: "puller".into(),
            password: "guess".into(),
        },
        ..PullOptions::default()
    };
    let err = store.pull(&reference, &wrong, &|_| {}).unwrap_err();
    let message = err.to_string();
    eprintln!("wrong credentials: {message}");
    assert!(matches!(err, ImageError::Unauthorized { .. }), "{message}");
    assert!(
        message.contains("\"puller\"") && message.contains(&registry.host()),
        "{message}"
    );
    assert!(
        !message.contains("guess") && !format!("{wrong:?}").contains("guess"),
        "a password leaked"
    );
    assert!(contents(tmp.path()).values().all(Vec::is_empty));

    let right = PullOptions {
        auth: RegistryAuth::Basic {
            username: "puller".into(),
            password: "s3cret".into(),
        },
        ..PullOptions::default()
    };
    let image = store.pull(&reference, &right, &|_| {}).unwrap();
    assert!(store.layer_dirs(&image).unwrap()[0].join("secret").is_file());
}

#[test]
fn blobs_that_do_not_match_their_digests_fail_the_pull_and_store_nothing() {
    require("digests");
    let registry = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();
    let empty = contents(tmp.path());

    // A layer blob corrupted on the registry's disk (same size, one byte flipped).
    let layout = write_layout(&TestImage::new(vec![LayerTar::new().file("f", &[1; 4096]).bytes()]));
    let reference = registry.push(layout.dir.path(), "corrupt", "v1");
    let blob = registry.blob_file(&layout.blobs[0]);
    let mut bytes = std::fs::read(&blob).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&blob, bytes).unwrap();
    let err = pull(&store, &reference).unwrap_err();
    eprintln!("corrupt layer blob: {err}");
    assert!(
        matches!(&err, ImageError::DigestMismatch { expected, .. } if *expected == layout.blobs[0]),
        "{err}"
    );
    assert_eq!(contents(tmp.path()), empty);

    // A config whose diff_id lies about the (intact) layer's contents.
    let mut lying = TestImage::new(vec![LayerTar::new().file("g", b"g").bytes()]);
    lying.diff_ids = Some(vec![sha256(b"something else")]);
    let layout = write_layout(&lying);
    let reference = registry.push(layout.dir.path(), "lying", "v1");
    let err = pull(&store, &reference).unwrap_err();
    eprintln!("lying diff_id: {err}");
    assert!(
        matches!(&err, ImageError::DigestMismatch { what, .. } if what.contains("diff_id")),
        "{err}"
    );
    assert_eq!(contents(tmp.path()), empty);

    // A corrupted config blob.
    let layout = write_layout(&TestImage::new(vec![LayerTar::new().file("h", b"h").bytes()]));
    let reference = registry.push(layout.dir.path(), "badconfig", "v1");
    let config = registry.blob_file(&layout.config);
    let mut bytes = std::fs::read(&config).unwrap();
    bytes[0] = b' ';
    std::fs::write(&config, bytes).unwrap();
    let err = pull(&store, &reference).unwrap_err();
    eprintln!("corrupt config: {err}");
    assert!(matches!(err, ImageError::DigestMismatch { .. }), "{err}");
    assert_eq!(contents(tmp.path()), empty);
}

#[test]
fn hostile_layers_fail_the_pull_naming_the_entry_and_store_nothing() {
    require("unsafe layers");
    let registry = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();
    let empty = contents(tmp.path());
    let passwd_before = std::fs::read("/etc/passwd").unwrap();
    let cases: Vec<(&str, Vec<u8>, &str, &str)> = vec![
        ("dotdot", LayerTar::new().file("../x", b"x").bytes(), "../x", "`..`"),
        (
            "symlink",
            LayerTar::new()
                .entry(tar::EntryType::Symlink, "a", "/etc", b"", 0o777)
                .file("a/passwd", b"root::0:0::/:/bin/sh\n")
                .bytes(),
            "a/passwd",
            "through the symlink a",
        ),
        (
            "hardlink",
            LayerTar::new()
                .entry(tar::EntryType::Link, "x", "../../x", b"", 0o644)
                .bytes(),
            "x",
            "`..`",
        ),
        (
            "device",
            LayerTar::new()
                .entry(tar::EntryType::Char, "dev/mem", "", b"", 0o600)
                .bytes(),
            "dev/mem",
            "device file",
        ),
        (
            "whiteout",
            LayerTar::new().file("a", b"").file(".wh.a", b"").bytes(),
            ".wh.a",
            "also holds",
        ),
    ];
    for (repo, layer, entry_name, why) in cases {
        let reference = push_layer(&registry, repo, layer);
        let result = pull(&store, &reference);
        if let Err(e) = &result {
            eprintln!("{repo}: {e}");
        }
        match result {
            Err(ImageError::UnsafeEntry { entry, reason, .. }) => {
                assert_eq!(entry, entry_name, "{repo}");
                assert!(reason.contains(why), "{repo}: {reason}");
            }
            other => panic!("{repo}: expected a refused entry, got {other:?}"),
        }
        assert_eq!(contents(tmp.path()), empty, "{repo} left something");
    }
    assert_eq!(std::fs::read("/etc/passwd").unwrap(), passwd_before);

    // Too many layers: refused from the manifest, before anything is fetched.
    let one = LayerTar::new().file("x", b"x").bytes();
    let layout = write_layout(&TestImage::new(vec![one; 129]));
    let reference = registry.push(layout.dir.path(), "tall", "v1");
    let err = pull(&store, &reference).unwrap_err();
    eprintln!("too many layers: {err}");
    assert!(
        matches!(&err, ImageError::BadImage { reason, .. } if reason.contains("129 layers")),
        "{err}"
    );
    assert_eq!(contents(tmp.path()), empty);

    // A registry that is not there.
    let nowhere = format!("127.0.0.1:{}/nothing:v1", free_port());
    let err = pull(&store, &nowhere).unwrap_err();
    let message = err.to_string();
    eprintln!("unknown registry: {message}");
    assert!(matches!(err, ImageError::Registry { .. }), "{message}");
    assert!(
        message.contains("cannot reach registry") && message.contains("refused"),
        "{message}"
    );
    // Not a reference at all.
    assert!(matches!(
        pull(&store, "ubuntu:22.04"),
        Err(ImageError::InvalidReference { .. })
    ));
    assert_eq!(contents(tmp.path()), empty);
}

#[test]
fn an_index_is_resolved_to_its_linux_amd64_image_when_pulled_and_imported() {
    require("index");
    let registry = Registry::start();
    let arm = TestImage::new(vec![LayerTar::new().file("arch", b"arm64").bytes()]);
    let amd = TestImage::new(vec![LayerTar::new().file("arch", b"amd64").bytes()]);
    // arm64 first: the choice is by platform, not by position.
    let layout = write_layout_of_index(&[("arm64", &arm), ("amd64", &amd)]);
    let reference = registry.push(layout.dir.path(), "multi", "v1");
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();
    let pulled = pull(&store, &reference).unwrap();
    assert_eq!(
        pulled.digest.as_deref(),
        Some(layout.manifest.as_str()),
        "not the amd64 manifest"
    );
    let layer = &store.layer_dirs(&pulled).unwrap()[0];
    assert_eq!(std::fs::read(layer.join("arch")).unwrap(), b"amd64");

    // The same layout as a tarball.
    let tarball = tmp.path().join("multi.tar");
    let mut builder = tar::Builder::new(std::fs::File::create(&tarball).unwrap());
    builder.append_dir_all(".", layout.dir.path()).unwrap();
    builder.finish().unwrap();
    drop(builder);
    let imported = store.import(&tarball, "multi", &|_| {}).unwrap();
    assert_eq!(imported.layers, pulled.layers);
    assert_eq!(imported.digest, pulled.digest);

    // An index without linux/amd64 is refused, naming what it has.
    let only_arm = write_layout_of_index(&[("arm64", &arm)]);
    let reference = registry.push(only_arm.dir.path(), "armonly", "v1");
    let err = pull(&store, &reference).unwrap_err().to_string();
    assert!(
        err.contains("no linux/amd64 image") && err.contains("linux/arm64"),
        "{err}"
    );
}

/// An image big enough that concurrent pulls overlap: two layers of 8 MiB.
fn big_image(registry: &Registry) -> (String, Vec<String>) {
    let noise = |seed: u8| -> Vec<u8> {
        let mut block = Sha256::digest([seed]).to_vec();
        let mut out = Vec::with_capacity(8 << 20);
        while out.len() < 8 << 20 {
            block = Sha256::digest(&block).to_vec();
            out.extend_from_slice(&block);
        }
        out
    };
    let layers = vec![
        LayerTar::new().file("a.bin", &noise(1)).bytes(),
        LayerTar::new().file("b.bin", &noise(2)).bytes(),
    ];
    let layout = write_layout(&TestImage::new(layers));
    let reference = registry.push(layout.dir.path(), "big", "v1");
    let ids = layout.diff_ids.iter().map(|d| d.replace(':', "-")).collect();
    (reference, ids)
}

#[test]
fn two_stores_on_one_directory_pulling_one_image_at_once_unpack_each_layer_once() {
    require("concurrent pulls");
    let registry = Registry::start();
    let (reference, ids) = big_image(&registry);
    let tmp = tempfile::tempdir().unwrap();
    // Two stores on one directory, as two edges sharing it: their own single-flight
    // maps, so only the per-layer locks keep them from unpacking twice.
    let stores = [
        ImageStore::open(tmp.path()).unwrap(),
        ImageStore::open(tmp.path()).unwrap(),
    ];
    let (images, steps) = pull_at_once(&stores, &reference);
    assert_eq!(images[0], images[1]);
    assert_eq!(images[0].layers, ids);
    for (i, steps) in steps.iter().enumerate() {
        let lines: Vec<String> = steps.0.lock().unwrap().iter().map(|p| p.current.clone()).collect();
        eprintln!("store {i}: {}", lines.join(" | "));
    }
    let unpacked: usize = steps.iter().map(|s| s.count("unpacking layer")).sum();
    assert_eq!(unpacked, 2, "each layer once between the two stores");
    let store = contents(tmp.path());
    assert_eq!(store["layers"], sorted(&ids));
    assert!(store["tmp"].is_empty(), "{store:?}");

    // One store, several threads: one pull between them (single flight).
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();
    let steps = Steps::default();
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                store
                    .pull(&reference, &PullOptions::default(), &|p| steps.record(p))
                    .unwrap()
            });
        }
    });
    assert_eq!(steps.count("resolving"), 1, "the threads did not share one pull");
}

/// One directory mounted through FUSE (`bindfs`) at a mount point of its own, as a
/// machine mounts a network file system's export; unmounted when dropped.
/// `lock_forwarding`: whether `flock` reaches the directory below (NFSv4 and CephFS carry
/// locks between clients), or stays within this mount (a file system whose locks do not
/// cross machines).
struct FuseMount {
    dir: tempfile::TempDir,
}

impl FuseMount {
    fn new(backing: &Path, lock_forwarding: bool) -> FuseMount {
        assert!(
            Path::new("/usr/bin/bindfs").is_file(),
            "bindfs is missing: install the bindfs package (ops/lib.sh IMAGE_TEST_PACKAGES)"
        );
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new("bindfs");
        if lock_forwarding {
            cmd.args(["--enable-lock-forwarding", "--multithreaded"]);
        }
        let out = cmd.arg(backing).arg(dir.path()).output().unwrap();
        assert!(
            out.status.success(),
            "bindfs {} (FUSE, /dev/fuse): {}",
            backing.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        FuseMount { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}

/// Pulls `reference` into each store at once: the images, and each store's steps.
fn pull_at_once(stores: &[ImageStore], reference: &str) -> (Vec<opendsec_edge::images::Image>, Vec<Steps>) {
    let steps: Vec<Steps> = stores.iter().map(|_| Steps::default()).collect();
    let images = std::thread::scope(|s| {
        let handles: Vec<_> = stores
            .iter()
            .zip(&steps)
            .map(|(store, steps)| {
                s.spawn(move || {
                    store
                        .pull(reference, &PullOptions::default(), &|p| steps.record(p))
                        .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    (images, steps)
}

#[test]
fn two_stores_on_two_fuse_mounts_of_one_directory_pull_one_image_at_once_and_agree() {
    require("a store on a network file system");
    let registry = Registry::start();
    let (reference, ids) = big_image(&registry);
    for lock_forwarding in [true, false] {
        let backing = tempfile::tempdir().unwrap();
        let mounts = [
            FuseMount::new(backing.path(), lock_forwarding),
            FuseMount::new(backing.path(), lock_forwarding),
        ];
        let stores = [
            ImageStore::open(mounts[0].path()).unwrap(),
            ImageStore::open(mounts[1].path()).unwrap(),
        ];
        let (images, steps) = pull_at_once(&stores, &reference);
        let unpacked: usize = steps.iter().map(|s| s.count("unpacking layer")).sum();
        eprintln!("lock forwarding {lock_forwarding}: {unpacked} layer unpacks between the two mounts");
        assert_eq!(images[0], images[1], "both machines see one image");
        assert_eq!(images[0].layers, ids);
        if lock_forwarding {
            assert_eq!(unpacked, 2, "locks that cross mounts: each layer unpacked once");
        } else {
            // Locks that stay within a mount: both may unpack a layer, and the second
            // publish finds the first's; what is visible is whole either way.
            assert!((2..=4).contains(&unpacked), "{unpacked}");
        }
        let store = contents(backing.path());
        assert_eq!(store["layers"], sorted(&ids), "lock forwarding {lock_forwarding}");
        assert!(store["tmp"].is_empty(), "nothing half-written is left: {store:?}");
        assert_eq!(store["images"].len(), 1);
        // What each mount shows is the whole layer, as the registry has it.
        for (mount, store) in mounts.iter().zip(&stores) {
            let dirs = store.layer_dirs(&images[0]).unwrap();
            assert!(dirs.iter().all(|d| d.starts_with(mount.path())));
            for (dir, name) in dirs.iter().zip(["a.bin", "b.bin"]) {
                assert_eq!(
                    std::fs::metadata(dir.join(name)).unwrap().len(),
                    8 << 20,
                    "{}",
                    dir.display()
                );
            }
        }
        drop(stores);
    }
}

/// Set by the two-process test for the processes it starts (see
/// `helper_process_pulls_when_started_by_the_two_process_test`).
const HELPER_STORE: &str = "OPENDSEC_OCI_TEST_HELPER_STORE";
const HELPER_REFERENCE: &str = "OPENDSEC_OCI_TEST_HELPER_REFERENCE";

#[test]
fn two_processes_pulling_one_image_into_one_store_unpack_each_layer_once() {
    require("concurrent pulls");
    let registry = Registry::start();
    let (reference, ids) = big_image(&registry);
    let tmp = tempfile::tempdir().unwrap();
    let children: Vec<Child> = (0..2)
        .map(|_| {
            Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "helper_process_pulls_when_started_by_the_two_process_test",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(HELPER_STORE, tmp.path())
                .env(HELPER_REFERENCE, &reference)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut unpacked = 0;
    for child in children {
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "helper failed: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("PULLED"), "the helper did not pull: {stdout}");
        unpacked += stdout.lines().filter(|l| l.starts_with("STEP unpacking layer")).count();
    }
    assert_eq!(unpacked, 2, "each layer once between the two processes");
    let store = contents(tmp.path());
    assert_eq!(store["layers"], sorted(&ids));
    assert!(store["tmp"].is_empty(), "{store:?}");
    assert_eq!(store["images"].len(), 1);
}

/// Not a specification: the entry point of the processes the two-process test starts
/// (it returns at once in a normal run, where the variables are unset).
#[test]
fn helper_process_pulls_when_started_by_the_two_process_test() {
    let (Some(store), Some(reference)) = (std::env::var_os(HELPER_STORE), std::env::var(HELPER_REFERENCE).ok()) else {
        return;
    };
    let store = ImageStore::open(store).unwrap();
    let last = Mutex::new(String::new());
    store
        .pull(&reference, &PullOptions::default(), &|p| {
            let mut last = last.lock().unwrap();
            if *last != p.current {
                println!("STEP {}", p.current);
                *last = p.current.clone();
            }
        })
        .unwrap();
    println!("PULLED");
}

#[test]
fn docker_archives_and_oci_layout_tarballs_import_like_pulls() {
    require("import");
    let bottom = LayerTar::new().file("etc/issue", b"imported\n").bytes();
    let top = LayerTar::new().file("etc/.wh.issue", b"").file("app", b"app").bytes();
    let mut image = TestImage::new(vec![bottom, top]);
    image.run = json!({"Cmd": ["/app"], "WorkingDir": "/"});
    let layout = write_layout(&image);
    let ids: Vec<String> = layout.diff_ids.iter().map(|d| d.replace(':', "-")).collect();
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();

    // An OCI layout, tarred as `docker save` (Docker 25+) or `skopeo … oci-archive:` do.
    let oci_tar = tmp.path().join("oci.tar");
    {
        let mut builder = tar::Builder::new(std::fs::File::create(&oci_tar).unwrap());
        builder.append_dir_all(".", layout.dir.path()).unwrap();
        builder.finish().unwrap();
    }
    let steps = Steps::default();
    let imported = store.import(&oci_tar, "from-oci", &|p| steps.record(p)).unwrap();
    assert_eq!(imported.name, "from-oci");
    assert_eq!(imported.layers, ids);
    assert_eq!(imported.digest.as_deref(), Some(layout.manifest.as_str()));
    assert_eq!(
        (imported.config.cmd.as_slice(), imported.config.workdir.as_str()),
        (&["/app".to_string()][..], "/")
    );
    assert_eq!(store.get("from-oci").unwrap(), imported);
    let layers = store.layer_dirs(&imported).unwrap();
    assert!(
        std::fs::symlink_metadata(layers[1].join("etc/issue"))
            .unwrap()
            .file_type()
            .is_char_device()
    );
    assert_eq!(steps.count("fetching layer"), 2);

    // A docker-archive (`docker save`'s classic format), made by skopeo from the layout,
    // stored under a reference: it shares the layers already stored.
    let archive = tmp.path().join("docker.tar");
    let out = Command::new("skopeo")
        .args(["copy", "--quiet", "--insecure-policy"])
        .arg(format!("oci:{}:v1", layout.dir.path().display()))
        .arg(format!("docker-archive:{}:example/app:v1", archive.display()))
        .output()
        .expect("running skopeo (the skopeo package)");
    assert!(out.status.success(), "skopeo: {}", String::from_utf8_lossy(&out.stderr));
    let steps = Steps::default();
    let from_docker = store
        .import(&archive, "registry.example/app:v1", &|p| steps.record(p))
        .unwrap();
    assert_eq!(from_docker.layers, ids);
    assert_eq!(from_docker.config, imported.config);
    let config_id = from_docker.digest.as_deref().unwrap_or_default();
    assert!(
        config_id.len() == 71 && config_id.starts_with("sha256:"),
        "a docker-archive is named by its config's digest: {config_id}"
    );
    assert_eq!(steps.count("fetching layer"), 0, "the layers were stored already");
    assert_eq!(store.get("registry.example/app:v1").unwrap(), from_docker);

    // The same docker-archive into a fresh store: unpacked from the archive's layer tars.
    let fresh_dir = tempfile::tempdir().unwrap();
    let fresh = ImageStore::open(fresh_dir.path()).unwrap();
    let again = fresh.import(&archive, "docker-app", &|_| {}).unwrap();
    assert_eq!(again.layers, ids);
    assert!(fresh.layer_dirs(&again).unwrap()[1].join("app").is_file());

    // Gzipped tarballs import too; a tarball that is neither format is refused.
    let gz = tmp.path().join("oci.tar.gz");
    std::fs::write(&gz, gzip(&std::fs::read(&oci_tar).unwrap())).unwrap();
    assert_eq!(fresh.import(&gz, "from-gzip", &|_| {}).unwrap().layers, ids);
    let junk = tmp.path().join("junk.tar");
    {
        let mut builder = tar::Builder::new(std::fs::File::create(&junk).unwrap());
        let mut header = tar::Header::new_gnu();
        header.set_size(1);
        header.set_mode(0o644);
        builder.append_data(&mut header, "readme", &b"x"[..]).unwrap();
        builder.finish().unwrap();
    }
    let err = fresh.import(&junk, "junk", &|_| {}).unwrap_err();
    assert!(err.to_string().contains("neither an OCI layout"), "{err}");
    assert!(contents(fresh_dir.path())["tmp"].is_empty());
}
