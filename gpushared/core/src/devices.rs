//! Kubelet device IDs: one device per memory unit, named so that the kubelet's 4 MiB message
//! limit holds as much memory as possible, and so that a name survives daemon restarts and
//! reboots (the kubelet's checkpoint keeps naming the same slices).
//!
//! An ID is a two-character GPU tag followed by the unit's number, both in base 62
//! (`0-9A-Za-z`): `Q3`, `Q30`, …, `Q3Lz`. The tag is derived from the GPU's UUID (FNV-1a hash),
//! so it does not depend on NVML's enumeration order; the rare clash between two GPUs of one
//! node is resolved deterministically in UUID order. Numbers are canonical (no leading zeros),
//! so every device has exactly one name.
//!
//! [`list_and_watch_size`] computes the exact protobuf size of the kubelet's `ListAndWatch`
//! message for an inventory, so the daemon can refuse a configuration the kubelet would reject.

use crate::inventory::NodeInventory;

/// The largest message the kubelet's gRPC client accepts (grpc-go's default receive limit).
pub const KUBELET_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

const ALPHABET: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
const TAGS: u64 = 62 * 62;

/// The devices of one node: each GPU's tag and how many units it offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceMap {
    /// Per GPU position: its tag.
    tags: Vec<[u8; 2]>,
    /// Per GPU position: devices (whole units of its total).
    units: Vec<u64>,
}

impl DeviceMap {
    /// Names the devices of `inventory`: one per whole unit of each GPU's total (none for a GPU
    /// in `whole` mode).
    #[must_use]
    pub fn new(inventory: &NodeInventory) -> Self {
        let gpus = inventory.gpus();
        let mut order: Vec<usize> = (0..gpus.len()).collect();
        order.sort_by(|&a, &b| gpus[a].uuid.cmp(&gpus[b].uuid));
        let mut taken = std::collections::BTreeSet::new();
        let mut tags = vec![[b'0'; 2]; gpus.len()];
        for pos in order {
            let mut n = fnv1a(gpus[pos].uuid.as_str().as_bytes()) % TAGS;
            while !taken.insert(n) {
                n = (n + 1) % TAGS;
            }
            tags[pos] = tag_chars(n);
        }
        let unit = inventory.unit();
        // A GPU handed out whole offers no memory devices (its tag stays reserved).
        let units = gpus.iter().map(|g| unit.whole_units(g.capacity(unit))).collect();
        DeviceMap { tags, units }
    }

    /// The ID of device `k` of the GPU at `gpu`, if it exists.
    #[must_use]
    pub fn id(&self, gpu: usize, k: u64) -> Option<String> {
        let tag = self.tags.get(gpu)?;
        if k >= *self.units.get(gpu)? {
            return None;
        }
        let mut id = String::with_capacity(6);
        id.push(char::from(tag[0]));
        id.push(char::from(tag[1]));
        push_base62(&mut id, k);
        Some(id)
    }

    /// Appends the ID of device `k` of the GPU at `gpu` to `out`; `false` (nothing written)
    /// if it does not exist. The allocation-free form of [`Self::id`].
    pub fn push_id(&self, gpu: usize, k: u64, out: &mut String) -> bool {
        match (self.tags.get(gpu), self.units.get(gpu)) {
            (Some(tag), Some(&units)) if k < units => {
                out.push(char::from(tag[0]));
                out.push(char::from(tag[1]));
                push_base62(out, k);
                true
            }
            _ => false,
        }
    }

    /// Which GPU (position) and unit number an ID names; `None` for IDs that are not this
    /// node's.
    #[must_use]
    pub fn resolve(&self, id: &str) -> Option<(usize, u64)> {
        let bytes = id.as_bytes();
        let (tag, number) = (bytes.get(..2)?, bytes.get(2..)?);
        let gpu = self.tags.iter().position(|t| t == tag)?;
        let k = parse_base62(number)?;
        (k < self.units[gpu]).then_some((gpu, k))
    }

    /// How many devices the GPU at `gpu` offers.
    #[must_use]
    pub fn units(&self, gpu: usize) -> u64 {
        self.units.get(gpu).copied().unwrap_or(0)
    }

    /// All device IDs of the GPU at `gpu`, in unit order.
    pub fn ids(&self, gpu: usize) -> impl Iterator<Item = String> + '_ {
        (0..self.units(gpu)).filter_map(move |k| self.id(gpu, k))
    }

    /// How many devices the node offers.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.units.iter().sum()
    }
}

