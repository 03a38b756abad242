//! A node whose kubelet counts the memory (`[kubelet] advertise = "capacity"`): each container
//! allocated as the runtime creates it, from its pod's assignment checked against its spec, and
//! its rows reconciled by its pod rather than by a device set.

use std::collections::BTreeSet;

use super::*;
use crate::allocation::reconcile::KubeletView;

fn creating(f: &Fixture, uid: &str, container: &str, env: &[&str]) -> Result<Creation, AllocError> {
    let pod = PodRef { namespace: "default".into(), name: format!("pod-{uid}"), uid: uid.into() };
    let env: Vec<String> = env.iter().map(|&s| s.to_owned()).collect();
    f.alloc.container_creating(&pod, container, &env)
}

fn grant(c: Creation) -> Edits {
    match c {
        Creation::Granted(edits) => edits,
        other => panic!("the container was not granted its whole answer: {other:?}"),
    }
}

fn environment(c: Creation) -> BTreeMap<String, String> {
    grant(c).envs
}

#[test]
fn a_container_is_allocated_as_it_is_created_and_gets_every_variable() {
    let f = fixture_counted();
    pod(&f, "u1", "2026-12-01T00:00:00Z", &[("main", ContainerRole::App, &[(1, 350)])]);
    // Its image says every GPU: gpushared's answer replaces that.
    let image = ["NVIDIA_VISIBLE_DEVICES=all", "PATH=/bin"];
    let env = environment(creating(&f, "u1", "main", &image).unwrap());
    assert_eq!(env.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str), Some("GPU-1"), "{env:?}");
    assert_eq!(env.get("GPUSHARE_MEMORY_MIB").map(String::as_str), Some("350"), "{env:?}");
    assert_eq!(env.get("CUDA_DEVICE_MEMORY_LIMIT_0").map(String::as_str), Some("350m"), "{env:?}");
    assert_eq!(env.get("GPUSHARE_POD").map(String::as_str), Some("default/pod-u1"), "{env:?}");
    assert!(!env.contains_key("PATH"), "{env:?}");
    let live = f.alloc.live().unwrap();
    assert_eq!(live.len(), 1);
    assert_eq!((live[0].gpu_index, live[0].mib.get(), live[0].device_ids.len()), (1, 350, 0));

    // Created again (a restart): the same answer, nothing written.
    assert_eq!(environment(creating(&f, "u1", "main", &image).unwrap()), env);
    assert_eq!(f.alloc.live().unwrap().len(), 1);

    // A container of the pod that asks for no memory, and a pod the store does not have.
    assert_eq!(creating(&f, "u1", "sidecar", &image).unwrap(), Creation::NotOurs);
    assert_eq!(creating(&f, "u9", "main", &image).unwrap(), Creation::NotOurs);
    // One whose own spec names a pod in GPUSHARE_POD does not start.
    let e = creating(&f, "u9", "main", &["GPUSHARE_POD=default/pod-u1"]).unwrap_err();
    assert!(matches!(e, AllocError::WrongPod { .. }), "{e}");
    assert!(e.to_string().contains("asks for no GPU memory on this node"), "{e}");
}

#[test]
fn a_counted_container_gets_its_gpus_device_nodes_and_on_mps_gpus_the_pipe_directory() {
    let text = "[device_nodes]\nenabled = true\nhost_dir = \"/host/dev\"\ncontrol = [\"nvidiactl\"]\n";
    let nodes = crate::config::Config::parse(text, std::path::Path::new("t.toml")).unwrap().device_nodes;
    let f = fixture_mps(Compatibility::Gpushare, &[2], |a| {
        a.with_advertise(crate::config::Advertise::Capacity).with_device_nodes(nodes)
    });
    pod(&f, "u1", "2026-12-01T00:00:00Z", &[("main", ContainerRole::App, &[(0, 100)])]);
    pod(&f, "u2", "2026-12-01T00:00:01Z", &[("main", ContainerRole::App, &[(2, 100)])]);
    let names = |e: &Edits| -> Vec<(String, String)> {
        e.devices.iter().map(|d| (d.host_path.display().to_string(), d.container_path.display().to_string())).collect()
    };
    let shared = grant(creating(&f, "u1", "main", &[]).unwrap());
    assert_eq!(
        names(&shared),
        [("/host/dev/nvidia4".into(), "/dev/nvidia4".into()), ("/host/dev/nvidiactl".into(), "/dev/nvidiactl".into())]
    );
    assert!(shared.mounts.is_empty() && !shared.envs.contains_key("CUDA_MPS_PIPE_DIRECTORY"), "{shared:?}");
    let mps = grant(creating(&f, "u2", "main", &[]).unwrap());
    assert_eq!(names(&mps)[0], ("/host/dev/nvidia6".into(), "/dev/nvidia6".into()));
    let pipe = std::path::Path::new("/run/nvidia-mps");
    assert_eq!(mps.mounts, [Mount { path: pipe.to_path_buf(), read_only: true }]);
    assert_eq!(mps.envs.get("CUDA_MPS_PIPE_DIRECTORY").map(String::as_str), Some("/run/nvidia-mps"));
    // Created again: the same grant from the rows it holds.
    assert_eq!(grant(creating(&f, "u2", "main", &[]).unwrap()), mps);
}

