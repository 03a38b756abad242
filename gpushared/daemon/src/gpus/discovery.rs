//! GPU discovery, behind one trait: NVML through nvml-wrapper on real hosts (and on the fake
//! NVML library in tests, through the very same code path), or the static `[[gpus]]` list of
//! the configuration for hosts without NVML. One GPU that does not answer does not stop the
//! others: it is reported ([`Silent`]), and [`account_for_lost`] serves it, unhealthy, under the
//! identity the ledger remembers.

use std::path::{Path, PathBuf};

use std::collections::{BTreeMap, BTreeSet};

use gpushare_core::{Gpu, GpuUuid, Health, Mib};
use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;
use thiserror::Error;

/// Why the GPUs could not be discovered.
#[derive(Debug, Error)]
pub enum DiscoveryError {
    /// NVML could not be loaded or initialised.
    #[error(
        "cannot use NVML from {library}: {error}; install the NVIDIA driver, point [nvml] library at its \
         libnvidia-ml.so.1, or list the GPUs under [[gpus]] in the configuration"
    )]
    Init {
        /// The library asked for.
        library: PathBuf,
        /// What nvml-wrapper said.
        error: NvmlError,
    },
    /// NVML answered a query with an error.
    #[error("NVML: {what}: {error}")]
    Query {
        /// The query, with the GPU.
        what: String,
        /// What nvml-wrapper said.
        error: NvmlError,
    },
    /// NVML returned a value gpushare cannot use.
    #[error("NVML: {0}")]
    Unusable(String),
}

/// A GPU NVML counts that did not answer a query.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Silent {
    /// Its NVML index.
    pub index: u32,
    /// The query and NVML's error.
    pub reason: String,
}

/// What discovery found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Found {
    /// The GPUs that answered, in index order.
    pub gpus: Vec<Gpu>,
    /// Those that did not.
    pub silent: Vec<Silent>,
}

/// A source of the host's GPUs.
pub trait Discovery: Send + Sync {
    /// The GPUs, in index order, and those that did not answer.
    ///
    /// # Errors
    /// [`DiscoveryError`] when the GPUs cannot be listed at all.
    fn discover(&self) -> Result<Found, DiscoveryError>;

    /// Where the GPUs come from, for logs.
    fn describe(&self) -> String;
}

/// GPUs from NVML.
pub struct NvmlDiscovery {
    nvml: Nvml,
    library: PathBuf,
}

impl std::fmt::Debug for NvmlDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlDiscovery").field("library", &self.library).finish_non_exhaustive()
    }
}

impl NvmlDiscovery {
    /// Loads and initialises NVML from `library` (a path, or a name the loader resolves).
    ///
    /// # Errors
    /// [`DiscoveryError::Init`] naming the library and the fixes.
    pub fn init(library: &Path) -> Result<Self, DiscoveryError> {
        let nvml = Nvml::builder()
            .lib_path(library.as_os_str())
            .init()
            .map_err(|error| DiscoveryError::Init { library: library.to_owned(), error })?;
        Ok(NvmlDiscovery { nvml, library: library.to_owned() })
    }

    /// GPU `i`'s identity; an error when one of the queries that make it fails.
    fn gpu(&self, i: u32) -> Result<Gpu, DiscoveryError> {
        let q = |what: String| move |error| DiscoveryError::Query { what, error };
        let d = self.nvml.device_by_index(i).map_err(q(format!("GPU{i}")))?;
        let uuid = d.uuid().map_err(q(format!("GPU{i} UUID")))?;
        let uuid = GpuUuid::new(uuid).map_err(|e| DiscoveryError::Unusable(format!("GPU{i}: {e}")))?;
        let model = d.name().map_err(q(format!("GPU{i} name")))?;
        let total = d.memory_info().map_err(q(format!("GPU{i} memory")))?.total / (1024 * 1024);
        let mut gpu = Gpu::new(i, uuid, model, Mib::new(total));
        gpu.minor = d.minor_number().ok();
        gpu.pci_bus_id = d.pci_info().ok().map(|p| p.bus_id);
        // NotSupported on single-socket hosts and older drivers: no NUMA node then.
        gpu.numa_node = d.numa_node_id().ok();
        Ok(gpu)
    }

    /// The driver version NVML reports.
    ///
    /// # Errors
    /// [`DiscoveryError::Query`].
    pub fn driver_version(&self) -> Result<String, DiscoveryError> {
        self.nvml.sys_driver_version().map_err(|error| DiscoveryError::Query { what: "driver version".into(), error })
    }
}

