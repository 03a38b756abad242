//! gpushare side by side with NVIDIA's device plugin (v0.19, time-slicing, built from Go
//! modules by `tests/peers/build` and run unmodified on the fake NVML library) and, where
//! `GPUSHARE_PEERS_SRC` gives their source, Alibaba's gpushare and HAMi (built by the same
//! script, also unmodified), each as a node of the real-cluster box under the real kube-scheduler and kubelet: the same scenarios, the pods
//! written the way each system's users write them, judged by one set of rules on what each
//! container's process saw (gpushare and NVIDIA's plugin run on containerd and runc; the peers
//! built from source on the recording runtime, judged on what it was asked to run). Each scenario keeps its evidence in
//! `target/tmp/side-by-side/<scenario>.json` and checks that docs/comparison.md's row says what
//! was seen: gpushare's cells as much as the peer's, so a regression in either is a failure
//! here, and a row where a system fails says how.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpushare_core::codec::assignment::{ASSIGNMENT_KEY, Assignment};
use gpushare_testkit::nvml::{self, FakeGpu};
use gpushare_testkit::peers::{ALIYUN_GPU_MEM, NVIDIA_GPU};
use serde_json::{Value, json};

mod realbox;
mod sides;
use realbox::{RealBox, get};
use sides::{Ctr, NODE, Seen, System, Verdict, evidence, load, observe, record, run, settle};

const A100: u64 = 40960;

fn a100s(n: u32) -> Vec<FakeGpu> {
    (0..n).map(|i| FakeGpu::new(NODE, i, A100, "NVIDIA A100-SXM4-40GB")).collect()
}

fn pods(names: &str, count: usize, containers: &[Ctr]) -> Vec<(String, Vec<Ctr>)> {
    (0..count).map(|i| (format!("{names}-{i}"), containers.to_vec())).collect()
}

/// The rules every scenario applies: every container started sees GPUs of its node; no GPU
/// holds more than it has of what its running containers need; each pod that does not run says why; with gpushare, each container runs
/// on the GPUs of its pod's assignment and is told its budget.
fn judge(b: &RealBox, system: System, gpus: &[FakeGpu], pods: &[(String, Vec<Ctr>)], seen: &[Seen]) -> Verdict {
    for s in seen {
        for c in &s.containers {
            if let Some(bad) = c.gpus.iter().find(|g| !gpus.iter().any(|known| &known.uuid == *g)) {
                return Verdict::Fail(format!(
                    "{}/{} is started with NVIDIA_VISIBLE_DEVICES={bad}, no GPU of the node: a real NVIDIA \
                     runtime refuses to start it",
                    s.pod, c.name
                ));
            }
        }
    }
    for (gpu, mib) in load(seen, pods) {
        let total = gpus.iter().find(|g| g.uuid == gpu).map_or(0, |g| g.memory_mib);
        if mib > total {
            let on = seen.iter().filter(|s| s.containers.iter().any(|c| c.running && c.gpus.contains(&gpu))).count();
            return Verdict::Fail(format!("{on} running pod(s) on {gpu} need {mib} MiB of its {total}"));
        }
    }
    for (s, (_, ctrs)) in seen.iter().zip(pods) {
        let apps = ctrs.iter().filter(|c| !c.init).count();
        if !s.runs(apps) && s.waiting.is_empty() {
            if !s.refused.is_empty() {
                return Verdict::Fail(format!("{} was refused by the kubelet: {}", s.pod, s.refused));
            }
            return Verdict::Fail(format!("{} is {:?} and does not say why", s.pod, s.phase));
        }
        if system == System::Alibaba
            && s.runs(apps)
            && let Some(wrong) = alibaba_mismatch(b, s, ctrs)
        {
            return Verdict::Fail(wrong);
        }
        if system == System::Hami
            && s.runs(apps)
            && let Some(wrong) = hami_mismatch(b, s, ctrs)
        {
            return Verdict::Fail(wrong);
        }
        if system == System::Gpushare && s.runs(apps) {
            let assigned = assignment(b, &s.pod);
            for c in s.containers.iter().filter(|c| c.running) {
                let want = ctrs.iter().find(|w| w.name == c.name).unwrap();
                if assigned.get(&c.name) != Some(&c.gpus) || c.budget_mib != Some(want.mib) {
                    return Verdict::Fail(format!(
                        "{}/{} sees {:?} with budget {:?}; its assignment says {:?}, {} MiB",
                        s.pod,
                        c.name,
                        c.gpus,
                        c.budget_mib,
                        assigned.get(&c.name),
                        want.mib
                    ));
                }
            }
        }
    }
    Verdict::Pass
}

