//! Spec: who may speak to whom, decided by the certificates of the cluster's CA.

use std::sync::Arc;

use opendsec_trust::{Ca, Expect, Identity, Role, Trust, request, stranger_config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Serves one TLS connection on loopback with `server`; returns what the client said and
/// the identity the server saw, or the error of either side.
async fn one_session(
    server: Arc<Trust>,
    client: impl FnOnce(tokio::net::TcpStream) -> futures_like::BoxFut,
) -> Result<(String, Option<Identity>), String> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let srv = tokio::spawn(async move {
        let (tcp, _) = l.accept().await.unwrap();
        let (mut tls, id) = server.accept(tcp).await.map_err(|e| format!("server: {e}"))?;
        let mut buf = vec![0u8; 5];
        tls.read_exact(&mut buf)
            .await
            .map_err(|e| format!("server read: {e}"))?;
        Ok::<_, String>((String::from_utf8(buf).unwrap(), id))
    });
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let sent = client(tcp).await;
    let got = srv.await.unwrap();
    sent?;
    got
}

mod futures_like {
    pub type BoxFut = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send>>;
}

fn as_client(trust: Arc<Trust>, expect: Expect) -> impl FnOnce(tokio::net::TcpStream) -> futures_like::BoxFut {
    move |tcp| {
        Box::pin(async move {
            let mut tls = trust.connect(tcp, &expect).await.map_err(|e| format!("client: {e}"))?;
            tls.write_all(b"hello")
                .await
                .map_err(|e| format!("client write: {e}"))?;
            tls.flush().await.map_err(|e| e.to_string())?;
            Ok(())
        })
    }
}

#[tokio::test]
async fn components_of_one_ca_see_each_others_identity() {
    let t = opendsec_trust::test_cluster(&[Identity::control(1), Identity::edge("e1")]);
    let (said, id) = one_session(t[0].clone(), as_client(t[1].clone(), Expect::Role(Role::Control)))
        .await
        .unwrap();
    assert_eq!(said, "hello");
    assert_eq!(id, Some(Identity::edge("e1")));
}

#[tokio::test]
async fn a_client_refuses_a_server_that_is_not_the_one_it_expects() {
    let t = opendsec_trust::test_cluster(&[Identity::edge("e1"), Identity::gateway(1)]);
    let err = one_session(
        t[0].clone(),
        as_client(t[1].clone(), Expect::Exactly(Identity::edge("e2"))),
    )
    .await
    .unwrap_err();
    assert!(err.contains("the peer is edge e1, not edge e2"), "{err}");
}

#[tokio::test]
async fn a_certificate_of_another_ca_is_refused_both_ways() {
    let ours = opendsec_trust::test_cluster(&[Identity::control(1), Identity::control(2)]);
    let theirs = opendsec_trust::test_cluster(&[Identity::control(3)]);
    // Their client, our server: the server refuses the client's certificate.
    let err = one_session(
        ours[0].clone(),
        as_client(theirs[0].clone(), Expect::Role(Role::Control)),
    )
    .await
    .unwrap_err();
    assert!(err.contains("client") || err.contains("server"), "{err}");
    // Our client, their server: the client refuses the server's.
    let err = one_session(
        theirs[0].clone(),
        as_client(ours[1].clone(), Expect::Role(Role::Control)),
    )
    .await
    .unwrap_err();
    assert!(err.contains("UnknownIssuer"), "{err}");
}

#[tokio::test]
async fn a_stranger_without_a_certificate_reaches_the_server_as_no_one() {
    let t = opendsec_trust::test_cluster(&[Identity::control(1)]);
    let cfg = stranger_config(t[0].ca_pem(), Expect::Role(Role::Control)).unwrap();
    let (_, id) = one_session(t[0].clone(), move |tcp| {
        Box::pin(async move {
            let mut tls = tokio_rustls::TlsConnector::from(cfg)
                .connect(opendsec_trust::peer_name(), tcp)
                .await
                .map_err(|e| e.to_string())?;
            tls.write_all(b"hello").await.map_err(|e| e.to_string())?;
            Ok(())
        })
    })
    .await
    .unwrap();
    assert_eq!(id, None);
}

#[test]
fn the_ca_decides_what_a_signed_request_names_whatever_the_request_asked() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::create(dir.path()).unwrap();
    // The edge asks as if it were a control node; the CA signs it as edge e7 only.
    let (key_pem, csr) = request(&Identity::control(1)).unwrap();
    let cert_pem = ca.sign_request(&csr, &Identity::edge("e7")).unwrap();
    let der = rustls_pemfile::certs(&mut cert_pem.as_bytes()).next().unwrap().unwrap();
    assert_eq!(Identity::of_certificate(&der), Some(Identity::edge("e7")));
    let issued = opendsec_trust::Issued { cert_pem, key_pem };
    assert!(Trust::new(Identity::edge("e7"), ca.cert_pem(), &issued, None).is_ok());
    let err = Trust::new(Identity::control(1), ca.cert_pem(), &issued, None).unwrap_err();
    assert!(err.to_string().contains("is for edge e7, not control node 1"), "{err}");
}

#[test]
fn a_reloaded_ca_issues_what_the_saved_certificate_verifies_and_is_never_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let first = Ca::create(dir.path()).unwrap();
    let pem = first.cert_pem().to_string();
    drop(first);
    let again = Ca::load_or_create(dir.path()).unwrap();
    assert_eq!(again.cert_pem(), pem);
    let issued = again.issue(&Identity::gateway(2)).unwrap();
    assert!(Trust::new(Identity::gateway(2), &pem, &issued, None).is_ok());
    let err = Ca::create(dir.path()).unwrap_err();
    assert!(err.to_string().contains("already holds a CA"), "{err}");
    // Key files are the owner's only.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.path().join("ca.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[tokio::test]
async fn a_renewed_certificate_is_presented_by_new_sessions() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::create(dir.path()).unwrap();
    let pem = ca.cert_pem().to_string();
    let server = Arc::new(Trust::issued_by(ca, Identity::control(1)).unwrap());
    let before = server.not_after().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1100));
    server.reissue().unwrap();
    assert!(server.not_after().unwrap() > before);
    let client = Arc::new(
        Trust::new(
            Identity::control(2),
            &pem,
            &server.issuer().unwrap().issue(&Identity::control(2)).unwrap(),
            None,
        )
        .unwrap(),
    );
    let (_, id) = one_session(server.clone(), as_client(client, Expect::Role(Role::Control)))
        .await
        .unwrap();
    assert_eq!(id, Some(Identity::control(2)));
    // A certificate for someone else is not installed.
    let other = server.issuer().unwrap().issue(&Identity::edge("e1")).unwrap();
    assert!(server.install(&other).is_err());
}
