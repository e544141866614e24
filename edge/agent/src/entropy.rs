//! Fresh randomness for a guest restored from another's memory. A fork copy, or a VM
//! started from a snapshot, wakes up with its source's kernel random number generator:
//! left alone, two copies would draw the same `/dev/urandom` bytes (the same keys, UUIDs
//! and Python `random` seeds) until the kernel next reseeds. When the edge re-keys such
//! a guest's agent it sends bytes from its own generator with the new token; they are
//! mixed into the guest kernel's input pool (`RNDADDENTROPY`, credited: they come from
//! the host's CSPRNG over the authenticated channel) and the kernel is made to reseed its
//! generator from it at once (`RNDRESEEDCRNG`). Needs `CAP_SYS_ADMIN`, which the agent
//! has as a VM guest's root; in a container it fails, and a container is never re-keyed.

use std::io;
use std::os::fd::AsRawFd;

/// `RNDADDENTROPY` = `_IOW('R', 0x03, int[2])` and `RNDRESEEDCRNG` = `_IO('R', 0x07)`, from
/// `<linux/random.h>` (the libc crate does not carry them).
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

/// The most bytes one request may carry.
pub const MAX_BYTES: usize = 256;

/// Mixes `bytes` into the kernel's input pool, crediting them, then reseeds the kernel's
/// generator from the pool.
pub fn mix_and_reseed(bytes: &[u8]) -> io::Result<()> {
    if bytes.is_empty() || bytes.len() > MAX_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("1 to {MAX_BYTES} bytes of entropy, not {}", bytes.len()),
        ));
    }
    let urandom = std::fs::OpenOptions::new().write(true).open("/dev/urandom")?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = vec![0u32; 2 + bytes.len().div_ceil(4)];
    info[0] = (bytes.len() * 8) as u32;
    info[1] = bytes.len() as u32;
    for (k, chunk) in bytes.chunks(4).enumerate() {
        let mut word = [0u8; 4];
        word[..chunk.len()].copy_from_slice(chunk);
        info[2 + k] = u32::from_ne_bytes(word);
    }
    // SAFETY: `info` is a whole rand_pool_info that outlives the call; the fd is open.
    if unsafe { libc::ioctl(urandom.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) } != 0 {
        return Err(io::Error::other(format!(
            "adding entropy (RNDADDENTROPY): {}",
            io::Error::last_os_error()
        )));
    }
    // SAFETY: an argument-less ioctl on an open fd.
    if unsafe { libc::ioctl(urandom.as_raw_fd(), RNDRESEEDCRNG as _) } != 0 {
        return Err(io::Error::other(format!(
            "reseeding the kernel's generator (RNDRESEEDCRNG): {}",
            io::Error::last_os_error()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn no_bytes_or_too_many_are_refused_before_the_kernel_is_asked() {
        assert!(super::mix_and_reseed(&[]).is_err());
        assert!(super::mix_and_reseed(&[7u8; super::MAX_BYTES + 1]).is_err());
    }
}
