//! Edge admission (`POST /admit` on an edge's proxy, authenticated with
//! [`crate::headers::EDGE_KEY_HEADER`]): before the leader logs a sandbox placed on an
//! edge that answers admission, it asks the edge itself, which judges from what really
//! runs there. A refusal (or no answer) makes the leader place the sandbox again
//! without that edge.

use opendsec_projections::Isolation;
use serde::{Deserialize, Serialize};

/// What the edge is asked to take (the JSON body of `POST /admit`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdmitRequest {
    pub sandbox: String,
    pub cpu_millis: u64,
    pub memory_mb: u64,
    /// `container` (the default when absent), `microvm` or `vm`: a VM also needs its RAM
    /// file's room on disk. A value the edge does not know is refused as a bad request.
    #[serde(default)]
    pub isolation: Isolation,
}

/// Why an edge refused (the JSON body of a non-2xx answer, as every error of the edge's
/// proxy): `code` is machine-readable (`refused` for a judged refusal), `message` is
/// what the leader logs and tells.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdmitRefusal {
    pub code: String,
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_without_isolation_is_for_a_container() {
        let r: AdmitRequest = serde_json::from_str(r#"{"sandbox":"s","cpu_millis":100,"memory_mb":64}"#).unwrap();
        assert_eq!(r.isolation, Isolation::Container);
        assert_eq!(r.cpu_millis, 100);
    }

    #[test]
    fn isolation_travels_by_name_and_an_unknown_one_is_refused() {
        let r = AdmitRequest {
            sandbox: "s".into(),
            cpu_millis: 1,
            memory_mb: 2,
            isolation: Isolation::Microvm,
        };
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["isolation"], "microvm");
        assert_eq!(serde_json::from_value::<AdmitRequest>(v).unwrap(), r);
        let bad = serde_json::from_str::<AdmitRequest>(
            r#"{"sandbox":"s","cpu_millis":1,"memory_mb":2,"isolation":"hypervisor"}"#,
        );
        assert!(bad.unwrap_err().to_string().contains("hypervisor"));
    }

    #[test]
    fn a_refusal_reads_as_the_proxy_writes_its_errors() {
        let r: AdmitRefusal = serde_json::from_str(r#"{"code":"refused","message":"no room"}"#).unwrap();
        assert_eq!(r.message, "no room");
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            serde_json::json!({"code": "refused", "message": "no room"})
        );
    }
}
