//! What the plugin counts, as one snapshot ([`PluginStats`], taken by
//! `Site::stats`), and that
//! snapshot in Prometheus' text format: each device's bytes by direction
//! and path (from the registration that moved them and the connection's
//! judgement: `verdict::data_path`), the comms' registration caches, and
//! what was refused. Served at `GPUDIRECT_METRICS` (see the crate doc);
//! the names are the engine's where they mean the same.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use gpudirect::metrics::{write_family, write_path_traffic, PathTraffic};
use gpudirect::rcache::{CacheStats, RegistrationCache};


/// The label every series of the plugin carries as `agent`.
pub const AGENT_LABEL: &str = "nccl-net";

/// What the plugin refused, by reason.
#[derive(Debug, Default)]
pub struct Refusals {
    /// Connections refused at their first transfer under `require`: a
    /// GPU's traffic would have been staged through host memory.
    pub staged: AtomicU64,
    /// Requests failed because the peer claimed more than was posted (a
    /// size, a slot, a message in place of a write).
    pub peer_claims: AtomicU64,
    /// Connections a listener closed during setup (unproven ones over
    /// their budget or silent past their deadline, malformed setups).
    pub setup_closed: AtomicU64,
}

/// The registration caches of a device's comms: live ones read when a
/// snapshot is taken, closed ones folded in when their comm closes.
#[derive(Debug, Default)]
pub struct CacheTotals {
    inner: Mutex<Caches>,
}

#[derive(Debug, Default)]
struct Caches {
    live: Vec<Weak<RegistrationCache>>,
    retired: CacheStats,
    /// The counters last reported: counters never go down, and a shortfall
    /// (counts no longer found anywhere) is kept in `retired`, so later
    /// counts still show.
    reported: CacheStats,
}

impl CacheTotals {
    fn lock(&self) -> std::sync::MutexGuard<'_, Caches> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts `cache`, a new comm's, from now on.
    pub fn add(&self, cache: &Arc<RegistrationCache>) {
        let mut c = self.lock();
        c.live.retain(|w| w.strong_count() > 0);
        c.live.push(Arc::downgrade(cache));
    }

    /// Folds `cache` in for good: its comm is closing.
    pub fn retire(&self, cache: &Arc<RegistrationCache>) {
        // Read under the lock: a snapshot between the read and the fold
        // would count the cache's newer counts live, then the older ones
        // folded in.
        let mut c = self.lock();
        let s = cache.stats();
        c.live.retain(|w| w.strong_count() > 0 && !std::ptr::eq(w.as_ptr(), Arc::as_ptr(cache)));
        add_counters(&mut c.retired, s);
    }

    /// The sum over every comm's cache, live and closed: counters since
    /// start, `entries` and `bytes` of the live ones.
    pub fn read(&self) -> CacheStats {
        let mut c = self.lock();
        let mut sum = c.retired;
        for cache in c.live.iter().filter_map(Weak::upgrade) {
            let s = cache.stats();
            add_counters(&mut sum, s);
            sum.entries += s.entries;
            sum.bytes += s.bytes;
        }
        let Caches { retired, reported, .. } = &mut *c;
        for i in 0..COUNTERS {
            let (now, last) = (*counter(&mut sum, i), *counter(reported, i));
            if now < last {
                *counter(retired, i) += last - now;
                *counter(&mut sum, i) = last;
            }
            *counter(reported, i) = now.max(last);
        }
        sum
    }
}

/// How many counters a [`CacheStats`] has ([`counter`]'s indices).
const COUNTERS: usize = 5;

/// Each counter's name in `gpudirect_rcache_<name>_total` and its help,
/// at its [`counter`] index.
const COUNTER_NAMES: [(&str, &str); COUNTERS] = [
    ("hits", "Registrations served by a comm's registration cache."),
    ("misses", "Registrations that registered memory."),
    ("evictions", "Cached regions dropped to stay within the cache's bounds."),
    ("invalidations", "Cached regions dropped because their memory changed or was freed."),
    ("uncached", "Registrations made but not cached (GPU ranges across several mappings)."),
];

/// A [`CacheStats`]' counter `i` (its gauges, `entries` and `bytes`, are
/// not counters).
fn counter(s: &mut CacheStats, i: usize) -> &mut u64 {
    match i {
        0 => &mut s.hits,
        1 => &mut s.misses,
        2 => &mut s.evictions,
        3 => &mut s.invalidations,
        _ => &mut s.uncached,
    }
}

