//! What the GPUs report about their health: Xid errors and ECC errors as NVML delivers them,
//! and a cheap probe of whether a GPU still answers. The health policy reads them through the
//! [`GpuEvents`] trait: [`NvmlEvents`] on real hosts (and on the fake NVML library in tests,
//! through the very same code path), a scripted fake in unit tests.
//!
//! NVML's event set borrows the library handle (`EventSet<'nvml>` holds a `&'nvml Nvml`), so
//! one struct cannot own both without `unsafe`. [`NvmlEvents`] therefore shares the handle in
//! an [`Arc`] with a watcher thread of its own: the thread creates the event set on its stack,
//! registers it on every GPU, and waits on it in short slices, passing what arrives through a
//! bounded channel that [`GpuEvents::next`] reads. Probes use the shared handle from the
//! caller's thread (NVML is thread-safe). Dropping [`NvmlEvents`] stops the thread and waits
//! for it (at most one wait slice), then shuts NVML down when the last handle goes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gpushare_core::{Activity, Mib};
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::event::EventSet;
use nvml_wrapper::struct_wrappers::event::EventData;
use thiserror::Error;

/// What the GPUs report, as the health policy needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuSignal {
    /// An Xid error on the GPU with this NVML index. Code 999: NVML did not know which Xid.
    Xid {
        /// NVML index of the GPU.
        gpu: u32,
        /// The Xid.
        code: u64,
    },
    /// An uncorrectable (double-bit) ECC error.
    DoubleBitEcc {
        /// NVML index of the GPU.
        gpu: u32,
    },
    /// A correctable (single-bit) ECC error.
    SingleBitEcc {
        /// NVML index of the GPU.
        gpu: u32,
    },
}

impl GpuSignal {
    /// NVML index of the GPU the signal is about.
    #[must_use]
    pub fn gpu(&self) -> u32 {
        match *self {
            GpuSignal::Xid { gpu, .. } | GpuSignal::DoubleBitEcc { gpu } | GpuSignal::SingleBitEcc { gpu } => gpu,
        }
    }
}

/// Why GPU signals could not be had.
#[derive(Debug, Error)]
pub enum GpuEventsError {
    /// NVML could not be loaded or initialised.
    #[error("cannot use NVML from {library} for GPU events: {error}")]
    Init {
        /// The library asked for.
        library: PathBuf,
        /// What nvml-wrapper said.
        error: NvmlError,
    },
    /// Setting up the event set failed (not one GPU's lack of event support, which is skipped).
    #[error("NVML: {what}: {error}")]
    Setup {
        /// The step, with the GPU if one.
        what: String,
        /// What nvml-wrapper said.
        error: NvmlError,
    },
    /// Waiting for events failed; the watcher tries again after a pause.
    #[error("NVML: waiting for GPU events: {error}")]
    Wait {
        /// What nvml-wrapper said.
        error: NvmlError,
    },
    /// An event arrived from a GPU that did not answer when asked its index.
    #[error("NVML: a {event} event came from a GPU that does not tell its index: {error}")]
    UnknownGpu {
        /// The event, e.g. `Xid 79`.
        event: String,
        /// What nvml-wrapper said when asked the index.
        error: NvmlError,
    },
    /// The watcher thread could not be started.
    #[error("cannot start the GPU event watcher thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// The watcher thread is gone (it panicked); no more signals will come.
    #[error("the GPU event watcher thread stopped")]
    Stopped,
}

/// A source of GPU health signals and probes (NVML on real hosts; a fake in unit tests).
pub trait GpuEvents: Send {
    /// Waits up to `timeout` for the next signal; Ok(None) when none arrived.
    ///
    /// # Errors
    /// [`GpuEventsError`] when the source failed; for [`NvmlEvents`], every error but
    /// [`GpuEventsError::Stopped`] is passing and later calls may bring signals again.
    fn next(&mut self, timeout: Duration) -> Result<Option<GpuSignal>, GpuEventsError>;

    /// Asks the GPU with this NVML index a cheap question (memory info, utilisation and UUID)
    /// and returns what it is doing; Err(reason) when it does not answer, or answers with
    /// another UUID than `expect` (the GPUs renumbered: it is not the GPU served under that
    /// index).
    ///
    /// # Errors
    /// The reason, for logs and the node's state, when the GPU does not answer.
    fn probe(&mut self, gpu: u32, expect: Option<&str>) -> Result<Activity, String>;
}

