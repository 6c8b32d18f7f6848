//! `gpudirect stats`: a terminal view of an agent's metrics endpoint
//! (`AgentConfig::metrics`, `GPUDIRECT_METRICS`), refreshed every
//! interval. Fetching, reading and judging are here; the command only
//! prints what [`render::render`] draws.
//!
//! - [`scrape`]: one bounded HTTP/1.1 `GET /metrics`.
//! - [`expo`]: the Prometheus text format the engine writes, read
//!   strictly (typed errors by line number, bounded).
//! - [`view`]: two scrapes into a [`view::Frame`]: rates by NIC,
//!   direction and path, totals, each NIC's verdict on staging.
//! - [`render`]: a frame as text, red for staged bytes on a terminal.
//!
//! [`StatsRequest`] is what the command line decided; [`Watcher`] takes
//! its scrapes one interval apart and hands back a frame per interval.
#![warn(missing_docs)]

pub mod expo;
pub mod render;
pub mod scrape;
pub mod view;

use std::ffi::OsStr;
use std::time::{Duration, Instant, SystemTime};

use self::expo::ExpoError;
use self::render::Style;
use self::scrape::{ScrapeError, Target};
use self::view::{Frame, Snapshot, ViewError, Watch};

/// The shortest interval: rates over less are noise.
pub const MIN_INTERVAL: Duration = Duration::from_millis(50);
/// The longest interval and the longest timeout.
pub const MAX_SECONDS: f64 = 86_400.0;

/// Why `stats` stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StatsError {
    /// A flag out of its range.
    #[error("{flag} {why}")]
    BadFlag {
        /// The flag.
        flag: &'static str,
        /// What is wrong.
        why: String,
    },
    /// A scrape failed.
    #[error(transparent)]
    Scrape(#[from] ScrapeError),
    /// The endpoint's answer is not the text format.
    #[error("{target}'s answer is not Prometheus text: {source}")]
    Expo {
        /// The endpoint.
        target: String,
        /// Where and why.
        source: ExpoError,
    },
    /// The text is not an agent's metrics as the view reads them.
    #[error("{target}: {source}")]
    View {
        /// The endpoint.
        target: String,
        /// Why.
        source: ViewError,
    },
}

/// `stats` as given on the command line.
#[derive(Clone, Debug)]
pub struct StatsArgs {
    /// `HOST:PORT`, `[IPV6]:PORT` or `PORT` (127.0.0.1).
    pub addr: String,
    /// Seconds between scrapes.
    pub interval: f64,
    /// Seconds one scrape may take.
    pub timeout: f64,
    /// One frame, then exit.
    pub once: bool,
    /// This many frames, then exit.
    pub count: Option<u64>,
}

/// `stats`, decided: where, how often, how many frames.
#[derive(Clone, Debug)]
pub struct StatsRequest {
    /// The endpoint.
    pub target: Target,
    /// Time between scrapes.
    pub interval: Duration,
    /// Bound on one scrape.
    pub timeout: Duration,
    /// Frames to show before exiting; `None`: until stopped.
    pub frames: Option<u64>,
}

/// `secs` of `flag` as a duration from `min` to [`MAX_SECONDS`].
fn seconds(flag: &'static str, secs: f64, min: Duration) -> Result<Duration, StatsError> {
    let bad = |why: String| StatsError::BadFlag { flag, why };
    if !secs.is_finite() || secs > MAX_SECONDS {
        return Err(bad(format!("{secs}: give seconds up to {MAX_SECONDS}")));
    }
    let d = Duration::try_from_secs_f64(secs).map_err(|_| bad(format!("{secs}: give a positive number of seconds")))?;
    if d < min || d.is_zero() {
        return Err(bad(format!("{secs}: at least {} s", min.as_secs_f64().max(0.001))));
    }
    Ok(d)
}

impl StatsRequest {
    /// Checks `a`.
    ///
    /// # Errors
    /// [`StatsError::BadFlag`] for an interval under [`MIN_INTERVAL`], a
    /// timeout of zero, either past a day, `--count 0`;
    /// [`ScrapeError::BadAddress`] for an address that is not one.
    pub fn new(a: StatsArgs) -> Result<StatsRequest, StatsError> {
        let target = Target::parse(&a.addr)?;
        let interval = seconds("--interval", a.interval, MIN_INTERVAL)?;
        let timeout = seconds("--timeout", a.timeout, Duration::from_millis(1))?;
        let frames = match (a.once, a.count) {
            (true, Some(_)) => return Err(StatsError::BadFlag { flag: "--once", why: "and --count: give one of them".into() }),
            (true, None) => Some(1),
            (false, Some(0)) => return Err(StatsError::BadFlag { flag: "--count", why: "0: give at least one frame".into() }),
            (false, n) => n,
        };
        Ok(StatsRequest { target, interval, timeout, frames })
    }