/// Where a running container of Alibaba's pod `s` is not on the one GPU its extender chose for
/// the pod (`ALIYUN_COM_GPU_MEM_IDX`), or not told its budget: what it saw instead.
fn alibaba_mismatch(b: &RealBox, s: &Seen, ctrs: &[Ctr]) -> Option<String> {
    let p = get(&b.plane, &["get", "pod", &s.pod, "-n", "default"]);
    let index = p["metadata"]["annotations"]["ALIYUN_COM_GPU_MEM_IDX"].as_str().and_then(|i| i.parse::<u32>().ok());
    let chosen = index.map(|i| FakeGpu::new(NODE, i, 0, "").uuid);
    s.containers.iter().filter(|c| c.running).find_map(|c| {
        let want = ctrs.iter().find(|w| w.name == c.name)?;
        let on_chosen = chosen.as_ref().is_some_and(|g| c.gpus == [g.clone()]);
        (!on_chosen || c.budget_mib != Some(want.mib * u64::from(want.gpus))).then(|| {
            format!(
                "{}/{} sees {:?} with budget {:?}; its extender chose GPU {index:?} for the pod, {} MiB",
                s.pod,
                c.name,
                c.gpus,
                c.budget_mib,
                want.mib * u64::from(want.gpus)
            )
        })
    })
}

/// Where a running container of HAMi's pod `s` is not on the GPUs its scheduler allocated it
/// (`hami.io/vgpu-devices-allocated`: per container, `;`-separated, each GPU as
/// `UUID,type,MiB,cores:`), or not told its memory on each (HAMi-core's
/// `CUDA_DEVICE_MEMORY_LIMIT_0`): what it saw instead.
fn hami_mismatch(b: &RealBox, s: &Seen, ctrs: &[Ctr]) -> Option<String> {
    let p = get(&b.plane, &["get", "pod", &s.pod, "-n", "default"]);
    let text = p["metadata"]["annotations"]["hami.io/vgpu-devices-allocated"].as_str().unwrap_or("");
    let per_container: Vec<Vec<String>> = text
        .split(';')
        .map(|c| {
            c.split(':').filter_map(|d| d.split(',').next()).filter(|u| !u.is_empty()).map(str::to_owned).collect()
        })
        .collect();
    let apps: Vec<&Ctr> = ctrs.iter().filter(|c| !c.init).collect();
    s.containers.iter().filter(|c| c.running).find_map(|c| {
        let i = apps.iter().position(|w| w.name == c.name)?;
        let mut allocated = per_container.get(i).cloned().unwrap_or_default();
        let mut seen = c.gpus.clone();
        allocated.sort();
        seen.sort();
        (allocated != seen || c.budget_mib != Some(apps[i].mib)).then(|| {
            format!(
                "{}/{} sees {:?} with budget {:?}; its scheduler allocated it {allocated:?}, {} MiB each ({text:?})",
                s.pod, c.name, c.gpus, c.budget_mib, apps[i].mib
            )
        })
    })
}

/// The GPUs (UUIDs) each container of pod `name` is assigned, from the extender's annotation.
fn assignment(b: &RealBox, name: &str) -> BTreeMap<String, Vec<String>> {
    let p = get(&b.plane, &["get", "pod", name, "-n", "default"]);
    let Some(text) = p["metadata"]["annotations"][ASSIGNMENT_KEY].as_str() else { return BTreeMap::new() };
    let a = Assignment::decode(text).unwrap();
    a.containers.iter().map(|c| (c.name.clone(), c.gpus.iter().map(|g| g.uuid.as_str().to_owned()).collect())).collect()
}

/// `first` unless it passed, then `then()`.
fn and_then(first: Verdict, then: impl FnOnce() -> Verdict) -> Verdict {
    if first == Verdict::Pass { then() } else { first }
}

