//! The client against small hyper servers on loopback TCP and Unix sockets: connections
//! are reused (or not, when unpooled), bodies stream both ways without being buffered,
//! upgrades are passed through, and failures say which side failed.

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use opendsec_http::{Client, ConnectError, Endpoint, Error, TokioIo};
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::wrappers::ReceiverStream;

type ServerBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// What the test servers answer: `/echo` streams the request body back as it arrives,
/// `/upgrade` switches to a raw byte echo, anything else says "hello".
async fn answer(mut req: Request<Incoming>) -> Result<Response<ServerBody>, Infallible> {
    match req.uri().path() {
        "/echo" => {
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(4);
            let mut body = req.into_body();
            tokio::spawn(async move {
                while let Some(Ok(frame)) = body.frame().await {
                    if let Ok(data) = frame.into_data()
                        && tx.send(Ok(Frame::data(data))).await.is_err()
                    {
                        return;
                    }
                }
            });
            let stream = tokio_stream_from(rx);
            Ok(Response::new(StreamBody::new(stream).boxed()))
        }
        "/upgrade" => {
            let on = hyper::upgrade::on(&mut req);
            tokio::spawn(async move {
                if let Ok(up) = on.await {
                    let (mut r, mut w) = tokio::io::split(TokioIo::new(up));
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                }
            });
            Ok(Response::builder()
                .status(StatusCode::SWITCHING_PROTOCOLS)
                .header("connection", "upgrade")
                .header("upgrade", "echo")
                .body(http_body_util::Empty::new().boxed())
                .unwrap())
        }
        _ => Ok(Response::new(
            http_body_util::Full::new(Bytes::from_static(b"hello")).boxed(),
        )),
    }
}

fn tokio_stream_from<T: Send + 'static>(rx: tokio::sync::mpsc::Receiver<T>) -> ReceiverStream<T> {
    ReceiverStream::new(rx)
}

/// Serves `answer` on every connection `accept` yields; counts the connections.
fn serve<S, F>(accept: impl Fn() -> F + Send + 'static) -> Arc<AtomicUsize>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    F: std::future::Future<Output = S> + Send,
{
    let connections = Arc::new(AtomicUsize::new(0));
    let counted = connections.clone();
    tokio::spawn(async move {
        loop {
            let io = accept().await;
            counted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(io), hyper::service::service_fn(answer))
                    .with_upgrades()
                    .await;
            });
        }
    });
    connections
}

