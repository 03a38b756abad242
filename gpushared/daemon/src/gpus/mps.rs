//! The host's side of MPS: the environment file that `gpushared-mps.service` (the packaged unit
//! that runs NVIDIA's `nvidia-cuda-mps-control -d`) reads, so the MPS control daemon serves
//! exactly the GPUs `[sharing] mps` names, with the pipe directory the containers are given.
//!
//! gpushared writes it at start, before it tells systemd it is ready; the unit is ordered after
//! gpushared and starts only when the file exists.

use std::io::Write as _;
use std::path::Path;

use gpushare_core::Gpu;

use crate::config::MpsConfig;

/// The file's contents for `gpus`, or `None` when no GPU is in MPS mode.
#[must_use]
pub fn environment(gpus: &[Gpu], mps: &MpsConfig) -> Option<String> {
    let uuids: Vec<&str> = gpus.iter().filter(|g| g.mode.runs_mps()).map(|g| g.uuid.as_str()).collect();
    if uuids.is_empty() {
        return None;
    }
    Some(format!(
        "# Written by gpushared at start from [sharing] mps and [mps]; read by gpushared-mps.service.\n\
         CUDA_VISIBLE_DEVICES={}\nCUDA_MPS_PIPE_DIRECTORY={}\nCUDA_MPS_LOG_DIRECTORY={}\n",
        uuids.join(","),
        mps.pipe_directory.path().display(),
        mps.log_directory.path().display(),
    ))
}

/// Writes `contents` to `path` whole (a temporary file renamed over it), creating its directory;
/// `None` removes the file. Returns what was done, for the log.
///
/// # Errors
/// The I/O error, with the path.
pub fn write_environment(path: &Path, contents: Option<&str>) -> Result<&'static str, String> {
    let fail = |what: &str, e: std::io::Error| format!("{what} {}: {e}", path.display());
    let Some(text) = contents else {
        return match std::fs::remove_file(path) {
            Ok(()) => Ok("removed"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok("absent"),
            Err(e) => Err(fail("removing the MPS environment file", e)),
        };
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| fail("creating the directory of", e))?;
    }
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp).map_err(|e| fail("writing the MPS environment file", e))?;
    f.write_all(text.as_bytes()).map_err(|e| fail("writing the MPS environment file", e))?;
    f.sync_all().map_err(|e| fail("writing the MPS environment file", e))?;
    std::fs::rename(&tmp, path).map_err(|e| fail("writing the MPS environment file", e))?;
    Ok("written")
}

#[cfg(test)]
mod tests {
    use gpushare_core::{GpuUuid, Mib, SharingMode};

    use super::*;

    fn gpus(modes: &[SharingMode]) -> Vec<Gpu> {
        modes
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let i = u32::try_from(i).unwrap();
                Gpu { mode: *m, ..Gpu::new(i, GpuUuid::new(format!("GPU-{i}")).unwrap(), "T4", Mib::new(1000)) }
            })
            .collect()
    }

    #[test]
    fn names_exactly_the_mps_gpus_and_nothing_without_them() {
        let mps = MpsConfig::default();
        let text = environment(&gpus(&[SharingMode::Mps, SharingMode::Shared, SharingMode::Mps]), &mps).unwrap();
        assert!(text.contains("\nCUDA_VISIBLE_DEVICES=GPU-0,GPU-2\n"), "{text}");
        assert!(text.contains("\nCUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps\n"), "{text}");
        assert!(text.contains("\nCUDA_MPS_LOG_DIRECTORY=/var/log/nvidia-mps\n"), "{text}");
        assert_eq!(environment(&gpus(&[SharingMode::Shared]), &mps), None);
    }

    #[test]
    fn written_whole_and_removed_when_no_gpu_is_mps() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/gpushare/mps.env");
        assert_eq!(write_environment(&path, None).unwrap(), "absent");
        assert_eq!(write_environment(&path, Some("A=1\n")).unwrap(), "written");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "A=1\n");
        assert!(!path.with_extension("tmp").exists());
        assert_eq!(write_environment(&path, None).unwrap(), "removed");
        assert!(!path.exists());
    }
}
