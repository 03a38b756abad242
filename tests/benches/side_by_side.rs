//! gpushare beside NVIDIA's device plugin, Alibaba's gpushare and HAMi, measured the same way on the
//! real-cluster box (the real kube-scheduler and kubelet): one node of 8 GPUs,
//! `GPUSHARE_BENCH_PODS` (default 500) pods created at once, each system in a box of its own,
//! `GPUSHARE_BENCH_ROUNDS` (default 2) rounds alternating the systems.
//!
//! ```text
//! cargo build --release --bins && cargo bench -p gpushare-testkit --bench side_by_side
//! ```
//!
//! gpushare in MiB mode: gpushared on 8 × 16 GiB (131,072 devices of 1 MiB), pods of 200 MiB
//! placed through gpushare-extender. gpushare in GiB mode: 8 × 80 GiB (640 devices of 1 GiB),
//! pods of 1 GiB; `gib-lean` the same with `[kubelet] environment = "lean"` (smaller `Allocate`
//! answers, which the kubelet rewrites into its checkpoint at each admission). gpushare through DRA: the same 8 × 80 GiB served as `[sharing] dra`, each pod
//! with a ResourceClaim of 1024 MiB of the shipped DeviceClass, allocated by kube-scheduler
//! itself (no extender call) and prepared by gpushared. NVIDIA: its device plugin v0.19.0 (`tests/peers/build`) with
//! time-slicing, enough replicas per GPU for every pod, pods of `nvidia.com/gpu: 1` placed by
//! kube-scheduler alone. Reported per system and round: pods per second from the one `kubectl
//! create` of all pods to the last container running (the recording runtime, polled every
//! 100 ms); the kubelet's own `Allocate` latency for the resource (its
//! `kubelet_device_plugin_alloc_duration_seconds` histogram, p50 and p99 interpolated within
//! its buckets: 5, 10, 25, 50, 100, 250 ms, ...); and the device plugin's resident memory
//! (`VmRSS`) once every pod runs; for gpushare's device plugin, how many containers were
//! answered for another pod (their `GPUSHARE_POD`). Then each figure of NVIDIA's as a ratio to gpushare's. And where
//! each round's time went, per pod, from the components' own metrics: kube-scheduler's attempts
//! and scheduling cycles, gpushare-extender's binds (and how many waited behind a look-alike),
//! the kubelet's admission of the pod's resources (its topology manager's admit, which runs the
//! device manager's `GetPreferredAllocation` and `Allocate`) and its `Allocate` calls alone, and
//! how long kube-scheduler's own API client held requests back. And the CPU time each component
//! used during the burst, per pod (its process and children, from `/proc`): on a box of few
//! cores they share them, so the CPU one spends is time the others wait. And the API server's
//! work per pod (its `/metrics` before and after: requests by verb and resource with the time
//! spent on them, watch events sent with their bytes), and the PodResources `List` calls the
//! kubelet served per pod.
//! Alibaba (where `GPUSHARE_PEERS_SRC` gives its source, `tests/peers/build`): its device plugin
//! in MiB mode on the same node as gpushare's MiB mode, pods of the same size placed through its
//! extender; its figures are given as ratios to gpushare's MiB mode. `GPUSHARE_BENCH_MIB_GPU`
//! (MiB per GPU, default 16384) and `GPUSHARE_BENCH_MIB_POD` (MiB per pod, default 200) set that
//! node and pod for both: Alibaba's plugin lists 8 × 16 GiB in one message over the kubelet's
//! 4 MiB limit (its capacity then reads 0), so it is measured on 8 × 8 GiB with pods of 100 MiB.
//! HAMi (its source given the same way): its scheduler and device plugin on the same node and
//! pods as gpushare's MiB mode (`nvidia.com/gpu: 1`, `nvidia.com/gpumem` of the pod's MiB), each
//! GPU shared by enough pods for every pod (its `deviceSplitCount`; the chart's 10 would hold
//! 80); its figures too are given as ratios to gpushare's MiB mode.
//! NVIDIA's DRA driver (its source given the same way): its GPU kubelet plugin with consumable
//! shares of memory on the same 8 × 80 GiB as gpushare's DRA row, each pod with a claim of
//! 1024 MiB of its `gpu.nvidia.com` class; its figures are given as ratios to gpushare's DRA row.
//! `GPUSHARE_BENCH_PIN=CONTROL/NODE` (CPU lists, e.g. `0/1`) runs each burst with the control
//! plane (etcd, kube-apiserver, kube-scheduler, the extender) on the CPUs `CONTROL` and the node
//! (the kubelet, the device plugin, the recording runtime in this process) on `NODE`: on one
//! machine, the split of a cluster whose control plane runs apart from its GPU nodes.
//! Needs root and Go, as the real-cluster tests do. `GPUSHARE_BOX_DIR` keeps each box's logs
//! and state, in `<dir>/<system>-<round>`. `GPUSHARE_BENCH_SYSTEMS` (e.g. `gib,dra`) runs only
//! the systems named (`mib`, `gib`, `gib-lean`, `dra`, `nvidia`, `alibaba`, `hami`, `nvidia-dra`,
//! `floor-mib`, `floor-gib`, `floor-dra`, `floor-gib-read`, `floor-counted`, `counted`,
//! `counted-gib`).
//! `floor-mib` is the kubelet's own limit at MiB mode's device count: a plugin of as many devices
//! (`example.com/mib`) that answers at once (`gpushare-box null-plugin`), pods of the same size
//! placed by kube-scheduler alone; gpushare's MiB mode is given as a ratio to it. `floor-gib` is
//! the kubelet's own limit for a plugin that must know the pod it serves, at GiB mode's device
//! count: a plugin of 640 devices (`example.com/gib`) whose every `GetPreferredAllocation` waits
//! for one PodResources `List` of the kubelet (`gpushare-box null-plugin --pod-resources`), the
//! only place the kubelet says which pod it admits, and answers at once otherwise; pods of one
//! device placed by kube-scheduler alone; gpushare's GiB mode is given as a ratio to it.
//! `floor-gib-read` is the same plugin reading, after each `List`, the pods it names with a quorum
//! `GET` (`--read-pods`, the node's identity): `List` names pods, not UIDs, so a plugin that never
//! serves the wrong pod whatever its pod watch's lag must read the pod; gpushare's GiB mode is
//! given as a ratio to it too. `floor-dra` is
//! Kubernetes' own limit for a pod with a claim: a DRA driver that prepares nothing and answers at
//! once (`gpushare-box null-dra`) on a slice shaped as gpushared's (8 GPUs of 80 GiB of consumable
//! memory), claims of the same 1024 MiB; gpushare's DRA path is given as a ratio to it. The kubelet's
//! DRA histogram starts at 100 ms, too coarse for a prepare: the DRA rows' `Allocate` figures are
//! left out (gpushare's prepare latency is `cargo bench -p gpushared --bench dra_prepare`'s).
//! `floor-counted` is what the kubelet allows MiB mode's memory as a counted resource rather
//! than as devices: the node's status carries `example.com/counted` of as many units as MiB
//! mode's devices (a JSON patch of the status through the API, as Kubernetes' "advertise extended
//! resources for a node" does), served by no device plugin, so the kubelet admits each pod by a
//! count and calls no plugin; pods of the same size placed by kube-scheduler alone. Its figures
//! are given as ratios to NVIDIA's and to `floor-mib`.
//! `counted` is gpushare's MiB mode on that design (`[kubelet] advertise = "capacity"`): gpushared
//! writes the count into the node's status and joins the recording runtime's NRI
//! (`gpushare_testkit::recording_nri`), which hands it each container as it is created; it
//! allocates then and completes the container's environment, the pods placed through
//! gpushare-extender as MiB mode's. Its figures are given as ratios to NVIDIA's, to MiB mode's
//! and to `floor-counted`; its wrong-pod answers are counted as MiB mode's are, and the latency
//! of each NRI `CreateContainer` (the call that allocates) is reported as the runtime saw it,
//! p50 and p99 of every call, where the kubelet's `Allocate` histogram has nothing.
//! `counted-gib` is GiB mode's node and pods (8 × 80 GiB, pods of 1 GiB) on a counted node, as
//! `counted`'s; its figures are given as ratios to NVIDIA's and to GiB mode's.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss
)]

