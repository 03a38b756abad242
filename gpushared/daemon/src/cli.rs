//! The `gpushared` command line, defined here rather than in the binary so that the packaging
//! tool (`gpushare-mangen`) generates the man page gpushared(8) from the very definition the
//! daemon parses.

use std::path::PathBuf;

use clap::Parser;

use crate::config::DEFAULT_PATH;

/// gpushare's node daemon: serves the kubelet's device plugin API for GPU memory.
#[derive(Parser, Debug)]
#[command(version)]
pub struct Cli {
    /// The configuration file (a missing file at the default path means all defaults).
    #[arg(long, value_name = "FILE", default_value = DEFAULT_PATH)]
    pub config: PathBuf,
    /// Check FILE and exit: 0 if gpushared would accept it, 1 with the reason if not.
    #[arg(long, value_name = "FILE")]
    pub check_config: Option<PathBuf>,
    /// Print the systemd drop-in that confines gpushared.service to the API server
    /// (`[kubernetes] confine_network` in --config) and exit: nothing when the setting is off; 1
    /// with the reason when the kubeconfig's server is not an address. The package's systemd
    /// generator runs it at boot and on daemon-reload.
    #[arg(long)]
    pub unit_drop_in: bool,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn config_defaults_to_the_shipped_path() {
        let cli = Cli::parse_from(["gpushared"]);
        assert_eq!(cli.config, std::path::Path::new(DEFAULT_PATH));
        assert_eq!(cli.check_config, None);
        assert!(!cli.unit_drop_in);
        assert_eq!(Cli::command().get_name(), "gpushared");
    }
}
