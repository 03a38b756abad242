//! The `gpushared` command line: parse flags, load the configuration, run the daemon.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use gpushared::config::{Config, DEFAULT_PATH};

/// gpushare's node daemon: serves the kubelet's device plugin API for GPU memory.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// The configuration file (a missing file at the default path means all defaults).
    #[arg(long, value_name = "FILE", default_value = DEFAULT_PATH)]
    config: PathBuf,
    /// Check FILE and exit: 0 if gpushared would accept it, 1 with the reason if not.
    #[arg(long, value_name = "FILE")]
    check_config: Option<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(path) = cli.check_config {
        return match Config::load(&path, true) {
            Ok(_) => {
                println!("{}: ok", path.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("gpushared: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let must_exist = cli.config != std::path::Path::new(DEFAULT_PATH);
    if let Err(e) = Config::load(&cli.config, must_exist) {
        eprintln!("gpushared: {e}");
        return ExitCode::FAILURE;
    }
    eprintln!("gpushared: serving the kubelet is not in this build yet; only --check-config and --version work");
    ExitCode::FAILURE
}
