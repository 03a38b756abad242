//! Allocator tests: the kubelet's call sequences for every request shape, against a real
//! ledger file and a pod store filled as the API-server watch would fill it.

use std::collections::{BTreeMap, BTreeSet};

use gpushare_core::codec::alibaba;
use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment, ContainerAssignment, GpuShare};
use gpushare_core::codec::node::PodRef;
use gpushare_core::{Gpu, GpuUuid, MemoryUnit, Mib};

use crate::allocation::pods::PodView;

use super::*;

const GPU_MIB: u64 = 1000;

fn uuid(i: u32) -> GpuUuid {
    GpuUuid::new(format!("GPU-{i}")).unwrap()
}

/// An allocator for node-a with three 1000 MiB GPUs (minor numbers 4-6), its ledger in a
/// temporary directory; also the plugin's tests' (`crate::kubelet::plugin`).
pub(crate) struct Fixture {
    _dir: tempfile::TempDir,
    pods: PodStore,
    names: ResourceNames,
    pub(crate) alloc: Arc<Allocator>,
    /// Devices the kubelet has handed out, as it tracks them.
    in_use: std::cell::RefCell<BTreeSet<String>>,
}

pub(crate) fn fixture(compat: Compatibility) -> Fixture {
    fixture_naming(compat, crate::config::DeviceNodesConfig::default())
}

/// [`fixture`] naming the device nodes `nodes` says.
fn fixture_naming(compat: Compatibility, nodes: crate::config::DeviceNodesConfig) -> Fixture {
    fixture_with(compat, nodes, crate::config::ContainerEnvironment::Full)
}

/// [`fixture`] naming the device nodes `nodes` says, answering with `environment`.
fn fixture_with(
    compat: Compatibility,
    nodes: crate::config::DeviceNodesConfig,
    environment: crate::config::ContainerEnvironment,
) -> Fixture {
    fixture_built(compat, |a| a.with_device_nodes(nodes).with_environment(environment))
}

/// [`fixture`] where the kubelet counts the memory (`[kubelet] advertise = "capacity"`).
pub(crate) fn fixture_counted() -> Fixture {
    fixture_built(Compatibility::Gpushare, |a| a.with_advertise(crate::config::Advertise::Capacity))
}

/// [`fixture`], the allocator finished by `build`.
fn fixture_built(compat: Compatibility, build: impl FnOnce(Allocator) -> Allocator) -> Fixture {
    fixture_mps(compat, &[], build)
}

/// [`fixture_built`] with the GPUs of indexes `mps` in MPS mode.
pub(crate) fn fixture_mps(compat: Compatibility, mps: &[u32], build: impl FnOnce(Allocator) -> Allocator) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::open(&dir.path().join("ledger.db")).unwrap().ledger;
    let gpus = (0..3)
        .map(|i| {
            let mut g = Gpu::new(i, uuid(i), "Tesla T4", Mib::new(GPU_MIB));
            g.minor = Some(i + 4);
            if mps.contains(&i) {
                g.mode = gpushare_core::SharingMode::Mps;
            }
            g
        })
        .collect();
    let inventory = NodeInventory::new(MemoryUnit::Mib, gpus).unwrap();
    let pods = PodStore::new();
    let names = match compat {
        Compatibility::Gpushare => ResourceNames::gpushare(),
        Compatibility::Alibaba => ResourceNames::alibaba(),
    };
    let alloc = build(Allocator::new("node-a".into(), names.clone(), compat, inventory, pods.clone(), ledger).unwrap());
    Fixture { _dir: dir, pods, names, alloc: Arc::new(alloc), in_use: std::cell::RefCell::default() }
}

/// A container of a test pod: name, role, and its (GPU index, MiB) shares.
pub(crate) type ContainerSpec<'a> = (&'a str, ContainerRole, &'a [(u32, u64)]);

