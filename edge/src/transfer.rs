//! Edge-to-edge transfer of sandbox state: a fork copy or a sandbox from a snapshot placed
//! on another edge than the state it starts from pulls that state from the edge holding it.
//!
//! The holding edge (the *source edge*) prepares a transfer directory (a microVM's
//! snapshot files, or tar archives of a container's file-system layers) with a
//! [`Manifest`] naming each file with its size and digest, and serves it on its proxy
//! port. The pulling edge fetches the manifest, then each file, streamed, writing as it
//! reads and checking each file's digest before it is used; then it tells the source edge
//! it is done so the source removes its copy.
//!
//! Files travel in a sparse encoding (a microVM's RAM and disk files are mostly holes):
//! the file is cut into 64 KiB blocks, and only blocks holding a non-zero byte are sent,
//! each as a record `offset: u64 BE, length: u64 BE, bytes`; a last record
//! `offset = file size, length = 0` ends it. A file's digest is the SHA-256 of this
//! encoding, which depends on the file's contents alone (not on how its file system
//! lays out holes), so both sides compute it the same way.
//!
//! Authentication: every request carries the pulling edge's name (`x-opendsec-edge`) and
//! a token ([`opendsec_edge_api::transfer_token`]: HMAC of the transfer id and that name
//! under the cluster key) that opens this one transfer for that one edge. No token is a
//! 401; a token for another transfer or edge, or an edge the log did not send the state
//! to, a 403.

use bytes::Bytes;
use http_body_util::BodyExt;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{self, Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The header naming the edge that pulls.
pub use opendsec_edge_api::headers::EDGE_HEADER;
/// The header carrying the transfer token.
pub use opendsec_edge_api::headers::TRANSFER_TOKEN_HEADER as TOKEN_HEADER;
/// The manifest's file name in a transfer directory.
pub const MANIFEST: &str = "manifest.json";

/// The unit of the sparse encoding: only blocks holding data travel.
const BLOCK: u64 = 64 << 10;
/// How long a pull keeps trying to reach a source edge that does not answer.
const UNREACHABLE_AFTER: Duration = Duration::from_secs(10);
/// How long a pull waits for the source edge to learn of the transfer (it follows the log
/// on its own and may be behind this edge).
const KNOWN_WITHIN: Duration = Duration::from_secs(30);
/// How long a pull waits for the source edge to prepare the state (a microVM's snapshot
/// under TCG takes seconds).
const READY_WITHIN: Duration = Duration::from_secs(180);

/// What a transfer holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub transfer: String,
    /// "" (a container's file-system layers) or "microvm" (a microVM's snapshot).
    pub isolation: String,
    /// The sandbox the state was taken of (a restored microVM still holds its agent token).
    pub source_sandbox: String,
    /// For a container: the layer archives, bottom first (each a name in `files`).
    #[serde(default)]
    pub layers: Vec<String>,
    pub files: Vec<FileEntry>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    /// The file's length (holes included).
    pub size: u64,
    /// Hex SHA-256 of the file's sparse encoding (see the module's comment).
    pub sha256: String,
    /// Bytes of data the encoding carries (the blocks that are not all zeros).
    pub data_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The source edge did not answer at all.
    #[error("the source edge {edge} ({address}) is unreachable: {why}")]
    Unreachable { edge: String, address: String, why: String },
    /// The source edge answered with a refusal or a failure.
    #[error("the source edge {edge} refused transfer {transfer}: {status} {message}")]
    Refused {
        edge: String,
        transfer: String,
        status: u16,
        message: String,
    },
    #[error("the source edge {edge} did not have transfer {transfer} ready within {within:?}")]
    NotReady {
        edge: String,
        transfer: String,
        within: Duration,
    },
    #[error("file {name} of transfer {transfer} arrived damaged: {why}")]
    Integrity {
        transfer: String,
        name: String,
        why: String,
    },
    #[error("transfer {transfer}: {context}: {source}")]
    Io {
        transfer: String,
        context: String,
        source: io::Error,
    },
}

