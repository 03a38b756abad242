//! NRI's transport: ttrpc messages on logical connections multiplexed over one unix socket.
//!
//! A mux frame is an 8-byte header (connection ID, payload length; big-endian) and at most
//! [`MAX_FRAME`] bytes of payload. Each connection carries a byte stream of ttrpc messages: a
//! 10-byte header (length, stream ID, type, flags; big-endian) and a protobuf `ttrpc.Request`
//! or `ttrpc.Response` of at most [`MAX_MESSAGE`] bytes. The plugin is the ttrpc client on
//! [`RUNTIME_CONN`] and the server on [`PLUGIN_CONN`]. [`Decoder`] reassembles messages however
//! the frames and the socket's reads cut them; [`frame`] writes one message as frames.

use std::collections::HashMap;
use std::fmt;

use bytes::{Buf as _, Bytes, BytesMut};

/// The connection on which the runtime calls the plugin's services.
pub const PLUGIN_CONN: u32 = 1;
/// The connection on which the plugin calls the runtime's services.
pub const RUNTIME_CONN: u32 = 2;
/// The largest ttrpc message payload (ttrpc refuses larger).
pub const MAX_MESSAGE: usize = 4 << 20;
/// The largest mux frame payload: one ttrpc message with its header.
pub const MAX_FRAME: usize = TTRPC_HEADER + MAX_MESSAGE;
/// ttrpc message type: a request, which opens a stream.
pub const REQUEST: u8 = 1;
/// ttrpc message type: a response, which ends its stream.
pub const RESPONSE: u8 = 2;

const MUX_HEADER: usize = 8;
const TTRPC_HEADER: usize = 10;

/// One ttrpc message, with the connection it came on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// The mux connection.
    pub conn: u32,
    /// The ttrpc stream.
    pub stream: u32,
    /// [`REQUEST`], [`RESPONSE`] or another ttrpc type.
    pub kind: u8,
    /// The ttrpc flags.
    pub flags: u8,
    /// The protobuf envelope.
    pub payload: Bytes,
}

/// Bytes that are not NRI's framing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireError(String);

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for WireError {}

/// The bytes of `payload` as a ttrpc message of `kind` on `stream`, in frames of `conn`.
///
/// # Errors
/// If the payload is larger than ttrpc allows ([`MAX_MESSAGE`]).
pub fn frame(conn: u32, stream: u32, kind: u8, payload: &[u8]) -> Result<Vec<u8>, WireError> {
    let len = u32::try_from(payload.len()).ok().filter(|_| payload.len() <= MAX_MESSAGE).ok_or_else(|| {
        WireError(format!("a ttrpc message of {} bytes is over ttrpc's {MAX_MESSAGE}", payload.len()))
    })?;
    let mut message = Vec::with_capacity(TTRPC_HEADER + payload.len());
    message.extend_from_slice(&len.to_be_bytes());
    message.extend_from_slice(&stream.to_be_bytes());
    message.extend_from_slice(&[kind, 0]);
    message.extend_from_slice(payload);
    let mut out = Vec::with_capacity(MUX_HEADER + message.len());
    for chunk in message.chunks(MAX_FRAME) {
        out.extend_from_slice(&conn.to_be_bytes());
        // A chunk is at most MAX_FRAME, which fits.
        out.extend_from_slice(&u32::try_from(chunk.len()).unwrap_or(u32::MAX).to_be_bytes());
        out.extend_from_slice(chunk);
    }
    Ok(out)
}

/// Reassembles ttrpc messages from the socket's bytes.
#[derive(Debug, Default)]
pub struct Decoder {
    input: BytesMut,
    conns: HashMap<u32, BytesMut>,
}

impl Decoder {
    /// Adds bytes read from the socket.
    pub fn push(&mut self, data: &[u8]) {
        self.input.extend_from_slice(data);
    }

    /// The next whole message, if the bytes so far hold one.
    ///
    /// # Errors
    /// A frame or message longer than NRI allows, or a frame on connection 0 (reserved); the
    /// connection cannot be read on after either.
    pub fn next_message(&mut self) -> Result<Option<Message>, WireError> {
        loop {
            for (&conn, buf) in &mut self.conns {
                if let Some(m) = take_message(conn, buf)? {
                    return Ok(Some(m));
                }
            }
            let Some(header) = self.input.get(..MUX_HEADER) else { return Ok(None) };
            let conn = be32(&header[..4]);
            let len = be32(&header[4..]) as usize;
            if conn == 0 {
                return Err(WireError("a mux frame on connection 0, which NRI reserves".into()));
            }
            if len > MAX_FRAME {
                return Err(WireError(format!("a mux frame of {len} bytes is over NRI's {MAX_FRAME}")));
            }
            if self.input.len() < MUX_HEADER + len {
                return Ok(None);
            }
            self.input.advance(MUX_HEADER);
            let payload = self.input.split_to(len);
            self.conns.entry(conn).or_default().extend_from_slice(&payload);
        }
    }
}