/// A pod bound to node-a with an assignment.
pub(crate) fn pod(f: &Fixture, uid: &str, created: &str, containers: &[ContainerSpec<'_>]) {
    pod_asking(f, uid, created, containers, containers);
}

/// A pod bound to node-a whose annotation assigns `containers` while its spec asks for `asks`.
pub(crate) fn pod_asking(
    f: &Fixture,
    uid: &str,
    created: &str,
    containers: &[ContainerSpec<'_>],
    asks: &[ContainerSpec<'_>],
) {
    let assignment = Assignment {
        node: "node-a".into(),
        unit: MemoryUnit::Mib,
        containers: containers
            .iter()
            .map(|(name, role, gpus)| ContainerAssignment {
                name: (*name).into(),
                role: *role,
                gpus: gpus.iter().map(|(i, mib)| GpuShare { index: *i, uuid: uuid(*i), mib: Mib::new(*mib) }).collect(),
            })
            .collect(),
    };
    f.pods.upsert(PodView {
        pod: PodRef { namespace: "default".into(), name: format!("pod-{uid}"), uid: uid.into() },
        node: Some("node-a".into()),
        created: created.into(),
        version: 0,
        terminal: false,
        spec: spec_of(&f.names, asks),
        annotations: BTreeMap::from([(ASSIGNMENT_KEY.to_owned(), assignment.encode().unwrap())]),
        container_ids: Vec::new(),
    });
}

/// The spec the kubelet admits `containers` by: each one's memory, and its GPU count when over
/// one, as limits under `names`; init containers and sidecars (restart policy `Always`) first.
pub(crate) fn spec_of(names: &ResourceNames, containers: &[ContainerSpec<'_>]) -> gpushare_core::PodSpec {
    let container = |(name, role, gpus): &ContainerSpec<'_>| {
        let mib: u64 = gpus.iter().map(|(_, m)| m).sum();
        let mut limits = serde_json::Map::new();
        limits.insert(names.memory.to_string(), mib.to_string().into());
        if gpus.len() > 1 {
            limits.insert(names.count.to_string(), gpus.len().to_string().into());
        }
        let mut c = serde_json::json!({"name": name, "resources": {"limits": limits}});
        if *role == ContainerRole::Sidecar {
            c["restartPolicy"] = "Always".into();
        }
        c
    };
    let init: Vec<_> = containers.iter().filter(|c| c.1 != ContainerRole::App).map(container).collect();
    let app: Vec<_> = containers.iter().filter(|c| c.1 == ContainerRole::App).map(container).collect();
    serde_json::from_value(serde_json::json!({"initContainers": init, "containers": app})).unwrap()
}

/// Every device the kubelet has not handed out yet.
fn all_devices(f: &Fixture) -> Vec<String> {
    let in_use = f.in_use.borrow();
    (0..3).flat_map(|g| f.alloc.devices().ids(g).collect::<Vec<_>>()).filter(|d| !in_use.contains(d)).collect()
}

/// The kubelet's sequence for one container: preferred allocation from the free devices,
/// then Allocate of what it proposed.
fn admit(f: &Fixture, size: usize) -> Result<Answer, AllocError> {
    let ids = f.alloc.preferred(all_devices(f).iter().map(String::as_str), &[], size)?;
    assert_eq!(ids.len(), size);
    let answer = f.alloc.allocate(&ids)?;
    f.in_use.borrow_mut().extend(ids);
    Ok(answer)
}

/// The whole history, as (unix ms, kind, detail).
fn history(f: &Fixture) -> Vec<(i64, String, String)> {
    let page = f.alloc.history_page(0, None, crate::allocation::ledger::MAX_PAGE).unwrap();
    assert!(page.next.is_none(), "more than a page of history");
    page.lines.into_iter().map(|l| (l.at_ms, l.kind, l.detail)).collect()
}

fn gpus_of(f: &Fixture, ids: &[String]) -> BTreeSet<usize> {
    ids.iter().map(|id| f.alloc.devices().resolve(id).unwrap().0).collect()
}

#[test]
fn one_container_gets_its_assigned_gpu_and_budget() {
    let f = fixture(Compatibility::Gpushare);
    pod(&f, "u1", "2026-01-01T00:00:00Z", &[("main", ContainerRole::App, &[(1, 350)])]);
    let ids = f.alloc.preferred(all_devices(&f).iter().map(String::as_str), &[], 350).unwrap();
    assert_eq!(gpus_of(&f, &ids), BTreeSet::from([1]));
    let answer = f.alloc.allocate(&ids).unwrap();
    assert_eq!(answer.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-1");
    assert_eq!(answer.envs["GPUSHARE_MEMORY_MIB"], "350");
    assert_eq!(answer.envs["GPUSHARE_MEMORY_TOTAL_MIB"], "350");
    assert_eq!(answer.envs["GPUSHARE_GPU_TOTAL_MIB"], "1000");
    assert_eq!(answer.envs["GPUSHARE_POD"], "default/pod-u1");
    assert!(!answer.envs.contains_key(alibaba::CONTAINER));
    let live = f.alloc.live().unwrap();
    assert_eq!(live.len(), 1);
    assert_eq!((live[0].gpu_index, live[0].mib, live[0].container.as_str()), (1, Mib::new(350), "main"));
}

#[test]
fn a_repeated_allocate_gets_the_same_answer_and_writes_nothing() {
    let f = fixture(Compatibility::Gpushare);
    pod(&f, "u1", "2026-01-01T00:00:00Z", &[("main", ContainerRole::App, &[(2, 100)])]);
    let ids = f.alloc.preferred(all_devices(&f).iter().map(String::as_str), &[], 100).unwrap();
    let first = f.alloc.allocate(&ids).unwrap();
    let mut shuffled = ids.clone();
    shuffled.reverse();
    let again = f.alloc.allocate(&shuffled).unwrap();
    assert_eq!(first, again);
    assert_eq!(f.alloc.live().unwrap().len(), 1);
}

#[test]
fn two_equal_pods_admitted_together_each_get_their_own_gpu() {
    let f = fixture(Compatibility::Gpushare);
    // Same size, different GPUs; b was created first, so the kubelet admits b first.
    pod(&f, "a", "2026-01-01T00:00:02Z", &[("main", ContainerRole::App, &[(0, 400)])]);
    pod(&f, "b", "2026-01-01T00:00:01Z", &[("main", ContainerRole::App, &[(2, 400)])]);
    let mut available = all_devices(&f);
    let first = f.alloc.preferred(available.iter().map(String::as_str), &[], 400).unwrap();
    available.retain(|d| !first.contains(d));
    let second = f.alloc.preferred(available.iter().map(String::as_str), &[], 400).unwrap();
    // Both proposals made before either Allocate: each remembers its container.
    let b = f.alloc.allocate(&first).unwrap();
    let a = f.alloc.allocate(&second).unwrap();
    assert_eq!((b.pod.uid.as_str(), b.envs["NVIDIA_VISIBLE_DEVICES"].as_str()), ("b", "GPU-2"));
    assert_eq!((a.pod.uid.as_str(), a.envs["NVIDIA_VISIBLE_DEVICES"].as_str()), ("a", "GPU-0"));
    assert_eq!(gpus_of(&f, &first), BTreeSet::from([2]));
    assert_eq!(gpus_of(&f, &second), BTreeSet::from([0]));
}

#[test]
fn an_admission_cut_by_a_kubelet_restart_is_served_again_to_its_own_pod() {
    let f = fixture(Compatibility::Gpushare);
    // Same size, different GPUs; b was created first, so the kubelet admits b first.
    pod(&f, "a", "2026-01-01T00:00:02Z", &[("main", ContainerRole::App, &[(0, 400)])]);
    pod(&f, "b", "2026-01-01T00:00:01Z", &[("main", ContainerRole::App, &[(2, 400)])]);
    let cut = f.alloc.preferred(all_devices(&f).iter().map(String::as_str), &[], 400).unwrap();
    assert_eq!(gpus_of(&f, &cut), BTreeSet::from([2]));
    // The kubelet stops before its Allocate; once back it admits b again.
    assert_eq!(f.alloc.kubelet_restarted(), 1);
    let b = admit(&f, 400).unwrap();
    assert_eq!((b.pod.uid.as_str(), b.envs["NVIDIA_VISIBLE_DEVICES"].as_str()), ("b", "GPU-2"));
    let a = admit(&f, 400).unwrap();
    assert_eq!((a.pod.uid.as_str(), a.envs["NVIDIA_VISIBLE_DEVICES"].as_str()), ("a", "GPU-0"));
}

#[test]
fn a_pod_whose_allocation_a_kubelet_restart_lost_is_served_again() {
    let f = fixture(Compatibility::Gpushare);
    pod(&f, "a", "2026-01-01T00:00:01Z", &[("main", ContainerRole::App, &[(0, 300)])]);
    pod(&f, "b", "2026-01-01T00:00:02Z", &[("main", ContainerRole::App, &[(1, 300)])]);
    let ids = f.alloc.preferred(all_devices(&f).iter().map(String::as_str), &[], 300).unwrap();
    f.alloc.allocate(&ids).unwrap();
    // The kubelet is killed before its checkpoint has a's devices; the new one admits a again
    // and offers a's devices as free. The restart explains it: a is served, not held back.
    // (Nor is it the pod being admitted any more: to a patient call, a and b now look alike.)
    std::thread::sleep(std::time::Duration::from_millis(2));
    f.alloc.kubelet_restarted();
    let patient = f.alloc.preferred_with(all_devices(&f).iter().map(String::as_str), &[], 300, &Care::PATIENT);
    assert!(matches!(patient, Err(AllocError::Ambiguous { .. })), "{patient:?}");
    let again = f.alloc.preferred_with(all_devices(&f).iter().map(String::as_str), &[], 300, &Care::AS_IS).unwrap();
    assert_eq!(gpus_of(&f, &again), BTreeSet::from([0]));
    let history = history(&f);
    assert!(history.iter().any(|(_, _, detail)| detail.contains("offers these devices as free")), "{history:?}");
    let answer = f.alloc.allocate(&again).unwrap();
    assert_eq!(answer.pod.uid, "a");
    assert_eq!(f.alloc.live().unwrap().len(), 1, "one row for a, its first released");
}

#[test]
fn a_grant_its_owner_widened_is_refused_and_nothing_is_allocated() {
    let f = fixture(Compatibility::Gpushare);
    // The spec asks for 400 MiB on one GPU; the annotation, which the pod's owner may write,
    // spreads it over two (both would be visible to the container).
    let one_gpu: &[ContainerSpec<'_>] = &[("main", ContainerRole::App, &[(0, 400)])];
    pod_asking(&f, "wide", "2026-01-01T00:00:01Z", &[("main", ContainerRole::App, &[(0, 200), (1, 200)])], one_gpu);
    let e = admit(&f, 400).unwrap_err();
    assert!(matches!(e, AllocError::BadAssignment { .. }), "{e}");
    assert!(e.to_string().contains("over 2 GPU(s), it asks for 1"), "{e}");
    // Two GPUs asked for, split 100 / 300 instead of the request's equal 200 each.
    let f = fixture(Compatibility::Gpushare);
    let two_gpus: &[ContainerSpec<'_>] = &[("main", ContainerRole::App, &[(0, 200), (1, 200)])];
    pod_asking(&f, "split", "2026-01-01T00:00:01Z", &[("main", ContainerRole::App, &[(0, 100), (1, 300)])], two_gpus);
    let e = admit(&f, 400).unwrap_err();
    assert!(e.to_string().contains("its request is an equal 200 MiB on each of its 2 GPU(s)"), "{e}");
    assert!(f.alloc.live().unwrap().is_empty(), "nothing allocated");
}

#[test]
fn a_call_the_dead_kubelet_made_commits_nothing_after_the_restart() {
    let f = fixture(Compatibility::Gpushare);
    pod(&f, "a", "2026-01-01T00:00:01Z", &[("main", ContainerRole::App, &[(0, 300)])]);
    // The old kubelet's calls came, then it was killed and the new one started while they
    // were still served (waiting on the API server, say).
    let old = Care { generation: Some(f.alloc.kubelet_generation()), ..Care::PATIENT };
    let ids = f.alloc.preferred_with(all_devices(&f).iter().map(String::as_str), &[], 300, &old).unwrap();
    f.alloc.kubelet_restarted();
    let late = f.alloc.allocate_with(&ids, &old);
    assert!(matches!(late, Err(AllocError::KubeletRestarted)), "{late:?}");
    let late = f.alloc.preferred_with(all_devices(&f).iter().map(String::as_str), &[], 300, &old);
    assert!(matches!(late, Err(AllocError::KubeletRestarted)), "{late:?}");
    assert!(f.alloc.live().unwrap().is_empty(), "nothing committed for the dead kubelet");
    // The new kubelet admits a again, and a is served at once, not held in doubt.
    let new = Care { generation: Some(f.alloc.kubelet_generation()), ..Care::PATIENT };
    let again = f.alloc.preferred_with(all_devices(&f).iter().map(String::as_str), &[], 300, &new).unwrap();
    let answer = f.alloc.allocate_with(&again, &new).unwrap();
    assert_eq!((answer.pod.uid.as_str(), answer.envs["NVIDIA_VISIBLE_DEVICES"].as_str()), ("a", "GPU-0"));
}

#[test]
fn a_multi_container_pod_is_served_container_by_container() {
    let f = fixture(Compatibility::Gpushare);
    pod(
        &f,
        "u1",
        "2026-01-01T00:00:00Z",
        &[
            ("fetch", ContainerRole::Init, &[(0, 200)]),
            ("model", ContainerRole::App, &[(0, 600)]),
            ("tokenizer", ContainerRole::App, &[(1, 150)]),
        ],
    );
    // An older pod of the same first size waits too; the pod being admitted still wins for
    // its later containers.
    pod(&f, "old", "2025-12-31T00:00:00Z", &[("main", ContainerRole::App, &[(2, 600)])]);
    let fetch = admit(&f, 200).unwrap();
    assert_eq!((fetch.container.as_str(), fetch.envs["NVIDIA_VISIBLE_DEVICES"].as_str()), ("fetch", "GPU-0"));
    let model = admit(&f, 600).unwrap();
    assert_eq!((model.pod.uid.as_str(), model.container.as_str()), ("u1", "model"));
    let tok = admit(&f, 150).unwrap();
    assert_eq!((tok.container.as_str(), tok.envs["NVIDIA_VISIBLE_DEVICES"].as_str()), ("tokenizer", "GPU-1"));
    let old = admit(&f, 600).unwrap();
    assert_eq!((old.pod.uid.as_str(), old.envs["NVIDIA_VISIBLE_DEVICES"].as_str()), ("old", "GPU-2"));
}

#[test]
fn a_two_gpu_container_gets_devices_and_memory_on_both() {
    let f = fixture(Compatibility::Gpushare);
    pod(&f, "u1", "2026-01-01T00:00:00Z", &[("train", ContainerRole::App, &[(0, 300), (2, 300)])]);
    let ids = f.alloc.preferred(all_devices(&f).iter().map(String::as_str), &[], 600).unwrap();
    assert_eq!(gpus_of(&f, &ids), BTreeSet::from([0, 2]));
    let answer = f.alloc.allocate(&ids).unwrap();
    assert_eq!(answer.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-0,GPU-2");
    assert_eq!(answer.envs["GPUSHARE_GPU_INDEXES"], "0,2");
    assert_eq!(answer.envs["GPUSHARE_MEMORY_MIB"], "300");
    assert_eq!(answer.envs["GPUSHARE_MEMORY_TOTAL_MIB"], "600");
    assert_eq!(f.alloc.live().unwrap().len(), 2);
}

#[test]
fn a_lean_answer_places_and_bounds_the_container_and_nothing_else() {
    let lean = crate::config::ContainerEnvironment::Lean;
    let f = fixture_with(Compatibility::Gpushare, crate::config::DeviceNodesConfig::default(), lean);
    pod(&f, "u1", "2026-01-01T00:00:00Z", &[("train", ContainerRole::App, &[(0, 300), (2, 300)])]);
    let ids = f.alloc.preferred(all_devices(&f).iter().map(String::as_str), &[], 600).unwrap();
    let answer = f.alloc.allocate(&ids).unwrap();
    let expected: BTreeMap<String, String> = [
        ("NVIDIA_VISIBLE_DEVICES", "GPU-0,GPU-2"),
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "300m"),
        ("CUDA_DEVICE_MEMORY_LIMIT_1", "300m"),
        ("GPUSHARE_POD", "default/pod-u1"),
        ("GPUSHARE_CONTAINER", "train"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    assert_eq!(answer.envs, expected);
    // A repeated Allocate (rebuilt from the ledger's rows) is answered alike.
    assert_eq!(f.alloc.allocate(&ids).unwrap(), answer);

    // Under Alibaba's compatibility its variables stay: images read them.
    let f = fixture_with(Compatibility::Alibaba, crate::config::DeviceNodesConfig::default(), lean);
    pod(&f, "u2", "2026-01-01T00:00:00Z", &[("main", ContainerRole::App, &[(1, 200)])]);
    let answer = admit(&f, 200).unwrap();
    assert_eq!(answer.envs[alibaba::CONTAINER], "200");
    assert!(!answer.envs.contains_key("GPUSHARE_MEMORY_MIB"), "{:?}", answer.envs);
}

#[test]
fn must_include_devices_are_kept_and_counted() {
    let f = fixture(Compatibility::Gpushare);
    pod(&f, "u1", "2026-01-01T00:00:00Z", &[("main", ContainerRole::App, &[(1, 10)])]);
    let must: Vec<String> = f.alloc.devices().ids(1).take(3).collect();
    let ids = f.alloc.preferred(all_devices(&f).iter().map(String::as_str), &must, 10).unwrap();
    assert_eq!(ids.len(), 10);
    assert!(must.iter().all(|m| ids.contains(m)));
    assert_eq!(gpus_of(&f, &ids), BTreeSet::from([1]));
}

#[test]
fn allocate_without_a_preference_is_resolved_by_size() {
    let f = fixture(Compatibility::Gpushare);
    pod(&f, "u1", "2026-01-01T00:00:00Z", &[("main", ContainerRole::App, &[(1, 5)])]);
    let ids: Vec<String> = f.alloc.devices().ids(0).take(5).collect();
    let answer = f.alloc.allocate(&ids).unwrap();
    assert_eq!(answer.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-1", "the assignment decides the GPU");
}

#[test]
fn failures_are_errors_with_reasons_never_bogus_success() {
    let f = fixture(Compatibility::Gpushare);
    let err = f.alloc.preferred(all_devices(&f).iter().map(String::as_str), &[], 100).unwrap_err().to_string();
    assert!(err.contains("no pod bound to node node-a is waiting for 100 MiB of gpushare.io/gpu-mem"), "{err}");
    assert!(err.contains("gpushare-extender"), "{err}");

    // A pod asking for the resource without an assignment is named.
    let mut view = PodView {
        pod: PodRef { namespace: "ml".into(), name: "raw".into(), uid: "r".into() },
        node: Some("node-a".into()),
        created: String::new(),
        version: 0,
        terminal: false,
        spec: serde_json::from_str(
            r#"{"containers":[{"name":"c","resources":{"limits":{"gpushare.io/gpu-mem":"100"}}}]}"#,
        )
        .unwrap(),
        annotations: BTreeMap::new(),
        container_ids: Vec::new(),
    };
    f.pods.upsert(view.clone());
    let err = f.alloc.allocate(&f.alloc.devices().ids(0).take(100).collect::<Vec<_>>()).unwrap_err().to_string();
    assert!(err.contains("ml/raw has no gpushare.io/assignment annotation"), "{err}");
    view.annotations.insert(ASSIGNMENT_KEY.into(), "{not json".into());
    f.pods.upsert(view);
    let err = f.alloc.preferred(all_devices(&f).iter().map(String::as_str), &[], 100).unwrap_err().to_string();
    assert!(err.contains("ml/raw: annotation gpushare.io/assignment: malformed value"), "{err}");

    assert!(matches!(f.alloc.allocate(&["nope".into()]), Err(AllocError::UnknownDevice(_))));
    // A size nobody waits for, while someone waits for another size.
    pod(&f, "u1", "2026-01-01T00:00:00Z", &[("main", ContainerRole::App, &[(1, 5)])]);
    let err = f.alloc.preferred(all_devices(&f).iter().map(String::as_str), &[], 6).unwrap_err().to_string();
    assert!(err.contains("default/pod-u1 container \"main\" waits for 5 MiB"), "{err}");
    assert!(f.alloc.live().unwrap().is_empty());
}

#[test]
fn the_ledger_refuses_to_overcommit_a_gpu() {
    let f = fixture(Compatibility::Gpushare);
    // Two assignments that together overcommit GPU0 (a stale extender view, say).
    pod(&f, "u1", "2026-01-01T00:00:01Z", &[("main", ContainerRole::App, &[(0, 700)])]);
    pod(&f, "u2", "2026-01-01T00:00:02Z", &[("main", ContainerRole::App, &[(0, 700)])]);
    admit(&f, 700).unwrap();
    let err = admit(&f, 700).unwrap_err().to_string();
    assert_eq!(
        err,
        "pod default/pod-u2 container \"main\": GPU0 has 300 MiB free in the ledger, needs 700 MiB; nothing was allocated"
    );
    assert_eq!(f.alloc.live().unwrap().len(), 1);
}

#[test]
fn init_containers_do_not_add_to_the_app_containers() {
    let f = fixture(Compatibility::Gpushare);
    // 900 init then 900 app on a 1000 MiB GPU: they never run together.
    pod(
        &f,
        "u1",
        "2026-01-01T00:00:00Z",
        &[("init", ContainerRole::Init, &[(0, 900)]), ("app", ContainerRole::App, &[(0, 900)])],
    );
    admit(&f, 900).unwrap();
    admit(&f, 900).unwrap();
}

#[test]
fn an_unhealthy_assigned_gpu_fails_admission_readably() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::open(&dir.path().join("l.db")).unwrap().ledger;
    let mut g = Gpu::new(0, uuid(0), "T4", Mib::new(GPU_MIB));
    g.health = gpushare_core::Health::Unhealthy { reason: "Xid 79".into() };
    let inventory = NodeInventory::new(MemoryUnit::Mib, vec![g]).unwrap();
    let pods = PodStore::new();
    let alloc = Allocator::new(
        "node-a".into(),
        ResourceNames::gpushare(),
        Compatibility::Gpushare,
        inventory,
        pods.clone(),
        ledger,
    )
    .unwrap();
    let f = Fixture {
        _dir: dir,
        pods,
        names: ResourceNames::gpushare(),
        alloc: Arc::new(alloc),
        in_use: std::cell::RefCell::default(),
    };
    pod(&f, "u1", "t", &[("main", ContainerRole::App, &[(0, 10)])]);
    let ids: Vec<String> = f.alloc.devices().ids(0).take(10).collect();
    let err = f.alloc.allocate(&ids).unwrap_err().to_string();
    assert_eq!(err, "pod default/pod-u1: assigned GPU0 is unhealthy (Xid 79); delete the pod so it is placed again");
}

#[test]
fn alibaba_compatibility_adds_alibabas_variables() {
    let f = fixture(Compatibility::Alibaba);
    pod(&f, "u1", "t", &[("a", ContainerRole::App, &[(1, 200)]), ("b", ContainerRole::App, &[(1, 100)])]);
    let a = admit(&f, 200).unwrap();
    assert_eq!(a.envs[alibaba::IDX], "5", "the minor number");
    assert_eq!(a.envs[alibaba::DEV], "1000");
    assert_eq!(a.envs[alibaba::POD], "300");
    assert_eq!(a.envs[alibaba::CONTAINER], "200");
}

#[test]
fn device_nodes_name_each_of_the_containers_gpus_by_its_minor_number() {
    let text = "[device_nodes]\nenabled = true\nhost_dir = \"/host/dev\"\ncontrol = [\"nvidiactl\"]\n";
    let nodes = crate::config::Config::parse(text, std::path::Path::new("t.toml")).unwrap().device_nodes;
    let f = fixture_naming(Compatibility::Gpushare, nodes);
    pod(&f, "u1", "t", &[("main", ContainerRole::App, &[(2, 200), (0, 200)])]);
    let a = admit(&f, 400).unwrap();
    let paths: Vec<_> =
        a.devices.iter().map(|d| (d.host_path.to_str().unwrap(), d.container_path.to_str().unwrap())).collect();
    assert_eq!(
        paths,
        [
            ("/host/dev/nvidia4", "/dev/nvidia4"),
            ("/host/dev/nvidia6", "/dev/nvidia6"),
            ("/host/dev/nvidiactl", "/dev/nvidiactl")
        ],
        "GPU0 and GPU2 by their minor numbers, in NVIDIA_VISIBLE_DEVICES's order, then the control node"
    );
    let again = f.alloc.allocate(&f.in_use.borrow().iter().cloned().collect::<Vec<_>>()).unwrap();
    assert_eq!(again.devices, a.devices, "a repeated Allocate names the same nodes");
    let plain = fixture(Compatibility::Gpushare);
    pod(&plain, "u1", "t", &[("main", ContainerRole::App, &[(1, 200)])]);
    assert!(admit(&plain, 200).unwrap().devices.is_empty(), "none unless enabled");
}

#[test]
fn an_app_container_reusing_its_init_containers_devices_is_a_new_allocation() {
    let f = fixture(Compatibility::Gpushare);
    pod(&f, "u1", "t", &[("init", ContainerRole::Init, &[(1, 100)]), ("app", ContainerRole::App, &[(1, 100)])]);
    let init = admit(&f, 100).unwrap();
    assert_eq!(init.container, "init");
    // The kubelet reuses the init container's devices: must_include is all of them.
    let reused: Vec<String> = f.alloc.live().unwrap()[0].device_ids.clone();
    let ids = f.alloc.preferred(all_devices(&f).iter().map(String::as_str), &reused, 100).unwrap();
    assert_eq!(request_key(&ids), request_key(&reused));
    let app = f.alloc.allocate(&ids).unwrap();
    assert_eq!((app.container.as_str(), app.envs["GPUSHARE_CONTAINER"].as_str()), ("app", "app"));
    assert_eq!(f.alloc.live().unwrap().len(), 2);
    // Asked again, the app container's answer comes back, not the init container's.
    assert_eq!(f.alloc.allocate(&ids).unwrap().container, "app");
    assert_eq!(f.alloc.live().unwrap().len(), 2);
}

#[test]
fn a_cordoned_gpu_takes_no_new_allocation_and_the_cordon_is_persisted() {
    let f = fixture(Compatibility::Gpushare);
    pod(&f, "u1", "2026-01-01T00:00:00Z", &[("main", ContainerRole::App, &[(1, 100)])]);
    admit(&f, 100).unwrap();
    assert_eq!(f.alloc.set_cordon("GPU-1", true).unwrap(), (1, true));
    assert_eq!(f.alloc.set_cordon("1", true).unwrap(), (1, false), "already cordoned");
    assert!(matches!(f.alloc.set_cordon("9", true), Err(AllocError::NoSuchGpu(_))));
    assert!(f.alloc.current_inventory().gpus()[1].cordoned);
    assert!(f.alloc.node_state(1, "x").inventory.gpus()[1].cordoned, "published");
    // A container assigned to it before the cordon is refused, readably; its allocations stay.
    pod(&f, "u2", "2026-01-01T00:00:01Z", &[("main", ContainerRole::App, &[(1, 100)])]);
    let err = admit(&f, 100).unwrap_err().to_string();
    assert!(err.contains("assigned GPU1 is cordoned (gpusharectl uncordon 1)"), "{err}");
    assert_eq!(f.alloc.live().unwrap().len(), 1);
    // Explain and history say so.
    let why = f.alloc.explain("default", "pod-u2").unwrap();
    assert!(why.contains("container \"main\": assigned GPU1 100 MiB; not admitted by the kubelet yet"), "{why}");
    let history = history(&f);
    assert!(history.iter().any(|(_, k, d)| k == "cordon" && d == "GPU1 (GPU-1) cordoned"), "{history:?}");
    assert!(history.iter().any(|(_, k, d)| k == "allocated" && d.contains("default/pod-u1")), "{history:?}");
    assert_eq!(f.alloc.set_cordon("GPU-1", false).unwrap(), (1, true));
    admit(&f, 100).unwrap();
}

#[test]
fn look_alike_pods_on_other_gpus_make_a_patient_choice_wait() {
    let f = fixture(Compatibility::Gpushare);
    pod(&f, "a", "2026-01-01T00:00:01Z", &[("main", ContainerRole::App, &[(0, 400)])]);
    pod(&f, "b", "2026-01-01T00:00:02Z", &[("main", ContainerRole::App, &[(2, 400)])]);
    let available = all_devices(&f);
    let ids = || available.iter().map(String::as_str);
    let err = f.alloc.preferred_with(ids(), &[], 400, &Care::PATIENT).unwrap_err();
    assert!(matches!(err, AllocError::Ambiguous { .. }), "{err}");
    assert!(err.to_string().contains("default/pod-a and default/pod-b both wait for 400 MiB"), "{err}");
    // Impatient, the oldest is taken, as the kubelet admits in creation order.
    assert_eq!(gpus_of(&f, &f.alloc.preferred_with(ids(), &[], 400, &Care::AS_IS).unwrap()), BTreeSet::from([0]));
    // Once the look-alike goes, the choice is clear.
    f.pods.remove("b", 0);
    assert_eq!(gpus_of(&f, &f.alloc.preferred_with(ids(), &[], 400, &Care::PATIENT).unwrap()), BTreeSet::from([0]));
    // Look-alikes placed alike are no ambiguity: either gets what it was assigned.
    pod(&f, "c", "2026-01-01T00:00:03Z", &[("main", ContainerRole::App, &[(0, 400)])]);
    assert!(f.alloc.preferred_with(ids(), &[], 400, &Care::PATIENT).is_ok());
}

#[test]
fn rows_whose_devices_the_kubelet_offers_as_free_are_released_and_their_pod_held_back() {
    let f = fixture(Compatibility::Gpushare);
    pod(&f, "a", "2026-01-01T00:00:01Z", &[("main", ContainerRole::App, &[(0, 300)])]);
    // The kubelet's call was really for another pod whose admission then failed (or a was
    // deleted and the kubelet saw it first): it holds nothing, so a's devices are free again.
    let ids = f.alloc.preferred(all_devices(&f).iter().map(String::as_str), &[], 300).unwrap();
    f.alloc.allocate(&ids).unwrap();
    assert_eq!(f.alloc.live().unwrap().len(), 1);
    pod(&f, "b", "2026-01-01T00:00:02Z", &[("main", ContainerRole::App, &[(1, 300)])]);
    let err = f.alloc.preferred_with(all_devices(&f).iter().map(String::as_str), &[], 300, &Care::AS_IS).unwrap_err();
    assert!(f.alloc.live().unwrap().is_empty(), "a's row is released");
    let history = history(&f);
    assert!(history.iter().any(|(_, _, detail)| detail.contains("offers these devices as free")), "{history:?}");
    // a is first in line, but nobody can say whether the kubelet is admitting a or b: refused.
    assert!(matches!(err, AllocError::Doubtful { .. }), "{err}");
    assert!(err.to_string().contains("pod default/pod-a waits for 300 MiB"), "{err}");
    // The pod watch settles it: a is gone, b is served.
    f.alloc.release_pod("a", "pod deleted").unwrap();
    f.pods.remove("a", 0);
    let again = f.alloc.preferred_with(all_devices(&f).iter().map(String::as_str), &[], 300, &Care::PATIENT).unwrap();
    assert_eq!(gpus_of(&f, &again), BTreeSet::from([1]));
    let answer = f.alloc.allocate(&again).unwrap();
    f.in_use.borrow_mut().extend(again);
    assert_eq!(answer.pod.uid, "b");
    // Devices the kubelet holds are never offered: a held row stays.
    pod(&f, "c", "2026-01-01T00:00:03Z", &[("main", ContainerRole::App, &[(2, 300)])]);
    f.alloc.preferred(all_devices(&f).iter().map(String::as_str), &[], 300).unwrap();
    assert_eq!(f.alloc.live().unwrap().len(), 1);
}

#[test]
fn activity_reaches_the_node_state_alone_and_only_when_it_is_news() {
    let f = fixture(Compatibility::Gpushare);
    let (mut changes, mut activity) = (f.alloc.subscribe(), f.alloc.subscribe_activity());
    changes.borrow_and_update();
    activity.borrow_and_update();
    let at = |u: u8, mib: u64| gpushare_core::Activity { utilization: Some(u), in_use: Mib::new(mib) };
    assert!(f.alloc.set_activity(0, at(40, 100)), "the first sample is news");
    assert!(activity.has_changed().unwrap());
    // Not an allocation or health change: reconciliation, the kubelet's list and D-Bus stay put.
    assert!(!changes.has_changed().unwrap());
    activity.borrow_and_update();
    assert!(!f.alloc.set_activity(0, at(45, 120)), "5 points and 20 MiB are not");
    assert!(!activity.has_changed().unwrap());
    assert_eq!(f.alloc.node_state(1, "x").inventory.gpus()[0].activity, Some(at(40, 100)));
    assert!(!f.alloc.set_activity(9, at(1, 1)), "no such GPU");
}

#[test]
fn a_rebuild_refuses_calls_until_the_lost_rows_are_booked_again() {
    let f = fixture(Compatibility::Gpushare);
    pod(&f, "u1", "t1", &[("main", ContainerRole::App, &[(0, 600)])]);
    pod(&f, "u2", "t2", &[("main", ContainerRole::App, &[(1, 300)])]);
    let lost = |uid: &str, gpu: u32, mib: u64| NodeAllocation {
        pod: PodRef { namespace: "default".into(), name: format!("pod-{uid}"), uid: uid.into() },
        container: "main".into(),
        role: ContainerRole::App,
        gpu,
        mib: Mib::new(mib),
    };
    // Published: u1 on GPU0 and a pod gone since; the ledger has neither.
    let published = [lost("u1", 0, 600), lost("gone", 2, 100)];
    let missing = f.alloc.missing_from_ledger(&published).unwrap();
    assert_eq!(missing.len(), 2);
    f.alloc.begin_rebuild(missing);
    let ids: Vec<String> = f.alloc.devices().ids(1).take(300).collect();
    let err = f.alloc.allocate_with(&ids, &Care::PATIENT).unwrap_err();
    assert!(matches!(err, AllocError::Rebuilding { missing: 2 }), "{err}");
    // Published meanwhile as held: the extender does not see the GPU free.
    assert_eq!(f.alloc.node_state(1, "t").used, [Mib::new(600), Mib::ZERO, Mib::new(100)]);
    let done = f.alloc.finish_rebuild().unwrap();
    assert_eq!((done.rows, done.gone), (1, 1));
    let live = f.alloc.live().unwrap();
    assert_eq!(live.iter().map(|r| (r.pod.uid.as_str(), r.gpu_index)).collect::<Vec<_>>(), [("u1", 0)]);
    // Served again, and the rebuilt row counts: u2 gets its GPU1, u1 is not booked twice.
    f.alloc.allocate_with(&ids, &Care::PATIENT).unwrap();
    assert!(f.alloc.missing_from_ledger(&published[..1]).unwrap().is_empty());
}

/// The history and an allocation never wait for each other: the history is read on a
/// connection of its own while an allocation holds the allocator's lock, and an `Allocate`
/// commits while a read of the history holds its connection and a read transaction open.
#[test]
fn the_history_is_read_beside_an_allocation_and_neither_waits_for_the_other() {
    let f = fixture(Compatibility::Gpushare);
    pod(&f, "u1", "2026-01-01T00:00:00Z", &[("main", ContainerRole::App, &[(1, 350)])]);
    let patience = std::time::Duration::from_secs(30);

    let held = f.alloc.lock();
    let alloc = Arc::clone(&f.alloc);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(alloc.history_page(0, None, 10).map(|p| p.lines.len())).unwrap());
    let read = rx.recv_timeout(patience).expect("the history read waited for the allocator's lock");
    assert!(read.is_ok(), "{read:?}");
    drop(held);

    let ids = f.alloc.preferred(all_devices(&f).iter().map(String::as_str), &[], 350).unwrap();
    let reading = f.alloc.history.lock().unwrap();
    reading.begin_read();
    let alloc = Arc::clone(&f.alloc);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(alloc.allocate(&ids).map(|a| a.envs["GPUSHARE_MEMORY_MIB"].clone())).unwrap());
    let answer = rx.recv_timeout(patience).expect("Allocate waited for a history read");
    assert_eq!(answer.unwrap(), "350");
    reading.end_read();
    drop(reading);
    let page = f.alloc.history_page(0, None, 10).unwrap();
    assert!(
        page.lines
            .iter()
            .any(|l| l.kind == "allocated" && l.detail == r#"default/pod-u1 container "main" GPU1 350 MiB"#),
        "{page:?}"
    );
}

/// `KEY=value` lines of an answer, as the runtime holds a container's environment.
fn env_lines(answer: &Answer) -> Vec<String> {
    answer.envs.iter().map(|(k, v)| format!("{k}={v}")).collect()
}

#[test]
fn a_container_being_created_gets_its_full_environment_and_no_other_pods() {
    let lean = crate::config::ContainerEnvironment::Lean;
    let f = fixture_with(Compatibility::Gpushare, crate::config::DeviceNodesConfig::default(), lean);
    pod(&f, "u1", "2026-01-01T00:00:00Z", &[("train", ContainerRole::App, &[(0, 300), (2, 300)])]);
    let answer = admit(&f, 600).unwrap();
    let own = PodRef { namespace: "default".into(), name: "pod-u1".into(), uid: "u1".into() };

    // The lean answer is completed to the full one, and only what it lacks is added.
    let Creation::Environment(added) = f.alloc.container_creating(&own, "train", &env_lines(&answer)).unwrap() else {
        panic!("the container holds devices");
    };
    let full = fixture(Compatibility::Gpushare);
    pod(&full, "u1", "2026-01-01T00:00:00Z", &[("train", ContainerRole::App, &[(0, 300), (2, 300)])]);
    let full_answer = admit(&full, 600).unwrap();
    let mut completed = answer.envs.clone();
    completed.extend(added.clone());
    assert_eq!(completed, full_answer.envs);
    assert!(added.keys().all(|k| !answer.envs.contains_key(k)), "{added:?}");
    assert_eq!(added["GPUSHARE_MEMORY_TOTAL_MIB"], "600");
    // A full answer needs nothing added.
    assert_eq!(
        full.alloc.container_creating(&own, "train", &env_lines(&full_answer)).unwrap(),
        Creation::Environment(BTreeMap::new())
    );

    // Another pod carrying this answer, or this pod's name under a new UID, is refused.
    let other = PodRef { namespace: "default".into(), name: "pod-u2".into(), uid: "u2".into() };
    let e = f.alloc.container_creating(&other, "train", &env_lines(&answer)).unwrap_err();
    assert!(matches!(e, AllocError::WrongPod { .. }), "{e}");
    assert!(e.to_string().contains("names pod default/pod-u1"), "{e}");
    let again = PodRef { uid: "u9".into(), ..own.clone() };
    let e = f.alloc.container_creating(&again, "train", &env_lines(&answer)).unwrap_err();
    assert!(e.to_string().contains("the ledger holds no devices for it"), "{e}");
    // A container of this pod that holds nothing, yet carries the answer, is refused too.
    assert!(f.alloc.container_creating(&own, "sidecar", &env_lines(&answer)).is_err());

    // A container without a device-plugin answer is not gpushared's.
    let plain = vec!["PATH=/usr/bin".to_owned()];
    assert_eq!(f.alloc.container_creating(&other, "main", &plain).unwrap(), Creation::NotOurs);
}

mod counted;
