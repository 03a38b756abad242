//! Table-driven tests of placement, scoring and rejection reasons.

use super::*;
use crate::inventory::{Gpu, GpuUuid, Health};
use crate::request::ContainerRequest;
use crate::units::MemoryUnit;

/// A GPU: total MiB, used MiB, and its state.
#[derive(Clone, Copy)]
struct G(u64, u64, State);

#[derive(Clone, Copy, PartialEq)]
enum State {
    Ok,
    Sick,
    Cordoned,
    Whole,
}

const OK: State = State::Ok;

fn node(unit: MemoryUnit, gpus: &[G]) -> (NodeInventory, Vec<Mib>) {
    let inv = gpus
        .iter()
        .zip(0u32..)
        .map(|(G(total, _, state), i)| {
            let mut g = Gpu::new(i, GpuUuid::new(format!("GPU-{i}")).unwrap(), "T4", Mib::new(*total));
            g.health =
                if *state == State::Sick { Health::Unhealthy { reason: "Xid 79".into() } } else { Health::Healthy };
            g.cordoned = *state == State::Cordoned;
            if *state == State::Whole {
                g.mode = crate::inventory::SharingMode::Whole;
            }
            g
        })
        .collect();
    (NodeInventory::new(unit, inv).unwrap(), gpus.iter().map(|G(_, used, _)| Mib::new(*used)).collect())
}

fn pod(containers: &[(&str, ContainerRole, u64, u32)]) -> PodRequest {
    PodRequest::new(
        MemoryUnit::Mib,
        containers
            .iter()
            .map(|(name, role, mib, k)| {
                ContainerRequest::new(*name, *role, Mib::new(*mib), *k, MemoryUnit::Mib).unwrap()
            })
            .collect(),
    )
}

fn app(name: &str, mib: u64) -> (&str, ContainerRole, u64, u32) {
    (name, ContainerRole::App, mib, 1)
}

/// Places and returns, per container, the GPU indices it got.
fn placed(gpus: &[G], p: &PodRequest, policy: GpuPolicy) -> Result<Vec<Vec<usize>>, Rejection> {
    let (inv, used) = node(MemoryUnit::Mib, gpus);
    let placement = place(NodeView::new(&inv, &used).unwrap(), p, policy)?;
    Ok((0..p.containers().len()).map(|c| placement.gpus_of(c).collect()).collect())
}

/// What is tested, the node, the pod, the policy, and each container's GPUs.
type Case<'a> = (&'a str, &'a [G], PodRequest, GpuPolicy, Vec<Vec<usize>>);

