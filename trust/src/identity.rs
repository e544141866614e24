//! What a certificate says its holder is: a role and a name, carried as one URI in the
//! certificate's subject alternative names (`spiffe://opendsec/<role>/<name>`).

use std::fmt;

/// The kinds of component that hold a certificate of the cluster's CA.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// A control node (Raft, forwarding, the edge slice); named by its node id.
    Control,
    /// A control node's gateway, as a client of edges (proxied traffic, admission);
    /// named by its node id.
    Gateway,
    /// An edge; named by its edge name, bound when it joined.
    Edge,
    /// A tool run by an operator on a control host (`opendsec init`).
    Operator,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Control => "control",
            Role::Gateway => "gateway",
            Role::Edge => "edge",
            Role::Operator => "operator",
        }
    }

    fn parse(s: &str) -> Option<Role> {
        Some(match s {
            "control" => Role::Control,
            "gateway" => Role::Gateway,
            "edge" => Role::Edge,
            "operator" => Role::Operator,
            _ => return None,
        })
    }
}

/// Who a certificate is for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Identity {
    pub role: Role,
    pub name: String,
}

const URI_PREFIX: &str = "spiffe://opendsec/";

impl Identity {
    pub fn control(node: u64) -> Identity {
        Identity {
            role: Role::Control,
            name: node.to_string(),
        }
    }

    pub fn gateway(node: u64) -> Identity {
        Identity {
            role: Role::Gateway,
            name: node.to_string(),
        }
    }

    pub fn edge(name: &str) -> Identity {
        Identity {
            role: Role::Edge,
            name: name.to_string(),
        }
    }

    pub fn operator(name: &str) -> Identity {
        Identity {
            role: Role::Operator,
            name: name.to_string(),
        }
    }

    /// The URI the certificate carries.
    pub fn uri(&self) -> String {
        format!("{URI_PREFIX}{}/{}", self.role.as_str(), self.name)
    }

    /// The identity a URI names, if it is one of ours and well formed (a name of
    /// lower-case letters, digits, `-`, `_` and `.`, as edge names are).
    pub fn from_uri(uri: &str) -> Option<Identity> {
        let (role, name) = uri.strip_prefix(URI_PREFIX)?.split_once('/')?;
        let ok = !name.is_empty()
            && name.len() <= 128
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.'));
        let role = Role::parse(role)?;
        ok.then(|| Identity {
            role,
            name: name.to_string(),
        })
    }

    /// The identity a certificate (DER) carries: exactly one of our URIs among its
    /// subject alternative names, else none.
    pub fn of_certificate(der: &[u8]) -> Option<Identity> {
        use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
        let (_, cert) = X509Certificate::from_der(der).ok()?;
        let san = cert.subject_alternative_name().ok()??;
        let mut ours = san.value.general_names.iter().filter_map(|n| match n {
            GeneralName::URI(u) if u.starts_with(URI_PREFIX) => Some(*u),
            _ => None,
        });
        let first = ours.next()?;
        if ours.next().is_some() {
            return None;
        }
        Identity::from_uri(first)
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.role {
            Role::Control => write!(f, "control node {}", self.name),
            Role::Gateway => write!(f, "the gateway of node {}", self.name),
            Role::Edge => write!(f, "edge {}", self.name),
            Role::Operator => write!(f, "operator tool {}", self.name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_round_trips_through_its_uri_and_nothing_else_parses() {
        for id in [
            Identity::control(3),
            Identity::gateway(1),
            Identity::edge("edge-1.rack_2"),
            Identity::operator("init"),
        ] {
            assert_eq!(Identity::from_uri(&id.uri()), Some(id));
        }
        for bad in [
            "spiffe://opendsec/edge/",
            "spiffe://opendsec/edge/E2",
            "spiffe://opendsec/edge/a/b",
            "spiffe://opendsec/root/x",
            "spiffe://other/edge/e1",
            "https://opendsec/edge/e1",
        ] {
            assert_eq!(Identity::from_uri(bad), None, "{bad}");
        }
    }
}
