//! The accept loop of the library's TCP servers (the transfer engine's
//! control listener and its rendezvous server): each connection served
//! on a thread of its own, a bounded number at once, so a client that
//! connects and stalls holds one slot for its bound, never the clients
//! behind it.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use gpudirect::sync::Mutex;

/// How long the loop sleeps in poll(2) before looking at its stop flag
/// again, when nothing wakes it sooner ([`wake_listener`] does).
const IDLE_LOOK: Duration = Duration::from_millis(500);

/// How often a loop with every slot taken looks for a free one.
const SLOT_LOOK: Duration = Duration::from_millis(5);

/// What a server does with a connection that arrives while every slot is
/// taken and no unproven connection can make room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WhenFull {
    /// Leaves it in the listen backlog until a slot frees.
    Wait,
    /// Closes it unanswered (the client's next try may find room).
    Close,
}

/// A server's name and limits, for [`serve_each`].
pub(crate) struct Server<'a> {
    /// Names its threads and log lines.
    pub(crate) name: &'a str,
    /// Connections served at once.
    pub(crate) max: usize,
    pub(crate) when_full: WhenFull,
}

/// An unproven connection this old or older gives its slot to a
/// newcomer when every slot is taken: a peer that proves itself does so
/// in a few milliseconds, so a flood of new connections cannot push out
/// a handshake in progress, while silent and trickling ones are.
pub(crate) const MIN_AGE: Duration = Duration::from_millis(200);

/// One connection being served.
struct Serving {
    id: u64,
    from: IpAddr,
    since: Instant,
    /// Its handler's peer proved it belongs (the cluster's secret).
    proven: bool,
    /// Closed to make room: its handler's reads fail at once.
    evicted: bool,
    /// A handle on its socket, to close it.
    stream: Option<TcpStream>,
}

#[derive(Default)]
struct Table {
    next: u64,
    serving: Vec<Serving>,
}

impl Table {
    /// Connections that hold a slot (evicted ones are on their way out).
    fn held(&self) -> usize {
        self.serving.iter().filter(|s| !s.evicted).count()
    }

    /// Closes the oldest unproven connection of the address holding the
    /// most unproven ones (at least [`MIN_AGE`] old); whether there was one.
    fn evict(&mut self, now: Instant) -> bool {
        let open = self.serving.iter().enumerate().filter(|(_, s)| !s.proven && !s.evicted && now.duration_since(s.since) >= MIN_AGE);
        let Some(at) = oldest_of_busiest(open.map(|(i, s)| (i, s.from, s.since))) else { return false };
        let victim = &mut self.serving[at];
        victim.evicted = true;
        if let Some(st) = victim.stream.take() {
            let _ = st.shutdown(std::net::Shutdown::Both);
        }
        true
    }
}

/// Of candidates `(index, address, since)`, the index of the oldest of
/// the address with the most: whom a server lets go first, so one
/// address's flood costs that address, not the others.
fn oldest_of_busiest(candidates: impl Iterator<Item = (usize, IpAddr, Instant)> + Clone) -> Option<usize> {
    let mut by_addr: HashMap<IpAddr, usize> = HashMap::new();
    for (_, addr, _) in candidates.clone() {
        *by_addr.entry(addr).or_default() += 1;
    }
    let (&busiest, _) = by_addr.iter().max_by_key(|(_, n)| **n)?;
    candidates.filter(|(_, addr, _)| *addr == busiest).min_by_key(|(_, _, since)| *since).map(|(i, _, _)| i)
}

/// A handler's hold on its connection's slot: given back when dropped
/// (also if serving panicked); [`proven`](Self::proven) once the peer
/// proved it belongs, after which no newcomer can take the slot.
pub(crate) struct Slot<'a> {
    table: &'a Mutex<Table>,
    id: u64,
}

impl Slot<'_> {
    /// The peer proved it holds the cluster's secret.
    pub(crate) fn proven(&self) {
        if let Some(s) = self.table.lock().serving.iter_mut().find(|s| s.id == self.id) {
            s.proven = true;
            s.stream = None;
        }
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.table.lock().serving.retain(|s| s.id != self.id);
    }
}

