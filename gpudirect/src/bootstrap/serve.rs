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
        while !*stop.lock() {
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
                    if let Err(e) = spawned {
                        tracing::warn!(%from, "{name}: cannot start a thread: {e}; connection closed");
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
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    fn echo_server(max: usize, when_full: WhenFull) -> (SocketAddr, std::thread::JoinHandle<usize>, std::sync::Arc<Mutex<bool>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = std::sync::Arc::new(Mutex::new(false));
        let t = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let served = AtomicUsize::new(0);
                serve_each(&listener, &stop, &Server { name: "test-server", max, when_full }, |mut s, _| {
                    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                    let mut b = [0u8; 1];
                    if s.read_exact(&mut b).is_ok() {
                        let _ = s.write_all(&b);
                        served.fetch_add(1, Ordering::Relaxed);
                    }
                });
                served.into_inner()
            })
        };
        (addr, t, stop)
    }

    fn ask(addr: SocketAddr, byte: u8) -> std::io::Result<u8> {
        let mut s = TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        s.write_all(&[byte])?;
        let mut b = [0u8; 1];
        s.read_exact(&mut b)?;
        Ok(b[0])
    }

    /// Silent clients hold their slots, not the server: a client behind
    /// them is answered at once; past the limit one waits (Wait) for a
    /// slot, or is closed (Close). Stopping waits for the connections in
    /// progress.
    #[test]
    fn silent_clients_hold_a_slot_each_and_nobody_else() {
        for when_full in [WhenFull::Wait, WhenFull::Close] {
            let (addr, t, stop) = echo_server(3, when_full);
            let silent: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
            std::thread::sleep(Duration::from_millis(100));
            let at = Instant::now();
            assert_eq!(ask(addr, 7).unwrap(), 7);
            assert!(at.elapsed() < Duration::from_secs(2), "{when_full:?}: waited {:?} behind silent clients", at.elapsed());
            let third = TcpStream::connect(addr).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            // Every slot taken now.
            match when_full {
                WhenFull::Close => assert!(ask(addr, 8).is_err(), "a connection past the limit is closed"),
                WhenFull::Wait => {
                    let waiter = std::thread::spawn(move || ask(addr, 9));
                    std::thread::sleep(Duration::from_millis(200));
                    drop(third);
                    assert_eq!(waiter.join().unwrap().unwrap(), 9, "the waiting client is served once a slot frees");
                    drop(silent);
                    *stop.lock() = true;
                    super::super::wake_listener(addr);
                    assert_eq!(t.join().unwrap(), 2);
                    continue;
                }
            }
            drop((silent, third));
            *stop.lock() = true;
            super::super::wake_listener(addr);
            assert_eq!(t.join().unwrap(), 1);
        }
    }
}
