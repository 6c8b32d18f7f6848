//! What `fleet post` and `fleet check` are asked, decided once. The
//! command line and the Python package each parse their own syntax into
//! [`PostArgs`] / [`CheckArgs`]; [`PostRequest::new`] and
//! [`CheckRequest::new`] check them together (one place given, a lease
//! only for etcd, a wait only with something to wait for, a time the
//! clock can hold) and open the place, so both front ends refuse and
//! accept exactly the same requests.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use super::{check_since, expand_hostlist, post, Collection, Expect, FleetReport};
use crate::doctor::report::Report;

/// Where a job's captures meet: exactly one of a folder every node
/// shares, the rendezvous server (`HOST:PORT`), etcd's endpoints.
#[derive(Clone, Debug, Default)]
pub struct Place {
    /// A shared folder (captures at `DIR/JOB/NODE.json`).
    pub dir: Option<PathBuf>,
    /// The rendezvous server's address.
    pub rendezvous: Option<String>,
    /// etcd's endpoints (empty: not etcd).
    pub etcd: Vec<String>,
}

/// A `fleet post` as given.
#[derive(Clone, Debug)]
pub struct PostArgs {
    /// Where to post.
    pub place: Place,
    /// The job's id.
    pub job: String,
    /// This node's name (`None`: the host name).
    pub node: Option<String>,
    /// A capture to post instead of capturing this machine now.
    pub from: Option<PathBuf>,
    /// With etcd: the posting expires this long after the post.
    pub lease: Option<Duration>,
    /// Bound on each request (and on the wait for a rendezvous server not
    /// up yet).
    pub timeout: Duration,
}

/// A `fleet post`, checked and with its place opened.
pub struct PostRequest {
    to: Collection,
    job: String,
    node: Option<String>,
    from: Option<PathBuf>,
}

/// Refuses a zero bound: every request would fail at once.
fn positive(timeout: Duration) -> Result<Duration, String> {
    if timeout.is_zero() {
        return Err("timeout 0: give each request a positive bound (seconds)".into());
    }
    Ok(timeout)
}

impl PostRequest {
    /// Checks `a` and opens its place.
    ///
    /// # Errors
    /// A lease without etcd (etcd's own are at least 2 s); a zero timeout; none or
    /// several places; the place's own errors (an unusable secret, etcd
    /// unreachable).
    pub fn new(a: PostArgs) -> Result<PostRequest, String> {
        let timeout = positive(a.timeout)?;
        let to = match a.lease {
            Some(_) if a.place.etcd.is_empty() => {
                return Err("--lease applies to --etcd (the rendezvous server's own --lease bounds what it holds)".into())
            }
            Some(l) => Collection::etcd_leased(&a.place.etcd, timeout, Some(l))?,
            None => Collection::open(a.place.dir.as_deref(), a.place.rendezvous.as_deref(), &a.place.etcd, timeout)?,
        };
        Ok(PostRequest { to, job: a.job, node: a.node, from: a.from })
    }

    /// Posts; where it went and the doctor's report of what was posted.
    ///
    /// # Errors
    /// As [`post`].
    pub fn run(&self) -> Result<(String, Report), String> {
        post(&self.to, &self.job, self.node.as_deref(), self.from.as_deref())
    }
}

/// A `fleet check` as given.
#[derive(Clone, Debug)]
pub struct CheckArgs {
    /// Where the captures are.
    pub place: Place,
    /// The job's id (a folder's subfolder; `None`: the folder itself).
    pub job: Option<String>,
    /// The allocation's size.
    pub expect: Option<usize>,
    /// The allocation's nodes, as a Slurm host list.
    pub nodes: Option<String>,
    /// How long to wait for the expected captures.
    pub wait: Option<Duration>,
    /// The job's start, in seconds since the epoch: older captures fail.
    pub since: Option<u64>,
    /// Bound on each request.
    pub timeout: Duration,
}

/// A `fleet check`, checked and with its place opened.
pub struct CheckRequest {
    from: Collection,
    job: Option<String>,
    expect: Option<Expect>,
    wait: Option<Duration>,
    since: Option<SystemTime>,
}

