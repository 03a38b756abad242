//! The annotation codec: the versioned JSON values gpushare writes on Kubernetes objects, and
//! Alibaba gpushare's keys for the compatibility setting.
//!
//! - [`node`]: what a node's daemon publishes on its Node (inventory, unit, health, cordon,
//!   usage and the pods holding it), under [`node::NODE_STATE_KEY`].
//! - [`assignment`]: what the extender writes on a pod at bind (per container: GPUs and MiB),
//!   under [`assignment::ASSIGNMENT_KEY`].
//! - [`heartbeat`]: what a node's daemon renews on its Node so that readers can tell it is alive,
//!   under [`heartbeat::HEARTBEAT_KEY`].
//! - [`alibaba`]: Alibaba's resource names, pod annotations and container env vars.
//!
//! Every value carries `"v"`, the schema version. Readers refuse versions they do not know;
//! fields added within a version are optional and ignored by older readers. Malformed values
//! decode to a [`CodecError`], never a panic. The schema is documented in `docs/annotations.md`.

pub mod alibaba;
pub mod assignment;
pub mod heartbeat;
pub mod node;

use thiserror::Error;

use crate::request::ContainerRole;

/// Kubernetes' limit on the total size of an object's annotations; no single value of ours may
/// be larger.
pub const MAX_ANNOTATION_BYTES: usize = 256 * 1024;

/// An annotation value gpushare cannot use. `key` names the annotation.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CodecError {
    /// Larger than Kubernetes allows for all annotations of an object.
    #[error("annotation {key}: {len} bytes is over the {max}-byte limit")]
    TooLarge {
        /// Annotation key.
        key: &'static str,
        /// Size of the value.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Not JSON of the expected shape.
    #[error("annotation {key}: malformed value: {reason}")]
    Malformed {
        /// Annotation key.
        key: &'static str,
        /// What the JSON parser said.
        reason: String,
    },
    /// A schema version this build does not read.
    #[error(
        "annotation {key}: schema version {found} is not supported (this build reads version {supported}); \
         run the same gpushare version on daemons and extender"
    )]
    UnknownVersion {
        /// Annotation key.
        key: &'static str,
        /// Version found.
        found: u64,
        /// Version this build reads.
        supported: u32,
    },
    /// Well-formed JSON that breaks a rule of the schema.
    #[error("annotation {key}: {reason}")]
    Invalid {
        /// Annotation key.
        key: &'static str,
        /// The rule broken.
        reason: String,
    },
}

/// Checks size and version, then decodes the rest of `value` as `T`.
fn decode_versioned<T: serde::de::DeserializeOwned>(
    key: &'static str,
    value: &str,
    supported: u32,
) -> Result<T, CodecError> {
    #[derive(serde::Deserialize)]
    struct Version {
        v: Option<serde_json::Value>,
    }
    if value.len() > MAX_ANNOTATION_BYTES {
        return Err(CodecError::TooLarge { key, len: value.len(), max: MAX_ANNOTATION_BYTES });
    }
    let malformed = |e: serde_json::Error| CodecError::Malformed { key, reason: e.to_string() };
    let version: Version = serde_json::from_str(value).map_err(malformed)?;
    match version.v {
        Some(serde_json::Value::Number(n)) if n.as_u64() == Some(u64::from(supported)) => {}
        Some(serde_json::Value::Number(n)) => match n.as_u64() {
            Some(found) => return Err(CodecError::UnknownVersion { key, found, supported }),
            None => return Err(CodecError::Invalid { key, reason: format!("\"v\" must be a whole number, not {n}") }),
        },
        Some(other) => {
            return Err(CodecError::Invalid { key, reason: format!("\"v\" must be a whole number, not {other}") });
        }
        None => return Err(CodecError::Invalid { key, reason: "the schema version \"v\" is missing".into() }),
    }
    serde_json::from_str(value).map_err(malformed)
}

/// Encodes `value` as compact JSON, refusing results over [`MAX_ANNOTATION_BYTES`].
fn encode_checked<T: serde::Serialize>(key: &'static str, value: &T) -> Result<String, CodecError> {
    let text = serde_json::to_string(value).map_err(|e| CodecError::Malformed { key, reason: e.to_string() })?;
    if text.len() > MAX_ANNOTATION_BYTES {
        return Err(CodecError::TooLarge { key, len: text.len(), max: MAX_ANNOTATION_BYTES });
    }
    Ok(text)
}

/// serde's default for an omitted `role`: an app container.
fn app_role() -> ContainerRole {
    ContainerRole::App
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_app_role(role: &ContainerRole) -> bool {
    *role == ContainerRole::App
}