async fn tcp_server() -> (Endpoint, Arc<AtomicUsize>) {
    let listener = Arc::new(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
    let to = Endpoint::Tcp(listener.local_addr().unwrap().to_string());
    let count = serve(move || {
        let l = listener.clone();
        async move { l.accept().await.unwrap().0 }
    });
    (to, count)
}

async fn unix_server(dir: &tempfile::TempDir) -> (Endpoint, Arc<AtomicUsize>) {
    let path = dir.path().join("agent.sock");
    let listener = Arc::new(tokio::net::UnixListener::bind(&path).unwrap());
    let count = serve(move || {
        let l = listener.clone();
        async move { l.accept().await.unwrap().0 }
    });
    (Endpoint::Unix(path), count)
}

fn get(path: &str) -> Request<opendsec_http::Body> {
    Request::get(path).body(opendsec_http::empty()).unwrap()
}

async fn text(resp: Response<Incoming>) -> String {
    String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

#[tokio::test]
async fn sequential_requests_to_one_endpoint_share_one_kept_alive_connection() {
    let dir = tempfile::tempdir().unwrap();
    for (to, connections) in [tcp_server().await, unix_server(&dir).await] {
        let client = Client::new(Some(Duration::from_secs(5)));
        for _ in 0..5 {
            assert_eq!(text(client.send(&to, get("/")).await.unwrap()).await, "hello");
        }
        assert_eq!(connections.load(Ordering::SeqCst), 1, "{to}");
    }
}

#[tokio::test]
async fn an_unpooled_client_opens_a_connection_per_request() {
    let (to, connections) = tcp_server().await;
    let client = Client::unpooled(None);
    for _ in 0..3 {
        assert_eq!(text(client.send(&to, get("/")).await.unwrap()).await, "hello");
    }
    assert_eq!(connections.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn bodies_stream_both_ways_piece_by_piece() {
    let (to, _) = tcp_server().await;
    let client = Client::new(None);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(1);
    let body = opendsec_http::body(StreamBody::new(tokio_stream_from(rx)));
    let req = Request::post("/echo").body(body).unwrap();
    let sending = tokio::spawn(async move { client.send(&to, req).await });
    tx.send(Ok(Frame::data(Bytes::from_static(b"first")))).await.unwrap();
    let mut answer = sending.await.unwrap().unwrap().into_body();
    // The first piece comes back while the request body is still open: neither side
    // waited for the whole body.
    let first = tokio::time::timeout(Duration::from_secs(5), answer.frame())
        .await
        .expect("the first piece echoed before the request ended")
        .unwrap()
        .unwrap();
    assert_eq!(first.into_data().unwrap(), "first");
    tx.send(Ok(Frame::data(Bytes::from_static(b"second")))).await.unwrap();
    drop(tx);
    let rest = answer.collect().await.unwrap().to_bytes();
    assert_eq!(rest, "second");
}

#[tokio::test]
async fn a_forwarded_upgrade_joins_the_caller_and_the_far_side() {
    let (far, _) = tcp_server().await;
    // A front server that passes every request on to the far one, as the gateway and
    // the edge's proxy do.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let front = listener.local_addr().unwrap();
    let client = Client::new(None);
    tokio::spawn(async move {
        let (io, _) = listener.accept().await.unwrap();
        let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
            let (client, far) = (client.clone(), far.clone());
            async move {
                let resp = client.forward(&far, req).await.unwrap();
                Ok::<_, Infallible>(resp)
            }
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(io), svc)
            .with_upgrades()
            .await;
    });
    let mut tcp = tokio::net::TcpStream::connect(front).await.unwrap();
    tcp.write_all(b"GET /upgrade HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: echo\r\n\r\n")
        .await
        .unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        tcp.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    assert!(head.starts_with(b"HTTP/1.1 101"), "{}", String::from_utf8_lossy(&head));
    tcp.write_all(b"through both").await.unwrap();
    let mut echoed = [0u8; 12];
    tokio::time::timeout(Duration::from_secs(5), tcp.read_exact(&mut echoed))
        .await
        .expect("the echo arrives")
        .unwrap();
    assert_eq!(&echoed, b"through both");
}

#[tokio::test]
async fn a_refused_connection_is_a_connect_error_naming_the_endpoint() {
    let dir = tempfile::tempdir().unwrap();
    let missing = Endpoint::Unix(dir.path().join("no-agent.sock"));
    let err = Client::new(None).send(&missing, get("/")).await.unwrap_err();
    assert!(
        matches!(&err, Error::Connect { source: ConnectError::Io(io), .. }
            if io.kind() == std::io::ErrorKind::NotFound),
        "the socket's own error, not the pool's wrapper: {err:?}"
    );
    assert!(err.to_string().contains("no-agent.sock"), "{err}");
    assert!(!err.is_connect_timeout());
}

#[tokio::test]
async fn send_on_carries_one_request_over_a_stream_the_caller_opened() {
    let (to, connections) = tcp_server().await;
    let Endpoint::Tcp(addr) = &to else { unreachable!() };
    let tcp = tokio::net::TcpStream::connect(addr.as_str()).await.unwrap();
    let resp = opendsec_http::send_on("the test server", TokioIo::new(tcp), get("/"))
        .await
        .unwrap();
    assert_eq!(text(resp).await, "hello");
    assert_eq!(connections.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_connect_that_does_not_complete_within_the_timeout_says_so() {
    // A listener that never accepts, with its accept queue full: the kernel drops
    // further connection attempts, so a connect neither succeeds nor fails.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(0).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut queued = Vec::new();
    for _ in 0..4 {
        if let Ok(Ok(s)) = tokio::time::timeout(Duration::from_millis(200), tokio::net::TcpStream::connect(addr)).await
        {
            queued.push(s);
        }
    }
    let client = Client::new(Some(Duration::from_millis(300)));
    let started = std::time::Instant::now();
    let err = client
        .send(&Endpoint::Tcp(addr.to_string()), get("/"))
        .await
        .unwrap_err();
    assert!(err.is_connect_timeout(), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
}
