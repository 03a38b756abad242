//! The HTTP adapter: kube-scheduler's verbs under the configured prefix ([`router`]), and on a
//! listener of their own ([`observe_router`]) the metrics and the inspect view, which name every
//! tenant's pods; health, readiness and the version on both. Handlers only translate between
//! JSON and [`Extender`] calls.
//!
//! | listener | method | path | answer |
//! |---|---|---|---|
//! | scheduler | POST | `<prefix>/filter`, `/prioritize`, `/bind`, `/preempt` | the extender JSON of `docs/extender.md`; a malformed body is HTTP 400 with the reason |
//! | observe | GET | `<prefix>/inspect`, `<prefix>/inspect/{node}` | the cluster view as JSON; an unknown node is 404 |
//! | observe | GET | `/metrics` | Prometheus text |
//! | both | GET | `/healthz` | 200 while the process serves |
//! | both | GET | `/readyz` | 200 once the view has synced, else 503 with the reason |
//! | both | GET | `/version` | the version |
//!
//! Bodies over the configured limit get 413; a request not answered in time gets 503.
//!
//! A verb waits for the cluster view's lock and decodes its body synchronously, and one slow
//! request must not hold up `/healthz`, the watches or the timeout of the others. So a verb whose
//! body is small (at most [`INLINE_BODY_BYTES`], some nine thousand node names: answered within a
//! millisecond or two) is parsed on the async worker and answered there if the view is free
//! within [`INLINE_PATIENCE`] of that, sparing the hand-off to another thread (tens of
//! microseconds, a fifth of a 500-node filter) and letting its parsing overlap another request's
//! hold of the view. Otherwise it runs on tokio's blocking pool. Bodies over [`LARGE_BODY_BYTES`] go
//! one at a time (a 15 MB filter body decodes into several hundred MB), and the memory they took
//! is given back to the system when each is done.

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path as UrlPath, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde::Serialize;
use thiserror::Error;
use tokio::net::TcpListener;

use crate::service::{Cluster, Extender};
use crate::wire::{BindingArgs, BindingResult, ExtenderArgs, PreemptionArgs};

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// URL prefix of the verbs, e.g. `/gpushare-scheduler`.
    pub prefix: String,
    /// Largest body.
    pub max_body_bytes: usize,
    /// Time to answer.
    pub timeout: Duration,
}

/// TLS cannot be set up.
#[derive(Debug, Error)]
#[error("TLS {path}: {reason}")]
pub struct TlsError {
    /// The file.
    pub path: String,
    /// What is wrong.
    pub reason: String,
}

/// Bodies larger than this are decoded one at a time.
pub const LARGE_BODY_BYTES: usize = 1024 * 1024;

/// Bodies up to this size are answered on the async worker when the view is free.
pub const INLINE_BODY_BYTES: usize = 128 * 1024;

/// How long a small request waits on the async worker for the view before it goes to the
/// blocking pool: about one small request's hold, so that small requests queue behind each
/// other in place and only a long hold (a huge request, a watch's burst) sends them off.
pub const INLINE_PATIENCE: Duration = Duration::from_millis(2);

struct App<C> {
    ext: Arc<Extender<C>>,
    /// The one permit of the large-body lane.
    large: Arc<tokio::sync::Semaphore>,
}

impl<C> Clone for App<C> {
    fn clone(&self) -> Self {
        App { ext: self.ext.clone(), large: self.large.clone() }
    }
}

