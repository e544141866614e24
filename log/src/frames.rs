//! Length-prefixed frames on a plain TCP connection: a 4-byte big-endian length, then
//! that many bytes. Used by the peer port's own protocols beside gRPC (replication here,
//! write forwarding in the control plane), which cost less per message than HTTP/2.

use tokio::io::{AsyncRead, AsyncReadExt};

/// The largest frame a reader accepts.
pub const MAX_FRAME: usize = 64 << 20;

/// Appends `payload` to `out` as one frame.
pub fn put(out: &mut Vec<u8>, payload: &[u8]) {
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
}

/// Reads one frame into `buf`; `Ok(false)` at a clean end between frames.
pub async fn read<R: AsyncRead + Unpin>(r: &mut R, buf: &mut Vec<u8>) -> std::io::Result<bool> {
    read_at_most(r, buf, MAX_FRAME).await
}

/// As [`read`], refusing a frame longer than `max` before anything is allocated for it.
pub async fn read_at_most<R: AsyncRead + Unpin>(r: &mut R, buf: &mut Vec<u8>, max: usize) -> std::io::Result<bool> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(false),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes is over the limit of {max}"),
        ));
    }
    buf.resize(len, 0);
    r.read_exact(buf).await?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn frames_read_back_as_written_and_oversized_ones_are_refused() {
        let mut wire = Vec::new();
        super::put(&mut wire, b"one");
        super::put(&mut wire, b"");
        super::put(&mut wire, &[7u8; 1000]);
        let mut r = wire.as_slice();
        let mut buf = Vec::new();
        for want in [b"one".to_vec(), vec![], vec![7u8; 1000]] {
            assert!(super::read(&mut r, &mut buf).await.unwrap());
            assert_eq!(buf, want);
        }
        assert!(!super::read(&mut r, &mut buf).await.unwrap(), "a clean end");
        let huge = ((super::MAX_FRAME + 1) as u32).to_be_bytes();
        let err = super::read(&mut huge.as_slice(), &mut buf).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
    }
}