#[test]
fn gpu_policies_choose_as_documented() {
    let three = [G(16_000, 6000, OK), G(16_000, 12_000, OK), G(16_000, 0, OK)];
    let cases: &[Case<'_>] = &[
        ("binpack takes the fullest GPU that fits", &three, pod(&[app("a", 3500)]), GpuPolicy::Binpack, vec![vec![1]]),
        ("spread takes the emptiest GPU", &three, pod(&[app("a", 3500)]), GpuPolicy::Spread, vec![vec![2]]),
        ("binpack skips a GPU without room", &three, pod(&[app("a", 5000)]), GpuPolicy::Binpack, vec![vec![0]]),
        (
            "ties go to the lowest index",
            &[G(8000, 0, OK), G(8000, 0, OK)],
            pod(&[app("a", 1000)]),
            GpuPolicy::Binpack,
            vec![vec![0]],
        ),
        (
            "ties go to the lowest index under spread too",
            &[G(8000, 0, OK), G(8000, 0, OK)],
            pod(&[app("a", 1000)]),
            GpuPolicy::Spread,
            vec![vec![0]],
        ),
        (
            "two GPUs for one container: the two fullest that fit",
            &three,
            pod(&[("a", ContainerRole::App, 8000, 2)]),
            GpuPolicy::Binpack,
            vec![vec![0, 1]],
        ),
        (
            "two GPUs for one container: the two emptiest",
            &three,
            pod(&[("a", ContainerRole::App, 8000, 2)]),
            GpuPolicy::Spread,
            vec![vec![0, 2]],
        ),
        (
            "unhealthy, cordoned and whole GPUs are never chosen",
            &[
                G(16_000, 15_000, OK),
                G(16_000, 0, State::Sick),
                G(16_000, 0, State::Cordoned),
                G(16_000, 0, State::Whole),
                G(16_000, 8000, OK),
            ],
            pod(&[app("a", 2000)]),
            GpuPolicy::Spread,
            vec![vec![4]],
        ),
        (
            "containers of one pod may share a GPU",
            &three,
            pod(&[app("a", 2000), app("b", 2000)]),
            GpuPolicy::Binpack,
            vec![vec![1], vec![1]],
        ),
        (
            // Best-fit decreasing puts 5 with 7, 4 with 8, 3 with 8 and has no room for the
            // last 3; the search finds 7 = 4 + 3 and 8 = 5 + 3.
            "the search finds what a greedy pass misses",
            &[G(7000, 0, OK), G(8000, 0, OK)],
            pod(&[app("a", 5000), app("b", 4000), app("c", 3000), app("d", 3000)]),
            GpuPolicy::Binpack,
            vec![vec![1], vec![0], vec![0], vec![1]],
        ),
        (
            "an init container goes where the app containers are when it fits",
            &[G(16_000, 0, OK), G(16_000, 8000, OK)],
            pod(&[("init", ContainerRole::Init, 2000, 1), app("main", 3000)]),
            GpuPolicy::Binpack,
            vec![vec![1], vec![1]],
        ),
        (
            // Binpack alone would put the app on the fuller GPU1 and the init container on
            // GPU0: 16 000 charged where 10 000 on GPU0 do.
            "the app goes where its init container can run too, when that charges less",
            &[G(16_000, 4000, OK), G(16_000, 9000, OK)],
            pod(&[("init", ContainerRole::Init, 10_000, 1), app("main", 6000)]),
            GpuPolicy::Binpack,
            vec![vec![0], vec![0]],
        ),
        (
            "init 20 000 + app 1 000 take one A10, not 1 000 on a fuller GPU and 20 000 on another",
            &[G(23_028, 15_000, OK), G(23_028, 15_000, OK), G(23_028, 0, OK)],
            pod(&[("init", ContainerRole::Init, 20_000, 1), app("main", 1000)]),
            GpuPolicy::Binpack,
            vec![vec![2], vec![2]],
        ),
        (
            "with two app containers, the init container runs beside the one that leaves it room",
            &[G(16_000, 4000, OK), G(16_000, 9000, OK)],
            pod(&[("init", ContainerRole::Init, 12_000, 1), app("a", 7000), app("b", 6000)]),
            GpuPolicy::Binpack,
            vec![vec![0], vec![0], vec![1]],
        ),
    ];
    for (what, gpus, p, policy, want) in cases {
        assert_eq!(placed(gpus, p, *policy).as_ref(), Ok(want), "{what}");
    }
}

#[test]
fn init_containers_count_the_way_kubernetes_counts_them() {
    let one_gpu = [G(8000, 0, OK)];
    // Init 5000 then app 5000: they never run together.
    assert!(placed(&one_gpu, &pod(&[("i", ContainerRole::Init, 5000, 1), app("a", 5000)]), GpuPolicy::Binpack).is_ok());
    // A sidecar started before the init container runs beside it: 4000 + 5000 > 8000.
    let sidecar_first =
        pod(&[("proxy", ContainerRole::Sidecar, 4000, 1), ("init", ContainerRole::Init, 5000, 1), app("main", 1000)]);
    assert!(placed(&one_gpu, &sidecar_first, GpuPolicy::Binpack).is_err());
    // The same containers with the init container first fit: max(5000, 4000 + 1000).
    let init_first =
        pod(&[("init", ContainerRole::Init, 5000, 1), ("proxy", ContainerRole::Sidecar, 4000, 1), app("main", 1000)]);
    let (inv, used) = node(MemoryUnit::Mib, &one_gpu);
    let p = place(NodeView::new(&inv, &used).unwrap(), &init_first, GpuPolicy::Binpack).unwrap();
    assert_eq!(p.footprint(), &[Mib::new(5000)]);
    // App containers add up.
    assert!(placed(&one_gpu, &pod(&[app("a", 5000), app("b", 5000)]), GpuPolicy::Binpack).is_err());
}

