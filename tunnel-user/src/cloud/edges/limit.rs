//! Bounds on what failed registrations can cost: a token bucket of failures per source
//! address (an address that keeps failing is refused with RATE_LIMITED before its
//! credentials are even looked at, so tokens cannot be guessed at speed), and a budget
//! of log lines so that a flood cannot fill the disk (the rest are counted and
//! summarised in one line).
//!
//! A valid edge is only ever refused because of failures from its own source address,
//! never because of a flood from elsewhere.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::rate::Bucket;

/// Failures an address may have in a burst, and how fast its budget comes back.
pub(crate) const FAILURE_BURST: f64 = 20.0;
pub(crate) const FAILURE_RATE: f64 = 2.0;
/// Addresses tracked at most; beyond this the ones with a full budget are forgotten,
/// and if none is, new addresses share one bucket.
const MAX_TRACKED: usize = 10_000;

pub(crate) struct AuthLimiter {
    inner: Mutex<Inner>,
}

struct Inner {
    per_ip: HashMap<IpAddr, Bucket>,
    /// Shared by addresses that did not fit in `per_ip`.
    overflow: Bucket,
}

impl Default for AuthLimiter {
    fn default() -> Self {
        let now = Instant::now();
        Self {
            inner: Mutex::new(Inner {
                per_ip: HashMap::new(),
                overflow: Bucket::new(FAILURE_RATE, FAILURE_BURST, now),
            }),
        }
    }
}

impl AuthLimiter {
    /// Whether `ip` may try to authenticate now (consumes nothing).
    pub(crate) fn allowed(&self, ip: IpAddr, now: Instant) -> bool {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let inner = &mut *guard;
        let full = inner.per_ip.len() >= MAX_TRACKED;
        match inner.per_ip.get_mut(&ip) {
            Some(bucket) => bucket.has(now),
            None if full => inner.overflow.has(now),
            None => true,
        }
    }

    /// Records a failed attempt from `ip`.
    pub(crate) fn failed(&self, ip: IpAddr, now: Instant) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if !inner.per_ip.contains_key(&ip) && inner.per_ip.len() >= MAX_TRACKED {
            inner.per_ip.retain(|_, b| !b.is_full(now));
        }
        if inner.per_ip.len() >= MAX_TRACKED && !inner.per_ip.contains_key(&ip) {
            inner.overflow.try_take(now);
            return;
        }
        inner
            .per_ip
            .entry(ip)
            .or_insert_with(|| Bucket::new(FAILURE_RATE, FAILURE_BURST, now))
            .try_take(now);
    }

    #[cfg(test)]
    fn tracked(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .per_ip
            .len()
    }
}

/// At most `lines` log lines per `window`; the rest are counted, and the count is
/// reported by the first line of a later window.
pub(crate) struct LogBudget {
    lines: u32,
    window: Duration,
    state: Mutex<(Instant, u32, u64)>,
}

impl LogBudget {
    pub(crate) fn new(lines: u32, window: Duration) -> Self {
        Self {
            lines,
            window,
            state: Mutex::new((Instant::now(), 0, 0)),
        }
    }

    /// `Log(n)` if a line may be logged now (`n` lines were left out since the last
    /// one), `FirstLeftOut` for the first line left out (time to say so), else `Quiet`.
    pub(crate) fn take(&self, now: Instant) -> Budget {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if now.saturating_duration_since(s.0) >= self.window {
            s.0 = now;
            s.1 = 0;
        }
        if s.1 < self.lines {
            s.1 += 1;
            Budget::Log(std::mem::take(&mut s.2))
        } else {
            s.2 += 1;
            if s.2 == 1 {
                Budget::FirstLeftOut
            } else {
                Budget::Quiet
            }
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Budget {
    Log(u64),
    FirstLeftOut,
    Quiet,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_that_keeps_failing_is_limited_and_others_are_not() {
        let l = AuthLimiter::default();
        let now = Instant::now();
        let bad: IpAddr = "127.0.0.2".parse().unwrap();
        let good: IpAddr = "127.0.0.1".parse().unwrap();
        for _ in 0..FAILURE_BURST as usize {
            assert!(l.allowed(bad, now));
            l.failed(bad, now);
        }
        assert!(!l.allowed(bad, now));
        assert!(l.allowed(good, now));
        // The budget comes back with time.
        assert!(l.allowed(
            bad,
            now + Duration::from_secs_f64(1.0 / FAILURE_RATE + 0.01)
        ));
    }

    #[test]
    fn tracked_addresses_are_bounded() {
        let l = AuthLimiter::default();
        let now = Instant::now();
        for i in 0..(MAX_TRACKED as u32 + 500) {
            l.failed(IpAddr::from(i.to_be_bytes()), now);
        }
        assert!(l.tracked() <= MAX_TRACKED);
        // Long after, the full buckets are forgotten to make room.
        l.failed("10.0.0.1".parse().unwrap(), now + Duration::from_secs(3600));
        assert!(l.tracked() <= 2);
    }

    #[test]
    fn log_budget_counts_what_it_leaves_out() {
        let b = LogBudget::new(2, Duration::from_secs(10));
        let now = Instant::now();
        assert_eq!(b.take(now), Budget::Log(0));
        assert_eq!(b.take(now), Budget::Log(0));
        assert_eq!(b.take(now), Budget::FirstLeftOut);
        assert_eq!(b.take(now), Budget::Quiet);
        assert_eq!(b.take(now + Duration::from_secs(11)), Budget::Log(2));
    }
}