/// True when every byte is zero.
fn all_zero(b: &[u8]) -> bool {
    let (pre, words, post) = unsafe {
        // SAFETY: any bytes are valid u64s; align_to only regroups them.
        b.align_to::<u64>()
    };
    pre.iter().all(|&x| x == 0) && words.iter().all(|&x| x == 0) && post.iter().all(|&x| x == 0)
}

/// `lseek` with SEEK_DATA/SEEK_HOLE; `None` past the last data.
fn seek(f: &std::fs::File, pos: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    // SAFETY: lseek on an open fd.
    let r = unsafe { libc::lseek(f.as_raw_fd(), pos as libc::off_t, whence) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENXIO) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    Ok(Some(r as u64))
}

/// Encodes `path` (see the module's comment), handing each piece to `sink`; returns the
/// digest of the encoding, the file's size and the data bytes sent.
pub fn encode_file(path: &Path, mut sink: impl FnMut(Bytes) -> io::Result<()>) -> io::Result<([u8; 32], u64, u64)> {
    let mut f = std::fs::File::open(path)?;
    let size = f.metadata()?.len();
    let mut hasher = Sha256::new();
    let mut data_bytes = 0;
    let mut pos = 0u64;
    let mut buf = vec![0u8; BLOCK as usize];
    while pos < size {
        // Holes read as zeros and would be skipped anyway: jump over them unread.
        let Some(data) = seek(&f, pos, libc::SEEK_DATA)? else {
            break;
        };
        let hole = seek(&f, data, libc::SEEK_HOLE)?.unwrap_or(size).min(size);
        let mut block = data / BLOCK * BLOCK;
        while block < hole {
            let len = BLOCK.min(size - block) as usize;
            f.seek(SeekFrom::Start(block))?;
            f.read_exact(&mut buf[..len])?;
            if !all_zero(&buf[..len]) {
                let mut rec = Vec::with_capacity(16 + len);
                rec.extend_from_slice(&block.to_be_bytes());
                rec.extend_from_slice(&(len as u64).to_be_bytes());
                rec.extend_from_slice(&buf[..len]);
                hasher.update(&rec);
                data_bytes += len as u64;
                sink(Bytes::from(rec))?;
            }
            block += BLOCK;
        }
        pos = block;
    }
    let mut end = Vec::with_capacity(16);
    end.extend_from_slice(&size.to_be_bytes());
    end.extend_from_slice(&0u64.to_be_bytes());
    hasher.update(&end);
    sink(Bytes::from(end))?;
    Ok((hasher.finalize().into(), size, data_bytes))
}

/// Writes an encoded file as its pieces arrive, hashing them.
pub struct Decoder {
    file: std::fs::File,
    hasher: Sha256,
    /// Bytes of the current record's header or data still awaited.
    header: Vec<u8>,
    /// (offset to write at, bytes of data still to come) of the record being read.
    data: Option<(u64, u64)>,
    /// The file's size, once the last record came.
    end: Option<u64>,
    pub received: u64,
}

