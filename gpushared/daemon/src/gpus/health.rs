//! The GPU health policy: which faults turn a GPU unhealthy, and when it is healthy again.
//!
//! - An Xid error turns the GPU unhealthy, except the application Xids listed in
//!   `[health] ignored_xids` (by default 13, 31, 43, 45, 68, 109: a program's fault, not the
//!   GPU's).
//! - An uncorrectable (double-bit) ECC error turns it unhealthy; correctable ones are logged.
//! - A GPU that does not answer a probe (every `probe_interval_seconds`) is unhealthy.
//! - **Recovery**: an unhealthy GPU with no new fault for `recovery_seconds` that answers a
//!   probe is healthy again (0 turns this off: it then stays unhealthy until the daemon
//!   restarts).
//!
//! An unhealthy GPU takes no new allocation; its devices are `Unhealthy` in the kubelet's
//! device list and in the node annotation, and every change is in the ledger history. The
//! [`Tracker`] decides (no I/O, a clock passed in); [`run`] feeds it from a [`GpuEvents`]
//! source on a thread of its own and applies its verdicts to the allocator.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use gpushare_core::Health;

use crate::allocation::allocator::Allocator;
use crate::config::HealthConfig;
use crate::gpus::events::{GpuEvents, GpuSignal};

/// The policy's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    /// Xids that do not make a GPU unhealthy.
    pub ignored_xids: BTreeSet<u64>,
    /// How often every GPU is probed.
    pub probe_interval: Duration,
    /// Quiet time before an unhealthy GPU that answers is healthy again; `None`: never.
    pub recovery: Option<Duration>,
}

impl From<&HealthConfig> for Policy {
    fn from(c: &HealthConfig) -> Self {
        Policy {
            ignored_xids: c.ignored_xids.iter().copied().collect(),
            probe_interval: c.probe_interval_seconds.duration(),
            recovery: (c.recovery_seconds > 0).then(|| Duration::from_secs(c.recovery_seconds)),
        }
    }
}

#[derive(Clone, Debug, Default)]
struct GpuState {
    /// Why it is unhealthy, if it is.
    fault: Option<String>,
    /// When the last fault was seen.
    last_fault: Option<Instant>,
}

/// The health of each GPU, as the policy sees it.
#[derive(Clone, Debug)]
pub struct Tracker {
    policy: Policy,
    gpus: BTreeMap<u32, GpuState>,
}

impl Tracker {
    /// All of `gpus` (NVML indexes) healthy.
    #[must_use]
    pub fn new(policy: Policy, gpus: impl IntoIterator<Item = u32>) -> Self {
        Tracker { policy, gpus: gpus.into_iter().map(|g| (g, GpuState::default())).collect() }
    }

    /// Starts `gpu` unhealthy for `reason` (it did not answer when the daemon started): it is
    /// healthy again like any faulty GPU, once it answers and has been quiet for the recovery
    /// time.
    pub fn start_unhealthy(&mut self, gpu: u32, reason: String, now: Instant) {
        let _ = self.fault(gpu, reason, now);
    }

    /// The policy.
    #[must_use]
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    fn fault(&mut self, gpu: u32, reason: String, now: Instant) -> Option<(u32, Health)> {
        let state = self.gpus.get_mut(&gpu)?;
        state.last_fault = Some(now);
        if state.fault.is_some() {
            return None;
        }
        state.fault = Some(reason.clone());
        Some((gpu, Health::Unhealthy { reason }))
    }

    /// A signal from the GPUs; returns the health change it causes, if any.
    pub fn signal(&mut self, signal: &GpuSignal, now: Instant) -> Option<(u32, Health)> {
        match *signal {
            GpuSignal::Xid { gpu, code } if self.policy.ignored_xids.contains(&code) => {
                tracing::info!(gpu, xid = code, "application Xid error; the GPU stays healthy");
                None
            }
            GpuSignal::Xid { gpu, code } => self.fault(gpu, format!("Xid {code}"), now),
            GpuSignal::DoubleBitEcc { gpu } => self.fault(gpu, "uncorrectable ECC error".to_owned(), now),
            GpuSignal::SingleBitEcc { gpu } => {
                tracing::info!(gpu, "correctable ECC error; the GPU stays healthy");
                None
            }
        }
    }

