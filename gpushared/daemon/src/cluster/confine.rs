//! The confinement of `gpushared.service` to the API server (`[kubernetes] confine_network`):
//! the address the kubeconfig's server names, and the systemd drop-in that allows it and no
//! other (`IPAddressDeny=any`, `IPAddressAllow=`). The package's systemd generator writes the
//! drop-in that `gpushared --unit-drop-in` prints; the daemon refuses to start when the
//! setting is on and no drop-in can be made, so a confinement asked for is never silently
//! missing.

use std::path::Path;

pub use gpushare_core::confine::{Allowed, ConfineError};
use kube::config::Kubeconfig;

use crate::config::Config;

/// The section of docs/install.md that confines the unit by hand.
const BY_HAND: &str = "Confine gpushared to the API server";

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
    gpushare_core::confine::api_server(&server, cluster.proxy_url.is_some()).map_err(|why| ConfineError::NotAnAddress {
        path: shown,
        server,
        why,
        by_hand: BY_HAND,
    })
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
    let why = format!("that {} names, and no other address.", path.display());
    Ok(Some(gpushare_core::confine::drop_in(
        &["Written by gpushared's systemd generator ([kubernetes] confine_network): the API server", &why],
        &[allowed],
    )))
}

#[cfg(test)]
mod tests;
