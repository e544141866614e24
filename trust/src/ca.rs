//! The cluster's certificate authority: `ca.crt` + `ca.key` (0600) in a directory that
//! only control hosts hold. It issues every component's certificate; an edge's is signed
//! from a request the edge made, so its key never leaves the edge.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

use crate::{Error, Identity};

/// How long a component's certificate is valid. Control nodes issue their own at every
/// start and on rotation; edges renew theirs when a third of this is left.
pub const LEAF_DAYS: i64 = 90;
const CA_DAYS: i64 = 3650;
/// A component's certificate is valid from this long before it was issued (clocks of
/// components differ a little).
pub const BACKDATE_MINUTES: i64 = 5;

/// A certificate and its private key, both PEM.
#[derive(Clone)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for Issued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Issued { key: <redacted> }")
    }
}

/// The cluster CA, loaded with its key.
pub struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
    /// `ca.crt` as written: what every component trusts.
    pem: String,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ca { key: <redacted> }")
    }
}

/// A new CA's parameters; its name carries a fingerprint of its key, so that two
/// clusters' CAs are told apart by name ("unknown issuer", not a bad signature).
fn ca_params(key: &KeyPair) -> CertificateParams {
    let mut params = CertificateParams::default();
    let tag: String = key
        .public_key_raw()
        .iter()
        .rev()
        .take(6)
        .map(|b| format!("{b:02x}"))
        .collect();
    params
        .distinguished_name
        .push(DnType::CommonName, format!("OpenDsec cluster CA {tag}"));
    params.distinguished_name.push(DnType::OrganizationName, "OpenDsec");
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = time::OffsetDateTime::now_utc() - time::Duration::days(1);
    params.not_after = time::OffsetDateTime::now_utc() + time::Duration::days(CA_DAYS);
    params
}

/// `ca.crt` and `ca.key` in `dir`.
pub fn ca_files(dir: &Path) -> (PathBuf, PathBuf) {
    (dir.join("ca.crt"), dir.join("ca.key"))
}

fn read(path: &Path) -> Result<String, Error> {
    std::fs::read_to_string(path).map_err(|e| Error::File(path.to_path_buf(), e.to_string()))
}

impl Ca {
    /// A new CA in `dir`; refused if one is there (it would cut off every certificate
    /// the old one issued).
    pub fn create(dir: &Path) -> Result<Ca, Error> {
        let (crt, key) = ca_files(dir);
        if crt.exists() || key.exists() {
            return Err(Error::Exists(crt));
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::File(dir.to_path_buf(), e.to_string()))?;
        let kp = KeyPair::generate()?;
        let cert = ca_params(&kp).self_signed(&kp)?;
        crate::write_private(&key, &kp.serialize_pem())?;
        crate::write_private(&crt, &cert.pem())?;
        let pem = cert.pem();
        Ok(Ca { cert, key: kp, pem })
    }

    /// The CA in `dir`.
    pub fn load(dir: &Path) -> Result<Ca, Error> {
        let (crt, key) = ca_files(dir);
        let pem = read(&crt)?;
        let kp = KeyPair::from_pem(&read(&key)?).map_err(|e| Error::Parse(key.clone(), e.to_string()))?;
        // The same name and key make an equivalent issuer: what it signs verifies against
        // the saved ca.crt, which the components (and users of the TLS port) trust.
        let params = CertificateParams::from_ca_cert_pem(&pem).map_err(|e| Error::Parse(crt.clone(), e.to_string()))?;
        let cert = params.self_signed(&kp)?;
        Ok(Ca { cert, key: kp, pem })
    }

    /// The CA in `dir`, made there the first time (a single node, or the first of a cluster).
    pub fn load_or_create(dir: &Path) -> Result<Ca, Error> {
        let (crt, key) = ca_files(dir);
        if crt.exists() && key.exists() {
            Ca::load(dir)
        } else if crt.exists() {
            Err(Error::NoCaKey(key))
        } else {
            Ca::create(dir)
        }
    }

    /// `ca.crt` (PEM).
    pub fn cert_pem(&self) -> &str {
        &self.pem
    }

    fn leaf_params(id: &Identity) -> Result<CertificateParams, Error> {
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, id.uri());
        params.distinguished_name.push(DnType::OrganizationName, "OpenDsec");
        params
            .subject_alt_names
            .push(SanType::URI(id.uri().try_into().map_err(|_| Error::Name(id.uri()))?));
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        // Every component is both a server and a client of the others.
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.not_before = time::OffsetDateTime::now_utc() - time::Duration::minutes(BACKDATE_MINUTES);
        params.not_after = time::OffsetDateTime::now_utc() + time::Duration::days(LEAF_DAYS);
        Ok(params)
    }

    /// A certificate for `id` with a fresh key (control nodes, their gateways, operator tools).
    pub fn issue(&self, id: &Identity) -> Result<Issued, Error> {
        let key = KeyPair::generate()?;
        let cert = Self::leaf_params(id)?.signed_by(&key, &self.cert, &self.key)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// Signs `csr_pem` for `id`: the CA decides what the certificate says (the identity,
    /// the usages, the validity); the request only brings its public key.
    pub fn sign_request(&self, csr_pem: &str, id: &Identity) -> Result<String, Error> {
        let csr = CertificateSigningRequestParams::from_pem(csr_pem).map_err(|e| Error::Request(e.to_string()))?;
        let cert = Self::leaf_params(id)?.signed_by(&csr.public_key, &self.cert, &self.key)?;
        Ok(cert.pem())
    }

    /// A server certificate for host names and addresses (the gateway's TLS port: the
    /// domain, `*.domain`, localhost), valid a year, with the CA after it in the chain.
    pub fn issue_server(&self, names: &[String], ips: &[std::net::IpAddr]) -> Result<Issued, Error> {
        let mut params = CertificateParams::new(names.to_vec())?;
        params
            .subject_alt_names
            .extend(ips.iter().map(|ip| SanType::IpAddress(*ip)));
        if let Some(first) = names.first() {
            params.distinguished_name.push(DnType::CommonName, first.clone());
        }
        params.not_before = time::OffsetDateTime::now_utc() - time::Duration::days(1);
        params.not_after = time::OffsetDateTime::now_utc() + time::Duration::days(365);
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.cert, &self.key)?;
        Ok(Issued {
            cert_pem: format!("{}{}", cert.pem(), self.pem),
            key_pem: key.serialize_pem(),
        })
    }
}

/// A key and a request for `id`'s certificate, made where the key is to stay (an edge).
pub fn request(id: &Identity) -> Result<(String, String), Error> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, id.uri());
    let csr = params.serialize_request(&key)?;
    Ok((key.serialize_pem(), csr.pem()?))
}
