//! The real Kubernetes control plane as processes, for the real-cluster suites: etcd and
//! kube-apiserver (generated certificates, service-account keys, `--authorization-mode=Node,RBAC`,
//! the `NodeRestriction` admission plugin) and kube-scheduler loading gpushare's shipped
//! configuration (`etc/kube-scheduler/gpushare-scheduler-config.yaml`, only its kubeconfig and
//! the extender's address filled in). No kube-controller-manager runs; the default
//! `ServiceAccount` it would create is created here. Every client gets its own certificate, so
//! each runs with exactly the rights a real cluster would give it.
//!
//! The binaries come from `tests/kube/build` (Go modules pinned in `tests/kube/go.mod`), built
//! once into a cache outside `target/`; `GPUSHARE_KUBE_BIN` names a directory that has them
//! instead. Certificates are made with the `openssl` command.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use crate::cluster::{Proc, wait_for};
use crate::ports::free_port;

/// What the shipped kube-scheduler configurations name as their kubeconfig.
pub const SCHEDULER_KUBECONFIG: &str = "kubeconfig: /etc/kubernetes/scheduler.conf";
/// The extender's address in the shipped kube-scheduler configurations.
pub const EXTENDER_URL: &str = "http://127.0.0.1:39999/gpushare-scheduler";

/// The directory of the real components' binaries: `$GPUSHARE_KUBE_BIN`, or what
/// `tests/kube/build` builds (or finds in its cache).
///
/// # Errors
/// If Go is missing or the build fails, with its output.
pub fn binaries() -> anyhow::Result<PathBuf> {
    built_by("GPUSHARE_KUBE_BIN", &Path::new(env!("CARGO_MANIFEST_DIR")).join("kube").join("build"))
}

/// The directory `$env_var` names, or else the one the build script `script` prints last (it
/// builds into its cache, or finds the binaries there).
///
/// # Errors
/// If the script cannot run or fails, with its standard error.
pub fn built_by(env_var: &str, script: &Path) -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os(env_var) {
        return Ok(PathBuf::from(dir));
    }
    let out = Command::new("bash").arg(script).output().with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed:\n{}", script.display(), String::from_utf8_lossy(&out.stderr));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let dir = stdout.lines().last().with_context(|| format!("{} printed no directory", script.display()))?;
    Ok(PathBuf::from(dir.trim()))
}

/// Whether the real components can be had here: Go to build them, or `GPUSHARE_KUBE_BIN`.
#[must_use]
pub fn available() -> bool {
    std::env::var_os("GPUSHARE_KUBE_BIN").is_some() || Command::new("go").arg("version").output().is_ok()
}

/// A certificate authority made with openssl, and the certificates it signs.
#[derive(Debug)]
pub struct Pki {
    dir: PathBuf,
}

