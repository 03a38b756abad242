//! Hand-written messages for the kubelet's large lists, wire-compatible with the generated
//! ones (same field numbers and types) but cheap in memory:
//!
//! - [`ContainerPreferredAllocationRequest`]: the kubelet lists every free device in each
//!   `GetPreferredAllocation` (131 072 IDs for 8 GPUs of 16 GiB in MiB mode). Decoded as
//!   [`DeviceIds`], one string buffer and one offset per ID (about 9 bytes an ID), instead of
//!   a `String` each (about 60 bytes an ID, and 131 072 allocations). Its envelope,
//!   [`PreferredAllocationRequest`], is hand-written too, so that a container's request lying
//!   whole in the received buffer (tonic's is one piece) is read from that slice in one loop,
//!   not an ID at a time through prost's generic buffer calls.
//! - [`ListAndWatchResponse`]: the complete device list, one entry per unit. The daemon hands
//!   it a [`DeviceSource`] and each device is written straight into the message as it is
//!   encoded, with no `Device` values in between; a decoded message (the kubelet side, in the
//!   tests) holds ordinary [`Device`]s.
//! - [`ContainerDevices`]: the PodResources API's device sets. A MiB-mode node's `List` answer
//!   lists every device held (up to 131 072 IDs), asked once an admission; each set's IDs are
//!   decoded as [`DeviceIds`] too.
//!
//! `build.rs` maps the generated code's types to these with `extern_path`.

use std::fmt;
use std::sync::Arc;

use prost::bytes::{Buf, BufMut};
use prost::encoding::{DecodeContext, WireType, encode_key, encode_varint, encoded_len_varint};
use prost::{DecodeError, Message};

use crate::deviceplugin::Device;

/// A list of device IDs in one buffer.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct DeviceIds {
    text: String,
    ends: Vec<u32>,
}

impl DeviceIds {
    /// An empty list.
    #[must_use]
    pub fn new() -> Self {
        DeviceIds::default()
    }

    /// How many IDs.
    #[must_use]
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there are none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Appends an ID; returns `false`, keeping nothing, once the list would pass 4 GiB of text
    /// (no gRPC message can carry that much).
    pub fn push(&mut self, id: &str) -> bool {
        let Ok(end) = u32::try_from(self.text.len() + id.len()) else { return false };
        self.text.push_str(id);
        self.ends.push(end);
        true
    }

    /// The IDs, in order.
    pub fn iter(&self) -> impl Iterator<Item = &str> + Clone + '_ {
        self.ends.iter().scan(0usize, move |start, &end| {
            let end = end as usize;
            let id = &self.text[*start..end];
            *start = end;
            Some(id)
        })
    }

    /// The IDs as owned strings.
    #[must_use]
    pub fn to_vec(&self) -> Vec<String> {
        self.iter().map(str::to_owned).collect()
    }

    fn encode_field(&self, tag: u32, buf: &mut impl BufMut) {
        for id in self.iter() {
            encode_key(tag, WireType::LengthDelimited, buf);
            encode_varint(id.len() as u64, buf);
            buf.put_slice(id.as_bytes());
        }
    }

    fn field_len(&self, tag: u32) -> usize {
        let key = prost::encoding::key_len(tag);
        self.iter().map(|id| key + encoded_len_varint(id.len() as u64) + id.len()).sum()
    }

    /// Decodes one occurrence of the repeated string field with the checks and errors of
    /// prost's string decoding (wire type, length, UTF-8), copying the ID straight into the
    /// list, not into a `String` of its own (the kubelet sends 131 072 of them in a MiB-mode
    /// `GetPreferredAllocation`). An ID with a one-byte length that lies whole in the buffer's
    /// current piece (tonic hands over a message in one) is read from that piece; any other
    /// goes through prost's buffer calls, a short ID through the stack.
    fn merge_one(&mut self, wire_type: WireType, buf: &mut impl Buf, _: DecodeContext) -> Result<(), DecodeError> {
        const SHORT: usize = 64;
        prost::encoding::check_wire_type(WireType::LengthDelimited, wire_type)?;
        // Nearly always the ID and its one-byte length lie whole in the buffer's piece at hand.
        if let [len @ 0..0x80, rest @ ..] = buf.chunk()
            && let Some(id) = rest.get(..usize::from(*len))
        {
            let taken = 1 + id.len();
            self.push_decoded(id)?;
            buf.advance(taken);
            return Ok(());
        }
        let len = delimited_len(buf)?;
        let (mut short, mut long) = ([0u8; SHORT], Vec::new());
        let bytes = if len <= SHORT {
            &mut short[..len]
        } else {
            long.resize(len, 0);
            &mut long[..]
        };
        buf.copy_to_slice(bytes);
        self.push_decoded(bytes)
    }

    /// Appends an ID as decoded from the wire, with prost's error for one that is not UTF-8.
    #[allow(deprecated)] // DecodeError::new: prost offers no other way to make one.
    fn push_decoded(&mut self, id: &[u8]) -> Result<(), DecodeError> {
        let id =
            std::str::from_utf8(id).map_err(|_| DecodeError::new("invalid string value: data is not UTF-8 encoded"))?;
        if self.push(id) {
            Ok(())
        } else {
            // Unreachable through gRPC, whose messages are far smaller.
            Err(DecodeError::new("device ID list over 4 GiB"))
        }
    }
}

