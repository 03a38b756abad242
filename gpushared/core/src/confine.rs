//! A unit's network confinement, as systemd writes it (`IPAddressDeny=any` and
//! `IPAddressAllow=`), for both binaries' `[kubernetes] confine_network`: the API server a
//! kubeconfig's server URL names, the callers an operator lists, and the drop-in that allows
//! those and no other address. Reading the kubeconfig is the binaries'; what it may say, and
//! what the drop-in then says, is decided here.

use std::fmt;
use std::net::IpAddr;

use thiserror::Error;

/// One `IPAddressAllow=` entry: an address, a network, or systemd's `localhost` (127.0.0.0/8
/// and `::1`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Allowed {
    /// An IPv4 or IPv6 address.
    Address(IpAddr),
    /// An address with a prefix length (`10.0.0.0/24`).
    Network(IpAddr, u8),
    /// The loopback addresses.
    Localhost,
}

impl fmt::Display for Allowed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Allowed::Address(a) => write!(f, "{a}"),
            Allowed::Network(a, prefix) => write!(f, "{a}/{prefix}"),
            Allowed::Localhost => f.write_str("localhost"),
        }
    }
}

/// An entry an operator wrote that systemd's `IPAddressAllow=` cannot take as meant.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{entry:?} {why}; write an address (10.0.0.5, fd00::5), a network (10.0.0.0/24) or \"localhost\"")]
pub struct EntryError {
    /// The entry as written.
    pub entry: String,
    /// What is wrong with it.
    pub why: &'static str,
}

impl Allowed {
    /// Reads an entry of a configured caller list: an address, `ADDRESS/PREFIX` or `localhost`.
    /// systemd's other names (`any`, `link-local`, `multicast`) are refused: each allows far
    /// more than one caller.
    ///
    /// # Errors
    /// [`EntryError`] saying what is wrong.
    pub fn parse_entry(entry: &str) -> Result<Allowed, EntryError> {
        let fail = |why| EntryError { entry: entry.to_owned(), why };
        if entry.eq_ignore_ascii_case("localhost") {
            return Ok(Allowed::Localhost);
        }
        if ["any", "link-local", "multicast"].iter().any(|n| entry.eq_ignore_ascii_case(n)) {
            return Err(fail("allows far more than the callers meant"));
        }
        let Some((address, prefix)) = entry.split_once('/') else {
            return entry.parse().map(Allowed::Address).map_err(|_| fail("is not an address"));
        };
        let address: IpAddr = address.parse().map_err(|_| fail("is not an address with a prefix length"))?;
        let longest = if address.is_ipv4() { 32 } else { 128 };
        let prefix = prefix.parse::<u8>().ok().filter(|p| (1..=longest).contains(p)).ok_or_else(|| {
            fail(if address.is_ipv4() {
                "needs a prefix length from 1 to 32"
            } else {
                "needs a prefix length from 1 to 128"
            })
        })?;
        Ok(Allowed::Network(address, prefix))
    }
}

/// Why a kubeconfig's server cannot be allowed by address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum ServerError {
    /// Not a URL with a host.
    #[error("which is not a URL with a host")]
    NoHost,
    /// A host name, which systemd cannot allow.
    #[error("which is named by host name")]
    HostName,
    /// Reached through a proxy, whose address is what the unit would connect to.
    #[error("through the proxy its proxy-url names")]
    Proxied,
}

/// A confinement that cannot be made from a unit's kubeconfig, with what to do. `by_hand` names
/// the section of docs/install.md that confines the unit by hand.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ConfineError {
    /// The kubeconfig cannot be read or resolved to a server.
    #[error("[kubernetes] confine_network: cannot read the kubeconfig {path}: {reason}")]
    Kubeconfig {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The kubeconfig does not say which server it uses.
    #[error("[kubernetes] confine_network: the kubeconfig {path} names no server for its current context")]
    NoServer {
        /// The file.
        path: String,
    },
    /// The server is not one systemd's `IPAddressAllow=` can name.
    #[error(
        "[kubernetes] confine_network: the kubeconfig {path} reaches the API server {server}, {why}; \
         systemd's IPAddressAllow= takes addresses only. Name the server by its address in the kubeconfig, \
         or set confine_network = false and confine the unit by hand (docs/install.md, {by_hand})"
    )]
    NotAnAddress {
        /// The file.
        path: String,
        /// The server as the client reads it.
        server: String,
        /// Why it cannot be allowed.
        why: ServerError,
        /// The section of docs/install.md that confines the unit by hand.
        by_hand: &'static str,
    },
}

