//! The real `kubectl` (v1.32 on the build machines) against the API-server stand-in: get nodes
//! (with label selectors), create, apply (create and patch), get and delete pods with kubectl's
//! default strict field validation, so the stand-in cannot drift from the protocol real clients
//! speak.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

use gpushare_testkit::apiserver::ApiServer;
use serde_json::json;

/// `kubectl ARGS` against `api`: exit success and output.
fn kubectl(kubeconfig: &std::path::Path, args: &[&str], stdin: Option<&str>) -> (bool, String) {
    use std::io::Write as _;
    let mut cmd = Command::new("kubectl");
    cmd.arg("--kubeconfig").arg(kubeconfig).args(args);
    cmd.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().expect("kubectl must be installed");
    if let Some(text) = stdin {
        child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    } else {
        drop(child.stdin.take());
    }
    let out = child.wait_with_output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_gets_creates_applies_and_deletes() {
    if Command::new("kubectl").arg("version").arg("--client").output().is_err() {
        gpushare_testkit::skip_unless_ci("kubectl is not installed (the build machines carry v1.32)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let api = ApiServer::start().await.unwrap();
    let kc = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kc).unwrap();
    api.create_node(json!({"metadata": {"name": "gpu-node-a", "labels": {"gpu": "yes"}}})).unwrap();
    let run = |args: &[&str], stdin: Option<&str>| {
        let kc = kc.clone();
        let args: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
        let stdin = stdin.map(str::to_owned);
        std::thread::spawn(move || {
            let a: Vec<&str> = args.iter().map(String::as_str).collect();
            kubectl(&kc, &a, stdin.as_deref())
        })
        .join()
        .unwrap()
    };
    let ok = |args: &[&str], stdin: Option<&str>| {
        let (success, out) = run(args, stdin);
        assert!(success, "kubectl {}: {out}", args.join(" "));
        out
    };

    let out = ok(&["get", "nodes"], None);
    assert!(out.contains("gpu-node-a"), "{out}");
    assert!(ok(&["get", "nodes", "-l", "gpu=yes"], None).contains("gpu-node-a"));
    assert!(ok(&["get", "nodes", "-l", "gpu=no"], None).contains("No resources found"));

    // create, with kubectl's default (strict) field validation.
    let pod = r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p1","namespace":"default"},
                  "spec":{"nodeName":"gpu-node-a","containers":[{"name":"main","image":"x"}]}}"#;
    assert!(ok(&["create", "-f", "-"], Some(pod)).contains("pod/p1 created"));
    assert!(api.pod("default", "p1").is_some());
    let (created, out) = run(&["create", "-f", "-"], Some(pod));
    assert!(!created && out.contains("AlreadyExists"), "a second create is refused: {out}");
    // Server-side printing: the real server's columns.
    let out = ok(&["get", "pods"], None);
    assert!(out.starts_with("NAME   READY   STATUS    RESTARTS   AGE"), "{out}");
    assert!(out.contains("p1     0/1     Pending   0"), "{out}");
    let out = ok(&["get", "pods", "-o", "wide"], None);
    assert!(out.contains("NODE") && out.contains("gpu-node-a"), "{out}");
    assert!(ok(&["get", "nodes"], None).contains("STATUS"));
    assert!(ok(&["get", "pods", "--field-selector", "spec.nodeName=gpu-node-a"], None).contains("p1"));

    // apply: a new object is created, an existing one patched.
    let second = r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p2","namespace":"default"},
                     "spec":{"containers":[{"name":"main","image":"x"}]}}"#;
    assert!(ok(&["apply", "-f", "-"], Some(second)).contains("pod/p2 created"));
    let labelled = r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p1","namespace":"default","labels":{"app":"x"}},
                       "spec":{"nodeName":"gpu-node-a","containers":[{"name":"main","image":"x"}]}}"#;
    assert!(ok(&["apply", "-f", "-"], Some(labelled)).contains("pod/p1 configured"));
    assert_eq!(api.pod("default", "p1").unwrap()["metadata"]["labels"]["app"], "x");
    let json: serde_json::Value = serde_json::from_str(&ok(&["get", "pod", "p1", "-o", "json"], None)).unwrap();
    assert_eq!(json["metadata"]["labels"]["app"], "x");
    assert!(json["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"].is_string());

    // delete.
    assert!(ok(&["delete", "pod", "p1"], None).contains("pod \"p1\" deleted"));
    assert!(api.pod("default", "p1").is_none());
    let out = ok(&["get", "pods"], None);
    assert!(!out.contains("p1") && out.contains("p2"), "{out}");
    let (found, out) = run(&["get", "pod", "p1"], None);
    assert!(!found && out.contains("NotFound"), "{out}");
}
