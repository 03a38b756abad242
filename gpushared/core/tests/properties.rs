//! Property tests: placement never overcommits a GPU, never uses an unusable one, and finds a
//! placement whenever a brute-force search over every choice finds one; the annotation codecs
//! round-trip whatever they are given.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use gpushare_core::codec::assignment::{Assignment, ContainerAssignment, GpuShare};
use gpushare_core::codec::node::{NodeAllocation, NodeClaim, NodeState, PodRef};
use gpushare_core::dra::ClaimRef;
use gpushare_core::placement::{GpuPolicy, NodePolicy, NodeView, Placer, footprint};
use gpushare_core::request::{ContainerRequest, ContainerRole, PodRequest};
use gpushare_core::{Gpu, GpuUuid, Health, MemoryUnit, Mib, NodeInventory};
use proptest::prelude::*;

fn arb_gpu(index: u32) -> impl Strategy<Value = (Gpu, u64)> {
    (1u64..40_000, 0u8..10, 0u64..45_000, proptest::option::of(0u32..4)).prop_map(move |(total, state, used, numa)| {
        let mut g = Gpu::new(index, GpuUuid::new(format!("GPU-{index}")).unwrap(), "model", Mib::new(total));
        // Mostly healthy GPUs; some sick, some cordoned.
        match state {
            0 => g.health = Health::Unhealthy { reason: "Xid 48".into() },
            1 => g.cordoned = true,
            _ => {}
        }
        g.numa_node = numa;
        // Usage may be anything from nothing to beyond the total (a daemon's report).
        (g, used.min(total + 5000) * u64::from(state % 3 != 0))
    })
}

fn arb_node() -> impl Strategy<Value = (NodeInventory, Vec<Mib>)> {
    (prop_oneof![Just(MemoryUnit::Mib), Just(MemoryUnit::Gib)], 1usize..6).prop_flat_map(|(unit, n)| {
        (0..n).map(|i| arb_gpu(u32::try_from(i).unwrap())).collect::<Vec<_>>().prop_map(move |gpus| {
            let used = gpus.iter().map(|(_, u)| Mib::new(*u)).collect();
            let gpus = gpus.into_iter().map(|(g, _)| g).collect();
            (NodeInventory::new(unit, gpus).unwrap(), used)
        })
    })
}

fn arb_pod(unit: MemoryUnit) -> impl Strategy<Value = PodRequest> {
    let role =
        prop_oneof![3 => Just(ContainerRole::App), 1 => Just(ContainerRole::Init), 1 => Just(ContainerRole::Sidecar)];
    proptest::collection::vec((role, 1u64..25, 1u32..4), 1..4).prop_map(move |cs| {
        // Init containers (and sidecars) first, as the spec reader orders them.
        let mut cs = cs;
        cs.sort_by_key(|(r, _, _)| *r == ContainerRole::App);
        let step = if unit == MemoryUnit::Mib { 700 } else { 1 };
        let containers = cs
            .into_iter()
            .enumerate()
            .map(|(i, (role, per, k))| {
                let per_gpu = unit.to_mib(per * step).unwrap();
                ContainerRequest::new(format!("c{i}"), role, per_gpu.checked_mul(u64::from(k)).unwrap(), k, unit)
                    .unwrap()
            })
            .collect();
        PodRequest::new(unit, containers)
    })
}

fn capacity(g: &Gpu, unit: MemoryUnit) -> Mib {
    if g.is_schedulable() { g.capacity(unit) } else { Mib::ZERO }
}

