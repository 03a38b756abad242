//! Which devices `GetPreferredAllocation` proposes for a container: the lowest-numbered free
//! devices of each GPU its assignment names, as many as it holds there, with the kubelet's
//! `must_include` kept and counted. Pure: the node's device map, the assignment and the
//! kubelet's lists in, the devices out.

use std::collections::{BTreeMap, BTreeSet};

use gpushare_core::NodeInventory;
use gpushare_core::codec::assignment::ContainerAssignment;
use gpushare_core::devices::DeviceMap;

/// The proposal, and whether the assigned GPUs had too few free devices in the kubelet's view
/// so that others were added to keep the count right.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Proposal {
    /// The devices, `must_include` first.
    pub devices: Vec<String>,
    /// Whether devices of other GPUs had to be added.
    pub short: bool,
}

/// `size` devices of `available` for `container`, including `must_include`.
pub(super) fn propose<'a, I>(
    inventory: &NodeInventory,
    devices: &DeviceMap,
    container: &ContainerAssignment,
    available: I,
    must_include: &[String],
    size: usize,
) -> Proposal
where
    I: IntoIterator<Item = &'a str> + Clone,
{
    let unit = inventory.unit().mib_per_unit();
    // Devices still needed on each assigned GPU.
    let mut need: BTreeMap<usize, u64> = BTreeMap::new();
    for g in &container.gpus {
        if let Some(pos) = inventory.position_of(&g.uuid) {
            *need.entry(pos).or_default() += g.mib.get() / unit;
        }
    }
    let mut chosen: Vec<String> = must_include.to_vec();
    for id in must_include {
        if let Some((pos, _)) = devices.resolve(id)
            && let Some(n) = need.get_mut(&pos)
        {
            *n = n.saturating_sub(1);
        }
    }
    let taken: BTreeSet<&str> = must_include.iter().map(String::as_str).collect();
    // Only the devices of the needed GPUs are looked at: their IDs start with the GPU's tag.
    let tags: Vec<(usize, String)> =
        need.keys().filter_map(|&pos| devices.id(pos, 0).map(|id| (pos, id.chars().take(2).collect()))).collect();
    let mut by_gpu: BTreeMap<usize, Vec<(u64, &str)>> = BTreeMap::new();
    for id in available.clone() {
        let Some(&(pos, _)) = tags.iter().find(|(_, t)| id.starts_with(t.as_str())) else { continue };
        if taken.contains(id) {
            continue;
        }
        if let Some((p, k)) = devices.resolve(id)
            && p == pos
        {
            by_gpu.entry(pos).or_default().push((k, id));
        }
    }
    for (pos, n) in &need {
        if let Some(ids) = by_gpu.get_mut(pos) {
            let n = usize::try_from(*n).unwrap_or(usize::MAX).min(ids.len());
            // The lowest-numbered free devices, without sorting them all.
            if n > 0 && n < ids.len() {
                ids.select_nth_unstable(n - 1);
            }
            ids.truncate(n);
            ids.sort_unstable();
            chosen.extend(ids.iter().map(|(_, id)| (*id).to_owned()));
        }
    }
    let short = chosen.len() < size;
    if short {
        // The kubelet's view of this GPU is fuller than ours; any devices keep the count right,
        // the environment still names the assigned GPU.
        let have: BTreeSet<String> = chosen.iter().cloned().collect();
        let rest: Vec<String> = available
            .into_iter()
            .filter(|id| !have.contains(*id))
            .take(size - chosen.len())
            .map(str::to_owned)
            .collect();
        chosen.extend(rest);
    }
    chosen.truncate(size.max(must_include.len()));
    Proposal { devices: chosen, short }
}
