//! The checks gpushared runs on its configuration against this host before it serves: the
//! node's name, the GPUs (from NVML or `[[gpus]]`), `[sharing]` against those GPUs, the
//! inventory, the size of the device list the kubelet will receive, and with `[device_nodes]`
//! on, each GPU's device node. The daemon's start and
//! `gpushared --check-config` both call [`inspect_host`], so a file the check calls usable is one
//! the daemon starts with.

use gpushare_core::devices::{DeviceMap, KUBELET_MAX_MESSAGE_BYTES, list_and_watch_size};
use gpushare_core::{Gpu, NodeInventory};
use thiserror::Error;

use crate::allocation::ledger::{EventKind, Ledger, LedgerError};
use crate::cluster::confine::ConfineError;
use crate::config::{Config, StaticGpu};
use crate::gpus::discovery::{Discovery, DiscoveryError, Lost, NvmlDiscovery, StaticDiscovery, account_for_lost};

/// Why the daemon would not start with this configuration on this host.
#[derive(Debug, Error)]
pub enum StartupError {
    /// No usable node name.
    #[error("cannot tell this node's name: set node_name in the configuration or the NODE_NAME variable")]
    NodeName,
    /// The GPUs cannot be listed.
    #[error(transparent)]
    Discovery(#[from] DiscoveryError),
    /// `[sharing]` does not fit the GPUs found.
    #[error("{0}")]
    Sharing(String),
    /// The GPUs found do not make an inventory.
    #[error("GPUs from {source_name}: {reason}")]
    Inventory {
        /// Where they came from.
        source_name: String,
        /// What is wrong.
        reason: String,
    },
    /// The kubelet would drop the whole device list.
    #[error(
        "this node's device list ({devices} devices of 1 {unit}) would be {size} bytes, over the kubelet's \
         {KUBELET_MAX_MESSAGE_BYTES}-byte message limit, and the kubelet would drop every device; {hint}"
    )]
    ListTooLarge {
        /// Devices listed.
        devices: u64,
        /// The unit.
        unit: gpushare_core::MemoryUnit,
        /// The encoded size.
        size: usize,
        /// What to change.
        hint: &'static str,
    },
    /// `[kubernetes] confine_network` is on and no confinement can be made.
    #[error(transparent)]
    Confine(#[from] ConfineError),
}

/// What the checks found: the host as the daemon will serve it.
#[derive(Debug)]
pub struct Host {
    /// This node's name.
    pub node: String,
    /// Its GPUs, modes applied.
    pub inventory: NodeInventory,
    /// Where the GPUs came from, for logs.
    pub source: String,
    /// NVML, when the GPUs came from it (the daemon keeps using it).
    pub nvml: Option<NvmlDiscovery>,
    /// The GPUs that did not answer, and what became of each.
    pub lost: Vec<Lost>,
    /// What the checks noticed and let pass (e.g. `[sharing]` naming a GPU that may be the one
    /// that does not answer).
    pub notes: Vec<String>,
}

impl Host {
    /// The GPUs that answered (their identity is worth remembering).
    pub fn answering(&self) -> impl Iterator<Item = &Gpu> {
        self.inventory
            .gpus()
            .iter()
            .filter(|g| !self.lost.iter().any(|l| matches!(l, Lost::Served { gpu, .. } if gpu.uuid == g.uuid)))
    }
}

