//! `GET /files` and `POST /files`: streamed download and upload, with the
//! user's permissions (the file is opened by a thread whose fsuid is the
//! user's; created files and directories belong to the user).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use bytes::{Buf, Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{HeaderMap, Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::connect::{Body, Code, RpcError, json_response};
use crate::metadata::{self, Metadata};
use crate::users::{self, User};

const READ_CHUNK: usize = 64 * 1024;

/// An error of the plain HTTP API: status plus `{"code": status, "message"}`.
pub fn http_error(e: &RpcError) -> Response<Body> {
    let status = match e.code {
        Code::ResourceExhausted => StatusCode::INSUFFICIENT_STORAGE,
        c => c.http_status(),
    };
    json_response(status, &json!({"code": status.as_u16(), "message": e.message}))
}

pub async fn get(user: User, path: &str, headers: &HeaderMap) -> Result<Response<Body>, RpcError> {
    let path = users::resolve_path(&user, path)?;
    let p = path.clone();
    let file = users::blocking_as(&user, move || {
        let s = p.display().to_string();
        let f = std::fs::File::open(&p).map_err(|e| RpcError::io(e, &s))?;
        let m = f.metadata().map_err(|e| RpcError::io(e, &s))?;
        if m.is_dir() {
            return Err(RpcError::invalid(format!("path '{s}' is a directory")));
        }
        Ok((f, m.len()))
    })
    .await?;
    let (mut file, len) = file;
    let gzip = headers
        .get_all("accept-encoding")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.split(',').any(|t| t.trim().split(';').next() == Some("gzip")));
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; READ_CHUNK];
        let mut enc = gzip.then(|| flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
        loop {
            let n = match file.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return,
            };
            let chunk = match &mut enc {
                Some(enc) => {
                    if enc.write_all(&buf[..n]).is_err() {
                        return;
                    }
                    let out = std::mem::take(enc.get_mut());
                    if out.is_empty() {
                        continue;
                    }
                    Bytes::from(out)
                }
                None => Bytes::copy_from_slice(&buf[..n]),
            };
            if tx.blocking_send(chunk).is_err() {
                return; // client went away
            }
        }
        if let Some(enc) = enc
            && let Ok(rest) = enc.finish()
        {
            let _ = tx.blocking_send(Bytes::from(rest));
        }
    });
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut b = Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/octet-stream")
        .header(
            "content-disposition",
            format!("attachment; filename=\"{}\"", name.replace('"', "")),
        );
    if gzip {
        b = b.header("content-encoding", "gzip").header("vary", "Accept-Encoding");
    } else {
        b = b.header("content-length", len);
    }
    Ok(b.body(Body::Chan(rx)).expect("valid response"))
}

/// A file being written by a blocking thread, fed chunk by chunk.
struct Sink {
    tx: mpsc::Sender<Bytes>,
    done: tokio::task::JoinHandle<Result<(), RpcError>>,
}

async fn open_sink(user: &User, path: PathBuf, gunzip: bool, meta: &Metadata) -> Result<Sink, RpcError> {
    let p = path.clone();
    let meta = meta.clone();
    let file = users::blocking_as(user, move || {
        let s = p.display().to_string();
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).map_err(|e| RpcError::io(e, &parent.display().to_string()))?;
        }
        if std::fs::metadata(&p).map(|m| m.is_dir()).unwrap_or(false) {
            return Err(RpcError::invalid(format!("path '{s}' is a directory")));
        }
        let f = std::fs::File::create(&p).map_err(|e| RpcError::io(e, &s))?;
        metadata::write(&f, &meta)?;
        Ok(f)
    })
    .await?;
    let (tx, mut rx) = mpsc::channel::<Bytes>(4);
    let done = tokio::task::spawn_blocking(move || {
        let s = path.display().to_string();
        let io = |e| RpcError::io(e, &s);
        if gunzip {
            let mut w = flate2::write::GzDecoder::new(file);
            while let Some(b) = rx.blocking_recv() {
                w.write_all(&b)
                    .map_err(|e| RpcError::invalid(format!("bad gzip body: {e}")))?;
            }
            w.try_finish()
                .map_err(|e| RpcError::invalid(format!("bad gzip body: {e}")))?;
            w.get_mut().flush().map_err(io)?;
        } else {
            let mut w = file;
            while let Some(b) = rx.blocking_recv() {
                w.write_all(&b).map_err(io)?;
            }
        }
        Ok(())
    });
    Ok(Sink { tx, done })
}

