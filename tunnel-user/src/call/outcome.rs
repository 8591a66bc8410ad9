//! How a dial ended, in one table. Every error of a dial becomes a `DialStatus` once,
//! where it happens (the edge's `DialError::status`, the cloud's
//! `ReverseDialError::status`, a session's or a link's own failure), and crosses every
//! hop after as a [`DialFailure`], the status with the text of whoever decided it.
//! What each place that reports it then says, the HTTP status of a proxy client, the
//! `reason` of each dial metric and the cloud's log text, is [`says`]'s row for the
//! status.
//!
//! The values are on dashboards and in clients' scripts, so they stay as they were,
//! with the places that say something else on purpose: the cloud's own dial metric
//! calls `TunnelFailed` `tunnel`, edge-to-cloud dials have labels of their own in the
//! same metric (`reverse_*`), the edge counts the cloud's refusals of edge-to-cloud
//! connections apart from its own dials, and its HTTP proxy answers a bad request with
//! 400 (the proxy client named the target).

use proto::{DialResult, DialStatus};
use tonic::Status;

/// What is said of a dial that ended with one status, wherever it is said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Says {
    /// The HTTP status the cloud's CONNECT and HTTPS entries answer a client with.
    pub(crate) http: (u16, &'static str),
    /// The HTTP status the edge's proxy answers its client with when the cloud refused.
    pub(crate) edge_proxy_http: (u16, &'static str),
    /// `reason` of `tunnel_edge_dials`, the edge's dials for the cloud (`ok` too).
    pub(crate) edge_dials: &'static str,
    /// `reason` of `tunnel_dial_failures` for a cloud-to-edge connection.
    pub(crate) cloud_dials: &'static str,
    /// `reason` of `tunnel_dial_failures` for an edge-to-cloud connection.
    pub(crate) cloud_reverse: &'static str,
    /// `reason` of `tunnel_edge_reverse_connections` for what the cloud answered (`ok`
    /// too).
    pub(crate) edge_reverse: &'static str,
    /// What the cloud says of the failure, and whether the deciding end's text follows
    /// (after `: `; alone when this is empty).
    pub(crate) text: (&'static str, bool),
}

const BAD_GATEWAY: (u16, &str) = (502, "Bad Gateway");
const FORBIDDEN: (u16, &str) = (403, "Forbidden");
const GATEWAY_TIMEOUT: (u16, &str) = (504, "Gateway Timeout");
const UNAVAILABLE: (u16, &str) = (503, "Service Unavailable");
const BAD_REQUEST: (u16, &str) = (400, "Bad Request");

/// The table: one row per status. `Ok` fails nowhere (its failure columns are never
/// used), and `Unspecified` comes only from a far end that set no status.
#[rustfmt::skip]
pub(crate) fn says(status: DialStatus) -> Says {
    use DialStatus as S;
    let (http, edge_proxy_http, edge_dials, cloud_dials, cloud_reverse, edge_reverse, text) =
        match status {
            // status           HTTP              HTTP, edge proxy  edge dials        cloud dials     cloud, reverse         edge, reverse        the cloud's text
            S::Ok           => (BAD_GATEWAY,      BAD_GATEWAY,      "ok",             "ok",           "ok",                  "ok",                ("tunnel to edge failed", true)),
            S::Forbidden    => (FORBIDDEN,        FORBIDDEN,        "forbidden",      "forbidden",    "reverse_forbidden",   "forbidden",         ("edge refused target", true)),
            S::Refused      => (BAD_GATEWAY,      BAD_GATEWAY,      "refused",        "refused",      "reverse_refused",     "refused",           ("edge could not connect to target", true)),
            S::Timeout      => (GATEWAY_TIMEOUT,  GATEWAY_TIMEOUT,  "timeout",        "timeout",      "reverse_timeout",     "dial_timeout",      ("edge timed out connecting to target", false)),
            S::BadRequest   => (BAD_GATEWAY,      BAD_REQUEST,      "bad_request",    "bad_request",  "reverse_refused",     "cloud_error",       ("edge rejected the request", true)),
            S::Overloaded   => (UNAVAILABLE,      UNAVAILABLE,      "overloaded",     "overloaded",   "reverse_overloaded",  "cloud_overloaded",  ("edge is at its connection limit", false)),
            S::NotHeld      => (BAD_GATEWAY,      BAD_GATEWAY,      "not_held",       "not_held",     "reverse_refused",     "cloud_error",       ("", true)),
            S::TunnelFailed => (BAD_GATEWAY,      BAD_GATEWAY,      "tunnel_failed",  "tunnel",       "reverse_refused",     "cloud_error",       ("tunnel to edge failed", true)),
            S::Unspecified  => (BAD_GATEWAY,      BAD_GATEWAY,      "unspecified",    "bad_request",  "reverse_refused",     "cloud_error",       ("edge rejected the request", true)),
        };
    Says { http, edge_proxy_http, edge_dials, cloud_dials, cloud_reverse, edge_reverse, text }
}

/// Why a dial did not connect: its status, and the text of the end that decided it
/// (the edge's, a replica's, or this process's own), as it crosses every hop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DialFailure {
    pub(crate) status: DialStatus,
    pub(crate) message: String,
}

impl DialFailure {
    pub(crate) fn new(status: DialStatus, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    /// The failure a status from the callee stands for (`DialResult::from_status`).
    pub(crate) fn from_status(status: &Status) -> Self {
        DialResult::from_status(status).into()
    }

    /// This failure's row of the table.
    pub(crate) fn says(&self) -> Says {
        says(self.status)
    }

    /// The `DialResult` that tells the caller (a forwarding replica, the edge).
    pub(crate) fn result(&self) -> DialResult {
        DialResult {
            status: self.status as i32,
            message: self.message.clone(),
        }
    }

    /// The status a call refused with this failure is answered with.
    pub(crate) fn into_status(self) -> Status {
        DialResult::refusal(self.status, self.message)
    }
}

impl From<DialResult> for DialFailure {
    fn from(result: DialResult) -> Self {
        Self::new(result.status(), result.message)
    }
}

impl std::fmt::Display for DialFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.says().text {
            ("", _) => f.write_str(&self.message),
            (text, true) => write!(f, "{text}: {}", self.message),
            (text, false) => f.write_str(text),
        }
    }
}

