//! `gpusharectl`, the operator's command line over gpushared's D-Bus status API ([`crate::dbus`],
//! `docs/gpusharectl.md`). The binary (`src/bin/gpusharectl.rs`) only parses, connects, prints
//! and exits; everything else is here so tests can reach it:
//!
//! - the clap definition [`Cli`], from which the man page ([`man_page`]) and the shell
//!   completions ([`completions`]) are generated;
//! - [`connect`] and [`execute`]: one request against a [`Gpushare1Proxy`], answered as the text
//!   to print;
//! - the text and JSON shapes of each answer ([`render_table`], [`gpus_text`], [`gpus_json`], …);
//! - times: [`format_ms`] (RFC 3339 UTC, from the core's `time`) and [`parse_since`];
//! - exit statuses: [`classify`] turns a D-Bus failure into a [`Failure`], which knows its exit
//!   code and its one-line message.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::{CommandFactory as _, Parser, Subcommand, ValueEnum};
pub use gpushare_core::time::format_ms;
use gpushare_core::time::parse_rfc3339;
use serde_json::{Value, json};
use zbus::DBusError as _;
use zbus::fdo;

use crate::config::Bus;
use crate::dbus::{
    ActivityRecord, AllocationRecord, BUS_NAME, GpuRecord, Gpushare1Proxy, HistoryRecord, OverBudgetRecord,
};

/// Exit status: the daemon refused the request (a D-Bus error reply such as an unknown GPU).
pub const EXIT_REFUSED: u8 = 1;
/// Exit status: a usage error (clap's own).
pub const EXIT_USAGE: u8 = 2;
/// Exit status `EX_UNAVAILABLE`: gpushared cannot be reached (not running, API off, no bus).
pub const EXIT_UNAVAILABLE: u8 = 69;
/// Exit status `EX_NOPERM`: the bus's policy refused the call.
pub const EXIT_NOPERM: u8 = 77;

/// How long one call may wait for gpushared's answer.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How far back `history` looks without `--since`, in ms.
pub const DEFAULT_HISTORY_MS: i64 = 3_600_000;

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
  77  the bus's policy denied the call, e.g. cordon by a user other than root (EX_NOPERM)";

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
The bus's policy denied the call, e.g. \fBcordon\fR by a user other than root.
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

/// Connects to `bus` and returns a proxy for gpushared's object that caches nothing (every
/// property read is a call, so its errors are the daemon's or the bus's).
///
/// # Errors
///
/// When the bus cannot be reached; see [`classify`].
pub async fn connect(bus: &Bus) -> zbus::Result<Gpushare1Proxy<'static>> {
    let builder = match bus {
        Bus::System => zbus::connection::Builder::system(),
        Bus::Address(a) => zbus::connection::Builder::address(a.as_str()),
    };
    let conn = builder.method_timeout(CALL_TIMEOUT).build().await?;
    Gpushare1Proxy::builder(&conn).cache_properties(zbus::proxy::CacheProperties::No).build().await
}

/// What `status` shows, read from gpushared's properties.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// The node's name in Kubernetes.
    pub node: String,
    /// gpushared's version.
    pub version: String,
    /// `MiB` or `GiB`.
    pub unit: String,
    /// The GPUs.
    pub gpus: Vec<GpuRecord>,
    /// Live allocations.
    pub allocations: u32,
    /// Containers over their budget.
    pub over_budget: usize,
}

/// Performs `request` against `proxy` and returns what to print (ending in a newline): text, or
/// JSON when `json`. `now_ms` is the default `history` start's reference.
///
/// # Errors
///
/// The D-Bus failure; [`classify`] says what it means.
pub async fn execute(proxy: &Gpushare1Proxy<'_>, request: &Request, json: bool, now_ms: i64) -> zbus::Result<String> {
    Ok(match request {
        Request::Status => {
            let (node, version, unit, gpus, allocations, over) = tokio::try_join!(
                proxy.node_name(),
                proxy.version(),
                proxy.unit(),
                proxy.gpus(),
                proxy.allocation_count(),
                proxy.over_budget()
            )?;
            let status = Status { node, version, unit, gpus, allocations, over_budget: over.len() };
            if json { pretty(&status_json(&status)) } else { status_text(&status) }
        }
        Request::Gpus => {
            let (gpus, activity) = tokio::try_join!(proxy.gpus(), proxy.gpu_activity())?;
            if json { pretty(&gpus_json(&gpus, &activity)) } else { gpus_text(&gpus, &activity) }
        }
        Request::Allocations { pod } => {
            let rows = proxy.list_allocations(pod.as_deref().unwrap_or("")).await?;
            if json { pretty(&allocations_json(&rows)) } else { allocations_text(&rows, pod.as_deref()) }
        }
        Request::History { since } => {
            let since = since.unwrap_or_else(|| now_ms.saturating_sub(DEFAULT_HISTORY_MS));
            let rows = proxy.history(since).await?;
            if json { pretty(&history_json(&rows)) } else { history_text(&rows, since) }
        }
        Request::OverBudget => {
            let rows = proxy.over_budget().await?;
            if json { pretty(&over_budget_json(&rows)) } else { over_budget_text(&rows) }
        }
        Request::Explain { pod } => {
            let text = proxy.explain(pod).await?;
            if json { pretty(&json!({ "pod": pod, "explanation": text })) } else { with_newline(text) }
        }
        Request::Cordon { gpu } => {
            let changed = proxy.cordon(gpu).await?;
            cordon_output(gpu, true, changed, json)
        }
        Request::Uncordon { gpu } => {
            let changed = proxy.uncordon(gpu).await?;
            cordon_output(gpu, false, changed, json)
        }
    })
}

