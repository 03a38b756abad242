//! The extender's configuration file (`/etc/gpushare/gpushare-extender.toml` by default),
//! every key documented in `docs/extender.md`. Unknown keys and bad values are refused with
//! the file, the line and what to write instead; a missing file at the default path means all
//! defaults.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpushare_core::confine::Allowed;
use gpushare_core::placement::{GpuPolicy, NodePolicy};
pub use gpushare_core::request::Compatibility;

use gpushare_core::resources::Resources;
use gpushare_core::schedule::Policies;
use serde::Deserialize;
use thiserror::Error;

/// Where the extender looks when `--config` is not given.
pub const DEFAULT_PATH: &str = "/etc/gpushare/gpushare-extender.toml";

/// A configuration that cannot be used.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The file exists but cannot be read.
    #[error("{path}: cannot read: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML of the documented shape; the message carries the line.
    #[error("{path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What the parser or validator said, with the line.
        message: String,
    },
}

/// The whole file.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `[server]`.
    #[serde(default)]
    pub server: ServerConfig,
    /// `[kubernetes]`.
    #[serde(default)]
    pub kubernetes: KubernetesConfig,
    /// `[resources]`.
    #[serde(default)]
    pub resources: Resources,
    /// `[scheduling]`.
    #[serde(default)]
    pub scheduling: SchedulingConfig,
}

/// `[server]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Address and port of kube-scheduler's verbs.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Address and port of `/metrics` and `<prefix>/inspect`, which name every tenant's pods:
    /// a listener of their own, so that reaching the scheduler's port does not show them.
    #[serde(default = "default_observe_listen")]
    pub observe_listen: SocketAddr,
    /// URL prefix of the verbs.
    #[serde(default = "default_prefix")]
    pub prefix: String,
    /// Largest request body.
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// Time to answer one request.
    #[serde(default = "default_timeout")]
    pub request_timeout_seconds: u64,
    /// TLS certificate chain (PEM).
    #[serde(default)]
    pub tls_cert: Option<PathBuf>,
    /// TLS private key (PEM).
    #[serde(default)]
    pub tls_key: Option<PathBuf>,
    /// CA bundle (PEM) that callers' client certificates must chain to; with it, a caller
    /// without one is refused in the TLS handshake. Needs `tls_cert` and `tls_key`.
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
    /// Serve a `listen` (or `observe_listen`) address beyond loopback without TLS client
    /// authentication: anyone who reaches it can then bind pods (or read every pod's GPU
    /// memory). Off by default.
    #[serde(default)]
    pub allow_unauthenticated: bool,
    /// Where kube-scheduler and the metrics scraper call from (addresses, networks or
    /// `localhost`): with `[kubernetes] confine_network`, the unit allows these, the API server
    /// and loopback (when a listener is on it), and no other address.
    #[serde(default, deserialize_with = "callers")]
    pub callers: Vec<Allowed>,
}

fn callers<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Allowed>, D::Error> {
    let entries = Vec::<String>::deserialize(d)?;
    entries.iter().map(|e| Allowed::parse_entry(e).map_err(serde::de::Error::custom)).collect()
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 39999))
}
fn default_observe_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 39998))
}
fn default_prefix() -> String {
    "/gpushare-scheduler".to_owned()
}
fn default_max_body() -> usize {
    32 * 1024 * 1024
}
fn default_timeout() -> u64 {
    5
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: default_listen(),
            observe_listen: default_observe_listen(),
            prefix: default_prefix(),
            max_body_bytes: default_max_body(),
            request_timeout_seconds: default_timeout(),
            tls_cert: None,
            tls_key: None,
            client_ca: None,
            allow_unauthenticated: false,
            callers: Vec::new(),
        }
    }
}

impl ServerConfig {
    /// The request timeout.
    #[must_use]
    pub fn request_timeout(&self) -> Duration {
        Duration::from_secs(self.request_timeout_seconds)
    }

    /// Both TLS files, when TLS is on.
    #[must_use]
    pub fn tls(&self) -> Option<(&Path, &Path)> {
        Some((self.tls_cert.as_deref()?, self.tls_key.as_deref()?))
    }
}

