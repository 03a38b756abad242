//! The resource names a cluster asks GPUs under: a validated extended resource name, the pair
//! (memory, count) a cluster uses, and the compatibility setting that picks gpushare's or
//! Alibaba's.

use std::fmt;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A Kubernetes extended resource name such as `gpushare.io/gpu-mem`: a DNS-subdomain prefix
/// outside `kubernetes.io`, a slash, and a name of at most 63 characters.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct ResourceName(String);

/// A resource name the kubelet or API server would refuse.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invalid extended resource name {name:?}: {why}; write a domain-prefixed name such as \"gpushare.io/gpu-mem\"")]
pub struct InvalidResourceName {
    /// The name as given.
    pub name: String,
    /// What is wrong with it.
    pub why: &'static str,
}

impl ResourceName {
    /// Validates `name` the way `IsExtendedResourceName` does.
    ///
    /// # Errors
    /// [`InvalidResourceName`] naming the rule that failed.
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidResourceName> {
        let name = name.into();
        let fail = |why| Err(InvalidResourceName { name: name.clone(), why });
        let Some((prefix, local)) = name.split_once('/') else {
            return fail("it has no domain prefix");
        };
        if prefix.is_empty() || prefix.len() > 253 {
            return fail("the prefix must be 1-253 characters");
        }
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        if !prefix.split('.').all(label_ok) {
            return fail("the prefix must be a lowercase DNS subdomain");
        }
        if prefix == "kubernetes.io" || prefix.ends_with(".kubernetes.io") || prefix.starts_with("requests.") {
            return fail("the kubernetes.io namespace and the requests. prefix are reserved");
        }
        let local_ok = !local.is_empty()
            && local.len() <= 63
            && local.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && local.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
            && local.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric());
        if !local_ok {
            return fail("the name after '/' must be 1-63 letters, digits, '-', '_' or '.'");
        }
        Ok(ResourceName(name))
    }

    /// The name text.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for ResourceName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        ResourceName::new(String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for ResourceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The two resource names a cluster uses: one for memory, one for the GPU count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceNames {
    /// The device-plugin resource, counted in the cluster unit.
    pub memory: ResourceName,
    /// The scheduler-only GPU count.
    pub count: ResourceName,
}

/// Which names, annotations and env vars a cluster uses: the one setting the daemon and the
/// extender share (`[resources] compatibility` in both configuration files).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compatibility {
    /// gpushare's own names.
    #[default]
    Gpushare,
    /// Alibaba gpushare's names, annotations and env vars too.
    Alibaba,
}

impl ResourceName {
    /// `gpushare.io/gpu`: whole GPUs, one device per GPU, beside the shares.
    #[must_use]
    pub fn gpushare_whole() -> Self {
        ResourceName(crate::GPUSHARE_WHOLE_RESOURCE.to_owned())
    }
}

impl ResourceNames {
    /// The names under `compatibility`, with either one overridden.
    #[must_use]
    pub fn configured(compatibility: Compatibility, memory: Option<ResourceName>, count: Option<ResourceName>) -> Self {
        let base = match compatibility {
            Compatibility::Gpushare => ResourceNames::gpushare(),
            Compatibility::Alibaba => ResourceNames::alibaba(),
        };
        ResourceNames { memory: memory.unwrap_or(base.memory), count: count.unwrap_or(base.count) }
    }

    /// gpushare's own names: `gpushare.io/gpu-mem` and `gpushare.io/gpu-count`.
    #[must_use]
    pub fn gpushare() -> Self {
        ResourceNames {
            memory: ResourceName(crate::GPUSHARE_MEMORY_RESOURCE.to_owned()),
            count: ResourceName(crate::GPUSHARE_COUNT_RESOURCE.to_owned()),
        }
    }

    /// Alibaba gpushare's names: `aliyun.com/gpu-mem` and `aliyun.com/gpu-count`.
    #[must_use]
    pub fn alibaba() -> Self {
        ResourceNames {
            memory: ResourceName(crate::ALIBABA_MEMORY_RESOURCE.to_owned()),
            count: ResourceName(crate::ALIBABA_COUNT_RESOURCE.to_owned()),
        }
    }
}
