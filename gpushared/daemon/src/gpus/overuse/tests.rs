//! The over-use detector's decisions and the cgroup paths it reads.

use super::*;

const UID_A: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
const UID_B: &str = "11111111-2222-3333-4444-555555555555";
const CID_MAIN: &str = "4f2a9c0d1e2b3a4f5e6d7c8b9a0f1e2d3c4b5a69788796a5b4c3d2e1f0a1b2c3";
const CID_SIDE: &str = "aaaabbbbccccddddeeeeffff000011112222333344445555666677778888999a";

fn pod(uid: &str, name: &str) -> PodRef {
    PodRef { namespace: "ml".into(), name: name.into(), uid: uid.into() }
}

fn budget(uid: &str, name: &str, container: &str, gpu: u32, mib: u64) -> NodeAllocation {
    NodeAllocation {
        pod: pod(uid, name),
        container: container.into(),
        role: gpushare_core::ContainerRole::App,
        gpu,
        mib: Mib::new(mib),
    }
}

fn known(uid: &str) -> Option<KnownPod> {
    match uid {
        UID_A => Some(KnownPod {
            pod: pod(UID_A, "train"),
            container_ids: vec![("main".into(), CID_MAIN.into()), ("side".into(), CID_SIDE.into())],
        }),
        UID_B => Some(KnownPod { pod: pod(UID_B, "rogue"), container_ids: vec![] }),
        _ => None,
    }
}

/// pid 10, 11: A's main; 12: A's side; 20: B (no container ID); 30: outside any pod.
fn cgroup(pid: u32) -> Option<ProcessCgroup> {
    let of = |uid: &str, cid: Option<&str>| {
        Some(ProcessCgroup { pod_uid: uid.into(), container_id: cid.map(str::to_owned) })
    };
    match pid {
        10 | 11 => of(UID_A, Some(CID_MAIN)),
        12 => of(UID_A, Some(CID_SIDE)),
        20 => of(UID_B, None),
        _ => None,
    }
}

fn process(gpu: u32, pid: u32, mib: u64) -> (u32, GpuProcess) {
    (gpu, GpuProcess { pid, used: Some(Mib::new(mib)) })
}

fn policy(action: OveruseAction) -> Policy {
    Policy { tolerance: Mib::new(100), action, evict_after_ms: 60_000 }
}

#[test]
fn cgroup_paths_of_both_drivers_and_runtimes() {
    let systemd = format!(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{CID_MAIN}.scope\n",
        UID_A.replace('-', "_")
    );
    assert_eq!(
        parse_cgroup(&systemd),
        Some(ProcessCgroup { pod_uid: UID_A.into(), container_id: Some(CID_MAIN.into()) })
    );
    let cgroupfs = format!(
        "12:memory:/kubepods/besteffort/pod{UID_B}/{CID_SIDE}\n11:pids:/kubepods/besteffort/pod{UID_B}/{CID_SIDE}\n"
    );
    assert_eq!(
        parse_cgroup(&cgroupfs),
        Some(ProcessCgroup { pod_uid: UID_B.into(), container_id: Some(CID_SIDE.into()) })
    );
    let guaranteed_docker =
        format!("0::/kubepods.slice/kubepods-pod{}.slice/docker-{CID_MAIN}.scope", UID_A.replace('-', "_"));
    assert_eq!(parse_cgroup(&guaranteed_docker).map(|c| c.pod_uid), Some(UID_A.into()));
    // The pod's own cgroup (a process in no container yet), nested under kind's prefix.
    let pod_level =
        format!("0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{}.slice", UID_A.replace('-', "_"));
    assert_eq!(parse_cgroup(&pod_level), Some(ProcessCgroup { pod_uid: UID_A.into(), container_id: None }));
    // Not in a pod: host services, user sessions, garbage.
    for text in [
        "0::/system.slice/nvidia-cuda-mps-control.service\n",
        "0::/user.slice/user-1000.slice/session-2.scope\n",
        "0::/kubepods.slice/kubepods-podnot-a-uid.slice\n",
        "0::/\n",
        "",
        "garbage",
        "0::/spod0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0/x\n",
    ] {
        assert_eq!(parse_cgroup(text), None, "{text:?}");
    }
}

#[test]
fn a_container_over_its_budget_is_reported_once_with_its_processes_summed() {
    let mut d = Detector::new(policy(OveruseAction::Warn));
    let budgets = [budget(UID_A, "train", "main", 0, 2000), budget(UID_A, "train", "side", 0, 500)];
    // 1500 + 600 = 2100 MiB: within 2000 + 100 of tolerance.
    let within =
        d.assess(&[process(0, 10, 1500), process(0, 11, 600), process(0, 30, 9000)], cgroup, &budgets, known, 1);
    assert_eq!(within, Verdict::default(), "tolerance; a host process is nobody's");
    let over = d.assess(&[process(0, 10, 1500), process(0, 11, 700), process(0, 12, 400)], cgroup, &budgets, known, 2);
    let main = OverBudget {
        pod: pod(UID_A, "train"),
        container: "main".into(),
        gpu: 0,
        in_use: Mib::new(2200),
        budget: Mib::new(2000),
        since_ms: 2,
    };
    assert_eq!(over.current, vec![main.clone()], "the side container is within its 500 MiB");
    assert_eq!(over.began, vec![main.clone()]);
    assert!(over.ended.is_empty() && over.evict.is_empty(), "warn never evicts");
    let still = d.assess(&[process(0, 10, 1500), process(0, 11, 900)], cgroup, &budgets, known, 3);
    assert_eq!(still.current[0].since_ms, 2, "over since the first sample");
    assert_eq!(still.current[0].in_use, Mib::new(2400));
    assert!(still.began.is_empty());
    let back = d.assess(&[process(0, 10, 1500)], cgroup, &budgets, known, 4);
    assert!(back.current.is_empty());
    assert_eq!(back.ended.len(), 1);
    assert_eq!(
        describe(&back.ended[0]),
        "ml/train container \"main\" uses 2400 MiB on GPU0, over its budget of 2000 MiB"
    );
}

