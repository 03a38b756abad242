//! Free TCP ports for the servers a test starts as processes.
//!
//! A port the kernel hands out for `bind(0)` lies in its ephemeral range, the range every
//! outgoing connection on the machine also draws its local port from: between our pick and
//! the server's own bind, any client (the previous test's components still talking, a
//! package download) can take it, and etcd dies with "address already in use". So a port is
//! picked below that range, where only a server that asks for that very number can hold it,
//! and checked free by binding it; within one process each pick is a new number, from an
//! offset that differs between processes.

use std::net::{Ipv4Addr, TcpListener};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::bail;

/// The lowest port picked: above the ports Kubernetes components take by default (10248 to
/// 10259) and the registered services most machines run.
const LOWEST: u16 = 20_000;
/// Where the kernel's ephemeral range starts when `/proc` does not say (Linux's default).
const EPHEMERAL_DEFAULT: u16 = 32_768;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A TCP port no one listens on and no outgoing connection can take, for a server to bind
/// on any address.
///
/// # Errors
/// When every port below the ephemeral range is in use.
pub fn free_port() -> anyhow::Result<u16> {
    let end = ephemeral_start();
    if end <= LOWEST {
        // No room below the ephemeral range: the kernel's pick is all there is.
        return Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port());
    }
    let span = u32::from(end - LOWEST);
    let base = offset();
    for _ in 0..span {
        let n = (base.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed))) % span;
        let port = LOWEST + u16::try_from(n).unwrap_or(0);
        if TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).is_ok()
            && TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
        {
            return Ok(port);
        }
    }
    bail!("every TCP port from {LOWEST} to {} is in use; stop what listens there and retry", end - 1)
}

/// The first port of the kernel's ephemeral range (`net.ipv4.ip_local_port_range`).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(EPHEMERAL_DEFAULT)
}

/// This process's starting point in the range: two test binaries run one after the other
/// while the first one's servers may still be going away.
fn offset() -> u32 {
    static OFFSET: OnceLock<u32> = OnceLock::new();
    *OFFSET.get_or_init(|| {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        std::process::id().wrapping_mul(2_654_435_761).wrapping_add(nanos)
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// The tests share the process's sequence: one at a time, or one's pick is the other's held port.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

    #[test]
    fn ports_are_distinct_free_and_below_the_ephemeral_range() {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let ports: Vec<u16> = (0..64).map(|_| free_port().unwrap()).collect();
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "{ports:?}");
        let end = ephemeral_start();
        for port in ports {
            assert!((LOWEST..end).contains(&port), "{port} outside {LOWEST}..{end}");
            TcpListener::bind((Ipv4Addr::LOCALHOST, port)).unwrap();
        }
    }

    #[test]
    fn the_ports_next_in_line_are_skipped_while_someone_listens_on_them() {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let span = u32::from(ephemeral_start() - LOWEST);
        let next =
            |k: u32| LOWEST + u16::try_from((offset().wrapping_add(NEXT.load(Ordering::Relaxed) + k)) % span).unwrap();
        let listeners: Vec<TcpListener> =
            (0..8).filter_map(|k| TcpListener::bind((Ipv4Addr::UNSPECIFIED, next(k))).ok()).collect();
        let held: Vec<u16> = listeners.iter().map(|l| l.local_addr().unwrap().port()).collect();
        assert!(!held.is_empty());
        let port = free_port().unwrap();
        assert!(!held.contains(&port), "{port} is held: {held:?}");
    }
}
