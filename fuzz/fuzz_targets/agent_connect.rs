//! The in-sandbox agent's request decoding, as its server reads a request body: the
//! Connect envelopes of a streaming call (`EnvelopeReader`: flags, a length checked
//! against `MAX_MESSAGE` before anything is buffered for it, the end-of-stream
//! envelope), or a whole unary body (`read_unary`), each message decoded as the envd
//! request it would be (protojson leniency: `null`, integers as strings), and what the
//! agent then reads out of it (base64 input, signal names).
//!
//! Input: a mode byte (even: a streaming call, odd: a unary one, of the method
//! `mode / 2` picks), a piece size (`opendsec_fuzz::piece_size`), then the body.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use opendsec_agent::connect::{self, EnvelopeReader, RpcError};
use opendsec_agent::json::unb64;
use opendsec_agent::requests::*;
use opendsec_fuzz::{PiecesBody, piece_size};

/// What the agent reads out of an input's data (stdin or PTY bytes, base64).
fn input_bytes(input: Option<&Input>) {
    if let Some(input) = input {
        for s in [&input.stdin, &input.pty].into_iter().flatten() {
            let _ = unb64(s);
        }
    }
}

/// One message of a streaming call, as each streaming method decodes it.
fn stream_message(msg: &[u8]) {
    let _ = connect::decode::<StartRequest>(msg);
    let _ = connect::decode::<SelectorRequest>(msg);
    let _ = connect::decode::<WatchRequest>(msg);
    if let Ok(m) = connect::decode::<StreamInputRequest>(msg) {
        input_bytes(m.data.as_ref().and_then(|d| d.input.as_ref()));
    }
}

/// A unary call of one of the envd methods that take a body.
async fn unary(method: u8, body: PiecesBody) -> Result<(), RpcError> {
    match method % 8 {
        0 => input_bytes(connect::read_unary::<SendInputRequest, _>(body).await?.input.as_ref()),
        1 => {
            parse_signal(&connect::read_unary::<SendSignalRequest, _>(body).await?.signal)?;
        }
        2 => drop(connect::read_unary::<SelectorRequest, _>(body).await?),
        3 => drop(connect::read_unary::<UpdateRequest, _>(body).await?),
        4 => drop(connect::read_unary::<PathRequest, _>(body).await?),
        5 => drop(connect::read_unary::<MoveRequest, _>(body).await?),
        6 => drop(connect::read_unary::<WatcherIdRequest, _>(body).await?),
        _ => drop(connect::read_unary::<WatchRequest, _>(body).await?),
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let [mode, piece, body @ ..] = data else {
        return;
    };
    let body = PiecesBody {
        data: Bytes::copy_from_slice(body),
        piece: piece_size(*piece),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        if mode % 2 == 0 {
            let mut reader = EnvelopeReader::new(body);
            while let Ok(Some(msg)) = reader.next().await {
                assert!(msg.len() <= connect::MAX_MESSAGE, "a message over the limit");
                stream_message(&msg);
            }
        } else {
            let _ = unary(mode / 2, body).await;
        }
    });
});
