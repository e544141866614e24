//! The peer port's framing and opening, as a follower's replication server reads them:
//! the versioned hello (`Protocol::read_hello`, at most `MAX_HELLO` bytes allocated
//! before the peer is known), then length-prefixed frames (`frames::read`), each decoded
//! as an append request. Also `frames::read_at_most` with a small limit over the same
//! bytes. Read in pieces of any size, as from a socket.
//!
//! Input: a piece size (`opendsec_fuzz::piece_size`), then the bytes a peer sends.
#![no_main]

use libfuzzer_sys::fuzz_target;
use opendsec_fuzz::{Pieces, piece_size};
use opendsec_log::{frames, fuzzing, replication};

fuzz_target!(|data: &[u8]| {
    let Some((&first, wire)) = data.split_first() else {
        return;
    };
    let piece = piece_size(first);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let mut peer = Pieces { data: wire, piece };
        if replication::PROTOCOL.read_hello(&mut peer).await.is_ok() {
            let mut buf = Vec::new();
            while let Ok(true) = frames::read(&mut peer, &mut buf).await {
                if fuzzing::decode_append_request(&buf).is_err() {
                    break;
                }
            }
        }
        let mut peer = Pieces { data: wire, piece };
        let mut buf = Vec::new();
        while let Ok(true) = frames::read_at_most(&mut peer, &mut buf, 4096).await {
            assert!(buf.len() <= 4096, "a frame over the limit was read");
        }
    });
});