impl Discovery for NvmlDiscovery {
    fn discover(&self) -> Result<Found, DiscoveryError> {
        let count =
            self.nvml.device_count().map_err(|error| DiscoveryError::Query { what: "device count".into(), error })?;
        let mut found = Found::default();
        for index in 0..count {
            match self.gpu(index) {
                Ok(gpu) => found.gpus.push(gpu),
                Err(e) => found.silent.push(Silent { index, reason: e.to_string() }),
            }
        }
        Ok(found)
    }

    fn describe(&self) -> String {
        format!("NVML ({})", self.library.display())
    }
}

/// GPUs listed in the configuration, for hosts without NVML.
#[derive(Debug, Clone)]
pub struct StaticDiscovery {
    gpus: Vec<Gpu>,
}

impl StaticDiscovery {
    /// The configured GPUs.
    #[must_use]
    pub fn new(gpus: Vec<Gpu>) -> Self {
        StaticDiscovery { gpus }
    }
}

impl Discovery for StaticDiscovery {
    fn discover(&self) -> Result<Found, DiscoveryError> {
        Ok(Found { gpus: self.gpus.clone(), silent: Vec::new() })
    }

    fn describe(&self) -> String {
        "the static [[gpus]] list of the configuration (NVML not used)".to_owned()
    }
}

/// What became of a GPU that did not answer at start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lost {
    /// Remembered by the ledger: served, unhealthy, under its last identity (in the GPUs
    /// [`account_for_lost`] returns); it is healthy again once it answers.
    Served {
        /// Its last identity.
        gpu: Gpu,
        /// Why it is unhealthy.
        reason: String,
    },
    /// Remembered, but its index now belongs to a GPU that answers with another UUID: replaced.
    /// The caller forgets it.
    Replaced {
        /// Its last identity.
        old: Gpu,
        /// The GPU at its index now.
        by: GpuUuid,
    },
    /// Counted by NVML but never seen answering here: there is no identity to serve it under.
    /// It is served once it answers and gpushared restarts.
    Unknown(Silent),
}

impl Lost {
    /// One sentence for logs, the ledger's history and `--check-config`.
    #[must_use]
    pub fn describe(&self) -> String {
        match self {
            Lost::Served { gpu, reason } => format!(
                "GPU{} ({}, {}, {}) {reason}; it is served unhealthy under its last identity and is healthy \
                 again once it answers",
                gpu.index, gpu.uuid, gpu.model, gpu.total
            ),
            Lost::Replaced { old, by } => format!(
                "GPU{} ({}, {}) is gone and {by} answers at its index: replaced; its identity is forgotten",
                old.index, old.uuid, old.model
            ),
            Lost::Unknown(s) => format!(
                "GPU{} does not answer ({}) and was never seen answering on this host, so its identity is \
                 unknown: it is not served until it answers and gpushared restarts",
                s.index, s.reason
            ),
        }
    }
}