/// JSON, indented, with a final newline.
fn pretty(v: &Value) -> String {
    format!("{v:#}\n")
}

fn with_newline(mut s: String) -> String {
    if !s.ends_with('\n') {
        s.push('\n');
    }
    s
}

/// The current time in Unix ms (0 before 1970, `i64::MAX` past year 292 million).
#[must_use]
pub fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

// ---------------------------------------------------------------------------------------------
// Tables and shapes

/// Renders rows under headers in left-aligned columns three spaces apart, each as wide as its
/// widest cell (counted in characters); the last column is not padded. Control characters in
/// cells (a newline in a detail) become spaces so every row stays one line. A row shorter than
/// the headers leaves its last columns empty; cells beyond the headers are dropped.
#[must_use]
pub fn render_table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let clean = |s: &str| s.replace(char::is_control, " ");
    let rows: Vec<Vec<String>> =
        rows.iter().map(|r| r.iter().take(headers.len()).map(|c| clean(c)).collect()).collect();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (i, w) in widths.iter().enumerate() {
            let cell = cells.next().unwrap_or("");
            text.push_str(cell);
            if i + 1 < widths.len() {
                text.extend(std::iter::repeat_n(' ', w.saturating_sub(cell.chars().count()) + 3));
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in &rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

/// Renders `key: value` lines with the values aligned.
fn key_values(pairs: &[(&str, String)]) -> String {
    let width = pairs.iter().map(|(k, _)| k.chars().count()).max().unwrap_or(0);
    let mut out = String::new();
    for (k, v) in pairs {
        let pad = width.saturating_sub(k.chars().count());
        out.push_str(k);
        out.push(':');
        out.extend(std::iter::repeat_n(' ', pad + 2));
        out.push_str(v);
        out.push('\n');
    }
    out
}

/// The GPU counts of `status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuCounts {
    /// All GPUs.
    pub total: usize,
    /// Healthy ones.
    pub healthy: usize,
    /// Unhealthy ones.
    pub unhealthy: usize,
    /// Cordoned ones (healthy or not).
    pub cordoned: usize,
    /// Total memory, MiB.
    pub total_mib: u64,
    /// Used memory, MiB.
    pub used_mib: u64,
}

/// Counts `gpus`.
#[must_use]
pub fn count_gpus(gpus: &[GpuRecord]) -> GpuCounts {
    let mut c = GpuCounts::default();
    for g in gpus {
        c.total += 1;
        if g.5 == "Healthy" {
            c.healthy += 1;
        } else {
            c.unhealthy += 1;
        }
        if g.7 {
            c.cordoned += 1;
        }
        c.total_mib = c.total_mib.saturating_add(g.3);
        c.used_mib = c.used_mib.saturating_add(g.4);
    }
    c
}

/// `status` as `key: value` lines.
#[must_use]
pub fn status_text(s: &Status) -> String {
    let c = count_gpus(&s.gpus);
    key_values(&[
        ("node", s.node.clone()),
        ("version", s.version.clone()),
        ("unit", s.unit.clone()),
        ("gpus", format!("{} ({} healthy, {} unhealthy, {} cordoned)", c.total, c.healthy, c.unhealthy, c.cordoned)),
        (
            "memory",
            format!(
                "{} MiB used of {} MiB ({} MiB free)",
                c.used_mib,
                c.total_mib,
                c.total_mib.saturating_sub(c.used_mib)
            ),
        ),
        ("allocations", s.allocations.to_string()),
        ("over budget", format!("{} containers", s.over_budget)),
    ])
}

/// `status` as a JSON object: `node`, `version`, `unit`, `gpus` {`total`, `healthy`,
/// `unhealthy`, `cordoned`}, `totalMiB`, `usedMiB`, `freeMiB`, `allocations`.
#[must_use]
pub fn status_json(s: &Status) -> Value {
    let c = count_gpus(&s.gpus);
    json!({
        "node": s.node,
        "version": s.version,
        "unit": s.unit,
        "gpus": { "total": c.total, "healthy": c.healthy, "unhealthy": c.unhealthy, "cordoned": c.cordoned },
        "totalMiB": c.total_mib,
        "usedMiB": c.used_mib,
        "freeMiB": c.total_mib.saturating_sub(c.used_mib),
        "allocations": s.allocations,
        "overBudget": s.over_budget,
    })
}

fn sorted_gpus(gpus: &[GpuRecord]) -> Vec<&GpuRecord> {
    let mut sorted: Vec<&GpuRecord> = gpus.iter().collect();
    sorted.sort_by_key(|g| g.0);
    sorted
}

/// The health column: `Healthy`, or `Unhealthy (REASON)` when there is a reason.
fn health_cell(health: &str, reason: &str) -> String {
    if reason.is_empty() { health.to_owned() } else { format!("{health} ({reason})") }
}

/// A GPU's mode, utilisation (`None`: not reported) and memory in use (`None`: not sampled).
fn activity_of(activity: &[ActivityRecord], index: u32) -> (String, Option<i32>, Option<i64>) {
    activity.iter().find(|a| a.0 == index).map_or_else(
        || ("shared".to_owned(), None, None),
        |(_, mode, util, in_use)| (mode.clone(), (*util >= 0).then_some(*util), (*in_use >= 0).then_some(*in_use)),
    )
}

/// `gpus` as a table sorted by index: INDEX UUID MODEL TOTAL(MiB) USED(MiB) FREE(MiB) MODE
/// UTIL(%) IN-USE(MiB) HEALTH CORDONED; `-` where NVML gave no figure.
#[must_use]
pub fn gpus_text(gpus: &[GpuRecord], activity: &[ActivityRecord]) -> String {
    if gpus.is_empty() {
        return "no GPUs\n".to_owned();
    }
    let dash = |v: Option<String>| v.unwrap_or_else(|| "-".to_owned());
    let rows: Vec<Vec<String>> = sorted_gpus(gpus)
        .into_iter()
        .map(|(index, uuid, model, total, used, health, reason, cordoned)| {
            let (mode, util, in_use) = activity_of(activity, *index);
            vec![
                index.to_string(),
                uuid.clone(),
                model.clone(),
                total.to_string(),
                used.to_string(),
                total.saturating_sub(*used).to_string(),
                mode,
                dash(util.map(|u| u.to_string())),
                dash(in_use.map(|m| m.to_string())),
                health_cell(health, reason),
                if *cordoned { "yes" } else { "no" }.to_owned(),
            ]
        })
        .collect();
    render_table(
        &[
            "INDEX",
            "UUID",
            "MODEL",
            "TOTAL(MiB)",
            "USED(MiB)",
            "FREE(MiB)",
            "MODE",
            "UTIL(%)",
            "IN-USE(MiB)",
            "HEALTH",
            "CORDONED",
        ],
        &rows,
    )
}

/// `gpus` as a JSON array sorted by index; each object has `index`, `uuid`, `model`,
/// `totalMiB`, `usedMiB`, `freeMiB`, `mode`, `utilPercent` and `inUseMiB` (`null` when NVML gave
/// no figure), `health`, `healthReason` (`null` when healthy) and `cordoned`.
#[must_use]
pub fn gpus_json(gpus: &[GpuRecord], activity: &[ActivityRecord]) -> Value {
    Value::Array(
        sorted_gpus(gpus)
            .into_iter()
            .map(|(index, uuid, model, total, used, health, reason, cordoned)| {
                let (mode, util, in_use) = activity_of(activity, *index);
                json!({
                    "mode": mode,
                    "utilPercent": util,
                    "inUseMiB": in_use,
                    "index": index,
                    "uuid": uuid,
                    "model": model,
                    "totalMiB": total,
                    "usedMiB": used,
                    "freeMiB": total.saturating_sub(*used),
                    "health": health,
                    "healthReason": if reason.is_empty() { Value::Null } else { Value::from(reason.as_str()) },
                    "cordoned": cordoned,
                })
            })
            .collect(),
    )
}

fn sorted_allocations(rows: &[AllocationRecord]) -> Vec<&AllocationRecord> {
    let mut sorted: Vec<&AllocationRecord> = rows.iter().collect();
    sorted.sort_by(|a, b| (&a.0, &a.1, a.8, &a.3, a.6).cmp(&(&b.0, &b.1, b.8, &b.3, b.6)));
    sorted
}

/// Live allocations as a table: NAMESPACE POD CONTAINER ROLE GPU MIB SINCE, by pod then time.
/// `pod` is the `--pod` filter, named when there is nothing.
#[must_use]
pub fn allocations_text(rows: &[AllocationRecord], pod: Option<&str>) -> String {
    if rows.is_empty() {
        return match pod {
            Some(p) if !p.is_empty() => format!("no live allocations of {p}\n"),
            _ => "no live allocations\n".to_owned(),
        };
    }
    let rows: Vec<Vec<String>> = sorted_allocations(rows)
        .into_iter()
        .map(|(ns, pod, _uid, container, role, _uuid, index, mib, at)| {
            vec![
                ns.clone(),
                pod.clone(),
                container.clone(),
                role.clone(),
                index.to_string(),
                mib.to_string(),
                format_ms(*at),
            ]
        })
        .collect();
    render_table(&["NAMESPACE", "POD", "CONTAINER", "ROLE", "GPU", "MIB", "SINCE"], &rows)
}

/// Live allocations as a JSON array; each object has `namespace`, `pod`, `podUid`,
/// `container`, `role`, `gpuIndex`, `gpuUuid`, `mib`, `allocatedAt` (RFC 3339) and
/// `allocatedAtMs` (Unix ms).
#[must_use]
pub fn allocations_json(rows: &[AllocationRecord]) -> Value {
    Value::Array(
        sorted_allocations(rows)
            .into_iter()
            .map(|(ns, pod, uid, container, role, uuid, index, mib, at)| {
                json!({
                    "namespace": ns,
                    "pod": pod,
                    "podUid": uid,
                    "container": container,
                    "role": role,
                    "gpuIndex": index,
                    "gpuUuid": uuid,
                    "mib": mib,
                    "allocatedAt": format_ms(*at),
                    "allocatedAtMs": at,
                })
            })
            .collect(),
    )
}

fn sorted_over_budget(rows: &[OverBudgetRecord]) -> Vec<&OverBudgetRecord> {
    let mut sorted: Vec<&OverBudgetRecord> = rows.iter().collect();
    sorted.sort_by(|a, b| (&a.0, &a.1, &a.3, a.4).cmp(&(&b.0, &b.1, &b.3, b.4)));
    sorted
}

/// The containers over budget as a table: NAMESPACE POD CONTAINER GPU IN-USE(MiB) BUDGET(MiB)
/// SINCE, by pod. A container not tied to one of the pod's containers shows `-`.
#[must_use]
pub fn over_budget_text(rows: &[OverBudgetRecord]) -> String {
    if rows.is_empty() {
        return "no container is over its budget\n".to_owned();
    }
    let rows: Vec<Vec<String>> = sorted_over_budget(rows)
        .into_iter()
        .map(|(ns, pod, _uid, container, gpu, in_use, budget, since)| {
            vec![
                ns.clone(),
                pod.clone(),
                if container.is_empty() { "-".to_owned() } else { container.clone() },
                gpu.to_string(),
                in_use.to_string(),
                budget.to_string(),
                format_ms(*since),
            ]
        })
        .collect();
    render_table(&["NAMESPACE", "POD", "CONTAINER", "GPU", "IN-USE(MiB)", "BUDGET(MiB)", "SINCE"], &rows)
}

/// The containers over budget as a JSON array; each object has `namespace`, `pod`, `podUid`,
/// `container` (`null` when not tied to one), `gpuIndex`, `inUseMiB`, `budgetMiB`, `since`
/// (RFC 3339) and `sinceMs`.
#[must_use]
pub fn over_budget_json(rows: &[OverBudgetRecord]) -> Value {
    Value::Array(
        sorted_over_budget(rows)
            .into_iter()
            .map(|(ns, pod, uid, container, gpu, in_use, budget, since)| {
                json!({
                    "namespace": ns,
                    "pod": pod,
                    "podUid": uid,
                    "container": if container.is_empty() { Value::Null } else { Value::from(container.as_str()) },
                    "gpuIndex": gpu,
                    "inUseMiB": in_use,
                    "budgetMiB": budget,
                    "since": format_ms(*since),
                    "sinceMs": since,
                })
            })
            .collect(),
    )
}

/// History as a table, oldest first: TIME KIND DETAIL. `since` is named when there is nothing.
#[must_use]
pub fn history_text(rows: &[HistoryRecord], since: i64) -> String {
    if rows.is_empty() {
        return format!("nothing since {}\n", format_ms(since));
    }
    let rows: Vec<Vec<String>> =
        rows.iter().map(|(at, kind, detail)| vec![format_ms(*at), kind.clone(), detail.clone()]).collect();
    render_table(&["TIME", "KIND", "DETAIL"], &rows)
}

/// History as a JSON array, oldest first; each object has `time` (RFC 3339), `timeMs` (Unix
/// ms), `kind` and `detail`.
#[must_use]
pub fn history_json(rows: &[HistoryRecord]) -> Value {
    Value::Array(
        rows.iter()
            .map(|(at, kind, detail)| json!({ "time": format_ms(*at), "timeMs": at, "kind": kind, "detail": detail }))
            .collect(),
    )
}

/// What `cordon` (`cordon` true) or `uncordon` prints for `gpu`, given whether anything changed:
/// `GPU 1 cordoned`, `GPU 1 was already cordoned`, `GPU 1 uncordoned`, `GPU 1 was not
/// cordoned`; or `{"gpu": "1", "cordoned": true, "changed": true}`.
#[must_use]
pub fn cordon_output(gpu: &str, cordon: bool, changed: bool, json: bool) -> String {
    if json {
        return pretty(&json!({ "gpu": gpu, "cordoned": cordon, "changed": changed }));
    }
    match (cordon, changed) {
        (true, true) => format!("GPU {gpu} cordoned\n"),
        (true, false) => format!("GPU {gpu} was already cordoned\n"),
        (false, true) => format!("GPU {gpu} uncordoned\n"),
        (false, false) => format!("GPU {gpu} was not cordoned\n"),
    }
}

// ---------------------------------------------------------------------------------------------
// Times

const SINCE_FORMS: &str = "write an RFC 3339 time (2026-11-23T10:00:00Z), a Unix time in ms (1763892000000), or a duration ago (30s, 10m, 2h, 1d)";

/// The Unix ms `--since` means, `now_ms` being now: an RFC 3339 time (`2026-11-23T10:00:00Z`,
/// with optional fractional seconds and a `Z` or `±HH:MM` offset), a Unix time in ms (all
/// digits), or a duration ago (`30s`, `10m`, `2h`, `1d`).
///
/// # Errors
///
/// A message naming the input and the forms accepted.
pub fn parse_since(s: &str, now_ms: i64) -> Result<i64, String> {
    let t = s.trim();
    if t.is_empty() {
        return Err(format!("an empty time; {SINCE_FORMS}"));
    }
    if t.bytes().all(|b| b.is_ascii_digit()) {
        return t.parse::<i64>().map_err(|_| format!("{t} is too large for a Unix time in ms"));
    }
    let per = match t.chars().last() {
        Some('s') => 1000,
        Some('m') => 60_000,
        Some('h') => 3_600_000,
        Some('d') => 86_400_000,
        _ => 0,
    };
    if let Some(digits) = t.get(..t.len() - 1)
        && per > 0
        && !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
    {
        return digits
            .parse::<i64>()
            .ok()
            .and_then(|n| n.checked_mul(per))
            .and_then(|ago| now_ms.checked_sub(ago))
            .ok_or_else(|| format!("{t} is too long ago"));
    }
    if t.len() >= 5 && t.as_bytes().get(4) == Some(&b'-') && t.bytes().take(4).all(|b| b.is_ascii_digit()) {
        return parse_rfc3339(t).ok_or_else(|| {
            format!("{t:?} is not an RFC 3339 time or has no such date or time; write one such as 2026-11-23T10:00:00Z")
        });
    }
    Err(format!("{t:?} is not a time; {SINCE_FORMS}"))
}

// ---------------------------------------------------------------------------------------------
// Failures and exit statuses

/// Why a request to gpushared failed, as the exit status tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The bus cannot be reached: no socket, a refused connection, a failed handshake, a
    /// connection lost (exit 69).
    NoBus(String),
    /// The bus is there but nobody owns `io.gpushare.GpuShare1`: gpushared is not running, or
    /// runs with `[dbus] enabled = false` or on another bus (exit 69).
    NotRunning,
    /// gpushared took the call but did not answer in time (exit 69).
    NoAnswer(String),
    /// The bus's policy refused the call (exit 77).
    PermissionDenied(String),
    /// gpushared answered with an error: an unknown GPU, a malformed pod name, a ledger it
    /// cannot read; or an answer gpusharectl does not understand (exit 1).
    Refused(String),
}

