//! `gpusharectl`, the operator's command line over gpushared's D-Bus status API
//! (`gpushared::dbus`, `docs/gpusharectl.md`). The binary (`src/main.rs`) only parses,
//! connects, prints and exits; everything else is here so tests and the packaging tool can
//! reach it:
//!
//! - [`cli`]: the clap definition [`Cli`], from which the man page ([`man_page`]) and the shell
//!   completions ([`completions`]) are generated;
//! - [`connect`] and [`execute`]: one request against a [`Gpushare1Proxy`], answered as the text
//!   to print;
//! - [`claims`]: the DRA claims' table and JSON;
//! - [`render`]: the text and JSON shapes of each answer ([`render_table`], [`gpus_text`],
//!   [`gpus_json`], …);
//! - [`since`]: times: [`format_ms`] (RFC 3339 UTC, from the core's `time`) and [`parse_since`];
//! - [`failure`]: exit statuses: [`classify`] turns a D-Bus failure into a [`Failure`], which
//!   knows its exit code and its one-line message.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use gpushare_core::time::format_ms;
use gpushared::config::Bus;
use gpushared::dbus::{GpuRecord, Gpushare1Proxy};
use serde_json::{Value, json};

pub mod claims;
pub mod cli;
pub mod failure;
pub mod render;
pub mod since;

pub use cli::{Cli, Command, Generate, Request, Shell, completions, man_page, roff_text};
pub use failure::{EXIT_NOPERM, EXIT_REFUSED, EXIT_UNAVAILABLE, EXIT_USAGE, Failure, classify};
pub use render::*;
pub use since::parse_since;

/// How long one call may wait for gpushared's answer.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Lines asked for per `HistoryPage` call.
const HISTORY_PAGE: u32 = 2000;

/// How far back `history` looks without `--since`, in ms.
pub const DEFAULT_HISTORY_MS: i64 = 3_600_000;

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
        Request::Claims => {
            let rows = proxy.list_claims().await?;
            if json { pretty(&claims::claims_json(&rows)) } else { claims::claims_text(&rows) }
        }
        Request::History { since } => {
            let since = since.unwrap_or_else(|| now_ms.saturating_sub(DEFAULT_HISTORY_MS));
            // Page by page: the daemon answers at most a page per call.
            let mut rows = Vec::new();
            let mut cursor = String::new();
            loop {
                let (page, next) = proxy.history_page(since, &cursor, HISTORY_PAGE).await?;
                rows.extend(page);
                if next.is_empty() {
                    break;
                }
                cursor = next;
            }
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

#[cfg(test)]
mod tests;