/// Runs `scenario` for each system and records it.
async fn scenario(name: &str, each: impl AsyncFn(System) -> Option<(Verdict, Value)>) {
    let mut outcomes = Vec::new();
    for system in System::runnable() {
        let Some((verdict, evidence)) = each(system).await else { return };
        outcomes.push((system, verdict, evidence));
    }
    record(name, &outcomes);
}

/// A pod of 3500 MiB: does its container see one GPU and know its budget?
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_pod() {
    scenario("one-pod", async |system| {
        let gpus = a100s(2);
        let b = system.up(&gpus, "").await?;
        let want = pods("one", 1, &[Ctr::main(3500)]);
        let seen = run(&b, system, &want, 1);
        let verdict = and_then(judge(&b, system, &gpus, &want, &seen), || {
            let c = seen[0].containers.first();
            match c {
                Some(c) if seen[0].runs(1) && c.gpus.len() == 1 && c.budget_mib == Some(3500) => Verdict::Pass,
                Some(c) if seen[0].runs(1) && c.budget_mib.is_none() => Verdict::NotExpressible(format!(
                    "no memory request; the pod asks for a replica and runs on {:?} with no budget",
                    c.gpus
                )),
                _ => Verdict::Fail(format!("{seen:?}")),
            }
        });
        Some((verdict.clone(), evidence(system, &verdict, &seen, &Value::Null)))
    })
    .await;
}

/// Eight pods of 12000 MiB created at once on two 40 GB GPUs (three fit on each): does each
/// container get the GPU it was assigned, and does any GPU end up holding more than it has?
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_size_pods_racing() {
    scenario("race", async |system| {
        let gpus = a100s(2);
        let b = system.up(&gpus, "").await?;
        let want = pods("race", 8, &[Ctr::main(12000)]);
        // Three of 12000 MiB fit a 40960 MiB GPU: six is what a system that counts memory runs.
        let seen = run(&b, system, &want, 6);
        let verdict = and_then(judge(&b, system, &gpus, &want, &seen), || {
            let running = seen.iter().filter(|s| s.runs(1)).count();
            if running == 6 { Verdict::Pass } else { Verdict::Fail(format!("{running} of 8 run")) }
        });
        let per_gpu = load(&seen, &want);
        let mut more = json!({"mib_needed_per_gpu": per_gpu});
        if system == System::Alibaba {
            // Ours must show the node Alibaba's plugin serves as Alibaba's own inspect does.
            let (theirs, ours) = gpushare_testkit::peers::inspect_both(&b.plane.admin);
            assert_eq!(
                gpushare_testkit::peers::inspect_rows(&ours),
                gpushare_testkit::peers::inspect_rows(&theirs),
                "kubectl-inspect-gpushare --alibaba disagrees with Alibaba's:\n{ours}\n{theirs}"
            );
            more["inspect"] = json!({"alibaba": theirs, "ours": ours});
        }
        Some((verdict.clone(), evidence(system, &verdict, &seen, &more)))
    })
    .await;
}

/// A pod of two containers (2000 and 3000 MiB): does each run, on one GPU, with its own budget?
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_container_pod() {
    scenario("multi-container", async |system| {
        let gpus = a100s(2);
        let b = system.up(&gpus, "").await?;
        let ctrs = [Ctr { name: "model", ..Ctr::main(2000) }, Ctr { name: "sidecar", ..Ctr::main(3000) }];
        let want = pods("multi", 2, &ctrs);
        let seen = run(&b, system, &want, 2);
        let verdict = and_then(judge(&b, system, &gpus, &want, &seen), || {
            let ok = seen.iter().all(|s| s.runs(2) && s.containers.iter().all(|c| c.gpus.len() == 1));
            if ok { Verdict::Pass } else { Verdict::Fail(format!("{seen:?}")) }
        });
        Some((verdict.clone(), evidence(system, &verdict, &seen, &Value::Null)))
    })
    .await;
}