/// Reads a length-delimited field's length, which must not pass the end of `buf`.
#[allow(deprecated)] // DecodeError::new: prost offers no other way to make one.
fn delimited_len(buf: &mut impl Buf) -> Result<usize, DecodeError> {
    let len = prost::encoding::decode_varint(buf)?;
    usize::try_from(len).ok().filter(|&len| len <= buf.remaining()).ok_or_else(|| DecodeError::new("buffer underflow"))
}

impl fmt::Debug for DeviceIds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 8;
        let mut list = f.debug_list();
        list.entries(self.iter().take(SHOWN));
        if self.len() > SHOWN {
            list.entry(&format_args!("... {} more", self.len() - SHOWN));
        }
        list.finish()
    }
}

impl<S: AsRef<str>> FromIterator<S> for DeviceIds {
    fn from_iter<I: IntoIterator<Item = S>>(iter: I) -> Self {
        let mut ids = DeviceIds::new();
        for id in iter {
            if !ids.push(id.as_ref()) {
                break;
            }
        }
        ids
    }
}

impl From<Vec<String>> for DeviceIds {
    fn from(ids: Vec<String>) -> Self {
        ids.iter().collect()
    }
}

/// `v1beta1.ContainerPreferredAllocationRequest`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ContainerPreferredAllocationRequest {
    /// `available_deviceIDs = 1`: the devices the kubelet can give.
    pub available_device_i_ds: DeviceIds,
    /// `must_include_deviceIDs = 2`: devices that must be in the answer.
    pub must_include_device_i_ds: DeviceIds,
    /// `allocation_size = 3`: how many devices.
    pub allocation_size: i32,
}

