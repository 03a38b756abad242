//! The resolver's rules on tables: pods as the watch stores them, rows as the ledger holds them,
//! admissions as the kubelet's earlier calls left them; the container chosen, or the refusal.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment, ContainerAssignment, GpuShare};
use gpushare_core::codec::node::PodRef;
use gpushare_core::{ContainerRole, GpuUuid, MemoryUnit, Mib, ResourceNames};

use super::{Care, KubeletListing, KubeletSays, Scope};
use crate::allocation::allocator::AllocError;
use crate::allocation::allocator::admission::{Admissions, Owner, Step};
use crate::allocation::allocator::held::{Held, HeldRows};
use crate::allocation::allocator::tests::{ContainerSpec, spec_of};
use crate::allocation::pods::{PodStore, PodView, StoredPod};

const APP: ContainerRole = ContainerRole::App;
const INIT: ContainerRole = ContainerRole::Init;

fn uuid(i: u32) -> GpuUuid {
    GpuUuid::new(format!("GPU-{i}")).unwrap()
}

/// A pod of the table: UID, creation time, node, and its containers as assigned.
struct P<'a> {
    uid: &'a str,
    created: &'a str,
    node: &'a str,
    containers: &'a [ContainerSpec<'a>],
    /// The spec disagrees with the assignment (each container asks 1 MiB more).
    bad: bool,
    terminal: bool,
    /// Its resource version when first stored: the order the watch delivered it.
    version: u64,
}

const fn p<'a>(uid: &'a str, created: &'a str, containers: &'a [ContainerSpec<'a>]) -> P<'a> {
    P { uid, created, node: "node-a", containers, bad: false, terminal: false, version: 0 }
}

/// A container as its pod's spec asks: name, role, (GPU index, MiB) shares.
type Asked<'a> = (&'a str, ContainerRole, Vec<(u32, u64)>);

fn stored(pods: &[P<'_>]) -> Vec<Arc<StoredPod>> {
    let names = ResourceNames::gpushare();
    let store = PodStore::new();
    for p in pods {
        let assignment = Assignment {
            node: p.node.into(),
            unit: MemoryUnit::Mib,
            containers: p
                .containers
                .iter()
                .map(|(name, role, gpus)| ContainerAssignment {
                    name: (*name).into(),
                    role: *role,
                    gpus: gpus
                        .iter()
                        .map(|(i, mib)| GpuShare { index: *i, uuid: uuid(*i), mib: Mib::new(*mib) })
                        .collect(),
                })
                .collect(),
        };
        let asked: Vec<Asked<'_>> = p
            .containers
            .iter()
            .map(|(n, r, g)| (*n, *r, g.iter().map(|(i, m)| (*i, m + u64::from(p.bad))).collect()))
            .collect();
        let asked: Vec<ContainerSpec<'_>> = asked.iter().map(|(n, r, g)| (*n, *r, g.as_slice())).collect();
        store.upsert(PodView {
            pod: PodRef { namespace: "default".into(), name: format!("pod-{}", p.uid), uid: p.uid.into() },
            node: Some("node-a".into()),
            created: p.created.into(),
            version: p.version,
            terminal: p.terminal,
            spec: spec_of(&names, &asked),
            annotations: BTreeMap::from([(ASSIGNMENT_KEY.to_owned(), assignment.encode().unwrap())]),
            container_ids: Vec::new(),
        });
    }
    store.snapshot()
}

/// A live row of (pod UID, container) on GPU 0.
fn held(rows: &[(&str, &str)]) -> HeldRows {
    rows.iter()
        .enumerate()
        .map(|(id, (uid, container))| {
            Arc::new(Held {
                key_hash: 0,
                id: i64::try_from(id).unwrap(),
                pod: PodRef { namespace: "default".into(), name: format!("pod-{uid}"), uid: (*uid).into() },
                container: (*container).into(),
                role: APP,
                gpu: uuid(0),
                gpu_index: 0,
                mib: Mib::new(100),
                first_device: None,
                allocated_at: 0,
            })
        })
        .collect()
}

/// The outcome as a line: `pod/container`, or the refusal's kind.
fn outcome(r: &Result<super::Candidate, AllocError>) -> String {
    match r {
        Ok(c) => format!("{}/{}", c.view().pod.uid, c.container().name),
        Err(AllocError::NoCandidate { .. }) => "no candidate".into(),
        Err(AllocError::Doubtful { pod, .. }) => format!("doubtful {pod}"),
        Err(AllocError::Ambiguous { first, other, .. }) => format!("ambiguous {first} {other}"),
        Err(AllocError::BadAssignment { pod, .. }) => format!("bad assignment {pod}"),
        Err(AllocError::BadRequest(_)) => "bad request".into(),
        Err(AllocError::Unconfirmed { pod }) => format!("unconfirmed {pod}"),
        Err(e) => format!("other: {e}"),
    }
}

struct Case<'a> {
    name: &'a str,
    pods: &'a [P<'a>],
    held: &'a [(&'a str, &'a str)],
    steps: &'a [Step],
    units: usize,
    patient: bool,
    want: &'a str,
}

