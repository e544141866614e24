//! OCI manifests, indexes and image configs as a pull reads them from a registry or a
//! tarball: size limits first, then the manifest (an index gives its linux/amd64
//! manifest; an image manifest is checked: layer count, media types, digests, sizes),
//! then the config planned against the manifest's layers (platform, diff_ids, run
//! settings).
//!
//! Input: a manifest, the byte 0xff, an image config (no 0xff: the config is empty).
#![no_main]

use libfuzzer_sys::fuzz_target;
use opendsec_edge::images::fuzzing;
use opendsec_fuzz::MANIFEST_CONFIG_SEPARATOR;

fuzz_target!(|data: &[u8]| {
    let (manifest, config) = match data.iter().position(|b| *b == MANIFEST_CONFIG_SEPARATOR) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &[][..]),
    };
    let blobs = fuzzing::read_manifest(manifest).unwrap_or_default();
    let _ = fuzzing::plan_config(config, &blobs);
});
