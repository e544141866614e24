//! A small Connect-protocol layer (JSON codec only) over hyper.
//!
//! Why hand-written rather than the `connectrpc` crate (0.9.1, evaluated first):
//! that crate does speak Connect JSON unary, server- and client-streaming over
//! HTTP/1.1, but it needs generated message types (a `buffa` codegen step from
//! .proto descriptors), pulls in tower, tower-http, zstd (a C library) and
//! HTTP/2 by default, and hides the response body behind its own streaming
//! abstraction. The agent is a static binary in every sandbox that only ever
//! speaks JSON, and it needs precise control over streaming (backpressure from
//! the client down to the process's pipe, keepalive frames, end frames after
//! a process ends). The JSON wire format of Connect is small: unary is a plain
//! JSON body, streams are `[flags u8][len u32 BE][json]` envelopes with an
//! end-of-stream envelope (flag 0x02). So it is implemented here in ~250 lines.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use hyper::{Response, StatusCode};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

/// Largest request message accepted (unary body or one stream envelope).
pub const MAX_MESSAGE: usize = 16 << 20;
pub const FLAG_COMPRESSED: u8 = 0x01;
pub const FLAG_END_STREAM: u8 = 0x02;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // the full Connect code set, not all used yet
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// HTTP status for a unary error, as in the Connect specification.
    pub fn http_status(self) -> StatusCode {
        let n = match self {
            Code::Canceled => 499,
            Code::Unknown | Code::Internal | Code::DataLoss => 500,
            Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists | Code::Aborted => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::Unimplemented => 501,
            Code::Unavailable => 503,
            Code::Unauthenticated => 401,
        };
        StatusCode::from_u16(n).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

#[derive(Debug, Clone)]
pub struct RpcError {
    pub code: Code,
    pub message: String,
}

impl RpcError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }
    /// Maps an io::Error, naming the path it concerns.
    pub fn io(e: std::io::Error, what: &str) -> Self {
        use std::io::ErrorKind as K;
        let code = match (e.kind(), e.raw_os_error()) {
            (_, Some(libc::ENOTDIR)) | (_, Some(libc::EISDIR)) | (_, Some(libc::ENOTEMPTY)) => Code::InvalidArgument,
            (_, Some(libc::ENOSPC)) | (_, Some(libc::EDQUOT)) => Code::ResourceExhausted,
            (K::NotFound, _) => Code::NotFound,
            (K::PermissionDenied, _) => Code::PermissionDenied,
            (K::AlreadyExists, _) => Code::AlreadyExists,
            (K::InvalidInput, _) | (K::InvalidData, _) => Code::InvalidArgument,
            _ => Code::Internal,
        };
        RpcError::new(code, format!("{what}: {e}"))
    }
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.as_str(), "message": self.message})
    }
}

impl std::fmt::Display for RpcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.message)
    }
}

/// The response body: empty, one buffer, or a channel of chunks (streams and
/// downloads). A bounded channel gives backpressure: the producer waits until
/// hyper has written the previous chunks to the socket.
pub enum Body {
    Full(Option<Bytes>),
    Chan(mpsc::Receiver<Bytes>),
}

impl Body {
    pub fn empty() -> Self {
        Body::Full(None)
    }
    pub fn full(b: impl Into<Bytes>) -> Self {
        Body::Full(Some(b.into()))
    }
}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match &mut *self {
            Body::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Body::Chan(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, Body::Full(None))
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            Body::Full(Some(b)) => hyper::body::SizeHint::with_exact(b.len() as u64),
            Body::Full(None) => hyper::body::SizeHint::with_exact(0),
            Body::Chan(_) => hyper::body::SizeHint::default(),
        }
    }
}

pub fn json_response(status: StatusCode, v: &serde_json::Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Body::full(serde_json::to_vec(v).unwrap_or_default()))
        .expect("valid response")
}

/// A unary Connect response: 200 with the JSON message, or the error's status.
pub fn unary_response<T: Serialize>(r: Result<T, RpcError>) -> Response<Body> {
    match r {
        Ok(v) => match serde_json::to_value(&v) {
            Ok(v) => json_response(StatusCode::OK, &v),
            Err(e) => unary_error(&RpcError::internal(e.to_string())),
        },
        Err(e) => unary_error(&e),
    }
}

pub fn unary_error(e: &RpcError) -> Response<Body> {
    json_response(e.code.http_status(), &e.to_json())
}