#[test]
fn footprint_function_agrees_with_the_placer() {
    let p = pod(&[
        ("init", ContainerRole::Init, 6000, 1),
        ("proxy", ContainerRole::Sidecar, 1000, 1),
        ("late", ContainerRole::Init, 3000, 2),
        ("main", ContainerRole::App, 4000, 2),
    ]);
    let (inv, used) = node(MemoryUnit::Mib, &[G(16_000, 1000, OK), G(16_000, 0, OK), G(8000, 0, OK)]);
    for policy in [GpuPolicy::Binpack, GpuPolicy::Spread] {
        let placement = place(NodeView::new(&inv, &used).unwrap(), &p, policy).unwrap();
        let by_fn = footprint(p.containers().iter().enumerate().map(|(i, c)| {
            (c.role, placement.shares().iter().filter(move |s| s.container == i).map(|s| (s.gpu, s.mib)))
        }));
        for (gpu, mib) in placement.footprint().iter().enumerate() {
            assert_eq!(by_fn.get(&gpu).copied().unwrap_or(Mib::ZERO), *mib, "{policy:?} GPU{gpu}");
        }
    }
}

#[test]
fn rejections_name_the_gpus_and_say_whether_preemption_helps() {
    let t4 = 16_276;
    let cases: &[(&str, &[G], PodRequest, &str, bool)] = &[
        ("no GPUs", &[], pod(&[app("a", 1)]), "node has no GPUs", false),
        (
            "nothing schedulable",
            &[G(t4, 0, State::Sick), G(t4, 0, State::Cordoned)],
            pod(&[app("a", 1)]),
            "no GPU takes allocations: GPU0: unhealthy (Xid 79); GPU1: cordoned",
            false,
        ),
        (
            "only whole GPUs",
            &[G(t4, 0, State::Whole), G(t4, 0, State::Whole)],
            pod(&[app("a", 1)]),
            "no GPU takes allocations: GPU0: handed out whole, not shared; GPU1: handed out whole, not shared",
            false,
        ),
        (
            "a whole GPU is not a second GPU for a share",
            &[G(t4, 0, OK), G(t4, 0, State::Whole)],
            pod(&[("a", ContainerRole::App, 4000, 2)]),
            "container \"a\" needs 2 GPUs, node has 1 that take allocations",
            false,
        ),
        (
            "too few GPUs",
            &[G(t4, 0, OK), G(t4, 0, State::Sick)],
            pod(&[("a", ContainerRole::App, 4000, 2)]),
            "container \"a\" needs 2 GPUs, node has 1 that take allocations",
            false,
        ),
        (
            "GPU too small even empty",
            &[G(t4, 0, OK)],
            pod(&[app("a", 20_000)]),
            "container \"a\" needs 20000 MiB on a GPU, the largest usable GPU here has 16276 MiB",
            false,
        ),
        (
            "pod too large even on an empty node",
            &[G(t4, 0, OK)],
            pod(&[app("a", 10_000), app("b", 10_000)]),
            "the pod's containers together need more than this node's usable GPUs hold even when empty",
            false,
        ),
        (
            "no room now: names each GPU",
            &[G(t4, t4 - 2000, OK), G(t4, 0, State::Sick), G(t4, t4 - 3400, OK)],
            pod(&[app("main", 3500)]),
            "container \"main\" does not fit: GPU0: 2000 of 16276 MiB free, needs 3500; GPU1: unhealthy (Xid 79); \
             GPU2: 3400 of 16276 MiB free, needs 3500",
            true,
        ),
        (
            "no room now on two GPUs",
            &[G(t4, 0, OK), G(t4, t4 - 2000, OK)],
            pod(&[("main", ContainerRole::App, 8000, 2)]),
            "container \"main\" needs 2 GPUs with 4000 MiB free each: GPU0: 16276 of 16276 MiB free; \
             GPU1: 2000 of 16276 MiB free, needs 4000",
            true,
        ),
        (
            "each fits alone but not together",
            &[G(t4, 6276, OK)],
            pod(&[app("a", 6000), app("b", 6000)]),
            "the pod's containers do not fit together: GPU0: 10000 of 16276 MiB free",
            true,
        ),
    ];
    for (what, gpus, p, want, resolvable) in cases {
        let err = placed(gpus, p, GpuPolicy::Binpack).expect_err(what);
        assert_eq!(err.to_string(), *want, "{what}");
        assert_eq!(err.is_resolvable(), *resolvable, "{what}");
    }
}