impl Decoder {
    pub fn create(path: &Path) -> io::Result<Decoder> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        Ok(Decoder {
            file,
            hasher: Sha256::new(),
            header: Vec::with_capacity(16),
            data: None,
            end: None,
            received: 0,
        })
    }

    pub fn feed(&mut self, mut chunk: &[u8]) -> io::Result<()> {
        self.received += chunk.len() as u64;
        while !chunk.is_empty() {
            if self.end.is_some() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "bytes after the end of the file",
                ));
            }
            match self.data {
                Some((at, left)) => {
                    let n = (left as usize).min(chunk.len());
                    self.file.write_all_at(&chunk[..n], at)?;
                    self.hasher.update(&chunk[..n]);
                    self.data = (left > n as u64).then_some((at + n as u64, left - n as u64));
                    chunk = &chunk[n..];
                }
                None => {
                    let n = (16 - self.header.len()).min(chunk.len());
                    self.header.extend_from_slice(&chunk[..n]);
                    chunk = &chunk[n..];
                    if self.header.len() == 16 {
                        self.hasher.update(&self.header);
                        let offset = u64::from_be_bytes(self.header[..8].try_into().expect("8 bytes"));
                        let len = u64::from_be_bytes(self.header[8..].try_into().expect("8 bytes"));
                        self.header.clear();
                        if len == 0 {
                            self.end = Some(offset);
                        } else if len > BLOCK || offset % BLOCK != 0 {
                            return Err(io::Error::new(
                                io::ErrorKind::InvalidData,
                                format!("a record of {len} bytes at {offset}"),
                            ));
                        } else {
                            self.data = Some((offset, len));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Sets the file's length and returns (digest, size); an encoding cut short is an error.
    pub fn finish(self) -> io::Result<([u8; 32], u64)> {
        let Some(size) = self.end else {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the stream ended before the file did",
            ));
        };
        self.file.set_len(size)?;
        self.file.sync_all()?;
        Ok((self.hasher.finalize().into(), size))
    }
}

/// Writes the manifest of the files in `dir` (every regular file but the manifest).
pub fn write_manifest(
    dir: &Path,
    transfer: &str,
    isolation: &str,
    source_sandbox: &str,
    layers: Vec<String>,
) -> io::Result<Manifest> {
    let mut names: Vec<String> = std::fs::read_dir(dir)?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n != MANIFEST)
        .collect();
    names.sort();
    let mut files = Vec::new();
    for name in names {
        let (digest, size, data_bytes) = encode_file(&dir.join(&name), |_| Ok(()))?;
        files.push(FileEntry {
            name,
            size,
            sha256: hex::encode(digest),
            data_bytes,
        });
    }
    let m = Manifest {
        transfer: transfer.into(),
        isolation: isolation.into(),
        source_sandbox: source_sandbox.into(),
        layers,
        files,
    };
    std::fs::write(dir.join(MANIFEST), serde_json::to_vec_pretty(&m).expect("serialisable"))?;
    Ok(m)
}

pub fn read_manifest(dir: &Path) -> io::Result<Manifest> {
    serde_json::from_slice(&std::fs::read(dir.join(MANIFEST))?)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// A file name a manifest may hold: no paths.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
        && !name.starts_with('.')
}

/// A transfer id: `snap-…` or `fork-…`, letters, digits and dashes.
pub fn valid_transfer(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        && !id.starts_with('-')
}

/// What a pull brought.
#[derive(Clone, Debug)]
pub struct Pulled {
    pub manifest: Manifest,
    /// Bytes received on the wire (encoded files).
    pub wire_bytes: u64,
    pub took: Duration,
}

/// Who pulls what from where.
pub struct PullRequest<'a> {
    pub transfer: &'a str,
    pub source_edge: &'a str,
    pub address: &'a str,
    /// This edge's name.
    pub me: &'a str,
    /// What opens the transfer on the holding edge (`EdgeSlice.TransferToken`).
    pub token: &'a str,
    /// This edge's certificate: the holding edge's proxy is reached over mutual TLS,
    /// and must be `source_edge`.
    pub trust: &'a std::sync::Arc<opendsec_trust::Trust>,
}

async fn send(
    client: &opendsec_http::Client,
    p: &PullRequest<'_>,
    method: hyper::Method,
    path: &str,
) -> Result<hyper::Response<hyper::body::Incoming>, String> {
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, "edge")
        .header(EDGE_HEADER, p.me)
        .header(TOKEN_HEADER, p.token)
        .body(opendsec_http::empty())
        .map_err(|e| e.to_string())?;
    client
        .send(
            &opendsec_http::Endpoint::Edge {
                addr: p.address.to_string(),
                edge: p.source_edge.to_string(),
            },
            req,
        )
        .await
        .map_err(|e| match e {
            opendsec_http::Error::Connect { source, .. } => format!("cannot connect: {source}"),
            opendsec_http::Error::Handshake { source, .. } => format!("handshake: {source}"),
            opendsec_http::Error::Request { source, .. } => format!("request failed: {source}"),
            other => other.to_string(),
        })
}