/// `[kubernetes]`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    /// The kubeconfig; unset: `$KUBECONFIG`, `~/.kube/config`, in-cluster.
    #[serde(default)]
    pub kubeconfig: Option<PathBuf>,
    /// Confine `gpushare-extender.service` to the API server the kubeconfig names, the
    /// `[server] callers` and loopback: the package's systemd generator writes
    /// `IPAddressDeny=any` with `IPAddressAllow=` those ([`crate::confine`]). Needs `kubeconfig`,
    /// whose server must be named by an address; the extender refuses to start otherwise.
    #[serde(default)]
    pub confine_network: bool,
}

/// `[scheduling]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulingConfig {
    /// Node ranking.
    #[serde(default)]
    pub node_policy: NodePolicy,
    /// GPU choice within a node.
    #[serde(default)]
    pub gpu_policy: GpuPolicy,
    /// How long an unseen bind is counted.
    #[serde(default = "default_assume")]
    pub assume_timeout_seconds: u64,
    /// Percent (0–100) of a node's score taken from how idle the GPUs the pod would land on
    /// are, by the utilisation the daemons publish; 0 leaves it out.
    #[serde(default)]
    pub busy_weight: u8,
    /// How long a bind waits, in milliseconds, for the node's daemon to report a look-alike pod
    /// admitted before it refuses (the scheduler then retries after its backoff); 0 refuses at
    /// once. Below `server.request_timeout_seconds`.
    #[serde(default = "default_lookalike_wait")]
    pub lookalike_wait_ms: u64,
    /// The kube-scheduler profiles (`schedulerName`) whose pods the extender binds; a bind for
    /// a pod of any other scheduler is refused.
    #[serde(default = "default_scheduler_names")]
    pub scheduler_names: Vec<String>,
}

fn default_scheduler_names() -> Vec<String> {
    vec![crate::objects::DEFAULT_SCHEDULER.to_owned()]
}

fn default_assume() -> u64 {
    300
}

fn default_lookalike_wait() -> u64 {
    2000
}

impl Default for SchedulingConfig {
    fn default() -> Self {
        SchedulingConfig {
            node_policy: NodePolicy::default(),
            gpu_policy: GpuPolicy::default(),
            assume_timeout_seconds: default_assume(),
            busy_weight: 0,
            lookalike_wait_ms: default_lookalike_wait(),
            scheduler_names: default_scheduler_names(),
        }
    }
}

impl SchedulingConfig {
    /// Both policies.
    #[must_use]
    pub fn policies(&self) -> Policies {
        Policies { gpu: self.gpu_policy, node: self.node_policy }
    }

    /// How long a bind waits for a look-alike's admission.
    #[must_use]
    pub fn lookalike_wait(&self) -> Duration {
        Duration::from_millis(self.lookalike_wait_ms)
    }
}