/// What a D-Bus failure means for the user, the exit status included.
#[must_use]
pub fn classify(e: &zbus::Error) -> Failure {
    match e {
        zbus::Error::FDO(f) => classify_fdo(f),
        zbus::Error::Connection(io, _) | zbus::Error::InputOutput(io) => match io.kind() {
            std::io::ErrorKind::PermissionDenied => Failure::PermissionDenied(e.to_string()),
            std::io::ErrorKind::TimedOut => Failure::NoAnswer(e.to_string()),
            _ => Failure::NoBus(e.to_string()),
        },
        zbus::Error::Handshake(_) | zbus::Error::Address(_) | zbus::Error::Unsupported => Failure::NoBus(e.to_string()),
        zbus::Error::MethodError(name, detail, _) => {
            Failure::Refused(detail.as_ref().map_or_else(|| name.to_string(), |d| format!("{d} ({name})")))
        }
        zbus::Error::DBus(d) => Failure::Refused(d.description().map_or_else(|| d.to_string(), str::to_owned)),
        other => Failure::Refused(format!("unexpected answer from gpushared: {other}")),
    }
}

fn classify_fdo(f: &fdo::Error) -> Failure {
    let detail = || f.description().map_or_else(|| f.to_string(), str::to_owned);
    match f {
        fdo::Error::ZBus(e) => classify(e),
        fdo::Error::ServiceUnknown(_) | fdo::Error::NameHasNoOwner(_) => Failure::NotRunning,
        fdo::Error::AccessDenied(_) | fdo::Error::AuthFailed(_) => Failure::PermissionDenied(detail()),
        fdo::Error::NoReply(_) | fdo::Error::Timeout(_) | fdo::Error::TimedOut(_) => Failure::NoAnswer(detail()),
        fdo::Error::NoServer(_)
        | fdo::Error::Disconnected(_)
        | fdo::Error::IOError(_)
        | fdo::Error::BadAddress(_)
        | fdo::Error::NoNetwork(_) => Failure::NoBus(detail()),
        fdo::Error::UnknownMethod(_)
        | fdo::Error::UnknownInterface(_)
        | fdo::Error::UnknownObject(_)
        | fdo::Error::UnknownProperty(_) => Failure::Refused(format!(
            "{} (is the owner of {BUS_NAME} a gpushared older than this gpusharectl?)",
            detail()
        )),
        _ => Failure::Refused(detail()),
    }
}

