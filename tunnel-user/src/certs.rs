//! `tunnel certs`: a private CA and the certificates the tunnel needs (cloud server,
//! edge clients, stand-in HTTPS servers) and a token file, for tests, demos and small
//! installs.

use std::collections::HashSet;
use std::fmt;
use std::fs;
use std::io::Write as _;
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::addr::check_node_name;
use crate::config::token_file::{TokenFile, TokenFileError};

pub(crate) const DEFAULT_CLOUD_NAME: &str = "tunnel-cloud";
pub(crate) const DEFAULT_CLOUD_IP: &str = "127.0.0.1";

const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 60 * 60);
/// 825 days is the longest TLS server certificate lifetime some clients accept. Re-run
/// `tunnel certs` with the same --out to renew: the CA stays, so trust does too.
const LEAF_VALIDITY: Duration = Duration::from_secs(825 * 24 * 60 * 60);
/// Certificates start an hour in the past so an edge whose clock lags a little does
/// not reject a certificate issued a moment ago.
const BACKDATE: Duration = Duration::from_secs(60 * 60);
/// The CA's subject. Fixed, so an existing CA can be recognised and reused from its
/// key alone.
const CA_NAME: &str = "tunnel CA";

#[derive(Debug, Clone, clap::Args)]
pub struct CertsArgs {
    /// Directory to write into (created). A CA already there (ca.crt, ca.key) is
    /// reused, so edges can be added later.
    #[arg(long, value_name = "DIR")]
    pub(crate) out: PathBuf,
    /// DNS name in the cloud's certificate (repeatable).
    #[arg(long = "cloud-name", value_name = "NAME", default_value = DEFAULT_CLOUD_NAME)]
    pub(crate) cloud_names: Vec<String>,
    /// IP address in the cloud's certificate (repeatable).
    #[arg(long = "cloud-ip", value_name = "IP", default_value = DEFAULT_CLOUD_IP)]
    pub(crate) cloud_ips: Vec<IpAddr>,
    /// Issue edge-NODE.crt/.key, a client certificate with CN=NODE (repeatable).
    #[arg(long = "edge", value_name = "NODE")]
    pub(crate) edges: Vec<String>,
    /// Issue relay-NODE.crt/.key, the client certificate of the relay on NODE, with
    /// CN=system:tunnel-relay:NODE, which the replicas' peer listener accepts as a
    /// relay's and no edge can present (repeatable).
    #[arg(long = "relay", value_name = "NODE")]
    pub(crate) relays: Vec<String>,
    /// Issue server-NAME.crt/.key, a serving certificate for NAME and these IPs, e.g. an
    /// HTTPS server standing in for a kubelet: --server kubelet=127.1.0.5 (repeatable).
    #[arg(long = "server", value_name = "NAME=IP[,IP..]")]
    pub(crate) servers: Vec<ServerSpec>,
    /// Write `tokens`, a random token per --edge; lines of other nodes already in the
    /// file are kept.
    #[arg(long, requires = "edges")]
    pub(crate) tokens: bool,
}

impl CertsArgs {
    /// The command line's defaults, writing into `out`.
    pub fn new(out: impl Into<PathBuf>) -> Self {
        Self {
            out: out.into(),
            cloud_names: vec![DEFAULT_CLOUD_NAME.into()],
            cloud_ips: vec![IpAddr::from([127, 0, 0, 1])],
            edges: Vec::new(),
            relays: Vec::new(),
            servers: Vec::new(),
            tokens: false,
        }
    }
}

/// `NAME=IP[,IP..]` of `--server`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ServerSpec {
    pub(crate) name: String,
    pub(crate) ips: Vec<IpAddr>,
}

