//! gpusharectl's command line: the clap definition [`Cli`], and the man page ([`man_page`]) and
//! shell completions ([`completions`]) generated from it.

use clap::{CommandFactory as _, Parser, Subcommand, ValueEnum};

use gpushared::config::Bus;

use crate::now_ms;
use crate::since::parse_since;

const ABOUT: &str = "Show and change what gpushared, the gpushare GPU-memory node daemon, is doing on this host";

/// The description, without the exit statuses (the man page has a section for them).
const DESCRIPTION: &str = "\
Shows and changes what gpushared, the gpushare GPU-memory node daemon, is doing on this host, \
through its D-Bus API (io.gpushare.GpuShare1 on the system bus). Anyone may read; only root may \
cordon or uncordon a GPU. --json prints any answer as JSON for scripts.";

const LONG_ABOUT: &str = "\
Shows and changes what gpushared, the gpushare GPU-memory node daemon, is doing on this host, \
through its D-Bus API (io.gpushare.GpuShare1 on the system bus). Anyone may read; only root may \
cordon or uncordon a GPU. --json prints any answer as JSON for scripts.

Exit status:
  0   success
  1   gpushared refused the request (an unknown GPU, a malformed pod name, a ledger it cannot read)
  2   usage error
  69  gpushared cannot be reached: it is not running, its D-Bus API is off, or the bus is down (EX_UNAVAILABLE)
  77  the bus's policy or gpushared denied the call, e.g. cordon by a user other than root (EX_NOPERM)";

/// gpusharectl's command line.
#[derive(Parser, Debug, Clone, PartialEq, Eq)]
#[command(name = "gpusharectl", version, about = ABOUT, long_about = LONG_ABOUT)]
pub struct Cli {
    /// The D-Bus address of gpushared's bus, such as unix:path=/run/gpushare/bus [default: the system bus]
    #[arg(long, global = true, value_name = "ADDR", value_parser = address_arg)]
    pub address: Option<String>,
    /// Print JSON instead of text
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// The bus `--address` names, or the system bus.
    #[must_use]
    pub fn bus(&self) -> Bus {
        self.address.as_ref().map_or(Bus::System, |a| Bus::Address(a.clone()))
    }
}

/// A subcommand: a request to gpushared, or the hidden `generate`.
#[derive(Subcommand, Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// A request to gpushared.
    #[command(flatten)]
    Request(Request),
    /// Generate the man page or shell completions (for packaging)
    #[command(hide = true)]
    Generate {
        /// What to generate.
        #[command(subcommand)]
        what: Generate,
    },
}

/// A request to gpushared over D-Bus.
#[derive(Subcommand, Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Node, version, unit, and the counts of GPUs and allocations
    Status,
    /// The GPUs: memory, health, cordons
    Gpus,
    /// The live allocations, all or of one pod
    Allocations {
        /// Only this pod's allocations
        #[arg(long, value_name = "NS/NAME")]
        pod: Option<String>,
    },
    /// The live DRA claims: which GPU each holds and how much
    Claims,
    /// Allocations, releases, health changes and cordons since a time (default: the last hour)
    History {
        /// An RFC 3339 time (2026-11-23T10:00:00Z), a Unix time in ms, or a duration ago (30s, 10m, 2h, 1d)
        #[arg(long, value_name = "T", value_parser = since_arg)]
        since: Option<i64>,
    },
    /// The containers whose processes use more GPU memory than their budget
    OverBudget,
    /// Where a pod's containers are on this node and why, or why the pod has nothing here
    Explain {
        /// The pod
        #[arg(value_name = "NS/NAME")]
        pod: String,
    },
    /// Take no new allocations on a GPU; its allocations stay (root only)
    Cordon {
        /// The GPU: its index or UUID
        #[arg(value_name = "GPU")]
        gpu: String,
    },
    /// Take allocations on a cordoned GPU again (root only)
    Uncordon {
        /// The GPU: its index or UUID
        #[arg(value_name = "GPU")]
        gpu: String,
    },
}

impl Request {
    /// The subcommand's name, as typed.
    #[must_use]
    pub fn name(&self) -> &'static str {
        match self {
            Request::Status => "status",
            Request::Gpus => "gpus",
            Request::Allocations { .. } => "allocations",
            Request::Claims => "claims",
            Request::History { .. } => "history",
            Request::OverBudget => "over-budget",
            Request::Explain { .. } => "explain",
            Request::Cordon { .. } => "cordon",
            Request::Uncordon { .. } => "uncordon",
        }
    }

    /// Whether the request changes gpushared (root only under the shipped policy).
    #[must_use]
    pub fn changes(&self) -> bool {
        matches!(self, Request::Cordon { .. } | Request::Uncordon { .. })
    }
}

/// What `generate` writes.
#[derive(Subcommand, Debug, Clone, PartialEq, Eq)]
pub enum Generate {
    /// The man page gpusharectl(1) on stdout, in roff
    Man,
    /// Shell completions on stdout
    Completions {
        /// The shell
        #[arg(value_enum)]
        shell: Shell,
    },
}

/// A shell `generate completions` writes for.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shell {
    /// bash
    Bash,
    /// zsh
    Zsh,
    /// fish
    Fish,
}

/// Checks `--address` while parsing, so a malformed one is a usage error.
fn address_arg(s: &str) -> Result<String, String> {
    s.parse::<zbus::Address>()
        .map(|_| s.to_owned())
        .map_err(|e| format!("not a D-Bus address ({e}); write one such as unix:path=/run/gpushare/bus"))
}