/// The event types watched, where a GPU supports them.
const HEALTH_EVENTS: EventTypes =
    EventTypes::CRITICAL_XID_ERROR.union(EventTypes::DOUBLE_BIT_ECC_ERROR).union(EventTypes::SINGLE_BIT_ECC_ERROR);

/// How long one NVML wait of the watcher lasts: the longest a drop waits for the thread.
const WAIT_SLICE_MS: u32 = 200;

/// The watcher's pause after a failed wait, so a GPU that keeps failing does not spin it.
const ERROR_PAUSE: Duration = Duration::from_secs(1);

/// How often the watcher tries again to register the GPUs that did not answer.
const RETRY_SILENT: Duration = Duration::from_secs(5);

/// Signals held for a reader that is behind; past that the watcher waits (NVML queues).
const QUEUE: usize = 1024;

type Item = Result<GpuSignal, GpuEventsError>;

/// GPU signals from NVML, through a watcher thread (see the module documentation).
pub struct NvmlEvents {
    // Declared first so that it drops before `_watcher`: a watcher blocked on a full channel
    // then sees it closed, and the join in `Watcher::drop` returns.
    signals: Receiver<Item>,
    _watcher: Watcher,
    nvml: Arc<Nvml>,
    library: PathBuf,
    watched: Vec<u32>,
}

impl std::fmt::Debug for NvmlEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlEvents")
            .field("library", &self.library)
            .field("watched", &self.watched)
            .finish_non_exhaustive()
    }
}

impl NvmlEvents {
    /// Loads and initialises NVML from `library` (a path, or a name the loader resolves) and
    /// starts watching every GPU for the health events it supports among Xid, double-bit ECC
    /// and single-bit ECC errors. A GPU that does not answer, supports none of them, or refuses
    /// the registration is logged and not watched (its probes still work).
    ///
    /// # Errors
    /// [`GpuEventsError::Init`] when NVML cannot be used, [`GpuEventsError::Setup`] when the
    /// event set cannot be made, [`GpuEventsError::Spawn`] when the thread cannot start.
    pub fn open(library: &Path) -> Result<Self, GpuEventsError> {
        let nvml = Nvml::builder()
            .lib_path(library.as_os_str())
            .init()
            .map_err(|error| GpuEventsError::Init { library: library.to_owned(), error })?;
        let nvml = Arc::new(nvml);
        let (tx, signals) = mpsc::sync_channel(QUEUE);
        let (ready_tx, ready) = mpsc::sync_channel(1);
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let nvml = Arc::clone(&nvml);
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("gpu-events".into())
                .spawn(move || watch(&nvml, &tx, &ready_tx, &stop))
                .map_err(GpuEventsError::Spawn)?
        };
        // From here on, an early return drops the watcher, which stops and joins the thread.
        let watcher = Watcher { stop, thread: Some(thread) };
        let watched = ready.recv().map_err(|_| GpuEventsError::Stopped)??;
        tracing::info!(library = %library.display(), gpus = ?watched, "watching GPUs for Xid and ECC events");
        Ok(NvmlEvents { signals, _watcher: watcher, nvml, library: library.to_owned(), watched })
    }

    /// The NVML indexes of the GPUs whose events are watched, ascending.
    #[must_use]
    pub fn watched(&self) -> &[u32] {
        &self.watched
    }

    /// The library NVML was loaded from.
    #[must_use]
    pub fn library(&self) -> &Path {
        &self.library
    }

    /// The shared NVML handle, for other samplers (the over-use detector).
    #[must_use]
    pub fn nvml(&self) -> Arc<Nvml> {
        Arc::clone(&self.nvml)
    }
}

impl GpuEvents for NvmlEvents {
    fn next(&mut self, timeout: Duration) -> Result<Option<GpuSignal>, GpuEventsError> {
        match self.signals.recv_timeout(timeout) {
            Ok(item) => item.map(Some),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(GpuEventsError::Stopped),
        }
    }

