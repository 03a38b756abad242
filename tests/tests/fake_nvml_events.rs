//! The fake NVML library's events and lost GPUs, driven by nvml-wrapper as gpushared drives
//! the real library: event sets, registration, `wait`, and the errors of a GPU that fell off
//! the bus. Each test builds its own copy of the library, configured through the file beside
//! it, and injects events by appending to its event file.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use gpushare_testkit::nvml::{FakeGpu, build, config_beside, events_directive, inject, write_config};
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::event::EventSet;
use nvml_wrapper::struct_wrappers::event::EventData;

/// Long enough for an injected event to arrive on a slow machine.
const ARRIVES: u32 = 5_000;

/// A built library with two GPUs and an event file.
struct Host {
    _dir: tempfile::TempDir,
    library: PathBuf,
    events: PathBuf,
}

impl Host {
    /// GPU 0 (Tesla T4, 100 MiB) and GPU 1 (NVIDIA A10, 200 MiB), then `extra` directives.
    fn new(extra: &str) -> Host {
        let dir = tempfile::tempdir().unwrap();
        let library = build(dir.path()).unwrap();
        let events = dir.path().join("events");
        let gpus = [FakeGpu::new("h", 0, 100, "Tesla T4"), FakeGpu::new("h", 1, 200, "NVIDIA A10")];
        write_config(&config_beside(&library), &gpus, &format!("{}{extra}", events_directive(&events))).unwrap();
        Host { _dir: dir, library, events }
    }

    fn nvml(&self) -> Nvml {
        Nvml::builder().lib_path(self.library.as_os_str()).init().unwrap()
    }

    fn inject(&self, line: &str) {
        inject(&self.events, line).unwrap();
    }
}

const HEALTH: EventTypes =
    EventTypes::CRITICAL_XID_ERROR.union(EventTypes::DOUBLE_BIT_ECC_ERROR).union(EventTypes::SINGLE_BIT_ECC_ERROR);

/// A set with the health events registered on every GPU.
fn watch_all(nvml: &Nvml) -> EventSet<'_> {
    let mut set = nvml.create_event_set().unwrap();
    for i in 0..nvml.device_count().unwrap() {
        set = nvml.device_by_index(i).unwrap().register_events(HEALTH, set).unwrap();
    }
    set
}

/// The event's type, Xid data and GPU index.
fn describe(event: &EventData<'_>) -> (EventTypes, Option<XidError>, u32) {
    (event.event_type, event.event_data.clone(), event.device.index().unwrap())
}

#[test]
fn xid_and_ecc_events_arrive_with_their_gpu() {
    let host = Host::new("");
    let nvml = host.nvml();
    let set = watch_all(&nvml);

    host.inject("xid 1 79");
    let event = set.wait(ARRIVES).unwrap();
    assert_eq!(describe(&event), (EventTypes::CRITICAL_XID_ERROR, Some(XidError::Value(79)), 1));
    assert_eq!(event.device.uuid().unwrap(), "GPU-fake-h-1");

    host.inject("ecc_dbe 0");
    assert_eq!(describe(&set.wait(ARRIVES).unwrap()), (EventTypes::DOUBLE_BIT_ECC_ERROR, None, 0));
    host.inject("ecc_sbe 1");
    assert_eq!(describe(&set.wait(ARRIVES).unwrap()), (EventTypes::SINGLE_BIT_ECC_ERROR, None, 1));
    host.inject("xid 0 999");
    assert_eq!(describe(&set.wait(ARRIVES).unwrap()), (EventTypes::CRITICAL_XID_ERROR, Some(XidError::Unknown), 0));
}

#[test]
fn events_queue_in_order_until_taken() {
    let host = Host::new("");
    let nvml = host.nvml();
    let set = watch_all(&nvml);
    host.inject("xid 0 13");
    host.inject("xid 1 31");
    host.inject("ecc_dbe 1");
    let got: Vec<_> = (0..3).map(|_| describe(&set.wait(ARRIVES).unwrap())).collect();
    assert_eq!(
        got,
        [
            (EventTypes::CRITICAL_XID_ERROR, Some(XidError::Value(13)), 0),
            (EventTypes::CRITICAL_XID_ERROR, Some(XidError::Value(31)), 1),
            (EventTypes::DOUBLE_BIT_ECC_ERROR, None, 1),
        ]
    );
    assert!(matches!(set.wait(50), Err(NvmlError::Timeout)));
}

