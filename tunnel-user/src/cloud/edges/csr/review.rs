//! What a CertificateSigningRequest must be for the cloud to sign it, as pure functions
//! of the request: whose certificate it asks for (an edge's, CN = the node; or a
//! relay's, CN = `system:tunnel-relay:<node>`), the usages, the key, and who filed it.
//! Each refusal is a [`Denial`] whose message becomes the CSR's Denied condition.

use k8s_openapi::api::certificates::v1::CertificateSigningRequestSpec;
use rcgen::{CertificateSigningRequestParams, ExtendedKeyUsagePurpose};
use rustls_pki_types::CertificateSigningRequestDer;
use rustls_pki_types::pem::PemObject as _;
use x509_parser::public_key::PublicKey;

use crate::addr::NodeName;
use crate::addr::check_node_name;
use crate::io::x509::RELAY_CN_PREFIX;

/// Usages a client certificate may carry; `client auth` is required.
const CLIENT_AUTH: &str = "client auth";
const ALLOWED_USAGES: [&str; 3] = [CLIENT_AUTH, "digital signature", "key encipherment"];
/// The smallest RSA modulus accepted.
const MIN_RSA_BITS: usize = 2048;
/// Curves rustls can use for a client certificate (P-256, P-384).
const EC_CURVES: [&str; 2] = ["1.2.840.10045.3.1.7", "1.3.132.0.34"];
const ED25519: &str = "1.3.101.112";
/// Extra keys the API server records for a token bound to a pod (1.28 has no node name
/// among them, so the pod's node is looked up).
const POD_NAME_EXTRA: &str = "authentication.kubernetes.io/pod-name";
const POD_UID_EXTRA: &str = "authentication.kubernetes.io/pod-uid";

/// Why a CSR is denied; the text is the condition's message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Denial {
    #[error("the request does not parse or its signature is wrong: {0}")]
    Malformed(String),
    #[error(
        "the subject must be CN=<node name> (an edge) or CN=system:tunnel-relay:<node name> (a relay) and nothing else: {0}"
    )]
    Subject(String),
    #[error("asks for usages a client certificate of an edge has no use for: {0}")]
    ExtraUsages(String),
    #[error("weak or unsupported key: {0}")]
    WeakKey(String),
    #[error("requester may not speak for {subject}: {why}")]
    OtherNode { subject: Subject, why: String },
    #[error("requester `{0}` filed too many CSRs; wait and file again")]
    Flood(String),
}

impl Denial {
    /// The condition's reason (CamelCase, as Kubernetes' own).
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Denial::Malformed(_) => "MalformedRequest",
            Denial::Subject(_) => "BadSubject",
            Denial::ExtraUsages(_) => "ExtraUsages",
            Denial::WeakKey(_) => "WeakKey",
            Denial::OtherNode { .. } => "NotThisNode",
            Denial::Flood(_) => "TooManyRequests",
        }
    }
}

/// Whose certificate a request asks for, by its CN.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Subject {
    /// An edge's: CN = the node name.
    Edge(NodeName),
    /// A relay's: CN = `system:tunnel-relay:<node>`.
    Relay(NodeName),
}

impl Subject {
    /// The node the certificate is for.
    pub(crate) fn node(&self) -> &NodeName {
        match self {
            Subject::Edge(n) | Subject::Relay(n) => n,
        }
    }

    /// The CN the signed certificate carries.
    pub(crate) fn common_name(&self) -> String {
        match self {
            Subject::Edge(n) => n.to_string(),
            Subject::Relay(n) => format!("{RELAY_CN_PREFIX}{n}"),
        }
    }
}

impl std::fmt::Display for Subject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Subject::Edge(n) => write!(f, "node `{n}`"),
            Subject::Relay(n) => write!(f, "the relay on node `{n}`"),
        }
    }
}

/// A request whose contents are what an edge or a relay asks for: whose certificate,
/// and the parsed request to sign.
pub(crate) struct Checked {
    pub(crate) subject: Subject,
    pub(crate) request: CertificateSigningRequestParams,
}