impl Failure {
    /// The exit status: 1, 69 or 77.
    #[must_use]
    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::NoBus(_) | Failure::NotRunning | Failure::NoAnswer(_) => EXIT_UNAVAILABLE,
            Failure::PermissionDenied(_) => EXIT_NOPERM,
            Failure::Refused(_) => EXIT_REFUSED,
        }
    }

    /// The one line to print after `gpusharectl: `, for `request` on `bus`.
    #[must_use]
    pub fn message(&self, bus: &Bus, request: &Request) -> String {
        match (self, bus) {
            (Failure::NotRunning, Bus::System) => format!(
                "gpushared is not running (no {BUS_NAME} on the system bus); start it with: systemctl start gpushared"
            ),
            (Failure::NotRunning, Bus::Address(a)) => format!(
                "gpushared is not running (no {BUS_NAME} on the bus at {a}); start it with [dbus] address = \"{a}\" in its configuration"
            ),
            (Failure::NoBus(d), Bus::System) => {
                format!("cannot reach gpushared: the system bus is not available ({d}); check: systemctl status dbus")
            }
            (Failure::NoBus(d), Bus::Address(_)) => format!("cannot reach gpushared: {d}"),
            (Failure::NoAnswer(d), _) => {
                format!("gpushared did not answer {} in time ({d}); check: journalctl -u gpushared", request.name())
            }
            (Failure::PermissionDenied(_), _) if request.changes() => format!(
                "permission denied: {} needs root (the D-Bus policy lets only root change gpushared)",
                request.name()
            ),
            (Failure::PermissionDenied(d), _) => format!("permission denied: the bus refused {} ({d})", request.name()),
            (Failure::Refused(m), _) => m.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn gpu(index: u32, total: u64, used: u64, reason: &str, cordoned: bool) -> GpuRecord {
        let health = if reason.is_empty() { "Healthy" } else { "Unhealthy" };
        (
            index,
            format!("GPU-{index:04}"),
            "NVIDIA A100-SXM4-80GB".to_owned(),
            total,
            used,
            health.to_owned(),
            reason.to_owned(),
            cordoned,
        )
    }

    fn strings(cells: &[&str]) -> Vec<String> {
        cells.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn table_columns_are_as_wide_as_their_widest_cell() {
        let out =
            render_table(&["A", "LONG HEADER", "C"], &[strings(&["xxxx", "y", "z"]), strings(&["1", "22", "333"])]);
        assert_eq!(out, "A      LONG HEADER   C\nxxxx   y             z\n1      22            333\n");
    }

    #[test]
    fn table_has_no_trailing_spaces_and_keeps_rows_on_one_line() {
        let out = render_table(&["A", "B"], &[strings(&["x", ""]), strings(&["two\nlines"])]);
        assert_eq!(out, "A           B\nx\ntwo lines\n");
        assert!(out.lines().all(|l| !l.ends_with(' ')));
    }

    #[test]
    fn table_counts_characters_not_bytes() {
        let out = render_table(&["N", "X"], &[strings(&["é", "1"]), strings(&["ab", "2"])]);
        assert_eq!(out, "N    X\né    1\nab   2\n");
    }

    #[test]
    fn gpus_table_is_sorted_aligned_and_shows_reasons() {
        let activity: Vec<ActivityRecord> = vec![(1, "whole".into(), 87, 40_960), (0, "shared".into(), -1, -1)];
        let out = gpus_text(&[gpu(1, 81_920, 20_480, "Xid 79", true), gpu(0, 81_920, 0, "", false)], &activity);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("INDEX   UUID       MODEL"), "{out}");
        assert!(lines[1].starts_with("0       GPU-0000"), "{out}");
        assert!(lines[2].contains("Unhealthy (Xid 79)"), "{out}");
        assert!(lines[2].ends_with("yes"), "{out}");
        assert!(lines[2].contains("81920        20480       61440       whole    87        40960         "), "{out}");
        assert!(lines[1].contains("81920        0           81920       shared   -         -             "), "{out}");
        // Every column starts at the same offset on every line.
        let col = lines[0].find("HEALTH").unwrap();
        assert_eq!(lines[1].find("Healthy"), Some(col));
        assert_eq!(lines[2].find("Unhealthy"), Some(col));
    }

    #[test]
    fn gpus_json_has_camel_case_keys_and_null_reason_when_healthy() {
        let v = gpus_json(&[gpu(1, 100, 150, "Xid 79", true), gpu(0, 100, 40, "", false)], &[(1, "mps".into(), 5, 90)]);
        assert_eq!(
            v[0],
            json!({"index": 0, "uuid": "GPU-0000", "model": "NVIDIA A100-SXM4-80GB", "totalMiB": 100, "usedMiB": 40,
                   "freeMiB": 60, "health": "Healthy", "healthReason": null, "cordoned": false,
                   "mode": "shared", "utilPercent": null, "inUseMiB": null})
        );
        assert_eq!(v[1]["healthReason"], "Xid 79");
        assert_eq!((&v[1]["mode"], &v[1]["utilPercent"], &v[1]["inUseMiB"]), (&json!("mps"), &json!(5), &json!(90)));
        assert_eq!(v[1]["freeMiB"], 0, "used over total saturates");
    }

    #[test]
    fn status_counts_gpus() {
        let s = Status {
            node: "n1".into(),
            version: "0.1.0".into(),
            unit: "MiB".into(),
            gpus: vec![gpu(0, 100, 10, "", true), gpu(1, 100, 20, "Xid 79", false)],
            allocations: 3,
            over_budget: 1,
        };
        let text = status_text(&s);
        assert!(text.ends_with("over budget:  1 containers\n"), "{text}");
        assert!(text.contains("gpus:         2 (1 healthy, 1 unhealthy, 1 cordoned)\n"), "{text}");
        assert!(text.contains("memory:       30 MiB used of 200 MiB (170 MiB free)\n"), "{text}");
        assert!(text.starts_with("node:         n1\n"), "{text}");
        let v = status_json(&s);
        assert_eq!(v["gpus"], json!({"total": 2, "healthy": 1, "unhealthy": 1, "cordoned": 1}));
        assert_eq!(v["allocations"], 3);
        assert_eq!(v["overBudget"], 1);
        assert_eq!(v["freeMiB"], 170);
    }

    #[test]
    fn over_budget_table_and_json() {
        assert_eq!(over_budget_text(&[]), "no container is over its budget\n");
        let rows: Vec<OverBudgetRecord> = vec![
            ("ml".into(), "train".into(), "u2".into(), "main".into(), 1, 5200, 4096, 1_763_892_000_000),
            ("default".into(), "rogue".into(), "u1".into(), String::new(), 0, 800, 0, 1_763_892_060_000),
        ];
        assert_eq!(
            over_budget_text(&rows),
            "NAMESPACE   POD     CONTAINER   GPU   IN-USE(MiB)   BUDGET(MiB)   SINCE\n\
             default     rogue   -           0     800           0             2025-11-23T10:01:00Z\n\
             ml          train   main        1     5200          4096          2025-11-23T10:00:00Z\n"
        );
        let v = over_budget_json(&rows);
        assert_eq!(v[0]["container"], Value::Null);
        assert_eq!(v[1]["container"], "main");
        assert_eq!(v[1]["inUseMiB"], 5200);
        assert_eq!(v[1]["sinceMs"], 1_763_892_000_000_i64);
    }

    #[test]
    fn allocations_table_and_json() {
        let row: AllocationRecord = (
            "default".into(),
            "infer-1".into(),
            "uid-1".into(),
            "main".into(),
            "app".into(),
            "GPU-0001".into(),
            1,
            4096,
            1_763_892_000_000,
        );
        let out = allocations_text(std::slice::from_ref(&row), None);
        assert_eq!(
            out,
            "NAMESPACE   POD       CONTAINER   ROLE   GPU   MIB    SINCE\n\
             default     infer-1   main        app    1     4096   2025-11-23T10:00:00Z\n"
        );
        let v = allocations_json(&[row]);
        assert_eq!(v[0]["podUid"], "uid-1");
        assert_eq!(v[0]["gpuIndex"], 1);
        assert_eq!(v[0]["allocatedAt"], "2025-11-23T10:00:00Z");
        assert_eq!(v[0]["allocatedAtMs"], 1_763_892_000_000_i64);
        assert_eq!(allocations_text(&[], Some("default/x")), "no live allocations of default/x\n");
    }

    #[test]
    fn history_table_and_json() {
        let rows: Vec<HistoryRecord> = vec![(0, "cordon".into(), "GPU 1".into())];
        assert_eq!(
            history_text(&rows, 0),
            "TIME                   KIND     DETAIL\n1970-01-01T00:00:00Z   cordon   GPU 1\n"
        );
        assert_eq!(history_text(&[], 0), "nothing since 1970-01-01T00:00:00Z\n");
        assert_eq!(
            history_json(&rows)[0],
            json!({"time": "1970-01-01T00:00:00Z", "timeMs": 0, "kind": "cordon", "detail": "GPU 1"})
        );
    }

    #[test]
    fn cordon_messages() {
        assert_eq!(cordon_output("1", true, true, false), "GPU 1 cordoned\n");
        assert_eq!(cordon_output("1", true, false, false), "GPU 1 was already cordoned\n");
        assert_eq!(cordon_output("1", false, true, false), "GPU 1 uncordoned\n");
        assert_eq!(cordon_output("1", false, false, false), "GPU 1 was not cordoned\n");
        let v: Value = serde_json::from_str(&cordon_output("GPU-1", true, false, true)).unwrap();
        assert_eq!(v, json!({"gpu": "GPU-1", "cordoned": true, "changed": false}));
    }

    #[test]
    fn formats_rfc3339_utc() {
        assert_eq!(format_ms(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_ms(1_763_892_000_000), "2025-11-23T10:00:00Z");
        assert_eq!(format_ms(1_763_892_000_999), "2025-11-23T10:00:00Z");
        assert_eq!(format_ms(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(format_ms(4_107_542_399_000), "2100-02-28T23:59:59Z");
        assert_eq!(format_ms(-1), "1969-12-31T23:59:59Z");
        // No panic at the ends of the range.
        assert!(!format_ms(i64::MAX).is_empty());
        assert!(!format_ms(i64::MIN).is_empty());
    }

    const NOW: i64 = 1_763_892_000_000;

    #[test]
    fn parses_rfc3339() {
        assert_eq!(parse_since("2025-11-23T10:00:00Z", NOW), Ok(NOW));
        assert_eq!(parse_since(" 1970-01-01T00:00:00Z ", NOW), Ok(0));
        assert_eq!(parse_since("2025-11-23t10:00:00.5z", NOW), Ok(NOW + 500));
        assert_eq!(parse_since("2025-11-23T10:00:00.123456Z", NOW), Ok(NOW + 123));
        assert_eq!(parse_since("2025-11-23T11:30:00+01:30", NOW), Ok(NOW));
        assert_eq!(parse_since("2025-11-23T08:00:00-02:00", NOW), Ok(NOW));
        assert_eq!(parse_since("2024-02-29T00:00:00Z", NOW), Ok(1_709_164_800_000));
    }

    #[test]
    fn parses_unix_ms_and_durations() {
        assert_eq!(parse_since("1763892000000", 0), Ok(NOW));
        assert_eq!(parse_since("0", NOW), Ok(0));
        assert_eq!(parse_since("30s", NOW), Ok(NOW - 30_000));
        assert_eq!(parse_since("10m", NOW), Ok(NOW - 600_000));
        assert_eq!(parse_since("2h", NOW), Ok(NOW - 7_200_000));
        assert_eq!(parse_since("1d", NOW), Ok(NOW - 86_400_000));
        assert_eq!(parse_since("0s", NOW), Ok(NOW));
    }

    #[test]
    fn refuses_what_is_not_a_time() {
        for bad in [
            "",
            "   ",
            "yesterday",
            "10x",
            "-5m",
            "m",
            "1.5h",
            "10 m",
            "99999999999999999999",
            "99999999999999999999d",
            "2025-13-01T00:00:00Z",
            "2025-02-29T00:00:00Z",
            "2025-11-31T00:00:00Z",
            "2025-11-23T24:00:00Z",
            "2025-11-23T10:60:00Z",
            "2025-11-23T10:00:00",
            "2025-11-23T10:00:00.Z",
            "2025-11-23T10:00:00+1:00",
            "2025-11-23",
            "2025-11-23T10:00:00Zjunk",
            "2025-11-23T10:00:00\u{e9}",
            "2025-\u{e9}1-23T10:00:00Z",
        ] {
            let e = parse_since(bad, NOW).expect_err(bad);
            assert!(!e.is_empty());
        }
        assert!(parse_since("yesterday", NOW).unwrap_err().contains("RFC 3339"));
        assert!(parse_since("99999999999999999999d", NOW).unwrap_err().contains("too long ago"));
        assert!(parse_since("2025-13-01T00:00:00Z", NOW).unwrap_err().contains("no such date"));
    }

    fn fdo_error(e: fdo::Error) -> zbus::Error {
        zbus::Error::from(e)
    }

    #[test]
    fn classifies_a_missing_daemon() {
        for e in [
            fdo_error(fdo::Error::ServiceUnknown("The name is not activatable".into())),
            fdo_error(fdo::Error::NameHasNoOwner("no owner".into())),
        ] {
            let f = classify(&e);
            assert_eq!(f, Failure::NotRunning);
            assert_eq!(f.exit_code(), 69);
            assert_eq!(
                f.message(&Bus::System, &Request::Status),
                "gpushared is not running (no io.gpushare.GpuShare1 on the system bus); start it with: systemctl start gpushared"
            );
            assert!(
                f.message(&Bus::Address("unix:path=/tmp/x/bus".into()), &Request::Gpus)
                    .contains("unix:path=/tmp/x/bus")
            );
        }
    }

    #[test]
    fn classifies_an_unreachable_bus() {
        let address: zbus::Address = "unix:path=/nonexistent/bus".parse().unwrap();
        let e = zbus::Error::Connection(Arc::new(std::io::ErrorKind::NotFound.into()), Box::new(address));
        let f = classify(&e);
        assert!(matches!(f, Failure::NoBus(_)), "{f:?}");
        assert_eq!(f.exit_code(), 69);
        let e = zbus::Error::InputOutput(Arc::new(std::io::ErrorKind::TimedOut.into()));
        assert!(matches!(classify(&e), Failure::NoAnswer(_)));
        assert_eq!(classify(&fdo_error(fdo::Error::NoReply("late".into()))).exit_code(), 69);
        assert_eq!(classify(&fdo_error(fdo::Error::Disconnected("gone".into()))).exit_code(), 69);
    }

    #[test]
    fn classifies_access_denied() {
        let e = fdo_error(fdo::Error::AccessDenied("Rejected send message".into()));
        let f = classify(&e);
        assert_eq!(f, Failure::PermissionDenied("Rejected send message".into()));
        assert_eq!(f.exit_code(), 77);
        assert_eq!(
            f.message(&Bus::System, &Request::Cordon { gpu: "1".into() }),
            "permission denied: cordon needs root (the D-Bus policy lets only root change gpushared)"
        );
        assert!(f.message(&Bus::System, &Request::Status).contains("status"));
        let e = zbus::Error::InputOutput(Arc::new(std::io::ErrorKind::PermissionDenied.into()));
        assert_eq!(classify(&e).exit_code(), 77);
    }

    #[test]
    fn classifies_other_errors_as_refusals() {
        let e = fdo_error(fdo::Error::InvalidArgs("\"7\" is not a GPU on this node".into()));
        let f = classify(&e);
        assert_eq!(f, Failure::Refused("\"7\" is not a GPU on this node".into()));
        assert_eq!(f.exit_code(), 1);
        assert_eq!(f.message(&Bus::System, &Request::Cordon { gpu: "7".into() }), "\"7\" is not a GPU on this node");
        assert_eq!(classify(&fdo_error(fdo::Error::Failed("ledger".into()))).exit_code(), 1);
        let f = classify(&fdo_error(fdo::Error::UnknownMethod("no Explain".into())));
        assert_eq!(f.exit_code(), 1);
        assert!(f.message(&Bus::System, &Request::Status).contains("older"));
        assert_eq!(classify(&zbus::Error::InvalidReply).exit_code(), 1);
        // An fdo::Error wrapping a zbus::Error is classified by what it wraps.
        let wrapped = zbus::Error::FDO(Box::new(fdo::Error::ZBus(zbus::Error::FDO(Box::new(
            fdo::Error::ServiceUnknown(String::new()),
        )))));
        assert_eq!(classify(&wrapped), Failure::NotRunning);
    }

    #[test]
    fn cli_parses_globals_anywhere() {
        let cli = Cli::try_parse_from(["gpusharectl", "gpus", "--json", "--address", "unix:path=/tmp/x/bus"]).unwrap();
        assert!(cli.json);
        assert_eq!(cli.bus(), Bus::Address("unix:path=/tmp/x/bus".into()));
        assert_eq!(cli.command, Command::Request(Request::Gpus));
        let cli = Cli::try_parse_from(["gpusharectl", "--json", "history", "--since", "1763892000000"]).unwrap();
        assert_eq!(cli.command, Command::Request(Request::History { since: Some(NOW) }));
        assert_eq!(cli.bus(), Bus::System);
        let cli = Cli::try_parse_from(["gpusharectl", "allocations", "--pod", "default/infer-1"]).unwrap();
        assert_eq!(cli.command, Command::Request(Request::Allocations { pod: Some("default/infer-1".into()) }));
    }

    #[test]
    fn cli_usage_errors() {
        for args in [
            &["gpusharectl"][..],
            &["gpusharectl", "history", "--since", "soon"],
            &["gpusharectl", "--address", "nonsense", "status"],
            &["gpusharectl", "cordon"],
            &["gpusharectl", "generate", "completions", "powershell"],
        ] {
            let e = Cli::try_parse_from(args).unwrap_err();
            assert_eq!(e.exit_code(), i32::from(EXIT_USAGE), "{args:?}");
        }
    }

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    const SUBCOMMANDS: [&str; 7] = ["status", "gpus", "allocations", "history", "explain", "cordon", "uncordon"];

    #[test]
    fn man_page_describes_every_subcommand_and_the_exit_codes() {
        let page = String::from_utf8(man_page().unwrap()).unwrap();
        assert!(page.contains(".TH gpusharectl 1"), "roff");
        for sub in SUBCOMMANDS {
            assert!(page.contains(&format!("\\fBgpusharectl {sub}\\fR")), "{sub} missing from the man page");
        }
        assert!(page.contains(r"\fBgpusharectl allocations\fR [\fB\-\-pod\fR \fINS/NAME\fR]"), "{page}");
        assert!(page.contains(r"\fBgpusharectl explain\fR \fINS/NAME\fR"), "{page}");
        assert!(page.contains(r"\fBgpusharectl cordon\fR \fIGPU\fR"), "{page}");
        assert!(page.contains(".SH \"EXIT STATUS\"") && page.contains(r"\fB69\fR (EX_UNAVAILABLE)"));
        assert!(page.contains(r"\fB77\fR (EX_NOPERM)"));
        assert!(!page.contains("generate"), "the generate subcommand is hidden");
        assert!(!page.contains("gpusharectl\\-status(1)"), "no references to per-command pages");
        // No text line is read as a roff request.
        assert!(page.lines().all(|l| !l.starts_with('\'')));
    }

    #[test]
    fn roff_text_escapes() {
        assert_eq!(roff_text(".start\n'quote\na-b \\ c"), "\\&.start\n\\&'quote\na\\-b \\e c\n");
    }

    #[test]
    fn completions_are_generated() {
        let bash = String::from_utf8(completions(Shell::Bash)).unwrap();
        assert!(!bash.is_empty());
        assert!(bash.contains("gpusharectl") && bash.contains("uncordon"));
        assert!(!completions(Shell::Zsh).is_empty());
        assert!(!completions(Shell::Fish).is_empty());
    }
}
