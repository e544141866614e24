//! Garbage collection of the image store (`images/gc.rs`): `image rm` removes a record
//! and a collection then frees what nothing uses: layers, VM disks, stale scratch.
//! Never collected: what an image record or a live edge's in-use set names (a running
//! sandbox's layers, a VM's disk), even when another process shares the store.
//!
//! Needs root (layer owners) like `oci_images.rs`, whose helpers build the images.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime};

use opendsec_edge::images::{GcOptions, Holder, Image, ImageStore, InUse};

mod oci_support;

use oci_support::*;

/// Collect at once: no grace for young layers.
const NOW: GcOptions = GcOptions {
    lease: Duration::from_secs(600),
    grace: Duration::ZERO,
};

/// Imports an OCI layout of `layers` as `name`.
fn import(store: &ImageStore, name: &str, layers: Vec<Vec<u8>>) -> Image {
    let layout = write_layout(&TestImage::new(layers));
    let tarball = tempfile::NamedTempFile::new().unwrap();
    {
        let mut builder = tar::Builder::new(std::fs::File::create(tarball.path()).unwrap());
        builder.append_dir_all(".", layout.dir.path()).unwrap();
        builder.finish().unwrap();
    }
    store.import(tarball.path(), name, &|_| {}).unwrap()
}

fn layer(name: &str) -> Vec<u8> {
    LayerTar::new().file(name, name.as_bytes()).bytes()
}

fn root() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "the image GC tests need root (layer owners)"
    );
}

#[test]
fn a_layer_shared_by_two_images_survives_removing_one_and_goes_with_the_last() {
    root();
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();
    let one = import(&store, "one", vec![layer("shared"), layer("one")]);
    let two = import(&store, "two", vec![layer("shared"), layer("two")]);
    assert_eq!(one.layers[0], two.layers[0]);
    assert_eq!(store.collect(NOW).unwrap().count(), 0, "everything is used");

    assert!(store.remove("one").unwrap());
    let freed = store.collect(NOW).unwrap();
    assert_eq!(freed.layers, vec![one.layers[1].clone()]);
    assert!(freed.bytes > 0);
    assert_eq!(store.get("two").unwrap(), two, "the other image is whole");

    assert!(store.remove("two").unwrap());
    assert!(!store.remove("two").unwrap(), "removed once");
    let freed = store.collect(NOW).unwrap();
    assert_eq!(sorted(&freed.layers), sorted(&two.layers));
    let left = contents(tmp.path());
    assert!(
        left["layers"].is_empty() && left["images"].is_empty() && left["tmp"].is_empty(),
        "{left:?}"
    );
}

#[test]
fn a_layer_a_running_sandbox_uses_survives_rm_and_collection_until_the_sandbox_is_gone() {
    root();
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();
    let image = import(&store, "app", vec![layer("bottom"), layer("top")]);

    // The edge's in-use set as it makes it: the JSON records of its sandboxes (a
    // container's record names its layers by path, a VM's by id and its disk by path).
    let sandboxes = tempfile::tempdir().unwrap();
    let container = sandboxes.path().join("sb-1");
    std::fs::create_dir(&container).unwrap();
    let dirs = store.layer_dirs(&image).unwrap();
    std::fs::write(
        container.join("sandbox.json"),
        serde_json::to_vec(&serde_json::json!({"id": "sb-1", "layers": dirs})).unwrap(),
    )
    .unwrap();
    let mut set = InUse::default();
    set.scan_dir(&store, sandboxes.path(), 3);
    assert_eq!(set.layers, image.layers.iter().cloned().collect());
    store.publish_in_use("edge-1", &set).unwrap();

    assert!(store.remove("app").unwrap());
    assert_eq!(store.collect(NOW).unwrap().count(), 0, "the sandbox's layers are kept");
    assert!(dirs.iter().all(|d| d.is_dir()));

    // The sandbox is deleted: the edge's next set no longer names the layers.
    std::fs::remove_dir_all(&container).unwrap();
    let mut set = InUse::default();
    set.scan_dir(&store, sandboxes.path(), 3);
    store.publish_in_use("edge-1", &set).unwrap();
    assert_eq!(sorted(&store.collect(NOW).unwrap().layers), sorted(&image.layers));

    // A set its edge stopped refreshing (the edge is gone) keeps nothing.
    let again = import(&store, "again", vec![layer("again")]);
    store.remove("again").unwrap();
    store
        .publish_in_use(
            "gone",
            &InUse {
                layers: again.layers.iter().cloned().collect(),
                ..InUse::default()
            },
        )
        .unwrap();
    let old = SystemTime::now() - Duration::from_secs(3600);
    let file = std::fs::File::options()
        .write(true)
        .open(tmp.path().join("inuse/gone.json"))
        .unwrap();
    file.set_modified(old).unwrap();
    assert_eq!(store.collect(NOW).unwrap().layers, again.layers);

    // So is a fresh set of an edge of this machine whose data directory is gone.
    let last = import(&store, "last", vec![layer("last")]);
    store.remove("last").unwrap();
    let gone_dir = tempfile::tempdir().unwrap();
    let set = InUse {
        layers: last.layers.iter().cloned().collect(),
        holder: Some(Holder::here(gone_dir.path())),
        ..InUse::default()
    };
    store.publish_in_use("edge-of-a-test", &set).unwrap();
    assert_eq!(store.collect(NOW).unwrap().count(), 0, "its directory is there");
    drop(gone_dir);
    assert_eq!(store.collect(NOW).unwrap().layers, last.layers);
}