    /// How frames are drawn on an output that is a terminal or not, with
    /// the environment's `NO_COLOR` (set and not empty: no colours, as
    /// no-color.org says).
    pub fn style(&self, terminal: bool, no_color: Option<&OsStr>) -> Style {
        Style { colour: terminal && no_color.is_none_or(OsStr::is_empty), clear: terminal && self.frames != Some(1) }
    }
}

/// An exposition's text, taken at `at` (`wall` on the wall clock), read
/// into a snapshot; `target` names it in errors.
///
/// # Errors
/// [`StatsError::Expo`] or [`StatsError::View`].
pub fn read(target: &Target, text: &str, at: Instant, wall: SystemTime) -> Result<Snapshot, StatsError> {
    let e = expo::parse(text).map_err(|source| StatsError::Expo { target: target.to_string(), source })?;
    Snapshot::read(&e, at, wall).map_err(|source| StatsError::View { target: target.to_string(), source })
}

/// Scrapes a request's endpoint one interval apart and hands back the
/// frame of each interval.
pub struct Watcher<'a> {
    request: &'a StatsRequest,
    watch: Watch,
    next: Option<Instant>,
}

impl<'a> Watcher<'a> {
    /// A watcher that has scraped nothing yet.
    pub fn new(request: &'a StatsRequest) -> Watcher<'a> {
        Watcher { request, watch: Watch::new(), next: None }
    }

    /// Scrapes (twice the first time, `interval` apart; then once, an
    /// interval after the previous scrape began) and returns the frame.
    ///
    /// # Errors
    /// The first scrape that failed or brought back no agent's metrics.
    pub fn next_frame(&mut self) -> Result<Frame, StatsError> {
        loop {
            if let Some(wait) = self.next.map(|t| t.saturating_duration_since(Instant::now())) {
                std::thread::sleep(wait);
            }
            let began = Instant::now();
            self.next = began.checked_add(self.request.interval);
            let text = scrape::scrape(&self.request.target, self.request.timeout)?;
            let snapshot = read(&self.request.target, &text, Instant::now(), SystemTime::now())?;
            if let Some(frame) = self.watch.push(snapshot) {
                return Ok(frame);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(addr: &str, interval: f64, timeout: f64, once: bool, count: Option<u64>) -> Result<StatsRequest, StatsError> {
        StatsRequest::new(StatsArgs { addr: addr.into(), interval, timeout, once, count })
    }

    #[test]
    fn flags_are_checked_once() {
        let r = args("9400", 0.2, 5.0, true, None).unwrap();
        assert_eq!((r.target.to_string(), r.interval, r.frames), ("127.0.0.1:9400".into(), Duration::from_millis(200), Some(1)));
        assert_eq!(args("h:1", 1.0, 5.0, false, None).unwrap().frames, None);
        assert_eq!(args("h:1", 1.0, 5.0, false, Some(3)).unwrap().frames, Some(3));
        for (interval, timeout) in [(0.0, 5.0), (0.01, 5.0), (-1.0, 5.0), (f64::NAN, 5.0), (f64::INFINITY, 5.0), (1e12, 5.0), (1.0, 0.0), (1.0, -2.0)] {
            assert!(matches!(args("1", interval, timeout, false, None), Err(StatsError::BadFlag { .. })), "{interval} {timeout}");
        }
        assert!(matches!(args("1", 1.0, 5.0, false, Some(0)), Err(StatsError::BadFlag { flag: "--count", .. })));
        assert!(matches!(args("1", 1.0, 5.0, true, Some(2)), Err(StatsError::BadFlag { flag: "--once", .. })));
        assert!(matches!(args("nope", 1.0, 5.0, false, None), Err(StatsError::Scrape(ScrapeError::BadAddress { .. }))));
    }

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        let once = args("1", 1.0, 1.0, true, None).unwrap();
        let more = args("1", 1.0, 1.0, false, None).unwrap();
        assert_eq!(more.style(true, None), Style { colour: true, clear: true });
        assert_eq!(once.style(true, None), Style { colour: true, clear: false });
        assert_eq!(more.style(false, None), Style::default());
        assert_eq!(more.style(true, Some(OsStr::new("1"))), Style { colour: false, clear: true });
        assert!(more.style(true, Some(OsStr::new(""))).colour, "an empty NO_COLOR is not set");
    }
}
