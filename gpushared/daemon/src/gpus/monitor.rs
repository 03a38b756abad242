//! Starting the watch over the node's GPUs: the health policy on NVML's events and probes, and
//! the over-use detector on the same NVML handle, each on a thread of its own. Without NVML (GPUs
//! from the static `[[gpus]]` list) neither runs, and the log says so.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use gpushare_core::NodeInventory;
use thiserror::Error;

use super::events::{GpuEventsError, NvmlEvents};
use super::{health, overuse};
use crate::allocation::allocator::Allocator;
use crate::allocation::pods::PodStore;
use crate::config::Config;

/// What the GPU monitors are started with.
#[derive(Debug)]
pub struct Monitor<'a> {
    /// Whether the GPUs come from NVML.
    pub nvml: bool,
    /// The configuration (`[nvml]`, `[health]`, `[overuse]`).
    pub config: &'a Config,
    /// The GPUs served.
    pub inventory: &'a NodeInventory,
    /// GPUs found unhealthy at start (index, reason): the policy starts them so.
    pub lost_at_start: Vec<(u32, String)>,
    /// The allocation service the monitors report to.
    pub alloc: &'a Arc<Allocator>,
    /// The pods bound here, for tying processes to containers.
    pub pods: &'a PodStore,
    /// Where the over-use detector sends the pods to evict.
    pub evictions: &'a tokio::sync::mpsc::UnboundedSender<overuse::Eviction>,
    /// Set to stop both threads.
    pub stop: &'a Arc<AtomicBool>,
}

/// Why the GPU monitors could not start.
#[derive(Debug, Error)]
pub enum MonitorError {
    /// NVML's events cannot be read.
    #[error(transparent)]
    Nvml(#[from] GpuEventsError),
    /// A thread could not be started.
    #[error("starting the GPU {what} thread: {source}")]
    Thread {
        /// Which.
        what: &'static str,
        /// Why.
        source: std::io::Error,
    },
}

/// Starts the health thread and, when `[overuse] enabled`, the over-use thread.
///
/// # Errors
/// [`MonitorError`]: NVML cannot be opened for events, or a thread cannot start.
pub fn start(m: &Monitor<'_>) -> Result<(), MonitorError> {
    if !m.nvml {
        tracing::warn!(
            "GPU health and over-use are not monitored: the GPUs come from the static [[gpus]] list, not NVML"
        );
        return Ok(());
    }
    let config = m.config;
    let events = NvmlEvents::open(&config.nvml.library)?;
    let policy = health::Policy::from(&config.health);
    tracing::info!(
        watched = ?events.watched(),
        ignored_xids = ?policy.ignored_xids,
        probe_interval = ?policy.probe_interval,
        recovery = ?policy.recovery,
        "watching GPU health"
    );
    let mut tracker = health::Tracker::new(policy, m.inventory.gpus().iter().map(|g| g.index));
    for (gpu, reason) in &m.lost_at_start {
        tracker.start_unhealthy(*gpu, reason.clone(), std::time::Instant::now());
    }
    // Over-use detection shares the health watcher's NVML handle.
    if config.overuse.enabled {
        let o = &config.overuse;
        tracing::info!(interval = ?o.interval_seconds.duration(), tolerance_mib = o.tolerance_mib,
            action = ?o.action, evict_after = ?o.evict_after_seconds.duration(),
            proc = %o.proc_directory.path().display(), "watching GPU processes against their containers' budgets");
        overuse::spawn(
            overuse::NvmlProcesses::new(events.nvml()),
            overuse::Detector::new(overuse::Policy::from(o)),
            Arc::clone(m.alloc),
            m.pods.clone(),
            overuse::Sampling { every: o.interval_seconds.duration(), proc_dir: o.proc_directory.path().to_owned() },
            m.evictions.clone(),
            Arc::clone(m.stop),
        )
        .map_err(|source| MonitorError::Thread { what: "over-use", source })?;
    } else {
        tracing::info!("GPU over-use detection is turned off ([overuse] enabled = false)");
    }
    health::spawn(events, tracker, Arc::clone(m.alloc), Arc::clone(m.stop))
        .map_err(|source| MonitorError::Thread { what: "health", source })?;
    Ok(())
}
