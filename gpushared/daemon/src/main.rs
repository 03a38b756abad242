//! The `gpushared` command line: parse flags, check a configuration, print the unit's drop-in
//! or load the configuration, and run the daemon ([`daemon`]) on a two-worker runtime.

mod daemon;

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;
use gpushared::cli::Cli;
use gpushared::config::{Config, DEFAULT_PATH};

fn main() -> ExitCode {
    // Before any thread starts: two allocator arenas keep the resident set small (memory.rs).
    gpushared::memory::limit_arenas(2);
    let cli = Cli::parse();
    if let Some(path) = cli.check_config {
        // The file, then every check the daemon runs with it on this host before it serves.
        let checked = Config::load(&path, true)
            .map_err(anyhow::Error::from)
            .and_then(|config| gpushared::startup::inspect_host(&config, &[]).map_err(anyhow::Error::from));
        return match checked {
            Ok(host) => {
                println!(
                    "{}: ok (node {}, {} GPUs from {})",
                    path.display(),
                    host.node,
                    host.inventory.gpus().len(),
                    host.source
                );
                // The check does not open the ledger: a GPU that does not answer is described
                // as if the ledger did not know it; the daemon serves it unhealthy if it does.
                for lost in &host.lost {
                    println!("note: {}", lost.describe());
                }
                for note in &host.notes {
                    println!("note: {note}");
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("gpushared: {}: {e:#}", path.display());
                ExitCode::FAILURE
            }
        };
    }
    let must_exist = cli.config != std::path::Path::new(DEFAULT_PATH);
    if cli.unit_drop_in {
        let made = Config::load(&cli.config, must_exist)
            .map_err(anyhow::Error::from)
            .and_then(|config| gpushared::cluster::confine::drop_in(&config).map_err(anyhow::Error::from));
        return match made {
            Ok(text) => {
                print!("{}", text.unwrap_or_default());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("gpushared: {}: {e:#}", cli.config.display());
                ExitCode::FAILURE
            }
        };
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = Config::load(&cli.config, must_exist).map_err(anyhow::Error::from).and_then(|config| {
        // Two workers whatever the host: the daemon's work is a few calls a second, and tokio's
        // default (one worker per core) would start 128 threads on a 128-core GPU host.
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("starting the async runtime")?
            .block_on(daemon::run(config))
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Once, on stderr (the journal under systemd): the log writes to stderr too.
            eprintln!("gpushared: {e:#}");
            ExitCode::FAILURE
        }
    }
}
