//! `[sharing]` and `[mps]`: how each GPU is shared (GPUs named by index or UUID) and, for the
//! GPUs shared through CUDA MPS, where its control daemon's pipes, logs and environment live and
//! how much of the GPU's threads each client gets.

use gpushare_core::{Gpu, Mib};
use serde::Deserialize;

use super::{AbsPath, abs, yes};

/// A GPU named in the configuration: its index or its UUID.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum GpuRef {
    /// The NVML index.
    Index(u32),
    /// The UUID (`GPU-...`).
    Uuid(String),
}

impl GpuRef {
    /// Whether `gpu` is the one named.
    #[must_use]
    pub fn names(&self, gpu: &Gpu) -> bool {
        match self {
            GpuRef::Index(i) => gpu.index == *i,
            GpuRef::Uuid(u) => gpu.uuid.as_str() == u,
        }
    }
}

impl std::fmt::Display for GpuRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuRef::Index(i) => write!(f, "GPU {i}"),
            GpuRef::Uuid(u) => write!(f, "GPU {u}"),
        }
    }
}

/// `[sharing]`: how each GPU's memory is shared. Every GPU is `shared` unless listed here.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharingConfig {
    /// GPUs (index or UUID) whose containers are clients of CUDA MPS.
    #[serde(default)]
    pub mps: Vec<GpuRef>,
    /// GPUs (index or UUID) handed out whole through `[resources] whole`, never shared.
    #[serde(default)]
    pub whole: Vec<GpuRef>,
    /// GPUs (index or UUID) served through DRA: published in the node's ResourceSlice, shared
    /// by ResourceClaims (docs/dra.md).
    #[serde(default)]
    pub dra: Vec<GpuRef>,
}

impl SharingConfig {
    /// Sets each GPU's mode from this section. When some GPU does not answer and its identity
    /// is unknown (`silent`: their indexes), a name that matches no GPU may be that one: it is
    /// returned as a note instead of refused.
    ///
    /// # Errors
    /// A GPU named here that this host does not have, with the GPUs it has.
    pub fn apply(&self, gpus: &mut [Gpu], silent: &[u32]) -> Result<Vec<String>, String> {
        let mut notes = Vec::new();
        for (key, list) in [("mps", &self.mps), ("whole", &self.whole), ("dra", &self.dra)] {
            for missing in list.iter().filter(|r| !gpus.iter().any(|g| r.names(g))) {
                let have: Vec<String> = gpus.iter().map(|g| format!("{} ({})", g.index, g.uuid)).collect();
                let have = if have.is_empty() { "none".to_owned() } else { have.join(", ") };
                let unidentified = match missing {
                    GpuRef::Index(i) => silent.contains(i),
                    GpuRef::Uuid(_) => !silent.is_empty(),
                };
                if !unidentified {
                    return Err(format!(
                        "[sharing] {key} names {missing}, which this host does not have; its GPUs are {have}"
                    ));
                }
                notes.push(format!(
                    "[sharing] {key} names {missing}, which is not among the GPUs that answer ({have}); it may be \
                     the GPU that does not answer, and applies once that one answers and gpushared restarts"
                ));
            }
        }
        for g in gpus.iter_mut() {
            let named: Vec<&str> = [("mps", &self.mps), ("whole", &self.whole), ("dra", &self.dra)]
                .into_iter()
                .filter(|(_, list)| list.iter().any(|r| r.names(g)))
                .map(|(key, _)| key)
                .collect();
            g.mode = match named.as_slice() {
                [] => gpushare_core::SharingMode::Shared,
                ["mps"] => gpushare_core::SharingMode::Mps,
                ["whole"] => gpushare_core::SharingMode::Whole,
                ["dra"] => gpushare_core::SharingMode::Dra,
                // Served through DRA, its claims' containers MPS clients.
                ["mps", "dra"] => gpushare_core::SharingMode::DraMps,
                _ => {
                    return Err(format!(
                        "[sharing] names GPU {} ({}) in {}; a GPU is served one way: name it in one list",
                        g.index,
                        g.uuid,
                        named.join(" and ")
                    ));
                }
            };
        }
        Ok(notes)
    }
}

/// `[mps]`: what containers on MPS GPUs are given.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MpsConfig {
    /// The MPS control daemon's pipe directory on the host, mounted into MPS containers at the
    /// same path (`CUDA_MPS_PIPE_DIRECTORY`); root's, created by `gpushared-mps.service`.
    #[serde(default = "default_mps_pipe_directory")]
    pub pipe_directory: AbsPath,
    /// Mount the pipe directory read-only into the clients: they reach the control daemon's
    /// sockets and pipes, but cannot remove or replace them.
    #[serde(default = "yes")]
    pub pipe_directory_read_only: bool,
    /// Each MPS client's share of the GPU's threads (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`).
    #[serde(default)]
    pub active_thread_percentage: ThreadShare,
    /// Where the MPS control daemon writes its logs (`CUDA_MPS_LOG_DIRECTORY`).
    #[serde(default = "default_mps_log_directory")]
    pub log_directory: AbsPath,
    /// The environment file `gpushared-mps.service` reads: the MPS GPUs and the two
    /// directories, written at start (removed when no GPU is in MPS mode).
    #[serde(default = "default_mps_environment_file")]
    pub environment_file: AbsPath,
}

impl Default for MpsConfig {
    fn default() -> Self {
        MpsConfig {
            pipe_directory: default_mps_pipe_directory(),
            pipe_directory_read_only: true,
            active_thread_percentage: ThreadShare::default(),
            log_directory: default_mps_log_directory(),
            environment_file: default_mps_environment_file(),
        }
    }
}

fn default_mps_log_directory() -> AbsPath {
    abs("/var/log/nvidia-mps")
}

fn default_mps_environment_file() -> AbsPath {
    abs("/run/gpushare/mps.env")
}

fn default_mps_pipe_directory() -> AbsPath {
    abs("/run/nvidia-mps")
}

/// How an MPS client's thread percentage is set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ThreadShare {
    /// The container's share of the GPU's memory, rounded up (a 4 GiB budget on a 16 GiB GPU
    /// gets 25).
    #[default]
    Proportional,
    /// The same percentage for every client (1 to 100).
    Fixed(u8),
}

impl ThreadShare {
    /// The percentage for a client with `budget` on a GPU of `total` (1 to 100).
    #[must_use]
    pub fn percentage(self, budget: Mib, total: Mib) -> u8 {
        match self {
            ThreadShare::Fixed(p) => p,
            ThreadShare::Proportional if total.get() == 0 => 100,
            ThreadShare::Proportional => {
                let p = (budget.get().saturating_mul(100)).div_ceil(total.get()).clamp(1, 100);
                u8::try_from(p).unwrap_or(100)
            }
        }
    }
}

impl<'de> Deserialize<'de> for ThreadShare {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(i64),
            Word(String),
        }
        let bad = || {
            serde::de::Error::custom(
                "write \"proportional\" (the container's share of the GPU's memory) or a percentage from 1 to 100",
            )
        };
        match Raw::deserialize(d)? {
            Raw::Word(w) if w == "proportional" => Ok(ThreadShare::Proportional),
            Raw::Number(n) => {
                u8::try_from(n).ok().filter(|p| (1..=100).contains(p)).map(ThreadShare::Fixed).ok_or_else(bad)
            }
            Raw::Word(_) => Err(bad()),
        }
    }
}