#[test]
fn the_container_a_call_is_for() {
    let one_a = [("a", APP, &[(0, 100)][..])];
    let one_on_1 = [("a", APP, &[(1, 100)][..])];
    let two = [("init", INIT, &[(0, 100)][..]), ("a", APP, &[(0, 200)][..])];
    let two_hundred_on_1 = [("a", APP, &[(1, 200)][..])];
    let admitting = |uid: &str| Step::Allocated { key: "k".into(), uid: uid.into() };
    let proposed = |uid: &str| Step::Proposed {
        key: format!("key-{uid}"),
        owner: Owner { uid: uid.into(), container: "a".into() },
    };
    let cases = [
        Case {
            name: "the oldest of look-alikes on the same GPU",
            pods: &[p("y", "2026-01-02", &one_a), p("x", "2026-01-01", &one_a)],
            held: &[],
            steps: &[],
            units: 100,
            patient: true,
            want: "x/a",
        },
        Case {
            name: "look-alikes created in the same second in the order the watch delivered them",
            pods: &[
                P { version: 9, ..p("a", "2026-01-01T00:00:00Z", &one_a) },
                P { version: 5, ..p("z", "2026-01-01T00:00:00Z", &one_a) },
            ],
            held: &[],
            steps: &[],
            units: 100,
            patient: true,
            want: "z/a",
        },
        Case {
            name: "the pod being admitted before older ones",
            pods: &[p("x", "2026-01-01", &one_a), p("y", "2026-01-02", &two)],
            held: &[("y", "init")],
            steps: &[admitting("y")],
            units: 200,
            patient: true,
            want: "y/a",
        },
        Case {
            name: "a container with an outstanding proposal after one without",
            pods: &[p("x", "2026-01-01", &one_a), p("y", "2026-01-02", &one_a)],
            held: &[],
            steps: &[proposed("x")],
            units: 100,
            patient: false,
            want: "y/a",
        },
        Case {
            name: "a doubtful pod first in line is refused, not skipped",
            pods: &[p("x", "2026-01-01", &one_a), p("y", "2026-01-02", &one_a)],
            held: &[],
            steps: &[Step::Offered { uid: "x".into() }],
            units: 100,
            patient: false,
            want: "doubtful default/pod-x",
        },
        Case {
            name: "look-alikes on other GPUs make a patient call wait",
            pods: &[p("x", "2026-01-01", &one_a), p("y", "2026-01-02", &one_on_1)],
            held: &[],
            steps: &[],
            units: 100,
            patient: true,
            want: "ambiguous default/pod-x default/pod-y",
        },
        Case {
            name: "an impatient call takes the oldest look-alike",
            pods: &[p("x", "2026-01-01", &one_a), p("y", "2026-01-02", &one_on_1)],
            held: &[],
            steps: &[],
            units: 100,
            patient: false,
            want: "x/a",
        },
        Case {
            name: "a pod that started admission is no guess",
            pods: &[p("x", "2026-01-01", &two), p("y", "2026-01-02", &two_hundred_on_1)],
            held: &[("x", "init")],
            steps: &[],
            units: 200,
            patient: true,
            want: "x/a",
        },
        Case {
            name: "the init container before the app container",
            pods: &[p("x", "2026-01-01", &two)],
            held: &[],
            steps: &[],
            units: 100,
            patient: true,
            want: "x/init",
        },
        Case {
            name: "no pod waits for this size",
            pods: &[p("x", "2026-01-01", &one_a)],
            held: &[],
            steps: &[],
            units: 300,
            patient: true,
            want: "no candidate",
        },
        Case {
            name: "a pod with every container held waits for nothing",
            pods: &[p("x", "2026-01-01", &one_a)],
            held: &[("x", "a")],
            steps: &[],
            units: 100,
            patient: true,
            want: "no candidate",
        },
        Case {
            name: "pods assigned elsewhere or finished are not candidates",
            pods: &[
                P { node: "node-b", ..p("x", "2026-01-01", &one_a) },
                P { terminal: true, ..p("y", "2026-01-01", &one_a) },
            ],
            held: &[],
            steps: &[],
            units: 100,
            patient: true,
            want: "no candidate",
        },
        Case {
            name: "an assignment that disagrees with its pod's spec is named",
            pods: &[P { bad: true, ..p("x", "2026-01-01", &one_a) }],
            held: &[],
            steps: &[],
            units: 101,
            patient: true,
            want: "bad assignment default/pod-x",
        },
        Case {
            name: "zero devices is the kubelet's mistake",
            pods: &[p("x", "2026-01-01", &one_a)],
            held: &[],
            steps: &[],
            units: 0,
            patient: true,
            want: "bad request",
        },
    ];
    let names = ResourceNames::gpushare();
    let scope = Scope { node: "node-a", names: &names, unit: MemoryUnit::Mib };
    for case in &cases {
        let mut admissions = Admissions::default();
        for step in case.steps {
            admissions.apply(step.clone());
        }
        let care = Care { patient: case.patient, ..Care::PATIENT };
        let got = scope.choose(&stored(case.pods), &held(case.held), &admissions, case.units, &care);
        assert_eq!(outcome(&got), case.want, "{}", case.name);
    }
}

