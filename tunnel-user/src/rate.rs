//! A token bucket, the rate limit of what edges can make the cloud do: failed
//! registrations per address (`cloud::edges::limit`), TokenReviews
//! (`cloud::edges::token_review`) and CSRs (`cloud::edges::csr`).

use std::time::Instant;

/// A token bucket: `rate` per second, at most `burst` at once.
#[derive(Debug)]
pub(crate) struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    pub(crate) fn new(rate: f64, burst: f64, now: Instant) -> Self {
        Self {
            rate,
            burst,
            tokens: burst,
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        self.at = self.at.max(now);
    }

    /// Whether a token is there (takes none).
    pub(crate) fn has(&mut self, now: Instant) -> bool {
        self.refill(now);
        self.tokens >= 1.0
    }

    /// Whether the bucket has refilled completely.
    pub(crate) fn is_full(&mut self, now: Instant) -> bool {
        self.refill(now);
        self.tokens >= self.burst
    }

    pub(crate) fn try_take(&mut self, now: Instant) -> bool {
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn bucket_allows_bursts_then_the_rate() {
        let t0 = Instant::now();
        let mut b = Bucket::new(2.0, 3.0, t0);
        assert!((0..3).all(|_| b.try_take(t0)), "a full burst at once");
        assert!(!b.try_take(t0));
        assert!(
            !b.try_take(t0 + Duration::from_millis(400)),
            "0.8 of a token is not one"
        );
        assert!(b.try_take(t0 + Duration::from_millis(500)));
        assert!(!b.try_take(t0 + Duration::from_millis(500)));
        assert!(
            (0..3).all(|_| b.try_take(t0 + Duration::from_secs(60)))
                && !b.try_take(t0 + Duration::from_secs(60)),
            "refill stops at the burst"
        );
    }
}