    /// The answer to a probe; returns the health change it causes, if any.
    pub fn probe(&mut self, gpu: u32, answer: Result<(), String>, now: Instant) -> Option<(u32, Health)> {
        match answer {
            Err(reason) => self.fault(gpu, format!("does not answer: {reason}"), now),
            Ok(()) => {
                let recovery = self.policy.recovery?;
                let state = self.gpus.get_mut(&gpu)?;
                let quiet = state.last_fault.is_none_or(|t| now.saturating_duration_since(t) >= recovery);
                if state.fault.is_some() && quiet {
                    state.fault = None;
                    return Some((gpu, Health::Healthy));
                }
                None
            }
        }
    }

    /// The GPUs to probe.
    pub fn gpus(&self) -> impl Iterator<Item = u32> + '_ {
        self.gpus.keys().copied()
    }
}

/// Feeds `tracker` from `events` and applies its verdicts to `alloc`, until `stop` is set.
/// Blocking: run it on a thread of its own.
pub fn run(mut events: impl GpuEvents, mut tracker: Tracker, alloc: &Allocator, stop: &AtomicBool) {
    let apply = |change: Option<(u32, Health)>| {
        let Some((gpu, health)) = change else { return };
        match &health {
            Health::Unhealthy { reason } => {
                tracing::error!(gpu, %reason, "GPU unhealthy: its devices are withdrawn from the kubelet");
            }
            Health::Healthy => tracing::warn!(gpu, "GPU recovered: its devices are offered to the kubelet again"),
        }
        if let Err(e) = alloc.set_health(gpu, health) {
            tracing::error!(gpu, error = %e, "the health change could not be recorded in the ledger history");
        }
    };
    let every = tracker.policy().probe_interval;
    // A probe checks that each index still answers with the UUID served under it.
    let uuids: BTreeMap<u32, String> =
        alloc.inventory().gpus().iter().map(|g| (g.index, g.uuid.as_str().to_owned())).collect();
    let mut next_probe = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        if now >= next_probe {
            let gpus: Vec<u32> = tracker.gpus().collect();
            for gpu in gpus {
                let answer = events.probe(gpu, uuids.get(&gpu).map(String::as_str));
                if let Ok(activity) = &answer
                    && alloc.set_activity(gpu, *activity)
                {
                    tracing::debug!(gpu, utilization = ?activity.utilization, in_use_mib = activity.in_use.get(), "GPU activity");
                }
                apply(tracker.probe(gpu, answer.map(|_| ()), Instant::now()));
            }
            next_probe = now + every;
        }
        let wait = next_probe.saturating_duration_since(Instant::now()).min(Duration::from_millis(500));
        match events.next(wait) {
            Ok(Some(signal)) => apply(tracker.signal(&signal, Instant::now())),
            Ok(None) => {}
            Err(e) => {
                // An event NVML could not tie to a GPU (a lost one cannot say its index):
                // probe every GPU now.
                tracing::warn!(error = %e, "GPU event error; probing every GPU");
                next_probe = Instant::now();
            }
        }
    }
}

