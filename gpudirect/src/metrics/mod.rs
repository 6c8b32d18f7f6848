//! Counting bytes by the path they took, and serving the counts to
//! Prometheus: the plain data and the endpoint the engine's agents and
//! the NCCL plugin share. Each renders its own snapshot in the text
//! format; this module holds what is common.
//!
//! - [`DataPath`]: a byte's path, from the registration that moved it
//!   ([`DataPath::of`]): `gdr`, `host` or `staged`, never inferred.
//! - [`PathCounters`], [`LatencyCounters`]: relaxed atomics the post and
//!   completion paths bump, no lock.
//! - [`MetricsEndpoint`]: an HTTP endpoint on a thread of its own with
//!   bounds on what a scraper or a stranger can make it hold.

mod counting;
mod endpoint;
mod exposition;

pub use counting::{now_ns, sample_start, DataPath, Direction, Histogram, LatencyCounters, PathBytes, PathCounters, PathTraffic, LATENCY_BOUNDS, LATENCY_SAMPLE};
pub use endpoint::{MetricsEndpoint, Render, ACCEPTS_PER_SEC, ACCEPT_BURST, MAX_CONNECTIONS, MAX_REQUEST, MIN_SILENT_AGE, RENDER_EVERY, SCRAPE_TIMEOUT};
pub use exposition::{escape_label, metrics_addr_from, metrics_addr_from_env, parse_metrics_addr, write_family, write_path_traffic, Sample, METRICS_ENV, PROMETHEUS_CONTENT_TYPE};
