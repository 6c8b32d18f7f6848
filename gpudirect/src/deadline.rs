//! Deadlines that accept any timeout (crate-private leaf module).
//!
//! `Instant::now() + timeout` panics when the sum overflows, which
//! `Duration::MAX` ("wait forever") always does. A deadline past what an
//! `Instant` can represent is no deadline at all.

use std::time::{Duration, Instant};

/// When a timeout runs out, or never.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deadline(Option<Instant>);

impl Deadline {
    /// `timeout` from now; never, when that is past the representable end of time.
    pub(crate) fn after(timeout: Duration) -> Deadline {
        Deadline(Instant::now().checked_add(timeout))
    }

    /// No deadline.
    pub(crate) fn never() -> Deadline {
        Deadline(None)
    }

    /// Time left (zero once passed); `None` without a deadline.
    pub(crate) fn left(&self) -> Option<Duration> {
        self.0.map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// Whether the deadline has passed.
    pub(crate) fn passed(&self) -> bool {
        self.left().is_some_and(|l| l.is_zero())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_timeout_is_accepted() {
        let d = Deadline::after(Duration::MAX);
        assert!(d.left().is_none() || d.left().unwrap() > Duration::from_secs(1 << 40));
        assert!(!d.passed());
        assert!(Deadline::after(Duration::ZERO).passed());
        assert!(!Deadline::never().passed());
        assert!(Deadline::after(Duration::from_secs(60)).left().unwrap() <= Duration::from_secs(60));
    }
}
