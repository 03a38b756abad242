//! `gpusharectl`: the operator's command line over gpushared's D-Bus status API
//! (`docs/gpusharectl.md`). It parses, connects, asks, prints and exits with a status that says
//! what happened; everything it shows is shaped in the `gpusharectl` library.

use std::io::Write as _;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser as _;
use gpusharectl::{self as ctl, Cli, Command, Generate, Request};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Generate { what } => generate(what),
        Command::Request(request) => return ask(&cli, request),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            say(&format!("gpusharectl: {e:#}"));
            ExitCode::from(ctl::EXIT_REFUSED)
        }
    }
}

/// Performs `request` and prints the answer, or one line saying why there is none.
fn ask(cli: &Cli, request: &Request) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            say(&format!("gpusharectl: starting the async runtime: {e}"));
            return ExitCode::FAILURE;
        }
    };
    let bus = cli.bus();
    let answer = runtime.block_on(async {
        let proxy = ctl::connect(&bus).await?;
        ctl::execute(&proxy, request, cli.json, ctl::now_ms()).await
    });
    match answer {
        Ok(text) => match print(text.as_bytes()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                say(&format!("gpusharectl: {e:#}"));
                ExitCode::FAILURE
            }
        },
        Err(e) => {
            let failure = ctl::classify(&e);
            say(&format!("gpusharectl: {}", failure.message(&bus, request)));
            ExitCode::from(failure.exit_code())
        }
    }
}

/// `generate man` and `generate completions`.
fn generate(what: &Generate) -> anyhow::Result<()> {
    match what {
        Generate::Man => print(&ctl::man_page().context("rendering the man page")?),
        Generate::Completions { shell } => print(&ctl::completions(*shell)),
    }
}

/// Writes to stdout; a closed pipe (`gpusharectl gpus | head -1`) is not an error.
fn print(bytes: &[u8]) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e).context("writing to stdout"),
        _ => Ok(()),
    }
}

/// Writes one line to stderr, ignoring a stderr that cannot be written.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}