    fn probe(&mut self, gpu: u32, expect: Option<&str>) -> Result<Activity, String> {
        let device = self.nvml.device_by_index(gpu).map_err(|e| format!("NVML GPU{gpu}: {e}"))?;
        let memory = device.memory_info().map_err(|e| format!("NVML GPU{gpu} memory info: {e}"))?;
        let uuid = device.uuid().map_err(|e| format!("NVML GPU{gpu} UUID: {e}"))?;
        if let Some(expect) = expect.filter(|e| *e != uuid) {
            return Err(format!("NVML GPU{gpu} answers as {uuid}, not {expect} (the GPUs were renumbered)"));
        }
        // Not every GPU reports utilisation; that is no fault.
        let utilization = device.utilization_rates().ok().map(|u| u8::try_from(u.gpu.min(100)).unwrap_or(100));
        Ok(Activity { utilization, in_use: Mib::new(memory.used / (1024 * 1024)) })
    }
}

/// The watcher thread's handle: dropping it stops the thread and waits for it.
struct Watcher {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            if thread.join().is_err() {
                tracing::warn!("the GPU event watcher thread panicked");
            }
        }
    }
}

/// The watcher thread: registers, reports the GPUs watched on `ready`, then passes events on
/// until `stop` is set or the reader is gone. Every [`RETRY_SILENT`] it tries again to register
/// the GPUs that did not answer, so a GPU that comes back has its events watched again.
fn watch(nvml: &Nvml, tx: &SyncSender<Item>, ready: &SyncSender<Result<Vec<u32>, GpuEventsError>>, stop: &AtomicBool) {
    let (mut set, mut registered, mut silent) = match register(nvml) {
        Ok(registered) => registered,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    if ready.send(Ok(registered.iter().map(|&(gpu, _)| gpu).collect())).is_err() {
        return;
    }
    let mut retry_at = Instant::now() + RETRY_SILENT;
    while !stop.load(Ordering::Relaxed) {
        if !silent.is_empty() && Instant::now() >= retry_at {
            retry_at = Instant::now() + RETRY_SILENT;
            let before = std::mem::take(&mut silent);
            match add_all(nvml, set, &mut registered, &before, &mut silent) {
                Ok(kept) => set = kept,
                Err(e) => {
                    tracing::error!(error = %e, "the GPU event set could not be made again; GPU events are no longer watched");
                    let _ = tx.send(Err(e));
                    return;
                }
            }
            for gpu in before.iter().filter(|g| !silent.contains(g)) {
                tracing::info!(gpu, "GPU answers again; its Xid and ECC events are watched again where supported");
            }
        }
        let item = match set.wait(WAIT_SLICE_MS) {
            Ok(event) => match signal(&event) {
                Ok(Some(signal)) => Ok(signal),
                Ok(None) => continue,
                Err(e) => Err(e),
            },
            Err(NvmlError::Timeout) => continue,
            Err(error) => {
                tracing::debug!(error = %error, "NVML event wait failed; pausing");
                if tx.send(Err(GpuEventsError::Wait { error })).is_err() {
                    return;
                }
                pause(stop, ERROR_PAUSE);
                continue;
            }
        };
        if tx.send(item).is_err() {
            return;
        }
    }
}

/// Sleeps `pause`, or less when `stop` is set (the stopper unparks the thread).
fn pause(stop: &AtomicBool, pause: Duration) {
    let until = Instant::now() + pause;
    while !stop.load(Ordering::Relaxed) {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        std::thread::park_timeout(left);
    }
}

/// The GPUs registered on an event set, with the types registered.
type Registered = Vec<(u32, EventTypes)>;

/// An event set with the health events registered on every GPU that supports some, the GPUs
/// registered, and those that did not answer (tried again later).
fn register(nvml: &Nvml) -> Result<(EventSet<'_>, Registered, Vec<u32>), GpuEventsError> {
    let setup = |what: String| move |error| GpuEventsError::Setup { what, error };
    let count = nvml.device_count().map_err(setup("device count".into()))?;
    let set = nvml.create_event_set().map_err(setup("creating the event set".into()))?;
    let (mut registered, mut silent) = (Vec::new(), Vec::new());
    let gpus: Vec<u32> = (0..count).collect();
    let set = add_all(nvml, set, &mut registered, &gpus, &mut silent)?;
    Ok((set, registered, silent))
}

/// Registers the health events of each of `gpus` on `set`, adding them to `registered`; those
/// that do not answer go to `silent`. A GPU without event support, or that refuses the
/// registration, is logged and left out.
fn add_all<'n>(
    nvml: &'n Nvml,
    mut set: EventSet<'n>,
    registered: &mut Registered,
    gpus: &[u32],
    silent: &mut Vec<u32>,
) -> Result<EventSet<'n>, GpuEventsError> {
    let setup = |what: String| move |error| GpuEventsError::Setup { what, error };
    for &gpu in gpus {
        let device = match nvml.device_by_index(gpu) {
            Ok(device) => device,
            Err(e) => {
                tracing::warn!(gpu, error = %e, "GPU does not answer; its Xid and ECC events are not watched until it does");
                silent.push(gpu);
                continue;
            }
        };
        let supported = match device.supported_event_types() {
            Ok(supported) => supported,
            Err(NvmlError::GpuLost) => {
                tracing::warn!(gpu, "GPU is lost; its Xid and ECC events are not watched until it answers");
                silent.push(gpu);
                continue;
            }
            Err(e) => {
                tracing::warn!(gpu, error = %e, "GPU has no event support; its Xid and ECC events are not watched");
                continue;
            }
        };
        let types = supported & HEALTH_EVENTS;
        if types.is_empty() {
            tracing::warn!(gpu, ?supported, "GPU supports none of the Xid and ECC events; not watched");
            continue;
        }
        if types != HEALTH_EVENTS {
            tracing::info!(gpu, ?types, "GPU supports only some of the Xid and ECC events; watching those");
        }
        match device.register_events(types, set) {
            Ok(kept) => {
                set = kept;
                registered.push((gpu, types));
            }
            Err(e) => {
                tracing::warn!(gpu, error = %e.error, "GPU refused the event registration; its Xid and ECC events are not watched");
                // nvml-wrapper frees the set on a failed registration: start again with the
                // GPUs registered so far.
                set = nvml.create_event_set().map_err(setup("creating the event set again".into()))?;
                for &(gpu, types) in registered.iter() {
                    let device = nvml.device_by_index(gpu).map_err(setup(format!("GPU{gpu}")))?;
                    set = device.register_events(types, set).map_err(|e| GpuEventsError::Setup {
                        what: format!("GPU{gpu} events again"),
                        error: e.error,
                    })?;
                }
            }
        }
    }
    Ok(set)
}