/// The canonical key of a set of device IDs, short enough to index: the IDs grouped by GPU tag
/// (tags in order), each tag's unit numbers as ascending runs, in base 62 —
/// `Q3:C-3J,40;Xy:0-1` for `Q3C`…`Q33J`, `Q340`, `Xy0`, `Xy1`. The same set always gives the same
/// key, whatever the order or repetition of the IDs: 200 consecutive devices take 9 characters
/// instead of 1,200. A set with an ID that is not of this form (a foreign or stale ID) keeps
/// every ID: `=` followed by the sorted, distinct IDs joined by commas.
#[must_use]
pub fn device_set_key<S: AsRef<str>>(ids: &[S]) -> String {
    let mut parsed: Vec<([u8; 2], u64)> = Vec::with_capacity(ids.len());
    for id in ids {
        let bytes = id.as_ref().as_bytes();
        let number = bytes.get(2..).and_then(parse_base62);
        match (bytes.get(..2), number) {
            (Some(&[a, b]), Some(k)) if ALPHABET.contains(&a) && ALPHABET.contains(&b) => parsed.push(([a, b], k)),
            _ => {
                let mut all: Vec<&str> = ids.iter().map(AsRef::as_ref).collect();
                all.sort_unstable();
                all.dedup();
                return format!("={}", all.join(","));
            }
        }
    }
    parsed.sort_unstable();
    parsed.dedup();
    let mut key = String::with_capacity(16);
    let mut i = 0;
    while i < parsed.len() {
        let tag = parsed[i].0;
        if !key.is_empty() {
            key.push(';');
        }
        key.push(char::from(tag[0]));
        key.push(char::from(tag[1]));
        key.push(':');
        let mut first = true;
        while i < parsed.len() && parsed[i].0 == tag {
            let start = parsed[i].1;
            let mut end = start;
            while i + 1 < parsed.len() && parsed[i + 1].0 == tag && parsed[i + 1].1 == end + 1 {
                i += 1;
                end += 1;
            }
            if !first {
                key.push(',');
            }
            first = false;
            push_base62(&mut key, start);
            if end > start {
                key.push('-');
                push_base62(&mut key, end);
            }
            i += 1;
        }
    }
    key
}

/// The most devices one set can hold: more than any node has (8 GPUs of 141 GiB in MiB are
/// 1,155,072), so that a damaged key cannot make a reader build billions of IDs.
pub const MAX_SET_DEVICES: u64 = 1 << 21;

/// The device IDs a [`device_set_key`] stands for, sorted as the key lists them; `None` for
/// a malformed key, or one of more than [`MAX_SET_DEVICES`] devices.
#[must_use]
pub fn device_set_ids(key: &str) -> Option<Vec<String>> {
    if let Some(raw) = key.strip_prefix('=') {
        return Some(raw.split(',').filter(|s| !s.is_empty()).map(str::to_owned).collect());
    }
    let runs = set_runs(key)?;
    let mut out = Vec::new();
    for (tag, a, b) in runs {
        for k in a..=b {
            let mut id = String::with_capacity(6);
            id.push_str(tag);
            push_base62(&mut id, k);
            out.push(id);
        }
    }
    Some(out)
}

/// How many devices a [`device_set_key`] stands for, without building their IDs; `None` as
/// for [`device_set_ids`].
#[must_use]
pub fn device_set_len(key: &str) -> Option<u64> {
    match key.strip_prefix('=') {
        Some(raw) => u64::try_from(raw.split(',').filter(|s| !s.is_empty()).count()).ok(),
        None => Some(set_runs(key)?.iter().map(|(_, a, b)| b - a + 1).sum()),
    }
}

/// A compact key's runs as (GPU tag, first, last unit number), checked: tags of two base-62
/// digits, ascending bounds, at most [`MAX_SET_DEVICES`] devices in all.
fn set_runs(key: &str) -> Option<Vec<(&str, u64, u64)>> {
    let mut out = Vec::new();
    let mut total: u64 = 0;
    for group in key.split(';').filter(|g| !g.is_empty()) {
        let (tag, runs) = group.split_once(':')?;
        if tag.len() != 2 || !tag.bytes().all(|b| ALPHABET.contains(&b)) {
            return None;
        }
        for run in runs.split(',') {
            let (a, b) = run.split_once('-').unwrap_or((run, run));
            let (a, b) = (parse_base62(a.as_bytes())?, parse_base62(b.as_bytes())?);
            total = total.checked_add(b.checked_sub(a)? + 1)?;
            if total > MAX_SET_DEVICES {
                return None;
            }
            out.push((tag, a, b));
        }
    }
    Some(out)
}