impl std::error::Error for DialFailure {}

#[cfg(test)]
mod tests {
    use super::*;

    /// What clients, dashboards and logs knew before the table, for every status.
    #[test]
    fn the_table_says_what_each_place_said() {
        let rows = [
            (
                DialStatus::Forbidden,
                403,
                403,
                "forbidden",
                "forbidden",
                "reverse_forbidden",
                "forbidden",
            ),
            (
                DialStatus::Refused,
                502,
                502,
                "refused",
                "refused",
                "reverse_refused",
                "refused",
            ),
            (
                DialStatus::Timeout,
                504,
                504,
                "timeout",
                "timeout",
                "reverse_timeout",
                "dial_timeout",
            ),
            (
                DialStatus::BadRequest,
                502,
                400,
                "bad_request",
                "bad_request",
                "reverse_refused",
                "cloud_error",
            ),
            (
                DialStatus::Overloaded,
                503,
                503,
                "overloaded",
                "overloaded",
                "reverse_overloaded",
                "cloud_overloaded",
            ),
            (
                DialStatus::NotHeld,
                502,
                502,
                "not_held",
                "not_held",
                "reverse_refused",
                "cloud_error",
            ),
            (
                DialStatus::TunnelFailed,
                502,
                502,
                "tunnel_failed",
                "tunnel",
                "reverse_refused",
                "cloud_error",
            ),
        ];
        for (status, http, proxy, edge, cloud, reverse, edge_reverse) in rows {
            let s = says(status);
            assert_eq!(
                (
                    s.http.0,
                    s.edge_proxy_http.0,
                    s.edge_dials,
                    s.cloud_dials,
                    s.cloud_reverse,
                    s.edge_reverse
                ),
                (http, proxy, edge, cloud, reverse, edge_reverse),
                "{status:?}"
            );
        }
        assert_eq!(
            (
                says(DialStatus::Ok).edge_dials,
                says(DialStatus::Ok).edge_reverse
            ),
            ("ok", "ok")
        );
    }

    #[test]
    fn the_cloud_says_the_edges_text_where_it_has_one() {
        let text = |status, message: &str| DialFailure::new(status, message).to_string();
        assert_eq!(text(DialStatus::Forbidden, "x"), "edge refused target: x");
        assert_eq!(
            text(DialStatus::Refused, "x"),
            "edge could not connect to target: x"
        );
        assert_eq!(
            text(DialStatus::Timeout, "x"),
            "edge timed out connecting to target"
        );
        assert_eq!(
            text(DialStatus::Overloaded, ""),
            "edge is at its connection limit"
        );
        assert_eq!(
            text(DialStatus::BadRequest, "x"),
            "edge rejected the request: x"
        );
        assert_eq!(
            text(DialStatus::TunnelFailed, "x"),
            "tunnel to edge failed: x"
        );
        assert_eq!(
            text(DialStatus::NotHeld, "replica `r` holds no"),
            "replica `r` holds no"
        );
    }

    /// A failure crosses a hop as a status and comes out the same.
    #[test]
    fn a_failure_survives_the_wire() {
        let failure = DialFailure::new(DialStatus::Refused, "connect to 192.0.2.1:80: refused");
        assert_eq!(
            DialFailure::from_status(&failure.clone().into_status()),
            failure
        );
        assert_eq!(DialFailure::from(failure.result()), failure);
    }
}