#[test]
fn a_young_layer_is_kept_for_the_grace_period() {
    root();
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();
    let image = import(&store, "young", vec![layer("young")]);
    store.remove("young").unwrap();
    // A pack or pull between publishing its layer and writing its record looks like this.
    assert_eq!(store.collect(GcOptions::default()).unwrap().count(), 0);
    assert_eq!(store.collect(NOW).unwrap().layers, image.layers);
}

const HELPER_STORE: &str = "OPENDSEC_TEST_GC_STORE";
const HELPER_LAYER: &str = "OPENDSEC_TEST_GC_LAYER";

#[test]
fn two_processes_on_one_store_never_collect_a_layer_the_other_uses() {
    root();
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();
    let image = import(&store, "shared-store", vec![layer("used-elsewhere"), layer("unused")]);
    store.remove("shared-store").unwrap();

    // Another process (another edge on the same directory) uses the bottom layer: it
    // publishes its set, and holds it until told to stop (its stdin closes).
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "helper_process_uses_a_layer_when_started_by_the_two_process_test",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HELPER_STORE, tmp.path())
        .env(HELPER_LAYER, &image.layers[0])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    loop {
        let line = lines.next().expect("the helper ended early").unwrap();
        if line.ends_with("USING") {
            break;
        }
    }
    let freed = store.collect(NOW).unwrap();
    assert_eq!(freed.layers, vec![image.layers[1].clone()]);
    assert!(store.layer_path(&image.layers[0]).is_dir());

    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    assert_eq!(store.collect(NOW).unwrap().layers, vec![image.layers[0].clone()]);
}

/// Not a specification: the process the two-process test starts (it returns at once in
/// a normal run, where the variables are unset).
#[test]
fn helper_process_uses_a_layer_when_started_by_the_two_process_test() {
    let (Some(dir), Ok(layer)) = (std::env::var_os(HELPER_STORE), std::env::var(HELPER_LAYER)) else {
        return;
    };
    let store = ImageStore::open(dir).unwrap();
    let owner = format!("helper-{}", std::process::id());
    store
        .publish_in_use(
            &owner,
            &InUse {
                layers: [layer].into_iter().collect(),
                ..InUse::default()
            },
        )
        .unwrap();
    println!("USING");
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut std::io::stdin(), &mut rest);
    store.withdraw_in_use(&owner).unwrap();
}

fn touch_at(path: &Path, age: Duration) {
    std::fs::write(path, b"disk").unwrap();
    let file = std::fs::File::options().write(true).open(path).unwrap();
    file.set_modified(SystemTime::now() - age).unwrap();
}