/// Runs every check the daemon runs on `config` before it serves. `known`: the GPUs the ledger
/// remembers (none for `--check-config`, which does not open the ledger).
///
/// # Errors
/// The first [`StartupError`].
pub fn inspect_host(config: &Config, known: &[Gpu]) -> Result<Host, StartupError> {
    let node = config.node_name().ok_or(StartupError::NodeName)?;
    // A confinement asked for is made by the unit's generator from this same answer: refusing
    // here keeps the daemon from running unconfined when it cannot be made.
    crate::cluster::confine::drop_in(config)?;
    let nvml = if config.gpus.is_empty() { Some(NvmlDiscovery::init(&config.nvml.library)?) } else { None };
    let (found, source) = match &nvml {
        Some(n) => (n.discover()?, n.describe()),
        None => {
            let s = StaticDiscovery::new(config.gpus.iter().map(StaticGpu::to_gpu).collect());
            (s.discover()?, s.describe())
        }
    };
    // The static list is the operator's word: a GPU left out of it is not lost.
    let known = if nvml.is_some() { known } else { &[] };
    let (mut gpus, lost) = account_for_lost(found, known);
    let silent: Vec<u32> =
        lost.iter().filter_map(|l| if let Lost::Unknown(s) = l { Some(s.index) } else { None }).collect();
    let notes = config.sharing.apply(&mut gpus, &silent).map_err(StartupError::Sharing)?;
    let inventory = NodeInventory::new(config.resources.unit, gpus)
        .map_err(|e| StartupError::Inventory { source_name: source.clone(), reason: e.to_string() })?;
    check_list_size(&inventory, config.resources.numa_topology)?;
    let mut notes = notes;
    notes.extend(missing_device_nodes(config, &inventory));
    Ok(Host { node, inventory, source, nvml, lost, notes })
}

/// With `[device_nodes]` on, a note for each GPU whose node under `host_dir` is not a character
/// device: the runtime would refuse its containers, naming the path.
fn missing_device_nodes(config: &Config, inventory: &NodeInventory) -> Vec<String> {
    use std::os::unix::fs::FileTypeExt as _;
    inventory
        .gpus()
        .iter()
        .filter_map(|g| {
            let node = config.device_nodes.nodes(&[g.device_number()]).into_iter().find(|n| n.required)?;
            let is_device = std::fs::metadata(&node.host_path).is_ok_and(|m| m.file_type().is_char_device());
            (!is_device).then(|| {
                format!(
                    "[device_nodes]: {} is not a character device, so the runtime would refuse the containers of \
                     GPU {} ({}); set host_dir to where the driver's nodes are, or load the driver",
                    node.host_path.display(),
                    g.index,
                    g.uuid
                )
            })
        })
        .collect()
}

/// Records in the ledger what discovery found: the identity of every GPU that answered, an
/// event (`gpu-lost`) for each that did not, and a replaced GPU forgotten (`gpu-replaced`).
/// Each is logged too.
///
/// # Errors
/// [`LedgerError`] if SQLite refuses.
pub fn record_discovery(ledger: &mut Ledger, host: &Host) -> Result<(), LedgerError> {
    let answering: Vec<Gpu> = host.answering().cloned().collect();
    ledger.remember_gpus(&answering)?;
    for lost in &host.lost {
        let detail = lost.describe();
        match lost {
            Lost::Served { gpu, .. } => {
                tracing::error!(gpu = gpu.index, uuid = %gpu.uuid, "{detail}");
                ledger.record_event(EventKind::GpuLost, &detail)?;
            }
            Lost::Replaced { old, .. } => {
                tracing::warn!(gpu = old.index, uuid = %old.uuid, "{detail}");
                ledger.forget_gpu(old.uuid.as_str(), EventKind::GpuReplaced, &detail)?;
            }
            Lost::Unknown(s) => {
                tracing::error!(gpu = s.index, "{detail}");
                ledger.record_event(EventKind::GpuLost, &detail)?;
            }
        }
    }
    for note in &host.notes {
        tracing::warn!("{note}");
    }
    Ok(())
}

/// Refuses an inventory whose device list would be over the kubelet's message limit.
///
/// # Errors
/// [`StartupError::ListTooLarge`] with the setting to change.
pub fn check_list_size(inventory: &NodeInventory, numa: bool) -> Result<(), StartupError> {
    let size = list_and_watch_size(inventory, numa);
    if size <= KUBELET_MAX_MESSAGE_BYTES {
        return Ok(());
    }
    let hint = if numa && list_and_watch_size(inventory, false) <= KUBELET_MAX_MESSAGE_BYTES {
        "set [resources] numa_topology = false, or unit = \"GiB\" on every node and the extender"
    } else {
        "set [resources] unit = \"GiB\" on every node and the extender"
    };
    Err(StartupError::ListTooLarge { devices: DeviceMap::new(inventory).total(), unit: inventory.unit(), size, hint })
}