/// A pod whose init container (1000 MiB) runs before its app container (4000 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_containers() {
    scenario("init-containers", async |system| {
        let gpus = a100s(2);
        let b = system.up(&gpus, "").await?;
        let ctrs = [Ctr { name: "fetch", init: true, ..Ctr::main(1000) }, Ctr::main(4000)];
        let want = pods("init", 1, &ctrs);
        let node = b.node(NODE).unwrap();
        // On containerd the init container's `true` exits by itself.
        if let Some(r) = node.runtime.recording() {
            r.finish_at_start("default", "init-0", "fetch");
        }
        let seen = run(&b, system, &want, 1);
        let verdict = and_then(judge(&b, system, &gpus, &want, &seen), || {
            let init = seen[0].containers.iter().find(|c| c.name == "fetch");
            match init {
                Some(i) if seen[0].runs(1) && !i.running && i.gpus.len() == 1 => Verdict::Pass,
                _ => Verdict::Fail(format!("{seen:?}")),
            }
        });
        Some((verdict.clone(), evidence(system, &verdict, &seen, &Value::Null)))
    })
    .await;
}

/// One container on 2 GPUs, 8000 MiB on each: does it see two different GPUs?
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpus_times_mib_in_one_container() {
    scenario("multi-gpu", async |system| {
        let gpus = a100s(2);
        let b = system.up(&gpus, "").await?;
        let want = pods("pair", 1, &[Ctr { gpus: 2, ..Ctr::main(8000) }]);
        let seen = run(&b, system, &want, 1);
        let verdict = and_then(judge(&b, system, &gpus, &want, &seen), || {
            let c = seen[0].containers.first();
            match c {
                Some(c) if seen[0].runs(1) && c.gpus.len() == 2 && c.gpus[0] != c.gpus[1] => Verdict::Pass,
                Some(c) if seen[0].runs(1) => Verdict::Fail(format!(
                    "runs on {:?} with a budget of {} MiB, where the user asked for 8000 MiB on each of 2 GPUs",
                    c.gpus,
                    c.budget_mib.map_or_else(|| "no".to_owned(), |m| m.to_string())
                )),
                _ => Verdict::Fail(format!("{seen:?}")),
            }
        });
        Some((verdict.clone(), evidence(system, &verdict, &seen, &Value::Null)))
    })
    .await;
}

/// A node of 8 × 80 GB counted in MiB (655,360 devices of 1 MiB): does it serve a pod of
/// 70000 MiB, and if not, does it say so?
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_80gb_gpus_in_mib() {
    scenario("8x80GB-MiB", async |system| {
        let gpus: Vec<FakeGpu> = (0..8).map(|i| FakeGpu::new(NODE, i, 81920, "NVIDIA H100 80GB HBM3")).collect();
        let mut b = system.up_unwaited(&gpus, "[resources]\nunit = \"MiB\"\n").await?;
        if system == System::Gpushare {
            // Over the kubelet's 4 MiB message limit: gpushared refuses to start, naming the fix.
            let deadline = Instant::now() + Duration::from_secs(30);
            let node = b.nodes.iter_mut().find(|n| n.name == NODE).unwrap();
            while node.daemon.exited().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
            let said = node.daemon.log().lines().find(|l| l.contains("message limit")).unwrap_or_default().to_owned();
            let verdict = if node.daemon.exited().is_some() && said.contains("unit = \"GiB\"") {
                Verdict::Fail(
                    "gpushared refuses to start: the device list would be over the kubelet's message \
                               limit; it names the fix (unit = \"GiB\")"
                        .into(),
                )
            } else {
                Verdict::Pass
            };
            return Some((
                verdict.clone(),
                json!({"system": system.column(), "verdict": verdict.to_string(),
                                                 "gpushared_said": said}),
            ));
        }
        if system == System::Alibaba {
            return Some(alibaba_in_mib(&b, &gpus));
        }
        // NVIDIA's time-slicing: 4 replicas of each GPU; HAMi: 10 shares of each, memory apart.
        let slots = if system == System::Hami { 80 } else { 32 };
        b.wait_allocatable(NODE, NVIDIA_GPU, &slots.to_string(), Duration::from_secs(60)).unwrap();
        let want = pods("big", 1, &[Ctr::main(70000)]);
        let seen = run(&b, system, &want, 1);
        let verdict = and_then(judge(&b, system, &gpus, &want, &seen), || {
            if system == System::Hami {
                return if seen[0].runs(1) {
                    Verdict::Pass
                } else {
                    Verdict::Fail(format!("{} is {} ({})", seen[0].pod, seen[0].phase, seen[0].waiting))
                };
            }
            Verdict::NotExpressible(
                "no memory unit: the node offers 32 replicas of 8 GPUs, and a pod cannot ask for 70000 MiB".into(),
            )
        });
        Some((verdict.clone(), evidence(system, &verdict, &seen, &json!({"allocatable": slots}))))
    })
    .await;
}