async fn error_message(resp: hyper::Response<hyper::body::Incoming>) -> String {
    let body = resp
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned())
}

/// Pulls transfer `p.transfer` from its source edge into `into` (created; on success it
/// holds every file and, last, the manifest) and tells the source edge it is done. On
/// failure `into` is removed. Blocking IO on the files: run it on a blocking thread.
pub async fn pull(p: &PullRequest<'_>, into: &Path) -> Result<Pulled, TransferError> {
    let t0 = Instant::now();
    // One pull's requests (the manifest until it is ready, each file, the end) reuse
    // their connection; it closes when the pull is done.
    let client = opendsec_http::Client::with_trust(None, p.trust.clone());
    let result = pull_into(&client, p, into).await;
    if result.is_err() {
        let _ = std::fs::remove_dir_all(into);
    }
    let (manifest, wire_bytes) = result?;
    // The source edge may drop its copy now; if it never hears this, it drops it later.
    match send(&client, p, hyper::Method::DELETE, &format!("/transfer/{}", p.transfer)).await {
        Ok(r) if r.status().is_success() => {}
        Ok(r) => {
            tracing::warn!(transfer = %p.transfer, status = %r.status(), "the source edge did not take the end of the transfer")
        }
        Err(e) => tracing::warn!(transfer = %p.transfer, error = %e, "cannot tell the source edge the transfer ended"),
    }
    Ok(Pulled {
        manifest,
        wire_bytes,
        took: t0.elapsed(),
    })
}