/// Connections accepted that have sent nothing yet, held without a
/// thread; past this the oldest of the address holding the most is closed.
pub(crate) const MAX_PENDING: usize = 1024;
/// How long an accepted connection may stay silent before it is closed.
pub(crate) const PENDING_TIMEOUT: Duration = Duration::from_secs(5);

/// An accepted connection that has sent nothing yet, and what its greeting
/// gave.
struct Pending<G> {
    stream: TcpStream,
    from: SocketAddr,
    since: Instant,
    /// Taken by the handler's thread.
    greeted: Option<G>,
}

/// Drops the oldest pending connection of the address holding the most.
fn drop_one<G>(pending: &mut Vec<Pending<G>>) {
    if let Some(at) = oldest_of_busiest(pending.iter().enumerate().map(|(i, p)| (i, p.from.ip(), p.since))) {
        pending.swap_remove(at);
    }
}

/// Accepts on `listener` (made non-blocking here) until `stop` is set,
/// sleeping in poll(2) while idle (an idle server costs no CPU). Each
/// connection is greeted (`greet`: what the server says first, if
/// anything) and held, without a thread, until it sends something (at
/// most [`MAX_PENDING`] such, each for [`PENDING_TIMEOUT`]); then `handle`
/// runs on a thread of its own, at most `server.max` at once. With every
/// slot taken, a connection with bytes to read takes the slot of an
/// unproven one at least [`MIN_AGE`] old (the oldest of the address that
/// holds the most), whose socket is closed under its handler; with none,
/// it waits or is closed (`server.when_full`). So silent clients never
/// hold a thread, and trickling ones, from one address or many, cannot
/// keep a peer that proves itself out. Returns once the connections in
/// progress are served; `handle` bounds its own time.
pub(crate) fn serve_each<G, W, F>(listener: &TcpListener, stop: &Mutex<bool>, server: &Server<'_>, greet: W, handle: F)
where
    G: Send,
    W: Fn(&TcpStream) -> io::Result<G>,
    F: Fn(TcpStream, SocketAddr, G, &Slot<'_>) + Sync,
{
    let name = server.name;
    if let Err(e) = listener.set_nonblocking(true) {
        tracing::error!("{name}: {e}; no connections will be served");
        return;
    }
    let table = Mutex::new(Table::default());
    let table = &table;
    let handle = &handle;
    let mut pending: Vec<Pending<G>> = Vec::new();
    std::thread::scope(|scope| {
        // Joined by hand, not only by the scope's end: pthread_join is
        // what helgrind and drd see as the serving thread's writes
        // happening before the owner's teardown (the scope's own wait is
        // an atomic count they do not model).
        let mut running: Vec<std::thread::ScopedJoinHandle<'_, ()>> = Vec::new();
        while !*stop.lock() {
            if running.iter().any(|h| h.is_finished()) {
                let (done, live): (Vec<_>, Vec<_>) = running.drain(..).partition(|h| h.is_finished());
                for h in done {
                    let _ = h.join();
                }
                running = live;
            }
            // Everything waiting in the backlog, greeted and held.
            loop {
                match listener.accept() {
                    Ok((s, from)) => {
                        // The owner's drop wakes us with a connection of its own.
                        if *stop.lock() {
                            break;
                        }
                        let greeted = s.set_nonblocking(true).and_then(|()| greet(&s));
                        match greeted {
                            Ok(greeted) => {
                                if pending.len() >= MAX_PENDING {
                                    drop_one(&mut pending);
                                }
                                pending.push(Pending { stream: s, from, since: Instant::now(), greeted: Some(greeted) });
                            }
                            Err(e) => tracing::debug!(%from, "{name}: greeting: {e}"),
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        tracing::warn!("{name}: accept: {e}");
                        std::thread::sleep(Duration::from_millis(50));
                        break;
                    }
                }
            }
            if *stop.lock() {
                break;
            }
            let now = Instant::now();
            pending.retain(|p| now.duration_since(p.since) < PENDING_TIMEOUT);
            // One wait on the listener and every pending connection.
            let mut fds: Vec<libc::pollfd> = std::iter::once(listener.as_raw_fd())
                .chain(pending.iter().map(|p| p.stream.as_raw_fd()))
                .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })
                .collect();
            let full = table.lock().held() >= server.max;
            let wait = if full && fds.len() > 1 { SLOT_LOOK } else { IDLE_LOOK };
            // SAFETY: `fds` is a valid array of pollfd of its length.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait.as_millis() as i32) };
            if n <= 0 {
                continue;
            }
            // The pending connections that spoke (or closed), oldest first.
            let mut spoke: Vec<usize> = (1..fds.len()).filter(|&i| fds[i].revents != 0).map(|i| i - 1).collect();
            let spoke_any = !spoke.is_empty();
            spoke.sort_by_key(|&i| pending[i].since);
            let mut taken = Vec::new();
            for i in spoke {
                let full = table.lock().held() >= server.max;
                if full && !table.lock().evict(Instant::now()) {
                    if server.when_full == WhenFull::Close {
                        tracing::warn!(from = %pending[i].from, "{name}: {} connections in progress, none of them unproven for {MIN_AGE:?}; connection closed", server.max);
                        taken.push(i);
                    }
                    continue;
                }
                taken.push(i);
                let p = &pending[i];
                if p.stream.set_nonblocking(false).is_err() {
                    continue;
                }
                let Ok(s) = p.stream.try_clone() else { continue };
                let from = p.from;
                let slot = {
                    let mut t = table.lock();
                    t.next += 1;
                    let id = t.next;
                    t.serving.push(Serving { id, from: from.ip(), since: Instant::now(), proven: false, evicted: false, stream: s.try_clone().ok() });
                    Slot { table, id }
                };
                let Some(greeted) = pending[i].greeted.take() else { continue };
                let spawned = std::thread::Builder::new().name(format!("{name}-req")).spawn_scoped(scope, move || {
                    handle(s, from, greeted, &slot);
                });
                // Not spawned: the closure, its stream and its slot are dropped.
                match spawned {
                    Ok(h) => running.push(h),
                    Err(e) => tracing::warn!(%from, "{name}: cannot start a thread: {e}; connection closed"),
                }
            }
            // Waiting for a slot: the connections that spoke stay readable,
            // so poll would return at once; look again a little later.
            if taken.is_empty() && spoke_any {
                std::thread::sleep(SLOT_LOOK);
            }
            taken.sort_unstable();
            for i in taken.into_iter().rev() {
                pending.swap_remove(i);
            }
        }
        for h in running {
            let _ = h.join();
        }
    });
}

pub(crate) use gpudirect::bootstrap::wake_listener;

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// A server that echoes the second byte of each connection; `prove`:
    /// its handler marks the peer proven once the first byte is in (a
    /// connection past its proof keeps its slot). `entered` counts the
    /// handlers started (a silent client never gets one).
    struct Echo {
        addr: SocketAddr,
        entered: Arc<AtomicUsize>,
        stop: Arc<Mutex<bool>>,
        thread: std::thread::JoinHandle<usize>,
    }

    impl Echo {
        fn start(max: usize, when_full: WhenFull, prove: bool) -> Echo {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let (entered, stop) = (Arc::new(AtomicUsize::new(0)), Arc::new(Mutex::new(false)));
            let thread = {
                let (entered, stop) = (entered.clone(), stop.clone());
                std::thread::spawn(move || {
                    let served = AtomicUsize::new(0);
                    serve_each(&listener, &stop, &Server { name: "test-server", max, when_full }, |_| Ok(()), |mut s, _, (), slot| {
                        entered.fetch_add(1, Ordering::SeqCst);
                        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                        let mut b = [0u8; 2];
                        if s.read_exact(&mut b[..1]).is_err() {
                            return;
                        }
                        if prove {
                            slot.proven();
                        }
                        if s.read_exact(&mut b[1..]).is_ok() && s.write_all(&b[1..]).is_ok() {
                            served.fetch_add(1, Ordering::SeqCst);
                        }
                    });
                    served.into_inner()
                })
            };
            Echo { addr, entered, stop, thread }
        }

        /// Until `n` handlers have started.
        fn entered(&self, n: usize) {
            let t = Instant::now();
            while self.entered.load(Ordering::SeqCst) < n {
                assert!(t.elapsed() < Duration::from_secs(10), "{} of {n} connections taken", self.entered.load(Ordering::SeqCst));
                std::thread::sleep(Duration::from_millis(2));
            }
        }

        /// Stops it (after the connections in progress) and gives how
        /// many were answered.
        fn stop(self) -> usize {
            *self.stop.lock() = true;
            super::wake_listener(self.addr);
            self.thread.join().unwrap()
        }
    }

    fn ask(addr: SocketAddr, byte: u8) -> std::io::Result<u8> {
        let mut s = TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        s.write_all(&[0, byte])?;
        let mut b = [0u8; 1];
        s.read_exact(&mut b)?;
        Ok(b[0])
    }

    /// A client that sends its first byte and stalls.
    fn trickler(addr: SocketAddr) -> TcpStream {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&[0]).unwrap();
        s
    }

    /// Silent clients (hundreds, from one address) are held without a
    /// thread: a client behind them is answered at once, and only it
    /// ever got a handler.
    #[test]
    fn silent_clients_hold_no_thread_and_a_client_behind_them_is_answered_at_once() {
        for when_full in [WhenFull::Wait, WhenFull::Close] {
            let echo = Echo::start(3, when_full, false);
            let silent: Vec<TcpStream> = (0..300).map(|_| TcpStream::connect(echo.addr).unwrap()).collect();
            std::thread::sleep(Duration::from_millis(100));
            let at = Instant::now();
            assert_eq!(ask(echo.addr, 7).unwrap(), 7);
            assert!(at.elapsed() < Duration::from_secs(2), "{when_full:?}: waited {:?} behind silent clients", at.elapsed());
            assert_eq!(echo.entered.load(Ordering::SeqCst), 1, "a silent client got a thread");
            drop(silent);
            assert_eq!(echo.stop(), 1);
        }
    }

    /// Clients that spoke but never proved themselves give their slots to
    /// a newcomer once they are MIN_AGE old, whichever the mode.
    #[test]
    fn unproven_clients_give_their_slots_to_a_newcomer() {
        for when_full in [WhenFull::Wait, WhenFull::Close] {
            let echo = Echo::start(3, when_full, false);
            let slow: Vec<TcpStream> = (0..3).map(|_| trickler(echo.addr)).collect();
            echo.entered(3);
            std::thread::sleep(MIN_AGE * 2);
            let at = Instant::now();
            assert_eq!(ask(echo.addr, 8).unwrap(), 8);
            assert!(at.elapsed() < Duration::from_secs(2), "{when_full:?}: waited {:?} behind unproven clients", at.elapsed());
            drop(slow);
            assert_eq!(echo.stop(), 1);
        }
    }

    /// With every slot held by proven peers, a new client waits in the
    /// backlog until one frees (Wait), or is closed unanswered (Close).
    #[test]
    fn past_the_limit_proven_peers_keep_their_slots() {
        for when_full in [WhenFull::Wait, WhenFull::Close] {
            let echo = Echo::start(3, when_full, true);
            let mut slow: Vec<TcpStream> = (0..3).map(|_| trickler(echo.addr)).collect();
            echo.entered(3);
            std::thread::sleep(MIN_AGE * 2);
            match when_full {
                WhenFull::Close => assert!(ask(echo.addr, 8).is_err(), "a connection past the limit is closed"),
                WhenFull::Wait => {
                    let addr = echo.addr;
                    let waiter = std::thread::spawn(move || ask(addr, 9));
                    std::thread::sleep(Duration::from_millis(300));
                    assert!(!waiter.is_finished(), "served while every slot was held");
                    assert_eq!(echo.entered.load(Ordering::SeqCst), 3);
                    slow.pop();
                    assert_eq!(waiter.join().unwrap().unwrap(), 9, "the waiting client is served once a slot frees");
                }
            }
            drop(slow);
            assert_eq!(echo.stop(), usize::from(when_full == WhenFull::Wait));
        }
    }
}
