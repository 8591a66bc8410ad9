//! The admin HTTP listener of each process: health, readiness, the log level, metrics
//! and debug listings. Health and metrics answer any client, so the listener may be
//! bound on the node's address for a Prometheus elsewhere in the cluster to scrape;
//! `/debug/` (the log level, the edges and connections listed) answers clients on this
//! host only.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

use crate::io::accept;

/// JSON for a `/debug/...` path, or None when there is no such listing.
pub(crate) type DebugFn = Arc<dyn Fn(&str) -> Option<serde_json::Value> + Send + Sync>;

/// What a process exposes on its admin listener.
#[derive(Clone)]
pub(crate) struct Handlers {
    /// `/readyz`: Ok with its detail when ready (200), Err with why not (503).
    pub(crate) ready: Arc<dyn Fn() -> Result<String, String> + Send + Sync>,
    pub(crate) metrics: Arc<Registry>,
    pub(crate) debug: DebugFn,
}

/// Largest request body accepted (a log filter).
const MAX_BODY: usize = 4096;

pub(crate) async fn serve(mut incoming: accept::Incoming<TcpListener>, handlers: Handlers) {
    let hostname: Option<Arc<str>> = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .map(Into::into);
    let warned = Arc::new(std::sync::Mutex::new(None));
    while let Some((tcp, client, permit)) = incoming.next().await {
        let handlers = handlers.clone();
        let names = OwnNames {
            client_is_local: client.ip().to_canonical().is_loopback(),
            local: tcp.local_addr().ok().map(|a| a.ip().to_canonical()),
            hostname: hostname.clone(),
            warned: warned.clone(),
        };
        let service = hyper::service::service_fn(move |req| {
            let handlers = handlers.clone();
            let names = names.clone();
            async move { Ok::<_, Infallible>(handle(req, &handlers, &names).await) }
        });
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(std::time::Duration::from_secs(10))
            .serve_connection(TokioIo::new(tcp), service);
        tokio::spawn(accept::hold(permit, conn));
    }
}

/// The names a request may give in its Host header: the address the client connected
/// to, `localhost`, or this host's name (the pod's name in a pod; the node's with the
/// host network). A web page a browser on this host loads from another name can reach
/// loopback by DNS rebinding (the name resolving to 127.0.0.1 after the page loaded),
/// and is then same-origin with the listener: it could read `/debug/edges` and PUT the
/// log level. Its requests carry that name as Host.
#[derive(Clone)]
struct OwnNames {
    /// Whether the client connected from loopback: only such a client reaches `/debug/`.
    client_is_local: bool,
    local: Option<std::net::IpAddr>,
    hostname: Option<Arc<str>>,
    /// When a refusal was last logged at WARN: a page can send them in a loop.
    warned: Arc<std::sync::Mutex<Option<std::time::Instant>>>,
}

/// The least time between two warnings of refused requests; those between are logged
/// at debug.
const REFUSED_WARN_GAP: std::time::Duration = std::time::Duration::from_secs(60);

impl OwnNames {
    /// Whether `host` (a Host header's value) names this listener. A request without
    /// Host (HTTP/1.0, a script) comes from no browser, which always sends one.
    fn allow(&self, host: Option<&http::HeaderValue>) -> bool {
        let Some(host) = host else {
            return true;
        };
        let Ok(host) = host.to_str() else {
            return false;
        };
        let Ok(authority) = host.parse::<http::uri::Authority>() else {
            return false;
        };
        let name = authority.host();
        let literal = name.trim_start_matches('[').trim_end_matches(']');
        match literal.parse::<std::net::IpAddr>() {
            Ok(ip) => Some(ip.to_canonical()) == self.local,
            Err(_) => {
                name.eq_ignore_ascii_case("localhost")
                    || self
                        .hostname
                        .as_deref()
                        .is_some_and(|h| name.eq_ignore_ascii_case(h))
            }
        }
    }

    /// The answer to a request whose Host is `host`, which [`OwnNames::allow`] refused.
    fn refuse(&self, host: &str, path: &str) -> Response<Full<Bytes>> {
        let now = std::time::Instant::now();
        let warn = {
            let mut last = self.warned.lock().unwrap_or_else(|e| e.into_inner());
            let warn = last.is_none_or(|t| now.duration_since(t) >= REFUSED_WARN_GAP);
            if warn {
                *last = Some(now);
            }
            warn
        };
        let what = "admin request for another host refused (a web page by DNS rebinding, or a client that names the listener otherwise)";
        match warn {
            true => tracing::warn!(host, path, "{what}"),
            false => tracing::debug!(host, path, "{what}"),
        }
        let own = self.hostname.as_deref().unwrap_or("localhost");
        text(
            StatusCode::MISDIRECTED_REQUEST,
            format!("Host {host:?} is not this listener: use its address, localhost or {own}"),
        )
    }
}