/// The GPUs to serve: those `found` answering, plus each GPU the ledger remembers (`known`)
/// that did not answer, unhealthy under its last identity; and what became of every GPU that
/// did not answer. Pure: the daemon's start and its tests call it.
#[must_use]
pub fn account_for_lost(found: Found, known: &[Gpu]) -> (Vec<Gpu>, Vec<Lost>) {
    let Found { mut gpus, silent } = found;
    let answered: BTreeSet<&str> = gpus.iter().map(|g| g.uuid.as_str()).collect();
    let mut at_index: BTreeMap<u32, GpuUuid> = gpus.iter().map(|g| (g.index, g.uuid.clone())).collect();
    let mut silent: BTreeMap<u32, Silent> = silent.into_iter().map(|s| (s.index, s)).collect();
    let mut lost = Vec::new();
    let missing: Vec<&Gpu> = known.iter().filter(|k| !answered.contains(k.uuid.as_str())).collect();
    for k in missing {
        if let Some(by) = at_index.get(&k.index) {
            lost.push(Lost::Replaced { old: k.clone(), by: by.clone() });
            continue;
        }
        let why = silent
            .remove(&k.index)
            .map_or_else(|| "NVML no longer lists it (fallen off the bus, or removed)".to_owned(), |s| s.reason);
        let reason = format!("does not answer: {why}");
        let mut gpu = k.clone();
        gpu.health = Health::Unhealthy { reason: reason.clone() };
        at_index.insert(gpu.index, gpu.uuid.clone());
        lost.push(Lost::Served { gpu: gpu.clone(), reason });
        gpus.push(gpu);
    }
    lost.extend(silent.into_values().map(Lost::Unknown));
    gpus.sort_by_key(|g| g.index);
    (gpus, lost)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, uuid: &str) -> Gpu {
        Gpu::new(index, GpuUuid::new(uuid).unwrap(), "Tesla T4", Mib::new(15360))
    }

    fn silent(index: u32) -> Silent {
        Silent { index, reason: format!("NVML: GPU{index} UUID: GPU is lost") }
    }

    #[test]
    fn a_remembered_gpu_that_does_not_answer_is_served_unhealthy_under_its_identity() {
        let mut known = gpu(1, "GPU-b");
        known.minor = Some(1);
        known.pci_bus_id = Some("00000000:3B:00.0".into());
        let found = Found { gpus: vec![gpu(0, "GPU-a"), gpu(2, "GPU-c")], silent: vec![silent(1)] };
        let (gpus, lost) = account_for_lost(found, &[gpu(0, "GPU-a"), known.clone(), gpu(2, "GPU-c")]);
        let uuids: Vec<&str> = gpus.iter().map(|g| g.uuid.as_str()).collect();
        assert_eq!(uuids, ["GPU-a", "GPU-b", "GPU-c"]);
        let reason = "does not answer: NVML: GPU1 UUID: GPU is lost".to_owned();
        assert_eq!(gpus[1].health, Health::Unhealthy { reason: reason.clone() });
        assert_eq!((gpus[1].minor, gpus[1].pci_bus_id.as_deref()), (Some(1), Some("00000000:3B:00.0")));
        assert!(matches!(&lost[..], [Lost::Served { gpu, reason: r }] if gpu.uuid.as_str() == "GPU-b" && *r == reason));
    }

    #[test]
    fn a_gpu_nvml_no_longer_counts_is_served_unhealthy_too() {
        let found = Found { gpus: vec![gpu(0, "GPU-a")], silent: vec![] };
        let (gpus, lost) = account_for_lost(found, &[gpu(0, "GPU-a"), gpu(1, "GPU-b")]);
        assert_eq!(gpus.len(), 2);
        assert!(matches!(&gpus[1].health, Health::Unhealthy { reason } if reason.contains("no longer lists it")));
        assert_eq!(lost.len(), 1);
    }

    #[test]
    fn a_gpu_whose_index_another_now_answers_on_was_replaced() {
        let found = Found { gpus: vec![gpu(0, "GPU-a"), gpu(1, "GPU-new")], silent: vec![] };
        let (gpus, lost) = account_for_lost(found, &[gpu(0, "GPU-a"), gpu(1, "GPU-b")]);
        assert_eq!(gpus.len(), 2);
        assert!(gpus.iter().all(|g| g.health.is_healthy()));
        assert!(
            matches!(&lost[..], [Lost::Replaced { old, by }] if old.uuid.as_str() == "GPU-b" && by.as_str() == "GPU-new")
        );
    }

    #[test]
    fn a_silent_gpu_never_seen_before_is_reported_and_not_served() {
        let found = Found { gpus: vec![gpu(0, "GPU-a")], silent: vec![silent(1)] };
        let (gpus, lost) = account_for_lost(found, &[]);
        assert_eq!(gpus.len(), 1);
        assert_eq!(lost, [Lost::Unknown(silent(1))]);
        // Every GPU answering: nothing lost, the order kept.
        let found = Found { gpus: vec![gpu(0, "GPU-a"), gpu(1, "GPU-b")], silent: vec![] };
        let (gpus, lost) = account_for_lost(found.clone(), &[gpu(1, "GPU-b")]);
        assert_eq!((gpus, lost), (found.gpus, vec![]));
    }

    #[test]
    fn an_nvml_error_is_told_once() {
        // main prints the error with its chain ("{e:#}"): the NVML text is in the message, so
        // it must not be the error's source as well (it was printed three times).
        let e = DiscoveryError::Init { library: PathBuf::from("libnvidia-ml.so.1"), error: NvmlError::DriverNotLoaded };
        assert!(std::error::Error::source(&e).is_none());
        let text = e.to_string();
        assert_eq!(text.matches(&NvmlError::DriverNotLoaded.to_string()).count(), 1, "{text}");
        assert!(text.contains("install the NVIDIA driver"), "{text}");
    }
}