/// The `IPAddressAllow=` entry for an API server URL (`https://HOST[:PORT][/PATH]`, as a
/// kubeconfig's `server`); `proxied` when the cluster names a `proxy-url`.
///
/// # Errors
/// [`ServerError`] when the server is not reached at an address written in the URL.
pub fn api_server(server: &str, proxied: bool) -> Result<Allowed, ServerError> {
    if proxied {
        return Err(ServerError::Proxied);
    }
    let host = host_of(server).ok_or(ServerError::NoHost)?;
    if host.eq_ignore_ascii_case("localhost") {
        return Ok(Allowed::Localhost);
    }
    let ip = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    ip.parse().map(Allowed::Address).map_err(|_| ServerError::HostName)
}

/// The host of a URL's authority (`SCHEME://[USERINFO@]HOST[:PORT]`, or the authority alone):
/// an IPv6 address keeps its brackets; `None` when there is no host.
fn host_of(url: &str) -> Option<&str> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let host = if host_port.starts_with('[') {
        &host_port[..=host_port.find(']')?]
    } else {
        host_port.split(':').next().unwrap_or_default()
    };
    (!host.is_empty()).then_some(host)
}

/// The drop-in that allows `allowed` and no other address, headed by `why` (comment lines,
/// each written with its `# `). Entries are written once each, in the order given.
#[must_use]
pub fn drop_in(why: &[&str], allowed: &[Allowed]) -> String {
    let mut text = String::new();
    for line in why {
        text.push_str("# ");
        text.push_str(line);
        text.push('\n');
    }
    let mut seen: Vec<String> = Vec::new();
    for entry in allowed {
        let entry = entry.to_string();
        if !seen.contains(&entry) {
            seen.push(entry);
        }
    }
    text.push_str("[Service]\nIPAddressDeny=any\nIPAddressAllow=");
    text.push_str(&seen.join(" "));
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_servers_host_is_taken_from_its_authority() {
        assert_eq!(host_of("https://user@10.0.0.1:443/x"), Some("10.0.0.1"));
        assert_eq!(host_of("https://[::1]:6443"), Some("[::1]"));
        assert_eq!(host_of("https://10.0.0.1?x=1"), Some("10.0.0.1"));
        assert_eq!(host_of("https://"), None);
        assert_eq!(host_of("https://[::1"), None);
        assert_eq!(host_of("10.0.0.1:6443"), Some("10.0.0.1"));
    }

    #[test]
    fn a_server_is_allowed_by_its_address_or_refused_with_the_reason() {
        for (url, want) in [
            ("https://10.9.0.1:6443", "10.9.0.1"),
            ("https://10.9.0.1:6443/prefix", "10.9.0.1"),
            ("https://[fd00::1]:6443", "fd00::1"),
            ("https://[fd00::1]", "fd00::1"),
            ("https://LOCALHOST:6443", "localhost"),
        ] {
            assert_eq!(api_server(url, false).map(|a| a.to_string()), Ok(want.to_owned()), "{url}");
        }
        assert_eq!(api_server("https://api.example:6443", false), Err(ServerError::HostName));
        assert_eq!(api_server("https://[api]:6443", false), Err(ServerError::HostName));
        assert_eq!(api_server("https://", false), Err(ServerError::NoHost));
        assert_eq!(api_server("https://10.9.0.1:6443", true), Err(ServerError::Proxied));
    }

    #[test]
    fn entries_are_addresses_networks_or_localhost() {
        assert_eq!(Allowed::parse_entry("10.0.0.5"), Ok(Allowed::Address("10.0.0.5".parse().expect("ip"))));
        assert_eq!(Allowed::parse_entry("Localhost"), Ok(Allowed::Localhost));
        assert_eq!(Allowed::parse_entry("10.0.0.0/24").map(|a| a.to_string()), Ok("10.0.0.0/24".to_owned()));
        assert_eq!(Allowed::parse_entry("fd00::/64").map(|a| a.to_string()), Ok("fd00::/64".to_owned()));
        for (bad, why) in [
            ("any", "far more"),
            ("link-local", "far more"),
            ("scheduler.example", "not an address"),
            ("10.0.0.0/33", "1 to 32"),
            ("10.0.0.0/0", "1 to 32"),
            ("fd00::/129", "1 to 128"),
            ("10.0.0.0/x", "1 to 32"),
            ("host/24", "not an address"),
            ("", "not an address"),
        ] {
            let e = Allowed::parse_entry(bad).expect_err(bad);
            assert!(e.to_string().contains(why), "{bad}: {e}");
            assert!(e.to_string().contains("localhost"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_drop_in_denies_all_but_each_entry_once() {
        let text = drop_in(
            &["Written by a generator.", "Second line."],
            &[Allowed::Address("10.9.0.1".parse().expect("ip")), Allowed::Localhost, Allowed::Localhost],
        );
        assert_eq!(
            text,
            "# Written by a generator.\n# Second line.\n[Service]\nIPAddressDeny=any\nIPAddressAllow=10.9.0.1 localhost\n"
        );
    }
}