#[test]
fn boot_disks_of_removed_images_and_old_disks_never_collected_go_and_current_or_used_ones_stay() {
    root();
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();
    import(&store, "kept", vec![layer("kept")]);
    let gone = import(&store, "127.0.0.1:5000/gone:v1", vec![layer("gone")]);
    let disks = tmp.path().join("vmdisks");
    std::fs::create_dir(&disks).unwrap();
    let hour = Duration::from_secs(3600);
    for (name, age) in [
        // The image that stays: its newest disks of each kind stay, older keys go.
        ("kept-00000000000000a1.erofs", 3 * hour),
        ("kept-00000000000000a2.erofs", 2 * hour),
        ("kept-00000000000000b1.qcow2", 3 * hour),
        ("kept-00000000000000b1.json", 3 * hour),
        ("kept-00000000000000b2.qcow2", 2 * hour),
        ("kept-00000000000000b2.json", 2 * hour),
        // The removed image: all its disks go, but for the one a VM runs from.
        (&format!("{}-00000000000000c1.erofs", gone.file_stem()), 2 * hour),
        (&format!("{}-00000000000000c2.qcow2", gone.file_stem()), 2 * hour),
        (&format!("{}-00000000000000c2.json", gone.file_stem()), 2 * hour),
        (&format!("{}-00000000000000c3.qcow2", gone.file_stem()), 2 * hour),
        // Templates stay; a builder's scratch goes once stale.
        ("empty-256M.ext4", 100 * hour),
        (".00000000000000d1.1234.tmp", 100 * hour),
    ] {
        touch_at(&disks.join(name), age);
    }
    store.remove("127.0.0.1:5000/gone:v1").unwrap();
    let running_vm = format!("{}-00000000000000c3.qcow2", gone.file_stem());
    let mut set = InUse::default();
    set.add_references_in(
        &store,
        &serde_json::json!({"root_disk": disks.join(&running_vm), "layers": gone.layers}),
    );
    assert!(set.disks.contains(&running_vm));
    store.publish_in_use("edge-1", &set).unwrap();

    let freed = store.collect(NOW).unwrap();
    let stem = gone.file_stem();
    assert_eq!(
        freed.disks,
        sorted(&[
            ".00000000000000d1.1234.tmp".to_string(),
            format!("{stem}-00000000000000c1.erofs"),
            format!("{stem}-00000000000000c2.json"),
            format!("{stem}-00000000000000c2.qcow2"),
            "kept-00000000000000a1.erofs".to_string(),
            "kept-00000000000000b1.json".to_string(),
            "kept-00000000000000b1.qcow2".to_string(),
        ])
    );
    assert!(freed.layers.is_empty(), "the running VM's layers stay: {freed:?}");
    let mut left: Vec<String> = std::fs::read_dir(&disks)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        sorted(&[
            running_vm,
            "empty-256M.ext4".to_string(),
            "kept-00000000000000a2.erofs".to_string(),
            "kept-00000000000000b2.json".to_string(),
            "kept-00000000000000b2.qcow2".to_string(),
        ])
    );
}

#[test]
fn stale_scratch_goes_and_work_under_way_stays() {
    root();
    let tmp = tempfile::tempdir().unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();
    let scratch = tmp.path().join("tmp");
    let old_build = scratch.join("base-0123456789abcdef.4242");
    let new_build = scratch.join("base-0123456789abcdef.4343");
    let dead_pull = scratch.join(format!(
        "pull.{}.00000000000000aa.{}",
        1u32 << 23,
        nix::unistd::gethostname().unwrap().to_string_lossy()
    ));
    for dir in [&old_build, &new_build, &dead_pull] {
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("sub/file"), b"12345").unwrap();
    }
    let file = std::fs::File::open(&old_build).unwrap();
    file.set_modified(SystemTime::now() - Duration::from_secs(48 * 3600))
        .unwrap();
    let freed = store.collect(NOW).unwrap();
    assert_eq!(
        freed.scratch,
        sorted(&[
            old_build.file_name().unwrap().to_string_lossy().into_owned(),
            dead_pull.file_name().unwrap().to_string_lossy().into_owned(),
        ])
    );
    assert_eq!(freed.bytes, 10);
    assert_eq!(
        contents(tmp.path())["tmp"],
        vec!["base-0123456789abcdef.4343".to_string()]
    );
}