impl FromStr for ServerSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (name, ips) = s
            .split_once('=')
            .ok_or_else(|| format!("`{s}` is not NAME=IP[,IP..]"))?;
        check_node_name(name)?;
        let ips = ips
            .split(',')
            .map(|ip| {
                ip.trim()
                    .parse::<IpAddr>()
                    .map_err(|_| format!("`{ip}` is not an IP address"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            name: name.to_string(),
            ips,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {problem}")]
    Ca { path: PathBuf, problem: String },
    #[error("cannot make the {what}: {source}")]
    Generate { what: String, source: rcgen::Error },
    #[error("{arg} `{value}`: {problem}")]
    Arg {
        arg: &'static str,
        value: String,
        problem: String,
    },
    #[error(transparent)]
    Tokens(#[from] TokenFileError),
}

/// One file `generate` wrote or reused.
#[derive(Debug, Clone, PartialEq)]
pub struct Written {
    pub(crate) path: PathBuf,
    pub(crate) what: String,
}

impl fmt::Display for Written {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.what)
    }
}

/// `tunnel certs`.
pub fn run(args: &CertsArgs) -> anyhow::Result<()> {
    for written in generate(args)? {
        println!("{written}");
    }
    Ok(())
}

/// Writes what `args` asks for into `args.out` and says what it wrote. Tests call this
/// to get a CA and certificates in a temporary directory.
pub fn generate(args: &CertsArgs) -> Result<Vec<Written>, CertError> {
    check_args(args)?;
    let dir = &args.out;
    fs::create_dir_all(dir).map_err(io(dir))?;
    let (ca, mut written) = ca_files(dir)?;
    written.extend(cloud_cert(dir, &ca, args)?);

    for node in &args.edges {
        let edge = ca.issue_edge(node)?;
        written.extend(edge.write(
            dir,
            &format!("edge-{node}"),
            &format!("client certificate of edge node {node}"),
        )?);
    }

    for node in &args.relays {
        let cn = format!("{}{node}", crate::io::x509::RELAY_CN_PREFIX);
        let relay = ca.issue(&cn, &[], &[], &[ExtendedKeyUsagePurpose::ClientAuth])?;
        written.extend(relay.write(
            dir,
            &format!("relay-{node}"),
            &format!("client certificate of the relay on node {node}"),
        )?);
    }

    for server in &args.servers {
        let names = [server.name.clone()];
        let cert = ca.issue(
            &server.name,
            &names,
            &server.ips,
            &[ExtendedKeyUsagePurpose::ServerAuth],
        )?;
        let ips: Vec<String> = server.ips.iter().map(IpAddr::to_string).collect();
        let what = format!(
            "server certificate for {} at {}",
            server.name,
            ips.join(", ")
        );
        written.extend(cert.write(dir, &format!("server-{}", server.name), &what)?);
    }

    if args.tokens {
        let path = dir.join("tokens");
        write_tokens(&path, &args.edges)?;
        written.push(Written {
            path,
            what: format!("tokens for {}", args.edges.join(", ")),
        });
    }
    Ok(written)
}

/// The CA in `dir`, reused, or a new one written there.
fn ca_files(dir: &Path) -> Result<(Ca, Vec<Written>), CertError> {
    let mut written = Vec::new();
    let (ca, reused) = Ca::load_or_create(dir)?;
    let ca_crt = dir.join("ca.crt");
    if reused {
        written.push(Written {
            path: ca_crt,
            what: "CA certificate (existing, reused)".into(),
        });
        written.push(Written {
            path: dir.join("ca.key"),
            what: "CA key (existing, reused)".into(),
        });
    } else {
        write_file(&ca_crt, ca.cert_pem.as_bytes(), false)?;
        written.push(Written {
            path: ca_crt,
            what: "CA certificate (new)".into(),
        });
        let ca_key = dir.join("ca.key");
        write_file(&ca_key, ca.key.serialize_pem().as_bytes(), true)?;
        written.push(Written {
            path: ca_key,
            what: "CA key (new)".into(),
        });
    }
    Ok((ca, written))
}

/// The cloud's server certificate, for `--cloud-name` and `--cloud-ip`.
fn cloud_cert(dir: &Path, ca: &Ca, args: &CertsArgs) -> Result<[Written; 2], CertError> {
    let mut sans: Vec<String> = args.cloud_names.clone();
    sans.extend(args.cloud_ips.iter().map(IpAddr::to_string));
    // clientAuth too: replicas present this certificate to each other (peers).
    let usages = [
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let cloud = ca.issue(
        &args.cloud_names[0],
        &args.cloud_names,
        &args.cloud_ips,
        &usages,
    )?;
    cloud.write(
        dir,
        "cloud",
        &format!("tunnel-cloud server certificate for {}", sans.join(", ")),
    )
}

fn check_args(args: &CertsArgs) -> Result<(), CertError> {
    let bad = |arg, value: &str, problem: String| CertError::Arg {
        arg,
        value: value.to_string(),
        problem,
    };
    if args.cloud_names.is_empty() {
        return Err(bad("--cloud-name", "", "give at least one".into()));
    }
    for name in &args.cloud_names {
        if name.is_empty()
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'*')
        {
            return Err(bad("--cloud-name", name, "not a DNS name".into()));
        }
    }
    for (arg, nodes) in [("--edge", &args.edges), ("--relay", &args.relays)] {
        let mut seen = HashSet::new();
        for node in nodes {
            check_node_name(node).map_err(|p| bad(arg, node, p))?;
            if !seen.insert(node) {
                return Err(bad(arg, node, "given twice".into()));
            }
        }
    }
    let mut seen = HashSet::new();
    for server in &args.servers {
        check_node_name(&server.name).map_err(|p| bad("--server", &server.name, p))?;
        if !seen.insert(&server.name) {
            return Err(bad("--server", &server.name, "given twice".into()));
        }
    }
    Ok(())
}

/// The CA, with what is needed to sign.
struct Ca {
    params: CertificateParams,
    key: KeyPair,
    cert_pem: String,
}

impl Ca {
    /// The CA in `dir`, or a new one; `true` when reused.
    fn load_or_create(dir: &Path) -> Result<(Self, bool), CertError> {
        let (crt_path, key_path) = (dir.join("ca.crt"), dir.join("ca.key"));
        match (crt_path.exists(), key_path.exists()) {
            (false, false) => Ok((Self::create()?, false)),
            (true, true) => Ok((Self::load(&crt_path, &key_path)?, true)),
            (true, false) => Err(CertError::Ca {
                path: key_path,
                problem: "missing beside ca.crt".into(),
            }),
            (false, true) => Err(CertError::Ca {
                path: crt_path,
                problem: "missing beside ca.key".into(),
            }),
        }
    }

    fn create() -> Result<Self, CertError> {
        let params = ca_params();
        let key = generate_key("CA key")?;
        let cert = params
            .self_signed(&key)
            .map_err(|source| CertError::Generate {
                what: "CA certificate".into(),
                source,
            })?;
        Ok(Self {
            params,
            key,
            cert_pem: cert.pem(),
        })
    }

    fn load(crt_path: &Path, key_path: &Path) -> Result<Self, CertError> {
        let key_pem = read(key_path)?;
        let key = KeyPair::from_pem(&key_pem).map_err(|e| CertError::Ca {
            path: key_path.to_path_buf(),
            problem: format!("not a usable PEM private key: {e}"),
        })?;
        let cert_pem = read(crt_path)?;
        let existing =
            CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|e| CertError::Ca {
                path: crt_path.to_path_buf(),
                problem: format!("not a PEM certificate: {e}"),
            })?;
        // New certificates name their issuer by the fixed subject of ca_params; that only
        // chains to the existing CA if the CA has that subject and ca.key's public key.
        let params = ca_params();
        let probe = params
            .self_signed(&key)
            .map_err(|source| CertError::Generate {
                what: "CA check certificate".into(),
                source,
            })?;
        if !same_subject_and_key(&existing, probe.der()) {
            let problem = format!(
                "not a CA made by `tunnel certs` with ca.key (subject must be CN={CA_NAME}); \
                 move ca.crt and ca.key away to make a new CA"
            );
            return Err(CertError::Ca {
                path: crt_path.to_path_buf(),
                problem,
            });
        }
        Ok(Self {
            params,
            key,
            cert_pem,
        })
    }

    /// The client certificate of edge node `node` (CN=`node`).
    fn issue_edge(&self, node: &str) -> Result<Issued, CertError> {
        self.issue(node, &[], &[], &[ExtendedKeyUsagePurpose::ClientAuth])
    }

    fn issue(
        &self,
        cn: &str,
        dns: &[String],
        ips: &[IpAddr],
        usages: &[ExtendedKeyUsagePurpose],
    ) -> Result<Issued, CertError> {
        let what = format!("certificate for {cn}");
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, cn);
        for name in dns {
            let name = name
                .clone()
                .try_into()
                .map_err(|source| CertError::Generate {
                    what: what.clone(),
                    source,
                })?;
            params.subject_alt_names.push(SanType::DnsName(name));
        }
        params
            .subject_alt_names
            .extend(ips.iter().map(|ip| SanType::IpAddress(*ip)));
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = usages.to_vec();
        params.use_authority_key_identifier_extension = true;
        set_validity(&mut params, LEAF_VALIDITY);
        let key = generate_key(&what)?;
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = params
            .signed_by(&key, &issuer)
            .map_err(|source| CertError::Generate { what, source })?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// The CA `tunnel certs` wrote into a directory, issuing edge client certificates in
/// memory: the bench's simulated edges each present their own, as deployed edges do.
pub struct EdgeCa(Ca);

impl EdgeCa {
    /// `ca.crt` and `ca.key` of `dir`.
    pub fn load(dir: &Path) -> Result<Self, CertError> {
        Ca::load(&dir.join("ca.crt"), &dir.join("ca.key")).map(Self)
    }

    /// The client certificate of edge node `node` and its new key.
    pub fn issue(
        &self,
        node: &str,
    ) -> Result<(CertificateDer<'static>, PrivateKeyDer<'static>), CertError> {
        let issued = self.0.issue_edge(node)?;
        let invalid = |e: rustls_pki_types::pem::Error| CertError::Generate {
            what: format!("certificate for {node}"),
            source: rcgen::Error::PemError(e.to_string()),
        };
        Ok((
            CertificateDer::from_pem_slice(issued.cert_pem.as_bytes()).map_err(invalid)?,
            PrivateKeyDer::from_pem_slice(issued.key_pem.as_bytes()).map_err(invalid)?,
        ))
    }
}

/// A new CA as `tunnel certs` makes one: its certificate and its key, PEM. The cloud
/// makes one on its first start when its Secret is empty (`cloud::lifecycle::ca`).
pub(crate) fn new_ca_pem() -> Result<(String, String), CertError> {
    let ca = Ca::create()?;
    Ok((ca.cert_pem, ca.key.serialize_pem()))
}

fn ca_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, CA_NAME);
    // Path length 0: this CA signs leaf certificates only.
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    set_validity(&mut params, CA_VALIDITY);
    params
}