async fn pull_into(
    client: &opendsec_http::Client,
    p: &PullRequest<'_>,
    into: &Path,
) -> Result<(Manifest, u64), TransferError> {
    let io_err = |context: String| {
        move |source| TransferError::Io {
            transfer: p.transfer.to_string(),
            context,
            source,
        }
    };
    let _ = std::fs::remove_dir_all(into);
    std::fs::create_dir_all(into).map_err(io_err(format!("creating {}", into.display())))?;
    let t0 = Instant::now();
    let manifest: Manifest = loop {
        match send(
            client,
            p,
            hyper::Method::GET,
            &format!("/transfer/{}/manifest", p.transfer),
        )
        .await
        {
            Err(why) if t0.elapsed() < UNREACHABLE_AFTER => {
                tracing::debug!(transfer = %p.transfer, %why, "source edge not reachable yet")
            }
            Err(why) => {
                return Err(TransferError::Unreachable {
                    edge: p.source_edge.into(),
                    address: p.address.into(),
                    why,
                });
            }
            Ok(r) if r.status() == hyper::StatusCode::SERVICE_UNAVAILABLE && t0.elapsed() < READY_WITHIN => {}
            Ok(r) if r.status() == hyper::StatusCode::NOT_FOUND && t0.elapsed() < KNOWN_WITHIN => {}
            Ok(r) if r.status() == hyper::StatusCode::SERVICE_UNAVAILABLE => {
                return Err(TransferError::NotReady {
                    edge: p.source_edge.into(),
                    transfer: p.transfer.into(),
                    within: READY_WITHIN,
                });
            }
            Ok(r) if r.status().is_success() => {
                let body = r
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| io_err("reading the manifest".into())(io::Error::other(e)))?
                    .to_bytes();
                break serde_json::from_slice(&body).map_err(|e| {
                    io_err("parsing the manifest".into())(io::Error::new(io::ErrorKind::InvalidData, e))
                })?;
            }
            Ok(r) => {
                let status = r.status().as_u16();
                let message = error_message(r).await;
                return Err(TransferError::Refused {
                    edge: p.source_edge.into(),
                    transfer: p.transfer.into(),
                    status,
                    message,
                });
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut wire = 0;
    for f in &manifest.files {
        if !valid_name(&f.name) {
            return Err(TransferError::Integrity {
                transfer: p.transfer.into(),
                name: f.name.clone(),
                why: "not a plain file name".into(),
            });
        }
        let damaged = |why: String| TransferError::Integrity {
            transfer: p.transfer.into(),
            name: f.name.clone(),
            why,
        };
        let r = send(
            client,
            p,
            hyper::Method::GET,
            &format!("/transfer/{}/files/{}", p.transfer, f.name),
        )
        .await
        .map_err(|why| TransferError::Unreachable {
            edge: p.source_edge.into(),
            address: p.address.into(),
            why,
        })?;
        if !r.status().is_success() {
            let status = r.status().as_u16();
            let message = error_message(r).await;
            return Err(TransferError::Refused {
                edge: p.source_edge.into(),
                transfer: p.transfer.into(),
                status,
                message,
            });
        }
        let path = into.join(&f.name);
        let mut dec = Decoder::create(&path).map_err(io_err(format!("creating {}", path.display())))?;
        let mut body = r.into_body();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| damaged(format!("the stream broke: {e}")))?;
            if let Ok(data) = frame.into_data() {
                dec.feed(&data).map_err(|e| damaged(e.to_string()))?;
            }
        }
        wire += dec.received;
        let (digest, size) = dec.finish().map_err(|e| damaged(e.to_string()))?;
        if hex::encode(digest) != f.sha256 || size != f.size {
            return Err(damaged(format!(
                "sha256 {} and {size} bytes, the manifest says {} and {} bytes",
                hex::encode(digest),
                f.sha256,
                f.size
            )));
        }
    }
    std::fs::write(
        into.join(MANIFEST),
        serde_json::to_vec_pretty(&manifest).expect("serialisable"),
    )
    .map_err(io_err("writing the manifest".into()))?;
    Ok((manifest, wire))
}

/// The body of a served file: pieces from a blocking reader, with backpressure (the
/// reader waits while the channel is full). A read error ends the body early, which the
/// puller sees as an encoding cut short.
pub struct FileBody {
    rx: tokio::sync::mpsc::Receiver<Bytes>,
}

impl hyper::body::Body for FileBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        self.rx
            .poll_recv(cx)
            .map(|b| b.map(|b| Ok(hyper::body::Frame::data(b))))
    }
}

/// Streams `path`, encoded, from a blocking thread.
pub fn serve_file(path: PathBuf) -> FileBody {
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tokio::task::spawn_blocking(move || {
        let sent = encode_file(&path, |b| {
            tx.blocking_send(b)
                .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the puller went away"))
        });
        if let Err(e) = sent {
            tracing::warn!(file = %path.display(), error = %e, "serving a transfer file failed");
        }
    });
    FileBody { rx }
}

