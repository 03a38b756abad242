//! GPU discovery, behind one trait: NVML through nvml-wrapper on real hosts (and on the fake
//! NVML library in tests, through the very same code path), or the static `[[gpus]]` list of
//! the configuration for hosts without NVML.

use std::path::{Path, PathBuf};

use gpushare_core::{Gpu, GpuUuid, Mib};
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

/// A source of the host's GPUs.
pub trait Discovery: Send + Sync {
    /// The GPUs, in index order.
    ///
    /// # Errors
    /// [`DiscoveryError`] when the GPUs cannot be listed.
    fn discover(&self) -> Result<Vec<Gpu>, DiscoveryError>;

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

    /// The driver version NVML reports.
    ///
    /// # Errors
    /// [`DiscoveryError::Query`].
    pub fn driver_version(&self) -> Result<String, DiscoveryError> {
        self.nvml.sys_driver_version().map_err(|error| DiscoveryError::Query { what: "driver version".into(), error })
    }
}

impl Discovery for NvmlDiscovery {
    fn discover(&self) -> Result<Vec<Gpu>, DiscoveryError> {
        let q = |what: String| move |error| DiscoveryError::Query { what, error };
        let count = self.nvml.device_count().map_err(q("device count".into()))?;
        let mut gpus = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
        for i in 0..count {
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
            gpus.push(gpu);
        }
        Ok(gpus)
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
    fn discover(&self) -> Result<Vec<Gpu>, DiscoveryError> {
        Ok(self.gpus.clone())
    }

    fn describe(&self) -> String {
        "the static [[gpus]] list of the configuration (NVML not used)".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