impl Config {
    /// Parses and validates configuration text; `path` only labels errors.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] with the line and the fix.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let invalid = |message: String| ConfigError::Invalid { path: path.to_owned(), message };
        let config: Config = toml::from_str(text).map_err(|e| invalid(e.to_string().trim_end().to_owned()))?;
        let s = &config.server;
        if !s.prefix.starts_with('/') || s.prefix.ends_with('/') || s.prefix.contains(['?', '#', ' ']) {
            return Err(invalid(format!(
                "server.prefix {:?} must be a URL path that starts with '/' and does not end with one, such as \"/gpushare-scheduler\"",
                s.prefix
            )));
        }
        if s.max_body_bytes < 1024 {
            return Err(invalid(format!(
                "server.max_body_bytes = {} is too small for any scheduler request; the default is {}",
                s.max_body_bytes,
                default_max_body()
            )));
        }
        if !(1..=300).contains(&s.request_timeout_seconds) {
            return Err(invalid(format!(
                "server.request_timeout_seconds = {} must be between 1 and 300 (kube-scheduler's httpTimeout is 5 s by default)",
                s.request_timeout_seconds
            )));
        }
        match (&s.tls_cert, &s.tls_key) {
            (Some(_), None) | (None, Some(_)) => {
                return Err(invalid("server: set both tls_cert and tls_key to serve HTTPS, or neither".to_owned()));
            }
            (Some(c), Some(k)) if !c.is_absolute() || !k.is_absolute() => {
                return Err(invalid("server: tls_cert and tls_key must be absolute paths".to_owned()));
            }
            _ => {}
        }
        match &s.client_ca {
            Some(_) if s.tls().is_none() => {
                return Err(invalid(
                    "server.client_ca needs tls_cert and tls_key: client certificates are checked in the TLS handshake"
                        .to_owned(),
                ));
            }
            Some(ca) if !ca.is_absolute() => {
                return Err(invalid("server.client_ca must be an absolute path".to_owned()));
            }
            _ => {}
        }
        // Beyond loopback, each listener needs client authentication or the explicit opt-out.
        let listeners = [
            (
                "listen",
                s.listen,
                "anyone who reaches it could bind pods to any node",
                "kube-scheduler's extender tlsConfig",
            ),
            ("observe_listen", s.observe_listen, "/metrics and /inspect name every tenant's pods", "the scraper"),
        ];
        for (key, addr, risk, caller) in listeners {
            if !addr.ip().is_loopback() && s.client_ca.is_none() && !s.allow_unauthenticated {
                return Err(invalid(format!(
                    "server.{key} = {addr} is reachable beyond this host, but no caller would be authenticated: \
                     {risk}. Set tls_cert, tls_key and client_ca ({caller} then presents a client certificate), \
                     listen on 127.0.0.1, or set allow_unauthenticated = true to accept that risk"
                )));
            }
        }
        if s.observe_listen == s.listen && s.listen.port() != 0 {
            return Err(invalid(format!(
                "server.observe_listen and server.listen are both {}: /metrics and /inspect need a port of their own",
                s.listen
            )));
        }
        if let Some(k) = &config.kubernetes.kubeconfig
            && !k.is_absolute()
        {
            return Err(invalid(format!(
                "kubernetes.kubeconfig {:?} must be an absolute path",
                k.display().to_string()
            )));
        }
        if config.kubernetes.confine_network {
            if config.kubernetes.kubeconfig.is_none() {
                return Err(invalid(
                    "kubernetes.confine_network needs kubernetes.kubeconfig: the unit is confined to the API server \
                     that file names"
                        .to_owned(),
                ));
            }
            // A listener beyond loopback is there for callers on other hosts: name them.
            let open = [("listen", s.listen), ("observe_listen", s.observe_listen)];
            if let Some((key, addr)) = open.into_iter().find(|(_, a)| !a.ip().is_loopback())
                && s.callers.is_empty()
            {
                return Err(invalid(format!(
                    "kubernetes.confine_network would let no other host reach server.{key} = {addr}: list where \
                     kube-scheduler and the metrics scraper call from in server.callers, such as [\"10.0.0.0/24\"]"
                )));
            }
        }
        if config.scheduling.busy_weight > 100 {
            return Err(invalid(format!(
                "scheduling.busy_weight is {}; write a percentage from 0 (off, the default) to 100",
                config.scheduling.busy_weight
            )));
        }
        if config.scheduling.lookalike_wait_ms >= config.server.request_timeout_seconds.saturating_mul(1000) {
            return Err(invalid(format!(
                "scheduling.lookalike_wait_ms = {} must be below server.request_timeout_seconds ({} s): a bind waiting \
                 longer would be answered 503; the default is 2000",
                config.scheduling.lookalike_wait_ms, config.server.request_timeout_seconds
            )));
        }
        if config.scheduling.scheduler_names.is_empty()
            || config.scheduling.scheduler_names.iter().any(String::is_empty)
        {
            return Err(invalid(
                "scheduling.scheduler_names must name at least one scheduler profile, none empty; the default is \
                 [\"default-scheduler\"]"
                    .to_owned(),
            ));
        }
        if config.scheduling.assume_timeout_seconds == 0 {
            return Err(invalid("scheduling.assume_timeout_seconds must be above 0; the default is 300".to_owned()));
        }
        config.resources.check().map_err(|e| invalid(e.to_string()))?;
        Ok(config)
    }

    /// Reads `path`; a missing file is all defaults only when `must_exist` is false.
    ///
    /// # Errors
    /// [`ConfigError`] if the file cannot be read or is invalid.
    pub fn load(path: &Path, must_exist: bool) -> Result<Config, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Config::parse(&text, path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !must_exist => Config::parse("", path),
            Err(source) => Err(ConfigError::Read { path: path.to_owned(), source }),
        }
    }
}

#[cfg(test)]
mod tests {
    use gpushare_core::MemoryUnit;
    use gpushare_core::request::ResourceNames;

    use super::*;

