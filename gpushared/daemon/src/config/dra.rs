//! `[dra]`: where gpushared serves as a DRA driver for the GPUs `[sharing] dra` names — the
//! driver name its ResourceSlices and allocations carry, the kubelet's plugin-registration
//! directory, the directory of its DRA socket, and where it writes CDI specs for the runtime.

use serde::Deserialize;

use super::{AbsPath, abs, is_dns_subdomain};

/// `[dra]` (docs/dra.md).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DraConfig {
    /// The DRA driver's name: ResourceSlices are published under it, and a DeviceClass selects
    /// it (`device.driver == "<driver>"`).
    #[serde(default = "default_driver")]
    pub driver: String,
    /// The kubelet's plugin watcher directory, where the registration socket goes
    /// (`<kubelet root>/plugins_registry`).
    #[serde(default = "default_registry_dir")]
    pub registry_dir: AbsPath,
    /// The directory of the DRA plugin socket (`dra.sock`), which the kubelet dials.
    #[serde(default = "default_plugin_dir")]
    pub plugin_dir: AbsPath,
    /// Where CDI specs are written, one per prepared claim; the container runtime must read
    /// this directory (containerd and CRI-O read `/var/run/cdi` by default).
    #[serde(default = "default_cdi_dir")]
    pub cdi_dir: AbsPath,
}

impl Default for DraConfig {
    fn default() -> Self {
        DraConfig {
            driver: default_driver(),
            registry_dir: default_registry_dir(),
            plugin_dir: default_plugin_dir(),
            cdi_dir: default_cdi_dir(),
        }
    }
}

impl DraConfig {
    /// Checks the driver name.
    ///
    /// # Errors
    /// What is wrong, and what to write instead.
    pub fn check(&self) -> Result<(), String> {
        if !is_dns_subdomain(&self.driver) || !self.driver.contains('.') || self.driver.len() > 63 {
            return Err(format!(
                "[dra] driver {:?} is not a DRA driver name: write a lower-case DNS subdomain of at most 63 \
                 characters with a dot, such as \"{}\"",
                self.driver,
                gpushare_core::dra::DEFAULT_DRIVER
            ));
        }
        Ok(())
    }

    /// The registration socket: `<registry_dir>/<driver>-reg.sock`.
    #[must_use]
    pub fn registration_socket(&self) -> std::path::PathBuf {
        self.registry_dir.path().join(format!("{}-reg.sock", self.driver))
    }

    /// The DRA plugin socket: `<plugin_dir>/dra.sock`.
    #[must_use]
    pub fn plugin_socket(&self) -> std::path::PathBuf {
        self.plugin_dir.path().join("dra.sock")
    }
}

fn default_driver() -> String {
    gpushare_core::dra::DEFAULT_DRIVER.to_owned()
}

fn default_registry_dir() -> AbsPath {
    abs("/var/lib/kubelet/plugins_registry")
}

fn default_plugin_dir() -> AbsPath {
    abs(&format!("/var/lib/kubelet/plugins/{}", gpushare_core::dra::DEFAULT_DRIVER))
}

fn default_cdi_dir() -> AbsPath {
    abs("/var/run/cdi")
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn defaults_and_a_bad_driver_name() {
        let c = Config::parse("", std::path::Path::new("t.toml")).unwrap();
        assert_eq!(c.dra.driver, "gpu.gpushare.io");
        assert_eq!(
            c.dra.registration_socket(),
            std::path::Path::new("/var/lib/kubelet/plugins_registry/gpu.gpushare.io-reg.sock")
        );
        assert_eq!(c.dra.plugin_socket(), std::path::Path::new("/var/lib/kubelet/plugins/gpu.gpushare.io/dra.sock"));
        let e = Config::parse("[dra]\ndriver = \"GPU\"\n", std::path::Path::new("t.toml")).unwrap_err().to_string();
        assert!(e.contains("[dra] driver \"GPU\"") && e.contains("gpu.gpushare.io"), "{e}");
        let e = Config::parse("[dra]\ncdi_dir = \"cdi\"\n", std::path::Path::new("t.toml")).unwrap_err().to_string();
        assert!(e.contains("cdi_dir"), "{e}");
    }
}
