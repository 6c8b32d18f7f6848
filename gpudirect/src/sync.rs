//! The library's one mutex type, public so that crates built over the
//! library (the NCCL plugin) lock the same way and run under the same
//! tools. A leaf module.
//!
//! Why it is not `std::sync::Mutex`:
//! - Poisoning carries no meaning here: every critical section leaves its
//!   data consistent before anything that can panic, so a panic on another
//!   thread must not turn every later post or poll into a panic too. The
//!   default build is parking_lot's mutex, which does not poison: the
//!   standard one checks whether the thread is panicking at every lock and
//!   unlock, about 15 user-space instructions per lock held, and a post
//!   and poll take three of them (the NCCL plugin's send five; measured in
//!   docs/performance.md). Its uncontended lock and unlock are inline.
//! - valgrind's helgrind and drd see only `pthread_*` synchronisation. A
//!   futex mutex, parking_lot's or the standard one, is invisible to them,
//!   so every access it orders would be reported as a race. With the
//!   `valgrind` feature the same type is a `pthread_mutex_t`, which both
//!   tools understand, so the concurrency tests run under them with
//!   suppressions for std's internals only (testbed/sanitize --threads);
//!   the default build does not use it because a pthread mutex is a call
//!   into libc on every post and poll.

use std::ops::{Deref, DerefMut};
use std::panic::{RefUnwindSafe, UnwindSafe};

pub use imp::Mutex;

// As the standard mutex is, whatever it holds: a panic leaves no critical
// section half done (see above), so what a caller's `catch_unwind` sees
// after one is consistent. Without these, every public type holding a
// lock (QueuePair, CompletionQueue, ...) could not be used inside
// `catch_unwind`, in either build.
impl<T> UnwindSafe for Mutex<T> {}
impl<T> RefUnwindSafe for Mutex<T> {}

/// A locked [`Mutex`]: unlocks when dropped.
pub struct Guard<'a, T> {
    inner: imp::Guard<'a, T>,
}

impl<T> Deref for Guard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<T> DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

#[cfg(not(feature = "valgrind"))]
mod imp {
    pub(crate) type Guard<'a, T> = parking_lot::MutexGuard<'a, T>;

    /// A mutex that does not poison (parking_lot's).
    #[derive(Default)]
    pub struct Mutex<T>(parking_lot::Mutex<T>);

    impl<T> std::fmt::Debug for Mutex<T> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Mutex { .. }")
        }
    }

    impl<T> Mutex<T> {
        /// A mutex holding `value`.
        pub fn new(value: T) -> Self {
            Mutex(parking_lot::Mutex::new(value))
        }

        /// Locks it, waiting while another thread holds it; a panic of a
        /// thread that held it does not poison it.
        #[inline]
        pub fn lock(&self) -> super::Guard<'_, T> {
            super::Guard { inner: self.0.lock() }
        }
    }
}

#[cfg(feature = "valgrind")]
mod imp {
    use std::cell::UnsafeCell;
    use std::ops::{Deref, DerefMut};

    /// A `pthread_mutex_t` (boxed: a pthread mutex must not move once used).
    pub struct Mutex<T> {
        raw: Box<UnsafeCell<libc::pthread_mutex_t>>,
        value: UnsafeCell<T>,
    }

    // SAFETY: the mutex hands out access to `value` to one thread at a time.
    unsafe impl<T: Send> Send for Mutex<T> {}
    // SAFETY: as above; `T: Send` suffices, as for std's Mutex.
    unsafe impl<T: Send> Sync for Mutex<T> {}

    impl<T: Default> Default for Mutex<T> {
        fn default() -> Self {
            Mutex::new(T::default())
        }
    }

    impl<T> std::fmt::Debug for Mutex<T> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Mutex { .. }")
        }
    }

    impl<T> Mutex<T> {
        /// A mutex holding `value`.
        pub fn new(value: T) -> Self {
            let raw = Box::new(UnsafeCell::new(libc::PTHREAD_MUTEX_INITIALIZER));
            // SAFETY: initialising a mutex nobody uses yet, at its final
            // address. Done explicitly, though the static initialiser would
            // serve, so drd knows a mutex destroyed without ever being locked.
            unsafe { libc::pthread_mutex_init(raw.get(), std::ptr::null()) };
            Mutex { raw, value: UnsafeCell::new(value) }
        }

        /// Locks it, waiting while another thread holds it.
        pub fn lock(&self) -> super::Guard<'_, T> {
            // SAFETY: an initialised mutex that never moves (boxed).
            let r = unsafe { libc::pthread_mutex_lock(self.raw.get()) };
            debug_assert_eq!(r, 0, "pthread_mutex_lock");
            super::Guard { inner: Guard { m: self } }
        }
    }

    impl<T> Drop for Mutex<T> {
        fn drop(&mut self) {
            // SAFETY: unlocked (no guard can outlive the borrow of `self`).
            unsafe { libc::pthread_mutex_destroy(self.raw.get()) };
        }
    }

    pub(crate) struct Guard<'a, T> {
        m: &'a Mutex<T>,
    }

    impl<T> Deref for Guard<'_, T> {
        type Target = T;
        fn deref(&self) -> &T {
            // SAFETY: the lock is held.
            unsafe { &*self.m.value.get() }
        }
    }

    impl<T> DerefMut for Guard<'_, T> {
        fn deref_mut(&mut self) -> &mut T {
            // SAFETY: the lock is held, and `&mut self` makes this the only view.
            unsafe { &mut *self.m.value.get() }
        }
    }

    impl<T> Drop for Guard<'_, T> {
        fn drop(&mut self) {
            // SAFETY: this guard locked it.
            unsafe { libc::pthread_mutex_unlock(self.m.raw.get()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_while_locked_does_not_poison() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let r = std::thread::spawn(move || {
            let _g = m2.lock();
            panic!("while locked");
        })
        .join();
        assert!(r.is_err());
        *m.lock() += 1;
        assert_eq!(*m.lock(), 2);
    }
}