#[test]
fn a_node_in_another_unit_is_refused() {
    let (inv, used) = node(MemoryUnit::Gib, &[G(16_384, 0, OK)]);
    let err = place(NodeView::new(&inv, &used).unwrap(), &pod(&[app("a", 1024)]), GpuPolicy::Binpack).unwrap_err();
    assert_eq!(err.to_string(), "node counts GPU memory in GiB, the cluster in MiB; set the same unit on its daemon");
    assert!(!err.is_resolvable());
}

#[test]
fn gib_nodes_offer_whole_gib_only() {
    let (inv, used) = node(MemoryUnit::Gib, &[G(16_276, 0, OK)]);
    let view = NodeView::new(&inv, &used).unwrap();
    let gib = |n: u64| {
        PodRequest::new(
            MemoryUnit::Gib,
            vec![ContainerRequest::new("a", ContainerRole::App, Mib::new(n * 1024), 1, MemoryUnit::Gib).unwrap()],
        )
    };
    assert!(place(view, &gib(15), GpuPolicy::Binpack).is_ok());
    assert!(matches!(place(view, &gib(16), GpuPolicy::Binpack), Err(Rejection::GpuTooSmall { .. })));
}

#[test]
fn usage_must_line_up_with_the_inventory() {
    let (inv, _) = node(MemoryUnit::Mib, &[G(1000, 0, OK), G(1000, 0, OK)]);
    assert_eq!(NodeView::new(&inv, &[Mib::ZERO]).unwrap_err(), UsageMismatch { usage: 1, gpus: 2 });
}

#[test]
fn node_scores_follow_the_node_policy() {
    let p = pod(&[app("a", 3000)]);
    let mut placer = Placer::new();
    let cases: &[(&[G], u8, u8)] = &[
        // capacity 10000, 5000 used, +3000 -> 80% full.
        (&[G(10_000, 5000, OK)], 8, 2),
        (&[G(10_000, 0, OK)], 3, 7),
        (&[G(10_000, 7000, OK)], 10, 0),
        // unusable GPUs do not count as capacity.
        (&[G(10_000, 0, OK), G(10_000, 0, State::Sick)], 3, 7),
        // usage above capacity (a daemon reporting an overcommit) clamps instead of overflowing.
        (&[G(10_000, 0, OK), G(10_000, 50_000, OK)], 6, 4),
    ];
    for (gpus, binpack, spread) in cases {
        let (inv, used) = node(MemoryUnit::Mib, gpus);
        let view = NodeView::new(&inv, &used).unwrap();
        assert_eq!(placer.score(view, &p, GpuPolicy::Binpack, NodePolicy::Binpack), Ok(*binpack));
        assert_eq!(placer.score(view, &p, GpuPolicy::Binpack, NodePolicy::Spread), Ok(*spread));
    }
}

#[test]
fn policies_parse_from_config_words() {
    assert_eq!("binpack".parse::<GpuPolicy>(), Ok(GpuPolicy::Binpack));
    assert_eq!("spread".parse::<NodePolicy>(), Ok(NodePolicy::Spread));
    assert_eq!(
        "best-fit".parse::<GpuPolicy>().unwrap_err().to_string(),
        "unknown placement policy \"best-fit\": write \"binpack\" or \"spread\""
    );
}

#[test]
fn schedule_picks_the_best_node_first_among_equals() {
    use crate::schedule::{Policies, best, evaluate};
    let p = pod(&[app("a", 3000)]);
    let nodes = [
        node(MemoryUnit::Mib, &[G(10_000, 9000, OK)]), // rejected
        node(MemoryUnit::Mib, &[G(10_000, 5000, OK)]), // 8
        node(MemoryUnit::Mib, &[G(10_000, 0, OK)]),    // 3
        node(MemoryUnit::Mib, &[G(10_000, 5000, OK)]), // 8
    ];
    let views = nodes.iter().map(|(inv, used)| NodeView::new(inv, used).unwrap());
    let verdicts = evaluate(&mut Placer::new(), views, &p, Policies::default());
    assert!(verdicts[0].as_ref().is_err_and(Rejection::is_resolvable));
    assert_eq!(best(&verdicts), Some(1));
    let spread = Policies { gpu: GpuPolicy::Spread, node: NodePolicy::Spread };
    let views = nodes.iter().map(|(inv, used)| NodeView::new(inv, used).unwrap());
    assert_eq!(best(&evaluate(&mut Placer::new(), views, &p, spread)), Some(2));
    assert_eq!(best(&[Err(Rejection::NoGpus)]), None);
}