impl Sink {
    async fn write(&self, b: Bytes) -> Result<(), RpcError> {
        if b.is_empty() {
            return Ok(());
        }
        // A send error means the writer stopped on an error: finish() reports it.
        let _ = self.tx.send(b).await;
        Ok(())
    }
    async fn finish(self) -> Result<(), RpcError> {
        drop(self.tx);
        self.done.await.map_err(|e| RpcError::internal(e.to_string()))?
    }
}

fn write_info(path: &Path, meta: &Metadata) -> Value {
    let mut v = json!({
        "name": path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        "type": "file",
        "path": path.to_string_lossy(),
    });
    if !meta.is_empty() {
        v["metadata"] = json!(meta);
    }
    v
}

pub async fn post(
    user: User,
    path: Option<&str>,
    headers: &HeaderMap,
    body: Incoming,
) -> Result<Response<Body>, RpcError> {
    let ctype = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let gunzip = headers
        .get("content-encoding")
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().eq_ignore_ascii_case("gzip"))
        .unwrap_or(false);
    let meta = metadata::from_headers(headers)?;
    let infos = if ctype.to_ascii_lowercase().starts_with("multipart/") {
        let boundary = ctype
            .split(';')
            .filter_map(|p| p.trim().split_once('='))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("boundary"))
            .map(|(_, v)| v.trim().trim_matches('"').to_string())
            .ok_or_else(|| RpcError::invalid("multipart body without boundary"))?;
        multipart(&user, path, &boundary, gunzip, &meta, body).await?
    } else {
        let path = users::resolve_path(&user, path.ok_or_else(|| RpcError::invalid("path is required"))?)?;
        let sink = open_sink(&user, path.clone(), gunzip, &meta).await?;
        let mut body = body;
        let mut res = Ok(());
        while let Some(f) = body.frame().await {
            match f {
                Ok(f) => {
                    if let Ok(d) = f.into_data() {
                        sink.write(d).await?;
                    }
                }
                Err(e) => {
                    res = Err(RpcError::new(Code::Canceled, format!("reading upload: {e}")));
                    break;
                }
            }
        }
        let fin = sink.finish().await;
        res?;
        fin?;
        vec![write_info(&path, &meta)]
    };
    Ok(json_response(StatusCode::OK, &Value::Array(infos)))
}

/// At most this much after a multipart body's close delimiter is read (and dropped)
/// before the upload is answered; a longer epilogue is left unread.
const EPILOGUE_MAX: usize = 64 * 1024;

/// A streaming multipart/form-data reader: parts named `file` are written
/// to their target as they arrive.
struct Parts {
    body: Incoming,
    buf: BytesMut,
    eof: bool,
}