fn add_counters(to: &mut CacheStats, mut s: CacheStats) {
    for i in 0..COUNTERS {
        *counter(to, i) += *counter(&mut s, i);
    }
}

/// One device's share of a [`PluginStats`].
#[derive(Clone, Debug, PartialEq)]
pub struct NicStats {
    /// `device:port`, as the plugin's log lines name it.
    pub nic: String,
    /// Bytes and posts by direction (out: sends; in: receives) and path.
    pub traffic: Vec<PathTraffic>,
    /// Comms open on it.
    pub comms: usize,
    /// Its comms' registration caches, summed.
    pub rcache: CacheStats,
}

/// Everything the plugin counts, at one moment.
#[derive(Clone, Debug, PartialEq)]
pub struct PluginStats {
    /// Since the plugin's init.
    pub uptime: Duration,
    /// Each device, in NCCL's index order.
    pub nics: Vec<NicStats>,
    /// Connections refused under `require`.
    pub refused_staged: u64,
    /// Requests failed on a peer's claim.
    pub refused_peer_claims: u64,
    /// Connections closed during setup.
    pub refused_setup_closed: u64,
}


/// `stats` in the text format (the README's "Metrics" table).
pub fn prometheus_text(stats: &PluginStats) -> String {
    let mut out = String::with_capacity(4096);
    let agent = || ("agent", AGENT_LABEL.to_owned());
    write_family(&mut out, "gpudirect_uptime_seconds", "gauge", "How long the plugin had run when this snapshot was taken (monotonic).", &[(vec![agent()], format!("{:.6}", stats.uptime.as_secs_f64()))]);
    write_path_traffic(&mut out, AGENT_LABEL, stats.nics.iter().map(|n| (n.nic.as_str(), n.traffic.as_slice())));
    let per_nic = |f: &dyn Fn(&NicStats) -> String| -> Vec<_> { stats.nics.iter().map(|n| (vec![agent(), ("nic", n.nic.clone())], f(n))).collect() };
    let comms: usize = stats.nics.iter().map(|n| n.comms).sum();
    write_family(&mut out, "gpudirect_connections", "gauge", "NCCL comms open (each its own queue pair), by state.", &[(vec![agent(), ("state", "live".to_owned())], comms.to_string())]);
    write_family(&mut out, "gpudirect_nic_connections", "gauge", "NCCL comms open, by NIC.", &per_nic(&|n| n.comms.to_string()));
    let reasons = [("nccl_staged", stats.refused_staged), ("nccl_peer_claim", stats.refused_peer_claims), ("nccl_setup_closed", stats.refused_setup_closed)];
    let refusals: Vec<_> = reasons.iter().map(|(why, n)| (vec![agent(), ("reason", (*why).to_owned())], n.to_string())).collect();
    write_family(&mut out, "gpudirect_refusals_total", "counter", "What the plugin refused, by reason (each also logged).", &refusals);
    for (i, (name, help)) in COUNTER_NAMES.iter().enumerate() {
        let value = |n: &NicStats| {
            let mut c = n.rcache;
            counter(&mut c, i).to_string()
        };
        write_family(&mut out, &format!("gpudirect_rcache_{name}_total"), "counter", help, &per_nic(&value));
    }
    write_family(&mut out, "gpudirect_rcache_entries", "gauge", "Regions cached now, over every open comm.", &per_nic(&|n| n.rcache.entries.to_string()));
    write_family(&mut out, "gpudirect_rcache_bytes", "gauge", "Bytes of the regions cached now (pinned).", &per_nic(&|n| n.rcache.bytes.to_string()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpudirect::metrics::{DataPath, Direction, PathCounters};

    fn stats(hits: u64) -> PluginStats {
        let t = PathCounters::default();
        t.add(Direction::Out, DataPath::Staged, 4096);
        t.add(Direction::In, DataPath::Host, 100);
        PluginStats {
            uptime: Duration::from_millis(1500),
            nics: vec![NicStats { nic: "rxe0:1".into(), traffic: t.read(), comms: 2, rcache: CacheStats { hits, misses: 3, entries: 1, bytes: 4096, ..CacheStats::default() } }],
            refused_staged: 1,
            refused_peer_claims: 0,
            refused_setup_closed: 5,
        }
    }

    /// Every series from the start (zeros included), staged bytes under
    /// their own path, the plugin's refusal reasons and cache families.
    #[test]
    fn the_text_has_every_family_and_path() {
        let text = prometheus_text(&stats(7));
        for line in [
            r#"gpudirect_bytes_total{agent="nccl-net",nic="rxe0:1",direction="out",path="staged"} 4096"#,
            r#"gpudirect_bytes_total{agent="nccl-net",nic="rxe0:1",direction="out",path="gdr"} 0"#,
            r#"gpudirect_bytes_total{agent="nccl-net",nic="rxe0:1",direction="in",path="host"} 100"#,
            r#"gpudirect_connections{agent="nccl-net",state="live"} 2"#,
            r#"gpudirect_nic_connections{agent="nccl-net",nic="rxe0:1"} 2"#,
            r#"gpudirect_refusals_total{agent="nccl-net",reason="nccl_staged"} 1"#,
            r#"gpudirect_refusals_total{agent="nccl-net",reason="nccl_setup_closed"} 5"#,
            r#"gpudirect_rcache_hits_total{agent="nccl-net",nic="rxe0:1"} 7"#,
            r#"gpudirect_rcache_bytes{agent="nccl-net",nic="rxe0:1"} 4096"#,
            r#"gpudirect_uptime_seconds{agent="nccl-net"} 1.500000"#,
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}\n{text}");
        }
        assert_eq!(text.lines().filter(|l| l.starts_with("gpudirect_bytes_total{")).count(), 6);
    }

    /// A cache whose last holder let go before its comm retired it is
    /// missing from the sum; the counters reported never go down.
    #[test]
    fn cache_counters_never_go_down() {
        let totals = CacheTotals::default();
        let mut c = totals.lock();
        c.retired.hits = 10;
        c.reported.hits = 15; // a cache gone before it was folded in
        drop(c);
        assert_eq!(totals.read().hits, 15);
        totals.lock().retired.hits = 20;
        assert_eq!(totals.read().hits, 20);
    }

    /// Attack (review): the high-water mark keeps counters from going
    /// down, but must not swallow what happens after. A cache with 5 hits
    /// gone before it was folded in (the mark holds 15 = 10 retired + 5),
    /// then 3 more hits folded in by a closing comm: 18 hits happened, and
    /// a counter that stays at 15 shows a rate of 0 while hits go on.
    #[test]
    fn cache_counters_count_on_after_a_lost_cache() {
        let totals = CacheTotals::default();
        let mut c = totals.lock();
        c.retired.hits = 10;
        c.reported.hits = 15; // 5 hits of a cache gone before it was folded in
        drop(c);
        assert_eq!(totals.read().hits, 15);
        totals.lock().retired.hits += 3; // a comm closing with 3 hits
        assert_eq!(totals.read().hits, 18, "3 hits that happened after a lost cache never show");
    }

    /// Attack (review): readers on several threads while counters are
    /// folded in never see a counter go down.
    #[test]
    fn cache_counters_never_go_down_across_threads() {
        let totals = std::sync::Arc::new(CacheTotals::default());
        let writer = {
            let t = totals.clone();
            std::thread::spawn(move || {
                for i in 0..20_000u64 {
                    let mut c = t.lock();
                    c.retired.misses += 1;
                    // now and then a cache's counters vanish for a moment
                    if i % 7 == 0 {
                        c.retired.misses -= 1;
                    } else if i % 7 == 1 {
                        c.retired.misses += 1;
                    }
                }
            })
        };
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let t = totals.clone();
                std::thread::spawn(move || {
                    let mut last = 0;
                    for _ in 0..20_000 {
                        let now = t.read().misses;
                        assert!(now >= last, "misses went from {last} to {now}");
                        last = now;
                    }
                })
            })
            .collect();
        writer.join().unwrap();
        for r in readers {
            r.join().unwrap();
        }
    }

    /// Attack (review): a NIC name with the text format's specials
    /// forges no series and no other label: every line is a comment or
    /// a sample of a family the plugin declared, and the name comes back.
    #[test]
    fn nic_names_cannot_forge_series() {
        let evil = "x\"} 1\ngpudirect_bytes_total{agent=\"other\",nic=\"y\",direction=\"out\",path=\"gdr\"} 999\r\\";
        let mut s = stats(1);
        s.nics[0].nic = evil.to_owned();
        let text = prometheus_text(&s);
        assert!(!text.contains("agent=\"other\""), "{text}");
        for l in text.lines() {
            assert!(l.starts_with('#') || l.contains("{agent=\"nccl-net\""), "forged line {l:?}");
        }
        assert!(!text.contains(" 999\n"), "{text}");
    }
}
