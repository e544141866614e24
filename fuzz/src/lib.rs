//! What the fuzz targets share with the seed generator (`examples/seeds.rs`): the
//! layouts of their inputs, and readers that hand an input over in small pieces, as a
//! socket does.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::Frame;
use tokio::io::{AsyncRead, ReadBuf};

/// The entries of a log in the golden-log framing (`replay-tests/README.md`): an 8-byte
/// index and a 4-byte length (both little endian), then that many bytes; a frame cut
/// short ends the log. The `event_batch` input, so the golden logs are its seeds as they are.
pub fn log_entries(mut data: &[u8]) -> impl Iterator<Item = (u64, &[u8])> {
    std::iter::from_fn(move || {
        let (head, rest) = data.split_first_chunk::<12>()?;
        let index = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
        let len = u32::from_le_bytes(head[8..].try_into().expect("4 bytes")) as usize;
        let entry = rest.get(..len)?;
        data = &rest[len..];
        Some((index, entry))
    })
}

/// The size of the pieces an input is read in, from its first byte: 0 all at once,
/// else 1 to 255 bytes at a time (splits inside a length prefix must not matter).
pub fn piece_size(first: u8) -> usize {
    match first {
        0 => usize::MAX,
        n => n as usize,
    }
}

/// An `AsyncRead` over bytes that returns at most `piece` bytes per read.
pub struct Pieces<'a> {
    pub data: &'a [u8],
    pub piece: usize,
}

impl AsyncRead for Pieces<'_> {
    fn poll_read(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let n = self.data.len().min(self.piece).min(buf.remaining());
        let (now, later) = self.data.split_at(n);
        buf.put_slice(now);
        self.data = later;
        Poll::Ready(Ok(()))
    }
}

/// An HTTP request body over bytes, in frames of at most `piece` bytes.
pub struct PiecesBody {
    pub data: Bytes,
    pub piece: usize,
}

impl hyper::body::Body for PiecesBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.data.is_empty() {
            return Poll::Ready(None);
        }
        let n = self.data.len().min(self.piece);
        let now = self.data.split_to(n);
        Poll::Ready(Some(Ok(Frame::data(now))))
    }
}

/// The journal generation the `journal_recovery` target recovers (a store that never
/// retired one: `Store::open` on a fresh redb file).
pub const LIVE_GENERATION: u64 = 1;
/// Bytes before a journal record's payload (`len | crc32 | generation | index`).
const JOURNAL_HEADER: usize = 24;

/// Rewrites every whole record of a journal so that it checks out (generation
/// [`LIVE_GENERATION`], a right checksum): the fuzzer then reaches the entries' decoding,
/// which a checksum would otherwise keep it from. The layout is `log/src/journal.rs`'s.
pub fn seal_journal(data: &mut [u8]) {
    let mut at = 0;
    while at + JOURNAL_HEADER <= data.len() {
        let n = u32::from_le_bytes(data[at..at + 4].try_into().expect("4 bytes")) as usize;
        if n == 0 || at + JOURNAL_HEADER + n > data.len() {
            return;
        }
        data[at + 8..at + 16].copy_from_slice(&LIVE_GENERATION.to_le_bytes());
        let mut h = crc32fast::Hasher::new();
        h.update(&data[at + 8..at + JOURNAL_HEADER + n]);
        let crc = h.finalize();
        data[at + 4..at + 8].copy_from_slice(&crc.to_le_bytes());
        at += JOURNAL_HEADER + n;
    }
}

/// The separator of the `oci_manifest` input: a manifest, this byte, an image config
/// (JSON never holds a raw 0xff byte).
pub const MANIFEST_CONFIG_SEPARATOR: u8 = 0xff;