impl Parts {
    async fn fill(&mut self) -> Result<bool, RpcError> {
        if self.eof {
            return Ok(false);
        }
        while let Some(f) = self.body.frame().await {
            let f = f.map_err(|e| RpcError::new(Code::Canceled, format!("reading upload: {e}")))?;
            if let Ok(d) = f.into_data() {
                self.buf.extend_from_slice(&d);
                return Ok(true);
            }
        }
        self.eof = true;
        Ok(false)
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

fn disposition_params(headers: &str) -> (Option<String>, Option<String>) {
    let mut name = None;
    let mut filename = None;
    for line in headers.split("\r\n") {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        if !k.trim().eq_ignore_ascii_case("content-disposition") {
            continue;
        }
        for p in v.split(';') {
            if let Some((pk, pv)) = p.trim().split_once('=') {
                let pv = pv.trim().trim_matches('"').to_string();
                match pk.trim().to_ascii_lowercase().as_str() {
                    "name" => name = Some(pv),
                    "filename" => filename = Some(pv),
                    _ => {}
                }
            }
        }
    }
    (name, filename)
}

async fn multipart(
    user: &User,
    path: Option<&str>,
    boundary: &str,
    gunzip: bool,
    meta: &Metadata,
    body: Incoming,
) -> Result<Vec<Value>, RpcError> {
    let delim = format!("\r\n--{boundary}").into_bytes();
    let mut r = Parts {
        body,
        buf: BytesMut::from(&b"\r\n"[..]),
        eof: false,
    };
    // Skip the preamble up to the first delimiter.
    loop {
        if let Some(i) = find(&r.buf, &delim) {
            r.buf.advance(i + delim.len());
            break;
        }
        let keep = r.buf.len().saturating_sub(delim.len());
        r.buf.advance(keep);
        if !r.fill().await? {
            return Err(RpcError::invalid("multipart body has no parts"));
        }
    }
    let mut out = Vec::new();
    let mut first = true;
    loop {
        while r.buf.len() < 2 {
            if !r.fill().await? {
                return Err(RpcError::invalid("truncated multipart body"));
            }
        }
        if r.buf.starts_with(b"--") {
            // The close delimiter. What follows it (its CRLF, any epilogue) is read,
            // bounded, before the answer: an answer sent while the client still sends
            // ends the connection under it, and the client (or the edge forwarding
            // for it) sees a broken pipe instead of the answer.
            r.buf.clear();
            let mut left = EPILOGUE_MAX;
            while left > 0 && r.fill().await.unwrap_or(false) {
                left = left.saturating_sub(r.buf.len());
                r.buf.clear();
            }
            break;
        }
        // Part headers end with an empty line (the delimiter line's own CRLF
        // comes first, so search from the start).
        let hend = loop {
            if let Some(i) = find(&r.buf, b"\r\n\r\n") {
                break i;
            }
            if r.buf.len() > 64 * 1024 || !r.fill().await? {
                return Err(RpcError::invalid("bad multipart part headers"));
            }
        };
        let headers = String::from_utf8_lossy(&r.buf[..hend]).into_owned();
        r.buf.advance(hend + 4);
        let (name, filename) = disposition_params(&headers);
        let target = if name.as_deref() == Some("file") {
            let p = match (first, path) {
                (true, Some(p)) if !p.is_empty() => p.to_string(),
                _ => filename
                    .clone()
                    .filter(|f| !f.is_empty())
                    .ok_or_else(|| RpcError::invalid("file part without a path"))?,
            };
            first = false;
            Some(users::resolve_path(user, &p)?)
        } else {
            None
        };
        let sink = match &target {
            Some(t) => Some(open_sink(user, t.clone(), gunzip, meta).await?),
            None => None,
        };
        // Stream the part's data up to the next delimiter.
        let res: Result<(), RpcError> = async {
            loop {
                if let Some(i) = find(&r.buf, &delim) {
                    let data = r.buf.split_to(i).freeze();
                    r.buf.advance(delim.len());
                    if let Some(s) = &sink {
                        s.write(data).await?;
                    }
                    return Ok(());
                }
                let safe = r.buf.len().saturating_sub(delim.len());
                if safe > 0 {
                    let data = r.buf.split_to(safe).freeze();
                    if let Some(s) = &sink {
                        s.write(data).await?;
                    }
                }
                if !r.fill().await? {
                    return Err(RpcError::invalid("truncated multipart body"));
                }
            }
        }
        .await;
        if let Some(s) = sink {
            let fin = s.finish().await;
            res?;
            fin?;
        } else {
            res?;
        }
        if let Some(t) = target {
            out.push(write_info(&t, meta));
        }
    }
    Ok(out)
}
