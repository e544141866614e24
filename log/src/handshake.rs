//! The versioned opening of the peer port's own protocols (replication here, write
//! forwarding in the control plane): the client names the protocol and every version it
//! speaks, the server answers with the one it chose or refuses with a reason. A later
//! version is added by speaking two versions for a while; no probing, no fallback.
//!
//! On the wire, right after the transport is up:
//!
//! ```text
//! client: magic (4 bytes, names the protocol) | frame(hello)
//!         hello  = count (u8) | count x version (u16, big endian) | credentials (the rest)
//! server: magic | frame(answer)
//!         answer = the chosen version (u16, big endian), or 0 | the refusal's reason (UTF-8)
//! ```
//!
//! (`frame` is a length-prefixed frame, see [`crate::frames`].) Credentials are the
//! protocol's own: the cluster key for replication, nothing for forwarding (each forwarded
//! write carries its caller's token). A server checks them before it answers anything, and
//! closes on a peer without them, unanswered: only a peer that proved itself learns which
//! versions this node speaks.
//!
//! **TLS:** the opening is the first bytes *inside* the transport, so it is the same when
//! the transport becomes a TLS session (mutual TLS, later): the peer port selects the
//! protocol by reading the magic after the TLS handshake (see [`crate::PeerStream`]), never
//! from the TCP layer, and could select it by ALPN instead (one ALPN name per protocol,
//! `opendsec-<protocol>`), the versions still negotiated here.

use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// How long a server waits for a whole opening: a peer that connects and stays silent
/// holds a connection no longer than this.
pub const OPENING_WITHIN: Duration = Duration::from_secs(10);

/// The largest hello a server reads (versions and credentials), checked before anything
/// is allocated for it: an unauthenticated peer cannot make the node reserve more.
pub const MAX_HELLO: usize = 4096;

/// One of the peer port's own protocols: its magic, and the versions this build speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Protocol {
    /// For messages and logs ("replication", "write forwarding").
    pub name: &'static str,
    /// The first four bytes of a connection of this protocol (the peer port sorts by them).
    pub magic: [u8; 4],
    /// Every version this build speaks, oldest first.
    pub versions: &'static [u16],
}

