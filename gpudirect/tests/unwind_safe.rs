//! The public types that hold the library's locks stay usable inside
//! `catch_unwind`, as they were when those locks were the standard
//! mutex (which is `UnwindSafe` and `RefUnwindSafe` whatever it holds).
//! A compile-time check: the test does not build if one is lost. No
//! device needed.

use std::panic::{RefUnwindSafe, UnwindSafe};

fn unwind_safe<T: UnwindSafe + RefUnwindSafe>() {}

#[test]
fn types_holding_the_library_locks_stay_unwind_safe() {
    unwind_safe::<gpudirect::QueuePair>();
    unwind_safe::<gpudirect::PreparedQueuePair>();
    unwind_safe::<gpudirect::CompletionQueue>();
    unwind_safe::<gpudirect::ProtectionDomain>();
    unwind_safe::<gpudirect::SharedReceiveQueue>();
    unwind_safe::<gpudirect::Context>();
    unwind_safe::<gpudirect::sync::Mutex<u32>>();
    unwind_safe::<gpudirect::sync::Mutex<std::cell::Cell<u32>>>();
}