fn json<T: Serialize>(status: StatusCode, value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => (status, [(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("cannot encode the answer: {e}\n")).into_response(),
    }
}

fn parse<'de, C: Cluster, T: Deserialize<'de>>(app: &App<C>, verb: &str, body: &'de [u8]) -> Result<T, Box<Response>> {
    serde_json::from_slice(body).map_err(|e| {
        app.ext.metrics().bad_request();
        tracing::warn!(verb, error = %e, "malformed request");
        Box::new((StatusCode::BAD_REQUEST, format!("malformed {verb} request: {e}\n")).into_response())
    })
}

/// The scheduler's router: kube-scheduler's verbs, health, readiness and the version.
pub fn router<C: Cluster>(ext: Arc<Extender<C>>, options: &ServerOptions) -> Router {
    let p = options.prefix.trim_end_matches('/');
    let routes = Router::new()
        .route(&format!("{p}/filter"), post(filter::<C>))
        .route(&format!("{p}/prioritize"), post(prioritize::<C>))
        .route(&format!("{p}/bind"), post(bind::<C>))
        .route(&format!("{p}/preempt"), post(preempt::<C>));
    finish(routes, ext, options)
}

/// The observer's router, for `[server] observe_listen`: the metrics and the inspect view,
/// health, readiness and the version.
pub fn observe_router<C: Cluster>(ext: Arc<Extender<C>>, options: &ServerOptions) -> Router {
    let p = options.prefix.trim_end_matches('/');
    let routes = Router::new()
        .route(&format!("{p}/inspect"), get(inspect::<C>))
        .route(&format!("{p}/inspect/{{node}}"), get(inspect_node::<C>))
        .route("/metrics", get(metrics::<C>));
    finish(routes, ext, options)
}

/// Adds what both routers serve: health, readiness, the version, the body limit and the
/// timeout.
fn finish<C: Cluster>(routes: Router<App<C>>, ext: Arc<Extender<C>>, options: &ServerOptions) -> Router {
    let timeout = options.timeout;
    routes
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz::<C>))
        .route("/version", get(|| async { concat!(env!("CARGO_PKG_VERSION"), "\n") }))
        .layer(DefaultBodyLimit::max(options.max_body_bytes))
        .layer(axum::middleware::from_fn(move |req: Request, next: Next| async move {
            let path = req.uri().path().to_owned();
            match tokio::time::timeout(timeout, next.run(req)).await {
                Ok(r) => r,
                Err(_) => {
                    tracing::warn!(path = %path, timeout_s = timeout.as_secs(), "request timed out");
                    (StatusCode::SERVICE_UNAVAILABLE, format!("{path}: not answered within {} s\n", timeout.as_secs()))
                        .into_response()
                }
            }
        }))
        .with_state(App { ext, large: Arc::new(tokio::sync::Semaphore::new(1)) })
}

/// Parses a verb's body, answers it with `answer`, and times it. With `patience` (on the async
/// worker) it gives up, answering `None`, when the view is still held that long after the body
/// was parsed: the caller then answers it on the blocking pool.
fn verb<'de, C: Cluster, A: Deserialize<'de>>(
    app: &App<C>,
    name: &str,
    body: &'de [u8],
    patience: Option<Duration>,
    answer: impl FnOnce(&A) -> Response,
) -> Option<Response> {
    let start = Instant::now();
    let args: A = match parse(app, name, body) {
        Ok(a) => a,
        Err(r) => return Some(*r),
    };
    if patience.is_some_and(|p| !app.ext.view_free_within(p)) {
        return None;
    }
    let response = answer(&args);
    app.ext.metrics().observe(name, start.elapsed());
    Some(response)
}

/// Answers a verb: on the async worker when its body is small and the view free by the time the
/// body is parsed (so that parsing overlaps another request's hold of the view), else on the
/// blocking pool, parsed there again.
async fn answer_verb<C: Cluster>(
    app: App<C>,
    body: Bytes,
    f: impl Fn(&App<C>, &[u8], Option<Duration>) -> Option<Response> + Clone + Send + 'static,
) -> Response {
    if body.len() <= INLINE_BODY_BYTES
        && let Some(response) = f(&app, &body, Some(INLINE_PATIENCE))
    {
        return response;
    }
    off_the_workers(app, body, move |app, body| {
        f(app, body, None)
            .unwrap_or_else(|| (StatusCode::SERVICE_UNAVAILABLE, "the cluster view stayed busy\n").into_response())
    })
    .await
}

/// Runs `f` (a verb's decoding and answer, or a whole-cluster report, which passes no body) on
/// the blocking pool, large bodies one at a time. When the request times out this future is
/// dropped: a call still waiting for the large lane leaves it, one already running finishes in
/// the background and its answer is dropped.
async fn off_the_workers<C: Cluster>(
    app: App<C>,
    body: Bytes,
    f: impl FnOnce(&App<C>, &[u8]) -> Response + Send + 'static,
) -> Response {
    let permit = if body.len() > LARGE_BODY_BYTES {
        match app.large.clone().acquire_owned().await {
            Ok(p) => Some(p),
            Err(e) => {
                return (StatusCode::SERVICE_UNAVAILABLE, format!("the extender is stopping: {e}\n")).into_response();
            }
        }
    } else {
        None
    };
    let task = tokio::task::spawn_blocking(move || {
        let response = f(&app, &body);
        if permit.is_some() {
            tracing::debug!(bytes = body.len(), "large request answered; giving its memory back");
            drop(body);
            crate::memory::release_free_memory();
        }
        drop(permit);
        response
    });
    task.await.unwrap_or_else(|e| {
        (StatusCode::INTERNAL_SERVER_ERROR, format!("the request failed inside the extender: {e}\n")).into_response()
    })
}