pub fn envelope(flags: u8, msg: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + msg.len());
    b.put_u8(flags);
    b.put_u32(msg.len() as u32);
    b.put_slice(msg);
    b.freeze()
}

pub fn message_frame(v: &serde_json::Value) -> Bytes {
    envelope(0, &serde_json::to_vec(v).unwrap_or_default())
}

pub fn end_frame(err: Option<&RpcError>) -> Bytes {
    let v = match err {
        None => serde_json::json!({}),
        Some(e) => serde_json::json!({"error": e.to_json()}),
    };
    envelope(FLAG_END_STREAM, &serde_json::to_vec(&v).unwrap_or_default())
}

/// A streaming response (server- or client-streaming RPC): always HTTP 200,
/// frames come from the returned sender; the producer must finish with an
/// `end_frame`.
pub fn stream_response(capacity: usize) -> (mpsc::Sender<Bytes>, Response<Body>) {
    let (tx, rx) = mpsc::channel(capacity);
    let resp = Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/connect+json")
        .body(Body::Chan(rx))
        .expect("valid response");
    (tx, resp)
}

/// A streaming response that carries only an end frame with this error.
pub fn stream_error(e: &RpcError) -> Response<Body> {
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/connect+json")
        .body(Body::full(end_frame(Some(e))))
        .expect("valid response")
}

pub fn decode<T: DeserializeOwned>(b: &[u8]) -> Result<T, RpcError> {
    let b: &[u8] = if b.iter().all(|c| c.is_ascii_whitespace()) {
        b"{}"
    } else {
        b
    };
    serde_json::from_slice(b).map_err(|e| RpcError::invalid(format!("bad request message: {e}")))
}

/// Reads a whole unary request body (bounded) and decodes it.
pub async fn read_unary<T: DeserializeOwned, B: RequestBody>(body: B) -> Result<T, RpcError> {
    let mut buf = BytesMut::new();
    let mut body = body;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| RpcError::new(Code::Canceled, format!("reading request: {e}")))?;
        if let Ok(d) = frame.into_data() {
            if buf.len() + d.len() > MAX_MESSAGE {
                return Err(RpcError::new(Code::ResourceExhausted, "request message too large"));
            }
            buf.put(d);
        }
    }
    decode(&buf)
}

/// A request body: hyper's in the agent, any other in the fuzz targets.
pub trait RequestBody: hyper::body::Body<Data = Bytes, Error: std::fmt::Display> + Unpin {}

impl<B: hyper::body::Body<Data = Bytes, Error: std::fmt::Display> + Unpin> RequestBody for B {}

/// Reads envelopes from a streaming request body, as they arrive.
pub struct EnvelopeReader<B = Incoming> {
    body: B,
    buf: BytesMut,
    done: bool,
}

impl<B: RequestBody> EnvelopeReader<B> {
    pub fn new(body: B) -> Self {
        EnvelopeReader {
            body,
            buf: BytesMut::new(),
            done: false,
        }
    }

    /// The next message, or None at the end of the stream (end-of-stream
    /// envelope or end of body).
    pub async fn next(&mut self) -> Result<Option<Bytes>, RpcError> {
        loop {
            if self.buf.len() >= 5 {
                let flags = self.buf[0];
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
                if len > MAX_MESSAGE {
                    return Err(RpcError::new(Code::ResourceExhausted, "request message too large"));
                }
                if self.buf.len() >= 5 + len {
                    self.buf.advance(5);
                    let msg = self.buf.split_to(len).freeze();
                    if flags & FLAG_COMPRESSED != 0 {
                        return Err(RpcError::new(
                            Code::Unimplemented,
                            "compressed messages are not supported",
                        ));
                    }
                    if flags & FLAG_END_STREAM != 0 {
                        self.done = true;
                        return Ok(None);
                    }
                    return Ok(Some(msg));
                }
            }
            if self.done {
                return Ok(None);
            }
            match self.body.frame().await {
                None => {
                    self.done = true;
                    if !self.buf.is_empty() {
                        return Err(RpcError::invalid("request stream ended inside an envelope"));
                    }
                    return Ok(None);
                }
                Some(Err(e)) => {
                    return Err(RpcError::new(Code::Canceled, format!("reading request: {e}")));
                }
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.buf.put(d);
                    }
                }
            }
        }
    }
}
