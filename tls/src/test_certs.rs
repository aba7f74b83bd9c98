//! Certificates made at test time (rcgen): a CA, and leaf certificates it
//! signs for servers and clients, valid or expired, written as PEM files.
//! For tests only (feature `test-certs`).
#![allow(clippy::missing_panics_doc)]

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, SanType};

/// A subject alternative name of a test certificate.
#[derive(Clone, Copy, Debug)]
pub enum San<'a> {
    /// A DNS name.
    Dns(&'a str),
    /// A URI (a SPIFFE id, say).
    Uri(&'a str),
    /// An IP address.
    Ip(IpAddr),
}

/// A test certificate authority.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TestCa")
    }
}

/// A leaf certificate and its key, as PEM.
#[derive(Clone, Debug)]
pub struct Leaf {
    /// The certificate (PEM).
    pub cert_pem: String,
    /// Its private key (PKCS#8 PEM).
    pub key_pem: String,
}

impl Leaf {
    /// Write `DIR/NAME.crt` and `DIR/NAME.key`; their paths.
    pub fn write(&self, dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let cert = dir.join(format!("{name}.crt"));
        let key = dir.join(format!("{name}.key"));
        std::fs::write(&cert, &self.cert_pem).expect("write a test certificate");
        std::fs::write(&key, &self.key_pem).expect("write a test key");
        (cert, key)
    }
}

impl TestCa {
    /// A new self-signed CA named `name`.
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("no names is valid");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate().expect("ring generates a key");
        let issuer = CertifiedIssuer::self_signed(params, key).expect("a self-signed CA");
        Self { issuer }
    }

    /// The CA certificate (PEM), the bundle a peer trusts.
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// Write the CA certificate to `DIR/NAME.crt`; its path.
    pub fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(format!("{name}.crt"));
        std::fs::write(&p, self.pem()).expect("write a test CA");
        p
    }

    /// A leaf naming `sans`, valid now (or expired since 2021 when
    /// `expired`), usable for both server and client authentication.
    pub fn leaf(&self, sans: &[San<'_>], expired: bool) -> Leaf {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("no names is valid");
        params
            .distinguished_name
            .push(DnType::CommonName, "quotalease test");
        params.subject_alt_names = sans
            .iter()
            .map(|s| match s {
                San::Dns(d) => SanType::DnsName((*d).try_into().expect("a valid DNS name")),
                San::Uri(u) => SanType::URI((*u).try_into().expect("a valid URI")),
                San::Ip(ip) => SanType::IpAddress(*ip),
            })
            .collect();
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let key = KeyPair::generate().expect("ring generates a key");
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("the CA signs the leaf");
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}
