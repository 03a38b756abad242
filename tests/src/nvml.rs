//! The fake NVML library (`tests/fake-nvml/fake_nvml.c`), built with the system C compiler
//! into a directory of the test's, its configuration file, and its event file.
//!
//! The daemon loads the library through nvml-wrapper's normal path; `FAKE_NVML_CONFIG` in the
//! daemon's environment names the configuration. A test that loads the library in its own
//! process (and cannot set the environment) writes the configuration to [`config_beside`]
//! instead: each built copy of the library reads its own.
//!
//! GPU events are injected while the library is in use: the configuration names an event file
//! ([`events_directive`]) and the test appends lines to it with [`inject`]: `xid <gpu> <code>`,
//! `ecc_dbe <gpu>`, `ecc_sbe <gpu>`, `lost <gpu>`, `recover <gpu>`, and what the GPU is doing from
//! then on: `util <gpu> <percent>`, `used <gpu> <mib>` (see the C file's header).

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};

/// The C source.
pub const SOURCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fake-nvml/fake_nvml.c");

/// One simulated GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeGpu {
    /// NVML UUID.
    pub uuid: String,
    /// Total memory, MiB.
    pub memory_mib: u64,
    /// `/dev/nvidiaN` minor number.
    pub minor: u32,
    /// NUMA node; `None` makes NVML answer "not supported".
    pub numa: Option<u32>,
    /// PCI bus id.
    pub pci: String,
    /// Product name.
    pub name: String,
}

impl FakeGpu {
    /// GPU `i` of a host: UUID `GPU-fake-<host>-<i>`, minor `i`, bus `00000000:<i+0x10>:00.0`.
    #[must_use]
    pub fn new(host: &str, i: u32, memory_mib: u64, name: &str) -> Self {
        FakeGpu {
            uuid: format!("GPU-fake-{host}-{i}"),
            memory_mib,
            minor: i,
            numa: None,
            pci: format!("00000000:{:02X}:00.0", i + 0x10),
            name: name.to_owned(),
        }
    }

    /// This GPU with a UUID of NVIDIA's form (`GPU-` and 32 hex digits in groups of 8-4-4-4-12),
    /// made from its own: the same GPU gets the same UUID. Tools that parse UUIDs (NVIDIA's CDI
    /// generation) refuse the `GPU-fake-…` form.
    #[must_use]
    pub fn with_nvidia_uuid(mut self) -> Self {
        // FNV-1a, 128 bits as two 64-bit halves with different seeds.
        let hash = |seed: u64| self.uuid.bytes().fold(seed, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
        let hex = format!("{:016x}{:016x}", hash(0xcbf2_9ce4_8422_2325), hash(0x8422_2325_cbf2_9ce4));
        self.uuid = format!("GPU-{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..]);
        self
    }
}

/// Builds the library as `<dir>/libnvidia-ml.so.1`.
///
/// # Errors
/// If the compiler is missing or fails.
pub fn build(dir: &Path) -> anyhow::Result<PathBuf> {
    let out = dir.join("libnvidia-ml.so.1");
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-shared", "-fPIC", "-pthread", "-O1", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&out)
        .arg(SOURCE)
        .arg("-ldl")
        .status()
        .context("running the C compiler (cc) to build the fake NVML library")?;
    if !status.success() {
        bail!("building {SOURCE} failed: {status}");
    }
    Ok(out)
}

/// Writes a configuration for the library: the GPUs, then `extra` directives verbatim.
///
/// # Errors
/// If the file cannot be written.
pub fn write_config(path: &Path, gpus: &[FakeGpu], extra: &str) -> anyhow::Result<()> {
    let mut text = String::from("# fake NVML host\n");
    for g in gpus {
        let numa = g.numa.map_or_else(|| "-1".to_owned(), |n| n.to_string());
        let _ = writeln!(text, "gpu {} {} {} {numa} {} {}", g.uuid, g.memory_mib, g.minor, g.pci, g.name);
    }
    text.push_str(extra);
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Where the library built at `library` looks for its configuration when `FAKE_NVML_CONFIG` is
/// not set: `<library>.conf`, e.g. `libnvidia-ml.so.1.conf` beside it.
#[must_use]
pub fn config_beside(library: &Path) -> PathBuf {
    let mut path = library.as_os_str().to_owned();
    path.push(".conf");
    PathBuf::from(path)
}

/// The configuration directive naming the event file, with its newline, for `extra` of
/// [`write_config`].
#[must_use]
pub fn events_directive(events_file: &Path) -> String {
    format!("events {}\n", events_file.display())
}

/// Appends one event line (`xid 1 79`, `ecc_dbe 0`, `lost 1`, ...) to the event file, creating
/// it if needed. The line and its newline go in one write, so the library never reads half of
/// it.
///
/// # Errors
/// If the line has a newline inside, or the file cannot be opened or written.
pub fn inject(events_file: &Path, line: &str) -> anyhow::Result<()> {
    let line = line.strip_suffix('\n').unwrap_or(line);
    if line.contains(['\n', '\r']) {
        bail!("one event per call: {line:?} has a line break inside");
    }
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(events_file)
        .with_context(|| format!("opening {}", events_file.display()))?;
    file.write_all(format!("{line}\n").as_bytes())
        .and_then(|()| file.flush())
        .with_context(|| format!("appending {line:?} to {}", events_file.display()))
}

/// The NVIDIA driver's device nodes for `gpus`, made under `dir` (created if missing) as a
/// driver makes them in a GPU host's `/dev`: character devices `nvidia<minor>` (major 195) for
/// each GPU, `nvidiactl` (195, 255) and `nvidia-uvm` (510, 0; dynamic on a host). Opening one
/// fails (there is no driver); a runtime reads their type and numbers and makes them in
/// containers. A node already there is kept.
///
/// # Errors
/// If `mknod` fails (it needs root).
pub fn make_device_nodes(dir: &Path, gpus: &[FakeGpu]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let devices = gpus.iter().map(|g| (format!("nvidia{}", g.minor), 195, g.minor));
    for (name, major, minor) in devices.chain([("nvidiactl".into(), 195, 255), ("nvidia-uvm".into(), 510, 0)]) {
        let path = dir.join(name);
        if path.exists() {
            continue;
        }
        let status = Command::new("mknod")
            .args(["-m", "666"])
            .arg(&path)
            .args(["c", &major.to_string(), &minor.to_string()])
            .status()
            .context("running mknod")?;
        anyhow::ensure!(status.success(), "mknod {} failed ({status}): it needs root", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::FakeGpu;

    #[test]
    fn nvidia_uuids_have_nvidias_form_and_are_stable_per_gpu() {
        let a = FakeGpu::new("n", 0, 1, "m").with_nvidia_uuid();
        let groups: Vec<usize> = a.uuid.strip_prefix("GPU-").unwrap().split('-').map(str::len).collect();
        assert_eq!(groups, [8, 4, 4, 4, 12], "{}", a.uuid);
        assert!(a.uuid[4..].chars().all(|c| c == '-' || c.is_ascii_hexdigit()), "{}", a.uuid);
        assert_eq!(a, FakeGpu::new("n", 0, 1, "m").with_nvidia_uuid());
        assert_ne!(a.uuid, FakeGpu::new("n", 1, 1, "m").with_nvidia_uuid().uuid);
        assert_ne!(a.uuid, FakeGpu::new("o", 0, 1, "m").with_nvidia_uuid().uuid);
    }
}