impl CheckRequest {
    /// Checks `a` and opens its place.
    ///
    /// # Errors
    /// Both `expect` and `nodes`; a wait with neither (nothing to wait
    /// for); a host list that does not parse; a `since` past what the
    /// clock holds; a zero timeout; none or several places; the place's
    /// own errors.
    pub fn new(a: CheckArgs) -> Result<CheckRequest, String> {
        let timeout = positive(a.timeout)?;
        let expect = match (a.expect, a.nodes) {
            (Some(_), Some(_)) => return Err("give --expect N or --nodes LIST, not both".into()),
            (Some(0), None) => return Err("--expect 0: an allocation has at least one node (leave it out to judge whatever posted)".into()),
            (Some(n), None) => Some(Expect::Count(n)),
            (None, Some(list)) => Some(Expect::Names(expand_hostlist(&list).map_err(|e| format!("--nodes: {e}"))?)),
            (None, None) if a.wait.is_some() => return Err("--wait needs --expect N or --nodes LIST: what to wait for".into()),
            (None, None) => None,
        };
        let since = match a.since {
            None => None,
            Some(s) => Some(
                SystemTime::UNIX_EPOCH
                    .checked_add(Duration::from_secs(s))
                    .ok_or_else(|| format!("--since {s}: past what this system's clock can hold (seconds since 1970)"))?,
            ),
        };
        let from = Collection::open(a.place.dir.as_deref(), a.place.rendezvous.as_deref(), &a.place.etcd, timeout)?;
        Ok(CheckRequest { from, job: a.job, expect, wait: a.wait, since })
    }

    /// Waits for the expected captures (when asked to), then judges them
    /// together.
    ///
    /// # Errors
    /// As [`check_since`].
    pub fn run(&self) -> Result<FleetReport, String> {
        if let (Some(e), Some(w)) = (&self.expect, self.wait) {
            self.from.wait_for(self.job.as_deref(), e, w);
        }
        check_since(&self.from, self.job.as_deref(), self.expect.as_ref(), self.since)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> CheckArgs {
        let dir = std::env::temp_dir();
        CheckArgs { place: Place { dir: Some(dir), ..Place::default() }, job: None, expect: None, nodes: None, wait: None, since: None, timeout: Duration::from_secs(1) }
    }

    fn refused(a: CheckArgs) -> String {
        match CheckRequest::new(a) {
            Ok(_) => panic!("taken"),
            Err(e) => e,
        }
    }

    /// The rules both front ends once decided apart (the command refused
    /// a wait with nothing to wait for; Python ignored it).
    #[test]
    fn a_check_is_refused_for_the_same_reasons_from_every_front_end() {
        assert!(CheckRequest::new(args()).is_ok());
        assert!(refused(CheckArgs { wait: Some(Duration::from_secs(1)), ..args() }).contains("--wait needs"));
        assert!(refused(CheckArgs { expect: Some(2), nodes: Some("n[1-2]".into()), ..args() }).contains("not both"));
        assert!(refused(CheckArgs { nodes: Some("n[2-1]".into()), ..args() }).starts_with("--nodes:"));
        assert!(refused(CheckArgs { since: Some(u64::MAX), ..args() }).contains("clock"));
        assert!(refused(CheckArgs { timeout: Duration::ZERO, ..args() }).contains("timeout 0"));
        assert!(refused(CheckArgs { expect: Some(0), ..args() }).contains("--expect 0"));
        let two = Place { rendezvous: Some("127.0.0.1:1".into()), ..args().place };
        assert!(CheckRequest::new(CheckArgs { place: two, ..args() }).is_err());
        assert!(CheckRequest::new(CheckArgs { wait: Some(Duration::ZERO), expect: Some(1), ..args() }).is_ok());
    }

    #[test]
    fn a_post_s_lease_is_etcd_s() {
        let a = PostArgs {
            place: Place { dir: Some(std::env::temp_dir()), ..Place::default() },
            job: "j".into(),
            node: None,
            from: None,
            lease: Some(Duration::from_secs(10)),
            timeout: Duration::from_secs(1),
        };
        assert!(PostRequest::new(a.clone()).err().unwrap().contains("applies to --etcd"));
        assert!(PostRequest::new(PostArgs { lease: None, timeout: Duration::ZERO, ..a }).err().unwrap().contains("timeout 0"));
    }
}
