//! The fault suite: pods churn over tens of nodes while `gpushared` and the extender are
//! killed with `SIGKILL`, kubelets restart, the API server goes away during admission and GPUs go
//! unhealthy and recover, all at random moments. After every fault the always-invariants are
//! checked; at the end, once the box is quiet, the settled ones too (no lost or duplicated
//! allocation), against the kubelets' record of every running pod. Every kind of fault happens
//! at least once (the churn goes on until it has), each is seen to take effect (restarted
//! processes, the stand-ins' logs, the GPU published unhealthy), and every faulted GPU is
//! published healthy again. The output reports the counts and the time taken.
//!
//! Bounded: `GPUSHARE_FAULT_PODS` pods (default 2000) over `GPUSHARE_FAULT_NODES` nodes
//! (default 20), within `GPUSHARE_FAULT_DEADLINE_SECS` (default 600) from start to end, after
//! which it fails with the counts so far; `GPUSHARE_FAULT_SEED` repeats a run;
//! `GPUSHARE_BOX_DIR` keeps its state. The daemons' API connections lag behind the kubelets' by
//! `GPUSHARE_FAULT_LAG_MS` (default 300; 0 for none): every answer and watch event reaches them
//! that much later, so a kubelet admits pods a daemon's watch has not delivered yet.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeSet, VecDeque};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use gpushare_testkit::cluster::{Cluster, Options, pod_key, uniform_cluster};
use gpushare_testkit::rng::XorShift;
use serde_json::json;

/// The longest this test waits for one API call (kube's client retries 503s during an outage).
const CALL: Duration = Duration::from_secs(3);
/// The longest a faulted GPU may take to be published healthy again once the faults stop
/// (`recovery_seconds = 2`, probed every second, published within one more).
const RECOVERY: Duration = Duration::from_secs(30);

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[derive(Default, Debug, Clone)]
struct Counts {
    created: u64,
    deleted: u64,
    daemon_kills: u64,
    extender_kills: u64,
    kubelet_restarts: u64,
    api_outages: u64,
    gpu_faults: u64,
    checks: u64,
}

impl Counts {
    /// The fault kinds that have not happened yet.
    fn missing_kinds(&self) -> Vec<&'static str> {
        [
            ("gpushared SIGKILL", self.daemon_kills),
            ("extender SIGKILL", self.extender_kills),
            ("kubelet restart", self.kubelet_restarts),
            ("API-server outage", self.api_outages),
            ("GPU fault", self.gpu_faults),
        ]
        .into_iter()
        .filter(|(_, n)| *n == 0)
        .map(|(kind, _)| kind)
        .collect()
    }

    fn faults(&self) -> u64 {
        self.daemon_kills + self.extender_kills + self.kubelet_restarts + self.api_outages + self.gpu_faults
    }
}

/// Where the run is, for the deadline's failure message.
#[derive(Default, Debug, Clone)]
struct Progress {
    stage: &'static str,
    counts: Counts,
}

type Shared = Arc<Mutex<Progress>>;

fn publish(shared: &Shared, stage: &'static str, counts: &Counts) {
    *shared.lock().unwrap_or_else(PoisonError::into_inner) = Progress { stage, counts: counts.clone() };
}

/// What the box's processes logged about the pods named in `violations`, and every time a
/// daemon guessed or took back an allocation: printed with a failure, so that a run in CI (whose
/// box is gone with its machine) can still be read.
fn evidence(box_: &mut Cluster, violations: &[String]) -> String {
    const MAX_LINES: usize = 300;
    let pods: BTreeSet<String> = violations
        .iter()
        .flat_map(|v| v.split(|c: char| c.is_whitespace() || c == ':' || c == ','))
        .filter(|w| w.starts_with("churn/p"))
        .map(|w| w.trim_start_matches("churn/").to_owned())
        .collect();
    let telling = ["ambiguous", "serving the oldest", "doubtful", "offers these devices as free"];
    let mut out = String::from("what the processes logged about it:\n");
    let mut lines = 0;
    for p in box_.processes_mut() {
        for line in p.log().lines() {
            if (pods.iter().any(|pod| line.contains(pod.as_str())) || telling.iter().any(|t| line.contains(t)))
                && lines < MAX_LINES
            {
                let _ = writeln!(out, "  [{}] {line}", p.name);
                lines += 1;
            }
        }
    }
    if lines >= MAX_LINES {
        out.push_str("  (more left out)\n");
    }
    out
}

