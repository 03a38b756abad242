//! The registration socket's connections, with `:authority` made valid. The kubelet's plugin
//! watcher dials a registration socket with gRPC-Go's default authority, which for a socket
//! path is the path itself (kubernetes/kubernetes#109081; still so in kubelet 1.37); h2, under
//! tonic, refuses such a request as malformed (`RST_STREAM` with `PROTOCOL_ERROR`), so the
//! kubelet could never register the driver. Each connection is passed through
//! [`rewrite`], which decodes every header block the kubelet sends (HPACK, with the
//! connection's dynamic table), sets `:authority` to `localhost` — what the kubelet's DRA
//! client and gRPC-Go's `unix:` targets send — and encodes it again for tonic; every other
//! frame, and everything tonic answers, passes unchanged.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, DuplexStream, ReadBuf};

const PREFACE_LEN: usize = 24;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// HTTP/2's smallest (and default) maximum frame size; a gRPC header block is far below it.
const MAX_FRAME: usize = 16_384;

/// One connection as tonic reads it: the rewritten side of an in-memory pipe.
#[derive(Debug)]
pub struct Rewritten(DuplexStream);

impl tonic::transport::server::Connected for Rewritten {
    type ConnectInfo = ();
    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for Rewritten {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for Rewritten {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// Accepted connections of `listener`, each rewritten on a task of its own.
pub fn incoming(listener: tokio::net::UnixListener) -> impl futures::Stream<Item = io::Result<Rewritten>> {
    futures::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(client, _)| {
            let (ours, theirs) = tokio::io::duplex(64 * 1024);
            let (client_read, mut client_write) = client.into_split();
            let (mut tonic_read, tonic_write) = tokio::io::split(theirs);
            tokio::spawn(async move {
                let up = rewrite(client_read, tonic_write);
                let down = tokio::io::copy(&mut tonic_read, &mut client_write);
                if let (Err(e), _) | (_, Err(e)) = tokio::join!(up, down) {
                    tracing::debug!(error = %e, "a registration connection ended");
                }
            });
            Rewritten(ours)
        });
        Some((accepted, listener))
    })
}

fn malformed(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("registration connection: {what}"))
}

/// Copies an HTTP/2 client's byte stream from `from` to `to`, with every header block's
/// `:authority` set to `localhost`. Returns when `from` ends.
///
/// # Errors
/// An I/O error, or a stream that is not HTTP/2.
pub async fn rewrite<R, W>(mut from: R, mut to: W) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut preface = [0u8; PREFACE_LEN];
    from.read_exact(&mut preface).await?;
    to.write_all(&preface).await?;
    let mut decoder = fluke_hpack::Decoder::new();
    let mut encoder = fluke_hpack::Encoder::new();
    loop {
        let Some((head, payload)) = read_frame(&mut from).await? else {
            return to.shutdown().await;
        };
        let (kind, flags) = (head[3], head[4]);
        if kind != HEADERS {
            to.write_all(&head).await?;
            to.write_all(&payload).await?;
            to.flush().await?;
            continue;
        }
        let mut block = fragment(&payload, flags)?.to_vec();
        let mut done = flags & END_HEADERS != 0;
        while !done {
            let (next, more) = read_frame(&mut from).await?.ok_or_else(|| malformed("ends inside a header block"))?;
            if next[3] != CONTINUATION || next[5..9] != head[5..9] {
                return Err(malformed("a header block is interrupted by another frame"));
            }
            block.extend_from_slice(&more);
            done = next[4] & END_HEADERS != 0;
        }
        let headers = decoder.decode(&block).map_err(|e| malformed(&format!("undecodable header block: {e:?}")))?;
        let headers: Vec<(Vec<u8>, Vec<u8>)> = headers
            .into_iter()
            .map(|(name, value)| if name == b":authority" { (name, b"localhost".to_vec()) } else { (name, value) })
            .collect();
        let encoded = encoder.encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        if encoded.len() > MAX_FRAME {
            return Err(malformed("a header block over 16 KiB"));
        }
        let len = u32::try_from(encoded.len()).unwrap_or(u32::MAX).to_be_bytes();
        let mut out = [len[1], len[2], len[3], HEADERS, (flags & END_STREAM) | END_HEADERS, 0, 0, 0, 0];
        out[5..9].copy_from_slice(&head[5..9]);
        to.write_all(&out).await?;
        to.write_all(&encoded).await?;
        to.flush().await?;
    }
}