use std::process::Command;
use std::time::{Duration, Instant};

use gpushare_testkit::nvml::FakeGpu;
use gpushare_testkit::peers::{self, ALIYUN_GPU_MEM, HAMI_GPU, HAMI_GPUMEM, NVIDIA_GPU, NullAsks, NvidiaSharing};
use gpushare_testkit::realbox::{RealCluster, RealOptions, is_root};
use gpushare_testkit::{null_dra, nvidia_dra};
use serde_json::{Value, json};

const NODE: &str = "bench-node";
const GPUS: u32 = 8;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum System {
    GpushareMib,
    GpushareGib,
    GpushareDra,
    Nvidia,
    Alibaba,
    Hami,
    NvidiaDra,
    /// A plugin that answers at once ([`gpushare_testkit::null_plugin`]) with as many devices as
    /// gpushare's MiB mode: what the kubelet itself allows at that count.
    FloorMib,
    /// The same plugin with GiB mode's device count, asking the kubelet's PodResources `List`
    /// before each `GetPreferredAllocation`: what the kubelet allows a plugin that must know
    /// its pod.
    FloorGib,
    /// A DRA driver that answers at once ([`gpushare_testkit::null_dra`]) on a slice like
    /// gpushared's: what Kubernetes itself allows for a pod with a claim.
    FloorDra,
    /// [`System::FloorGib`] that also reads each pod the `List` names with a quorum `GET`: what
    /// the kubelet and the API server allow a plugin that never serves the wrong pod, whatever
    /// its pod watch's lag.
    FloorGibRead,
    /// [`System::GpushareGib`] answering `Allocate` with `[kubelet] environment = "lean"`: what
    /// the answer's size costs in the kubelet's checkpoint.
    GpushareGibLean,
    /// MiB mode's memory as a counted extended resource: the node's status carries as many
    /// units as MiB mode's devices, written through the API (as Kubernetes' "advertise
    /// extended resources for a node" does) and served by no device plugin, so the kubelet
    /// admits each pod by a count alone. What the kubelet allows a design that delivers the GPU
    /// at the container's creation (NRI) rather than through the device plugin.
    FloorCounted,
    /// gpushare's MiB mode on a node whose kubelet counts the memory (`[kubelet] advertise =
    /// "capacity"`): each container allocated as it is created, through the runtime's NRI.
    GpushareCounted,
    /// [`System::GpushareGib`]'s node and pods on a node that counts the memory, as
    /// [`System::GpushareCounted`]'s does.
    GpushareCountedGib,
}

const SYSTEMS: [System; 15] = [
    System::GpushareMib,
    System::GpushareGib,
    System::GpushareDra,
    System::Nvidia,
    System::Alibaba,
    System::Hami,
    System::NvidiaDra,
    System::FloorMib,
    System::FloorDra,
    System::FloorGib,
    System::FloorGibRead,
    System::GpushareGibLean,
    System::FloorCounted,
    System::GpushareCounted,
    System::GpushareCountedGib,
];

impl System {
    /// The name `GPUSHARE_BENCH_SYSTEMS` uses.
    fn short(self) -> &'static str {
        match self {
            System::GpushareMib => "mib",
            System::GpushareGib => "gib",
            System::GpushareDra => "dra",
            System::Nvidia => "nvidia",
            System::Alibaba => "alibaba",
            System::Hami => "hami",
            System::NvidiaDra => "nvidia-dra",
            System::FloorMib => "floor-mib",
            System::FloorDra => "floor-dra",
            System::FloorGib => "floor-gib",
            System::FloorGibRead => "floor-gib-read",
            System::GpushareGibLean => "gib-lean",
            System::FloorCounted => "floor-counted",
            System::GpushareCounted => "counted",
            System::GpushareCountedGib => "counted-gib",
        }
    }
}