/// Checks the credential of a transfer request: `Err` is (status, message).
pub fn check_token(
    cluster_key: &str,
    transfer: &str,
    edge: Option<&str>,
    token: Option<&str>,
) -> Result<String, (u16, String)> {
    let (Some(edge), Some(token)) = (edge, token) else {
        return Err((
            401,
            format!("a transfer request needs the {EDGE_HEADER} and {TOKEN_HEADER} headers"),
        ));
    };
    let want = opendsec_edge_api::transfer_token(cluster_key, transfer, edge);
    let same = want.len() == token.len() && want.bytes().zip(token.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
    if !same {
        return Err((
            403,
            format!("the token does not open transfer {transfer} for edge {edge}"),
        ));
    }
    Ok(edge.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(write: impl FnOnce(&std::fs::File)) -> (u64, u64, bool) {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let f = std::fs::File::create(&src).unwrap();
        write(&f);
        drop(f);
        let mut wire = Vec::new();
        let (digest, size, data) = encode_file(&src, |b| {
            wire.extend_from_slice(&b);
            Ok(())
        })
        .unwrap();
        let dst = dir.path().join("dst");
        let mut dec = Decoder::create(&dst).unwrap();
        // Fed in odd pieces, as a network delivers it.
        for piece in wire.chunks(7777) {
            dec.feed(piece).unwrap();
        }
        let (got, got_size) = dec.finish().unwrap();
        assert_eq!((got, got_size), (digest, size));
        let same = std::fs::read(&src).unwrap() == std::fs::read(&dst).unwrap();
        (size, data, same)
    }

    #[test]
    fn a_sparse_file_travels_as_its_data_blocks_and_arrives_whole() {
        let (size, data, same) = roundtrip(|f| {
            f.set_len(64 << 20).unwrap();
            f.write_all_at(b"hello", 10 << 20).unwrap();
            f.write_all_at(&[7u8; 100_000], 30 << 20).unwrap();
            // Zeros written as data do not travel either.
            f.write_all_at(&vec![0u8; 1 << 20], 40 << 20).unwrap();
            f.write_all_at(b"end", (64 << 20) - 3).unwrap();
        });
        assert!(same);
        assert_eq!(size, 64 << 20);
        assert_eq!(
            data,
            BLOCK + 2 * BLOCK + BLOCK,
            "one block for hello, two for the 100 kB, one for the end"
        );
    }

    #[test]
    fn empty_and_small_files_travel_too() {
        assert_eq!(roundtrip(|_| {}), (0, 0, true));
        assert_eq!(roundtrip(|f| f.write_all_at(b"x", 0).unwrap()), (1, 1, true));
    }

    #[test]
    fn the_digest_names_the_contents_not_the_layout() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        // The same contents, one with a hole and one with written zeros.
        let fa = std::fs::File::create(&a).unwrap();
        fa.set_len(1 << 20).unwrap();
        fa.write_all_at(b"x", 500_000).unwrap();
        let mut dense = vec![0u8; 1 << 20];
        dense[500_000] = b'x';
        std::fs::write(&b, &dense).unwrap();
        let digest = |p: &Path| encode_file(p, |_| Ok(())).unwrap().0;
        assert_eq!(digest(&a), digest(&b));
        dense[0] = 1;
        std::fs::write(&b, &dense).unwrap();
        assert_ne!(digest(&a), digest(&b));
    }

    #[test]
    fn a_stream_cut_short_or_damaged_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::write(&src, vec![9u8; 200_000]).unwrap();
        let mut wire = Vec::new();
        let (digest, _, _) = encode_file(&src, |b| {
            wire.extend_from_slice(&b);
            Ok(())
        })
        .unwrap();
        let mut cut = Decoder::create(&dir.path().join("cut")).unwrap();
        cut.feed(&wire[..wire.len() - 16]).unwrap();
        assert!(cut.finish().is_err());
        wire[100] ^= 1;
        let mut bad = Decoder::create(&dir.path().join("bad")).unwrap();
        bad.feed(&wire).unwrap();
        assert_ne!(bad.finish().unwrap().0, digest);
    }

    #[test]
    fn a_token_opens_one_transfer_for_one_edge() {
        let key = "k";
        let t = opendsec_edge_api::transfer_token(key, "fork-a", "e2");
        assert_eq!(check_token(key, "fork-a", Some("e2"), Some(&t)), Ok("e2".to_string()));
        assert_eq!(check_token(key, "fork-a", None, None).unwrap_err().0, 401);
        assert_eq!(check_token(key, "fork-b", Some("e2"), Some(&t)).unwrap_err().0, 403);
        assert_eq!(check_token(key, "fork-a", Some("e3"), Some(&t)).unwrap_err().0, 403);
    }
}
