//! Decoding a peer's bytes: the bounds-checked [`Reader`] every decoder
//! of untrusted input uses (the bootstrap, the engine's metadata and
//! control messages), and the [`Truncated`] error it reports. A leaf:
//! imports nothing from the crate.

/// A field ran past the end of the bytes a peer sent: what each decoder's
/// own error type (bootstrap, engine metadata) reports as truncation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Truncated {
    /// The field being read.
    pub field: &'static str,
    /// Bytes it needed.
    pub need: usize,
    /// Bytes that were left.
    pub have: usize,
}

/// Reads big-endian fields off untrusted bytes, every length checked
/// before anything is taken or allocated.
pub struct Reader<'a>(
    /// The bytes not read yet.
    pub &'a [u8],
);

impl<'a> Reader<'a> {
    /// Fails unless at least `n` bytes are left for `field`.
    pub fn need(&self, field: &'static str, n: usize) -> Result<(), Truncated> {
        if self.0.len() < n {
            return Err(Truncated { field, need: n, have: self.0.len() });
        }
        Ok(())
    }
    /// Takes the next `n` bytes for `field`.
    pub fn take(&mut self, field: &'static str, n: usize) -> Result<&'a [u8], Truncated> {
        self.need(field, n)?;
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    /// Takes the next `N` bytes for `field` as an array.
    pub fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], Truncated> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(field, N)?);
        Ok(a)
    }
    /// A byte.
    pub fn u8(&mut self, f: &'static str) -> Result<u8, Truncated> {
        Ok(self.array::<1>(f)?[0])
    }
    /// A big-endian `u16`.
    pub fn u16(&mut self, f: &'static str) -> Result<u16, Truncated> {
        Ok(u16::from_be_bytes(self.array(f)?))
    }
    /// A big-endian `u32`.
    pub fn u32(&mut self, f: &'static str) -> Result<u32, Truncated> {
        Ok(u32::from_be_bytes(self.array(f)?))
    }
    /// A big-endian `u64`.
    pub fn u64(&mut self, f: &'static str) -> Result<u64, Truncated> {
        Ok(u64::from_be_bytes(self.array(f)?))
    }
    /// Bytes after the last field read.
    pub fn rest(&self) -> usize {
        self.0.len()
    }
}