/// Resolves `--since` while parsing, against the clock.
fn since_arg(s: &str) -> Result<i64, String> {
    parse_since(s, now_ms())
}

/// The command as the man page and completions see it: no `help` subcommand.
fn documented_command() -> clap::Command {
    Cli::command().disable_help_subcommand(true)
}

/// `s` as roff text lines: backslashes and hyphens escaped, no line read as a request (the
/// packaging's man pages use it too).
#[must_use]
pub fn roff_text(s: &str) -> String {
    let mut out = String::new();
    for line in s.lines() {
        let line = line.replace('\\', "\\e").replace('-', "\\-");
        if line.starts_with(['.', '\'']) {
            out.push_str("\\&");
        }
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// How an argument is written in a synopsis, in roff: `\fINS/NAME\fR`, `[\fB\-\-pod\fR \fINS/NAME\fR]`.
fn roff_arg(arg: &clap::Arg) -> String {
    let value = arg
        .get_value_names()
        .and_then(<[clap::builder::Str]>::first)
        .map_or_else(|| arg.get_id().as_str().to_uppercase(), |v| v.as_str().to_owned());
    let value = value.replace('-', "\\-");
    match arg.get_long() {
        Some(long) if arg.is_required_set() => format!("\\fB\\-\\-{}\\fR \\fI{value}\\fR", long.replace('-', "\\-")),
        Some(long) => format!("[\\fB\\-\\-{}\\fR \\fI{value}\\fR]", long.replace('-', "\\-")),
        None if arg.is_required_set() => format!("\\fI{value}\\fR"),
        None => format!("[\\fI{value}\\fR]"),
    }
}

/// The COMMANDS section: each visible subcommand with its own arguments (the global ones are
/// under OPTIONS).
fn roff_commands(cmd: &clap::Command) -> String {
    let mut out = String::from(".SH COMMANDS\n");
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let args: Vec<&clap::Arg> = sub
            .get_arguments()
            .filter(|a| !a.is_hide_set() && !a.is_global_set() && !matches!(a.get_id().as_str(), "help" | "version"))
            .collect();
        out.push_str(".TP\n");
        out.push_str(&format!("\\fBgpusharectl {}\\fR", sub.get_name()));
        for a in &args {
            out.push(' ');
            out.push_str(&roff_arg(a));
        }
        out.push('\n');
        if let Some(about) = sub.get_long_about().or_else(|| sub.get_about()) {
            out.push_str(&roff_text(&about.to_string()));
        }
        if !args.is_empty() {
            out.push_str(".RS\n");
            for a in &args {
                out.push_str(".TP\n");
                out.push_str(roff_arg(a).trim_start_matches('[').trim_end_matches(']'));
                out.push('\n');
                if let Some(help) = a.get_long_help().or_else(|| a.get_help()) {
                    out.push_str(&roff_text(&help.to_string()));
                }
            }
            out.push_str(".RE\n");
        }
    }
    out
}

const ROFF_EXIT_STATUS: &str = r#".SH "EXIT STATUS"
.TP
\fB0\fR
Success.
.TP
\fB1\fR
gpushared refused the request: an unknown GPU, a malformed pod name, a ledger it cannot read.
.TP
\fB2\fR
A usage error.
.TP
\fB69\fR (EX_UNAVAILABLE)
gpushared cannot be reached: it is not running, its D\-Bus API is off ([dbus] enabled = false), or the bus is down.
.TP
\fB77\fR (EX_NOPERM)
The bus's policy or gpushared denied the call, e.g. \fBcordon\fR by a user other than root.
.SH ENVIRONMENT
.TP
\fBDBUS_SYSTEM_BUS_ADDRESS\fR
The system bus's address when \fB\-\-address\fR is not given (default unix:path=/var/run/dbus/system_bus_socket).
"#;

/// The man page `gpusharectl(1)`, in roff: one self-contained page with every command, the
/// exit statuses and the environment.
///
/// # Errors
///
/// Never in practice: rendering writes to memory.
pub fn man_page() -> std::io::Result<Vec<u8>> {
    let cmd = documented_command().long_about(DESCRIPTION);
    let page = clap_mangen::Man::new(cmd.clone())
        .source(format!("gpushare {}", env!("CARGO_PKG_VERSION")))
        .manual("gpushare manual");
    let mut out = Vec::new();
    page.render_title(&mut out)?;
    page.render_name_section(&mut out)?;
    page.render_synopsis_section(&mut out)?;
    page.render_description_section(&mut out)?;
    page.render_options_section(&mut out)?;
    out.extend_from_slice(roff_commands(&cmd).as_bytes());
    out.extend_from_slice(ROFF_EXIT_STATUS.as_bytes());
    page.render_version_section(&mut out)?;
    Ok(out)
}

/// The completion script for `shell`.
#[must_use]
pub fn completions(shell: Shell) -> Vec<u8> {
    let generator = match shell {
        Shell::Bash => clap_complete::Shell::Bash,
        Shell::Zsh => clap_complete::Shell::Zsh,
        Shell::Fish => clap_complete::Shell::Fish,
    };
    let mut out = Vec::new();
    clap_complete::generate(generator, &mut documented_command(), "gpusharectl", &mut out);
    out
}