fn set_validity(params: &mut CertificateParams, validity: Duration) {
    let now = SystemTime::now();
    params.not_before = (now - BACKDATE).into();
    params.not_after = (now + validity).into();
}

fn generate_key(what: &str) -> Result<KeyPair, CertError> {
    KeyPair::generate().map_err(|source| CertError::Generate {
        what: what.to_string(),
        source,
    })
}

fn same_subject_and_key(a: &[u8], b: &[u8]) -> bool {
    match (
        x509_parser::parse_x509_certificate(a),
        x509_parser::parse_x509_certificate(b),
    ) {
        (Ok((_, a)), Ok((_, b))) => {
            a.subject().as_raw() == b.subject().as_raw() && a.public_key().raw == b.public_key().raw
        }
        _ => false,
    }
}

struct Issued {
    cert_pem: String,
    key_pem: String,
}

impl Issued {
    fn write(&self, dir: &Path, stem: &str, what: &str) -> Result<[Written; 2], CertError> {
        let (crt, key) = (
            dir.join(format!("{stem}.crt")),
            dir.join(format!("{stem}.key")),
        );
        write_file(&crt, self.cert_pem.as_bytes(), false)?;
        write_file(&key, self.key_pem.as_bytes(), true)?;
        Ok([
            Written {
                path: crt,
                what: what.to_string(),
            },
            Written {
                path: key,
                what: format!("key of the {what}"),
            },
        ])
    }
}

