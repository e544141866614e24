//! The image store: the busybox image is built from the Debian package, published
//! atomically, reused from cache, and built once when several callers ask at once.

use std::path::Path;
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
    use std::os::unix::fs::MetadataExt;
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