#[test]
fn a_container_without_a_usable_grant_is_refused_and_nothing_is_allocated() {
    let f = fixture_counted();
    // The spec asks for 400 MiB on one GPU; the annotation, which the pod's owner may write,
    // spreads it over two.
    let one_gpu: &[ContainerSpec<'_>] = &[("main", ContainerRole::App, &[(0, 400)])];
    pod_asking(&f, "wide", "2026-12-01T00:00:01Z", &[("main", ContainerRole::App, &[(0, 200), (1, 200)])], one_gpu);
    let e = creating(&f, "wide", "main", &[]).unwrap_err();
    assert!(matches!(e, AllocError::NotServed { .. }), "{e}");
    assert!(e.to_string().contains("over 2 GPU(s), it asks for 1"), "{e}");

    // Asking, but placed by no extender.
    pod(&f, "bare", "2026-12-01T00:00:02Z", &[("main", ContainerRole::App, &[(0, 100)])]);
    let mut stored = f.pods.get("bare").unwrap().view.clone();
    stored.annotations.clear();
    f.pods.upsert(stored);
    let e = creating(&f, "bare", "main", &[]).unwrap_err();
    assert!(e.to_string().contains("has no gpushare.io/assignment annotation"), "{e}");

    // Assigned to another node.
    pod(&f, "far", "2026-12-01T00:00:03Z", &[("main", ContainerRole::App, &[(0, 100)])]);
    let mut stored = f.pods.get("far").unwrap().view.clone();
    stored.node = Some("node-b".into());
    f.pods.upsert(stored);
    let e = creating(&f, "far", "main", &[]).unwrap_err();
    assert!(e.to_string().contains("not running on node node-a"), "{e}");

    // No room left on the GPU by the ledger.
    pod(&f, "big", "2026-12-01T00:00:04Z", &[("main", ContainerRole::App, &[(2, 700)])]);
    pod(&f, "late", "2026-12-01T00:00:05Z", &[("main", ContainerRole::App, &[(2, 700)])]);
    creating(&f, "big", "main", &[]).unwrap();
    let e = creating(&f, "late", "main", &[]).unwrap_err();
    assert!(matches!(e, AllocError::NoRoom { .. }), "{e}");
    let live = f.alloc.live().unwrap();
    assert_eq!(live.iter().map(|r| r.pod.uid.as_str()).collect::<Vec<_>>(), ["big"], "{live:?}");
}

#[test]
fn a_counted_node_tells_lookalikes_apart_without_the_kubelet() {
    // Each grant names its pod by UID at the container's creation: the extender need not keep
    // look-alikes apart, whether or not the kubelet's PodResources answered.
    assert!(fixture_counted().alloc.node_state(1, "x").tells_lookalikes_apart);
    assert!(!fixture(Compatibility::Gpushare).alloc.node_state(1, "x").tells_lookalikes_apart);
}

#[test]
fn rows_of_no_device_are_kept_while_their_pod_runs_and_released_after() {
    let f = fixture_counted();
    pod(&f, "u1", "2026-12-01T00:00:00Z", &[("main", ContainerRole::App, &[(0, 100)])]);
    creating(&f, "u1", "main", &[]).unwrap();
    let listed =
        KubeletView { pods: BTreeSet::from([("default".to_owned(), "pod-u1".to_owned())]), holdings: Vec::new() };
    // The kubelet lists the pod, and holds no device of it: nothing to repair.
    assert!(f.alloc.reconcile(&listed, 0).unwrap().0.is_empty());
    // The kubelet no longer lists it, but the API server has it running here: kept, with no
    // grace period that could keep it instead (reconcile's second argument is the grace).
    let (repairs, _) = f.alloc.reconcile(&KubeletView::default(), 0).unwrap();
    assert!(repairs.is_empty(), "the API server still has it running: {repairs:?}");
    // Neither the kubelet nor the API server has it running here: released.
    f.pods.remove("u1", 1);
    let (repairs, _) = f.alloc.reconcile(&KubeletView::default(), 0).unwrap();
    assert_eq!(repairs.len(), 1, "{repairs:?}");
    assert!(f.alloc.live().unwrap().is_empty());
}