/// The floor systems' resources: kube-scheduler places their pods alone, as NVIDIA's.
const FLOOR_RESOURCE: &str = "example.com/mib";
const FLOOR_GIB_RESOURCE: &str = "example.com/gib";
const FLOOR_COUNTED_RESOURCE: &str = "example.com/counted";

/// One round's figures.
#[derive(Clone, Copy, Debug)]
struct Figures {
    pods_per_s: f64,
    alloc_p50_ms: f64,
    alloc_p99_ms: f64,
    rss_mib: f64,
    /// Containers whose `GPUSHARE_POD` names another pod (NaN: not gpushared's device plugin).
    wrong_pod: f64,
    /// NRI `CreateContainer` latency as the runtime saw it, p50 and p99 of every call (NaN: no
    /// NRI plugin served the node): on a counted node, the call that allocates.
    create_p50_ms: f64,
    create_p99_ms: f64,
    stages: Stages,
    /// CPU time each of [`CPU_PARTS`] used during the burst, ms per pod.
    cpu_ms: [f64; CPU_PARTS.len()],
}

/// The processes whose CPU time a round reports: on a box of few cores they share them, so
/// what one spends the others wait for. `bench` is this process alone (the recording runtime,
/// the polling); a component's children are counted with it.
const CPU_PARTS: [&str; 7] = ["kube-apiserver", "etcd", "kube-scheduler", "kubelet", "extender", "plugin", "bench"];

/// CPU time used so far by each of [`CPU_PARTS`] in box `b`, on its node.
fn cpu_now(b: &RealCluster) -> [Duration; CPU_PARTS.len()] {
    use gpushare_testkit::cluster::Proc;
    let of = |p: Option<&Proc>| p.and_then(Proc::pid).map_or(Duration::ZERO, gpushare_testkit::cpu::tree);
    let node = b.node(NODE).unwrap();
    [
        of(Some(&b.plane.apiserver)),
        of(Some(&b.plane.etcd)),
        of(b.plane.scheduler.as_ref()),
        of(Some(&node.kubelet.proc)),
        of(Some(&b.extender)),
        of(Some(&node.daemon)),
        gpushare_testkit::cpu::own(std::process::id()),
    ]
}

/// With `GPUSHARE_BENCH_PIN=CONTROL/NODE` (CPU lists, e.g. `0/1`), pins box `b`'s control
/// plane (etcd, kube-apiserver, kube-scheduler, the extender) to the CPUs `CONTROL` and its
/// node (the kubelet, the device plugin, and this process, which hosts the recording runtime)
/// to `NODE`, as a cluster whose control plane runs on other machines than its GPU nodes does.
/// Returns the CPUs this process ran on before, to give back after the burst.
fn pin_split(b: &RealCluster) -> Option<String> {
    use gpushare_testkit::cluster::Proc;
    use gpushare_testkit::cpu::pin;
    let split = std::env::var("GPUSHARE_BENCH_PIN").ok().filter(|s| !s.is_empty())?;
    let Some((control, node_cpus)) = split.split_once('/') else {
        panic!("GPUSHARE_BENCH_PIN={split}: write the control plane's CPUs, a slash, the node's (e.g. 0/1)")
    };
    let before = gpushare_testkit::cpu::allowed(std::process::id()).unwrap();
    let node = b.node(NODE).unwrap();
    let pid = |p: Option<&Proc>, what: &str| p.and_then(Proc::pid).unwrap_or_else(|| panic!("no {what} to pin"));
    for (p, what) in [
        (Some(&b.plane.etcd), "etcd"),
        (Some(&b.plane.apiserver), "kube-apiserver"),
        (b.plane.scheduler.as_ref(), "kube-scheduler"),
        (Some(&b.extender), "extender"),
    ] {
        pin(pid(p, what), control).unwrap();
    }
    pin(pid(Some(&node.kubelet.proc), "kubelet"), node_cpus).unwrap();
    pin(pid(Some(&node.daemon), "device plugin"), node_cpus).unwrap();
    pin(std::process::id(), node_cpus).unwrap();
    println!(
        "  pinned: the control plane to CPUs {control}, the node (kubelet, device plugin, runtime) to {node_cpus}"
    );
    Some(before)
}

/// Where a round's time went, from the components' own metrics and logs, per pod of the burst
/// (the stages overlap: kube-scheduler places pods while the kubelet admits earlier ones). NaN
/// where a component does not report it.
#[derive(Clone, Copy, Debug)]
struct Stages {
    /// kube-scheduler's scheduling attempts per pod (1: none was tried again).
    attempts: f64,
    /// kube-scheduler's scheduling cycles (its filters and scores, the extender's filter and
    /// prioritize), ms per pod (`scheduler_scheduling_attempt_duration_seconds`).
    schedule_ms: f64,
    /// gpushare-extender's bind (its checks, waits behind look-alikes, the Binding), ms per
    /// pod (`gpushare_extender_request_duration_seconds{verb="bind"}`).
    bind_ms: f64,
    /// Binds deferred behind a look-alike, per pod (`gpushare_extender_binds_total{outcome="deferred"}`).
    deferred: f64,
    /// The kubelet's admission of a pod's resources (its topology manager's admit, which runs the
    /// device manager: `GetPreferredAllocation`, `Allocate`, its checkpoint), ms per pod
    /// (`kubelet_topology_manager_admission_duration_ms`).
    admit_ms: f64,
    /// The kubelet's `Allocate` calls alone, ms per pod (`kubelet_device_plugin_alloc_duration_seconds`).
    allocate_ms: f64,
    /// PodResources `List` calls the kubelet served, per pod (`pod_resources_endpoint_requests_list`):
    /// each walks every active pod, on the kubelet's CPU.
    lists: f64,
    /// kube-scheduler's API client held back by its own rate limit, ms per pod (its log's
    /// `Waited before sending request`).
    throttled_ms: f64,
}