impl Message for ContainerPreferredAllocationRequest {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        self.available_device_i_ds.encode_field(1, buf);
        self.must_include_device_i_ds.encode_field(2, buf);
        if self.allocation_size != 0 {
            prost::encoding::int32::encode(3, &self.allocation_size, buf);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        match tag {
            1 => self.available_device_i_ds.merge_one(wire_type, buf, ctx),
            2 => self.must_include_device_i_ds.merge_one(wire_type, buf, ctx),
            3 => prost::encoding::int32::merge(wire_type, &mut self.allocation_size, buf, ctx),
            _ => prost::encoding::skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        self.available_device_i_ds.field_len(1)
            + self.must_include_device_i_ds.field_len(2)
            + if self.allocation_size == 0 { 0 } else { prost::encoding::int32::encoded_len(3, &self.allocation_size) }
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}

impl ContainerPreferredAllocationRequest {
    /// Merges the fields in `bytes`, which hold this message whole (its length taken off): the
    /// IDs with a one-byte key and length, nearly all of them, are read straight from the
    /// slice; any other field goes through [`Message::merge_field`], with prost's checks and
    /// errors.
    #[allow(deprecated)] // DecodeError::new: prost offers no other way to make one.
    fn merge_slice(&mut self, mut bytes: &[u8], ctx: &DecodeContext) -> Result<(), DecodeError> {
        // Field 1 and 2, length-delimited: `tag << 3 | 2`.
        const AVAILABLE: u8 = (1 << 3) | 2;
        const MUST_INCLUDE: u8 = (2 << 3) | 2;
        // The IDs' text is shorter than the message: one growth instead of many.
        self.available_device_i_ds.text.reserve(bytes.len());
        loop {
            match bytes {
                [] => return Ok(()),
                [key @ (AVAILABLE | MUST_INCLUDE), len @ 0..0x80, rest @ ..] => {
                    let Some((id, after)) = rest.split_at_checked(usize::from(*len)) else {
                        return Err(DecodeError::new("buffer underflow"));
                    };
                    let ids = if *key == AVAILABLE {
                        &mut self.available_device_i_ds
                    } else {
                        &mut self.must_include_device_i_ds
                    };
                    ids.push_decoded(id)?;
                    bytes = after;
                }
                _ => {
                    let (tag, wire_type) = prost::encoding::decode_key(&mut bytes)?;
                    self.merge_field(tag, wire_type, &mut bytes, ctx.clone())?;
                }
            }
        }
    }
}

/// `v1beta1.PreferredAllocationRequest`: `repeated ContainerPreferredAllocationRequest
/// container_requests = 1`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct PreferredAllocationRequest {
    /// `container_requests = 1`: one request per container.
    pub container_requests: Vec<ContainerPreferredAllocationRequest>,
}

impl Message for PreferredAllocationRequest {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        for r in &self.container_requests {
            prost::encoding::message::encode(1, r, buf);
        }
    }

    #[allow(deprecated)] // DecodeError::new: prost offers no other way to make one.
    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        if tag != 1 {
            return prost::encoding::skip_field(wire_type, tag, buf, ctx);
        }
        prost::encoding::check_wire_type(WireType::LengthDelimited, wire_type)?;
        let len = delimited_len(buf)?;
        let mut request = ContainerPreferredAllocationRequest::default();
        if let Some(whole) = buf.chunk().get(..len) {
            request.merge_slice(whole, &ctx)?;
            buf.advance(len);
        } else {
            // Spread over pieces of the buffer: prost's way, a field at a time.
            let mut piece = buf.take(len);
            while piece.has_remaining() {
                let (tag, wire_type) = prost::encoding::decode_key(&mut piece)?;
                request.merge_field(tag, wire_type, &mut piece, ctx.clone())?;
            }
        }
        self.container_requests.push(request);
        Ok(())
    }

    fn encoded_len(&self) -> usize {
        prost::encoding::message::encoded_len_repeated(1, &self.container_requests)
    }

    fn clear(&mut self) {
        self.container_requests.clear();
    }
}

/// `v1.ContainerDevices` (PodResources): one resource's devices in a container, as the
/// kubelet's `List` and `GetAllocatableResources` answer them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ContainerDevices {
    /// `resource_name = 1`.
    pub resource_name: String,
    /// `device_ids = 2`.
    pub device_ids: DeviceIds,
    /// `topology = 3`.
    pub topology: Option<crate::podresources::TopologyInfo>,
}