    fn parse(text: &str) -> Result<Config, String> {
        Config::parse(text, Path::new("/etc/gpushare/gpushare-extender.toml")).map_err(|e| e.to_string())
    }

    #[test]
    fn the_shipped_file_is_the_defaults() {
        let shipped = include_str!("../../etc/gpushare-extender.toml");
        let c = parse(shipped).unwrap();
        let d = parse("").unwrap();
        assert_eq!(c.server.listen, d.server.listen);
        assert_eq!(c.server.prefix, "/gpushare-scheduler");
        assert_eq!(c.server.max_body_bytes, d.server.max_body_bytes);
        assert_eq!(c.server.request_timeout_seconds, 5);
        assert_eq!(c.resources.unit, MemoryUnit::Mib);
        assert_eq!(c.resources.names(), ResourceNames::gpushare());
        assert_eq!(c.scheduling.policies(), Policies::default());
        assert_eq!(c.scheduling.assume_timeout_seconds, 300);
        assert_eq!(c.scheduling.busy_weight, 0);
        assert_eq!(c.scheduling.lookalike_wait(), Duration::from_secs(2));
        assert!(c.server.tls().is_none());
        // The one key set to other than its default: the packaged service needs credentials.
        assert_eq!(c.kubernetes.kubeconfig.as_deref(), Some(Path::new("/etc/gpushare/gpushare-extender.kubeconfig")));
        assert!(d.kubernetes.kubeconfig.is_none());
        assert!(!c.kubernetes.confine_network && c.server.callers.is_empty());
    }

    #[test]
    fn every_key_can_be_set() {
        let c = parse(
            "[server]\nlisten = \"0.0.0.0:12345\"\nobserve_listen = \"0.0.0.0:12346\"\nprefix = \"/x\"\nmax_body_bytes = 4096\nrequest_timeout_seconds = 9\n\
             tls_cert = \"/c.pem\"\ntls_key = \"/k.pem\"\nclient_ca = \"/ca.pem\"\nallow_unauthenticated = true\n[kubernetes]\nkubeconfig = \"/etc/kubernetes/scheduler.conf\"\n\
             [resources]\nunit = \"GiB\"\ncompatibility = \"alibaba\"\n[scheduling]\nnode_policy = \"spread\"\n\
             gpu_policy = \"spread\"\nassume_timeout_seconds = 60\nbusy_weight = 30\nlookalike_wait_ms = 8000\n",
        )
        .unwrap();
        assert_eq!(c.scheduling.busy_weight, 30);
        assert_eq!(c.scheduling.lookalike_wait(), Duration::from_secs(8));
        // Beyond loopback only with client authentication, or the explicit opt-out.
        let e = parse("[server]\nlisten = \"0.0.0.0:39999\"\n").unwrap_err();
        assert!(e.contains("reachable beyond this host") && e.contains("allow_unauthenticated"), "{e}");
        let e =
            parse("[server]\nlisten = \"10.0.0.5:39999\"\ntls_cert = \"/c.pem\"\ntls_key = \"/k.pem\"\n").unwrap_err();
        assert!(e.contains("client_ca"), "{e}");
        assert!(parse("[server]\nlisten = \"0.0.0.0:39999\"\nallow_unauthenticated = true\n").is_ok());
        // The same for the listener of /metrics and /inspect, which must be a port of its own.
        let e = parse("[server]\nobserve_listen = \"0.0.0.0:39998\"\n").unwrap_err();
        assert!(e.contains("observe_listen") && e.contains("every tenant's pods"), "{e}");
        let e = parse("[server]\nobserve_listen = \"127.0.0.1:39999\"\n").unwrap_err();
        assert!(e.contains("a port of their own"), "{e}");
        assert!(parse("[server]\nlisten = \"[::1]:39999\"\n").is_ok());
        let e = parse("[server]\nclient_ca = \"/ca.pem\"\n").unwrap_err();
        assert!(e.contains("client_ca needs tls_cert and tls_key"), "{e}");
        let e = parse("[scheduling]\nscheduler_names = []\n").unwrap_err();
        assert!(e.contains("scheduler_names"), "{e}");
        let names = parse("[scheduling]\nscheduler_names = [\"gpu-scheduler\"]\n").unwrap();
        assert_eq!(names.scheduling.scheduler_names, ["gpu-scheduler"]);
        assert_eq!(parse("").unwrap().scheduling.scheduler_names, ["default-scheduler"]);
        let e = parse("[scheduling]\nlookalike_wait_ms = 5000\n").unwrap_err();
        assert!(e.contains("must be below server.request_timeout_seconds (5 s)"), "{e}");
        assert!(parse("[scheduling]\nbusy_weight = 101\n").unwrap_err().contains("from 0 (off, the default) to 100"));
        assert_eq!(c.server.listen.port(), 12345);
        assert!(c.server.tls().is_some());
        assert_eq!(c.resources.names(), ResourceNames::alibaba());
        assert_eq!(c.scheduling.policies(), Policies { gpu: GpuPolicy::Spread, node: NodePolicy::Spread });
    }

