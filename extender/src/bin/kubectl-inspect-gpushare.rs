//! `kubectl-inspect-gpushare [-d] [-o json] [NODE]`: the cluster's GPU memory, in the tables
//! Alibaba's `kubectl inspect gpushare` users know, read through `KUBECONFIG` (or
//! `~/.kube/config`, or the in-cluster account). Installed on the `PATH`, kubectl runs it as
//! `kubectl inspect gpushare`.

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser as _;
use gpushare_core::codec::node::{NODE_STATE_KEY, NodeState};
use gpushare_core::{MemoryUnit, ResourceNames};
use gpushare_extender::cli::{InspectCli, Output};
use gpushare_extender::inspect::ClusterReport;
use gpushare_extender::kube::client;
use gpushare_extender::objects::{NodeObject, PodObject};
use gpushare_extender::view::{ClusterView, ViewConfig};
use kube::Api;
use kube::api::ListParams;

fn main() -> ExitCode {
    let cli = InspectCli::parse();
    let result = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
        .and_then(|rt| rt.block_on(inspect(&cli)));
    match result {
        Ok(text) => match gpushare_extender::cli::print_stdout(&text) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kubectl-inspect-gpushare: writing to stdout: {e}");
                ExitCode::FAILURE
            }
        },
        Err(e) => {
            // One line: what failed and why, no backtrace.
            eprintln!("kubectl-inspect-gpushare: {}", format!("{e:#}").replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}

async fn inspect(cli: &InspectCli) -> anyhow::Result<String> {
    let client = client(None).await.context("no usable kubeconfig (set KUBECONFIG)")?;
    let timeout = std::time::Duration::from_secs(15);
    let nodes = tokio::time::timeout(timeout, Api::<NodeObject>::all(client.clone()).list(&ListParams::default()))
        .await
        .context("the API server did not answer within 15 s")?
        .context("cannot list nodes")?;
    let pods = tokio::time::timeout(timeout, Api::<PodObject>::all(client).list(&ListParams::default()))
        .await
        .context("the API server did not answer within 15 s")?
        .context("cannot list pods")?;
    // The cluster unit: what the nodes' daemons publish (the most common one).
    let units: Vec<MemoryUnit> = nodes
        .items
        .iter()
        .filter_map(|n| n.annotation(NODE_STATE_KEY))
        .filter_map(|v| NodeState::decode(v).ok())
        .map(|s| s.inventory.unit())
        .collect();
    let gib = units.iter().filter(|u| **u == MemoryUnit::Gib).count();
    let unit = if gib * 2 > units.len() { MemoryUnit::Gib } else { MemoryUnit::Mib };
    let mut view = ClusterView::new(ViewConfig {
        unit,
        names: if cli.alibaba { ResourceNames::alibaba() } else { ResourceNames::gpushare() },
        alibaba: cli.alibaba,
        assume_ttl: std::time::Duration::ZERO,
        heartbeat_by_wall_clock: true,
    });
    view.replace_nodes(&nodes.items);
    view.replace_pods(&pods.items);
    let mut report = ClusterReport::from_view(&mut view);
    if let Some(node) = &cli.node {
        report = report.only(node);
        if let Some((_, why)) = report.unreadable.first() {
            anyhow::bail!(
                "node {node:?}: its {NODE_STATE_KEY} annotation cannot be read: {why}; check that its gpushared \
                 runs the same gpushare version as this tool (journalctl -u gpushared on the node)"
            );
        }
        if report.nodes.is_empty() {
            if nodes.items.iter().any(|n| n.name() == node) {
                anyhow::bail!(
                    "node {node:?} is not a gpushare node (no {NODE_STATE_KEY} annotation: is gpushared running there?)"
                );
            }
            anyhow::bail!("node {node:?} does not exist (kubectl get nodes lists the cluster's nodes)");
        }
    }
    let mut out = match (cli.output, cli.details) {
        (Output::Json, _) => serde_json::to_string_pretty(&report).context("encoding the report")? + "\n",
        (Output::Table, true) => report.details(),
        (Output::Table, false) => report.summary(),
    };
    if cli.output == Output::Table {
        for n in report.nodes.iter().filter(|n| n.stale) {
            out.push_str(&format!(
                "\nnode {}: its gpushared has not renewed its heartbeat for {} s; no new pod is placed there \
                 (is gpushared running? systemctl status gpushared on the node)\n",
                n.name,
                n.heartbeat_age_seconds.unwrap_or(0)
            ));
        }
        for (node, why) in &report.unreadable {
            out.push_str(&format!("\nnode {node}: its {NODE_STATE_KEY} annotation is unreadable: {why}\n"));
        }
    }
    Ok(out)
}