/// `8x80GB-MiB` for Alibaba's plugin in MiB mode: does the node's capacity come to 655,360
/// (given a minute, the time gpushared's refusal gets), and does a pod of 70000 MiB then run on
/// one GPU with that budget?
fn alibaba_in_mib(b: &RealBox, gpus: &[FakeGpu]) -> (Verdict, Value) {
    let system = System::Alibaba;
    let listed = b.wait_allocatable(NODE, ALIYUN_GPU_MEM, "655360", Duration::from_secs(60));
    let allocatable = b.allocatable(NODE, ALIYUN_GPU_MEM).unwrap_or_default();
    if listed.is_err() {
        let kubelet = b.node(NODE).unwrap().kubelet.proc.log();
        let said = kubelet.lines().rfind(|l| l.contains("gpu-mem") || l.contains("message larger"));
        let verdict = Verdict::Fail(format!(
            "the node's {ALIYUN_GPU_MEM} is {allocatable:?} a minute after the plugin started, not 655360; \
             the plugin keeps running and nothing says why to the user"
        ));
        return (
            verdict.clone(),
            json!({"system": system.column(), "verdict": verdict.to_string(),
                                         "allocatable": allocatable, "kubelet_said": said}),
        );
    }
    let want = pods("big", 1, &[Ctr::main(70000)]);
    let seen = run(b, system, &want, 1);
    let verdict = and_then(judge(b, system, gpus, &want, &seen), || {
        if seen[0].runs(1) { Verdict::Pass } else { Verdict::Fail(format!("{seen:?}")) }
    });
    (verdict.clone(), evidence(system, &verdict, &seen, &json!({"allocatable": allocatable})))
}

/// A pod of 50000 MiB on a node of 40 GB GPUs: what does its user see?
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_fits_no_gpu() {
    scenario("no-fit", async |system| {
        let gpus = a100s(2);
        let b = system.up(&gpus, "").await?;
        let want = pods("huge", 1, &[Ctr::main(50000)]);
        let seen = run(&b, system, &want, 0);
        let verdict = and_then(judge(&b, system, &gpus, &want, &seen), || {
            let s = &seen[0];
            if s.runs(1) {
                Verdict::Fail(format!(
                    "admitted and running on {:?} (40960 MiB); the shortfall shows only inside the container",
                    s.containers[0].gpus
                ))
            } else if s.waiting.contains("50000") {
                Verdict::Pass
            } else {
                Verdict::Fail(format!("waits, saying {:?}", s.waiting))
            }
        });
        Some((verdict.clone(), evidence(system, &verdict, &seen, &Value::Null)))
    })
    .await;
}

/// An Xid 79 on the GPU a running pod uses: does the GPU leave the pool (every share of it),
/// and does it come back when the fault is over?
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_with_an_xid() {
    scenario("xid", async |system| {
        let gpus = a100s(2);
        let b = system.up(&gpus, "[health]\nprobe_interval_seconds = 1\nrecovery_seconds = 10\n").await?;
        let (resource, full, half) = match system {
            System::Gpushare => ("gpushare.io/gpu-mem", "81920", "40960"),
            System::Nvidia => (NVIDIA_GPU, "8", "4"),
            System::Alibaba => (ALIYUN_GPU_MEM, "81920", "40960"),
            System::Hami => (gpushare_testkit::peers::HAMI_GPU, "20", "10"),
        };
        let want = pods("xid", 1, &[Ctr::main(8000)]);
        let seen = run(&b, system, &want, 1);
        let sick = seen[0].containers.first().map(|c| c.gpus[0].clone()).unwrap_or_default();
        let index = gpus.iter().position(|g| g.uuid == sick).unwrap();
        nvml::inject(&b.node(NODE).unwrap().events, &format!("xid {index} 79")).unwrap();
        let out = b.wait_allocatable(NODE, resource, half, Duration::from_secs(30));
        let after_fault = b.allocatable(NODE, resource).unwrap();
        let back = out.is_ok() && b.wait_allocatable(NODE, resource, full, Duration::from_secs(45)).is_ok();
        let after_recovery = b.allocatable(NODE, resource).unwrap();
        let seen = observe(&b, &want);
        let verdict = and_then(judge(&b, system, &gpus, &want, &seen), || match (out.is_ok(), back) {
            (true, true) => Verdict::Pass,
            (true, false) => Verdict::Fail(format!("left the pool; not back 45 s later ({after_recovery})")),
            (false, _) => Verdict::Fail(format!(
                "{resource} went from {full} to {after_fault}, not {half}: part of the failed GPU stays schedulable; \
                 {after_recovery} 45 s later"
            )),
        });
        let more = json!({"gpu": sick, "allocatable": {"before": full, "after_fault": after_fault,
                          "after_recovery": after_recovery}});
        Some((verdict.clone(), evidence(system, &verdict, &seen, &more)))
    })
    .await;
}

