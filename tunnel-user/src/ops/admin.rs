//! The admin HTTP listener of each process: health, readiness, the log level, metrics
//! and debug listings.

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
    pub(crate) ready: Arc<dyn Fn() -> bool + Send + Sync>,
    pub(crate) metrics: Arc<Registry>,
    pub(crate) debug: DebugFn,
}

/// Largest request body accepted (a log filter).
const MAX_BODY: usize = 4096;

pub(crate) async fn serve(mut incoming: accept::Incoming<TcpListener>, handlers: Handlers) {
    while let Some((tcp, _, permit)) = incoming.next().await {
        let handlers = handlers.clone();
        let service = hyper::service::service_fn(move |req| {
            let handlers = handlers.clone();
            async move { Ok::<_, Infallible>(handle(req, &handlers).await) }
        });
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(std::time::Duration::from_secs(10))
            .serve_connection(TokioIo::new(tcp), service);
        tokio::spawn(accept::hold(permit, conn));
    }
}

fn text(status: StatusCode, body: impl Into<String>) -> Response<Full<Bytes>> {
    let mut body: String = body.into();
    body.push('\n');
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp
}

async fn handle(req: Request<Incoming>, h: &Handlers) -> Response<Full<Bytes>> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") => text(StatusCode::OK, "ok"),
        (&Method::GET, "/readyz") if (h.ready)() => text(StatusCode::OK, "ready"),
        (&Method::GET, "/readyz") => text(StatusCode::SERVICE_UNAVAILABLE, "not ready"),
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
