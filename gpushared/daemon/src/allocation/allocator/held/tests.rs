//! The indexes against a plain scan of the rows, after any sequence of changes.

use std::collections::BTreeSet;
use std::sync::Arc;

use gpushare_core::codec::node::PodRef;
use gpushare_core::{ContainerRole, GpuUuid, Mib};

use super::{Held, HeldRows};

const PODS: [&str; 3] = ["a", "b", "c"];
const CONTAINERS: [&str; 2] = ["main", "side"];
const DEVICES: [&str; 3] = ["d0", "d1", "d2"];

fn row(id: i64, pod: &str, container: &str, first_device: Option<&str>, allocated_at: i64) -> Arc<Held> {
    Arc::new(Held {
        key_hash: 0,
        id,
        pod: PodRef { namespace: "default".into(), name: format!("pod-{pod}"), uid: pod.into() },
        container: container.into(),
        role: ContainerRole::App,
        gpu: GpuUuid::new("GPU-0").unwrap(),
        gpu_index: 0,
        mib: Mib::new(100),
        first_device: first_device.map(str::to_owned),
        allocated_at,
    })
}

/// Every question the allocator asks of the indexes, answered by the index and by a scan.
fn assert_in_step(held: &HeldRows, model: &[Arc<Held>]) {
    let ids = |rows: &[Arc<Held>]| rows.iter().map(|h| h.id).collect::<Vec<_>>();
    assert_eq!(ids(held), ids(model), "the rows, in allocation order");
    for pod in PODS {
        assert_eq!(held.holds_any(pod), model.iter().any(|h| h.pod.uid == pod), "pod {pod}");
        for container in CONTAINERS {
            let scanned = model.iter().any(|h| h.pod.uid == pod && h.container == container);
            assert_eq!(held.holds(pod, container), scanned, "pod {pod} container {container}");
        }
    }
    // Every subset of devices offered, every cut-off, every exception.
    for offered in 0..8usize {
        let devices: Vec<&str> =
            DEVICES.iter().enumerate().filter(|(i, _)| offered & (1 << i) != 0).map(|(_, d)| *d).collect();
        for since in 0..3 {
            for except in [vec![], vec!["d1".to_owned()]] {
                let scanned: BTreeSet<i64> = model
                    .iter()
                    .filter(|h| h.allocated_at >= since)
                    .filter(|h| {
                        h.first_device.as_ref().is_some_and(|f| devices.contains(&f.as_str()) && !except.contains(f))
                    })
                    .map(|h| h.id)
                    .collect();
                assert_eq!(held.recent_beginning_with(devices.iter().copied(), since, &except), scanned);
            }
        }
    }
}

#[test]
fn a_pod_released_leaves_no_trace_in_the_indexes() {
    let mut held: HeldRows =
        [row(1, "a", "main", Some("d0"), 2), row(2, "a", "side", Some("d1"), 2), row(3, "b", "main", Some("d0"), 2)]
            .into_iter()
            .collect();
    assert!(held.holds("a", "side"));
    assert_eq!(held.recent_beginning_with(["d0"], 0, &[]), BTreeSet::from([1, 3]));
    let gone = held.remove_where(|h| h.pod.uid == "a");
    assert_eq!(gone.iter().map(|h| h.id).collect::<Vec<_>>(), vec![1, 2]);
    assert!(!held.holds_any("a"));
    assert!(!held.holds("a", "side"));
    assert!(held.holds("b", "main"));
    assert_eq!(held.recent_beginning_with(["d0", "d1"], 0, &[]), BTreeSet::from([3]));
    assert_eq!(held.recent_beginning_with(["d0"], 3, &[]), BTreeSet::new(), "older than the cut-off");
}

proptest::proptest! {
    /// Rows added and removed in any order: the indexes answer as a scan of the rows would.
    #[test]
    fn the_indexes_answer_as_a_scan_of_the_rows(
        steps in proptest::collection::vec(
            (proptest::bool::weighted(0.7), 0usize..3, 0usize..2, proptest::option::of(0usize..3), 0i64..3),
            0..40,
        ),
    ) {
        let mut held = HeldRows::default();
        let mut model: Vec<Arc<Held>> = Vec::new();
        for (i, &(add, pod, container, first, at)) in steps.iter().enumerate() {
            if add {
                let r = row(i64::try_from(i).unwrap(), PODS[pod], CONTAINERS[container], first.map(|d| DEVICES[d]), at);
                held.extend([Arc::clone(&r)]);
                model.push(r);
            } else {
                // Released: one container's rows (a repair), or a whole pod's.
                let whole_pod = first.is_none();
                let gone = |h: &Held| h.pod.uid == PODS[pod] && (whole_pod || h.container == CONTAINERS[container]);
                let removed = held.remove_where(gone);
                let expected: Vec<i64> = model.iter().filter(|h| gone(h)).map(|h| h.id).collect();
                proptest::prop_assert_eq!(removed.iter().map(|h| h.id).collect::<Vec<_>>(), expected);
                model.retain(|h| !gone(h));
            }
            assert_in_step(&held, &model);
        }
    }
}