/// Twelve pods of 6000 MiB: six run, six more are created and the kubelet is killed and
/// restarted at once. Does every running container keep its GPUs, and does the node end as it
/// should?
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_restart_under_load() {
    scenario("kubelet-restart", async |system| {
        let gpus = a100s(2);
        let mut b = system.up(&gpus, "").await?;
        let first = pods("early", 6, &[Ctr::main(6000)]);
        let before = run(&b, system, &first, 6);
        let later = pods("late", 6, &[Ctr::main(6000)]);
        for (name, c) in &later {
            b.plane.create(&system.pod(name, c)).unwrap();
        }
        let restart = restart_kubelet(&mut b);
        let all: Vec<(String, Vec<Ctr>)> = first.iter().chain(&later).cloned().collect();
        // gpushare and Alibaba fit all 12 (six of 6000 MiB per GPU); NVIDIA has 8 replicas.
        let seen = settle(&b, &all, if system == System::Nvidia { 8 } else { 12 });
        let verdict = and_then(judge(&b, system, &gpus, &all, &seen), || {
            if let Err(e) = restart {
                return Verdict::Fail(format!("the kubelet did not come back: {e}"));
            }
            for (was, now) in before.iter().zip(&seen) {
                let gpus =
                    |s: &Seen| s.containers.iter().filter(|c| c.running).map(|c| c.gpus.clone()).collect::<Vec<_>>();
                if !now.runs(1) || gpus(was) != gpus(now) {
                    return Verdict::Fail(format!(
                        "{} ran on {:?}, now {:?} ({})",
                        was.pod,
                        gpus(was),
                        gpus(now),
                        now.phase
                    ));
                }
            }
            Verdict::Pass
        });
        Some((verdict.clone(), evidence(system, &verdict, &seen, &Value::Null)))
    })
    .await;
}

fn restart_kubelet(b: &mut RealBox) -> anyhow::Result<()> {
    let i = b.nodes.iter().position(|n| n.name == NODE).unwrap();
    let (plane, nodes) = (&b.plane, &mut b.nodes);
    nodes[i].kubelet.restart(plane)
}

/// Ten pods of 6000 MiB with the extender killed a moment after they are created and started
/// again two seconds later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_extender_restarted_mid_burst() {
    scenario("extender-restart", async |system| {
        let gpus = a100s(2);
        let mut b = system.up(&gpus, "").await?;
        if system == System::Nvidia {
            let why = "no extender: the default kube-scheduler places replicas by count".to_owned();
            return Some((Verdict::NotExpressible(why.clone()), json!({"system": system.column(), "verdict": why})));
        }
        let want = pods("burst", 10, &[Ctr::main(6000)]);
        for (name, c) in &want {
            b.plane.create(&system.pod(name, c)).unwrap();
        }
        std::thread::sleep(Duration::from_millis(300));
        b.extender.kill();
        let killed_at = Instant::now();
        std::thread::sleep(Duration::from_secs(2));
        b.extender.start().unwrap();
        let seen = settle(&b, &want, 10);
        let verdict = and_then(judge(&b, system, &gpus, &want, &seen), || {
            let running = seen.iter().filter(|s| s.runs(1)).count();
            if running == 10 { Verdict::Pass } else { Verdict::Fail(format!("{running} of 10 run")) }
        });
        let more = json!({"settled_after_kill_s": killed_at.elapsed().as_secs_f64()});
        Some((verdict.clone(), evidence(system, &verdict, &seen, &more)))
    })
    .await;
}
