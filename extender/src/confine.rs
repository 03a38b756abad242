//! The confinement of `gpushare-extender.service` (`[kubernetes] confine_network`): the API
//! server the kubeconfig names, as the client resolves it, the callers `[server] callers`
//! lists, and loopback when a listener is on it; the systemd drop-in that allows those and no
//! other address (`IPAddressDeny=any`, `IPAddressAllow=`). The package's systemd generator
//! writes the drop-in that `gpushare-extender --unit-drop-in` prints; the extender refuses to
//! start when the setting is on and no drop-in can be made, so a confinement asked for is never
//! silently missing.

use gpushare_core::confine::Allowed;
pub use gpushare_core::confine::ConfineError;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::config::Config;

/// The section of docs/install.md that confines the unit by hand.
const BY_HAND: &str = "Confine the extender";

/// What the unit may reach and be reached from, when `config` asks for a confinement: the API
/// server, loopback when a listener is on it, then the configured callers.
///
/// # Errors
/// [`ConfineError`] when the kubeconfig cannot be read or its server is not an address.
pub async fn allowed(config: &Config) -> Result<Option<Vec<Allowed>>, ConfineError> {
    if !config.kubernetes.confine_network {
        return Ok(None);
    }
    // Config::parse refuses confine_network without a kubeconfig; an empty path fails to read.
    let path = config.kubernetes.kubeconfig.clone().unwrap_or_default();
    let shown = path.display().to_string();
    let bad = |reason: String| ConfineError::Kubeconfig { path: shown.clone(), reason };
    let kubeconfig = Kubeconfig::read_from(&path).map_err(|e| bad(e.to_string()))?;
    // The server and proxy exactly as the client connects (crate::kube::client).
    let resolved = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| bad(e.to_string()))?;
    let server = resolved.cluster_url.to_string();
    let api = gpushare_core::confine::api_server(&server, resolved.proxy_url.is_some())
        .map_err(|why| ConfineError::NotAnAddress { path: shown.clone(), server, why, by_hand: BY_HAND })?;
    let mut allowed = vec![api];
    let s = &config.server;
    if s.listen.ip().is_loopback() || s.observe_listen.ip().is_loopback() {
        allowed.push(Allowed::Localhost);
    }
    allowed.extend(s.callers.iter().cloned());
    Ok(Some(allowed))
}

/// The drop-in for `gpushare-extender.service` that `config` asks for: `None` when
/// `[kubernetes] confine_network` is off.
///
/// # Errors
/// [`ConfineError`], as [`allowed`].
pub async fn drop_in(config: &Config) -> Result<Option<String>, ConfineError> {
    let Some(allowed) = allowed(config).await? else {
        return Ok(None);
    };
    let path = config.kubernetes.kubeconfig.clone().unwrap_or_default();
    let why = format!(
        "that {} names, loopback when a listener is on it, [server] callers; no other address.",
        path.display()
    );
    Ok(Some(gpushare_core::confine::drop_in(
        &["Written by gpushare-extender's systemd generator ([kubernetes] confine_network): the API server", &why],
        &allowed,
    )))
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;
    use std::path::Path;

    use super::*;

    fn kubeconfig(server: &str, extra: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        write!(
            f,
            "apiVersion: v1\nkind: Config\ncurrent-context: x\ncontexts:\n- name: x\n  context:\n    cluster: main\n    user: x\n\
             clusters:\n- name: other\n  cluster:\n    server: https://192.0.2.99:6443\n\
             - name: main\n  cluster:\n    server: {server}\n{extra}users:\n- name: x\n  user:\n    token: t\n"
        )
        .expect("write");
        f
    }

    fn config(kubeconfig: &Path, server: &str) -> Config {
        let text = format!(
            "{server}[kubernetes]\nkubeconfig = {:?}\nconfine_network = true\n",
            kubeconfig.display().to_string()
        );
        Config::parse(&text, Path::new("gpushare-extender.toml")).expect("config")
    }

    fn settings(text: &str) -> Vec<&str> {
        text.lines().filter(|l| !l.starts_with('#')).collect()
    }

    #[tokio::test]
    async fn the_drop_in_allows_the_api_server_loopback_and_the_callers_only() {
        let k = kubeconfig("https://10.9.0.1:6443", "");
        let text = drop_in(&config(k.path(), "")).await.expect("made").expect("a drop-in");
        assert_eq!(settings(&text), ["[Service]", "IPAddressDeny=any", "IPAddressAllow=10.9.0.1 localhost"]);
        let callers = "[server]\ncallers = [\"10.0.0.0/24\", \"10.9.0.1\"]\n";
        let text = drop_in(&config(k.path(), callers)).await.expect("made").expect("a drop-in");
        assert_eq!(
            settings(&text),
            ["[Service]", "IPAddressDeny=any", "IPAddressAllow=10.9.0.1 localhost 10.0.0.0/24"]
        );
        // Listeners beyond loopback: loopback is not allowed unless listed.
        let open = "[server]\nlisten = \"10.0.0.2:39999\"\nobserve_listen = \"10.0.0.2:39998\"\n\
                    allow_unauthenticated = true\ncallers = [\"10.0.0.3\"]\n";
        let text = drop_in(&config(k.path(), open)).await.expect("made").expect("a drop-in");
        assert_eq!(settings(&text), ["[Service]", "IPAddressDeny=any", "IPAddressAllow=10.9.0.1 10.0.0.3"]);
        let off = Config::parse("", Path::new("x.toml")).expect("defaults");
        assert_eq!(drop_in(&off).await.expect("off"), None);
    }

    #[tokio::test]
    async fn a_server_that_is_no_address_is_refused_with_what_to_do() {
        let k = kubeconfig("https://api.cluster.example:6443", "");
        let text = drop_in(&config(k.path(), "")).await.expect_err("a host name").to_string();
        assert!(text.contains("api.cluster.example") && text.contains("host name"), "{text}");
        assert!(text.contains("confine_network = false"), "{text}");
        let k = kubeconfig("https://10.9.0.1:6443", "    proxy-url: http://10.0.0.5:3128\n");
        let text = drop_in(&config(k.path(), "")).await.expect_err("a proxy").to_string();
        assert!(text.contains("proxy"), "{text}");
        let missing = config(Path::new("/nonexistent/extender.kubeconfig"), "");
        let text = drop_in(&missing).await.expect_err("missing").to_string();
        assert!(text.contains("/nonexistent/extender.kubeconfig"), "{text}");
    }
}