impl Message for ContainerDevices {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        if !self.resource_name.is_empty() {
            prost::encoding::string::encode(1, &self.resource_name, buf);
        }
        self.device_ids.encode_field(2, buf);
        if let Some(topology) = &self.topology {
            prost::encoding::message::encode(3, topology, buf);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        match tag {
            1 => prost::encoding::string::merge(wire_type, &mut self.resource_name, buf, ctx),
            2 => self.device_ids.merge_one(wire_type, buf, ctx),
            3 => {
                prost::encoding::message::merge(wire_type, self.topology.get_or_insert_with(Default::default), buf, ctx)
            }
            _ => prost::encoding::skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        (if self.resource_name.is_empty() { 0 } else { prost::encoding::string::encoded_len(1, &self.resource_name) })
            + self.device_ids.field_len(2)
            + self.topology.as_ref().map_or(0, |t| prost::encoding::message::encoded_len(3, t))
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}

/// Where the daemon's device list comes from when it is encoded.
pub trait DeviceSource: Send + Sync + fmt::Debug {
    /// Calls `f` with every device: its ID, whether it is healthy, and its NUMA node if
    /// published.
    fn for_each_device(&self, f: &mut dyn FnMut(&str, bool, Option<i64>));
}

/// `v1beta1.ListAndWatchResponse`: `repeated Device devices = 1`.
#[derive(Clone, Default)]
pub struct ListAndWatchResponse {
    /// The devices, when the message was decoded or built from values.
    pub devices: Vec<Device>,
    /// The devices, when they are written from a source as the message is encoded (after
    /// `devices`, if both are set).
    pub source: Option<Arc<dyn DeviceSource>>,
}

impl ListAndWatchResponse {
    /// A message whose devices come from `source` as it is encoded.
    #[must_use]
    pub fn from_source(source: Arc<dyn DeviceSource>) -> Self {
        ListAndWatchResponse { devices: Vec::new(), source: Some(source) }
    }
}

impl fmt::Debug for ListAndWatchResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ListAndWatchResponse")
            .field("devices", &self.devices.len())
            .field("source", &self.source)
            .finish()
    }
}

impl PartialEq for ListAndWatchResponse {
    fn eq(&self, other: &Self) -> bool {
        self.encode_to_vec() == other.encode_to_vec()
    }
}

const HEALTHY: &str = crate::HEALTHY;
const UNHEALTHY: &str = crate::UNHEALTHY;

/// The length of `Device` `{id, health, topology}` without its field wrapper.
fn device_len(id: &str, health: &str, numa: Option<i64>) -> (usize, usize, usize) {
    let mut len = 1 + encoded_len_varint(id.len() as u64) + id.len();
    len += 1 + encoded_len_varint(health.len() as u64) + health.len();
    // TopologyInfo { repeated NUMANode nodes = 1 }, NUMANode { int64 ID = 1 } (0 left out).
    let (mut node_len, mut topology_len) = (0, 0);
    if let Some(n) = numa {
        node_len = if n == 0 { 0 } else { 1 + encoded_len_varint(n.cast_unsigned()) };
        topology_len = 1 + encoded_len_varint(node_len as u64) + node_len;
        len += 1 + encoded_len_varint(topology_len as u64) + topology_len;
    }
    (len, topology_len, node_len)
}

impl Message for ListAndWatchResponse {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        for d in &self.devices {
            prost::encoding::message::encode(1, d, buf);
        }
        if let Some(source) = &self.source {
            source.for_each_device(&mut |id, healthy, numa| {
                let health = if healthy { HEALTHY } else { UNHEALTHY };
                let (len, topology_len, node_len) = device_len(id, health, numa);
                encode_key(1, WireType::LengthDelimited, buf);
                encode_varint(len as u64, buf);
                encode_key(1, WireType::LengthDelimited, buf);
                encode_varint(id.len() as u64, buf);
                buf.put_slice(id.as_bytes());
                encode_key(2, WireType::LengthDelimited, buf);
                encode_varint(health.len() as u64, buf);
                buf.put_slice(health.as_bytes());
                if let Some(n) = numa {
                    encode_key(3, WireType::LengthDelimited, buf);
                    encode_varint(topology_len as u64, buf);
                    encode_key(1, WireType::LengthDelimited, buf);
                    encode_varint(node_len as u64, buf);
                    if n != 0 {
                        prost::encoding::int64::encode(1, &n, buf);
                    }
                }
            });
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        if tag == 1 {
            prost::encoding::message::merge_repeated(wire_type, &mut self.devices, buf, ctx)
        } else {
            prost::encoding::skip_field(wire_type, tag, buf, ctx)
        }
    }