#[test]
fn a_gpu_without_a_budget_and_an_unknown_container() {
    let mut d = Detector::new(policy(OveruseAction::Evict));
    let budgets = [budget(UID_A, "train", "main", 0, 2000)];
    // A's main container on GPU1, where it has no budget; B (no gpushare budget at all) on GPU0.
    let v = d.assess(&[process(1, 10, 300), process(0, 20, 800)], cgroup, &budgets, known, 0);
    let summary: Vec<(String, String, u32, u64)> =
        v.current.iter().map(|o| (o.pod.name.clone(), o.container.clone(), o.gpu, o.budget.get())).collect();
    assert_eq!(summary, vec![("train".into(), "main".into(), 1, 0), ("rogue".into(), String::new(), 0, 0)]);
    assert_eq!(describe(&v.current[1]), "ml/rogue uses 800 MiB on GPU0 without a budget there");
    // Pods with no budget on the GPU are never evicted, however long.
    let later = d.assess(&[process(1, 10, 300), process(0, 20, 800)], cgroup, &budgets, known, 3_600_000);
    assert!(later.evict.is_empty());
    // A process of a pod not seen by the watch and without budgets cannot be named: skipped.
    let unknown = |pid| {
        (pid == 40)
            .then(|| ProcessCgroup { pod_uid: "99999999-2222-3333-4444-555555555555".into(), container_id: None })
    };
    assert!(
        Detector::new(policy(OveruseAction::Warn))
            .assess(&[process(0, 40, 100)], unknown, &budgets, known, 0)
            .current
            .is_empty()
    );
    // A process with no memory figure counts for nothing.
    let blind = [(0, GpuProcess { pid: 10, used: None })];
    assert!(Detector::new(policy(OveruseAction::Warn)).assess(&blind, cgroup, &budgets, known, 0).current.is_empty());
}

#[test]
fn a_process_not_tied_to_a_container_counts_for_the_only_one_with_a_budget_or_the_pod() {
    let no_status = |_: &str| Some(KnownPod { pod: pod(UID_A, "train"), container_ids: vec![] });
    let one = [budget(UID_A, "train", "main", 0, 1000)];
    let v = Detector::new(policy(OveruseAction::Warn)).assess(&[process(0, 10, 1200)], cgroup, &one, no_status, 0);
    assert_eq!(v.current[0].container, "main");
    let two = [budget(UID_A, "train", "main", 0, 1000), budget(UID_A, "train", "side", 0, 1000)];
    let v = Detector::new(policy(OveruseAction::Warn)).assess(&[process(0, 10, 1900)], cgroup, &two, no_status, 0);
    assert!(v.current.is_empty(), "1900 MiB is within the pod's 2000 MiB on the GPU");
    let v = Detector::new(policy(OveruseAction::Warn)).assess(&[process(0, 10, 2500)], cgroup, &two, no_status, 0);
    assert_eq!((v.current[0].container.as_str(), v.current[0].budget), ("", Mib::new(2000)));
}

#[test]
fn evict_waits_its_time_and_asks_once_per_pod() {
    let mut d = Detector::new(policy(OveruseAction::Evict));
    let budgets = [budget(UID_A, "train", "main", 0, 1000), budget(UID_A, "train", "side", 1, 1000)];
    let over = [process(0, 10, 1500), process(1, 12, 1500)];
    assert!(d.assess(&over, cgroup, &budgets, known, 0).evict.is_empty());
    assert!(d.assess(&over, cgroup, &budgets, known, 59_999).evict.is_empty(), "not yet a minute");
    let due = d.assess(&over, cgroup, &budgets, known, 60_000);
    assert_eq!(due.evict.len(), 1, "one eviction for the pod, not one per container: {:?}", due.evict);
    assert_eq!(due.evict[0].pod.name, "train");
    assert!(d.assess(&over, cgroup, &budgets, known, 120_000).evict.is_empty(), "asked once");
    // Dropping back within budget restarts the clock.
    let mut d = Detector::new(policy(OveruseAction::Evict));
    d.assess(&over, cgroup, &budgets, known, 0);
    d.assess(&[], cgroup, &budgets, known, 30_000);
    assert!(d.assess(&over, cgroup, &budgets, known, 70_000).evict.is_empty());
    assert_eq!(d.assess(&over, cgroup, &budgets, known, 130_000).evict.len(), 1);
}

#[test]
fn gpus_served_through_dra_are_not_sampled() {
    use gpushare_core::{Gpu, GpuUuid, MemoryUnit, SharingMode};
    let modes = [SharingMode::Shared, SharingMode::Mps, SharingMode::Whole, SharingMode::Dra, SharingMode::DraMps];
    let gpus = (0..5u32)
        .map(|i| {
            let mut g = Gpu::new(i, GpuUuid::new(format!("GPU-{i}")).unwrap(), "T4", Mib::new(1000));
            g.mode = modes[i as usize];
            g
        })
        .collect();
    let inventory = NodeInventory::new(MemoryUnit::Mib, gpus).unwrap();
    assert_eq!(sampled(&inventory), [(0, false), (1, true), (2, false)]);
}
