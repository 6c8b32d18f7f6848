//! Two threads on one pair of comms, as NCCL runs the plugin: its proxy
//! thread moving messages (irecv, isend, test) while the main thread
//! registers and deregisters other memory on the same comms. Run under
//! helgrind and drd by `testbed/sanitize --threads`, against a plugin
//! built with its `valgrind` feature (its locks pthread mutexes the tools
//! see); every byte received is checked.

use std::ffi::c_int;
use std::time::Duration;


use crate::hostile::pair;
use crate::phases::within;
use crate::plugin::Plugin;

const W: Duration = Duration::from_secs(300);
const SIZE: usize = 4096;

/// A value the harness moves between its threads: NCCL's opaque pointers
/// and the plugin's table, which the plugin's contract lets NCCL's
/// threads use at once.
#[derive(Clone, Copy)]
struct Shared<T>(T);
// SAFETY: the plugin's entry points are called from several threads by
// NCCL itself (its contract: thread-safe per comm); the pointers are only
// passed back to it.
unsafe impl<T> Send for Shared<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Shared<T> {}

impl<T> Shared<T> {
    /// The value (a method, so that a closure captures the whole wrapper).
    fn get(self) -> T {
        self.0
    }
}

/// A flag behind a pthread mutex: helgrind and drd see no ordering in
/// atomics or std's futex locks, and would report the harness's own
/// bookkeeping as a race.
struct Flag {
    raw: Box<std::cell::UnsafeCell<libc::pthread_mutex_t>>,
    value: std::cell::UnsafeCell<bool>,
}

// SAFETY: `value` is only read or written with the mutex held.
unsafe impl Sync for Flag {}

impl Flag {
    fn new() -> Flag {
        Flag { raw: Box::new(std::cell::UnsafeCell::new(libc::PTHREAD_MUTEX_INITIALIZER)), value: std::cell::UnsafeCell::new(false) }
    }

    fn with<R>(&self, f: impl FnOnce(&mut bool) -> R) -> R {
        // SAFETY: a mutex that never moves (boxed), locked and unlocked
        // around the only access to `value`.
        unsafe {
            libc::pthread_mutex_lock(self.raw.get());
            let r = f(&mut *self.value.get());
            libc::pthread_mutex_unlock(self.raw.get());
            r
        }
    }

    fn set(&self) {
        self.with(|v| *v = true);
    }

    fn get(&self) -> bool {
        self.with(|v| *v)
    }
}

fn byte(k: usize, i: usize) -> u8 {
    (k.wrapping_mul(31) ^ i.wrapping_mul(7)) as u8
}

/// `iters` messages on the proxy thread, registrations on this one.
pub fn run(p: &Plugin, iters: usize) -> Result<(), String> {
    let (mut h, l) = p.listen(0)?;
    let (s, r) = pair(p, &mut h, l)?;
    p.close_listen(l)?;
    let mut src = vec![0u8; SIZE];
    let mut dst = vec![0u8; SIZE];
    let (ms, mr) = (p.reg(s, &mut src)?, p.reg(r, &mut dst)?);
    let (srcp, dstp) = (Shared(src.as_mut_ptr()), Shared(dst.as_mut_ptr()));
    let (sp, rp, msp, mrp, pp) = (Shared(s), Shared(r), Shared(ms), Shared(mr), Shared(p));
    let done = Flag::new();
    let mut regs = 0usize;
    std::thread::scope(|sc| -> Result<(), String> {
        let done = &done;
        let proxy = sc.spawn(move || -> Result<(), String> {
            let (p, s, r, ms, mr) = (pp.get(), sp.get(), rp.get(), msp.get(), mrp.get());
            let (srcp, dstp) = (srcp.get(), dstp.get());
            let result = (|| {
                for k in 0..iters {
                    // SAFETY: the buffers outlive the scope; only this thread
                    // touches them while messages move.
                    let (src, dst) = unsafe { (std::slice::from_raw_parts_mut(srcp, SIZE), std::slice::from_raw_parts_mut(dstp, SIZE)) };
                    for (i, b) in src.iter_mut().enumerate() {
                        *b = byte(k, i);
                    }
                    let rr = within(W, "irecv got no request", || p.irecv(r, &mut [(dst.as_mut_ptr(), SIZE, k as c_int, mr)]))?;
                    let sr = within(W, "isend found no receive", || p.isend(s, src.as_mut_ptr(), SIZE, k as c_int, ms))?;
                    p.wait(sr, W)?;
                    let got = p.wait(rr, W)?;
                    if got[0] as usize != SIZE || dst.iter().enumerate().any(|(i, b)| *b != byte(k, i)) {
                        return Err(format!("message {k}: {} bytes, or a byte not as sent", got[0]));
                    }
                }
                Ok(())
            })();
            done.set();
            result
        });
        // The main thread: registrations on both comms meanwhile.
        let mut other = vec![0u8; 1 << 16];
        while !done.get() {
            for c in [s, r] {
                let m = p.reg(c, &mut other)?;
                p.dereg(c, m)?;
                regs += 1;
            }
        }
        proxy.join().map_err(|_| "the proxy thread panicked".to_string())?
    })?;
    p.dereg(s, ms)?;
    p.dereg(r, mr)?;
    p.close_send(s)?;
    p.close_recv(r)?;
    println!("threads: {iters} messages of {SIZE} bytes on the proxy thread, every byte checked; {regs} registrations made and dropped on the main thread meanwhile");
    Ok(())
}