#[test]
fn wait_times_out_when_nothing_happens() {
    let host = Host::new("");
    let nvml = host.nvml();
    let set = watch_all(&nvml);
    let start = Instant::now();
    assert!(matches!(set.wait(100), Err(NvmlError::Timeout)));
    let waited = start.elapsed();
    assert!(waited >= Duration::from_millis(100), "{waited:?}");
    assert!(waited < Duration::from_secs(2), "{waited:?}");
}

#[test]
fn only_the_registered_types_and_gpus_get_events() {
    let host = Host::new("");
    let nvml = host.nvml();
    let set = nvml.create_event_set().unwrap();
    let set = nvml.device_by_index(0).unwrap().register_events(EventTypes::CRITICAL_XID_ERROR, set).unwrap();
    // Another set, registered on GPU 1 only: the events of GPU 1 go there, not to `set`.
    let other = nvml.create_event_set().unwrap();
    let other = nvml.device_by_index(1).unwrap().register_events(HEALTH, other).unwrap();
    host.inject("ecc_dbe 0");
    host.inject("xid 1 48");
    host.inject("xid 0 43");
    assert_eq!(describe(&set.wait(ARRIVES).unwrap()), (EventTypes::CRITICAL_XID_ERROR, Some(XidError::Value(43)), 0));
    assert!(matches!(set.wait(50), Err(NvmlError::Timeout)));
    assert_eq!(describe(&other.wait(ARRIVES).unwrap()), (EventTypes::CRITICAL_XID_ERROR, Some(XidError::Value(48)), 1));
    assert!(matches!(other.wait(50), Err(NvmlError::Timeout)));
}

#[test]
fn supported_event_types_follow_the_configuration() {
    let host = Host::new("event_types 1 0x8\ngpu_error 0 nvmlDeviceGetSupportedEventTypes 3\n");
    let nvml = host.nvml();
    let gpu0 = nvml.device_by_index(0).unwrap();
    let gpu1 = nvml.device_by_index(1).unwrap();
    assert!(matches!(gpu0.supported_event_types(), Err(NvmlError::NotSupported)));
    assert_eq!(gpu1.supported_event_types().unwrap(), EventTypes::CRITICAL_XID_ERROR);
    let set = nvml.create_event_set().unwrap();
    let err = gpu1.register_events(HEALTH, set).unwrap_err();
    assert!(matches!(err.error, NvmlError::NotSupported), "{err:?}");
    let set = gpu1.register_events(EventTypes::CRITICAL_XID_ERROR, nvml.create_event_set().unwrap()).unwrap();
    drop(set);

    let defaults = Host::new("");
    let nvml = defaults.nvml();
    let supported = nvml.device_by_index(0).unwrap().supported_event_types().unwrap();
    assert_eq!(supported, HEALTH | EventTypes::PSTATE_CHANGE);
}

#[test]
fn a_lost_gpu_answers_gpu_is_lost_until_it_recovers() {
    let host = Host::new("");
    let nvml = host.nvml();
    let gpu1 = nvml.device_by_index(1).unwrap();
    assert_eq!(gpu1.memory_info().unwrap().total, 200 * 1024 * 1024);

    host.inject("lost 1");
    assert!(matches!(gpu1.memory_info(), Err(NvmlError::GpuLost)));
    assert!(matches!(gpu1.uuid(), Err(NvmlError::GpuLost)));
    assert!(matches!(gpu1.name(), Err(NvmlError::GpuLost)));
    assert!(matches!(gpu1.index(), Err(NvmlError::GpuLost)));
    assert!(matches!(gpu1.minor_number(), Err(NvmlError::GpuLost)));
    assert!(matches!(gpu1.pci_info(), Err(NvmlError::GpuLost)));
    assert!(matches!(gpu1.numa_node_id(), Err(NvmlError::GpuLost)));
    assert!(matches!(gpu1.supported_event_types(), Err(NvmlError::GpuLost)));
    assert!(matches!(nvml.device_by_index(1), Err(NvmlError::GpuLost)));
    assert!(matches!(nvml.device_by_uuid("GPU-fake-h-1"), Err(NvmlError::GpuLost)));
    // The other GPU and the host-wide calls still answer.
    assert_eq!(nvml.device_count().unwrap(), 2);
    assert_eq!(nvml.device_by_index(0).unwrap().uuid().unwrap(), "GPU-fake-h-0");

    host.inject("recover 1");
    assert_eq!(gpu1.memory_info().unwrap().total, 200 * 1024 * 1024);
    assert_eq!(gpu1.uuid().unwrap(), "GPU-fake-h-1");
    assert_eq!(nvml.device_by_index(1).unwrap().index().unwrap(), 1);
}