    fn encoded_len(&self) -> usize {
        let mut total = prost::encoding::message::encoded_len_repeated(1, &self.devices);
        if let Some(source) = &self.source {
            source.for_each_device(&mut |id, healthy, numa| {
                let (len, _, _) = device_len(id, if healthy { HEALTHY } else { UNHEALTHY }, numa);
                total += 1 + encoded_len_varint(len as u64) + len;
            });
        }
        total
    }

    fn clear(&mut self) {
        self.devices.clear();
        self.source = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deviceplugin::{NumaNode, TopologyInfo};

    /// The generated message, for comparing encodings.
    #[derive(Clone, PartialEq, prost::Message)]
    struct GeneratedRequest {
        #[prost(string, repeated, tag = "1")]
        available: Vec<String>,
        #[prost(string, repeated, tag = "2")]
        must: Vec<String>,
        #[prost(int32, tag = "3")]
        size: i32,
    }

    #[test]
    fn the_compact_request_is_wire_compatible() {
        let generated = GeneratedRequest {
            available: vec!["Q30".into(), "Q31".into(), "ünï".into()],
            must: vec!["Q31".into()],
            size: 2,
        };
        let bytes = generated.encode_to_vec();
        let compact = ContainerPreferredAllocationRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(compact.available_device_i_ds.to_vec(), generated.available);
        assert_eq!(compact.must_include_device_i_ds.to_vec(), generated.must);
        assert_eq!(compact.allocation_size, 2);
        assert_eq!(compact.encode_to_vec(), bytes);
        assert_eq!(compact.encoded_len(), bytes.len());
        // Bad input is an error, not a panic.
        assert!(ContainerPreferredAllocationRequest::decode(&[0x0a, 0x05, b'a'][..]).is_err());
        assert!(ContainerPreferredAllocationRequest::decode(&[0x0a, 0x01, 0xff][..]).is_err());
        assert!(ContainerPreferredAllocationRequest::decode(&[0x08, 0x01][..]).is_err(), "wrong wire type");
        assert_eq!(format!("{:?}", compact.available_device_i_ds), r#"["Q30", "Q31", "ünï"]"#);
        // IDs longer than the stack buffer take the other path, with the same checks.
        let long =
            GeneratedRequest { available: vec!["x".repeat(65), "ü".repeat(40), "y".into()], must: vec![], size: 1 };
        let compact = ContainerPreferredAllocationRequest::decode(long.encode_to_vec().as_slice()).unwrap();
        assert_eq!(compact.available_device_i_ds.to_vec(), long.available);
        let mut bad = vec![0x0a, 65];
        bad.extend(std::iter::repeat_n(b'x', 64));
        bad.push(0xff);
        assert!(ContainerPreferredAllocationRequest::decode(bad.as_slice()).is_err(), "a long ID that is not UTF-8");
    }

    /// The generated `v1beta1.PreferredAllocationRequest`, for comparing encodings.
    #[derive(Clone, PartialEq, prost::Message)]
    struct GeneratedEnvelope {
        #[prost(message, repeated, tag = "1")]
        requests: Vec<GeneratedRequest>,
    }

    #[test]
    fn the_request_envelope_is_wire_compatible_however_the_buffer_is_cut() {
        let generated = GeneratedEnvelope {
            requests: vec![
                GeneratedRequest {
                    available: vec!["Q30".into(), "x".repeat(200), "ünï".into(), String::new()],
                    must: vec!["Q30".into()],
                    size: 2,
                },
                GeneratedRequest { available: vec![], must: vec![], size: 0 },
                GeneratedRequest { available: vec!["Z".into(); 3], must: vec![], size: -1 },
            ],
        };
        let bytes = generated.encode_to_vec();
        for decoded in decode_every_way::<PreferredAllocationRequest>(&bytes) {
            let decoded = decoded.unwrap();
            assert_eq!(decoded.container_requests.len(), 3);
            for (compact, want) in decoded.container_requests.iter().zip(&generated.requests) {
                assert_eq!(compact.available_device_i_ds.to_vec(), want.available);
                assert_eq!(compact.must_include_device_i_ds.to_vec(), want.must);
                assert_eq!(compact.allocation_size, want.size);
            }
            assert_eq!(decoded.encode_to_vec(), bytes, "encodes as the generated message");
            assert_eq!(decoded.encoded_len(), bytes.len());
        }
        // Fields this build does not know are skipped, in the envelope and in a request.
        // The envelope's field 4 (7), then a request of 7 bytes: ID "A", field 5 (1), size 3.
        let unknown = [0x20, 0x07, 0x0a, 0x07, 0x0a, 0x01, b'A', 0x28, 0x01, 0x18, 0x03];
        for decoded in decode_every_way::<PreferredAllocationRequest>(&unknown) {
            let decoded = decoded.unwrap();
            assert_eq!(decoded.container_requests[0].available_device_i_ds.to_vec(), ["A"]);
            assert_eq!(decoded.container_requests[0].allocation_size, 3);
        }
    }

    #[test]
    fn a_bad_request_envelope_is_an_error_however_the_buffer_is_cut() {
        for bad in [
            &[0x0a, 0x03, 0x0a, 0x05, b'a'][..],         // an ID longer than its request
            &[0x0a, 0x03, 0x0a, 0x01, 0xff],             // an ID that is not UTF-8
            &[0x0a, 0x02, 0x0a, 0x01],                   // an ID cut at the request's end
            &[0x0a, 0x01, 0x0a],                         // a key without its field
            &[0x0a, 0x02, 0x08, 0x01],                   // an ID sent as a number
            &[0x0a, 0x05, 0x0a, 0x80, 0x01, b'a', b'b'], // a long length, cut
            &[0x08, 0x01, 0x0a, 0x09],                   // a request sent as a number, then cut
            &[0x0a, 0x09, 0x0a, 0x01, b'a'],             // a request longer than the message
        ] {
            for decoded in decode_every_way::<PreferredAllocationRequest>(bad) {
                assert!(decoded.is_err(), "{bad:?} is refused, got {decoded:?}");
            }
        }
    }

    /// Decodes `bytes` in one piece and cut in two at every place: an ID cut in two, or whose
    /// length is, takes the path through prost's buffer calls.
    fn decode_every_way<M: Message + Default>(bytes: &[u8]) -> Vec<Result<M, DecodeError>> {
        let mut all = vec![M::decode(bytes)];
        all.extend((0..=bytes.len()).map(|cut| {
            let (a, b) = bytes.split_at(cut);
            M::decode(a.chain(b))
        }));
        all
    }

    #[test]
    fn an_id_is_decoded_alike_whole_or_in_pieces() {
        let generated = GeneratedRequest {
            available: vec!["Q30".into(), "x".repeat(200), "ü".repeat(40), String::new(), "y".repeat(70)],
            must: vec!["Q30".into()],
            size: 2,
        };
        let bytes = generated.encode_to_vec();
        for decoded in decode_every_way::<ContainerPreferredAllocationRequest>(&bytes) {
            let decoded = decoded.unwrap();
            assert_eq!(decoded.available_device_i_ds.to_vec(), generated.available);
            assert_eq!(decoded.must_include_device_i_ds.to_vec(), generated.must);
            assert_eq!(decoded.allocation_size, 2);
        }
        for bad in [
            &[0x0a, 0x05, b'a'][..],               // cut short
            &[0x0a, 0x02, b'a', 0xff],             // not UTF-8
            &[0x0a, 0x81, 0x01, b'a'],             // a two-byte length, cut short
            &[0x0a, 0x01, 0xc3, 0x0a, 0x01, 0xbc], // a character split between two IDs
        ] {
            for decoded in decode_every_way::<ContainerPreferredAllocationRequest>(bad) {
                assert!(decoded.is_err(), "{bad:?} is refused, got {decoded:?}");
            }
        }
    }

    /// The generated `v1.ContainerDevices`, for comparing encodings.
    #[derive(Clone, PartialEq, prost::Message)]
    struct GeneratedDevices {
        #[prost(string, tag = "1")]
        resource_name: String,
        #[prost(string, repeated, tag = "2")]
        device_ids: Vec<String>,
        #[prost(message, optional, tag = "3")]
        topology: Option<crate::podresources::TopologyInfo>,
    }

    #[test]
    fn the_compact_device_set_is_wire_compatible() {
        use crate::podresources::{NumaNode, TopologyInfo};
        let topology = Some(TopologyInfo { nodes: vec![NumaNode { id: 0 }, NumaNode { id: 1 }] });
        for generated in [
            GeneratedDevices {
                resource_name: "gpushare.io/gpu-mem".into(),
                device_ids: vec!["Q0-1".into(), "Q0-2".into(), "ünï".into()],
                topology: topology.clone(),
            },
            GeneratedDevices { resource_name: String::new(), device_ids: vec![], topology: None },
            GeneratedDevices { resource_name: "x.io/r".into(), device_ids: vec!["a".into()], topology: None },
        ] {
            let bytes = generated.encode_to_vec();
            let compact = ContainerDevices::decode(bytes.as_slice()).unwrap();
            assert_eq!(compact.resource_name, generated.resource_name);
            assert_eq!(compact.device_ids.to_vec(), generated.device_ids);
            assert_eq!(compact.topology, generated.topology);
            assert_eq!(compact.encode_to_vec(), bytes, "encodes as the generated message");
            assert_eq!(compact.encoded_len(), bytes.len());
        }
        // Bad input is an error, not a panic: a cut ID, an ID that is not UTF-8, an ID sent as
        // a number, a topology that is no message.
        for bad in [&[0x12, 0x05, b'a'][..], &[0x12, 0x01, 0xff], &[0x10, 0x01], &[0x1a, 0x02, 0x08]] {
            assert!(ContainerDevices::decode(bad).is_err(), "{bad:?} is refused");
        }
    }

    #[derive(Debug)]
    struct Three;

    impl DeviceSource for Three {
        fn for_each_device(&self, f: &mut dyn FnMut(&str, bool, Option<i64>)) {
            f("A0", true, Some(0));
            f("A1", false, Some(3));
            f("B0", true, None);
        }
    }

    #[test]
    fn a_list_from_a_source_encodes_as_the_values_would() {
        let values = ListAndWatchResponse {
            devices: vec![
                Device {
                    id: "A0".into(),
                    health: HEALTHY.into(),
                    topology: Some(TopologyInfo { nodes: vec![NumaNode { id: 0 }] }),
                },
                Device {
                    id: "A1".into(),
                    health: UNHEALTHY.into(),
                    topology: Some(TopologyInfo { nodes: vec![NumaNode { id: 3 }] }),
                },
                Device { id: "B0".into(), health: HEALTHY.into(), topology: None },
            ],
            source: None,
        };
        let lazy = ListAndWatchResponse::from_source(Arc::new(Three));
        let bytes = values.encode_to_vec();
        assert_eq!(lazy.encode_to_vec(), bytes);
        assert_eq!(lazy.encoded_len(), bytes.len());
        let decoded = ListAndWatchResponse::decode(bytes.as_slice()).unwrap();
        assert_eq!(decoded.devices, values.devices);
        assert_eq!(decoded, lazy);
    }
}
