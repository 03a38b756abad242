//! A timing relay in front of a scheduler extender, so that every extender in a benchmark is timed
//! the same way, from outside, whatever histogram it keeps or lacks. kube-scheduler calls the
//! relay over plain HTTP; the relay sends each call on to the extender (plain HTTP, or HTTPS
//! trusting the box's CA, as HAMi's chart serves it) on a connection of its own, opened before
//! the clock starts, and records how long the extender took: from the request sent to the whole
//! answer read. Calls are kept by verb, the last segment of the path (`filter`, `prioritize`,
//! `bind`). The extender sees the same paths and bodies kube-scheduler sent. The relay runs on a
//! thread and runtime of its own, so that the benchmark's own work (listing thousands of pods)
//! never holds a call back.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use axum::body::Body;
use axum::extract::State;
use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::{BodyExt as _, Full};
use hyper_util::rt::TokioIo;

type Samples = Arc<Mutex<BTreeMap<String, Vec<Duration>>>>;

/// A running relay; it stops when dropped.
#[derive(Debug)]
pub struct CallTimer {
    url_prefix: String,
    samples: Samples,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

#[derive(Clone)]
struct Upstream {
    addr: SocketAddr,
    tls: Option<tokio_rustls::TlsConnector>,
    samples: Samples,
}

impl CallTimer {
    /// Starts a relay to the extender at `url_prefix` (kube-scheduler's `urlPrefix`:
    /// `http://<ip>:<port>[/path]` or `https://…`); `ca` is the PEM CA that signed an HTTPS
    /// extender's certificate.
    ///
    /// # Errors
    /// If the prefix is not of that form, HTTPS has no CA, the CA cannot be read, or no port can
    /// be bound.
    pub fn start(url_prefix: &str, ca: Option<&Path>) -> anyhow::Result<Self> {
        let (https, rest) = match url_prefix.split_once("://") {
            Some(("http", rest)) => (false, rest),
            Some(("https", rest)) => (true, rest),
            _ => bail!("{url_prefix}: not an http:// or https:// URL prefix"),
        };
        let (authority, path) = rest.split_once('/').map_or((rest, String::new()), |(a, p)| (a, format!("/{p}")));
        let addr: SocketAddr =
            authority.parse().with_context(|| format!("{url_prefix}: the extender's address is not <ip>:<port>"))?;
        let tls = match (https, ca) {
            (false, _) => None,
            (true, Some(ca)) => Some(tls_connector(ca)?),
            (true, None) => bail!("{url_prefix}: an HTTPS extender needs the CA that signed its certificate"),
        };
        let samples = Samples::default();
        let upstream = Upstream { addr, tls, samples: samples.clone() };
        let listener = std::net::TcpListener::bind("127.0.0.1:0").context("binding the call timer")?;
        listener.set_nonblocking(true)?;
        let local = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new().name("call-timer".into()).spawn(move || {
            runtime.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else { return };
                let app = axum::Router::new().fallback(relay).with_state(upstream);
                tokio::select! {
                    _ = axum::serve(listener, app) => {}
                    _ = stopped => {}
                }
            });
        })?;
        Ok(Self { url_prefix: format!("http://{local}{path}"), samples, stop: Some(stop) })
    }

    /// The `urlPrefix` kube-scheduler is to call instead of the extender's (always plain HTTP).
    pub fn url_prefix(&self) -> &str {
        &self.url_prefix
    }

    /// How many `verb` calls the extender answered.
    pub fn calls(&self, verb: &str) -> usize {
        self.samples.lock().unwrap_or_else(PoisonError::into_inner).get(verb).map_or(0, Vec::len)
    }

    /// Quantile `q` (0 < q ≤ 1) of the extender's time on `verb` calls, nearest rank; `None`
    /// before the first such call.
    pub fn quantile(&self, verb: &str, q: f64) -> Option<Duration> {
        let samples = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
        let mut times = samples.get(verb)?.clone();
        drop(samples);
        times.sort_unstable();
        nearest_rank(&times, q)
    }
}

impl Drop for CallTimer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// The nearest-rank quantile `q` of sorted `times`.
fn nearest_rank(times: &[Duration], q: f64) -> Option<Duration> {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    let rank = (q * times.len() as f64).ceil() as usize;
    times.get(rank.clamp(1, times.len().max(1)) - 1).copied()
}

