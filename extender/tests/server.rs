//! The extender as kube-scheduler and operators meet it: HTTP with the exact JSON
//! kube-scheduler sends, a view fed by watches of the API-server stand-in, Bindings created
//! there, the inspect view, metrics, health; and the two binaries (`gpushare-extender` serving,
//! over TLS too, and `kubectl-inspect-gpushare`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};
use gpushare_core::{GpuUuid, MemoryUnit, Mib};
use gpushare_testkit::apiserver::ApiServer;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

mod common;
use common::{http, node_object, pod_object, split_response, start, until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_scheduler_json_in_one_binding_out() {
    let h = start(1024 * 1024).await;
    let (status, body) = http(h.addr, "GET", "/readyz", "").await;
    assert!(status == 503 || status == 200, "{status} {body}");
    h.api.create_node(node_object("gpu-a", 2, 15_360)).unwrap();
    h.api.create_node(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "cpu-1"}})).unwrap();
    let pod = h.api.create_pod("default", pod_object("infer", 3500)).unwrap();
    let uid = pod["metadata"]["uid"].as_str().unwrap().to_owned();
    until("ready", async || http(h.addr, "GET", "/readyz", "").await.0 == 200).await;
    until("the pod and node in the view", async || {
        h.ext.with_view(|v| v.pod(&uid).is_some() && v.inventory("gpu-a").is_ok() && v.counts().0 == 2)
    })
    .await;

    // Exactly what kube-scheduler sends with nodeCacheCapable: true (Go's nulls included).
    let filter = json!({"Pod": pod, "Nodes": null, "NodeNames": ["gpu-a", "cpu-1"]}).to_string();
    let (status, body) = http(h.addr, "POST", "/gpushare-scheduler/filter", &filter).await;
    assert_eq!(status, 200, "{body}");
    let result: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(result["NodeNames"], json!(["gpu-a"]), "{body}");
    assert_eq!(result["Nodes"], Value::Null);
    assert!(result["FailedAndUnresolvableNodes"]["cpu-1"].as_str().unwrap().contains("gpushared is not running"));
    assert_eq!(result["Error"], "");

    // nodeCacheCapable: false: full Node objects in, the passing ones back.
    let full = json!({"Pod": pod, "Nodes": {"items": [h.api.node("gpu-a").unwrap(), h.api.node("cpu-1").unwrap()]}, "NodeNames": null});
    let (_, body) = http(h.addr, "POST", "/gpushare-scheduler/filter", &full.to_string()).await;
    let result: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(result["Nodes"]["items"][0]["metadata"]["name"], "gpu-a");
    assert_eq!(result["Nodes"]["items"].as_array().unwrap().len(), 1);

    let (status, body) = http(h.addr, "POST", "/gpushare-scheduler/prioritize", &filter).await;
    assert_eq!(status, 200, "{body}");
    let scores: Vec<Value> = serde_json::from_str(&body).unwrap();
    assert_eq!(scores.len(), 2);
    assert!(scores.iter().all(|s| s["Score"].as_i64().unwrap() <= 10 && s["Host"].is_string()));

    // The bind route binds only what kube-scheduler would send it: not a pod that asks for no
    // GPU memory, not one of another scheduler.
    let plain = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain", "namespace": "default"},
        "spec": {"containers": [{"name": "main", "image": "x"}]}});
    let plain = h.api.create_pod("default", plain).unwrap();
    let mut theirs = pod_object("theirs", 3500);
    theirs["spec"]["schedulerName"] = json!("other-scheduler");
    let theirs = h.api.create_pod("default", theirs).unwrap();
    h.api.clear_requests();
    for (pod, why) in [(&plain, "asks for no GPU memory"), (&theirs, "not by one this extender serves")] {
        let bind = json!({"PodName": pod["metadata"]["name"], "PodNamespace": "default",
            "PodUID": pod["metadata"]["uid"], "Node": "gpu-a"});
        let (status, body) = http(h.addr, "POST", "/gpushare-scheduler/bind", &bind.to_string()).await;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains(why), "{body}");
    }
    assert!(h.api.requests().iter().all(|(m, _)| m == "GET"), "{:?}", h.api.requests());

    let bind = json!({"PodName": "infer", "PodNamespace": "default", "PodUID": uid, "Node": "gpu-a"}).to_string();
    let (status, body) = http(h.addr, "POST", "/gpushare-scheduler/bind", &bind).await;
    assert_eq!((status, body.as_str()), (200, r#"{"Error":""}"#));
    // One write: the Binding. No patch of the pod before or after it.
    let writes: Vec<_> = h.api.requests().into_iter().filter(|(m, _)| m != "GET").collect();
    assert_eq!(writes.len(), 1, "{writes:?}");
    assert!(writes[0].1.starts_with("/api/v1/namespaces/default/pods/infer/binding"), "{writes:?}");
    let stored = h.api.pod("default", "infer").unwrap();
    assert_eq!(stored["spec"]["nodeName"], "gpu-a");
    let a = Assignment::decode(stored["metadata"]["annotations"][ASSIGNMENT_KEY].as_str().unwrap()).unwrap();
    assert_eq!(a.containers[0].gpus[0].mib, Mib::new(3500));
    // A retried bind is answered the same, with no second Binding.
    let (_, body) = http(h.addr, "POST", "/gpushare-scheduler/bind", &bind).await;
    assert_eq!(body, r#"{"Error":""}"#);
    assert_eq!(h.api.requests().iter().filter(|(m, _)| m == "POST").count(), 1);

    // The inspect view and metrics see it.
    until("the bound pod in the view", async || {
        h.ext.with_view(|v| v.pod(&uid).is_some_and(|p| p.node.as_deref() == Some("gpu-a")))
    })
    .await;
    let (status, body) = http(h.observe, "GET", "/gpushare-scheduler/inspect/gpu-a", "").await;
    assert_eq!(status, 200, "{body}");
    let report: Value = serde_json::from_str(&body).unwrap();
    let gpus = report["nodes"][0]["gpus"].as_array().unwrap();
    assert_eq!(gpus.iter().map(|g| g["usedMiB"].as_u64().unwrap()).sum::<u64>(), 3500);
    let (status, body) = http(h.observe, "GET", "/gpushare-scheduler/inspect/nowhere", "").await;
    assert_eq!(status, 404, "{body}");
    let (_, metrics) = http(h.observe, "GET", "/metrics", "").await;
    assert!(metrics.contains("gpushare_extender_binds_total{outcome=\"bound\"} 2"), "{metrics}");
    // Each listener serves only its own: no metrics or pods on the scheduler's port, no verbs
    // on the observer's; health on both.
    for path in ["/metrics", "/gpushare-scheduler/inspect", "/gpushare-scheduler/inspect/gpu-a"] {
        assert_eq!(http(h.addr, "GET", path, "").await.0, 404, "{path} on the scheduler's port");
    }
    assert_eq!(http(h.observe, "POST", "/gpushare-scheduler/bind", &bind).await.0, 404);
    assert_eq!(http(h.observe, "GET", "/readyz", "").await.0, 200);
    assert!(metrics.contains("gpushare_gpu_memory_total_mib{node=\"gpu-a\",gpu=\"0\",uuid=\"GPU-gpu-a-0\"} 15360"));
    assert!(metrics.contains("gpushare_extender_request_duration_seconds_count{verb=\"filter\"} 2"));
    assert_eq!(http(h.addr, "GET", "/healthz", "").await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_requests_get_a_reason_not_a_panic() {
    let h = start(4096).await;
    for (verb, body) in [
        ("filter", "{not json"),
        ("filter", r#"{"NodeNames": ["a"]}"#),
        ("prioritize", r#"{"Pod": 7}"#),
        ("bind", r#"{"PodName": 1}"#),
        ("preempt", "[]"),
    ] {
        let (status, text) = http(h.addr, "POST", &format!("/gpushare-scheduler/{verb}"), body).await;
        assert_eq!(status, 400, "{verb} {body}: {text}");
        assert!(text.starts_with(&format!("malformed {verb} request: ")), "{text}");
    }
    let huge = format!(r#"{{"Pod": {{}}, "NodeNames": ["{}"]}}"#, "x".repeat(10_000));
    assert_eq!(http(h.addr, "POST", "/gpushare-scheduler/filter", &huge).await.0, 413);
    let (_, metrics) = http(h.observe, "GET", "/metrics", "").await;
    assert!(metrics.contains("gpushare_extender_bad_requests_total 5"), "{metrics}");
    // A bind when the API server refuses: the error says so and nothing stays assumed.
    h.api.create_node(node_object("gpu-a", 1, 1000)).unwrap();
    h.api.create_pod("default", pod_object("p", 100)).unwrap();
    until("ready", async || h.ext.is_ready()).await;
    until("node and pod", async || h.ext.with_view(|v| v.counts().0 == 1 && v.pod_named("default", "p").is_some()))
        .await;
    let bind = json!({"PodName": "p", "PodNamespace": "default", "PodUID": "not-the-uid", "Node": "gpu-a"}).to_string();
    let (_, body) = http(h.addr, "POST", "/gpushare-scheduler/bind", &bind).await;
    assert!(body.contains("re-created") || body.contains("UID"), "{body}");
    assert_eq!(h.ext.with_view(|v| v.counts().2), 0);
}

fn free_port() -> u16 {
    gpushare_testkit::ports::free_port().unwrap()
}

struct Child(std::process::Child);
impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binaries_serve_check_configs_and_inspect() {
    let api = ApiServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    api.create_node(node_object("gpu-a", 2, 15_360)).unwrap();
    api.create_node(node_object("gpu-b", 1, 15_360)).unwrap();
    let mut pod = pod_object("infer", 3500);
    pod["metadata"]["annotations"] = json!({ASSIGNMENT_KEY: Assignment {
        node: "gpu-a".into(), unit: MemoryUnit::Mib,
        containers: vec![gpushare_core::codec::assignment::ContainerAssignment {
            name: "main".into(), role: gpushare_core::ContainerRole::App,
            gpus: vec![gpushare_core::codec::assignment::GpuShare { index: 1, uuid: GpuUuid::new("GPU-gpu-a-1").unwrap(), mib: Mib::new(3500) }],
        }],
    }.encode().unwrap()});
    pod["spec"]["nodeName"] = json!("gpu-a");
    api.create_pod("default", pod).unwrap();

    // kubectl-inspect-gpushare through KUBECONFIG.
    let inspect = env!("CARGO_BIN_EXE_kubectl-inspect-gpushare");
    let out = Command::new(inspect).env("KUBECONFIG", &kubeconfig).output().unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        table.starts_with("NAME   IPADDRESS  GPU0(Allocated/Total)  GPU1(Allocated/Total)  GPU Memory(MiB)\n"),
        "{table}"
    );
    assert!(table.contains("gpu-a  10.0.0.7   0/15360                3500/15360             3500/30720\n"), "{table}");
    assert!(table.ends_with("3500/46080 (7%)\n"), "{table}");
    let out = Command::new(inspect).args(["-d", "gpu-a"]).env("KUBECONFIG", &kubeconfig).output().unwrap();
    let details = String::from_utf8_lossy(&out.stdout);
    // No pending pod there: no pending column, as Alibaba's; the totals align with the table.
    assert!(details.contains("NAME         NAMESPACE   GPU0(Allocated)  GPU1(Allocated)\n"), "{details}");
    assert!(details.contains("infer        default     0                3500\n"), "{details}");
    assert!(details.contains("Allocated :  3500 (11%)\nTotal :      30720\n"), "{details}");
    assert!(!details.contains("Pending"), "{details}");
    let out = Command::new(inspect).args(["-o", "json"]).env("KUBECONFIG", &kubeconfig).output().unwrap();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["nodes"][0]["gpus"][1]["pods"][0]["pod"], "default/infer");
    // No cluster: one line, non-zero.
    let out =
        Command::new(inspect).env("KUBECONFIG", dir.path().join("missing")).env("HOME", dir.path()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("kubectl-inspect-gpushare: "), "{err}");

    // A node that does not exist, one that is no gpushare node, one whose annotation cannot
    // be read: each is said, and the exit status is non-zero.
    api.create_node(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "cpu-1"}})).unwrap();
    api.create_node(json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "broken", "annotations": {"gpushare.io/node-state": "{\"v\":9}"}}}))
        .unwrap();
    for (node, want) in [
        ("nope", "node \"nope\" does not exist"),
        ("cpu-1", "node \"cpu-1\" is not a gpushare node"),
        ("broken", "node \"broken\": its gpushare.io/node-state annotation cannot be read: "),
    ] {
        let out = Command::new(inspect).arg(node).env("KUBECONFIG", &kubeconfig).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && out.stdout.is_empty(), "{node}: {err}");
        assert!(err.contains(want), "{node}: {err}");
    }

    // gpushare-extender --check-config.
    let extender = env!("CARGO_BIN_EXE_gpushare-extender");
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/../etc/gpushare-extender.toml");
    let out = Command::new(extender).args(["--check-config", shipped]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[server]\nlisten = \"127.0.0.1:1\"\nprefix = \"nope\"\n").unwrap();
    let out = Command::new(extender).args(["--check-config"]).arg(&bad).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("server.prefix"), "{}", String::from_utf8_lossy(&out.stderr));
    // An open listener with nobody authenticated is refused before it serves anything.
    std::fs::write(&bad, "[server]\nlisten = \"0.0.0.0:39999\"\n").unwrap();
    let out = Command::new(extender).args(["--check-config"]).arg(&bad).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("reachable beyond this host") && err.contains("client_ca"), "{err}");
    let out = Command::new(extender).arg("--config").arg(&bad).output().unwrap();
    assert!(!out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // The server, over TLS, with a CA and a server certificate made here.
    let (ca, ca_key) = (dir.path().join("ca.crt"), dir.path().join("ca.key"));
    let (cert, key, csr) = (dir.path().join("tls.crt"), dir.path().join("tls.key"), dir.path().join("tls.csr"));
    let ext_file = dir.path().join("ext.cnf");
    std::fs::write(&ext_file, "subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\n").unwrap();
    let openssl = |args: &[&std::ffi::OsStr]| {
        let status = Command::new("openssl")
            .args(args)
            .stderr(Stdio::null())
            .status()
            .expect("openssl is needed for the TLS test (.ci/run installs it)");
        assert!(status.success(), "openssl {args:?}");
    };
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"].map(std::ffi::OsStr::new);
    let os = |s: &'static str| std::ffi::OsStr::new(s);
    openssl(
        &[
            &[os("req"), os("-x509")],
            &ec[..],
            &[
                os("-days"),
                os("1"),
                os("-subj"),
                os("/CN=test-ca"),
                os("-keyout"),
                ca_key.as_os_str(),
                os("-out"),
                ca.as_os_str(),
            ],
        ]
        .concat(),
    );
    openssl(
        &[
            &[os("req")],
            &ec[..],
            &[os("-subj"), os("/CN=localhost"), os("-keyout"), key.as_os_str(), os("-out"), csr.as_os_str()],
        ]
        .concat(),
    );
    openssl(&[
        os("x509"),
        os("-req"),
        os("-in"),
        csr.as_os_str(),
        os("-CA"),
        ca.as_os_str(),
        os("-CAkey"),
        ca_key.as_os_str(),
        os("-CAcreateserial"),
        os("-days"),
        os("1"),
        os("-extfile"),
        ext_file.as_os_str(),
        os("-out"),
        cert.as_os_str(),
    ]);
    // kube-scheduler's client certificate, from the same CA (its extender tlsConfig).
    let (client_cert, client_key, client_csr) =
        (dir.path().join("client.crt"), dir.path().join("client.key"), dir.path().join("client.csr"));
    let client_ext = dir.path().join("client.cnf");
    std::fs::write(&client_ext, "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n").unwrap();
    openssl(
        &[
            &[os("req")],
            &ec[..],
            &[
                os("-subj"),
                os("/CN=system:kube-scheduler"),
                os("-keyout"),
                client_key.as_os_str(),
                os("-out"),
                client_csr.as_os_str(),
            ],
        ]
        .concat(),
    );
    openssl(&[
        os("x509"),
        os("-req"),
        os("-in"),
        client_csr.as_os_str(),
        os("-CA"),
        ca.as_os_str(),
        os("-CAkey"),
        ca_key.as_os_str(),
        os("-CAcreateserial"),
        os("-days"),
        os("1"),
        os("-extfile"),
        client_ext.as_os_str(),
        os("-out"),
        client_cert.as_os_str(),
    ]);
    let (port, observe_port) = (free_port(), free_port());
    let config = dir.path().join("extender.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nobserve_listen = \"127.0.0.1:{observe_port}\"\n\
             tls_cert = \"{}\"\ntls_key = \"{}\"\nclient_ca = \"{}\"\n[kubernetes]\nkubeconfig = \"{}\"\n",
            cert.display(),
            key.display(),
            ca.display(),
            kubeconfig.display()
        ),
    )
    .unwrap();
    let _child = Child(Command::new(extender).arg("--config").arg(&config).stderr(Stdio::null()).spawn().unwrap());
    let tls = tls_client(&ca, Some((&client_cert, &client_key)));
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    until("the TLS server ready", async || tls_get(&tls, addr, "/readyz").await.is_some_and(|(s, _)| s == 200)).await;
    // The inspect view on the observer's listener, with the same TLS and client authentication.
    let observe = SocketAddr::from(([127, 0, 0, 1], observe_port));
    let (status, body) = tls_get(&tls, observe, "/gpushare-scheduler/inspect").await.unwrap();
    assert_eq!(status, 200);
    assert!(body.contains("\"name\":\"gpu-b\""), "{body}");
    assert_eq!(tls_get(&tls, addr, "/gpushare-scheduler/inspect").await.unwrap().0, 404);
    // A caller without a client certificate gets no answer at all, bind included, on either.
    let anonymous = tls_client(&ca, None);
    for (at, path) in [(addr, "/healthz"), (addr, "/gpushare-scheduler/bind"), (observe, "/gpushare-scheduler/inspect")]
    {
        let answer = tls_get(&anonymous, at, path).await;
        assert!(matches!(answer, None | Some((0, _))), "{path}: {answer:?}");
    }
    // Plain HTTP to the TLS port gets nothing useful.
    let plain = tokio::time::timeout(Duration::from_secs(5), http(addr, "GET", "/healthz", "")).await;
    assert!(plain.is_err() || plain.is_ok_and(|(s, _)| s != 200));
}

/// A TLS client trusting `ca`, presenting `identity` (certificate, key) when given.
fn tls_client(
    ca: &std::path::Path,
    identity: Option<(&std::path::Path, &std::path::Path)>,
) -> tokio_rustls::TlsConnector {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match identity {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = CertificateDer::pem_file_iter(cert).unwrap().collect::<Result<Vec<_>, _>>().unwrap();
            builder.with_client_auth_cert(chain, PrivateKeyDer::from_pem_file(key).unwrap()).unwrap()
        }
    };
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

async fn tls_get(tls: &tokio_rustls::TlsConnector, addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
    let name = rustls::pki_types::ServerName::try_from("localhost").ok()?;
    let mut stream = tls.connect(name, tcp).await.ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw).await;
    Some(split_response(&raw))
}