/// Starts [`run`] on a thread named `gpu-health`.
///
/// # Errors
/// The I/O error if the thread cannot start.
pub fn spawn(
    events: impl GpuEvents + 'static,
    tracker: Tracker,
    alloc: Arc<Allocator>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("gpu-health".into()).spawn(move || run(events, tracker, &alloc, &stop))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker(recovery: Option<u64>) -> Tracker {
        let policy = Policy {
            ignored_xids: crate::config::DEFAULT_IGNORED_XIDS.into_iter().collect(),
            probe_interval: Duration::from_secs(5),
            recovery: recovery.map(Duration::from_secs),
        };
        Tracker::new(policy, [0, 1])
    }

    fn unhealthy(gpu: u32, reason: &str) -> Option<(u32, Health)> {
        Some((gpu, Health::Unhealthy { reason: reason.into() }))
    }

    #[test]
    fn application_xids_and_correctable_ecc_leave_the_gpu_healthy() {
        let mut t = tracker(Some(60));
        let now = Instant::now();
        for code in [13, 31, 43, 45, 68, 109] {
            assert_eq!(t.signal(&GpuSignal::Xid { gpu: 0, code }, now), None);
        }
        assert_eq!(t.signal(&GpuSignal::SingleBitEcc { gpu: 0 }, now), None);
        assert_eq!(t.probe(0, Ok(()), now), None);
    }

    #[test]
    fn faults_turn_a_gpu_unhealthy_once() {
        let mut t = tracker(Some(60));
        let now = Instant::now();
        assert_eq!(t.signal(&GpuSignal::Xid { gpu: 1, code: 79 }, now), unhealthy(1, "Xid 79"));
        assert_eq!(t.signal(&GpuSignal::Xid { gpu: 1, code: 48 }, now), None, "already unhealthy");
        assert_eq!(t.signal(&GpuSignal::DoubleBitEcc { gpu: 0 }, now), unhealthy(0, "uncorrectable ECC error"));
        let mut t = tracker(Some(60));
        assert_eq!(t.probe(0, Err("GPU is lost".into()), now), unhealthy(0, "does not answer: GPU is lost"));
        // A GPU the tracker does not know is ignored, not a panic.
        assert_eq!(t.signal(&GpuSignal::Xid { gpu: 9, code: 79 }, now), None);
    }

    #[test]
    fn recovery_needs_a_quiet_period_and_an_answer() {
        let mut t = tracker(Some(60));
        let t0 = Instant::now();
        t.signal(&GpuSignal::Xid { gpu: 0, code: 79 }, t0);
        assert_eq!(t.probe(0, Ok(()), t0 + Duration::from_secs(30)), None, "too soon");
        // A new fault restarts the quiet period.
        t.signal(&GpuSignal::Xid { gpu: 0, code: 79 }, t0 + Duration::from_secs(40));
        assert_eq!(t.probe(0, Ok(()), t0 + Duration::from_secs(70)), None);
        assert_eq!(t.probe(0, Err("lost".into()), t0 + Duration::from_secs(90)), None, "still unhealthy");
        assert_eq!(t.probe(0, Ok(()), t0 + Duration::from_secs(120)), None, "the failed probe was a fault");
        assert_eq!(t.probe(0, Ok(()), t0 + Duration::from_secs(150)), Some((0, Health::Healthy)));
        assert_eq!(t.probe(0, Ok(()), t0 + Duration::from_secs(160)), None);
    }

    #[test]
    fn a_gpu_unhealthy_from_the_start_recovers_like_any_other() {
        let mut t = tracker(Some(60));
        let t0 = Instant::now();
        t.start_unhealthy(1, "does not answer: GPU is lost".into(), t0);
        assert_eq!(t.probe(1, Err("lost".into()), t0 + Duration::from_secs(30)), None, "already unhealthy");
        assert_eq!(t.probe(1, Ok(()), t0 + Duration::from_secs(60)), None, "quiet for 30 s only");
        assert_eq!(t.probe(1, Ok(()), t0 + Duration::from_secs(90)), Some((1, Health::Healthy)));
    }

    #[test]
    fn without_recovery_an_unhealthy_gpu_stays_so() {
        let mut t = tracker(None);
        let t0 = Instant::now();
        t.signal(&GpuSignal::DoubleBitEcc { gpu: 1 }, t0);
        assert_eq!(t.probe(1, Ok(()), t0 + Duration::from_secs(86_400)), None);
    }
}
