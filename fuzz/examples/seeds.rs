//! Writes the seed corpus of every fuzz target into `corpus/<target>/`: a few valid
//! inputs each, made with the project's own encoders (and its golden logs), so that the
//! fuzzer starts from what real peers, files and clients send. Run from anywhere:
//!
//! ```sh
//! cargo run --manifest-path fuzz/Cargo.toml --example seeds
//! ```
//!
//! The files are committed; rerunning rewrites them (same bytes for the same sources).
//! Beside them, `regression-*` files are inputs that once crashed a target: kept by hand.

use std::path::{Path, PathBuf};

use opendsec_fuzz::{LIVE_GENERATION, MANIFEST_CONFIG_SEPARATOR, log_entries};

fn main() -> std::io::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let corpus = root.join("corpus");
    let tour = std::fs::read(root.join("../replay-tests/golden/v1/control-plane-tour.log"))?;
    let options = std::fs::read(root.join("../replay-tests/golden/v1/sandbox-options-and-snapshots.log"))?;
    let batches: Vec<&[u8]> = log_entries(&tour).map(|(_, b)| b).collect();

    let mut seeds = Seeds { corpus, written: 0 };
    event_batch(&mut seeds, &tour, &options)?;
    peer_frames(&mut seeds, &batches)?;
    journal_recovery(&mut seeds, &batches)?;
    agent_connect(&mut seeds)?;
    layer_unpack(&mut seeds)?;
    oci_manifest(&mut seeds)?;
    println!("{} seeds, {} bytes", seeds.written, seeds.bytes()?);
    Ok(())
}

struct Seeds {
    corpus: PathBuf,
    written: usize,
}

impl Seeds {
    fn write(&mut self, target: &str, name: &str, bytes: &[u8]) -> std::io::Result<()> {
        let dir = self.corpus.join(target);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(name), bytes)?;
        self.written += 1;
        Ok(())
    }

    fn bytes(&self) -> std::io::Result<u64> {
        let mut total = 0;
        for target in std::fs::read_dir(&self.corpus)? {
            for seed in std::fs::read_dir(target?.path())? {
                total += seed?.metadata()?.len();
            }
        }
        Ok(total)
    }
}

/// The first `n` entries of a golden log, in its framing.
fn first_entries(log: &[u8], n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for (index, entry) in log_entries(log).take(n) {
        out.extend_from_slice(&index.to_le_bytes());
        out.extend_from_slice(&(entry.len() as u32).to_le_bytes());
        out.extend_from_slice(entry);
    }
    out
}

/// The golden logs as they are (real batches of every kind, denials included), and
/// their openings.
fn event_batch(seeds: &mut Seeds, tour: &[u8], options: &[u8]) -> std::io::Result<()> {
    seeds.write("event_batch", "control-plane-tour", tour)?;
    seeds.write("event_batch", "sandbox-options-and-snapshots", options)?;
    seeds.write("event_batch", "tour-first-8", &first_entries(tour, 8))?;
    seeds.write("event_batch", "options-first-4", &first_entries(options, 4))
}

/// A follower's view of a replication connection: the opening with the cluster key,
/// then append requests carrying real batches; read whole and in small pieces.
fn peer_frames(seeds: &mut Seeds, batches: &[&[u8]]) -> std::io::Result<()> {
    let connection = |versions: &[u16], key: &[u8], requests: &[Vec<u8>]| {
        let mut hello = vec![versions.len() as u8];
        for v in versions {
            hello.extend_from_slice(&v.to_be_bytes());
        }
        hello.extend_from_slice(key);
        let mut wire = opendsec_log::replication::PROTOCOL.magic.to_vec();
        opendsec_log::frames::put(&mut wire, &hello);
        for r in requests {
            opendsec_log::frames::put(&mut wire, r);
        }
        wire
    };
    let heartbeat = opendsec_log::fuzzing::append_request_of(7, &[]);
    let appends = opendsec_log::fuzzing::append_request_of(0, &batches[..3]);
    let more = opendsec_log::fuzzing::append_request_of(3, &batches[3..5]);
    for (name, piece, wire) in [
        (
            "appends",
            0u8,
            connection(&[1], b"cluster-key", &[appends.clone(), more]),
        ),
        (
            "appends-in-3-byte-pieces",
            3,
            connection(&[1], b"cluster-key", &[appends]),
        ),
        ("heartbeat-two-versions", 0, connection(&[1, 2], b"k", &[heartbeat])),
        ("hello-only-no-key", 1, connection(&[1], b"", &[])),
    ] {
        let mut input = vec![piece];
        input.extend_from_slice(&wire);
        seeds.write("peer_frames", name, &input)?;
    }
    Ok(())
}