/// Every way to give each container K distinct GPUs, checked with the footprint rule.
fn brute_force_fits(inv: &NodeInventory, used: &[Mib], pod: &PodRequest) -> bool {
    fn subsets(n: usize, k: usize) -> Vec<Vec<usize>> {
        (0u32..(1 << n))
            .filter(|m| m.count_ones() as usize == k)
            .map(|m| (0..n).filter(|i| m & (1 << i) != 0).collect())
            .collect()
    }
    let n = inv.gpus().len();
    let choices: Vec<Vec<Vec<usize>>> = pod.containers().iter().map(|c| subsets(n, c.gpus as usize)).collect();
    let mut pick = vec![0usize; choices.len()];
    if choices.iter().any(Vec::is_empty) {
        return false;
    }
    loop {
        let fp = footprint(
            pod.containers()
                .iter()
                .zip(&pick)
                .zip(&choices)
                .map(|((c, &p), ch)| (c.role, ch[p].iter().map(|&g| (g, c.per_gpu())).collect::<Vec<_>>())),
        );
        let ok = fp.iter().all(|(&g, &m)| {
            let cap = capacity(&inv.gpus()[g], inv.unit());
            cap > Mib::ZERO && used[g].checked_add(m).is_some_and(|t| t <= cap)
        });
        if ok {
            return true;
        }
        // Next combination (odometer).
        let mut i = 0;
        loop {
            if i == pick.len() {
                return false;
            }
            pick[i] += 1;
            if pick[i] < choices[i].len() {
                break;
            }
            pick[i] = 0;
            i += 1;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]

    #[test]
    fn placement_never_overcommits_and_misses_nothing(
        (inv, used) in arb_node(),
        pod in prop_oneof![arb_pod(MemoryUnit::Mib), arb_pod(MemoryUnit::Gib)],
        spread in any::<bool>(),
    ) {
        let policy = if spread { GpuPolicy::Spread } else { GpuPolicy::Binpack };
        let view = NodeView::new(&inv, &used).unwrap();
        let mut placer = Placer::new();
        let result = placer.place(view, &pod, policy);
        if inv.unit() != pod.unit() {
            prop_assert!(result.is_err());
            return Ok(());
        }
        match result {
            Ok(placement) => {
                // K distinct GPUs per container, each with the even share, none unusable.
                for (i, c) in pod.containers().iter().enumerate() {
                    let mut gpus: Vec<usize> = placement.gpus_of(i).collect();
                    prop_assert_eq!(gpus.len(), c.gpus as usize);
                    gpus.dedup();
                    prop_assert_eq!(gpus.len(), c.gpus as usize);
                    for s in placement.shares().iter().filter(|s| s.container == i) {
                        prop_assert_eq!(s.mib, c.per_gpu());
                        prop_assert!(inv.gpus()[s.gpu].is_schedulable());
                    }
                }
                // Usage plus the pod's footprint stays within every GPU's capacity.
                let fp = footprint(pod.containers().iter().enumerate().map(|(i, c)| {
                    (c.role, placement.shares().iter().filter(move |s| s.container == i).map(|s| (s.gpu, s.mib)))
                }));
                for (g, m) in &fp {
                    prop_assert_eq!(placement.footprint()[*g], *m);
                    let cap = capacity(&inv.gpus()[*g], inv.unit());
                    prop_assert!(used[*g].checked_add(*m).unwrap() <= cap, "GPU{} over: {} + {} > {}", g, used[*g], m, cap);
                }
                let score = placer.score(view, &pod, policy, NodePolicy::Binpack).unwrap();
                prop_assert!(score <= 10);
                prop_assert!(brute_force_fits(&inv, &used, &pod));
            }
            Err(rejection) => {
                prop_assert!(!brute_force_fits(&inv, &used, &pod), "refused a pod that fits: {}", rejection);
                // A reason preemption could fix must really be fixable on an empty node.
                let empty = vec![Mib::ZERO; used.len()];
                let fits_empty = placer.place(NodeView::new(&inv, &empty).unwrap(), &pod, policy).is_ok();
                prop_assert_eq!(rejection.is_resolvable(), fits_empty, "{}", rejection);
                prop_assert!(!rejection.to_string().is_empty());
            }
        }
    }

    #[test]
    fn node_state_round_trips(
        (inv, used) in arb_node(),
        generation in any::<u64>(),
        holders in proptest::collection::vec(("[a-z][a-z0-9-]{0,20}", "[a-z0-9-]{1,36}", "[a-z]{1,8}", 0u8..3, 1u64..100_000), 0..20),
        claims in proptest::collection::vec(("[a-z][a-z0-9-]{0,20}", "[a-z0-9-]{1,36}", "[a-z]{0,8}", 1u64..100_000), 0..10),
    ) {
        let n = inv.gpus().len();
        let allocations = holders
            .into_iter()
            .enumerate()
            .map(|(i, (name, uid, container, role, mib))| NodeAllocation {
                pod: PodRef { namespace: "ns".into(), name, uid },
                container,
                role: [ContainerRole::Init, ContainerRole::Sidecar, ContainerRole::App][usize::from(role)],
                gpu: u32::try_from(i % n).unwrap(),
                mib: Mib::new(mib),
            })
            .collect::<Vec<_>>();
        let claims = claims
            .into_iter()
            .enumerate()
            .map(|(i, (name, uid, request, mib))| NodeClaim {
                claim: ClaimRef { uid, namespace: "ns".into(), name },
                request,
                gpu: u32::try_from(i % n).unwrap(),
                mib: Mib::new(mib),
            })
            .collect::<Vec<_>>();
        let state = NodeState { generation, daemon_version: "0.1.0".into(), inventory: inv, used, allocations, claims, over_budget: vec![], tells_lookalikes_apart: false };
        let text = state.encode().unwrap();
        let back = NodeState::decode(&text).unwrap();
        // Allocations come back grouped by GPU; compare as sets.
        let mut want = state.allocations.clone();
        let mut got = back.allocations.clone();
        want.sort_by(|a, b| (a.gpu, &a.pod, &a.container).cmp(&(b.gpu, &b.pod, &b.container)));
        got.sort_by(|a, b| (a.gpu, &a.pod, &a.container).cmp(&(b.gpu, &b.pod, &b.container)));
        prop_assert_eq!(want, got);
        let mut want = state.claims.clone();
        let mut got = back.claims.clone();
        want.sort_by(|a, b| (a.gpu, &a.claim, &a.request).cmp(&(b.gpu, &b.claim, &b.request)));
        got.sort_by(|a, b| (a.gpu, &a.claim, &a.request).cmp(&(b.gpu, &b.claim, &b.request)));
        prop_assert_eq!(want, got);
        prop_assert_eq!(back.inventory, state.inventory);
        prop_assert_eq!(back.used, state.used);
        prop_assert_eq!(back.generation, generation);
    }

    #[test]
    fn assignment_round_trips(
        node in "[a-z][a-z0-9.-]{0,40}",
        containers in proptest::collection::vec((0u8..3, proptest::collection::btree_set(0u32..8, 1..4), 1u64..80_000), 1..6),
    ) {
        let a = Assignment {
            node,
            unit: MemoryUnit::Mib,
            containers: containers
                .into_iter()
                .enumerate()
                .map(|(i, (role, gpus, mib))| ContainerAssignment {
                    name: format!("c{i}"),
                    role: [ContainerRole::Init, ContainerRole::Sidecar, ContainerRole::App][usize::from(role)],
                    gpus: gpus
                        .into_iter()
                        .map(|g| GpuShare { index: g, uuid: GpuUuid::new(format!("GPU-{g}")).unwrap(), mib: Mib::new(mib) })
                        .collect(),
                })
                .collect(),
        };
        prop_assert_eq!(Assignment::decode(&a.encode().unwrap()).unwrap(), a);
    }

    #[test]
    fn decoders_never_panic(text in ".{0,400}") {
        let _ = NodeState::decode(&text);
        let _ = Assignment::decode(&text);
    }

    #[test]
    fn decoders_never_panic_on_near_miss_json(
        v in prop_oneof![Just("1".to_owned()), Just("2".to_owned()), Just("\"1\"".to_owned()), Just("null".to_owned())],
        body in "[\\[\\]{}\",:a-z0-9 -]{0,200}",
    ) {
        let _ = NodeState::decode(&format!("{{\"v\":{v},{body}}}"));
        let _ = Assignment::decode(&format!("{{\"v\":{v},\"node\":\"n\",\"unit\":\"MiB\",\"containers\":[{body}]}}"));
    }
}