impl Pki {
    /// A new CA in `dir`.
    ///
    /// # Errors
    /// If openssl fails.
    pub fn new(dir: &Path) -> anyhow::Result<Pki> {
        std::fs::create_dir_all(dir)?;
        let pki = Pki { dir: dir.to_owned() };
        pki.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "3",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-subj",
            "/CN=gpushare-box-ca",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ])?;
        Ok(pki)
    }

    fn openssl(&self, args: &[&str]) -> anyhow::Result<()> {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(&self.dir)
            .output()
            .context("running openssl (install it: the real cluster's certificates are made with it)")?;
        if !out.status.success() {
            bail!("openssl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// The CA certificate.
    #[must_use]
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// Issues `name.crt`/`name.key` for `subject` (`/O=group/CN=user`) with the extensions in
    /// `extensions` (openssl's `-extfile` syntax). Returns (certificate, key).
    ///
    /// # Errors
    /// If openssl fails.
    pub fn issue(&self, name: &str, subject: &str, extensions: &str) -> anyhow::Result<(PathBuf, PathBuf)> {
        let (crt, key, csr, ext) =
            (format!("{name}.crt"), format!("{name}.key"), format!("{name}.csr"), format!("{name}.ext"));
        std::fs::write(self.dir.join(&ext), extensions)?;
        self.openssl(&[
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            subject,
        ])?;
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "3",
            "-out",
            &crt,
            "-extfile",
            &ext,
        ])?;
        Ok((self.dir.join(crt), self.dir.join(key)))
    }

    /// A client certificate for `user` in `groups`, and a kubeconfig using it against `server`.
    ///
    /// # Errors
    /// If openssl fails or the file cannot be written.
    pub fn kubeconfig(&self, server: &str, user: &str, groups: &[&str]) -> anyhow::Result<PathBuf> {
        let file = user.replace(':', "-");
        let subject: String = groups.iter().map(|g| format!("/O={g}")).chain([format!("/CN={user}")]).collect();
        let (crt, key) =
            self.issue(&file, &subject, "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature\n")?;
        let path = self.dir.join(format!("{file}.kubeconfig"));
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: box\n  cluster:\n    server: {server}\n    \
                 certificate-authority: {}\nusers:\n- name: {user}\n  user:\n    client-certificate: {}\n    \
                 client-key: {}\ncontexts:\n- name: box\n  context:\n    cluster: box\n    user: {user}\n    \
                 namespace: default\ncurrent-context: box\n",
                self.ca().display(),
                crt.display(),
                key.display()
            ),
        )?;
        Ok(path)
    }
}

/// etcd and kube-apiserver, up and ready, with an administrator's kubeconfig.
#[derive(Debug)]
pub struct ControlPlane {
    /// Where the state, certificates and logs are.
    pub dir: PathBuf,
    /// The binaries.
    pub bin: PathBuf,
    /// The CA.
    pub pki: Pki,
    /// `https://127.0.0.1:PORT`.
    pub server: String,
    /// A `system:masters` kubeconfig.
    pub admin: PathBuf,
    /// etcd.
    pub etcd: Proc,
    /// kube-apiserver.
    pub apiserver: Proc,
    /// kube-scheduler, once started.
    pub scheduler: Option<Proc>,
    /// kube-scheduler's secure port (its `/metrics`), once started.
    pub scheduler_port: u16,
    /// The components' minor version (`29` for v1.29.15): what a suite may ask of them.
    pub minor: u32,
}

/// Before this minor version, kube-scheduler retries a pod that gpushare-extender turned away
/// from a node whose gpushared was silent only on its flush of long-unschedulable pods, five
/// minutes later (1.29 measured 318 s); the box runs it with a shorter flush, as docs/install.md
/// asks of an operator.
pub const UNSCHEDULABLE_FLUSH_MINOR: u32 = 30;

/// What docs/install.md asks for `--pod-max-in-unschedulable-pods-duration` before
/// [`UNSCHEDULABLE_FLUSH_MINOR`].
pub const UNSCHEDULABLE_FLUSH: &str = "20s";

