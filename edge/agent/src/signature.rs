//! The signature of E2B's signed `/files` URLs. Standalone (sha2 and base64 only): the
//! gateway includes this file too, to tell whether a request may resume a paused
//! sandbox before the agent sees it.

/// The signature of a signed `/files` URL, as E2B's SDK makes it
/// (`e2b/sandbox/signature.py`): `v1_` + unpadded standard base64 of
/// SHA-256(`path:operation:username:token[:expiration]`), where `username`
/// is empty when the URL names none (the default user).
pub fn file_signature(token: &str, path: &str, operation: &str, username: &str, expiration: Option<i64>) -> String {
    use base64::Engine;
    use sha2::Digest;
    let raw = match expiration {
        None => format!("{path}:{operation}:{username}:{token}"),
        Some(e) => format!("{path}:{operation}:{username}:{token}:{e}"),
    };
    let digest = sha2::Sha256::digest(raw.as_bytes());
    format!("v1_{}", base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest))
}