/// Journals as the store leaves them: whole records of real batches before the
/// preallocated zeros, one torn at its end, one of an older generation.
fn journal_recovery(seeds: &mut Seeds, batches: &[&[u8]]) -> std::io::Result<()> {
    let journal = opendsec_log::fuzzing::journal_of(LIVE_GENERATION, 1, &batches[..4]);
    let with_zeros = |mut j: Vec<u8>| {
        j.resize(j.len() + 256, 0);
        j
    };
    let mut torn = journal.clone();
    let last = torn.len() - 3;
    torn[last] ^= 0x5a;
    let older = opendsec_log::fuzzing::journal_of(LIVE_GENERATION - 1, 1, &batches[..2]);
    let one = opendsec_log::fuzzing::journal_of(LIVE_GENERATION, 41, &batches[4..5]);
    for (name, mode, file) in [
        ("four-records", 0u8, with_zeros(journal.clone())),
        ("four-records-sealed", 1, with_zeros(journal)),
        ("torn-last-record", 0, with_zeros(torn)),
        ("older-generation", 0, with_zeros(older)),
        ("one-record-at-41", 1, one),
    ] {
        let mut input = vec![mode];
        input.extend_from_slice(&file);
        seeds.write("journal_recovery", name, &input)?;
    }
    Ok(())
}

/// A Connect envelope: flags, a big-endian length, the message.
fn envelope(flags: u8, msg: &[u8]) -> Vec<u8> {
    let mut out = vec![flags];
    out.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    out.extend_from_slice(msg);
    out
}

/// Requests as the E2B SDKs send them: streaming calls (Start, StreamInput, WatchDir)
/// in envelopes ending with the end-of-stream one, and unary bodies of each method.
fn agent_connect(seeds: &mut Seeds) -> std::io::Result<()> {
    let end = envelope(0x02, b"{}");
    let start = br#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"},"cwd":"/home/user"},"pty":{"size":{"cols":80,"rows":"24"}},"tag":"t1","stdin":true}"#;
    let input_start = br#"{"start":{"process":{"pid":"42"}}}"#;
    let input_data = br#"{"data":{"input":{"stdin":"aGVsbG8K"}}}"#;
    let watch = br#"{"path":"/home/user","recursive":true,"includeEntry":true}"#;
    let stream = |messages: &[&[u8]]| {
        let mut body = Vec::new();
        for m in messages {
            body.extend_from_slice(&envelope(0, m));
        }
        body.extend_from_slice(&end);
        body
    };
    for (name, mode, piece, body) in [
        ("stream-start", 0u8, 0u8, stream(&[start])),
        (
            "stream-input-in-pieces",
            0,
            4,
            stream(&[input_start, input_data, input_data]),
        ),
        ("stream-watch", 0, 0, stream(&[watch])),
        (
            "unary-send-input",
            1,
            0,
            br#"{"process":{"tag":"t1"},"input":{"pty":"bHMK"}}"#.to_vec(),
        ),
        (
            "unary-send-signal",
            3,
            0,
            br#"{"process":{"pid":12},"signal":"SIGNAL_SIGKILL"}"#.to_vec(),
        ),
        (
            "unary-update",
            7,
            2,
            br#"{"process":{"pid":null},"pty":{"size":{"cols":"100","rows":30}}}"#.to_vec(),
        ),
        ("unary-stat", 9, 0, br#"{"path":"/etc/hosts","depth":"2"}"#.to_vec()),
        (
            "unary-move",
            11,
            0,
            br#"{"source":"/tmp/a","destination":"/tmp/b"}"#.to_vec(),
        ),
        ("unary-watcher-events", 13, 0, br#"{"watcherId":"w-1"}"#.to_vec()),
    ] {
        let mut input = vec![mode, piece];
        input.extend_from_slice(&body);
        seeds.write("agent_connect", name, &input)?;
    }
    Ok(())
}

/// A small layer with each kind of entry the unpacker handles (a directory, files, a
/// symlink, a hard link, a FIFO, a whiteout, an opaque directory, a kept xattr in a pax
/// header), as a plain tar, gzip and zstd.
fn layer_unpack(seeds: &mut Seeds) -> std::io::Result<()> {
    let mut b = tar::Builder::new(Vec::new());
    let header = |path: &str, kind: tar::EntryType, mode: u32, size: u64| {
        let mut h = tar::Header::new_gnu();
        h.set_path(path).expect("a short path");
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(1000);
        h.set_gid(1000);
        h.set_mtime(1_700_000_000);
        h.set_size(size);
        h
    };
    let mut dir = header("etc/", tar::EntryType::Directory, 0o755, 0);
    b.append_data(&mut dir, "etc/", &[][..])?;
    let mut file = header("etc/motd", tar::EntryType::Regular, 0o644, 6);
    b.append_data(&mut file, "etc/motd", &b"hello\n"[..])?;
    b.append_pax_extensions([
        ("SCHILY.xattr.user.origin", &b"seed"[..]),
        ("mtime", &b"1700000000.5"[..]),
    ])?;
    let mut tagged = header("etc/tagged", tar::EntryType::Regular, 0o4755, 3);
    b.append_data(&mut tagged, "etc/tagged", &b"abc"[..])?;
    let mut link = header("etc/motd.link", tar::EntryType::Symlink, 0o777, 0);
    b.append_link(&mut link, "etc/motd.link", "motd")?;
    let mut hard = header("etc/motd.hard", tar::EntryType::Link, 0o644, 0);
    b.append_link(&mut hard, "etc/motd.hard", "etc/motd")?;
    let mut fifo = header("run/pipe", tar::EntryType::Fifo, 0o600, 0);
    b.append_data(&mut fifo, "run/pipe", &[][..])?;
    let mut whiteout = header("usr/.wh.share", tar::EntryType::Regular, 0o644, 0);
    b.append_data(&mut whiteout, "usr/.wh.share", &[][..])?;
    let mut opaque = header("var/.wh..wh..opq", tar::EntryType::Regular, 0o644, 0);
    b.append_data(&mut opaque, "var/.wh..wh..opq", &[][..])?;
    let layer = b.into_inner()?;

    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut gz, &layer)?;
    let gz = gz.finish()?;
    let zst = zstd::encode_all(&layer[..], 3)?;
    let mut refused = tar::Builder::new(Vec::new());
    let mut escape = header("a", tar::EntryType::Symlink, 0o777, 0);
    refused.append_link(&mut escape, "a", "/etc")?;
    let mut through = header("a/passwd", tar::EntryType::Regular, 0o644, 1);
    refused.append_data(&mut through, "a/passwd", &b"x"[..])?;
    let refused = refused.into_inner()?;
    seeds.write("layer_unpack", "every-kind.tar", &layer)?;
    seeds.write("layer_unpack", "every-kind.tar.gz", &gz)?;
    seeds.write("layer_unpack", "every-kind.tar.zst", &zst)?;
    seeds.write("layer_unpack", "through-a-symlink.tar", &refused)
}

/// A registry's answers: an OCI image manifest with its config, a Docker v2 manifest,
/// and an index naming linux/amd64 among other platforms.
fn oci_manifest(seeds: &mut Seeds) -> std::io::Result<()> {
    let digest = |c: char| format!("sha256:{}", c.to_string().repeat(64));
    let (config_digest, layer_a, layer_b) = (digest('c'), digest('a'), digest('b'));
    let manifest = format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",
"config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{config_digest}","size":512}},
"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"{layer_a}","size":1024}},
{{"mediaType":"application/vnd.oci.image.layer.v1.tar+zstd","digest":"{layer_b}","size":2048}}]}}"#
    );
    let docker = format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json",