/// The signal an NVML event carries; None for event types the health policy does not use.
fn signal(event: &EventData<'_>) -> Result<Option<GpuSignal>, GpuEventsError> {
    let types = event.event_type;
    let gpu = |name: String| event.device.index().map_err(|error| GpuEventsError::UnknownGpu { event: name, error });
    let signal = if types.contains(EventTypes::CRITICAL_XID_ERROR) {
        let code = match event.event_data {
            Some(XidError::Value(code)) => code,
            Some(XidError::Unknown) | None => 999,
        };
        GpuSignal::Xid { gpu: gpu(format!("Xid {code}"))?, code }
    } else if types.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
        GpuSignal::DoubleBitEcc { gpu: gpu("double-bit ECC".to_owned())? }
    } else if types.contains(EventTypes::SINGLE_BIT_ECC_ERROR) {
        GpuSignal::SingleBitEcc { gpu: gpu("single-bit ECC".to_owned())? }
    } else {
        tracing::debug!(?types, "NVML event of a type not watched; ignored");
        return Ok(None);
    };
    Ok(Some(signal))
}

/// Scripted GPU signals and probe answers, for the health policy's unit tests. Clones share
/// the script: a test keeps one to push signals and read the probes while the code under test
/// owns another. `next` waits for a pushed signal up to its timeout, like the real source.
#[cfg(test)]
#[derive(Clone, Debug, Default)]
pub struct FakeGpuEvents {
    shared: Arc<(std::sync::Mutex<FakeScript>, std::sync::Condvar)>,
}

#[cfg(test)]
#[derive(Debug, Default)]
struct FakeScript {
    queue: std::collections::VecDeque<Item>,
    lost: std::collections::BTreeMap<u32, String>,
    probes: Vec<u32>,
}

#[cfg(test)]
impl FakeGpuEvents {
    /// No signals yet; every GPU answers probes.
    #[must_use]
    pub fn new() -> Self {
        FakeGpuEvents::default()
    }

    fn script(&self) -> std::sync::MutexGuard<'_, FakeScript> {
        self.shared.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Queues a signal for `next`.
    pub fn push(&self, signal: GpuSignal) {
        self.script().queue.push_back(Ok(signal));
        self.shared.1.notify_all();
    }

    /// Queues an error for `next`.
    pub fn push_error(&self, error: GpuEventsError) {
        self.script().queue.push_back(Err(error));
        self.shared.1.notify_all();
    }