fn main() {
    if !is_root() {
        eprintln!("side_by_side: the real kubelet needs root");
        std::process::exit(1);
    }
    let pods = env("GPUSHARE_BENCH_PODS", 500) as usize;
    let rounds = env("GPUSHARE_BENCH_ROUNDS", 2);
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let chosen = std::env::var("GPUSHARE_BENCH_SYSTEMS").unwrap_or_else(|_| {
        "mib,gib,dra,nvidia,alibaba,hami,nvidia-dra,floor-mib,floor-gib,floor-dra,floor-gib-read,floor-counted,counted,\
         counted-gib"
            .into()
    });
    let mut chosen: Vec<&str> = chosen.split(',').map(str::trim).collect();
    if chosen.contains(&"alibaba")
        && let Err(why) = gpushare_testkit::peers::alibaba()
    {
        eprintln!("{why}");
        chosen.retain(|s| *s != "alibaba");
    }
    if chosen.contains(&"hami")
        && let Err(why) = gpushare_testkit::peers::hami()
    {
        eprintln!("{why}");
        chosen.retain(|s| *s != "hami");
    }
    if chosen.contains(&"nvidia-dra")
        && let Err(why) = gpushare_testkit::nvidia_dra::built()
    {
        eprintln!("{why}");
        chosen.retain(|s| *s != "nvidia-dra");
    }
    let mut figures: Vec<Vec<Figures>> = vec![Vec::new(); SYSTEMS.len()];
    for round in 1..=rounds {
        for (i, system) in SYSTEMS.into_iter().enumerate().filter(|(_, s)| chosen.contains(&s.short())) {
            let dir = gpushare_testkit::box_dir().map(|d| d.join(format!("{system:?}-{round}").to_lowercase()));
            // The extender counts in the node's unit.
            let extender_extra =
                if matches!(system, System::GpushareGib | System::GpushareGibLean | System::GpushareCountedGib) {
                    "[resources]\nunit = \"GiB\"\n".into()
                } else {
                    String::new()
                };
            let options = RealOptions { dir, extender_extra, ..RealOptions::default() };
            let f = runtime.block_on(measure(system, pods, options));
            println!(
                "round {round} {system:?}: {pods} pods in {:.1} pods/s; kubelet Allocate p50 {:.1} ms, p99 {:.1} ms; \
                 plugin RSS {:.1} MiB; wrong-pod answers {}",
                f.pods_per_s, f.alloc_p50_ms, f.alloc_p99_ms, f.rss_mib, f.wrong_pod
            );
            let st = f.stages;
            println!(
                "  stages per pod: {:.2} scheduling attempts, scheduling {:.1} ms, extender bind {:.1} ms ({:.2} \
                 deferred behind look-alikes), kubelet admission {:.1} ms of which Allocate {:.1} ms, {:.2} PodResources \
                 List calls, kube-scheduler throttled {:.1} ms; wall time {:.1} ms",
                st.attempts,
                st.schedule_ms,
                st.bind_ms,
                st.deferred,
                st.admit_ms,
                st.allocate_ms,
                st.lists,
                st.throttled_ms,
                1000.0 / f.pods_per_s
            );
            if !f.create_p50_ms.is_nan() {
                println!(
                    "  NRI CreateContainer as the runtime saw it: p50 {:.2} ms, p99 {:.2} ms",
                    f.create_p50_ms, f.create_p99_ms
                );
            }
            println!("  CPU per pod: {}", cpu_line(&f.cpu_ms));
            figures[i].push(f);
        }
    }
    let mean = |v: &[Figures], f: fn(&Figures) -> f64| v.iter().map(f).sum::<f64>() / v.len() as f64;
    let (mib, gib, dra, nvidia, alibaba, hami, nvidia_dra, floor) =
        (&figures[0], &figures[1], &figures[2], &figures[3], &figures[4], &figures[5], &figures[6], &figures[7]);
    let (floor_dra, floor_gib, floor_read, gib_lean) = (&figures[8], &figures[9], &figures[10], &figures[11]);
    let (counted, gpushare_counted, counted_gib) = (&figures[12], &figures[13], &figures[14]);
    println!(
        "\nmeans of {rounds} rounds (NaN: not run); ratios to gpushare GiB mode (DRA's, NVIDIA's), \
         Alibaba's and HAMi's to gpushare MiB mode, NVIDIA's DRA driver's to gpushare DRA, gpushare MiB mode's \
         to the floor at its device count, gpushare GiB mode's to the floor of a plugin that asks the kubelet \
         (and to that of one that also reads the pod), gpushare DRA's to the DRA floor and the DRA floor's to \
         NVIDIA, the counted floor's to NVIDIA and to the floor at MiB mode's device count, gpushare counted's \
         to NVIDIA, to gpushare MiB mode and to the counted floor, gpushare counted in GiB's to NVIDIA and to \
         gpushare GiB mode:"
    );
    for (name, f) in [
        ("pods/s end to end", (|x: &Figures| x.pods_per_s) as fn(&Figures) -> f64),
        ("kubelet Allocate p50", |x| x.alloc_p50_ms),
        ("kubelet Allocate p99", |x| x.alloc_p99_ms),
        ("plugin RSS", |x| x.rss_mib),
        ("NRI CreateContainer p50", |x| x.create_p50_ms),
        ("NRI CreateContainer p99", |x| x.create_p99_ms),
    ] {
        let (a, g, d, n, l) = (mean(mib, f), mean(gib, f), mean(dra, f), mean(nvidia, f), mean(alibaba, f));
        let (h, nd, fl, fd) = (mean(hami, f), mean(nvidia_dra, f), mean(floor, f), mean(floor_dra, f));
        let (fg, fr, gl, fc) = (mean(floor_gib, f), mean(floor_read, f), mean(gib_lean, f), mean(counted, f));
        let (gc, gg) = (mean(gpushare_counted, f), mean(counted_gib, f));
        println!(
            "  {name}: gpushare MiB {a:.2}, GiB {g:.2}, DRA {d:.2}; NVIDIA {n:.2}; Alibaba MiB {l:.2}; HAMi {h:.2}; \
             NVIDIA DRA {nd:.2}; floor MiB {fl:.2}; floor GiB {fg:.2}; floor GiB reading {fr:.2}; floor DRA {fd:.2}; \
             ratio {:.2}, {:.2}; Alibaba {:.2}; HAMi {:.2}; NVIDIA DRA {:.2}; MiB to floor {:.2}; GiB to its floor \
             {:.2}; GiB to the reading floor {:.2}; floor GiB to NVIDIA {:.2}; reading floor to NVIDIA {:.2}; DRA to \
             its floor {:.2}; DRA floor to NVIDIA {:.2}; GiB lean {gl:.2}, to NVIDIA {:.2}; floor counted {fc:.2}, \
             to NVIDIA {:.2}, to floor MiB {:.2}; gpushare counted {gc:.2}, to NVIDIA {:.2}, to MiB {:.2}, to \
             floor counted {:.2}; gpushare counted GiB {gg:.2}, to NVIDIA {:.2}, to GiB {:.2}",
            d / g,
            n / g,
            l / a,
            h / a,
            nd / d,
            a / fl,
            g / fg,
            g / fr,
            fg / n,
            fr / n,
            d / fd,
            fd / n,
            gl / n,
            fc / n,
            fc / fl,
            gc / n,
            gc / a,
            gc / fc,
            gg / n,
            gg / g
        );
    }
    println!("\nstages per pod, means of {rounds} rounds (ms unless said; NaN: not reported):");
    println!(
        "  system | pods/s | attempts | scheduling | extender bind | deferred | kubelet admission | Allocate | throttled"
    );
    for (system, runs) in SYSTEMS.into_iter().zip(&figures).filter(|(_, r)| !r.is_empty()) {
        let m = |f: fn(&Stages) -> f64| runs.iter().map(|x| f(&x.stages)).sum::<f64>() / runs.len() as f64;
        println!(
            "  {} | {:.2} | {:.2} | {:.1} | {:.1} | {:.2} | {:.1} | {:.1} | {:.1}",
            system.short(),
            mean(runs, |x| x.pods_per_s),
            m(|s| s.attempts),
            m(|s| s.schedule_ms),
            m(|s| s.bind_ms),
            m(|s| s.deferred),
            m(|s| s.admit_ms),
            m(|s| s.allocate_ms),
            m(|s| s.throttled_ms)
        );
    }
    println!("\nCPU per pod during the burst, means of {rounds} rounds (ms):");
    for (system, runs) in SYSTEMS.into_iter().zip(&figures).filter(|(_, r)| !r.is_empty()) {
        let cpu: [f64; CPU_PARTS.len()] =
            std::array::from_fn(|i| runs.iter().map(|x| x.cpu_ms[i]).sum::<f64>() / runs.len() as f64);
        println!("  {}: {}", system.short(), cpu_line(&cpu));
    }
}