    #[test]
    fn mistakes_name_the_line_and_the_fix() {
        let e = parse("[server]\nlisten = \"127.0.0.1:1\"\nprefx = \"/a\"\n").unwrap_err();
        assert!(e.contains("line 3") && e.contains("prefx"), "{e}");
        let e = parse("[scheduling]\nnode_policy = \"pack\"\n").unwrap_err();
        assert!(e.contains("line 2") && e.contains("binpack"), "{e}");
        let e = parse("[server]\nprefix = \"gpushare/\"\n").unwrap_err();
        assert!(e.contains("starts with '/'"), "{e}");
        let e = parse("[server]\ntls_cert = \"/c.pem\"\n").unwrap_err();
        assert!(e.contains("both tls_cert and tls_key"), "{e}");
        let e = parse("[server]\nrequest_timeout_seconds = 0\n").unwrap_err();
        assert!(e.contains("between 1 and 300"), "{e}");
        let e = parse("[server]\nlisten = \"localhost\"\n").unwrap_err();
        assert!(e.contains("line 2"), "{e}");
        let e = parse("[resources]\nmemory = \"a.io/x\"\ncount = \"a.io/x\"\n").unwrap_err();
        assert!(e.contains("two different resources"), "{e}");
        assert!(Config::load(Path::new("/nonexistent/x.toml"), true).is_err());
        assert!(Config::load(Path::new("/nonexistent/x.toml"), false).is_ok());
    }

    #[test]
    fn a_confinement_needs_a_kubeconfig_and_someone_to_reach_the_extender() {
        let kubeconfig = "[kubernetes]\nkubeconfig = \"/etc/gpushare/k\"\nconfine_network = true\n";
        let c =
            parse(&format!("[server]\ncallers = [\"10.0.0.0/24\", \"localhost\", \"fd00::7\"]\n{kubeconfig}")).unwrap();
        assert!(c.kubernetes.confine_network);
        let shown: Vec<String> = c.server.callers.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["10.0.0.0/24", "localhost", "fd00::7"]);
        assert!(!parse("").unwrap().kubernetes.confine_network);
        // Loopback listeners (the defaults) are reached from this host: no caller list needed.
        assert!(parse(kubeconfig).is_ok());
        let e = parse("[kubernetes]\nconfine_network = true\n").unwrap_err();
        assert!(e.contains("confine_network needs kubernetes.kubeconfig"), "{e}");
        let open =
            "[server]\nlisten = \"0.0.0.0:39999\"\nobserve_listen = \"0.0.0.0:39998\"\nallow_unauthenticated = true\n";
        let e = parse(&format!("{open}{kubeconfig}")).unwrap_err();
        assert!(e.contains("would let no other host reach server.listen") && e.contains("server.callers"), "{e}");
        // One listener beyond loopback is enough to need them.
        let scraped = "[server]\nobserve_listen = \"10.0.0.2:39998\"\nallow_unauthenticated = true\n";
        let e = parse(&format!("{scraped}{kubeconfig}")).unwrap_err();
        assert!(e.contains("reach server.observe_listen = 10.0.0.2:39998"), "{e}");
        assert!(parse(&format!("{open}callers = [\"10.0.0.9\"]\n{kubeconfig}")).is_ok());
        // An entry systemd would read as more than meant, or not at all, names its line.
        for bad in ["any", "scheduler.example", "10.0.0.0/40"] {
            let e = parse(&format!("[server]\ncallers = [\"{bad}\"]\n")).unwrap_err();
            assert!(e.contains("line 2") && e.contains(bad) && e.contains("localhost"), "{bad}: {e}");
        }
    }
}