    /// Probes of `gpu` fail with `reason` until [`FakeGpuEvents::recover`].
    pub fn lose(&self, gpu: u32, reason: &str) {
        self.script().lost.insert(gpu, reason.to_owned());
    }

    /// Probes of `gpu` succeed again.
    pub fn recover(&self, gpu: u32) {
        self.script().lost.remove(&gpu);
    }

    /// The GPUs probed so far, in order.
    #[must_use]
    pub fn probes(&self) -> Vec<u32> {
        self.script().probes.clone()
    }

    /// Signals and errors pushed and not yet taken.
    #[must_use]
    pub fn pending(&self) -> usize {
        self.script().queue.len()
    }
}

#[cfg(test)]
impl GpuEvents for FakeGpuEvents {
    fn next(&mut self, timeout: Duration) -> Result<Option<GpuSignal>, GpuEventsError> {
        let (script, arrived) = &*self.shared;
        let script = script.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (mut script, _) = arrived
            .wait_timeout_while(script, timeout, |s| s.queue.is_empty())
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        script.queue.pop_front().transpose()
    }

    fn probe(&mut self, gpu: u32, _expect: Option<&str>) -> Result<Activity, String> {
        let mut script = self.script();
        script.probes.push(gpu);
        script
            .lost
            .get(&gpu)
            .map_or(Ok(Activity { utilization: None, in_use: Mib::ZERO }), |reason| Err(reason.clone()))
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use gpushare_testkit::nvml::{FakeGpu, build, config_beside, events_directive, inject, write_config};

    use super::*;

    /// A fake GPU's answer before any `util` or `used` line.
    const IDLE: Activity = Activity { utilization: Some(0), in_use: Mib::ZERO };

    /// Long enough for an injected event to arrive on a slow machine.
    const ARRIVES: Duration = Duration::from_secs(5);

    /// A fake NVML library with two GPUs, configured beside itself, and its event file.
    struct Host {
        _dir: tempfile::TempDir,
        library: PathBuf,
        events: PathBuf,
    }

    impl Host {
        fn new(extra: &str) -> Host {
            let dir = tempfile::tempdir().unwrap();
            let library = build(dir.path()).unwrap();
            let events = dir.path().join("events");
            let gpus = [FakeGpu::new("h", 0, 100, "Tesla T4"), FakeGpu::new("h", 1, 200, "NVIDIA A10")];
            write_config(&config_beside(&library), &gpus, &format!("{}{extra}", events_directive(&events))).unwrap();
            Host { _dir: dir, library, events }
        }

        fn inject(&self, line: &str) {
            inject(&self.events, line).unwrap();
        }
    }

    #[test]
    fn nvml_events_report_xid_and_ecc_with_the_gpu_index() {
        let host = Host::new("");
        let mut events = NvmlEvents::open(&host.library).unwrap();
        assert_eq!(events.watched(), [0, 1]);
        host.inject("xid 1 79");
        assert_eq!(events.next(ARRIVES).unwrap(), Some(GpuSignal::Xid { gpu: 1, code: 79 }));
        host.inject("ecc_dbe 0");
        host.inject("ecc_sbe 1");
        assert_eq!(events.next(ARRIVES).unwrap(), Some(GpuSignal::DoubleBitEcc { gpu: 0 }));
        assert_eq!(events.next(ARRIVES).unwrap(), Some(GpuSignal::SingleBitEcc { gpu: 1 }));
        host.inject("xid 0 999");
        assert_eq!(events.next(ARRIVES).unwrap(), Some(GpuSignal::Xid { gpu: 0, code: 999 }));
    }

    #[test]
    fn nvml_events_time_out_with_none() {
        let host = Host::new("");
        let mut events = NvmlEvents::open(&host.library).unwrap();
        let start = Instant::now();
        assert_eq!(events.next(Duration::from_millis(100)).unwrap(), None);
        assert!(start.elapsed() >= Duration::from_millis(100));
    }

    #[test]
    fn nvml_events_skip_a_gpu_without_event_support() {
        let host = Host::new("gpu_error 0 nvmlDeviceGetSupportedEventTypes 3\n");
        let mut events = NvmlEvents::open(&host.library).unwrap();
        assert_eq!(events.watched(), [1]);
        host.inject("xid 0 79");
        host.inject("xid 1 48");
        assert_eq!(events.next(ARRIVES).unwrap(), Some(GpuSignal::Xid { gpu: 1, code: 48 }));
        assert_eq!(events.next(Duration::from_millis(100)).unwrap(), None);
        assert_eq!(events.probe(0, None), Ok(IDLE), "not watched, still probed");
    }

    #[test]
    fn nvml_events_register_only_the_supported_health_types() {
        // GPU 0 has no ECC (Xid only); GPU 1 supports only P-state changes.
        let host = Host::new("event_types 0 0x8\nevent_types 1 0x4\n");
        let mut events = NvmlEvents::open(&host.library).unwrap();
        assert_eq!(events.watched(), [0]);
        host.inject("ecc_dbe 0");
        host.inject("xid 1 13");
        host.inject("xid 0 13");
        assert_eq!(events.next(ARRIVES).unwrap(), Some(GpuSignal::Xid { gpu: 0, code: 13 }));
        assert_eq!(events.next(Duration::from_millis(100)).unwrap(), None);
    }

    #[test]
    fn nvml_events_keep_the_gpus_registered_before_a_refused_registration() {
        // nvml-wrapper frees the set when GPU 1 refuses; GPU 0 is registered again on a new one.
        let host = Host::new("gpu_error 1 nvmlDeviceRegisterEvents 999\n");
        let mut events = NvmlEvents::open(&host.library).unwrap();
        assert_eq!(events.watched(), [0]);
        host.inject("xid 1 48");
        host.inject("xid 0 62");
        assert_eq!(events.next(ARRIVES).unwrap(), Some(GpuSignal::Xid { gpu: 0, code: 62 }));
    }

    #[test]
    fn nvml_events_skip_a_gpu_lost_at_startup_and_watch_it_once_it_answers() {
        let host = Host::new("");
        host.inject("lost 0");
        let mut events = NvmlEvents::open(&host.library).unwrap();
        assert_eq!(events.watched(), [1]);
        assert!(events.probe(0, None).is_err());
        // Back: registered again within RETRY_SILENT (events before that are not delivered,
        // as with NVML, so the test sends one every half second).
        host.inject("recover 0");
        let deadline = Instant::now() + RETRY_SILENT * 3;
        let got = loop {
            host.inject("xid 0 79");
            if let Some(signal) = events.next(Duration::from_millis(500)).unwrap() {
                break signal;
            }
            assert!(Instant::now() < deadline, "GPU0's events not watched after it answered again");
        };
        assert_eq!(got, GpuSignal::Xid { gpu: 0, code: 79 });
    }

    #[test]
    fn a_probe_that_finds_another_gpu_at_the_index_fails() {
        let host = Host::new("");
        let mut events = NvmlEvents::open(&host.library).unwrap();
        assert_eq!(events.probe(1, Some("GPU-fake-h-1")), Ok(IDLE));
        let reason = events.probe(1, Some("GPU-fake-h-0")).unwrap_err();
        assert!(reason.contains("answers as GPU-fake-h-1, not GPU-fake-h-0"), "{reason}");
    }

    #[test]
    fn nvml_probe_fails_while_the_gpu_is_lost_and_answers_after_recover() {
        let host = Host::new("");
        let mut events = NvmlEvents::open(&host.library).unwrap();
        assert_eq!(events.probe(1, None), Ok(IDLE));
        host.inject("lost 1");
        let reason = events.probe(1, None).unwrap_err();
        assert!(reason.contains("GPU1"), "{reason}");
        assert!(reason.contains("fell off the bus"), "{reason}");
        assert_eq!(events.probe(0, None), Ok(IDLE));
        host.inject("recover 1");
        assert_eq!(events.probe(1, None), Ok(IDLE));
        // What the GPU is doing comes with the answer.
        host.inject("util 1 55");
        host.inject("used 1 150");
        assert_eq!(events.probe(1, None), Ok(Activity { utilization: Some(55), in_use: Mib::new(150) }));
        let reason = events.probe(7, None).unwrap_err();
        assert!(reason.contains("GPU7"), "{reason}");
    }

    #[test]
    fn nvml_events_of_a_lost_gpu_are_errors_naming_the_event() {
        let host = Host::new("");
        let mut events = NvmlEvents::open(&host.library).unwrap();
        host.inject("lost 1");
        host.inject("xid 1 79");
        let err = events.next(ARRIVES).unwrap_err();
        assert!(matches!(err, GpuEventsError::UnknownGpu { .. }), "{err:?}");
        assert!(err.to_string().contains("Xid 79"), "{err}");
        host.inject("recover 1");
        host.inject("xid 1 31");
        assert_eq!(events.next(ARRIVES).unwrap(), Some(GpuSignal::Xid { gpu: 1, code: 31 }));
    }

    #[test]
    fn nvml_events_open_names_a_missing_library() {
        let err = NvmlEvents::open(Path::new("/nonexistent/libnvidia-ml.so.1")).unwrap_err();
        assert!(matches!(err, GpuEventsError::Init { .. }), "{err:?}");
        assert!(err.to_string().contains("/nonexistent/libnvidia-ml.so.1"), "{err}");
    }

    #[test]
    fn nvml_events_on_a_host_without_gpus_watch_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let library = build(dir.path()).unwrap();
        let mut events = NvmlEvents::open(&library).unwrap();
        assert!(events.watched().is_empty());
        assert_eq!(events.next(Duration::from_millis(50)).unwrap(), None);
    }