/// Why an opening failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The connection failed or ended during the opening.
    #[error("{protocol} handshake: {source}")]
    Io {
        protocol: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The peer answered with other bytes than the protocol's magic.
    #[error("the peer does not speak {protocol}")]
    NotSpoken { protocol: &'static str },
    /// The peer speaks none of the versions offered.
    #[error("the peer refused {protocol} versions {offered:?}: {reason}")]
    Refused {
        protocol: &'static str,
        offered: Vec<u16>,
        reason: String,
    },
    /// An opening that does not follow the layout above.
    #[error("malformed {protocol} handshake: {why}")]
    Malformed { protocol: &'static str, why: String },
}

/// What a client offered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The versions it speaks.
    pub versions: Vec<u16>,
    /// The protocol's credentials (see the module doc).
    pub credentials: Vec<u8>,
}

impl Protocol {
    fn io(&self, source: std::io::Error) -> HandshakeError {
        HandshakeError::Io {
            protocol: self.name,
            source,
        }
    }

    fn malformed(&self, why: impl Into<String>) -> HandshakeError {
        HandshakeError::Malformed {
            protocol: self.name,
            why: why.into(),
        }
    }

    /// Client side: offers `versions` with `credentials` and returns the version the server
    /// chose. Nothing of the protocol itself is sent before it returns.
    pub async fn offer<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        io: &mut S,
        versions: &[u16],
        credentials: &[u8],
    ) -> Result<u16, HandshakeError> {
        let count = u8::try_from(versions.len()).map_err(|_| self.malformed("more than 255 versions offered"))?;
        let mut hello = Vec::with_capacity(1 + 2 * versions.len() + credentials.len());
        hello.push(count);
        for v in versions {
            hello.extend_from_slice(&v.to_be_bytes());
        }
        hello.extend_from_slice(credentials);
        let mut out = self.magic.to_vec();
        crate::frames::put(&mut out, &hello);
        io.write_all(&out).await.map_err(|e| self.io(e))?;

        let mut magic = [0u8; 4];
        io.read_exact(&mut magic).await.map_err(|e| self.io(e))?;
        if magic != self.magic {
            return Err(HandshakeError::NotSpoken { protocol: self.name });
        }
        let mut answer = Vec::new();
        if !crate::frames::read(io, &mut answer).await.map_err(|e| self.io(e))? {
            return Err(self.io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        let Some((chosen, rest)) = answer.split_first_chunk::<2>() else {
            return Err(self.malformed("an answer shorter than a version"));
        };
        match u16::from_be_bytes(*chosen) {
            0 => Err(HandshakeError::Refused {
                protocol: self.name,
                offered: versions.to_vec(),
                reason: String::from_utf8_lossy(rest).into_owned(),
            }),
            v if versions.contains(&v) => Ok(v),
            v => Err(self.malformed(format!("the peer chose version {v}, which was not offered"))),
        }
    }

    /// Server side: reads the magic and the hello, within [`OPENING_WITHIN`].
    pub async fn read_hello<R: AsyncRead + Unpin>(&self, r: &mut R) -> Result<Hello, HandshakeError> {
        self.read_hello_within(r, OPENING_WITHIN).await
    }

    /// As [`Self::read_hello`], giving the peer `within` for its whole opening.
    pub async fn read_hello_within<R: AsyncRead + Unpin>(
        &self,
        r: &mut R,
        within: Duration,
    ) -> Result<Hello, HandshakeError> {
        let read = async {
            let mut magic = [0u8; 4];
            r.read_exact(&mut magic).await.map_err(|e| self.io(e))?;
            if magic != self.magic {
                return Err(HandshakeError::NotSpoken { protocol: self.name });
            }
            let mut hello = Vec::new();
            if !crate::frames::read_at_most(r, &mut hello, MAX_HELLO)
                .await
                .map_err(|e| self.io(e))?
            {
                return Err(self.io(std::io::ErrorKind::UnexpectedEof.into()));
            }
            Ok(hello)
        };
        let hello = tokio::time::timeout(within, read).await.map_err(|_| {
            self.io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no whole opening within {within:?}"),
            ))
        })??;
        let (&count, rest) = hello.split_first().ok_or_else(|| self.malformed("an empty hello"))?;
        let listed = 2 * count as usize;
        if rest.len() < listed {
            return Err(self.malformed(format!("a hello listing {count} versions is {} bytes", hello.len())));
        }
        let versions = rest[..listed]
            .chunks_exact(2)
            .map(|v| u16::from_be_bytes([v[0], v[1]]))
            .collect();
        Ok(Hello {
            versions,
            credentials: rest[listed..].to_vec(),
        })
    }

    /// Server side: the newest version both sides speak, or why there is none.
    pub fn choose(&self, offered: &[u16]) -> Result<u16, String> {
        self.versions
            .iter()
            .rev()
            .find(|v| offered.contains(v))
            .copied()
            .ok_or_else(|| {
                format!(
                    "this node speaks {} versions {:?}, the peer offered {offered:?}",
                    self.name, self.versions
                )
            })
    }

    /// Server side: answers a hello with `choice` (see [`Self::choose`]). A refusal is
    /// logged here; the caller closes the connection after it.
    pub async fn answer<W: AsyncWrite + Unpin>(&self, w: &mut W, choice: &Result<u16, String>) -> std::io::Result<()> {
        let mut answer = Vec::new();
        match choice {
            Ok(v) => answer.extend_from_slice(&v.to_be_bytes()),
            Err(reason) => {
                tracing::warn!(protocol = self.name, %reason, "refused a peer's connection: no common version");
                answer.extend_from_slice(&0u16.to_be_bytes());
                answer.extend_from_slice(reason.as_bytes());
            }
        }
        let mut out = self.magic.to_vec();
        crate::frames::put(&mut out, &answer);
        w.write_all(&out).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEST: Protocol = Protocol {
        name: "test",
        magic: *b"ODTT",
        versions: &[1, 2],
    };

    /// Runs a server that answers one hello, and a client offering `offered`.
    async fn open(offered: &[u16]) -> (Result<u16, HandshakeError>, Hello) {
        let (mut client, mut server) = tokio::io::duplex(1024);
        let serve = tokio::spawn(async move {
            let hello = TEST.read_hello(&mut server).await.expect("a hello");
            TEST.answer(&mut server, &TEST.choose(&hello.versions))
                .await
                .expect("answered");
            hello
        });
        let chosen = TEST.offer(&mut client, offered, b"key").await;
        (chosen, serve.await.expect("server"))
    }

    #[tokio::test]
    async fn a_peer_that_stays_silent_or_announces_a_huge_hello_is_let_go() {
        // Silent after the magic: given up on once its time is over.
        let (mut client, mut server) = tokio::io::duplex(1024);
        client.write_all(b"ODTT").await.unwrap();
        let silent = TEST.read_hello_within(&mut server, Duration::from_millis(50)).await;
        assert!(
            matches!(&silent, Err(HandshakeError::Io { source, .. }) if source.kind() == std::io::ErrorKind::TimedOut),
            "{silent:?}"
        );
        // A hello announced at 64 MiB: refused before it is read or allocated.
        let (mut client, mut server) = tokio::io::duplex(1024);
        client.write_all(b"ODTT").await.unwrap();
        client.write_all(&(64u32 << 20).to_be_bytes()).await.unwrap();
        let huge = TEST.read_hello(&mut server).await;
        assert!(
            matches!(&huge, Err(HandshakeError::Io { source, .. }) if source.kind() == std::io::ErrorKind::InvalidData),
            "{huge:?}"
        );
    }

    #[tokio::test]
    async fn the_newest_version_both_sides_speak_is_chosen() {
        let (chosen, hello) = open(&[1, 2, 3]).await;
        assert_eq!(chosen.expect("accepted"), 2);
        assert_eq!(
            hello,
            Hello {
                versions: vec![1, 2, 3],
                credentials: b"key".to_vec()
            }
        );
        assert_eq!(open(&[1]).await.0.expect("accepted"), 1);
    }

    #[tokio::test]
    async fn a_peer_offering_only_unknown_versions_is_refused_with_the_versions_spoken_here() {
        let (chosen, _) = open(&[7, 9]).await;
        match chosen {
            Err(HandshakeError::Refused {
                protocol,
                offered,
                reason,
            }) => {
                assert_eq!((protocol, offered), ("test", vec![7, 9]));
                assert!(reason.contains("[1, 2]") && reason.contains("[7, 9]"), "{reason}");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_server_answering_another_protocol_is_not_spoken() {
        let (mut client, mut server) = tokio::io::duplex(1024);
        tokio::spawn(async move {
            let _ = server.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
        });
        let err = TEST.offer(&mut client, &[1], b"").await.unwrap_err();
        assert!(matches!(err, HandshakeError::NotSpoken { protocol: "test" }), "{err}");
    }

    #[tokio::test]
    async fn a_hello_shorter_than_its_version_list_is_malformed() {
        let mut wire = TEST.magic.to_vec();
        crate::frames::put(&mut wire, &[3, 0, 1]);
        let err = TEST.read_hello(&mut wire.as_slice()).await.unwrap_err();
        assert!(matches!(err, HandshakeError::Malformed { .. }), "{err}");
    }
}