#[test]
fn a_lost_gpu_still_reports_events() {
    let host = Host::new("");
    let nvml = host.nvml();
    let set = watch_all(&nvml);
    host.inject("lost 1");
    host.inject("xid 1 79");
    let event = set.wait(ARRIVES).unwrap();
    assert_eq!(event.event_type, EventTypes::CRITICAL_XID_ERROR);
    assert!(matches!(event.device.index(), Err(NvmlError::GpuLost)), "the index is a query too");
    host.inject("recover 1");
    assert_eq!(event.device.index().unwrap(), 1);
}

#[test]
fn a_line_counts_only_once_it_is_complete() {
    let host = Host::new("");
    let nvml = host.nvml();
    let set = watch_all(&nvml);
    std::fs::write(&host.events, "xid 0 4").unwrap();
    assert!(matches!(set.wait(100), Err(NvmlError::Timeout)));
    host.inject("3");
    assert_eq!(describe(&set.wait(ARRIVES).unwrap()), (EventTypes::CRITICAL_XID_ERROR, Some(XidError::Value(43)), 0));
}

#[test]
fn malformed_lines_are_skipped() {
    let host = Host::new("");
    let nvml = host.nvml();
    let set = watch_all(&nvml);
    for bad in ["bogus 1", "xid 7 1", "xid 1", "xid 1 -4", "ecc_dbe 0 0", "lost", "recover x", "# a comment", ""] {
        host.inject(bad);
    }
    host.inject("  xid 0 31  ");
    assert_eq!(describe(&set.wait(ARRIVES).unwrap()), (EventTypes::CRITICAL_XID_ERROR, Some(XidError::Value(31)), 0));
    assert!(matches!(set.wait(50), Err(NvmlError::Timeout)));
    assert!(nvml.device_by_index(0).unwrap().memory_info().is_ok(), "no GPU was lost");
}

#[test]
fn the_event_file_is_replayed_at_init() {
    let host = Host::new("");
    host.inject("lost 0");
    host.inject("xid 0 79");
    let nvml = host.nvml();
    assert!(matches!(nvml.device_by_index(0), Err(NvmlError::GpuLost)), "still lost after a restart");
    let set = nvml.create_event_set().unwrap();
    let set = nvml.device_by_index(1).unwrap().register_events(HEALTH, set).unwrap();
    assert!(matches!(set.wait(50), Err(NvmlError::Timeout)), "events before registration are not delivered");
    host.inject("recover 0");
    assert!(nvml.device_by_index(0).is_ok());
}

#[test]
fn inject_refuses_two_lines_at_once() {
    let host = Host::new("");
    let err = inject(&host.events, "lost 0\nrecover 0").unwrap_err();
    assert!(err.to_string().contains("one event per call"), "{err}");
    inject(&host.events, "lost 0\n").unwrap();
    assert_eq!(std::fs::read_to_string(&host.events).unwrap(), "lost 0\n");
}

/// What NVIDIA's DRA driver asks while it enumerates the GPUs (docs/comparison.md).
#[test]
fn the_dra_drivers_enumeration_calls_answer_an_ampere_board_without_mig() {
    let host = Host::new("");
    let nvml = host.nvml();
    let gpu = nvml.device_by_index(0).unwrap();
    assert_eq!(gpu.architecture().unwrap(), nvml_wrapper::enums::device::DeviceArchitecture::Ampere);
    assert_eq!(gpu.brand().unwrap(), nvml_wrapper::enum_wrappers::device::Brand::Nvidia);
    assert!(matches!(gpu.mig_mode(), Err(NvmlError::NotSupported)));
    assert_eq!(nvml.sys_cuda_driver_version().unwrap(), 12080);
    host.inject("lost 0");
    assert!(matches!(gpu.architecture(), Err(NvmlError::GpuLost)));
}