/// `part X, ...; total X` for CPU figures in ms.
fn cpu_line(cpu: &[f64; CPU_PARTS.len()]) -> String {
    let parts: Vec<String> = CPU_PARTS.iter().zip(cpu).map(|(p, ms)| format!("{p} {ms:.1}")).collect();
    format!("{}; total {:.1} ms", parts.join(", "), cpu.iter().sum::<f64>())
}

async fn measure(system: System, pods: usize, options: RealOptions) -> Figures {
    let mut b = RealCluster::up(&options).await.unwrap_or_else(|e| panic!("{e:#}"));
    // The MiB-mode node and pod, for gpushare's MiB mode and Alibaba's alike.
    let (mib_gpu, mib_pod) = (env("GPUSHARE_BENCH_MIB_GPU", 16384), env("GPUSHARE_BENCH_MIB_POD", 200).to_string());
    let gpus =
        |mib: u64, model: &str| -> Vec<FakeGpu> { (0..GPUS).map(|i| FakeGpu::new(NODE, i, mib, model)).collect() };
    let (resource, devices, ask) = match system {
        System::GpushareMib => {
            b.add_node(NODE, &gpus(mib_gpu, "Tesla V100-SXM2-16GB"), ("", "")).unwrap();
            ("gpushare.io/gpu-mem", (mib_gpu * u64::from(GPUS)).to_string(), mib_pod.as_str())
        }
        System::GpushareGib | System::GpushareGibLean => {
            let lean = if system == System::GpushareGibLean { "[kubelet]\nenvironment = \"lean\"\n" } else { "" };
            let config = format!("[resources]\nunit = \"GiB\"\n{lean}");
            b.add_node(NODE, &gpus(81920, "NVIDIA H100 80GB HBM3"), ("", &config)).unwrap();
            ("gpushare.io/gpu-mem", (80 * GPUS).to_string(), "1")
        }
        System::GpushareDra => {
            let config = b.dra_config(NODE, &(0..GPUS).collect::<Vec<_>>());
            b.plane.apply(&gpushare_testkit::realbox::repo().join("etc/kubernetes/gpushare-deviceclass.yaml")).unwrap();
            b.add_node(NODE, &gpus(81920, "NVIDIA H100 80GB HBM3"), ("", &config)).unwrap();
            ("", String::new(), "1024Mi")
        }
        System::Nvidia => {
            let replicas = (pods as u32).div_ceil(GPUS);
            b.add_nvidia_node(NODE, &gpus(16384, "Tesla V100-SXM2-16GB"), NvidiaSharing { replicas }).unwrap();
            (NVIDIA_GPU, (replicas * GPUS).to_string(), "1")
        }
        System::Alibaba => {
            // Its extender takes the place of ours: kube-scheduler calls it alone.
            b.extender = peers::start_alibaba_extender(&mut b.plane).unwrap();
            b.add_alibaba_node(NODE, &gpus(mib_gpu, "Tesla V100-SXM2-16GB"), "MiB").unwrap();
            (ALIYUN_GPU_MEM, (mib_gpu * u64::from(GPUS)).to_string(), mib_pod.as_str())
        }
        System::Hami => {
            // Its scheduler takes the place of our extender; its webhook sends the pods to it.
            let split = (pods as u32).div_ceil(GPUS);
            let (scheduler, metrics) = peers::start_hami_scheduler(&mut b.plane, split).unwrap();
            (b.extender, b.observe) = (scheduler, metrics);
            b.add_hami_node(NODE, &gpus(mib_gpu, "Tesla V100-SXM2-16GB"), split).unwrap();
            wait_hami_registered(&b).await;
            (HAMI_GPU, (split * GPUS).to_string(), mib_pod.as_str())
        }
        System::FloorMib => {
            let devices = u32::try_from(mib_gpu * u64::from(GPUS)).unwrap();
            b.add_null_plugin_node(NODE, FLOOR_RESOURCE, devices, NullAsks::Nothing).unwrap();
            (FLOOR_RESOURCE, devices.to_string(), mib_pod.as_str())
        }
        System::FloorGib | System::FloorGibRead => {
            let asks = if system == System::FloorGib { NullAsks::Kubelet } else { NullAsks::KubeletAndApiServer };
            b.add_null_plugin_node(NODE, FLOOR_GIB_RESOURCE, 80 * GPUS, asks).unwrap();
            (FLOOR_GIB_RESOURCE, (80 * GPUS).to_string(), "1")
        }
        System::FloorCounted => {
            // The node boots as the other floors' do, its plugin serving one device of
            // another resource; the counted resource is the node status's alone.
            b.add_null_plugin_node(NODE, FLOOR_GIB_RESOURCE, 1, NullAsks::Nothing).unwrap();
            let units = mib_gpu * u64::from(GPUS);
            let path = format!("/status/capacity/{}", FLOOR_COUNTED_RESOURCE.replace('/', "~1"));
            let patch = json!([{"op": "add", "path": path, "value": units.to_string()}]).to_string();
            b.plane.kubectl(&["patch", "node", NODE, "--subresource=status", "--type=json", "-p", &patch]).unwrap();
            (FLOOR_COUNTED_RESOURCE, units.to_string(), mib_pod.as_str())
        }
        System::GpushareCounted => {
            let config = "[kubelet]\nadvertise = \"capacity\"\n[nri]\nenabled = true\n";
            b.add_node(NODE, &gpus(mib_gpu, "Tesla V100-SXM2-16GB"), ("", config)).unwrap();
            wait_nri(&b);
            ("gpushare.io/gpu-mem", (mib_gpu * u64::from(GPUS)).to_string(), mib_pod.as_str())
        }
        System::GpushareCountedGib => {
            let config = "[resources]\nunit = \"GiB\"\n[kubelet]\nadvertise = \"capacity\"\n[nri]\nenabled = true\n";
            b.add_node(NODE, &gpus(81920, "NVIDIA H100 80GB HBM3"), ("", config)).unwrap();
            wait_nri(&b);
            ("gpushare.io/gpu-mem", (80 * GPUS).to_string(), "1")
        }
        System::FloorDra => {
            b.plane.create(&null_dra::device_class()).unwrap();
            b.add_null_dra_node(NODE).unwrap();
            b.plane.create(&null_dra::slice(NODE, GPUS, 81920)).unwrap();
            wait_registered(&b);
            ("", String::new(), "1024Mi")
        }
        System::NvidiaDra => {
            b.plane.create(&nvidia_dra::device_class()).unwrap();
            let gpus: Vec<FakeGpu> =
                gpus(81920, "NVIDIA H100 80GB HBM3").into_iter().map(FakeGpu::with_nvidia_uuid).collect();
            b.add_nvidia_dra_node(NODE, &gpus).unwrap();
            ("", String::new(), "1024Mi")
        }
    };
    let dra = matches!(system, System::GpushareDra | System::NvidiaDra | System::FloorDra);
    let class = match system {
        System::NvidiaDra => nvidia_dra::DEVICE_CLASS,
        System::FloorDra => null_dra::DEVICE_CLASS,
        _ => "gpushare-memory",
    };
    if dra {
        wait_slice(&b, GPUS as usize);
    } else {
        b.wait_allocatable(NODE, resource, &devices, Duration::from_secs(120)).unwrap();
    }
    let mut items: Vec<Value> = Vec::new();
    for i in 0..pods {
        let name = format!("b-{i}");
        let (resources, claims) = if dra {
            items.push(json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": class, "capacity": {"requests": {"memory": ask}}}}]}}}));
            (json!({"claims": [{"name": "gpu"}]}), json!([{"name": "gpu", "resourceClaimName": name}]))
        } else if system == System::Hami {
            (json!({"limits": {HAMI_GPU: "1", HAMI_GPUMEM: ask}}), json!([]))
        } else {
            (json!({"limits": {resource: ask}}), json!([]))
        };
        items.push(json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
               "spec": {"automountServiceAccountToken": false, "terminationGracePeriodSeconds": 0,
                        "resourceClaims": claims,
                        "containers": [{"name": "main", "image": "registry.example/app:1", "resources": resources}]}}));
    }
    let list = json!({"apiVersion": "v1", "kind": "List", "metadata": {"name": "bench"}, "items": items});
    let node = b.node(NODE).unwrap();
    let api_before = b.plane.kubectl(&["get", "--raw", "/metrics"]).unwrap_or_default();
    let unpin = pin_split(&b);
    let cpu_before = cpu_now(&b);
    let started = Instant::now();
    b.plane.create(&list).unwrap();
    let deadline = started + Duration::from_secs(900);
    while node.runtime.recording().unwrap().running().len() < pods {
        assert!(
            Instant::now() < deadline,
            "{} of {pods} running after 15 minutes",
            node.runtime.recording().unwrap().running().len()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu_after = cpu_now(&b);
    if let Some(all) = unpin {
        gpushare_testkit::cpu::pin(std::process::id(), &all).unwrap();
    }
    let cpu_ms =
        std::array::from_fn(|i| cpu_after[i].saturating_sub(cpu_before[i]).as_secs_f64() * 1000.0 / pods as f64);
    let api_after = b.plane.kubectl(&["get", "--raw", "/metrics"]).unwrap_or_default();
    println!("  {system:?}, the API server per pod of the burst: {}", api_line(&api_before, &api_after, pods as f64));
    // gpushared names the pod it served in each container's environment: one that names
    // another pod is a wrong-pod answer.
    let wrong_pod = if matches!(
        system,
        System::GpushareMib
            | System::GpushareGib
            | System::GpushareGibLean
            | System::GpushareCounted
            | System::GpushareCountedGib
    ) {
        let running = node.runtime.recording().unwrap().running();
        let wrong: Vec<String> = running
            .iter()
            .filter(|c| c.envs.get("GPUSHARE_POD") != Some(&format!("{}/{}", c.namespace, c.pod)))
            .map(|c| format!("{}/{} got {:?}", c.namespace, c.pod, c.envs.get("GPUSHARE_POD")))
            .collect();
        if !wrong.is_empty() {
            eprintln!("wrong-pod answers: {}", wrong.join("; "));
        }
        wrong.len() as f64
    } else {
        f64::NAN
    };
    // The counted floor's plugin serves none of its pods.
    let rss_mib = if system == System::FloorCounted { f64::NAN } else { rss_kib(node.daemon.pid().unwrap()) / 1024.0 };
    let kubelet = kubelet_metrics(&b);
    // No device plugin serves a counted resource's pods: the kubelet calls no `Allocate` for them.
    let counts = matches!(system, System::FloorCounted | System::GpushareCounted | System::GpushareCountedGib);
    let (alloc_p50_ms, alloc_p99_ms) =
        if dra || counts { (f64::NAN, f64::NAN) } else { alloc_quantiles(&kubelet, resource) };
    let stages = stages(&b, &kubelet, resource, pods as f64).await;
    let mut creates: Vec<f64> =
        node.runtime.recording().unwrap().nri_create_latencies().iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    creates.sort_by(f64::total_cmp);
    let rank = |q: f64| creates.get(((creates.len() as f64 * q).ceil() as usize).saturating_sub(1)).copied();
    let (create_p50_ms, create_p99_ms) = (rank(0.5).unwrap_or(f64::NAN), rank(0.99).unwrap_or(f64::NAN));
    b.shutdown();
    Figures {
        pods_per_s: pods as f64 / elapsed,
        alloc_p50_ms,
        alloc_p99_ms,
        rss_mib,
        wrong_pod,
        create_p50_ms,
        create_p99_ms,
        stages,
        cpu_ms,
    }
}

/// The sum of a metric's series whose lines start with `name` (`name{` or `name `) and contain
/// every one of `labels`; NaN if there is none.
fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    let values: Vec<f64> = text
        .lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' ')))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    if values.is_empty() { f64::NAN } else { values.iter().sum() }
}