fn text(status: StatusCode, body: impl Into<String>) -> Response<Full<Bytes>> {
    let mut body: String = body.into();
    body.push('\n');
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp
}

async fn handle(req: Request<Incoming>, h: &Handlers, names: &OwnNames) -> Response<Full<Bytes>> {
    let host = req.headers().get(http::header::HOST);
    if !names.allow(host) {
        let host = String::from_utf8_lossy(host.map_or(&[][..], |h| h.as_bytes()));
        return names.refuse(&host, req.uri().path());
    }
    if req.uri().path().starts_with("/debug/") && !names.client_is_local {
        tracing::debug!(
            path = req.uri().path(),
            "admin /debug/ request from beyond this host refused"
        );
        return text(
            StatusCode::FORBIDDEN,
            "/debug/ answers clients on this host only (connect from loopback)",
        );
    }
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") => text(StatusCode::OK, "ok"),
        (&Method::GET, "/readyz") => match (h.ready)() {
            Ok(detail) => text(StatusCode::OK, detail),
            Err(why) => text(StatusCode::SERVICE_UNAVAILABLE, why),
        },
        (&Method::GET, "/debug/flags/v") => {
            text(StatusCode::OK, crate::ops::logging::current_filter())
        }
        // Not POST: a web page may send a POST to any address cross-origin (a form or a
        // "simple" fetch, no preflight), and a browser on this host reaches loopback. A
        // PUT needs a preflight the listener never answers. SuperEdge users script PUT.
        (&Method::POST, "/debug/flags/v") => {
            let mut resp = text(
                StatusCode::METHOD_NOT_ALLOWED,
                "set the log filter with PUT, read it with GET",
            );
            resp.headers_mut().insert(
                http::header::ALLOW,
                http::HeaderValue::from_static("GET, PUT"),
            );
            resp
        }
        (&Method::PUT, "/debug/flags/v") => {
            let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => return text(StatusCode::PAYLOAD_TOO_LARGE, e.to_string()),
            };
            let spec = String::from_utf8_lossy(&body);
            match crate::ops::logging::set_filter(&spec) {
                Ok(filter) => text(StatusCode::OK, filter),
                Err(e) => text(StatusCode::BAD_REQUEST, e),
            }
        }
        (&Method::GET, "/metrics") => {
            let mut resp = Response::new(Full::new(Bytes::from(crate::ops::metrics::encode(
                &h.metrics,
            ))));
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            resp
        }
        (&Method::GET, path) if path.starts_with("/debug/") => match (h.debug)(path) {
            Some(value) => {
                let mut resp = Response::new(Full::new(Bytes::from(format!("{value:#}\n"))));
                resp.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("application/json"),
                );
                resp
            }
            None => text(StatusCode::NOT_FOUND, "not found"),
        },
        _ => text(StatusCode::NOT_FOUND, "not found"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_listeners_own_names_are_hosts() {
        let names = OwnNames {
            client_is_local: true,
            local: Some("127.0.0.1".parse().unwrap()),
            hostname: Some("tunnel-cloud-x7k2p".into()),
            warned: Arc::default(),
        };
        let allow = |host: &str| names.allow(Some(&http::HeaderValue::from_str(host).unwrap()));
        for own in [
            "127.0.0.1:9100",
            "127.0.0.1",
            "localhost:9100",
            "LocalHost",
            "tunnel-cloud-x7k2p:9100",
        ] {
            assert!(allow(own), "{own}");
        }
        for other in [
            "attacker.example:9100",
            "127.0.0.2:9100",
            "localhost.attacker.example",
            "[::1]:9100",
            "tunnel-cloud-x7k2p.attacker.example",
            "",
            "a b",
        ] {
            assert!(!allow(other), "{other}");
        }
        assert!(names.allow(None), "no Host: no browser");
        let v6 = OwnNames {
            local: Some("::1".parse().unwrap()),
            ..names.clone()
        };
        assert!(v6.allow(Some(&http::HeaderValue::from_static("[::1]:9100"))));
    }
}