async fn filter<C: Cluster>(State(app): State<App<C>>, body: Bytes) -> Response {
    answer_verb(app, body, |app, body, patience| {
        verb(app, "filter", body, patience, |args: &ExtenderArgs| json(StatusCode::OK, &app.ext.filter(args)))
    })
    .await
}

async fn prioritize<C: Cluster>(State(app): State<App<C>>, body: Bytes) -> Response {
    answer_verb(app, body, |app, body, patience| {
        verb(app, "prioritize", body, patience, |args: &ExtenderArgs| json(StatusCode::OK, &app.ext.prioritize(args)))
    })
    .await
}

async fn preempt<C: Cluster>(State(app): State<App<C>>, body: Bytes) -> Response {
    answer_verb(app, body, |app, body, patience| {
        verb(app, "preempt", body, patience, |args: &PreemptionArgs| json(StatusCode::OK, &app.ext.preempt(args)))
    })
    .await
}

async fn bind<C: Cluster>(State(app): State<App<C>>, body: Bytes) -> Response {
    let start = Instant::now();
    let args: BindingArgs = match parse(&app, "bind", &body) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    // The bind runs to its end even if this request times out, so its assumption is either
    // confirmed or rolled back, never left half-done.
    let ext = app.ext.clone();
    let result = tokio::spawn(async move { ext.bind(&args).await })
        .await
        .unwrap_or_else(|e| BindingResult { error: format!("bind failed inside the extender: {e}") });
    app.ext.metrics().observe("bind", start.elapsed());
    json(StatusCode::OK, &result)
}

async fn inspect<C: Cluster>(State(app): State<App<C>>) -> Response {
    off_the_workers(app, Bytes::new(), |app, _| json(StatusCode::OK, &app.ext.report())).await
}

async fn inspect_node<C: Cluster>(State(app): State<App<C>>, UrlPath(node): UrlPath<String>) -> Response {
    off_the_workers(app, Bytes::new(), move |app, _| {
        let report = app.ext.report().only(&node);
        if report.nodes.is_empty() && report.unreadable.is_empty() {
            return (StatusCode::NOT_FOUND, format!("node {node:?} is not a gpushare node in the extender's view\n"))
                .into_response();
        }
        json(StatusCode::OK, &report)
    })
    .await
}

async fn readyz<C: Cluster>(State(app): State<App<C>>) -> Response {
    if app.ext.is_ready() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready: the view of nodes and pods has not synced with the API server\n")
            .into_response()
    }
}

async fn metrics<C: Cluster>(State(app): State<App<C>>) -> Response {
    off_the_workers(app, Bytes::new(), |app, _| {
        ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], app.ext.render_metrics()).into_response()
    })
    .await
}

/// A TLS acceptor from PEM files; with `client_ca`, every caller must present a client
/// certificate that chains to it.
///
/// # Errors
/// [`TlsError`] naming the file that cannot be used.
pub fn tls_acceptor(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<tokio_rustls::TlsAcceptor, TlsError> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let bad = |path: &Path, reason: String| TlsError { path: path.display().to_string(), reason };
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .map_err(|e| bad(cert, format!("cannot read a PEM certificate chain: {e}")))?;
    if certs.is_empty() {
        return Err(bad(cert, "holds no certificate".to_owned()));
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| bad(key, format!("cannot read a PEM private key: {e}")))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(cert, e.to_string()))?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in
                CertificateDer::pem_file_iter(ca).map_err(|e| bad(ca, format!("cannot read PEM certificates: {e}")))?
            {
                let c = c.map_err(|e| bad(ca, format!("cannot read PEM certificates: {e}")))?;
                roots.add(c).map_err(|e| bad(ca, format!("not a usable CA certificate: {e}")))?;
            }
            if roots.is_empty() {
                return Err(bad(ca, "holds no certificate".to_owned()));
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| bad(ca, format!("cannot check client certificates against it: {e}")))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| bad(cert, format!("certificate and key do not go together: {e}")))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// Serves `router` on `listener` until `shutdown` resolves, over TLS when `tls` is given.
///
/// # Errors
/// The listener failing.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let Some(acceptor) = tls else {
        return axum::serve(listener, router).with_graceful_shutdown(shutdown).await;
    };
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let (acceptor, router) = (acceptor.clone(), router.clone());
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => return tracing::debug!(peer = %peer, error = %e, "TLS handshake failed"),
                Err(_) => return tracing::debug!(peer = %peer, "TLS handshake timed out"),
            };
            let service = hyper_util::service::TowerToHyperService::new(router);
            let builder = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
            if let Err(e) = builder.serve_connection(hyper_util::rt::TokioIo::new(tls), service).await {
                tracing::debug!(peer = %peer, error = %e, "connection ended with an error");
            }
        });
    }
}