/// A metric's series summed by the labels `by` (joined by a space), from one `/metrics` text.
fn series_by(text: &str, name: &str, by: &[&str]) -> std::collections::BTreeMap<String, f64> {
    let mut sums = std::collections::BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name).and_then(|r| r.strip_prefix('{')) else { continue };
        let Some((labels, value)) = rest.rsplit_once("} ") else { continue };
        let Ok(value) = value.parse::<f64>() else { continue };
        let label = |key: &str| {
            labels.split(',').find_map(|kv| kv.strip_prefix(key)?.strip_prefix("=\"")?.strip_suffix('"')).unwrap_or("")
        };
        let key: Vec<&str> = by.iter().map(|k| label(k)).filter(|v| !v.is_empty()).collect();
        *sums.entry(key.join(" ")).or_insert(0.0) += value;
    }
    sums
}

/// The API server's work during a burst, per pod, from its `/metrics` before and after: each
/// kind of request (verb, resource and subresource; watches left out) as its count and the time
/// the server spent on it, the watch events it sent by resource, with their bytes, then the
/// requests it answered with an error, by code.
fn api_line(before: &str, after: &str, pods: f64) -> String {
    let delta = |name: &str, by: &[&str]| {
        let (b, a) = (series_by(before, name, by), series_by(after, name, by));
        a.into_iter().map(|(k, v)| (k.clone(), v - b.get(&k).copied().unwrap_or(0.0))).collect::<Vec<_>>()
    };
    let by = ["verb", "resource", "subresource"];
    let seconds: std::collections::BTreeMap<String, f64> =
        delta("apiserver_request_duration_seconds_sum", &by).into_iter().collect();
    let mut requests: Vec<(String, f64, f64)> = delta("apiserver_request_total", &by)
        .into_iter()
        .filter(|(k, n)| *n > 0.0 && !k.starts_with("WATCH"))
        .map(|(k, n)| {
            let ms = seconds.get(&k).copied().unwrap_or(0.0) * 1000.0;
            (k, n / pods, ms / pods)
        })
        .collect();
    requests.sort_by(|a, b| b.2.total_cmp(&a.2));
    let mut parts: Vec<String> = requests.iter().map(|(k, n, ms)| format!("{k} {n:.2}× {ms:.2} ms")).collect();
    let bytes: std::collections::BTreeMap<String, f64> =
        delta("apiserver_watch_events_sizes_sum", &["resource"]).into_iter().collect();
    for (k, n) in delta("apiserver_watch_events_total", &["resource"]).into_iter().filter(|(_, n)| *n > 0.0) {
        let kib = bytes.get(&k).copied().unwrap_or(0.0) / 1024.0;
        parts.push(format!("watch events {k} {:.2}× {:.1} KiB", n / pods, kib / pods));
    }
    let refused: Vec<String> = delta("apiserver_request_total", &["code", "verb", "resource", "subresource"])
        .into_iter()
        .filter(|(k, n)| *n > 0.0 && (k.starts_with('4') || k.starts_with('5')))
        .map(|(k, n)| format!("{k} {:.3}×", n / pods))
        .collect();
    if !refused.is_empty() {
        parts.push(format!("refused: {}", refused.join(", ")));
    }
    parts.join("; ")
}