/// The minor version of the components in `bin`, from `kube-apiserver --version`
/// (`Kubernetes v1.29.15`).
///
/// # Errors
/// If it cannot run or prints something else.
pub fn minor_version(bin: &Path) -> anyhow::Result<u32> {
    let out = Command::new(bin.join("kube-apiserver"))
        .arg("--version")
        .output()
        .with_context(|| format!("running {} --version", bin.join("kube-apiserver").display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim()
        .strip_prefix("Kubernetes v1.")
        .and_then(|rest| rest.split('.').next())
        .and_then(|minor| minor.parse().ok())
        .with_context(|| format!("kube-apiserver --version printed {text:?}, not Kubernetes v1.N.P"))
}

/// The first minor version where gpushared's DRA driver runs on the components' defaults:
/// `resource.k8s.io/v1` is served from 1.34, and `DRAConsumableCapacity` (claims consuming
/// `memory`) is on by default from 1.36. On 1.34 and 1.35 that gate must be turned on in
/// kube-apiserver, kube-scheduler and the kubelet (docs/dra.md); the box does not.
pub const DRA_MINOR: u32 = 36;

/// The first minor version that serves `admissionregistration.k8s.io/v1`
/// `ValidatingAdmissionPolicy` (the shipped admission policy).
pub const ADMISSION_POLICY_MINOR: u32 = 30;

impl ControlPlane {
    /// Starts etcd and kube-apiserver in `dir` and waits until the API server is ready.
    ///
    /// # Errors
    /// A process that does not start or get ready in time, with the end of its log.
    pub fn start(dir: &Path, bin: &Path) -> anyhow::Result<ControlPlane> {
        let logs = dir.join("logs");
        std::fs::create_dir_all(&logs)?;
        let pki = Pki::new(&dir.join("pki"))?;
        let (serving, serving_key) = pki.issue(
            "apiserver",
            "/CN=kube-apiserver",
            "subjectAltName=IP:127.0.0.1,DNS:localhost,IP:10.96.0.1,DNS:kubernetes.default.svc\n\
             extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature\n",
        )?;
        let sa_key = dir.join("pki/sa.key");
        let sa_pub = dir.join("pki/sa.pub");
        pki.openssl(&["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "sa.key"])?;
        pki.openssl(&["pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub"])?;

        let (client, peer, secure) = (free_port()?, free_port()?, free_port()?);
        let etcd_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let s = |p: &Path| p.display().to_string();
        let mut etcd = Proc::spawn(
            "etcd",
            &bin.join("etcd"),
            vec![
                "--name=box".into(),
                format!("--data-dir={}", s(&dir.join("etcd"))),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=box={peer_url}"),
                // A test cluster: its data need not survive a power cut.
                "--unsafe-no-fsync".into(),
                "--log-level=warn".into(),
            ],
            vec![],
            &logs,
        )?;
        let etcd_up = format!("127.0.0.1:{client}");
        wait_for(&mut etcd, Duration::from_secs(30), "etcd", || std::net::TcpStream::connect(&etcd_up).is_ok())?;

        let server = format!("https://127.0.0.1:{secure}");
        let apiserver = Proc::spawn(
            "kube-apiserver",
            &bin.join("kube-apiserver"),
            vec![
                format!("--etcd-servers={etcd_url}"),
                "--bind-address=127.0.0.1".into(),
                "--advertise-address=127.0.0.1".into(),
                format!("--secure-port={secure}"),
                format!("--tls-cert-file={}", s(&serving)),
                format!("--tls-private-key-file={}", s(&serving_key)),
                format!("--client-ca-file={}", s(&pki.ca())),
                format!("--service-account-key-file={}", s(&sa_pub)),
                format!("--service-account-signing-key-file={}", s(&sa_key)),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
                "--service-cluster-ip-range=10.96.0.0/24".into(),
                "--authorization-mode=Node,RBAC".into(),
                "--enable-admission-plugins=NodeRestriction".into(),
                format!("--cert-dir={}", s(&dir.join("apiserver"))),
                "--profiling=false".into(),
                // The `kubernetes` Service's endpoint cannot be a loopback address, and nothing
                // here reaches the API server through it.
                "--endpoint-reconciler-type=none".into(),
            ],
            vec![],
            &logs,
        )?;
        let admin = pki.kubeconfig(&server, "admin", &["system:masters"])?;
        let mut plane = ControlPlane {
            dir: dir.to_owned(),
            bin: bin.to_owned(),
            pki,
            server,
            admin,
            etcd,
            apiserver,
            scheduler: None,
            scheduler_port: 0,
            minor: minor_version(bin)?,
        };
        plane.wait_ready(Duration::from_secs(90))?;
        // No kube-controller-manager runs (its node lifecycle controller would taint the
        // API-only nodes, which have no kubelet, not-ready): the one thing of its the tests
        // need is the namespace's default ServiceAccount, which admission requires of pods.
        plane.kubectl(&["create", "serviceaccount", "default", "--namespace=default"])?;
        Ok(plane)
    }

    /// Waits until `/readyz` answers ok (RBAC's bootstrap roles are in by then).
    ///
    /// # Errors
    /// If it does not within `timeout`, with the end of the API server's log.
    pub fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.kubectl(&["get", "--raw=/readyz"]) {
                Ok(out) if out.trim() == "ok" => return Ok(()),
                Ok(_) | Err(_) if Instant::now() < deadline => {}
                Ok(out) => bail!("the API server is not ready after {timeout:?}: {out}"),
                Err(e) => {
                    bail!("the API server is not ready after {timeout:?}: {e:#}\n{}", self.apiserver.log_tail(30))
                }
            }
            if let Some(status) = self.apiserver.exited() {
                bail!("kube-apiserver exited ({status}); its log ends:\n{}", self.apiserver.log_tail(30));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// A client of the API server as the administrator.
    ///
    /// # Errors
    /// If the kubeconfig cannot be read or used.
    pub async fn admin_client(&self) -> anyhow::Result<kube::Client> {
        let kubeconfig = kube::config::Kubeconfig::read_from(&self.admin)
            .with_context(|| format!("reading {}", self.admin.display()))?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default())
            .await
            .context("the administrator's kubeconfig")?;
        kube::Client::try_from(config).context("building a client for the API server")
    }

    /// Runs kubectl as the administrator; its stdout.
    ///
    /// # Errors
    /// If it fails, with its stderr.
    pub fn kubectl(&self, args: &[&str]) -> anyhow::Result<String> {
        self.kubectl_as(&self.admin, args)
    }

    /// Runs kubectl with `kubeconfig`; its stdout.
    ///
    /// # Errors
    /// If it fails, with its stderr.
    pub fn kubectl_as(&self, kubeconfig: &Path, args: &[&str]) -> anyhow::Result<String> {
        let out = Command::new(self.bin.join("kubectl"))
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(args)
            .output()
            .context("running kubectl")?;
        if !out.status.success() {
            bail!("kubectl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Starts a process of the test (the extender, a daemon) with its log beside the control
    /// plane's, killed on drop.
    ///
    /// # Errors
    /// If it cannot be started.
    pub fn spawn(
        &self,
        name: &str,
        program: &Path,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> anyhow::Result<Proc> {
        Proc::spawn(name, program, args, env, &self.dir.join("logs"))
    }

    /// Creates an object (JSON) as the administrator.
    ///
    /// # Errors
    /// If kubectl fails.
    pub fn create(&self, object: &serde_json::Value) -> anyhow::Result<()> {
        let name = object["metadata"]["name"].as_str().unwrap_or("object");
        let kind = object["kind"].as_str().unwrap_or("object").to_lowercase();
        let file = self.dir.join(format!("{kind}-{name}.json"));
        std::fs::write(&file, object.to_string())?;
        self.kubectl(&["create", "-f", &file.display().to_string()]).map(|_| ())
    }

    /// Adds an API-only node (no kubelet): creates `node`, sets its `status` (capacity,
    /// allocatable, a Ready condition) as a kubelet would, and removes the `not-ready` taint the
    /// API server puts on new nodes, as the node lifecycle controller would for a Ready node.
    ///
    /// # Errors
    /// If kubectl fails.
    pub fn add_api_only_node(&self, node: &serde_json::Value, status: &serde_json::Value) -> anyhow::Result<()> {
        self.create(node)?;
        let name = node["metadata"]["name"].as_str().context("the node has no name")?;
        let patch = serde_json::json!({"status": status}).to_string();
        self.kubectl(&["patch", "node", name, "--subresource=status", "--type=merge", "-p", &patch])?;
        let taints = self.kubectl(&["get", "node", name, "-o", "jsonpath={.spec.taints[*].key}"])?;
        if taints.split_whitespace().any(|t| t == "node.kubernetes.io/not-ready") {
            self.kubectl(&["taint", "node", name, "node.kubernetes.io/not-ready:NoSchedule-"])?;
        }
        Ok(())
    }

    /// Applies a manifest as the administrator.
    ///
    /// # Errors
    /// If kubectl fails.
    pub fn apply(&self, manifest: &Path) -> anyhow::Result<String> {
        self.kubectl(&["apply", "-f", &manifest.display().to_string()])
    }

    /// Starts kube-scheduler with gpushare's shipped configuration, its kubeconfig and
    /// `extender` (`http://ADDR/gpushare-scheduler`) filled in, as `system:kube-scheduler`.
    ///
    /// # Errors
    /// If the shipped file lacks what is filled in, or the scheduler does not start.
    pub fn start_scheduler(&mut self, shipped: &Path, extender: &str) -> anyhow::Result<()> {
        let text = std::fs::read_to_string(shipped).with_context(|| format!("reading {}", shipped.display()))?;
        if !text.contains(SCHEDULER_KUBECONFIG) || !text.contains(EXTENDER_URL) {
            bail!("{} no longer has `{SCHEDULER_KUBECONFIG}` and `{EXTENDER_URL}` to fill in", shipped.display());
        }
        self.start_scheduler_config(&text.replace(EXTENDER_URL, extender))
    }

    /// Starts kube-scheduler (replacing a running one) with the configuration `text`, in which
    /// `kubeconfig: /etc/kubernetes/scheduler.conf` is replaced by the kubeconfig of
    /// `system:kube-scheduler`.
    ///
    /// # Errors
    /// If `text` names no such kubeconfig, or the scheduler does not start.
    pub fn start_scheduler_config(&mut self, text: &str) -> anyhow::Result<()> {
        self.scheduler = None;
        let (scheduler, port) = self.spawn_scheduler("kube-scheduler", text)?;
        self.scheduler = Some(scheduler);
        self.scheduler_port = port;
        Ok(())
    }

    /// Starts one more kube-scheduler, called `name` in the logs, with the configuration `text`
    /// (as [`Self::start_scheduler_config`] fills it in), as another control-plane host of an
    /// HA cluster would: it competes for the same leader lease. Returns it and its secure port.
    ///
    /// # Errors
    /// If `text` names no kubeconfig to fill in, or the scheduler does not start.
    pub fn spawn_scheduler(&self, name: &str, text: &str) -> anyhow::Result<(Proc, u16)> {
        if !text.contains(SCHEDULER_KUBECONFIG) {
            bail!("the scheduler configuration has no `{SCHEDULER_KUBECONFIG}` to fill in");
        }
        let kubeconfig = self.pki.kubeconfig(&self.server, "system:kube-scheduler", &[])?;
        let config = self.dir.join(format!("{name}-config.yaml"));
        std::fs::write(&config, text.replace(SCHEDULER_KUBECONFIG, &format!("kubeconfig: {}", kubeconfig.display())))?;
        let port = free_port()?;
        let mut args = vec![
            format!("--config={}", config.display()),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={port}"),
            // Its /metrics for the benchmarks, without delegated authentication.
            "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics".into(),
            "--v=2".into(),
        ];
        if self.minor < UNSCHEDULABLE_FLUSH_MINOR {
            // As docs/install.md asks of such a kube-scheduler: a pod the extender turned away
            // from a node whose gpushared was silent is retried within a minute of its return,
            // not on the five-minute flush.
            args.push(format!("--pod-max-in-unschedulable-pods-duration={UNSCHEDULABLE_FLUSH}"));
        }
        let scheduler = Proc::spawn(name, &self.bin.join("kube-scheduler"), args, vec![], &self.dir.join("logs"))?;
        Ok((scheduler, port))
    }
}