"config":{{"mediaType":"application/vnd.docker.container.image.v1+json","digest":"{config_digest}","size":512}},
"layers":[{{"mediaType":"application/vnd.docker.image.rootfs.diff.tar.gzip","digest":"{layer_a}","size":1024}}]}}"#
    );
    let config = |layers: &[&str]| {
        let diff_ids: Vec<String> = layers.iter().map(|l| format!("\"{l}\"")).collect();
        format!(
            r#"{{"architecture":"amd64","os":"linux",
"config":{{"Env":["A=1"],"WorkingDir":"/srv","User":"1000:1000","Entrypoint":["/bin/app"],"Cmd":["--serve"],
"ExposedPorts":{{"8080/tcp":{{}}}},"Labels":{{"k":"v"}}}},
"rootfs":{{"type":"layers","diff_ids":[{}]}},"history":[{{"created_by":"seed"}}]}}"#,
            diff_ids.join(",")
        )
    };
    let index = format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[
{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{layer_a}","size":700,"platform":{{"architecture":"arm64","os":"linux","variant":"v8"}}}},
{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{layer_b}","size":700,"platform":{{"architecture":"amd64","os":"linux"}}}}]}}"#
    );
    let joined = |m: &str, c: &str| {
        let mut input = m.as_bytes().to_vec();
        input.push(MANIFEST_CONFIG_SEPARATOR);
        input.extend_from_slice(c.as_bytes());
        input
    };
    seeds.write(
        "oci_manifest",
        "oci-manifest-and-config",
        &joined(&manifest, &config(&[&digest('d'), &digest('e')])),
    )?;
    seeds.write(
        "oci_manifest",
        "docker-manifest-and-config",
        &joined(&docker, &config(&[&digest('d')])),
    )?;
    seeds.write("oci_manifest", "index", index.as_bytes())
}
