//! The accept loop of the library's TCP servers (the transfer engine's
//! control listener and its rendezvous server): each connection served
//! on a thread of its own, a bounded number at once, so a client that
//! connects and stalls holds one slot for its bound, never the clients
//! behind it.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::Duration;

use crate::deadline::Deadline;
use crate::sync::Mutex;

/// How long the loop sleeps in poll(2) before looking at its stop flag
/// again, when nothing wakes it sooner ([`super::wake_listener`] does).
const IDLE_LOOK: Duration = Duration::from_millis(500);

/// How often a loop with every slot taken looks for a free one.
const SLOT_LOOK: Duration = Duration::from_millis(5);

/// What a server does with a connection that arrives while every slot is
/// taken.
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

/// Gives back a slot, also if serving panicked.
struct Slot<'a>(&'a Mutex<usize>);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        *self.0.lock() -= 1;
    }
}

/// Accepts on `listener` (made non-blocking here) until `stop` is set,
/// sleeping in poll(2) while idle (an idle server costs no CPU), and runs
/// `handle` on each connection on a thread of its own, at most
/// `server.max` at once. Returns once the connections in progress are
/// served; `handle` bounds its own time.
pub(crate) fn serve_each<F>(listener: &TcpListener, stop: &Mutex<bool>, server: &Server<'_>, handle: F)
where
    F: Fn(TcpStream, SocketAddr) + Sync,
{
    let name = server.name;
    if let Err(e) = listener.set_nonblocking(true) {
        tracing::error!("{name}: {e}; no connections will be served");
        return;
    }
    let serving = Mutex::new(0usize);
    let handle = &handle;
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
            let full = *serving.lock() >= server.max;
            if full && server.when_full == WhenFull::Wait {
                std::thread::sleep(SLOT_LOOK);
                continue;
            }
            match listener.accept() {
                Ok((s, from)) => {
                    // The owner's drop wakes us with a connection of its own.
                    if *stop.lock() {
                        break;
                    }
                    if full {
                        tracing::warn!(%from, "{name}: {} connections in progress; connection closed", server.max);
                        continue;
                    }
                    *serving.lock() += 1;
                    let slot = Slot(&serving);
                    let spawned = std::thread::Builder::new().name(format!("{name}-req")).spawn_scoped(scope, move || {
                        let _slot = slot;
                        handle(s, from);
                    });
                    // Not spawned: the closure, its stream and its slot are dropped.
                    match spawned {
                        Ok(h) => running.push(h),
                        Err(e) => tracing::warn!(%from, "{name}: cannot start a thread: {e}; connection closed"),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if let Err(errno) = Deadline::after(IDLE_LOOK).wait_readable(listener.as_raw_fd()) {
                        tracing::warn!("{name}: poll: {errno}");
                        std::thread::sleep(IDLE_LOOK);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::warn!("{name}: accept: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        for h in running {
            let _ = h.join();
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Instant;

    /// An echo server of one byte per connection; `entered` counts the
    /// connections whose handler has started (so a test knows a silent
    /// client holds a slot), the join gives how many were answered.
    struct Echo {
        addr: SocketAddr,
        entered: Arc<AtomicUsize>,
        stop: Arc<Mutex<bool>>,
        thread: std::thread::JoinHandle<usize>,
    }

    impl Echo {
        fn start(max: usize, when_full: WhenFull) -> Echo {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let (entered, stop) = (Arc::new(AtomicUsize::new(0)), Arc::new(Mutex::new(false)));
            let thread = {
                let (entered, stop) = (entered.clone(), stop.clone());
                std::thread::spawn(move || {
                    let served = AtomicUsize::new(0);
                    serve_each(&listener, &stop, &Server { name: "test-server", max, when_full }, |mut s, _| {
                        entered.fetch_add(1, Ordering::SeqCst);
                        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                        let mut b = [0u8; 1];
                        if s.read_exact(&mut b).is_ok() && s.write_all(&b).is_ok() {
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
            super::super::wake_listener(self.addr);
            self.thread.join().unwrap()
        }
    }

    fn ask(addr: SocketAddr, byte: u8) -> std::io::Result<u8> {
        let mut s = TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        s.write_all(&[byte])?;
        let mut b = [0u8; 1];
        s.read_exact(&mut b)?;
        Ok(b[0])
    }

    /// Silent clients hold their slots, not the server: a client behind
    /// them is answered at once.
    #[test]
    fn a_client_behind_silent_ones_is_answered_at_once() {
        for when_full in [WhenFull::Wait, WhenFull::Close] {
            let echo = Echo::start(3, when_full);
            let silent: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(echo.addr).unwrap()).collect();
            echo.entered(2);
            let at = Instant::now();
            assert_eq!(ask(echo.addr, 7).unwrap(), 7);
            assert!(at.elapsed() < Duration::from_secs(5), "{when_full:?}: waited {:?} behind silent clients", at.elapsed());
            drop(silent);
            assert_eq!(echo.stop(), 1);
        }
    }

    /// With every slot held, a new client waits in the backlog until one
    /// frees (Wait), or is closed unanswered (Close).
    #[test]
    fn past_the_limit_a_client_waits_or_is_closed() {
        for when_full in [WhenFull::Wait, WhenFull::Close] {
            let echo = Echo::start(3, when_full);
            let mut silent: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(echo.addr).unwrap()).collect();
            echo.entered(3);
            match when_full {
                WhenFull::Close => assert!(ask(echo.addr, 8).is_err(), "a connection past the limit is closed"),
                WhenFull::Wait => {
                    let addr = echo.addr;
                    let waiter = std::thread::spawn(move || ask(addr, 9));
                    std::thread::sleep(Duration::from_millis(300));
                    assert!(!waiter.is_finished(), "served while every slot was held");
                    assert_eq!(echo.entered.load(Ordering::SeqCst), 3);
                    silent.pop();
                    assert_eq!(waiter.join().unwrap().unwrap(), 9, "the waiting client is served once a slot frees");
                }
            }
            drop(silent);
            assert_eq!(echo.stop(), usize::from(when_full == WhenFull::Wait));
        }
    }
}