/// Replaces the tokens of `edges`, keeping every other line.
fn write_tokens(path: &Path, edges: &[String]) -> Result<(), CertError> {
    let existing = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(io(path)(e)),
    };
    let mut text = String::new();
    for line in existing.lines() {
        let node = line.split_once(':').map(|(node, _)| node.trim());
        let replaced = !line.trim_start().starts_with('#')
            && node.is_some_and(|n| edges.iter().any(|e| e == n));
        if !replaced {
            text.push_str(line);
            text.push('\n');
        }
    }
    for edge in edges {
        let token: String = rand::random::<[u8; 16]>()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        text.push_str(&format!("{edge}:{token}\n"));
    }
    // Refuse to write a file the cloud would reject (a broken line kept from before).
    TokenFile::parse(path, &text)?;
    write_file(path, text.as_bytes(), true)
}

fn read(path: &Path) -> Result<String, CertError> {
    fs::read_to_string(path).map_err(io(path))
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CertError + '_ {
    move |source| CertError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes through a temporary file and a rename, so a reader never sees half a key,
/// and a secret is never readable by others, not even for a moment.
pub(crate) fn write_file(path: &Path, contents: &[u8], secret: bool) -> Result<(), CertError> {
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(".tmp");
    let tmp = PathBuf::from(tmp_name);
    match fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(&tmp)(e)),
        _ => {}
    }
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(&tmp)
        .map_err(io(&tmp))?;
    file.write_all(contents)
        .and_then(|()| file.sync_all())
        .map_err(io(&tmp))?;
    fs::rename(&tmp, path).map_err(io(path))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;
    use std::process::Command;
    use std::sync::Arc;

    use rustls::pki_types::{PrivateKeyDer, ServerName};
    use rustls::server::WebPkiClientVerifier;
    use rustls::{ClientConfig, RootCertStore, ServerConfig};

    use super::*;
    use crate::io::x509::node_name_from_cert;

    /// A directory of this test's own, removed at the end.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(test: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("tunnel-certs-{test}-{}", std::process::id()));
            // Left over from an earlier run that crashed: start clean.
            let _ = fs::remove_dir_all(&dir);
            Self(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn certs(path: &Path) -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_file_iter(path)
            .expect("open")
            .collect::<Result<_, _>>()
            .expect("PEM certificates")
    }

    fn key(path: &Path) -> PrivateKeyDer<'static> {
        PrivateKeyDer::from_pem_file(path).expect("PEM key")
    }

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    fn roots(dir: &Path) -> Arc<RootCertStore> {
        let mut roots = RootCertStore::empty();
        for ca in certs(&dir.join("ca.crt")) {
            roots.add(ca).expect("CA certificate");
        }
        Arc::new(roots)
    }

    /// A server with `stem`.crt/.key that requires a client certificate from the CA.
    fn server(dir: &Path, stem: &str) -> Arc<ServerConfig> {
        let verifier = WebPkiClientVerifier::builder_with_provider(roots(dir), provider())
            .build()
            .expect("verifier");
        let config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_client_cert_verifier(verifier)
            .with_single_cert(
                certs(&dir.join(format!("{stem}.crt"))),
                key(&dir.join(format!("{stem}.key"))),
            )
            .expect("server certificate and key");
        Arc::new(config)
    }

    /// A client trusting the CA and presenting edge-`node`.crt.
    fn client(dir: &Path, node: &str) -> Arc<ClientConfig> {
        let config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots(dir))
            .with_client_auth_cert(
                certs(&dir.join(format!("edge-{node}.crt"))),
                key(&dir.join(format!("edge-{node}.key"))),
            )
            .expect("client certificate and key");
        Arc::new(config)
    }

    /// A TLS handshake over an in-memory pipe; the node name the server sees in the
    /// client's certificate.
    async fn handshake(
        server: Arc<ServerConfig>,
        client: Arc<ClientConfig>,
        name: &str,
    ) -> std::io::Result<Option<String>> {
        let name = ServerName::try_from(name.to_string()).expect("server name");
        let (client_io, server_io) = tokio::io::duplex(64 << 10);
        let accept = tokio_rustls::TlsAcceptor::from(server).accept(server_io);
        let connect = tokio_rustls::TlsConnector::from(client).connect(name, client_io);
        let (accepted, connected) = tokio::join!(accept, connect);
        let (mut accepted, mut connected) = (accepted?, connected?);
        // TLS 1.3 clients finish before the server has checked their certificate: a
        // round trip makes the server's verdict visible to both sides.
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        connected.write_all(b"ping").await?;
        let mut buf = [0; 4];
        accepted.read_exact(&mut buf).await?;
        assert_eq!(&buf, b"ping");
        let peer = accepted
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(|c| node_name_from_cert(c));
        Ok(peer)
    }

    fn openssl_verify(dir: &Path, cert: &str) -> Option<bool> {
        let out = Command::new("openssl")
            .arg("verify")
            .arg("-CAfile")
            .arg(dir.join("ca.crt"))
            .arg(dir.join(cert))
            .output();
        match out {
            Ok(out) => {
                if !out.status.success() {
                    eprintln!(
                        "openssl: {}{}",
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
                Some(out.status.success())
            }
            Err(e) => {
                eprintln!("SKIPPED openssl verify of {cert}: cannot run openssl: {e}");
                None
            }
        }
    }

    fn full_args(dir: &Path) -> CertsArgs {
        CertsArgs {
            edges: vec!["edge-1".into()],
            servers: vec!["kubelet=127.1.0.5".parse().expect("spec")],
            tokens: true,
            ..CertsArgs::new(dir)
        }
    }

    #[tokio::test]
    async fn generated_chain_handshakes_with_rustls() {
        let tmp = TempDir::new("rustls");
        generate(&full_args(&tmp.0)).expect("generate");

        let node = handshake(
            server(&tmp.0, "cloud"),
            client(&tmp.0, "edge-1"),
            DEFAULT_CLOUD_NAME,
        )
        .await
        .expect("handshake");
        assert_eq!(
            node.as_deref(),
            Some("edge-1"),
            "the edge certificate names its node"
        );
        handshake(
            server(&tmp.0, "cloud"),
            client(&tmp.0, "edge-1"),
            "127.0.0.1",
        )
        .await
        .expect("cloud IP SAN");
        handshake(
            server(&tmp.0, "cloud"),
            client(&tmp.0, "edge-1"),
            "other-name",
        )
        .await
        .expect_err("name not in the certificate");

        handshake(
            server(&tmp.0, "server-kubelet"),
            client(&tmp.0, "edge-1"),
            "127.1.0.5",
        )
        .await
        .expect("server IP SAN");
        handshake(
            server(&tmp.0, "server-kubelet"),
            client(&tmp.0, "edge-1"),
            "127.1.0.6",
        )
        .await
        .expect_err("IP not in the certificate");
    }

    #[tokio::test]
    async fn certificates_from_another_ca_are_refused() {
        let (a, b) = (TempDir::new("ca-a"), TempDir::new("ca-b"));
        generate(&full_args(&a.0)).expect("generate a");
        generate(&full_args(&b.0)).expect("generate b");
        // A client of CA b against a server requiring CA a, and the other way round.
        handshake(
            server(&a.0, "cloud"),
            client(&b.0, "edge-1"),
            DEFAULT_CLOUD_NAME,
        )
        .await
        .expect_err("foreign client");
        let mixed = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots(&b.0))
            .with_client_auth_cert(
                certs(&a.0.join("edge-edge-1.crt")),
                key(&a.0.join("edge-edge-1.key")),
            )
            .expect("client");
        handshake(server(&a.0, "cloud"), Arc::new(mixed), DEFAULT_CLOUD_NAME)
            .await
            .expect_err("foreign server");
    }

    #[test]
    fn openssl_verifies_the_chain() {
        let tmp = TempDir::new("openssl");
        generate(&full_args(&tmp.0)).expect("generate");
        for cert in ["cloud.crt", "edge-edge-1.crt", "server-kubelet.crt"] {
            if let Some(ok) = openssl_verify(&tmp.0, cert) {
                assert!(ok, "openssl verify {cert}");
            }
        }
    }

    #[test]
    fn a_relay_certificate_names_its_node_as_a_relay_only() {
        let tmp = TempDir::new("relay");
        let mut args = CertsArgs::new(&tmp.0);
        args.relays = vec!["worker-1".into()];
        generate(&args).expect("generate");
        let pem = fs::read(tmp.0.join("relay-worker-1.crt")).expect("relay cert");
        let der = CertificateDer::from_pem_slice(&pem).expect("PEM");
        let relay = crate::io::x509::relay_node_from_cert(&der);
        assert_eq!(relay.as_deref(), Some("worker-1"));
        assert_eq!(crate::io::x509::node_name_from_cert(&der), None, "no edge");
        if let Some(ok) = openssl_verify(&tmp.0, "relay-worker-1.crt") {
            assert!(ok, "openssl verify");
        }
        args.relays = vec!["Worker_1".into()];
        let e = generate(&args).expect_err("not a node name");
        assert!(e.to_string().starts_with("--relay `Worker_1`: "), "{e}");
    }

    #[test]
    fn files_keys_private_and_summary() {
        let tmp = TempDir::new("files");
        let written = generate(&full_args(&tmp.0)).expect("generate");
        let names: Vec<String> = written
            .iter()
            .map(|w| {
                w.path
                    .file_name()
                    .expect("name")
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        assert_eq!(
            names,
            [
                "ca.crt",
                "ca.key",
                "cloud.crt",
                "cloud.key",
                "edge-edge-1.crt",
                "edge-edge-1.key",
                "server-kubelet.crt",
                "server-kubelet.key",
                "tokens"
            ]
        );
        for w in &written {
            let mode = fs::metadata(&w.path).expect("written").permissions().mode() & 0o777;
            let secret =
                w.path.extension().is_some_and(|e| e == "key") || w.path.ends_with("tokens");
            if secret {
                assert_eq!(mode, 0o600, "{w}");
            } else {
                assert_eq!(
                    mode & 0o077,
                    mode & 0o044,
                    "certificates are not writable by others: {w}"
                );
            }
            assert!(!w.to_string().contains('\n'), "one line per file");
        }
        assert!(
            written[2].what.contains("tunnel-cloud, 127.0.0.1"),
            "{}",
            written[2]
        );

        let text = fs::read_to_string(tmp.0.join("tokens")).expect("tokens");
        let (node, token) = text.trim().split_once(':').expect("node:token");
        assert_eq!(node, "edge-1");
        assert_eq!(token.len(), 32);
        assert!(token.bytes().all(|b| b.is_ascii_hexdigit()));
        let file = TokenFile::parse(&tmp.0.join("tokens"), &text).expect("tokens parse");
        assert!(file.verify("edge-1", token));
        assert!(!file.verify("edge-2", token));
    }

    #[tokio::test]
    async fn second_run_reuses_ca_and_keeps_tokens() {
        let tmp = TempDir::new("reuse");
        generate(&full_args(&tmp.0)).expect("first run");
        let ca_before = fs::read(tmp.0.join("ca.crt")).expect("ca");
        let tokens_before = fs::read_to_string(tmp.0.join("tokens")).expect("tokens");

        let args = CertsArgs {
            edges: vec!["edge-2".into()],
            tokens: true,
            ..CertsArgs::new(&tmp.0)
        };
        let written = generate(&args).expect("second run");
        assert!(written[0].what.contains("reused"), "{}", written[0]);
        assert_eq!(
            fs::read(tmp.0.join("ca.crt")).expect("ca"),
            ca_before,
            "CA unchanged"
        );

        let tokens_after = fs::read_to_string(tmp.0.join("tokens")).expect("tokens");
        assert!(
            tokens_after.starts_with(&tokens_before),
            "edge-1's token is kept: {tokens_after}"
        );
        assert!(tokens_after.lines().any(|l| l.starts_with("edge-2:")));

        // The cloud certificate of the second run accepts the edge certificate of the first.
        let node = handshake(
            server(&tmp.0, "cloud"),
            client(&tmp.0, "edge-1"),
            DEFAULT_CLOUD_NAME,
        )
        .await
        .expect("handshake");
        assert_eq!(node.as_deref(), Some("edge-1"));
        if let Some(ok) = openssl_verify(&tmp.0, "edge-edge-2.crt") {
            assert!(ok);
        }

        // Renewing edge-1 replaces its token line instead of adding a second one.
        let args = CertsArgs {
            edges: vec!["edge-1".into()],
            tokens: true,
            ..CertsArgs::new(&tmp.0)
        };
        generate(&args).expect("third run");
        let tokens = fs::read_to_string(tmp.0.join("tokens")).expect("tokens");
        assert_eq!(
            tokens.lines().filter(|l| l.starts_with("edge-1:")).count(),
            1,
            "{tokens}"
        );
        assert_eq!(
            tokens.lines().filter(|l| l.starts_with("edge-2:")).count(),
            1,
            "{tokens}"
        );
    }

    #[test]
    fn mismatched_or_half_ca_is_refused() {
        let (a, b) = (TempDir::new("mismatch-a"), TempDir::new("mismatch-b"));
        generate(&CertsArgs::new(&a.0)).expect("a");
        generate(&CertsArgs::new(&b.0)).expect("b");
        fs::copy(b.0.join("ca.key"), a.0.join("ca.key")).expect("copy");
        let e = generate(&CertsArgs::new(&a.0)).expect_err("key of another CA");
        assert!(matches!(e, CertError::Ca { .. }), "{e}");
        assert!(
            e.to_string()
                .contains("ca.crt: not a CA made by `tunnel certs` with ca.key"),
            "{e}"
        );

        fs::remove_file(b.0.join("ca.key")).expect("remove");
        let e = generate(&CertsArgs::new(&b.0)).expect_err("half a CA");
        assert!(
            e.to_string().contains("ca.key: missing beside ca.crt"),
            "{e}"
        );
    }

    #[test]
    fn bad_arguments_are_refused_before_writing() {
        let tmp = TempDir::new("args");
        let e = generate(&CertsArgs {
            edges: vec!["Edge_1".into()],
            ..CertsArgs::new(&tmp.0)
        })
        .expect_err("bad node");
        assert!(e.to_string().starts_with("--edge `Edge_1`: "), "{e}");
        let e = generate(&CertsArgs {
            edges: vec!["a".into(), "a".into()],
            ..CertsArgs::new(&tmp.0)
        })
        .expect_err("twice");
        assert!(e.to_string().contains("given twice"), "{e}");
        let e = generate(&CertsArgs {
            cloud_names: vec!["bad name".into()],
            ..CertsArgs::new(&tmp.0)
        })
        .expect_err("dns");
        assert!(e.to_string().starts_with("--cloud-name `bad name`"), "{e}");
        assert!(!tmp.0.exists(), "nothing written");
    }

    #[test]
    fn server_spec_parses() {
        let s: ServerSpec = "kubelet=127.1.0.5,127.1.0.6".parse().expect("spec");
        assert_eq!(
            s,
            ServerSpec {
                name: "kubelet".into(),
                ips: vec![[127, 1, 0, 5].into(), [127, 1, 0, 6].into()]
            }
        );
        assert!(
            "kubelet"
                .parse::<ServerSpec>()
                .expect_err("no =")
                .contains("NAME=IP")
        );
        assert!(
            "kubelet=host"
                .parse::<ServerSpec>()
                .expect_err("not ip")
                .contains("`host` is not an IP address")
        );
        assert!("Kube=127.0.0.1".parse::<ServerSpec>().is_err());
    }

    #[test]
    fn command_line_defaults_match_new() {
        use clap::{Args as _, FromArgMatches as _};
        let cmd = CertsArgs::augment_args(clap::Command::new("certs"));
        let matches = cmd
            .try_get_matches_from(["certs", "--out", "d"])
            .expect("parse");
        let parsed = CertsArgs::from_arg_matches(&matches).expect("args");
        let new = CertsArgs::new("d");
        assert_eq!(
            (parsed.cloud_names, parsed.cloud_ips),
            (new.cloud_names, new.cloud_ips)
        );

        let cmd = CertsArgs::augment_args(clap::Command::new("certs"));
        assert!(
            cmd.try_get_matches_from(["certs", "--out", "d", "--tokens"])
                .is_err(),
            "--tokens needs --edge"
        );
    }
}
