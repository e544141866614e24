//! An image layer as a pull installs it: a blob (gzip, zstd or a plain tar, told by its
//! magic) unpacked by our own unpacker into a fresh directory, with small limits
//! (8 MiB, 512 entries) so that the limits' paths are reached. Whatever the tar holds,
//! the unpacker refuses or unpacks it without a panic, and writes nothing outside the
//! layer's directory (checked beside it: the temporary directory holds only the blob
//! and the layer).
//!
//! Input: the layer blob.
#![no_main]

use libfuzzer_sys::fuzz_target;
use opendsec_edge::images::fuzzing;

const MAX_BYTES: u64 = 8 << 20;
const MAX_ENTRIES: u64 = 512;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let blob = dir.path().join("blob");
    std::fs::write(&blob, data).expect("the blob written");
    let blob = std::fs::File::open(&blob).expect("the blob");
    let _ = fuzzing::unpack_layer(blob, &dir.path().join("layer"), MAX_BYTES, MAX_ENTRIES);
    for entry in std::fs::read_dir(dir.path()).expect("the temporary directory") {
        let name = entry.expect("an entry").file_name();
        assert!(
            name == "blob" || name == "layer",
            "the unpacker wrote {name:?} beside its layer"
        );
    }
});