    #[test]
    fn dropping_nvml_events_stops_the_watcher_promptly() {
        let host = Host::new("");
        let events = NvmlEvents::open(&host.library).unwrap();
        let start = Instant::now();
        drop(events);
        assert!(start.elapsed() < Duration::from_secs(2), "{:?}", start.elapsed());
    }

    #[test]
    fn nvml_events_queue_for_a_reader_that_is_behind() {
        let host = Host::new("");
        let mut events = NvmlEvents::open(&host.library).unwrap();
        for code in 1..=20 {
            host.inject(&format!("xid 0 {code}"));
        }
        std::thread::sleep(Duration::from_millis(300));
        let codes: Vec<u64> = (0..20)
            .map(|_| match events.next(ARRIVES).unwrap() {
                Some(GpuSignal::Xid { code, .. }) => code,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(codes, (1..=20).collect::<Vec<_>>());
    }

    #[test]
    fn fake_delivers_pushed_signals_in_order_then_times_out() {
        let mut fake = FakeGpuEvents::new();
        fake.push(GpuSignal::Xid { gpu: 1, code: 79 });
        fake.push_error(GpuEventsError::Stopped);
        fake.push(GpuSignal::DoubleBitEcc { gpu: 0 });
        assert_eq!(fake.pending(), 3);
        assert_eq!(fake.next(Duration::ZERO).unwrap(), Some(GpuSignal::Xid { gpu: 1, code: 79 }));
        assert!(matches!(fake.next(Duration::ZERO), Err(GpuEventsError::Stopped)));
        assert_eq!(fake.next(Duration::ZERO).unwrap(), Some(GpuSignal::DoubleBitEcc { gpu: 0 }));
        let start = Instant::now();
        assert_eq!(fake.next(Duration::from_millis(50)).unwrap(), None);
        assert!(start.elapsed() >= Duration::from_millis(50));
    }

    #[test]
    fn fake_next_wakes_when_a_signal_is_pushed_from_another_thread() {
        let script = FakeGpuEvents::new();
        let mut events: Box<dyn GpuEvents> = Box::new(script.clone());
        let pusher = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            script.push(GpuSignal::SingleBitEcc { gpu: 3 });
        });
        assert_eq!(events.next(ARRIVES).unwrap(), Some(GpuSignal::SingleBitEcc { gpu: 3 }));
        pusher.join().unwrap();
    }

    #[test]
    fn fake_probe_answers_as_scripted_and_records_the_probes() {
        let script = FakeGpuEvents::new();
        let mut events = script.clone();
        assert_eq!(events.probe(0, None), Ok(Activity { utilization: None, in_use: Mib::ZERO }));
        script.lose(1, "GPU is lost");
        assert_eq!(events.probe(1, None), Err("GPU is lost".to_owned()));
        script.recover(1);
        assert_eq!(events.probe(1, None), Ok(Activity { utilization: None, in_use: Mib::ZERO }));
        assert_eq!(script.probes(), [0, 1, 1]);
    }

    #[test]
    fn signals_name_their_gpu() {
        assert_eq!(GpuSignal::Xid { gpu: 2, code: 79 }.gpu(), 2);
        assert_eq!(GpuSignal::DoubleBitEcc { gpu: 1 }.gpu(), 1);
        assert_eq!(GpuSignal::SingleBitEcc { gpu: 0 }.gpu(), 0);
    }
}
