//! `gpushare-box demo --real`: the demo on the real Kubernetes components. etcd and
//! kube-apiserver (Node and RBAC authorization), kube-scheduler with the shipped configuration,
//! the extender under the shipped cluster role, and per node of the cluster file the real kubelet
//! (its runtime records what each container was created with) and gpushared on simulated GPUs,
//! as that node ([`gpushare_testkit::realbox`]). The workload is applied as the administrator,
//! and what the runtime received is shown as the stand-in demo shows it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use gpushare_testkit::cluster::{self, Binaries};
use gpushare_testkit::realbox::{self, RealCluster, RealOptions};
use gpushare_testkit::realkube;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;

use super::{Received, print_pods, print_refused, until_stopped};

pub(crate) async fn demo(
    cluster_file: &Path,
    workload_file: &Path,
    dir: Option<PathBuf>,
    exit: bool,
) -> anyhow::Result<()> {
    let spec = cluster::read_cluster(cluster_file)
        .with_context(|| "pass --cluster (the sample is examples/cluster.yaml in the repository)")?;
    let mut pods = cluster::read_workload(workload_file)
        .with_context(|| "pass --workload (the sample is examples/workload.yaml in the repository)")?;
    if !realbox::is_root() {
        bail!(
            "--real runs the real kubelet, which needs root (each kubelet mounts its node's device-plugin \
             directory in a mount namespace of its own): run gpushare-box as root, or leave out --real for \
             the stand-ins"
        );
    }
    if !realkube::available() {
        bail!(
            "--real needs Go (1.26 or later) to build the real Kubernetes components with tests/kube/build, \
             or GPUSHARE_KUBE_BIN naming a directory with etcd, kube-apiserver, kube-scheduler, kubelet and kubectl"
        );
    }
    let started = Instant::now();
    println!(
        "Starting the real-cluster box: etcd, kube-apiserver, kube-scheduler with the shipped configuration, the extender, \
         {} nodes (the real kubelet + gpushared on simulated GPUs)...\n(The first run builds the components from \
         tests/kube, several minutes; later runs reuse them.)",
        spec.nodes.len()
    );
    let mut cluster = RealCluster::for_spec(&spec, &RealOptions { dir, ..RealOptions::default() }).await?;
    println!("Ready in {:.1} s ({}).", started.elapsed().as_secs_f64(), cluster.plane.dir.display());

    // No kube-controller-manager runs: each namespace gets what it would create for pods.
    let mut namespaces = BTreeSet::new();
    for pod in &mut pods {
        let ns = pod.pointer("/metadata/namespace").and_then(serde_json::Value::as_str).unwrap_or("default").to_owned();
        if let Some(meta) = pod.get_mut("metadata").and_then(serde_json::Value::as_object_mut) {
            meta.insert("namespace".into(), ns.clone().into());
        }
        namespaces.insert(ns);
    }
    for ns in &namespaces {
        cluster.prepare_namespace(ns)?;
    }
    // The runtime runs nothing: an init container has done its work as soon as it starts.
    for pod in &pods {
        let meta =
            |k: &str| pod.pointer(&format!("/metadata/{k}")).and_then(serde_json::Value::as_str).unwrap_or_default();
        let inits = pod.pointer("/spec/initContainers").and_then(serde_json::Value::as_array).into_iter().flatten();
        for c in inits.filter(|c| c.get("restartPolicy").and_then(serde_json::Value::as_str) != Some("Always")) {
            let name = c.get("name").and_then(serde_json::Value::as_str).unwrap_or_default();
            for runtime in cluster.nodes.iter().filter_map(|n| n.runtime.recording()) {
                runtime.finish_at_start(meta("namespace"), meta("name"), name);
            }
        }
    }
    let applied = Instant::now();
    println!("Applying {} ({} pods)...", workload_file.display(), pods.len());
    // The shipped admission policy is in force (RealCluster::up): what it refuses is shown.
    let mut refused = Vec::new();
    for pod in &pods {
        if let Err(e) = cluster.plane.create(pod) {
            let e = format!("{e:#}");
            let Some((_, reason)) = e.split_once("denied request: ") else { return Err(anyhow::anyhow!(e)) };
            refused.push((cluster::pod_json_key(pod), reason.trim().to_owned()));
        }
    }
    print_refused(&refused);
    let client = cluster.plane.admin_client().await?;
    let settled = match cluster::settle(&client, Duration::from_secs(90)).await {
        Ok(pods) => {
            println!("Settled in {:.1} s.\n", applied.elapsed().as_secs_f64());
            pods
        }
        Err(e) => {
            println!("Not settled after {:.0} s ({e:#}); as things stand:\n", applied.elapsed().as_secs_f64());
            Api::<Pod>::all(client.clone()).list(&ListParams::default()).await?.items
        }
    };
    println!("{}", cluster.inspect(&[])?);
    println!("(The runtime runs nothing: it records what the kubelet created each container with.)");
    print_pods(&settled, &received(&cluster, &settled));
    println!("\nExplore it:");
    println!("  export KUBECONFIG={}", cluster.plane.admin.display());
    println!("  {} get pods -A -o wide", cluster.plane.bin.join("kubectl").display());
    println!("  {} -d", Binaries::beside_current_exe()?.inspect.display());
    println!("  logs: {}/logs/ (each kubelet's under its node's directory)", cluster.plane.dir.display());
    if !exit {
        println!("\nRunning. Ctrl-C stops every process and removes what the demo created.");
        until_stopped().await?;
        println!("Stopping...");
    }
    cluster.shutdown();
    Ok(())
}

/// What each node's runtime was asked to create, by pod UID, in the order the kubelet created
/// the containers (init containers first).
fn received(cluster: &RealCluster, pods: &[Pod]) -> BTreeMap<String, Vec<Received>> {
    let init: BTreeSet<(String, String)> = pods
        .iter()
        .flat_map(|p| {
            let uid = p.metadata.uid.clone().unwrap_or_default();
            let names = p.spec.iter().flat_map(|s| s.init_containers.iter().flatten()).map(|c| c.name.clone());
            names.map(move |n| (uid.clone(), n)).collect::<Vec<_>>()
        })
        .collect();
    let mut out: BTreeMap<String, Vec<Received>> = BTreeMap::new();
    for runtime in cluster.nodes.iter().filter_map(|n| n.runtime.recording()) {
        for c in runtime.created() {
            let gpu = c.envs.contains_key("GPUSHARE_MEMORY_MIB") || c.envs.contains_key("NVIDIA_VISIBLE_DEVICES");
            let init = init.contains(&(c.pod_uid.clone(), c.container.clone()));
            out.entry(c.pod_uid).or_default().push(Received { name: c.container, init, gpu, env: c.envs });
        }
    }
    out
}