/// Checks the request itself (not yet its requester): PEM, signature, subject, usages
/// (spec and extensions), key.
pub(crate) fn check_request(spec: &CertificateSigningRequestSpec) -> Result<Checked, Denial> {
    let der = CertificateSigningRequestDer::from_pem_slice(&spec.request.0)
        .map_err(|e| Denial::Malformed(format!("not a PEM CERTIFICATE REQUEST: {e}")))?;
    check_usages(spec.usages.as_deref().unwrap_or_default())?;
    let subject = check_subject_and_key(der.as_ref())?;
    let request = CertificateSigningRequestParams::from_der(&der)
        .map_err(|e| Denial::Malformed(e.to_string()))?;
    let params = &request.params;
    if !params.subject_alt_names.is_empty() {
        return Err(Denial::Subject(
            "subject alternative names requested; a client certificate names only its CN".into(),
        ));
    }
    if !matches!(params.is_ca, rcgen::IsCa::NoCa | rcgen::IsCa::ExplicitNoCa) {
        return Err(Denial::ExtraUsages("a CA certificate".into()));
    }
    let extra: Vec<String> = params
        .extended_key_usages
        .iter()
        .filter(|u| **u != ExtendedKeyUsagePurpose::ClientAuth)
        .map(|u| format!("{u:?} (in the request's extensions)"))
        .collect();
    if !extra.is_empty() {
        return Err(Denial::ExtraUsages(extra.join(", ")));
    }
    Ok(Checked { subject, request })
}

fn check_usages(usages: &[String]) -> Result<(), Denial> {
    let extra: Vec<&str> = usages
        .iter()
        .map(String::as_str)
        .filter(|u| !ALLOWED_USAGES.contains(u))
        .collect();
    if !extra.is_empty() {
        return Err(Denial::ExtraUsages(extra.join(", ")));
    }
    if !usages.iter().any(|u| u == CLIENT_AUTH) {
        return Err(Denial::ExtraUsages(format!(
            "`{CLIENT_AUTH}` is missing from {usages:?}"
        )));
    }
    Ok(())
}

/// Whose certificate the subject (its only attribute, CN) asks for, and the key's
/// strength.
fn check_subject_and_key(der: &[u8]) -> Result<Subject, Denial> {
    use x509_parser::prelude::FromDer as _;
    let (_, csr) = x509_parser::certification_request::X509CertificationRequest::from_der(der)
        .map_err(|e| Denial::Malformed(e.to_string()))?;
    let info = &csr.certification_request_info;
    let attributes = info.subject.iter_attributes().count();
    let cn = info
        .subject
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok());
    let (node, relay) = match (cn, attributes) {
        (Some(cn), 1) => match cn.strip_prefix(RELAY_CN_PREFIX) {
            Some(node) => (node, true),
            None => (cn, false),
        },
        _ => return Err(Denial::Subject(format!("got `{}`", info.subject))),
    };
    check_node_name(node).map_err(Denial::Subject)?;
    let spki = &info.subject_pki;
    let algorithm = spki.algorithm.algorithm.to_id_string();
    match spki.parsed() {
        Ok(PublicKey::RSA(rsa)) if rsa.key_size() >= MIN_RSA_BITS => {}
        Ok(PublicKey::RSA(rsa)) => {
            return Err(Denial::WeakKey(format!(
                "RSA {} bits (at least {MIN_RSA_BITS})",
                rsa.key_size()
            )));
        }
        Ok(PublicKey::EC(_)) => {
            let curve = spki
                .algorithm
                .parameters
                .as_ref()
                .and_then(|p| p.as_oid().ok())
                .map(|oid| oid.to_id_string())
                .unwrap_or_default();
            if !EC_CURVES.contains(&curve.as_str()) {
                return Err(Denial::WeakKey(format!(
                    "EC curve {curve} (P-256 or P-384)"
                )));
            }
        }
        _ if algorithm == ED25519 => {}
        _ => return Err(Denial::WeakKey(format!("key algorithm {algorithm}"))),
    }
    let node = NodeName::new(node.to_string()).map_err(Denial::Subject)?;
    Ok(match relay {
        true => Subject::Relay(node),
        false => Subject::Edge(node),
    })
}

/// Which of the tunnel's service accounts a pod runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Account {
    /// `kubernetes.edge_service_account`: its pods may ask for their node's edge name.
    Edges,
    /// `kubernetes.relay_service_account`: its pods may ask for their node's relay name.
    Relays,
}

