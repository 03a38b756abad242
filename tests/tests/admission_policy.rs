//! The shipped admission policy (`etc/kubernetes/gpushare-admission-policy.yaml`) on the real
//! kube-apiserver, tried as a tenant would: an ordinary user (impersonated) who may create,
//! patch and bind pods in their namespace cannot write a GPU assignment, in a pod, a patch or a
//! Binding of their own, while the extender's identity binds with one; a pod asking for GPU
//! memory in a way gpushare refuses is refused at create with what to write, and the policy
//! refuses exactly the requests the core's rule refuses, so the two cannot disagree.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use gpushare_core::{MemoryUnit, PodRequest, PodSpec, ResourceNames};
use gpushare_testkit::realbox::apply_admission_policy;
use gpushare_testkit::realkube::{self, ControlPlane};
use serde_json::{Value, json};

mod realbox;
use realbox::repo;

const NS: &str = "team-a";
const TENANT: &str = "alice";

/// The control plane with the shipped RBAC and admission policy, a namespace the tenant may
/// create, patch and bind pods in, and the policy in force
/// ([`gpushare_testkit::realbox::apply_admission_policy`]); `None` where it cannot run.
fn plane() -> Option<(tempfile::TempDir, ControlPlane)> {
    if !realkube::available() {
        gpushare_testkit::skip_unless_ci("the admission policy test needs the real Kubernetes components");
        return None;
    }
    let dir = tempfile::Builder::new().prefix("gpushare-vap.").tempdir().unwrap();
    let plane = ControlPlane::start(dir.path(), &realkube::binaries().unwrap()).unwrap();
    if plane.minor < realkube::ADMISSION_POLICY_MINOR {
        eprintln!("skipped: ValidatingAdmissionPolicy v1 is served from Kubernetes 1.30 (this is 1.{})", plane.minor);
        return None;
    }
    plane.apply(&repo().join("etc/kubernetes/gpushare-extender-rbac.yaml")).unwrap();
    apply_admission_policy(&plane).unwrap();
    plane.kubectl(&["create", "namespace", NS]).unwrap();
    plane.kubectl(&["create", "serviceaccount", "default", "-n", NS]).unwrap();
    plane
        .kubectl(&[
            "create",
            "role",
            "pod-owner",
            "-n",
            NS,
            "--verb=get,list,create,update,patch,delete",
            "--resource=pods,pods/binding,bindings",
        ])
        .unwrap();
    plane
        .kubectl(&["create", "rolebinding", "pod-owner", "-n", NS, "--role=pod-owner", &format!("--user={TENANT}")])
        .unwrap();
    Some((dir, plane))
}

fn pod(name: &str, limits: &Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS},
        "spec": {"automountServiceAccountToken": false,
                 "containers": [{"name": "app", "image": "registry.example/app:1", "resources": {"limits": limits}}]}})
}