#[test]
fn an_unconfirmed_store_serves_only_a_pod_the_kubelet_already_admits() {
    let names = ResourceNames::gpushare();
    let scope = Scope { node: "node-a", names: &names, unit: MemoryUnit::Mib };
    let unconfirmed = Care { confirmed: false, ..Care::PATIENT };
    let two = [("init", INIT, &[(0, 100)][..]), ("a", APP, &[(0, 200)][..])];
    let pods = stored(&[p("x", "2026-01-01", &two)]);
    let none = Admissions::default();
    // The only pod in view may not be the one the kubelet admits; nor may "none waits".
    assert_eq!(outcome(&scope.choose(&pods, &held(&[]), &none, 100, &unconfirmed)), "unconfirmed default/pod-x");
    assert_eq!(outcome(&scope.choose(&pods, &held(&[]), &none, 300, &unconfirmed)), "unconfirmed ");
    assert_eq!(outcome(&scope.choose(&[], &held(&[]), &none, 100, &unconfirmed)), "unconfirmed ");
    // Its next container once its first holds a row, or while it is the pod being admitted.
    assert_eq!(outcome(&scope.choose(&pods, &held(&[("x", "init")]), &none, 200, &unconfirmed)), "x/a");
    let mut admitting = Admissions::default();
    admitting.apply(Step::Allocated { key: "k".into(), uid: "x".into() });
    assert_eq!(outcome(&scope.choose(&pods, &held(&[]), &admitting, 100, &unconfirmed)), "x/init");
}