/// The first whole ttrpc message of connection `conn`'s bytes, taken off them.
fn take_message(conn: u32, buf: &mut BytesMut) -> Result<Option<Message>, WireError> {
    let Some(header) = buf.get(..TTRPC_HEADER) else { return Ok(None) };
    let len = be32(&header[..4]) as usize;
    if len > MAX_MESSAGE {
        return Err(WireError(format!(
            "a ttrpc message of {len} bytes on connection {conn} is over ttrpc's {MAX_MESSAGE}"
        )));
    }
    if buf.len() < TTRPC_HEADER + len {
        return Ok(None);
    }
    let (stream, kind, flags) = (be32(&header[4..8]), header[8], header[9]);
    buf.advance(TTRPC_HEADER);
    Ok(Some(Message { conn, stream, kind, flags, payload: buf.split_to(len).freeze() }))
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn messages() -> Vec<(u32, u32, u8, Vec<u8>)> {
        vec![
            (RUNTIME_CONN, 1, REQUEST, b"register".to_vec()),
            (PLUGIN_CONN, 1, REQUEST, vec![]),
            (PLUGIN_CONN, 3, REQUEST, (0..=255).collect()),
            (RUNTIME_CONN, 1, RESPONSE, vec![7; 40]),
        ]
    }

    fn decode_all(d: &mut Decoder) -> Vec<(u32, u32, u8, Vec<u8>)> {
        let mut out = Vec::new();
        while let Some(m) = d.next_message().unwrap() {
            out.push((m.conn, m.stream, m.kind, m.payload.to_vec()));
        }
        out
    }

    #[test]
    fn messages_come_back_whole_however_the_bytes_are_cut() {
        let bytes: Vec<u8> = messages().iter().flat_map(|(c, s, k, p)| frame(*c, *s, *k, p).unwrap()).collect();
        for cut in 0..=bytes.len() {
            let mut d = Decoder::default();
            d.push(&bytes[..cut]);
            let mut got = decode_all(&mut d);
            d.push(&bytes[cut..]);
            got.extend(decode_all(&mut d));
            // Messages of one connection keep their order.
            for conn in [PLUGIN_CONN, RUNTIME_CONN] {
                let of = |v: &[(u32, u32, u8, Vec<u8>)]| v.iter().filter(|m| m.0 == conn).cloned().collect::<Vec<_>>();
                assert_eq!(of(&got), of(&messages()), "cut at {cut}");
            }
        }
    }

    #[test]
    fn a_message_split_over_frames_is_joined() {
        // What NRI's mux does with a write larger than one frame, and what a writer may do.
        let whole = frame(PLUGIN_CONN, 5, REQUEST, b"abcdefgh").unwrap();
        let message = &whole[MUX_HEADER..];
        let mut bytes = Vec::new();
        for part in [&message[..3], &message[3..12], &message[12..]] {
            bytes.extend_from_slice(&PLUGIN_CONN.to_be_bytes());
            bytes.extend_from_slice(&u32::try_from(part.len()).unwrap().to_be_bytes());
            bytes.extend_from_slice(part);
        }
        let mut d = Decoder::default();
        d.push(&bytes);
        assert_eq!(decode_all(&mut d), vec![(PLUGIN_CONN, 5, REQUEST, b"abcdefgh".to_vec())]);
    }

    #[test]
    fn oversized_and_reserved_frames_are_errors() {
        let mut d = Decoder::default();
        d.push(&[0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff]);
        assert!(d.next_message().unwrap_err().to_string().contains("over NRI's"));

        let mut d = Decoder::default();
        d.push(&[0, 0, 0, 0, 0, 0, 0, 1, 9]);
        assert!(d.next_message().unwrap_err().to_string().contains("reserves"));

        let mut d = Decoder::default();
        let mut bytes = PLUGIN_CONN.to_be_bytes().to_vec();
        bytes.extend_from_slice(&10u32.to_be_bytes());
        bytes.extend_from_slice(&[0x01, 0, 0, 0, 0, 0, 0, 1, REQUEST, 0]);
        d.push(&bytes);
        assert!(d.next_message().unwrap_err().to_string().contains("over ttrpc's"));

        assert!(frame(PLUGIN_CONN, 1, REQUEST, &vec![0; MAX_MESSAGE + 1]).is_err());
    }
}