/// The two service accounts, `namespace:name` each.
pub(crate) struct Accounts<'a> {
    pub(crate) edges: &'a str,
    pub(crate) relays: &'a str,
}

/// Who filed a CSR, as far as speaking for a node goes.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Requester {
    /// A node's own credentials (`system:node:<name>` in group `system:nodes`).
    Node(String),
    /// A pod of the edges' or the relays' service account, by the token bound to it.
    Pod {
        account: Account,
        namespace: String,
        name: String,
        uid: String,
    },
    /// Anyone else.
    Other(String),
}

impl std::fmt::Display for Requester {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Requester::Node(n) => write!(f, "node {n}"),
            Requester::Pod {
                namespace, name, ..
            } => write!(f, "pod {namespace}/{name}"),
            Requester::Other(u) => write!(f, "user {u}"),
        }
    }
}

impl Requester {
    /// Sorts out the requester the API server recorded in `spec` (it sets username,
    /// groups and extra itself; a client cannot).
    pub(crate) fn of(spec: &CertificateSigningRequestSpec, accounts: &Accounts<'_>) -> Self {
        let username = spec.username.clone().unwrap_or_default();
        let in_group = |g: &str| spec.groups.iter().flatten().any(|x| x == g);
        if let Some(node) = username.strip_prefix("system:node:")
            && in_group("system:nodes")
        {
            return Requester::Node(node.to_string());
        }
        let one = |key: &str| match spec.extra.as_ref().and_then(|e| e.get(key)) {
            Some(values) if values.len() == 1 => Some(values[0].clone()),
            _ => None,
        };
        let of_account = |sa: &str| username == format!("system:serviceaccount:{sa}");
        let (account, sa) = match () {
            () if of_account(accounts.edges) => (Account::Edges, accounts.edges),
            () if of_account(accounts.relays) => (Account::Relays, accounts.relays),
            () => return Requester::Other(username),
        };
        let (Some(name), Some(uid)) = (one(POD_NAME_EXTRA), one(POD_UID_EXTRA)) else {
            return Requester::Other(username);
        };
        let namespace = sa
            .split_once(':')
            .map(|(ns, _)| ns.to_string())
            .unwrap_or_default();
        Requester::Pod {
            account,
            namespace,
            name,
            uid,
        }
    }

    /// The requester in a denial's message: a user by its name alone.
    fn named(&self) -> String {
        match self {
            Requester::Other(user) => format!("`{user}`"),
            named => named.to_string(),
        }
    }

    /// Who counts as one requester for the flood bound: a node, a pod, a user.
    pub(crate) fn key(&self) -> String {
        match self {
            Requester::Node(n) => format!("node/{n}"),
            Requester::Pod { namespace, uid, .. } => format!("pod/{namespace}/{uid}"),
            Requester::Other(u) => format!("user/{u}"),
        }
    }
}

/// The pod a requester's token is bound to, whose node decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PodRef<'a> {
    pub(crate) namespace: &'a str,
    pub(crate) name: &'a str,
    pub(crate) uid: &'a str,
}