/// Seconds in a Go duration as klog prints it (`1.5s`, `993.1ms`, `12µs`).
fn go_seconds(text: &str) -> Option<f64> {
    for (suffix, scale) in [("ms", 1e-3), ("µs", 1e-6), ("us", 1e-6), ("ns", 1e-9), ("s", 1.0)] {
        if let Some(n) = text.strip_suffix(suffix) {
            return n.parse::<f64>().ok().map(|v| v * scale);
        }
    }
    None
}

/// Where the round's time went ([`Stages`]).
async fn stages(b: &RealCluster, kubelet: &str, resource: &str, pods: f64) -> Stages {
    let scheduler = b.plane.scheduler_port;
    let scheduler = if scheduler == 0 { String::new() } else { secure_metrics(b, scheduler) };
    let extender = gpushare_testkit::cluster::http_get(b.observe, "/metrics").await.map(|(_, m)| m).unwrap_or_default();
    let throttled: f64 = b
        .plane
        .scheduler
        .as_ref()
        .map(gpushare_testkit::cluster::Proc::log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("Waited before sending request"))
        .filter_map(|l| go_seconds(l.split("delay=\"").nth(1)?.split('"').next()?))
        .fold(0.0, |sum, s| sum + s);
    let per_pod_ms = |seconds: f64| seconds * 1000.0 / pods;
    let attempts = metric(&scheduler, "scheduler_schedule_attempts_total", &[]);
    Stages {
        attempts: attempts / pods,
        schedule_ms: per_pod_ms(metric(&scheduler, "scheduler_scheduling_attempt_duration_seconds_sum", &[])),
        bind_ms: per_pod_ms(metric(&extender, "gpushare_extender_request_duration_seconds_sum", &["verb=\"bind\""])),
        deferred: metric(&extender, "gpushare_extender_binds_total", &["outcome=\"deferred\""]) / pods,
        admit_ms: metric(kubelet, "kubelet_topology_manager_admission_duration_ms_sum", &[]) / pods,
        allocate_ms: per_pod_ms(metric(
            kubelet,
            "kubelet_device_plugin_alloc_duration_seconds_sum",
            &[&format!("resource_name=\"{resource}\"")],
        )),
        throttled_ms: per_pod_ms(throttled),
        lists: ["kubelet_pod_resources_endpoint_requests_list", "pod_resources_endpoint_requests_list"]
            .iter()
            .map(|name| metric(kubelet, name, &[]))
            .find(|n| !n.is_nan())
            .unwrap_or(0.0)
            / pods,
    }
}