/// How many lines of `log` contain `needle`.
fn occurrences(log: &str, needle: &str) -> usize {
    log.lines().filter(|l| l.contains(needle)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churn_under_faults_keeps_every_invariant() {
    let deadline = Duration::from_secs(env("GPUSHARE_FAULT_DEADLINE_SECS", 600));
    let started = Instant::now();
    let shared = Shared::default();
    // Dropping the run at the deadline drops the box, which kills its processes.
    if tokio::time::timeout(deadline, churn_under_faults(started, Arc::clone(&shared))).await.is_err() {
        let progress = shared.lock().unwrap_or_else(PoisonError::into_inner).clone();
        panic!(
            "fault suite: over its deadline of {} s (GPUSHARE_FAULT_DEADLINE_SECS) after {:.1} s, while {}; so far: {:?}",
            deadline.as_secs(),
            started.elapsed().as_secs_f64(),
            progress.stage,
            progress.counts
        );
    }
}

async fn churn_under_faults(started: Instant, shared: Shared) {
    let total = env("GPUSHARE_FAULT_PODS", 2000);
    let n_nodes = usize::try_from(env("GPUSHARE_FAULT_NODES", 20)).unwrap();
    // A new seed each run unless one is given; printed, so any run can be repeated.
    let seed = env("GPUSHARE_FAULT_SEED", XorShift::from_clock().below(u64::MAX));
    let mut rng = XorShift::new(seed);
    let lag_ms = env("GPUSHARE_FAULT_LAG_MS", 300);
    eprintln!(
        "fault suite: {total} pods over {n_nodes} nodes, the daemons' API answers {lag_ms} ms late, seed \
         GPUSHARE_FAULT_SEED={seed}"
    );

    // GiB units keep 20 nodes' device lists small on a 2-core machine; recovery after 2 s.
    let spec = uniform_cluster(n_nodes, 2, 16_384, gpushare_core::MemoryUnit::Gib);
    let options = Options {
        // GPUSHARE_BOX_DIR keeps the logs, ledgers and records of a run to study.
        dir: gpushare_testkit::box_dir(),
        dbus: false,
        scheduler_backoff_ms: 200,
        daemon_api_lag: (lag_ms > 0).then(|| Duration::from_millis(lag_ms)),
        daemon_extra: "[health]\nprobe_interval_seconds = 1\nrecovery_seconds = 2\n[reconcile]\ninterval_seconds = 5\ngrace_seconds = 5\n"
            .into(),
        ..Options::default()
    };
    let mut counts = Counts::default();
    publish(&shared, "bringing the box up", &counts);
    let mut box_ = Cluster::up(&spec, &options).await.unwrap();
    eprintln!("box up in {:.1} s", started.elapsed().as_secs_f64());

    let mut live: VecDeque<String> = VecDeque::new();
    let target_live = (n_nodes * 6) as u64; // about 60% of the box's memory at 4.5 GiB per pod
    let mut next_fault = Instant::now() + Duration::from_millis(500);
    let mut outage_until: Option<Instant> = None;
    let mut restarts: Vec<(Instant, usize)> = Vec::new(); // (when, node) daemons to bring back
    let mut extender_back: Option<Instant> = None;
    let mut faulted: BTreeSet<(usize, usize)> = BTreeSet::new(); // (node, GPU) given an Xid
    let churn_started = Instant::now();
    // The churn goes on until every pod is created and every kind of fault has happened.
    while counts.created < total || !counts.missing_kinds().is_empty() {
        publish(&shared, "churning", &counts);
        // Create a few pods, delete the oldest beyond the target.
        for _ in 0..5 {
            if counts.created >= total {
                break;
            }
            let name = format!("p{:05}", counts.created);
            let gib = 1 + rng.below(8);
            let count = if rng.below(10) == 0 { 2 } else { 1 };
            let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "churn"},
                "spec": {"containers": [{"name": "main", "image": "x", "resources": {"limits": {
                    "gpushare.io/gpu-mem": (gib * count).to_string(), "gpushare.io/gpu-count": count.to_string()}}}]}});
            if tokio::time::timeout(CALL, box_.apply(&[pod])).await.is_ok_and(|r| r.is_ok()) {
                counts.created += 1;
                live.push_back(name);
            } else {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        while live.len() as u64 > target_live {
            let name = live.front().unwrap().clone();
            if tokio::time::timeout(CALL, box_.delete_pod("churn", &name)).await.is_ok_and(|r| r.is_ok()) {
                live.pop_front();
                counts.deleted += 1;
            } else {
                break;
            }
        }
        // Faults.
        let now = Instant::now();
        if outage_until.is_some_and(|t| now > t) {
            outage_until = None;
        }
        for (_, node) in restarts.iter().filter(|(t, _)| now > *t) {
            box_.nodes[*node].daemon.kill_and_restart().unwrap();
        }
        restarts.retain(|(t, _)| now <= *t);
        if extender_back.is_some_and(|t| now > t) {
            box_.extender.kill_and_restart().unwrap();
            extender_back = None;
        }
        if now > next_fault {
            next_fault = now + Duration::from_millis(300 + rng.below(700));
            let node = usize::try_from(rng.below(n_nodes as u64)).unwrap();
            match rng.below(5) {
                0 if !restarts.iter().any(|(_, n)| *n == node) => {
                    box_.nodes[node].daemon.kill();
                    restarts.push((now + Duration::from_millis(200 + rng.below(800)), node));
                    counts.daemon_kills += 1;
                }
                1 if extender_back.is_none() => {
                    box_.extender.kill();
                    extender_back = Some(now + Duration::from_millis(200 + rng.below(800)));
                    counts.extender_kills += 1;
                }
                2 if box_.nodes[node].kubelet.signal("HUP").is_ok() => counts.kubelet_restarts += 1,
                3 if outage_until.is_none() => {
                    // The outage ends on its own clock: clients (this test's too) may block
                    // while it lasts, as kube's client retries 503s.
                    let length = Duration::from_millis(500 + rng.below(1000));
                    box_.apiserver.signal("USR1").unwrap();
                    let pid = box_.apiserver.pid().unwrap();
                    tokio::spawn(async move {
                        tokio::time::sleep(length).await;
                        let _ = std::process::Command::new("kill").arg("-USR2").arg(pid.to_string()).status();
                    });
                    outage_until = Some(now + length + Duration::from_millis(100));
                    counts.api_outages += 1;
                }
                4 => {
                    let gpu = usize::try_from(rng.below(2)).unwrap();
                    box_.nodes[node].inject(&format!("xid {gpu} 79")).unwrap();
                    faulted.insert((node, gpu));
                    counts.gpu_faults += 1;
                }
                _ => {}
            }
            if outage_until.is_none()
                && let Ok(Ok(report)) = tokio::time::timeout(CALL, box_.check()).await
            {
                counts.checks += 1;
                assert!(
                    report.violations.is_empty(),
                    "after {counts:?} (seed {seed}):\n{}\n{}",
                    report.describe(),
                    evidence(&mut box_, &report.violations)
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Every fault healed: the API server serves, every daemon and the extender run.
    publish(&shared, "healing the faults", &counts);
    if let Some(t) = outage_until {
        tokio::time::sleep(t.saturating_duration_since(Instant::now())).await;
    }
    for (_, node) in std::mem::take(&mut restarts) {
        box_.nodes[node].daemon.kill_and_restart().unwrap();
    }
    if extender_back.is_some() {
        box_.extender.kill_and_restart().unwrap();
    }
    let churn = churn_started.elapsed();
    assert!(counts.missing_kinds().is_empty(), "faults never injected: {:?} ({counts:?})", counts.missing_kinds());

    // Each kind of fault took effect. Killed processes were started again, once per kill.
    let daemon_starts: usize = box_.nodes.iter().map(|n| n.daemon.starts).sum();
    assert_eq!(daemon_starts as u64 - n_nodes as u64, counts.daemon_kills, "gpushared restarts after SIGKILL");
    assert_eq!(box_.extender.starts as u64 - 1, counts.extender_kills, "extender restarts after SIGKILL");
    // The stand-ins logged the restarts and outages they were signalled (signals sent close
    // together may arrive as one).
    let kubelet_logs: String = box_.nodes.iter().map(|n| n.kubelet.log()).collect();
    let restarted = occurrences(&kubelet_logs, "SIGHUP: restarting the kubelet") as u64;
    assert!(
        (1..=counts.kubelet_restarts).contains(&restarted),
        "kubelets logged {restarted} restarts of {} signalled",
        counts.kubelet_restarts
    );
    let api_log = box_.apiserver.log();
    let (outages, ended) = (occurrences(&api_log, "SIGUSR1: outage"), occurrences(&api_log, "SIGUSR2: serving again"));
    assert!(
        (1..=counts.api_outages).contains(&(outages as u64)) && ended >= 1,
        "the API server logged {outages} outages ({ended} ended) of {} begun",
        counts.api_outages
    );
    // No process died of its faults: the kubelets restarted in place.
    for p in box_.processes_mut() {
        if let Some(status) = p.exited() {
            panic!("{} exited ({status}) during the faults:\n{}", p.name, p.log());
        }
    }
    box_.wait_ready(Duration::from_secs(60)).await.unwrap();

    // Every GPU given an Xid during the churn is published healthy again.
    publish(&shared, "waiting for the faulted GPUs to recover", &counts);
    let recovering = Instant::now();
    for (node, gpu) in &faulted {
        let name = box_.nodes[*node].spec.name.clone();
        box_.wait_gpu_health(&name, *gpu, true, RECOVERY).await.unwrap_or_else(|e| panic!("{e:#} ({counts:?})"));
    }
    let recovered = recovering.elapsed();
    // And a fault on a quiet box is seen, then recovers: the daemon publishes the GPU
    // unhealthy, then healthy again.
    publish(&shared, "faulting a GPU on the quiet box", &counts);
    let probe = box_.nodes[0].spec.name.clone();
    let faulted_at = Instant::now();
    box_.nodes[0].inject("xid 1 79").unwrap();
    box_.wait_gpu_health(&probe, 1, false, RECOVERY).await.unwrap_or_else(|e| panic!("the Xid is not seen: {e:#}"));
    let seen = faulted_at.elapsed();
    box_.wait_gpu_health(&probe, 1, true, RECOVERY).await.unwrap_or_else(|e| panic!("no recovery: {e:#}"));
    let back = faulted_at.elapsed();

    publish(&shared, "settling", &counts);
    let pods = box_.settle(Duration::from_secs(120)).await.unwrap();
    let report = box_.check_settled(Duration::from_secs(30)).await.unwrap();
    // Counted on the report's own read: a pod that was waiting for room at `settle` may have
    // been placed and admitted since.
    let running = report.running;
    let (failed, waiting) = (report.failed, report.unplaced);
    eprintln!(
        "fault suite: {} pods created, {} deleted in {:.1} s of churn; faults injected: {} gpushared SIGKILLs, {} extender \
         SIGKILLs, {} kubelet restarts ({restarted} logged), {} API-server outages ({outages} logged), {} GPU Xid 79s on {} \
         GPUs ({} in all); faulted GPUs healthy again {:.1} s after the churn; a quiet-box Xid seen in {:.1} s, healthy in \
         {:.1} s; {} invariant checks; at the end {} live pods: {running} running, {failed} failed admission, {waiting} \
         waiting; {} pods admitted, {} containers checked; violations = {}; {:.1} s in all (deadline {} s)",
        counts.created,
        counts.deleted,
        churn.as_secs_f64(),
        counts.daemon_kills,
        counts.extender_kills,
        counts.kubelet_restarts,
        counts.api_outages,
        counts.gpu_faults,
        faulted.len(),
        counts.faults(),
        recovered.as_secs_f64(),
        seen.as_secs_f64(),
        back.as_secs_f64(),
        counts.checks + 1,
        pods.len(),
        report.admitted,
        report.containers_checked,
        report.violations.len() + report.settled_violations.len(),
        started.elapsed().as_secs_f64(),
        env("GPUSHARE_FAULT_DEADLINE_SECS", 600),
    );
    let all: Vec<String> = report.violations.iter().chain(&report.settled_violations).cloned().collect();
    assert!(
        report.is_clean(),
        "invariants violated at the end (seed {seed}):\n{}\n{}",
        report.describe(),
        evidence(&mut box_, &all)
    );
    assert!(running > 0, "nothing runs: {:?}", pods.iter().map(pod_key).collect::<Vec<_>>());
    // Every running pod was checked against its kubelet's record: one GPU container each.
    assert_eq!(report.admitted, running, "running pods the kubelets recorded as admitted");
    assert_eq!(report.containers_checked, running, "containers whose environment was compared with their assignment");
}