/// Whether `requester` may ask for `subject` at all, by its name alone: Ok(None) for a
/// node asking for its own edge name, Ok(Some(pod)) when it depends on the node that
/// pod runs on, which must be the subject's; Err(why) otherwise. An edge's name: the
/// node itself or a pod of the edges' account. A relay's name: a pod of the relays'
/// account only, so no edge pod, and no node's credentials, can link as a relay.
pub(crate) fn may_ask<'a>(
    subject: &Subject,
    requester: &'a Requester,
    accounts: &Accounts<'_>,
) -> Result<Option<PodRef<'a>>, String> {
    let wanted = match subject {
        Subject::Edge(_) => Account::Edges,
        Subject::Relay(_) => Account::Relays,
    };
    match (subject, requester) {
        (Subject::Edge(node), Requester::Node(n)) if n == node.as_str() => Ok(None),
        (Subject::Edge(_), Requester::Node(n)) => Err(format!("it is node `{n}`")),
        (
            _,
            Requester::Pod {
                account,
                namespace,
                name,
                uid,
            },
        ) if *account == wanted => Ok(Some(PodRef {
            namespace,
            name,
            uid,
        })),
        (Subject::Edge(_), _) => Err(format!(
            "{} is neither that node nor a pod of the edges' service account `{}`",
            requester.named(),
            accounts.edges
        )),
        (Subject::Relay(_), _) => Err(format!(
            "{} is not a pod of the relays' service account `{}`",
            requester.named(),
            accounts.relays
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use k8s_openapi::ByteString;

    fn spec(pem: String, usages: &[&str]) -> CertificateSigningRequestSpec {
        CertificateSigningRequestSpec {
            request: ByteString(pem.into_bytes()),
            signer_name: "tunnel.io/edge-client".into(),
            usages: Some(usages.iter().map(|u| u.to_string()).collect()),
            ..Default::default()
        }
    }

    fn request(cn: &str, configure: impl FnOnce(&mut rcgen::CertificateParams)) -> String {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = crate::csr::request_params(cn);
        configure(&mut params);
        params
            .serialize_request(&key)
            .expect("csr")
            .pem()
            .expect("pem")
    }

    #[test]
    fn an_edge_request_passes_and_names_its_node() {
        let ok = check_request(&spec(
            request("edge-1", |_| {}),
            &["digital signature", "client auth"],
        ))
        .expect("an edge's request");
        assert_eq!(ok.subject, Subject::Edge(node("edge-1")));
        assert_eq!(ok.subject.common_name(), "edge-1");
    }

    fn node(name: &str) -> NodeName {
        NodeName::new(name.to_string()).expect("node name")
    }

    /// A relay's CN, `system:tunnel-relay:<node>`, asks for a relay's certificate; the
    /// node in it must be a node name, as an edge's must.
    #[test]
    fn a_relay_request_names_the_relay_of_its_node() {
        let usages = &["digital signature", "client auth"];
        let ok = check_request(&spec(
            request("system:tunnel-relay:worker-1", |_| {}),
            usages,
        ))
        .expect("a relay's request");
        assert_eq!(ok.subject, Subject::Relay(node("worker-1")));
        assert_eq!(ok.subject.common_name(), "system:tunnel-relay:worker-1");
        for bad in [
            "system:tunnel-relay:",
            "system:tunnel-relay:Worker_1",
            "system:tunnel-relay:system:tunnel-relay:w",
            "system:node:worker-1",
        ] {
            let e = check_request(&spec(request(bad, |_| {}), usages))
                .err()
                .expect(bad);
            assert_eq!(e.reason(), "BadSubject", "{bad}");
        }
    }

    #[test]
    fn extra_usages_subjects_and_names_are_denied_with_the_reason() {
        let e = check_request(&spec(
            request("edge-1", |_| {}),
            &["client auth", "server auth"],
        ))
        .err()
        .expect("server auth");
        assert_eq!(e.reason(), "ExtraUsages");
        assert!(e.to_string().contains("server auth"), "{e}");

        let e = check_request(&spec(request("edge-1", |_| {}), &["digital signature"]))
            .err()
            .expect("no client auth");
        assert!(e.to_string().contains("`client auth` is missing"), "{e}");

        let e = check_request(&spec(
            request("edge-1", |p| {
                p.distinguished_name
                    .push(rcgen::DnType::OrganizationName, "system:masters")
            }),
            &["client auth"],
        ))
        .err()
        .expect("an organization");
        assert_eq!(e.reason(), "BadSubject");

        let e = check_request(&spec(
            request("edge-1", |p| {
                p.subject_alt_names = vec![rcgen::SanType::DnsName(
                    "tunnel-cloud".try_into().expect("dns"),
                )]
            }),
            &["client auth"],
        ))
        .err()
        .expect("a SAN");
        assert!(e.to_string().contains("subject alternative names"), "{e}");

        let e = check_request(&spec(
            request("edge-1", |p| {
                p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth]
            }),
            &["client auth"],
        ))
        .err()
        .expect("server auth in the extensions");
        assert_eq!(e.reason(), "ExtraUsages");

        let e = check_request(&spec(request("Edge_1", |_| {}), &["client auth"]))
            .err()
            .expect("not a node name");
        assert_eq!(e.reason(), "BadSubject");

        let e = check_request(&spec("garbage".into(), &["client auth"]))
            .err()
            .expect("not PEM");
        assert_eq!(e.reason(), "MalformedRequest");
    }

    #[test]
    /// Who may ask for which name, before the pod's node is looked up: a relay's name
    /// only by a relay pod (never an edge pod, nor a node's own credentials), an edge's
    /// only by the node or an edge pod.
    fn who_may_ask_for_an_edge_or_a_relay_name() {
        let accounts = Accounts {
            edges: "tunnel-system:tunnel-edge",
            relays: "tunnel-system:tunnel-relay",
        };
        let pod = |account| Requester::Pod {
            account,
            namespace: "tunnel-system".into(),
            name: "p".into(),
            uid: "u".into(),
        };
        let (edge_pod, relay_pod) = (pod(Account::Edges), pod(Account::Relays));
        let node_1 = Requester::Node("worker-1".into());
        let admin = Requester::Other("admin".into());
        let edge = Subject::Edge(node("worker-1"));
        let relay = Subject::Relay(node("worker-1"));
        let looked_up = Some(PodRef {
            namespace: "tunnel-system",
            name: "p",
            uid: "u",
        });
        assert_eq!(may_ask(&edge, &node_1, &accounts), Ok(None));
        assert_eq!(may_ask(&edge, &edge_pod, &accounts), Ok(looked_up));
        assert_eq!(may_ask(&relay, &relay_pod, &accounts), Ok(looked_up));
        let refused =
            |subject, requester| may_ask(subject, requester, &accounts).expect_err("refused");
        let e = refused(&relay, &edge_pod);
        assert!(
            e.contains("not a pod of the relays' service account `tunnel-system:tunnel-relay`"),
            "{e}"
        );
        let e = refused(&relay, &node_1);
        assert!(
            e.contains("node worker-1 is not a pod of the relays'"),
            "{e}"
        );
        refused(&relay, &admin);
        let e = refused(&edge, &relay_pod);
        assert!(
            e.contains("neither that node nor a pod of the edges'"),
            "{e}"
        );
        let node_2 = Requester::Node("worker-2".into());
        let e = refused(&edge, &node_2);
        assert_eq!(e, "it is node `worker-2`");
        refused(&edge, &admin);
    }

    #[test]
    fn requesters_are_nodes_pods_of_the_edge_or_relay_account_or_others() {
        let with = |user: &str, groups: &[&str], extra: &[(&str, &str)]| {
            let mut s = spec(String::new(), &[]);
            s.username = Some(user.into());
            s.groups = Some(groups.iter().map(|g| g.to_string()).collect());
            s.extra = Some(
                extra
                    .iter()
                    .map(|(k, v)| (k.to_string(), vec![v.to_string()]))
                    .collect(),
            );
            let accounts = Accounts {
                edges: "tunnel-system:tunnel-edge",
                relays: "tunnel-system:tunnel-relay",
            };
            Requester::of(&s, &accounts)
        };
        assert_eq!(
            with("system:node:edge-1", &["system:nodes"], &[]),
            Requester::Node("edge-1".into())
        );
        assert_eq!(
            with("system:node:edge-1", &[], &[]),
            Requester::Other("system:node:edge-1".into()),
            "a node name without the nodes' group is just a name"
        );
        let pod = with(
            "system:serviceaccount:tunnel-system:tunnel-edge",
            &[],
            &[(POD_NAME_EXTRA, "tunnel-edge-x"), (POD_UID_EXTRA, "u-1")],
        );
        assert_eq!(
            pod,
            Requester::Pod {
                account: Account::Edges,
                namespace: "tunnel-system".into(),
                name: "tunnel-edge-x".into(),
                uid: "u-1".into()
            }
        );
        assert_eq!(pod.key(), "pod/tunnel-system/u-1");
        assert!(matches!(
            with(
                "system:serviceaccount:tunnel-system:tunnel-relay",
                &[],
                &[(POD_NAME_EXTRA, "tunnel-relay-x"), (POD_UID_EXTRA, "u-2")]
            ),
            Requester::Pod {
                account: Account::Relays,
                ..
            }
        ));
        assert!(matches!(
            with("system:serviceaccount:tunnel-system:tunnel-edge", &[], &[]),
            Requester::Other(_)
        ));
        assert!(matches!(
            with(
                "system:serviceaccount:default:builder",
                &[],
                &[(POD_NAME_EXTRA, "p"), (POD_UID_EXTRA, "u")]
            ),
            Requester::Other(_)
        ));
    }
}