/// Waits until HAMi's scheduler has read the node's devices (its metrics name the node): until
/// then it places nothing there.
async fn wait_hami_registered(b: &RealCluster) {
    let registered = format!("node=\"{NODE}\"");
    let deadline = Instant::now() + Duration::from_secs(60);
    while gpushare_testkit::cluster::http_get(b.observe, "/metrics").await.is_none_or(|(_, m)| !m.contains(&registered))
    {
        assert!(Instant::now() < deadline, "HAMi's scheduler has not registered {NODE} after 60 s");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Waits until the node's ResourceSlice lists `devices` devices.
fn wait_slice(b: &RealCluster, devices: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let out = b.plane.kubectl(&["get", "resourceslices", "-o", "json"]).unwrap();
        let slices: Value = serde_json::from_str(&out).unwrap();
        let n: usize = slices["items"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len))
            .sum();
        if n == devices {
            return;
        }
        assert!(Instant::now() < deadline, "the node's ResourceSlice has {n} devices, not {devices}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Waits until gpushared has registered with the node's runtime as its NRI plugin: until then
/// the runtime creates containers without it.
fn wait_nri(b: &RealCluster) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let runtime = b.node(NODE).unwrap().runtime.recording().unwrap();
    while runtime.nri_plugin().is_none() {
        assert!(Instant::now() < deadline, "gpushared has not registered with the runtime's NRI after 60 s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until the node's kubelet has registered the null DRA driver (its log says so).
fn wait_registered(b: &RealCluster) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let node = b.node(NODE).unwrap();
    while !node.daemon.log().contains("the kubelet registered the DRA plugin") {
        assert!(Instant::now() < deadline, "the kubelet has not registered the null DRA driver after 60 s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn rss_kib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// The node's kubelet's `/metrics`, fetched with a client certificate of the cluster's CA.
fn kubelet_metrics(b: &RealCluster) -> String {
    let text = secure_metrics(b, b.node(NODE).unwrap().kubelet.port);
    assert!(!text.is_empty(), "the kubelet served no metrics");
    text
}

/// `/metrics` of a component serving HTTPS on `port` (the kubelet, kube-scheduler), fetched with
/// a client certificate of the cluster's CA; empty if it cannot be read.
fn secure_metrics(b: &RealCluster, port: u16) -> String {
    let (crt, key) =
        b.plane.pki.issue("bench-metrics", "/O=system:masters/CN=bench", "extendedKeyUsage=clientAuth\n").unwrap();
    let out = Command::new("curl")
        .args(["-sSk", "--cert"])
        .arg(&crt)
        .arg("--key")
        .arg(&key)
        .arg(format!("https://127.0.0.1:{port}/metrics"))
        .output()
        .expect("running curl for metrics");
    if !out.status.success() {
        eprintln!("curl https://127.0.0.1:{port}/metrics: {}", String::from_utf8_lossy(&out.stderr));
        return String::new();
    }
    String::from_utf8(out.stdout).unwrap_or_default()
}

/// p50 and p99 (ms) of `kubelet_device_plugin_alloc_duration_seconds` for `resource`,
/// interpolated linearly within the histogram's buckets.
fn alloc_quantiles(metrics: &str, resource: &str) -> (f64, f64) {
    let prefix = "kubelet_device_plugin_alloc_duration_seconds_bucket{";
    let mut buckets: Vec<(f64, f64)> = metrics
        .lines()
        .filter(|l| l.starts_with(prefix) && l.contains(&format!("resource_name=\"{resource}\"")))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let bound = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            let count: f64 = l.rsplit(' ').next()?.parse().ok()?;
            Some((bound, count))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    assert!(!buckets.is_empty(), "no kubelet_device_plugin_alloc_duration_seconds for {resource}");
    let total = buckets.last().unwrap().1;
    let quantile = |q: f64| {
        let rank = q * total;
        let (mut lower, mut below) = (0.0, 0.0);
        for &(bound, count) in &buckets {
            if count >= rank {
                if bound.is_infinite() {
                    return lower * 1000.0;
                }
                let share = if count > below { (rank - below) / (count - below) } else { 0.0 };
                return (lower + (bound - lower) * share) * 1000.0;
            }
            (lower, below) = (bound, count);
        }
        lower * 1000.0
    };
    (quantile(0.5), quantile(0.99))
}