#[cfg(test)]
mod set_tests {
    use super::*;

    #[test]
    fn a_key_of_more_devices_than_a_node_has_is_refused_not_expanded() {
        assert_eq!(device_set_ids("Q3:0-1").map(|v| v.len()), Some(2));
        // One huge run, or many runs that add up: found by fuzzing (a damaged ledger key).
        assert_eq!(device_set_ids("Q3:0-zzzzzz"), None);
        let many = (0..40).map(|i| format!("{}-{}", 100_000 * i + 1, 100_000 * i + 60_000)).collect::<Vec<_>>();
        let key = format!(
            "Q3:{}",
            many.iter()
                .map(|r| {
                    let (a, b) = r.split_once('-').unwrap();
                    let (mut x, mut y) = (String::new(), String::new());
                    push_base62(&mut x, a.parse().unwrap());
                    push_base62(&mut y, b.parse().unwrap());
                    format!("{x}-{y}")
                })
                .collect::<Vec<_>>()
                .join(",")
        );
        assert_eq!(device_set_ids(&key), None, "2.4 million devices in 40 runs");
        assert_eq!(device_set_ids("Q3:1-0"), None);
        assert_eq!(device_set_len("Q3:0-1;Xy:5"), Some(3));
        assert_eq!(device_set_len("=a,b,,c"), Some(3));
        assert_eq!(device_set_len("Q3:0-zzzzzz"), None);
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

fn tag_chars(n: u64) -> [u8; 2] {
    [ALPHABET[usize::try_from(n / 62).unwrap_or(0) % 62], ALPHABET[usize::try_from(n % 62).unwrap_or(0)]]
}

fn push_base62(out: &mut String, mut k: u64) {
    let mut digits = [0u8; 11];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = ALPHABET[usize::try_from(k % 62).unwrap_or(0)];
        k /= 62;
        if k == 0 {
            break;
        }
    }
    out.extend(digits[i..].iter().map(|b| char::from(*b)));
}

fn parse_base62(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || (digits.len() > 1 && digits[0] == b'0') {
        return None;
    }
    digits.iter().try_fold(0u64, |acc, d| {
        let v = ALPHABET.iter().position(|a| a == d)?;
        acc.checked_mul(62)?.checked_add(u64::try_from(v).ok()?)
    })
}

fn varint_len(mut v: u64) -> usize {
    let mut n = 1;
    while v >= 0x80 {
        v >>= 7;
        n += 1;
    }
    n
}

/// Length of a length-delimited field (tag byte, length varint, payload).
fn field_len(payload: usize) -> usize {
    1 + varint_len(payload as u64) + payload
}

/// The encoded size of one `v1beta1.Device` entry of a `ListAndWatchResponse` (the field
/// wrapper included), for an ID of `id_len` characters, health `"Unhealthy"` (the longer
/// word, so a GPU turning sick never overflows), and the GPU's NUMA node if published.
fn device_entry_len(id_len: usize, numa: Option<u32>) -> usize {
    let mut device = field_len(id_len) + field_len("Unhealthy".len());
    if let Some(n) = numa {
        // NUMANode { int64 ID = 1 }: proto3 leaves out a zero ID.
        let numa_node = if n == 0 { 0 } else { 1 + varint_len(u64::from(n)) };
        let topology = field_len(numa_node);
        device += field_len(topology);
    }
    field_len(device)
}

/// The exact size in bytes of the `ListAndWatchResponse` that lists every device of
/// `inventory`, with NUMA topology when `numa` is true and the GPU reports a node.
#[must_use]
pub fn list_and_watch_size(inventory: &NodeInventory, numa: bool) -> usize {
    let unit = inventory.unit();
    let mut total = 0usize;
    for g in inventory.gpus() {
        let devices = unit.whole_units(g.capacity(unit));
        let numa_node = if numa { g.numa_node } else { None };
        // Devices 0..62 have 1-digit numbers, 62..3844 two digits, and so on.
        let (mut start, mut end, mut digits) = (0u64, 62u64, 1usize);
        while start < devices {
            let count = usize::try_from(devices.min(end) - start).unwrap_or(usize::MAX);
            total = total.saturating_add(count.saturating_mul(device_entry_len(2 + digits, numa_node)));
            start = end;
            end = end.saturating_mul(62);
            digits += 1;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::{Gpu, GpuUuid};
    use crate::units::{MemoryUnit, Mib};

    fn inventory(unit: MemoryUnit, gpus: &[(&str, u64, Option<u32>)]) -> NodeInventory {
        let gpus = gpus
            .iter()
            .zip(0u32..)
            .map(|((uuid, mib, numa), i)| {
                let mut g = Gpu::new(i, GpuUuid::new(*uuid).unwrap(), "T4", Mib::new(*mib));
                g.numa_node = *numa;
                g
            })
            .collect();
        NodeInventory::new(unit, gpus).unwrap()
    }

    #[test]
    fn ids_are_short_unique_canonical_and_resolve_back() {
        let inv = inventory(MemoryUnit::Mib, &[("GPU-a", 15_360, None), ("GPU-b", 4000, None)]);
        let map = DeviceMap::new(&inv);
        assert_eq!(map.total(), 19_360);
        let mut seen = std::collections::BTreeSet::new();
        for gpu in 0..2 {
            for (k, id) in map.ids(gpu).enumerate() {
                assert!(id.len() <= 5, "{id}");
                assert_eq!(map.resolve(&id), Some((gpu, k as u64)), "{id}");
                assert!(seen.insert(id));
            }
        }
        assert_eq!(map.id(1, 4000), None);
        let tag: String = map.id(0, 0).unwrap().chars().take(2).collect();
        for bad in ["", "x", &tag, &format!("{tag}00"), &format!("{tag}-1"), &format!("{tag}zzzzzzzzzzzzz"), "??0"] {
            assert_eq!(map.resolve(bad), None, "{bad:?}");
        }
        // A number beyond the GPU's units is not a device.
        assert_eq!(map.resolve(&format!("{tag}4000000")), None);
    }

    #[test]
    fn a_whole_gpu_offers_no_memory_devices_and_keeps_its_tag() {
        let shared = inventory(MemoryUnit::Mib, &[("GPU-a", 100, None), ("GPU-b", 100, None)]);
        let mut gpus = shared.gpus().to_vec();
        gpus[1].mode = crate::inventory::SharingMode::Whole;
        let whole = NodeInventory::new(MemoryUnit::Mib, gpus).unwrap();
        let (a, b) = (DeviceMap::new(&shared), DeviceMap::new(&whole));
        assert_eq!((b.units(0), b.units(1), b.total()), (100, 0, 100));
        assert_eq!(b.id(1, 0), None);
        assert_eq!(a.id(0, 7), b.id(0, 7), "the shared GPU's IDs do not move");
        assert!(list_and_watch_size(&whole, false) < list_and_watch_size(&shared, false));
    }

    #[test]
    fn ids_depend_on_the_uuid_not_the_enumeration_order() {
        let a = DeviceMap::new(&inventory(MemoryUnit::Mib, &[("GPU-a", 100, None), ("GPU-b", 100, None)]));
        let b = DeviceMap::new(&inventory(MemoryUnit::Mib, &[("GPU-b", 100, None), ("GPU-a", 100, None)]));
        assert_eq!(a.id(0, 7), b.id(1, 7));
        assert_eq!(a.id(1, 7), b.id(0, 7));
    }

    #[test]
    fn clashing_tags_are_resolved_deterministically() {
        // Find two UUIDs whose hashes clash, then check both orders give distinct, equal tags.
        let base = fnv1a(b"GPU-0") % TAGS;
        let other = (1..100_000).map(|i| format!("GPU-{i}")).find(|u| fnv1a(u.as_bytes()) % TAGS == base).unwrap();
        let one = DeviceMap::new(&inventory(MemoryUnit::Mib, &[("GPU-0", 10, None), (&other, 10, None)]));
        let two = DeviceMap::new(&inventory(MemoryUnit::Mib, &[(&other, 10, None), ("GPU-0", 10, None)]));
        assert_ne!(one.tags[0], one.tags[1]);
        assert_eq!(one.tags[0], two.tags[1]);
        assert_eq!(one.tags[1], two.tags[0]);
    }

    #[test]
    fn device_set_keys_are_short_canonical_and_reversible() {
        let ids: Vec<String> =
            (12..212u64).map(|k| format!("Q3{}", b62(k))).chain(["Xy1".into(), "Xy0".into()]).collect();
        let key = device_set_key(&ids);
        assert_eq!(key, format!("Q3:{}-{};Xy:0-1", b62(12), b62(211)));
        assert!(key.len() < 16, "{key}");
        let mut reversed = ids.clone();
        reversed.reverse();
        reversed.push("Q3C".into());
        assert_eq!(device_set_key(&reversed), key, "order and repetition do not matter");
        let mut sorted = ids.clone();
        sorted.sort_by_key(|id| (id[..2].to_owned(), parse_base62(&id.as_bytes()[2..]).unwrap()));
        assert_eq!(device_set_ids(&key).unwrap(), sorted);
        assert_eq!(device_set_key(&["Q30", "Q32", "Q33"]), "Q3:0,2-3");
        assert_eq!(device_set_key::<&str>(&[]), "");
        assert_eq!(device_set_ids("").unwrap(), Vec::<String>::new());
        // Foreign IDs keep every ID.
        let foreign = device_set_key(&["nvidia0-_-3", "Q30", "Q30"]);
        assert_eq!(foreign, "=Q30,nvidia0-_-3");
        assert_eq!(device_set_ids(&foreign).unwrap(), vec!["Q30", "nvidia0-_-3"]);
        assert_eq!(device_set_key(&["Q300"]), "=Q300", "not canonical base 62");
        for bad in ["Q3", "Q3:", "Q3:2-1", "Q:1", "Q3:1-", "Q3:!"] {
            assert_eq!(device_set_ids(bad), None, "{bad}");
        }
    }

    fn b62(k: u64) -> String {
        let mut s = String::new();
        push_base62(&mut s, k);
        s
    }

    #[test]
    fn base62_round_trips() {
        for k in [0u64, 1, 61, 62, 3843, 3844, 238_327, 238_328, u64::MAX] {
            let mut s = String::new();
            push_base62(&mut s, k);
            assert_eq!(parse_base62(s.as_bytes()), Some(k), "{k} -> {s}");
        }
        assert_eq!(parse_base62(b"zzzzzzzzzzzz"), None); // overflow
    }

    #[test]
    fn sizes_follow_the_protobuf_encoding() {
        // 62 one-digit devices: entry = 2 + (2+3) + (2+9) = 18 bytes.
        let inv = inventory(MemoryUnit::Mib, &[("GPU-a", 62, None)]);
        assert_eq!(list_and_watch_size(&inv, true), 62 * 18);
        // NUMA node 0 adds field 3 holding an empty NUMANode: 1+1+(1+1+0) = 4 bytes.
        let inv = inventory(MemoryUnit::Mib, &[("GPU-a", 62, Some(0))]);
        assert_eq!(list_and_watch_size(&inv, true), 62 * 22);
        assert_eq!(list_and_watch_size(&inv, false), 62 * 18);
        // NUMA node 1: the NUMANode carries its ID: 2 more bytes.
        let inv = inventory(MemoryUnit::Mib, &[("GPU-a", 63, Some(1))]);
        assert_eq!(list_and_watch_size(&inv, true), 62 * 24 + 25);
        // GiB mode: 15 devices for 16276 MiB.
        let inv = inventory(MemoryUnit::Gib, &[("GPU-a", 16_276, None)]);
        assert_eq!(list_and_watch_size(&inv, true), 15 * 18);
    }

    /// The largest node (8 equal GPUs) whose MiB-granularity device list the kubelet accepts.
    fn largest_mib_node(numa: Option<u32>) -> u64 {
        let (mut lo, mut hi) = (1u64, 1 << 20);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            let gpus: Vec<(String, u64, Option<u32>)> = (0..8).map(|i| (format!("GPU-{i}"), mid, numa)).collect();
            let refs: Vec<(&str, u64, Option<u32>)> = gpus.iter().map(|(u, m, n)| (u.as_str(), *m, *n)).collect();
            if list_and_watch_size(&inventory(MemoryUnit::Mib, &refs), true) <= KUBELET_MAX_MESSAGE_BYTES {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo * 8
    }

    #[test]
    fn largest_node_served_at_mib_granularity() {
        // Recorded in docs/device-plugin.md: MiB over 8 equal GPUs. Without NUMA topology
        // 206.3 GiB (8 x 26 409 MiB); with a NUMA node on every device 158.7 GiB.
        assert_eq!(largest_mib_node(None), 211_272);
        assert_eq!(largest_mib_node(Some(1)), 162_520);
    }
}
