//! The confinement of `gpushared.service` to the API server (`[kubernetes] confine_network`):
//! the address the kubeconfig's server names, and the systemd drop-in that allows it and no
//! other (`IPAddressDeny=any`, `IPAddressAllow=`). The package's systemd generator writes the
//! drop-in that `gpushared --unit-drop-in` prints; the daemon refuses to start when the
//! setting is on and no drop-in can be made, so a confinement asked for is never silently
//! missing.

use std::net::IpAddr;
use std::path::Path;

use kube::config::Kubeconfig;
use thiserror::Error;

use crate::config::Config;

/// What the drop-in allows: one address, or systemd's `localhost` (127.0.0.0/8, `::1`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Allowed {
    /// An IPv4 or IPv6 address.
    Address(IpAddr),
    /// The loopback addresses.
    Localhost,
}

impl std::fmt::Display for Allowed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Allowed::Address(a) => write!(f, "{a}"),
            Allowed::Localhost => f.write_str("localhost"),
        }
    }
}

/// The confinement cannot be made.
#[derive(Debug, Error)]
pub enum ConfineError {
    /// The kubeconfig cannot be read.
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
         or set confine_network = false and confine the unit by hand (docs/install.md, Confine gpushared \
         to the API server)"
    )]
    NotAnAddress {
        /// The file.
        path: String,
        /// The server as written.
        server: String,
        /// Why it cannot be allowed.
        why: &'static str,
    },
}

/// The address the kubeconfig at `path` reaches the API server at (its current context's
/// cluster, or its only cluster).
///
/// # Errors
/// [`ConfineError`] when the file cannot be read, names no server, names it by host name or
/// reaches it through a proxy.
pub fn api_server(path: &Path) -> Result<Allowed, ConfineError> {
    let shown = path.display().to_string();
    let kubeconfig = Kubeconfig::read_from(path)
        .map_err(|e| ConfineError::Kubeconfig { path: shown.clone(), reason: e.to_string() })?;
    let cluster_name = kubeconfig
        .current_context
        .as_ref()
        .and_then(|current| kubeconfig.contexts.iter().find(|c| &c.name == current))
        .and_then(|c| c.context.as_ref())
        .map(|c| c.cluster.clone());
    let cluster = match cluster_name {
        Some(name) => kubeconfig.clusters.iter().find(|c| c.name == name),
        None if kubeconfig.clusters.len() == 1 => kubeconfig.clusters.first(),
        None => None,
    }
    .and_then(|c| c.cluster.as_ref())
    .ok_or_else(|| ConfineError::NoServer { path: shown.clone() })?;
    let server = cluster.server.clone().ok_or_else(|| ConfineError::NoServer { path: shown.clone() })?;
    let not = |why| ConfineError::NotAnAddress { path: shown.clone(), server: server.clone(), why };
    if cluster.proxy_url.is_some() {
        return Err(not("through the proxy its proxy-url names"));
    }
    let host = host_of(&server).ok_or_else(|| not("which is not a URL with a host"))?;
    let host = host.as_str();
    if host.eq_ignore_ascii_case("localhost") {
        return Ok(Allowed::Localhost);
    }
    let ip = host.trim_start_matches('[').trim_end_matches(']');
    ip.parse::<IpAddr>().map(Allowed::Address).map_err(|_| not("which is named by host name"))
}

/// The host of a server URL (`https://HOST[:PORT][/PATH]`), as `http::Uri` (the URL type kube's
/// client connects with) reads it: an IPv6 address keeps its brackets.
fn host_of(server: &str) -> Option<String> {
    let uri = server.parse::<http::Uri>().ok()?;
    uri.host().filter(|h| !h.is_empty()).map(str::to_owned)
}

/// The drop-in for `gpushared.service` that `config` asks for: `None` when
/// `[kubernetes] confine_network` is off.
///
/// # Errors
/// [`ConfineError`], as [`api_server`].
pub fn drop_in(config: &Config) -> Result<Option<String>, ConfineError> {
    if !config.kubernetes.confine_network {
        return Ok(None);
    }
    let path = config.kubernetes.kubeconfig.path();
    let allowed = api_server(path)?;
    Ok(Some(format!(
        "# Written by gpushared's systemd generator ([kubernetes] confine_network): the API server\n\
         # that {} names, and no other address.\n\
         [Service]\n\
         IPAddressDeny=any\n\
         IPAddressAllow={allowed}\n",
        path.display()
    )))
}

#[cfg(test)]
mod tests;