fn tls_connector(ca: &Path) -> anyhow::Result<tokio_rustls::TlsConnector> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).with_context(|| format!("reading {}", ca.display()))? {
        roots.add(cert.with_context(|| format!("a certificate in {}", ca.display()))?)?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

async fn relay(State(upstream): State<Upstream>, request: Request<Body>) -> Response<Body> {
    match forward(&upstream, request).await {
        Ok(response) => response,
        Err(e) => {
            let mut response = Response::new(Body::from(format!("call timer: the extender did not answer: {e:#}")));
            *response.status_mut() = StatusCode::BAD_GATEWAY;
            response
        }
    }
}

async fn forward(upstream: &Upstream, request: Request<Body>) -> anyhow::Result<Response<Body>> {
    let (parts, body) = request.into_parts();
    let body = body.collect().await.context("reading kube-scheduler's request")?.to_bytes();
    let verb = parts.uri.path().rsplit('/').next().unwrap_or_default().to_owned();
    let request = Request::from_parts(parts, Full::new(body));
    let tcp = tokio::net::TcpStream::connect(upstream.addr).await.context("connecting")?;
    tcp.set_nodelay(true)?;
    let (mut parts, body, took) = match &upstream.tls {
        None => exchange(TokioIo::new(tcp), request).await?,
        Some(tls) => {
            let name = rustls::pki_types::ServerName::IpAddress(upstream.addr.ip().into());
            let stream = tls.connect(name, tcp).await.context("TLS handshake")?;
            exchange(TokioIo::new(stream), request).await?
        }
    };
    upstream.samples.lock().unwrap_or_else(PoisonError::into_inner).entry(verb).or_default().push(took);
    // The body goes back whole, with its own length.
    parts.headers.remove(header::TRANSFER_ENCODING);
    parts.headers.remove(header::CONNECTION);
    Ok(Response::from_parts(parts, Body::from(body)))
}

/// Sends `request` on `io` and reads the whole answer: the answer and the time it took.
async fn exchange<I>(io: I, request: Request<Full<Bytes>>) -> anyhow::Result<(http::response::Parts, Bytes, Duration)>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut send, connection) = hyper::client::conn::http1::handshake(io).await.context("HTTP handshake")?;
    let connection = tokio::spawn(connection);
    let t = Instant::now();
    let response = send.send_request(request).await.context("sending the call")?;
    let (parts, body) = response.into_parts();
    let body = body.collect().await.context("reading the answer")?.to_bytes();
    let took = t.elapsed();
    connection.abort();
    Ok((parts, body, took))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let times: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(nearest_rank(&times, 0.5), Some(Duration::from_millis(50)));
        assert_eq!(nearest_rank(&times, 0.99), Some(Duration::from_millis(99)));
        assert_eq!(nearest_rank(&times, 1.0), Some(Duration::from_millis(100)));
        assert_eq!(nearest_rank(&times[..1], 0.99), Some(Duration::from_millis(1)));
        assert_eq!(nearest_rank(&[], 0.5), None);
    }

    /// A call goes through unchanged both ways and is timed under its verb.
    #[tokio::test]
    async fn relays_and_times_each_call_by_verb() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new().route(
            "/prefix/{verb}",
            axum::routing::post(|axum::extract::Path(verb): axum::extract::Path<String>, body: String| async move {
                if verb == "filter" {
                    tokio::time::sleep(Duration::from_millis(30)).await;
                }
                format!("{verb}:{body}")
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let timer = CallTimer::start(&format!("http://{addr}/prefix"), None).unwrap();
        assert!(timer.url_prefix().starts_with("http://127.0.0.1:") && timer.url_prefix().ends_with("/prefix"));
        let relay: SocketAddr = timer.url_prefix()["http://".len()..].trim_end_matches("/prefix").parse().unwrap();
        for (verb, body) in [("filter", "{\"a\":1}"), ("bind", "{}"), ("filter", "x")] {
            let answer = post(relay, &format!("/prefix/{verb}"), body).await;
            assert_eq!(answer, format!("{verb}:{body}"));
        }
        assert_eq!((timer.calls("filter"), timer.calls("bind"), timer.calls("prioritize")), (2, 1, 0));
        assert!(timer.quantile("filter", 0.5).unwrap() >= Duration::from_millis(30));
        assert!(timer.quantile("bind", 0.5).unwrap() < Duration::from_millis(30));
        assert_eq!(timer.quantile("prioritize", 0.5), None);
    }

    #[test]
    fn a_bad_prefix_is_refused_with_the_reason() {
        let e = CallTimer::start("ftp://127.0.0.1:1", None).err().unwrap();
        assert!(format!("{e:#}").contains("not an http:// or https://"), "{e:#}");
        let e = CallTimer::start("https://127.0.0.1:1/x", None).err().unwrap();
        assert!(format!("{e:#}").contains("needs the CA"), "{e:#}");
        let e = CallTimer::start("http://localhost:1", None).err().unwrap();
        assert!(format!("{e:#}").contains("<ip>:<port>"), "{e:#}");
    }

    async fn post(addr: SocketAddr, path: &str, body: &str) -> String {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        stream.read_to_end(&mut out).await.unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        text.split_once("\r\n\r\n").unwrap().1.to_owned()
    }
}
