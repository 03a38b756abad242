//! `[nri]`: whether gpushared joins the container runtime as an NRI plugin, and where the
//! runtime's NRI socket is (docs/gpushared.md).

use serde::{Deserialize, Deserializer};

use super::{AbsPath, abs};

/// `[nri]`: gpushared as an NRI plugin of the container runtime.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NriConfig {
    /// Join the runtime's NRI at all.
    #[serde(default)]
    pub enabled: bool,
    /// The runtime's NRI socket.
    #[serde(default = "default_socket")]
    pub socket: AbsPath,
    /// The plugin's index: two digits; the runtime calls its plugins in ascending index order.
    #[serde(default = "default_index", deserialize_with = "two_digits")]
    pub index: String,
}

impl Default for NriConfig {
    fn default() -> Self {
        NriConfig { enabled: false, socket: default_socket(), index: default_index() }
    }
}

fn default_socket() -> AbsPath {
    abs("/var/run/nri/nri.sock")
}

fn default_index() -> String {
    "50".to_owned()
}

fn two_digits<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let s = String::deserialize(d)?;
    if s.len() == 2 && s.bytes().all(|b| b.is_ascii_digit()) {
        Ok(s)
    } else {
        Err(serde::de::Error::custom(format!("{s:?} is not two digits; write an index such as \"50\"")))
    }
}
