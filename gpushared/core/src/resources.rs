//! The `[resources]` section both binaries read: the cluster's unit and resource names, and the
//! rule that checks them. gpushared and gpushare-extender must agree on all four keys; one type
//! and one check make the two configurations read and refuse them alike. (The daemon's section
//! also names the whole-GPU resource and the NUMA switch; [`Resources::check_whole`] is its part
//! of the rule.)

use serde::Deserialize;
use thiserror::Error;

use crate::request::{Compatibility, ResourceName, ResourceNames};
use crate::units::MemoryUnit;

/// `[resources]` as both binaries read it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    /// The cluster unit, `MiB` or `GiB`; the same on every node and the extender.
    #[serde(default)]
    pub unit: MemoryUnit,
    /// `gpushare` or `alibaba`: the default names (and, for Alibaba, its annotations).
    #[serde(default)]
    pub compatibility: Compatibility,
    /// Overrides the memory resource name.
    #[serde(default)]
    pub memory: Option<ResourceName>,
    /// Overrides the GPU-count resource name.
    #[serde(default)]
    pub count: Option<ResourceName>,
}

/// Resource names that cannot work together.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ResourcesError {
    /// Memory and count name the same resource.
    #[error("resources: memory and count are both {0:?}; they must be two different resources")]
    SameName(String),
    /// The whole-GPU resource is also the memory or the count resource.
    #[error(
        "resources: whole is {0:?}, which is also the memory or count resource; name whole GPUs with their own \
         resource, such as \"gpushare.io/gpu\""
    )]
    WholeClashes(String),
}

impl Resources {
    /// The resource names in force.
    #[must_use]
    pub fn names(&self) -> ResourceNames {
        ResourceNames::configured(self.compatibility, self.memory.clone(), self.count.clone())
    }

    /// The names in force, when they can work together.
    ///
    /// # Errors
    /// [`ResourcesError::SameName`].
    pub fn check(&self) -> Result<ResourceNames, ResourcesError> {
        let names = self.names();
        if names.memory == names.count {
            return Err(ResourcesError::SameName(names.memory.as_str().to_owned()));
        }
        Ok(names)
    }

    /// Whether `whole` can name whole GPUs beside these names.
    ///
    /// # Errors
    /// [`ResourcesError::WholeClashes`].
    pub fn check_whole(&self, whole: &ResourceName) -> Result<(), ResourcesError> {
        let names = self.names();
        if *whole == names.memory || *whole == names.count {
            return Err(ResourcesError::WholeClashes(whole.as_str().to_owned()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> ResourceName {
        serde_json::from_value(serde_json::Value::from(s)).unwrap()
    }

    #[test]
    fn names_follow_compatibility_and_overrides() {
        assert_eq!(Resources::default().check().unwrap(), ResourceNames::gpushare());
        let alibaba = Resources { compatibility: Compatibility::Alibaba, ..Resources::default() };
        assert_eq!(alibaba.check().unwrap(), ResourceNames::alibaba());
        let custom = Resources { count: Some(name("example.com/gpus")), ..alibaba };
        assert_eq!(custom.check().unwrap().count.as_str(), "example.com/gpus");
    }

    #[test]
    fn clashing_names_are_refused_with_what_to_write() {
        let same = Resources { memory: Some(name("a.io/x")), count: Some(name("a.io/x")), ..Resources::default() };
        let e = same.check().unwrap_err();
        assert_eq!(e, ResourcesError::SameName("a.io/x".into()));
        assert!(e.to_string().contains("two different resources"), "{e}");
        let r = Resources::default();
        assert!(r.check_whole(&name("gpushare.io/gpu")).is_ok());
        let e = r.check_whole(&name("gpushare.io/gpu-mem")).unwrap_err();
        assert!(e.to_string().contains("their own resource"), "{e}");
    }

    #[test]
    fn unknown_keys_are_refused() {
        let e = serde_json::from_str::<Resources>(r#"{"unit": "GiB", "colour": "red"}"#).unwrap_err();
        assert!(e.to_string().contains("colour"), "{e}");
    }
}