/// The next frame's 9-byte header and payload; `None` at a clean end of the stream.
async fn read_frame<R: AsyncRead + Unpin>(from: &mut R) -> io::Result<Option<([u8; 9], Vec<u8>)>> {
    let mut head = [0u8; 9];
    match from.read_exact(&mut head).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
    if len > MAX_FRAME {
        return Err(malformed("a frame over 16 KiB"));
    }
    let mut payload = vec![0u8; len];
    from.read_exact(&mut payload).await?;
    Ok(Some((head, payload)))
}

/// A HEADERS frame's header block fragment: its payload without padding and priority.
fn fragment(payload: &[u8], flags: u8) -> io::Result<&[u8]> {
    let bad = || malformed("a HEADERS frame shorter than its padding and priority");
    let (mut start, mut end) = (0, payload.len());
    if flags & PADDED != 0 {
        let pad = usize::from(*payload.first().ok_or_else(bad)?);
        start = 1;
        end = end.checked_sub(pad).ok_or_else(bad)?;
    }
    if flags & PRIORITY != 0 {
        start += 5;
    }
    payload.get(start..end).ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, stream: u8, payload: &[u8]) -> Vec<u8> {
        let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
        let mut f = vec![len[1], len[2], len[3], kind, flags, 0, 0, 0, stream];
        f.extend_from_slice(payload);
        f
    }

    #[tokio::test]
    async fn a_path_authority_becomes_localhost_and_other_frames_pass_unchanged() {
        let mut client = fluke_hpack::Encoder::new();
        let path_authority: &[(&[u8], &[u8])] = &[
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/pluginregistration.Registration/GetInfo"),
            (b":authority", b"/var/lib/kubelet/plugins_registry/gpu.gpushare.io-reg.sock"),
            (b"content-type", b"application/grpc"),
        ];
        let block = client.encode(path_authority.iter().copied());
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        input.extend(frame(0x4, 0, 0, &[0, 3, 0, 0, 0x10, 0])); // SETTINGS
        // The block split over HEADERS (padded) and CONTINUATION, as a client may send it.
        let (a, b) = block.split_at(block.len() / 2);
        let mut padded = vec![2];
        padded.extend_from_slice(a);
        padded.extend_from_slice(&[0, 0]);
        input.extend(frame(HEADERS, PADDED, 1, &padded));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, b));
        input.extend(frame(0x0, END_STREAM, 1, b"\0\0\0\0\0")); // DATA
        // A second request: the dynamic table carries over between blocks.
        input.extend(frame(HEADERS, END_HEADERS, 3, &client.encode(path_authority.iter().copied())));
        let mut out = Vec::new();
        rewrite(input.as_slice(), &mut out).await.unwrap();
        assert_eq!(&out[..PREFACE_LEN], b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
        let mut rest = &out[PREFACE_LEN..];
        let mut server = fluke_hpack::Decoder::new();
        let mut seen = Vec::new();
        while !rest.is_empty() {
            let len = usize::from(rest[1]) << 8 | usize::from(rest[2]);
            let (kind, flags, payload) = (rest[3], rest[4], &rest[9..9 + len]);
            if kind == HEADERS {
                assert_eq!(flags, END_HEADERS);
                let headers = server.decode(payload).unwrap();
                let authority = headers.iter().find(|(n, _)| n == b":authority").unwrap();
                assert_eq!(authority.1, b"localhost");
                assert!(headers.iter().any(|(n, v)| n == b":path" && v.ends_with(b"/GetInfo")));
            }
            seen.push(kind);
            rest = &rest[9 + len..];
        }
        assert_eq!(seen, [0x4, HEADERS, 0x0, HEADERS]);
    }

    #[tokio::test]
    async fn a_broken_header_block_is_an_error_not_a_panic() {
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        input.extend(frame(HEADERS, PADDED | END_HEADERS, 1, &[9, 1]));
        let mut out = Vec::new();
        let e = rewrite(input.as_slice(), &mut out).await.unwrap_err();
        assert!(e.to_string().contains("shorter than its padding"), "{e}");
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        input.extend(frame(HEADERS, 0, 1, &[0x82]));
        input.extend(frame(0x0, 0, 1, b"x"));
        let e = rewrite(input.as_slice(), &mut Vec::new()).await.unwrap_err();
        assert!(e.to_string().contains("interrupted"), "{e}");
    }
}
