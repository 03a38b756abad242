//! `gpushare-extender`: the command line. Today it offers `simulate`, the offline run of the
//! extender's placement decisions over a cluster description and Pod manifests.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use gpushare_core::ResourceNames;
use gpushare_core::placement::{GpuPolicy, NodePolicy};
use gpushare_core::schedule::Policies;
use gpushare_extender::simulate::{Simulation, parse_cluster, parse_workload, run};

/// gpushare's kube-scheduler extender.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Place Pod manifests on a simulated cluster, as the extender would, and print the result.
    Simulate {
        /// The cluster description (YAML; see docs/simulate.md).
        #[arg(long, value_name = "FILE")]
        cluster: PathBuf,
        /// Pod manifests (multi-document YAML), placed in order.
        #[arg(long, value_name = "FILE")]
        workload: PathBuf,
        /// How GPUs are chosen within a node.
        #[arg(long, value_name = "POLICY", default_value = "binpack", value_parser = parse_gpu_policy)]
        gpu_policy: GpuPolicy,
        /// How nodes are ranked.
        #[arg(long, value_name = "POLICY", default_value = "binpack", value_parser = parse_node_policy)]
        node_policy: NodePolicy,
        /// Read Alibaba's resource names (aliyun.com/gpu-mem, aliyun.com/gpu-count).
        #[arg(long)]
        alibaba: bool,
        /// Also print the assignment annotation each placed pod would carry.
        #[arg(long)]
        show_annotations: bool,
    },
}

fn parse_gpu_policy(s: &str) -> Result<GpuPolicy, String> {
    s.parse().map_err(|e| format!("{e}"))
}

fn parse_node_policy(s: &str) -> Result<NodePolicy, String> {
    s.parse().map_err(|e| format!("{e}"))
}

fn main() -> ExitCode {
    match real_main() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpushare-extender: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn real_main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Simulate { cluster, workload, gpu_policy, node_policy, alibaba, show_annotations } => {
            let read =
                |path: &PathBuf| std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()));
            let spec = parse_cluster(&read(&cluster)?).with_context(|| format!("{}", cluster.display()))?;
            let pods = parse_workload(&read(&workload)?).with_context(|| format!("{}", workload.display()))?;
            let names = if alibaba { ResourceNames::alibaba() } else { ResourceNames::gpushare() };
            let policies = Policies { gpu: gpu_policy, node: node_policy };
            let mut sim = Simulation::new(&spec, names, policies).with_context(|| format!("{}", cluster.display()))?;
            println!(
                "Placing {} pods from {} on {} nodes (unit {}, GPU policy {}, node policy {})\n",
                pods.len(),
                workload.display(),
                spec.nodes.len(),
                spec.unit,
                policy_name(gpu_policy == GpuPolicy::Binpack),
                policy_name(node_policy == NodePolicy::Binpack),
            );
            print!("{}", run(&mut sim, &pods, show_annotations));
            Ok(())
        }
    }
}

fn policy_name(binpack: bool) -> &'static str {
    if binpack { "binpack" } else { "spread" }
}
