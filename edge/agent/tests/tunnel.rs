//! `GET /.opendsec/tunnel`: a TCP tunnel to a port inside the sandbox, over
//! an HTTP/1.1 upgrade, against echo servers on loopback.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, Empty};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Echoes every connection's bytes back; closes its side at the client's EOF.
async fn echo_server() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
    port
}

enum Opened {
    Tunnel(TokioIo<hyper::upgrade::Upgraded>),
    Refused(u16, Value),
}

/// Asks the agent for a tunnel the way the edge does: an HTTP/1.1 client
/// connection with upgrades.
async fn open(a: &Agent, query: &str, upgrade_headers: bool) -> Opened {
    let stream = tokio::net::UnixStream::connect(&a.sock).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    let mut b = Request::get(format!("/.opendsec/tunnel?{query}")).header("host", "localhost");
    if upgrade_headers {
        b = b.header("connection", "Upgrade").header("upgrade", "opendsec-tcp");
    }
    if let Some(t) = &a.token {
        b = b.header("x-access-token", t);
    }
    let resp = sender
        .send_request(b.body(Empty::<Bytes>::new()).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    if status == 101 {
        assert_eq!(resp.headers()["upgrade"], "opendsec-tcp");
        return Opened::Tunnel(TokioIo::new(hyper::upgrade::on(resp).await.unwrap()));
    }
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Opened::Refused(status, serde_json::from_slice(&body).unwrap())
}

async fn tunnel(a: &Agent, query: &str) -> TokioIo<hyper::upgrade::Upgraded> {
    match open(a, query, true).await {
        Opened::Tunnel(t) => t,
        Opened::Refused(s, v) => panic!("tunnel refused: {s} {v}"),
    }
}

async fn refused(a: &Agent, query: &str, upgrade_headers: bool) -> (u16, Value) {
    match open(a, query, upgrade_headers).await {
        Opened::Tunnel(_) => panic!("tunnel opened for {query}"),
        Opened::Refused(s, v) => (s, v),
    }
}

#[tokio::test]
async fn bytes_go_both_ways_through_the_tunnel() {
    let a = Agent::start().await;
    let port = echo_server().await;
    let mut t = tunnel(&a, &format!("port={port}")).await;
    for msg in [&b"hello"[..], b"second message", &[0u8, 255, 10, 13]] {
        t.write_all(msg).await.unwrap();
        let mut back = vec![0u8; msg.len()];
        t.read_exact(&mut back).await.unwrap();
        assert_eq!(back, msg);
    }
    // Closing our side closes the port's side, whose close comes back as EOF.
    t.shutdown().await.unwrap();
    let mut rest = Vec::new();
    t.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());
}

#[tokio::test]
async fn half_close_reaches_the_server_and_its_answer_still_comes_back() {
    let a = Agent::start().await;
    // Reads to EOF, then answers with the count and closes.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut all = Vec::new();
        s.read_to_end(&mut all).await.unwrap();
        s.write_all(format!("got {} bytes", all.len()).as_bytes())
            .await
            .unwrap();
        s.shutdown().await.unwrap();
    });
    let mut t = tunnel(&a, &format!("port={port}")).await;
    t.write_all(&[7u8; 10_000]).await.unwrap();
    t.shutdown().await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), t.read_to_string(&mut answer))
        .await
        .expect("answer after half-close")
        .unwrap();
    assert_eq!(answer, "got 10000 bytes");
}

#[tokio::test]
async fn several_megabytes_each_way() {
    let a = Agent::start().await;
    let port = echo_server().await;
    let t = tunnel(&a, &format!("port={port}")).await;
    let (mut r, mut w) = tokio::io::split(t);
    const LEN: usize = 8 << 20;
    let data: Vec<u8> = (0..LEN).map(|i| (i * 31 % 251) as u8).collect();
    let sent = data.clone();
    let writer = tokio::spawn(async move {
        for chunk in sent.chunks(100_000) {
            w.write_all(chunk).await.unwrap();
        }
        w.shutdown().await.unwrap();
    });
    let mut back = Vec::with_capacity(LEN);
    tokio::time::timeout(Duration::from_secs(60), r.read_to_end(&mut back))
        .await
        .expect("echo within 60 s")
        .unwrap();
    writer.await.unwrap();
    assert_eq!(back.len(), LEN);
    assert!(back == data, "echoed bytes differ");
}

#[tokio::test]
async fn wait_ms_waits_for_a_listener_that_comes_up_later() {
    let a = Agent::start().await;
    let port = free_port();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let l = TcpListener::bind(("127.0.0.1", port)).await.unwrap();
        let (mut s, _) = l.accept().await.unwrap();
        s.write_all(b"late hello").await.unwrap();
    });
    let t0 = Instant::now();
    let mut t = tunnel(&a, &format!("port={port}&wait_ms=5000")).await;
    assert!(t0.elapsed() >= Duration::from_millis(190), "{:?}", t0.elapsed());
    let mut got = [0u8; 10];
    t.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"late hello");
}

#[tokio::test]
async fn closed_port_is_502_after_the_wait() {
    let a = Agent::start().await;
    let port = free_port();
    let (st, v) = refused(&a, &format!("port={port}"), true).await;
    assert_eq!(st, 502);
    assert_eq!(v["code"], 502);
    assert_eq!(v["message"], format!("port {port} is not open in the sandbox"));
    let t0 = Instant::now();
    let (st, _) = refused(&a, &format!("port={port}&wait_ms=300"), true).await;
    assert_eq!(st, 502);
    assert!(t0.elapsed() >= Duration::from_millis(280), "{:?}", t0.elapsed());
}

#[tokio::test]
async fn bad_port_or_missing_upgrade_is_400() {
    let a = Agent::start().await;
    let port = echo_server().await;
    for q in [
        "",
        "port=0",
        "port=65536",
        "port=abc",
        "port=-1",
        "port=80&wait_ms=soon",
    ] {
        let (st, v) = refused(&a, q, true).await;
        assert_eq!((st, v["code"].as_u64()), (400, Some(400)), "{q}: {v}");
        assert!(v["message"].as_str().unwrap().len() > 5, "{q}: {v}");
    }
    let (st, v) = refused(&a, &format!("port={port}"), false).await;
    assert_eq!(st, 400, "{v}");
    assert!(v["message"].as_str().unwrap().contains("Upgrade"), "{v}");
}

#[tokio::test]
async fn tunnel_needs_the_access_token() {
    let mut a = Agent::start_with(Some("tunnel-secret")).await;
    let port = echo_server().await;
    let mut t = tunnel(&a, &format!("port={port}")).await;
    t.write_all(b"ok").await.unwrap();
    let mut b = [0u8; 2];
    t.read_exact(&mut b).await.unwrap();
    a.token = None;
    let (st, v) = refused(&a, &format!("port={port}"), true).await;
    assert_eq!((st, v["code"].as_u64()), (401, Some(401)), "{v}");
    a.token = Some("wrong".into());
    let (st, _) = refused(&a, &format!("port={port}"), true).await;
    assert_eq!(st, 401);
}
