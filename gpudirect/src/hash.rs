//! A hasher for numbers this library and the crates over it hand out
//! themselves: queue pair numbers, tracker tags, post ids. A leaf module.
//!
//! The standard hasher (SipHash) resists keys chosen to collide, which
//! costs about 60 instructions per lookup; on the completion path that
//! was paid per completion. None of these keys comes from a peer, so
//! there is nothing to resist, and one multiply is enough.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Fibonacci hashing of integer keys: the key times 2^64 / phi, so the
/// high bits, which the table's probing reads first, depend on every bit
/// of the key (consecutive counters and numbers differing only in their
/// high bits both spread). Not for keys a peer or an input chooses.
#[derive(Clone, Copy, Debug, Default)]
pub struct NumberHasher(u64);

impl Hasher for NumberHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// A map keyed by such numbers.
pub type NumberMap<K, V> = HashMap<K, V, BuildHasherDefault<NumberHasher>>;