/// `kubectl create` as `user` (impersonated by the administrator); the API server's refusal as
/// the error. `dry_run`: admission runs, nothing is stored.
fn create_as(plane: &ControlPlane, user: &str, object: &Value, dry_run: bool) -> Result<String, String> {
    let name = object["metadata"]["name"].as_str().unwrap();
    let kind = object["kind"].as_str().unwrap().to_lowercase();
    let file = plane.dir.join(format!("{kind}-{name}-as-{user}.json"));
    std::fs::write(&file, object.to_string()).unwrap();
    // --validate=false: kubectl's own schema check of a Binding needs rights the tenant lacks.
    let mut args = vec![
        "create".to_owned(),
        "-f".into(),
        file.display().to_string(),
        format!("--as={user}"),
        "--validate=false".into(),
    ];
    if dry_run {
        args.push("--dry-run=server".into());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    plane.kubectl(&args).map_err(|e| format!("{e:#}"))
}

/// POSTs `binding` to its pod's `binding` subresource as `user`, as a scheduler binds.
fn bind_as(plane: &ControlPlane, user: &str, binding: &Value) -> Result<String, String> {
    let name = binding["metadata"]["name"].as_str().unwrap();
    let file = plane.dir.join(format!("binding-{name}-raw-as-{user}.json"));
    std::fs::write(&file, binding.to_string()).unwrap();
    let path = format!("/api/v1/namespaces/{NS}/pods/{name}/binding");
    kubectl_as(plane, user, &["create", "--raw", &path, "-f", &file.display().to_string()])
}

fn kubectl_as(plane: &ControlPlane, user: &str, args: &[&str]) -> Result<String, String> {
    let mut all = args.to_vec();
    let as_user = format!("--as={user}");
    all.push(&as_user);
    plane.kubectl(&all).map_err(|e| format!("{e:#}"))
}

#[test]
fn a_tenant_cannot_write_a_gpu_assignment_and_the_extender_can() {
    let Some((_dir, plane)) = plane() else { return };
    let grant = r#"{"v":1,"containers":[{"name":"app","gpus":[0,1],"mib":[100,7900]}]}"#;

    // A pod created with its grant already there, as a tenant would forge it.
    for key in ["gpushare.io/assignment", "ALIYUN_COM_GPU_MEM_IDX", "ALIYUN_COM_GPU_MEM_ASSIGNED"] {
        let mut forged = pod("forged", &json!({"gpushare.io/gpu-mem": "8000"}));
        forged["metadata"]["annotations"] = json!({key: if key == "gpushare.io/assignment" { grant } else { "0" }});
        forged["spec"]["nodeName"] = json!("gpu-node-1");
        let refused = create_as(&plane, TENANT, &forged, false).expect_err(key);
        assert!(refused.contains(&format!("only gpushare-extender writes {key}")), "{key}: {refused}");
        assert!(refused.contains("alice may not"), "{refused}");
    }

    // A pod of the tenant, then a patch that adds a grant: refused; another annotation: fine.
    create_as(&plane, TENANT, &pod("mine", &json!({"gpushare.io/gpu-mem": "8000"})), false).unwrap();
    let widen = json!({"metadata": {"annotations": {"gpushare.io/assignment": grant}}}).to_string();
    let refused = kubectl_as(&plane, TENANT, &["patch", "pod", "mine", "-n", NS, "--type=merge", "-p", &widen])
        .expect_err("a patch that adds a grant");
    assert!(refused.contains("only gpushare-extender writes gpushare.io/assignment"), "{refused}");
    let note = json!({"metadata": {"annotations": {"team": "nlp"}}}).to_string();
    kubectl_as(&plane, TENANT, &["patch", "pod", "mine", "-n", NS, "--type=merge", "-p", &note]).unwrap();

    // A Binding of the tenant's own that carries a grant: refused; one without: the policy
    // lets it through (binding rights are RBAC's to give).
    let binding = |annotations: Value| {
        json!({"apiVersion": "v1", "kind": "Binding",
               "metadata": {"name": "mine", "namespace": NS, "annotations": annotations},
               "target": {"apiVersion": "v1", "kind": "Node", "name": "gpu-node-1"}})
    };
    // Both routes: POST .../bindings (kubectl create) and .../pods/NAME/binding (schedulers).
    let refused = create_as(&plane, TENANT, &binding(json!({"gpushare.io/assignment": grant})), false)
        .expect_err("a tenant's Binding with a grant");
    assert!(refused.contains("only gpushare-extender writes gpushare.io/assignment"), "{refused}");
    let refused = bind_as(&plane, TENANT, &binding(json!({"gpushare.io/assignment": grant})))
        .expect_err("a tenant's pods/binding with a grant");
    assert!(refused.contains("only gpushare-extender writes gpushare.io/assignment"), "{refused}");
    create_as(&plane, TENANT, &binding(json!({"team": "nlp"})), true).unwrap();

    // The extender binds with the grant, through pods/binding, as it does for every pod.
    bind_as(&plane, "gpushare-extender", &binding(json!({"gpushare.io/assignment": grant}))).unwrap();
    let bound = plane.kubectl(&["get", "pod", "mine", "-n", NS, "-o", "json"]).unwrap();
    let bound: Value = serde_json::from_str(&bound).unwrap();
    assert_eq!(bound["spec"]["nodeName"], "gpu-node-1");
    assert_eq!(bound["metadata"]["annotations"]["gpushare.io/assignment"], grant);

    // Once bound, the tenant can neither change nor remove it.
    let remove = json!({"metadata": {"annotations": {"gpushare.io/assignment": null}}}).to_string();
    let refused = kubectl_as(&plane, TENANT, &["patch", "pod", "mine", "-n", NS, "--type=merge", "-p", &remove])
        .expect_err("a patch that removes the grant");
    assert!(refused.contains("only gpushare-extender writes gpushare.io/assignment"), "{refused}");
}

/// Requests the way users write them, each with what the API server must say. `None`: accepted.
fn requests() -> Vec<(&'static str, Value, Option<&'static str>)> {
    vec![
        ("plain", json!({"gpushare.io/gpu-mem": "3500"}), None),
        ("decimal-suffix", json!({"gpushare.io/gpu-mem": "8k", "gpushare.io/gpu-count": "2"}), None),
        ("two-gpus", json!({"gpushare.io/gpu-mem": "40000", "gpushare.io/gpu-count": "2"}), None),
        ("alibaba", json!({"aliyun.com/gpu-mem": "4"}), None),
        ("no-gpu", json!({"cpu": "1"}), None),
        (
            "wrong-unit",
            json!({"gpushare.io/gpu-mem": "4Gi"}),
            Some(
                r#"container "app": gpushare.io/gpu-mem "4Gi" counts 4294967296 units, because a binary suffix multiplies; gpushare counts plain MiB (GiB in a cluster set to GiB): write "4096" for 4Gi in MiB, or "4" in GiB"#,
            ),
        ),
        ("mebibytes", json!({"gpushare.io/gpu-mem": "3500Mi"}), Some(r#"write "3500" for 3500Mi in MiB"#)),
        (
            "alibaba-wrong-unit",
            json!({"aliyun.com/gpu-mem": "8Gi"}),
            Some(r#"aliyun.com/gpu-mem "8Gi" counts 8589934592 units"#),
        ),
        // Fractions: kube-apiserver's own validation of extended resources.
        // kube-apiserver's own message (1.30 prints the quantity's Go value where 1.37 says "500m").
        ("fraction", json!({"gpushare.io/gpu-mem": "0.5"}), Some("must be an integer")),
        (
            "count-only",
            json!({"gpushare.io/gpu-count": "2"}),
            Some(r#"container "app" sets gpushare.io/gpu-count but not gpushare.io/gpu-mem"#),
        ),
        ("zero", json!({"gpushare.io/gpu-mem": "0"}), Some(r#"container "app" asks for 0 gpushare.io/gpu-mem"#)),
        (
            "zero-gpus",
            json!({"gpushare.io/gpu-mem": "100", "gpushare.io/gpu-count": "0"}),
            Some(r#"container "app" asks for 0 gpushare.io/gpu-count"#),
        ),
        (
            "uneven",
            json!({"gpushare.io/gpu-mem": "1001", "gpushare.io/gpu-count": "2"}),
            Some(r#"container "app": 1001 does not split evenly over 2 GPUs; ask for a multiple of 2"#),
        ),
    ]
}

#[test]
fn a_request_gpushare_refuses_is_refused_at_create_with_what_to_write() {
    let Some((_dir, plane)) = plane() else { return };
    for (name, limits, expected) in requests() {
        let object = pod(name, &limits);
        let answer = create_as(&plane, TENANT, &object, true);
        // The core's rule, as gpushared and the extender apply it, on the same spec.
        let spec: PodSpec = serde_json::from_value(object["spec"].clone()).unwrap();
        let alibaba = limits.as_object().unwrap().keys().any(|k| k.starts_with("aliyun.com/"));
        let (names, unit) = if alibaba {
            (ResourceNames::alibaba(), MemoryUnit::Gib)
        } else {
            (ResourceNames::gpushare(), MemoryUnit::Mib)
        };
        let core = PodRequest::from_spec(&spec, &names, unit);
        match (expected, &answer) {
            (None, Ok(_)) => assert!(core.is_ok(), "{name}: the policy accepts what the core refuses: {core:?}"),
            (Some(message), Err(refused)) => {
                assert!(refused.contains(message), "{name}: {refused}");
                assert!(core.is_err(), "{name}: the policy refuses what the core accepts: {refused}");
            }
            _ => panic!("{name}: expected {expected:?}, the API server answered {answer:?}"),
        }
    }
    // Requests unequal to limits: kube-apiserver's own validation of extended resources.
    let mut unequal = pod("unequal", &json!({"gpushare.io/gpu-mem": "4000"}));
    unequal["spec"]["containers"][0]["resources"]["requests"] = json!({"gpushare.io/gpu-mem": "2000"});
    let refused = create_as(&plane, TENANT, &unequal, true).expect_err("requests unequal to limits");
    assert!(refused.contains("must be equal to gpushare.io/gpu-mem limit"), "{refused}");
    // An init container is held to the same rules, and named.
    let mut init = pod("init", &json!({"gpushare.io/gpu-mem": "1000"}));
    init["spec"]["initContainers"] = json!([{"name": "fetch", "image": "registry.example/fetch:1",
        "resources": {"limits": {"gpushare.io/gpu-mem": "2Gi"}}}]);
    let refused = create_as(&plane, TENANT, &init, true).expect_err("an init container's wrong unit");
    assert!(refused.contains(r#"container "fetch": gpushare.io/gpu-mem "2Gi""#), "{refused}");
}
