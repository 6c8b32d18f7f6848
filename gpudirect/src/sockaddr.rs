//! `SocketAddr` as the C library's `sockaddr_storage` and back: for the
//! calls that take one (rdma_cm's bind, resolve and connect; a
//! non-blocking connect(2) the standard library does not offer). Plain
//! data, a leaf: one builder for every such call in the workspace.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

/// `addr` as a `sockaddr_storage`, and the length of the `sockaddr_in` or
/// `sockaddr_in6` it holds (what `connect(2)` and `bind(2)` take).
pub fn to_storage(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all zeroes is a valid value.
    let mut out: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
                sin_zero: [0; 8],
            };
            // SAFETY: a sockaddr_in fits in (and is laid out for) sockaddr_storage.
            unsafe { std::ptr::write_unaligned((&mut out as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo().to_be(),
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write_unaligned((&mut out as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (out, len as libc::socklen_t)
}

/// A `sockaddr_storage` as a `SocketAddr`; `None` for families other than
/// IPv4 and IPv6.
pub fn from_storage(s: &libc::sockaddr_storage) -> Option<SocketAddr> {
    let p = (s as *const libc::sockaddr_storage).cast::<u8>();
    match i32::from(s.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says it holds a sockaddr_in.
            let sin = unsafe { std::ptr::read_unaligned(p.cast::<libc::sockaddr_in>()) };
            let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
            Some(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(sin.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, sockaddr_in6.
            let sin6 = unsafe { std::ptr::read_unaligned(p.cast::<libc::sockaddr_in6>()) };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::V6(SocketAddrV6::new(ip, u16::from_be(sin6.sin6_port), u32::from_be(sin6.sin6_flowinfo), sin6.sin6_scope_id)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_go_there_and_back() {
        for a in ["10.1.2.3:4791", "[fe80::1%3]:18515", "[::1]:0", "0.0.0.0:65535"] {
            let addr: SocketAddr = a.parse().unwrap();
            let (s, len) = to_storage(addr);
            let want = if addr.is_ipv4() { std::mem::size_of::<libc::sockaddr_in>() } else { std::mem::size_of::<libc::sockaddr_in6>() };
            assert_eq!(len as usize, want);
            assert_eq!(from_storage(&s), Some(addr), "{a}");
        }
        // SAFETY: all zeroes is a valid sockaddr_storage (family 0).
        assert_eq!(from_storage(&unsafe { std::mem::zeroed() }), None);
    }
}
