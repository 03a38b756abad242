//! The command lines of this crate's two binaries: [`ExtenderCli`] for `gpushare-extender`
//! (the scheduler extender and its `simulate` subcommand) and [`InspectCli`] for
//! `kubectl-inspect-gpushare`. They live in the library so that the packaging tool
//! (`gpushare-mangen`) generates the man pages gpushare-extender(8) and
//! kubectl-inspect-gpushare(1) from the very definitions the binaries parse.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use gpushare_core::placement::{GpuPolicy, NodePolicy};

use crate::config::DEFAULT_PATH;

/// gpushare's kube-scheduler extender: filter, prioritize, bind and preempt for pods that ask
/// for GPU memory. Without a subcommand it serves kube-scheduler.
#[derive(Parser, Debug)]
#[command(version)]
pub struct ExtenderCli {
    /// The configuration file (docs/extender.md).
    #[arg(long, value_name = "FILE", default_value = DEFAULT_PATH, global = true)]
    pub config: PathBuf,
    /// Validate FILE and exit: 0 if it is usable, 1 with the line and the fix if not.
    #[arg(long, value_name = "FILE")]
    pub check_config: Option<PathBuf>,
    /// Print the systemd drop-in that confines gpushare-extender.service to the API server,
    /// loopback and the configured callers (`[kubernetes] confine_network` in --config) and
    /// exit: nothing when the setting is off; 1 with the reason when the kubeconfig's server is
    /// not an address. The package's systemd generator runs it at boot and on daemon-reload.
    #[arg(long)]
    pub unit_drop_in: bool,
    /// What to run instead of serving kube-scheduler.
    #[command(subcommand)]
    pub command: Option<ExtenderCommand>,
}

/// A `gpushare-extender` subcommand.
#[derive(Subcommand, Debug)]
pub enum ExtenderCommand {
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

/// Shows the GPU memory allocated and free on each gpushare node.
#[derive(Parser, Debug)]
#[command(name = "kubectl-inspect-gpushare", version)]
pub struct InspectCli {
    /// Per pod, what it holds on each GPU.
    #[arg(short = 'd', long)]
    pub details: bool,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
    pub output: Output,
    /// Read Alibaba's resource names and count pods Alibaba's extender placed.
    #[arg(long)]
    pub alibaba: bool,
    /// Only this node.
    pub node: Option<String>,
}

/// What `kubectl-inspect-gpushare --output` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// The tables.
    Table,
    /// The report as JSON.
    Json,
}

/// Writes `text` to standard output. A reader that went away (`... | head`) is not an error:
/// the output was wanted only so far. Any other write error is returned.
///
/// # Errors
/// When standard output cannot be written for another reason (a full disk, say).
pub fn print_stdout(text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::*;

    #[test]
    fn cli_definitions_are_consistent() {
        ExtenderCli::command().debug_assert();
        InspectCli::command().debug_assert();
    }

    #[test]
    fn binary_names() {
        assert_eq!(ExtenderCli::command().get_name(), "gpushare-extender");
        assert_eq!(InspectCli::command().get_name(), "kubectl-inspect-gpushare");
    }

    #[test]
    fn each_binary_describes_itself() {
        // The doc comments, not the package's description (which names both binaries).
        let about = |c: clap::Command| c.get_about().map(ToString::to_string).unwrap_or_default();
        assert!(about(InspectCli::command()).starts_with("Shows the GPU memory"), "{}", about(InspectCli::command()));
        assert!(about(ExtenderCli::command()).starts_with("gpushare's kube-scheduler extender: filter"));
    }

    #[test]
    fn simulate_parses_its_policies() {
        let cli = ExtenderCli::parse_from([
            "gpushare-extender",
            "simulate",
            "--cluster",
            "c.yaml",
            "--workload",
            "w.yaml",
            "--gpu-policy",
            "spread",
        ]);
        assert_eq!(cli.config, std::path::Path::new(DEFAULT_PATH));
        let Some(ExtenderCommand::Simulate { gpu_policy, node_policy, alibaba, .. }) = cli.command else {
            panic!("simulate expected");
        };
        assert_eq!(gpu_policy, GpuPolicy::Spread);
        assert_eq!(node_policy, NodePolicy::Binpack);
        assert!(!alibaba);
        let err = ExtenderCli::try_parse_from([
            "gpushare-extender",
            "simulate",
            "--cluster",
            "c",
            "--workload",
            "w",
            "--node-policy",
            "bogus",
        ])
        .unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
    }

    #[test]
    fn inspect_defaults() {
        let cli = InspectCli::parse_from(["kubectl-inspect-gpushare"]);
        assert_eq!(cli.output, Output::Table);
        assert!(!cli.details && !cli.alibaba && cli.node.is_none());
        let cli = InspectCli::parse_from(["kubectl-inspect-gpushare", "-d", "-o", "json", "n1"]);
        assert_eq!(cli.output, Output::Json);
        assert!(cli.details);
        assert_eq!(cli.node.as_deref(), Some("n1"));
    }
}