#[test]
fn the_kubelet_names_the_pod_among_look_alikes() {
    let names = ResourceNames::gpushare();
    let scope = Scope { node: "node-a", names: &names, unit: MemoryUnit::Mib };
    let none = Admissions::default();
    // Three look-alikes: x and z on GPU0, y (younger) on GPU1.
    let pods = stored(&[
        p("x", "2026-01-01", &[("a", APP, &[(0, 100)])]),
        p("y", "2026-01-02", &[("a", APP, &[(1, 100)])]),
        p("z", "2026-01-03", &[("a", APP, &[(0, 100)])]),
    ]);
    let asked = |pods: &[(&str, &[&str])]| {
        let mut l = KubeletListing::default();
        for (name, holding) in pods {
            l.insert("default", name, holding.iter().map(|c| (*c).to_owned()));
        }
        Care { kubelet: KubeletSays::Listed(Arc::new(l)), ..Care::PATIENT }
    };
    // Not asked: only look-alikes on other GPUs are ambiguous, and the oldest of the same
    // placement is taken.
    let unasked = scope.choose(
        &pods[..1].iter().chain(&pods[2..]).cloned().collect::<Vec<_>>(),
        &held(&[]),
        &none,
        100,
        &Care::PATIENT,
    );
    assert_eq!(outcome(&unasked), "x/a");
    assert_eq!(
        outcome(&scope.choose(&pods, &held(&[]), &none, 100, &Care::PATIENT)),
        "ambiguous default/pod-x default/pod-y"
    );
    // Askable: any two are, so that the caller asks.
    let askable = Care { kubelet: KubeletSays::Askable, ..Care::PATIENT };
    let same = [Arc::clone(&pods[0]), Arc::clone(&pods[2])];
    assert_eq!(
        outcome(&scope.choose(&same, &held(&[]), &none, 100, &askable)),
        "ambiguous default/pod-x default/pod-z"
    );
    // Of several, the first and the next in the kubelet's order are named, whatever the
    // order the store gives them in.
    let reversed: Vec<_> = pods.iter().rev().cloned().collect();
    assert_eq!(
        outcome(&scope.choose(&reversed, &held(&[]), &none, 100, &askable)),
        "ambiguous default/pod-x default/pod-y"
    );
    // Asked: the pod it lists without devices is the one, whatever the order says.
    assert_eq!(outcome(&scope.choose(&pods, &held(&[]), &none, 100, &asked(&[("pod-y", &[])]))), "y/a");
    assert_eq!(outcome(&scope.choose(&pods, &held(&[]), &none, 100, &asked(&[("pod-z", &[])]))), "z/a");
    // A listed pod whose container already holds devices is not being admitted.
    let got = scope.choose(&pods, &held(&[]), &none, 100, &asked(&[("pod-x", &["a"]), ("pod-z", &[])]));
    assert_eq!(outcome(&got), "z/a");
    // Two listed without devices (a kubelet before 1.34 lists the pods it rejected too): still
    // ambiguous, whatever their placement.
    let got = scope.choose(&pods, &held(&[]), &none, 100, &asked(&[("pod-x", &[]), ("pod-z", &[])]));
    assert_eq!(outcome(&got), "ambiguous default/pod-x default/pod-z");
    // None listed: the kubelet admits no pod this daemon knows to wait for that many.
    assert!(
        outcome(&scope.choose(&pods, &held(&[]), &none, 100, &asked(&[("other", &[])]))).starts_with("no candidate")
    );
}

#[test]
fn no_candidate_says_what_waits_and_what_cannot_be_served() {
    let names = ResourceNames::gpushare();
    let scope = Scope { node: "node-a", names: &names, unit: MemoryUnit::Mib };
    let pods = stored(&[
        p("x", "2026-01-01", &[("a", APP, &[(0, 100)])]),
        P { node: "node-b", ..p("y", "2026-01-01", &[("a", APP, &[(0, 100)])]) },
    ]);
    let e = scope.choose(&pods, &held(&[]), &Admissions::default(), 300, &Care::PATIENT).unwrap_err().to_string();
    assert!(e.contains("default/pod-x container \"a\" waits for 100 MiB"), "{e}");
    assert!(e.contains("default/pod-y is assigned to node node-b"), "{e}");
}

#[test]
fn a_proposal_ties_allocate_to_its_container_while_it_still_waits() {
    let names = ResourceNames::gpushare();
    let scope = Scope { node: "node-a", names: &names, unit: MemoryUnit::Mib };
    let pods = stored(&[p("x", "2026-01-01", &[("init", INIT, &[(0, 100)]), ("a", APP, &[(0, 100)])])]);
    let owner = |c: &str| Owner { uid: "x".into(), container: c.into() };
    let pod = Arc::clone(&pods[0]);
    assert_eq!(scope.candidate_for(Arc::clone(&pod), &owner("init"), &held(&[])).map(|c| c.position), Some(0));
    // The proposal was for the init container, which is held now: the app container is next,
    // and the proposal no longer names a waiting container.
    assert!(scope.candidate_for(Arc::clone(&pod), &owner("init"), &held(&[("x", "init")])).is_none());
    assert!(scope.candidate_for(pod, &owner("a"), &held(&[])).is_none());
}
