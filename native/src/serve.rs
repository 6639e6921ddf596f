//! The native route server: `POST /route` answered by a `Decide` without Python in the request
//! path, everything else relayed to the index app (the upstream).
//!
//! The Python app serves every route on one event loop; this server exists so that route traffic
//! can scale with cores. It mirrors the app's edge rules so that a router can talk to either port
//! and see the same answers:
//! - bearer token on every path but `/health` and `/openapi.json` (`processors/core/webauth.py`), with
//!   the same 401 bodies and `WWW-Authenticate: Bearer`;
//! - a body capped in size (413) and in time (408), with `processors/core/httpbody.py`'s messages;
//! - errors as JSON `{"error": ..., "detail": ...}` written the way Python's `json.dumps` writes
//!   them.
//!
//! A `/route` the decider declines (and any `/route?query`, whose meaning the decider cannot see)
//! is forwarded as is, so the upstream stays the authority on everything the native side does not
//! know. The server owns its tokio runtime: it lives inside a Python process whose threads must
//! not be borrowed.

use std::convert::Infallible;
use std::error::Error as StdError;
use std::fmt::Write as _;
use std::net::{SocketAddr, ToSocketAddrs};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Either, Full};
use hyper::body::{Body, Incoming};
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode, Uri, Version};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// A decider's answer to one `POST /route`; `body` is JSON.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
}

/// The routing decision, called on a server worker thread for every `POST /route` (no query) whose
/// body arrived whole and within limits.
pub trait Decide: Send + Sync + 'static {
    /// The answer to a `POST /route` body, or None when this request must be answered by the
    /// upstream (forwarded as is).
    fn route(&self, body: &[u8]) -> Option<Answer>;
}

/// How a `Server` listens and where it forwards.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// A name or address to bind (its first resolved address is used).
    pub host: String,
    /// 0: the system picks one (`Server::addr` says which).
    pub port: u16,
    /// Worker threads of the server's runtime.
    pub threads: usize,
    /// Required as `Authorization: Bearer <token>` on every path but the open ones.
    pub token: Option<String>,
    /// Largest `POST /route` body read (413 above it).
    pub max_body_bytes: usize,
    /// Time for a whole `POST /route` body to arrive (408 after it).
    pub read_timeout: Duration,
    /// The index app, on loopback: what the native side does not answer goes there.
    pub upstream: Option<SocketAddr>,
    /// SO_REUSEPORT, so that several processes can accept on one port.
    pub reuse_port: bool,
    /// Niceness added to the server's threads: when the cores are busy, the process's own ingest
    /// thread (nice 0) is scheduled before queries, so answers never make the index fall behind.
    pub nice: i32,
}

/// Lower this thread's scheduling priority by `nice` (Linux keeps a nice value per thread).
fn lower_priority(nice: i32) {
    if nice > 0 {
        // SAFETY: setpriority on the calling thread (who = 0) with a plain integer; failure only leaves
        // the priority as it was, which is harmless.
        unsafe {
            let current = libc::getpriority(libc::PRIO_PROCESS, 0);
            libc::setpriority(libc::PRIO_PROCESS, 0, (current + nice).min(19));
        }
    }
}

impl Default for ServerConfig {
    /// The Python app's limits (`schemas/settings.py`: `http_max_body_bytes`,
    /// `http_read_timeout_s`), on loopback, port picked by the system.
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 0,
            threads: 2,
            token: None,
            max_body_bytes: 8 * 1024 * 1024,
            read_timeout: Duration::from_secs(10),
            upstream: None,
            reuse_port: false,
            nice: 0,
        }
    }
}

/// Upper bounds (seconds) of the latency histograms' buckets; one more bucket holds the rest.
pub const LATENCY_BOUNDS: [f64; 14] = [
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0,
];

/// A latency histogram read at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// The buckets' upper bounds in seconds (`LATENCY_BOUNDS`); the last bucket has none (+Inf).
    pub bounds: Vec<f64>,
    /// Observations per bucket (not cumulative): `bounds.len() + 1` of them.
    pub counts: Vec<u64>,
    /// Sum of the observations in seconds.
    pub sum: f64,
}

impl Histogram {
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Observations at or under each bound, then the total (Prometheus' `le` buckets).
    pub fn cumulative(&self) -> Vec<u64> {
        self.counts
            .iter()
            .scan(0u64, |acc, &c| {
                *acc += c;
                Some(*acc)
            })
            .collect()
    }
}

/// The server's counters read at one moment (each read atomically, not all together).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    /// `POST /route` answered by the decider.
    pub native: u64,
    /// Relayed to the upstream (whatever status it answered).
    pub forwarded: u64,
    /// 401: no or wrong bearer token.
    pub unauthorized: u64,
    /// 413: body over the limit.
    pub too_large: u64,
    /// 408: body not whole within the read timeout.
    pub timeout: u64,
    /// 400 (a broken body: bad chunking, client gone mid-body) and 404 (no upstream to ask).
    pub bad_request: u64,
    /// 500 (decider panicked, or answered an impossible status), 502 (upstream failed), 503 (a
    /// declined route and no upstream).
    pub error: u64,
    /// `GET /health`.
    pub health: u64,
    /// Decider panics (also counted in `error`).
    pub panics: u64,
    /// Requests being handled now (headers read, answer not yet handed to the connection).
    pub in_flight: u64,
    /// Native answers: from the whole body read to the answer ready.
    pub native_latency: Histogram,
    /// Every request: from its headers read to its answer ready (bodies of forwarded answers are
    /// relayed after that).
    pub request_latency: Histogram,
}

impl Stats {
    /// Requests by outcome, by name (the names Python and metrics use).
    pub fn outcomes(&self) -> [(&'static str, u64); 8] {
        [
            ("native", self.native),
            ("forwarded", self.forwarded),
            ("unauthorized", self.unauthorized),
            ("too_large", self.too_large),
            ("timeout", self.timeout),
            ("bad_request", self.bad_request),
            ("error", self.error),
            ("health", self.health),
        ]
    }
}

/// A running server; `stop` (or drop) ends it.
pub struct Server {
    addr: SocketAddr,
    shared: Arc<Shared>,
    running: Mutex<Option<Running>>,
}

struct Running {
    runtime: tokio::runtime::Runtime,
    stop: oneshot::Sender<Duration>,
    done: mpsc::Receiver<()>,
}

/// What `drop` gives in-flight requests when nobody called `stop`.
const DROP_GRACE: Duration = Duration::from_secs(1);
/// Time to read a request's headers, which is also how long an idle keep-alive connection is kept
/// (hyper runs the header timer from the end of the previous request): aiohttp's keep-alive
/// default, so clients pooling connections to either app see the same lifetime.
const HEADER_TIMEOUT: Duration = Duration::from_secs(75);
/// Idle pooled connections to the upstream are closed well before aiohttp's 75 s keep-alive, so
/// the pool rarely hands out one the upstream is closing.
const UPSTREAM_IDLE: Duration = Duration::from_secs(30);

impl Server {
    /// Bind, start the runtime and accept. Errors: the address does not resolve or cannot be bound,
    /// the runtime cannot start.
    pub fn start(cfg: ServerConfig, decider: Arc<dyn Decide>) -> Result<Server, String> {
        let addr = (cfg.host.as_str(), cfg.port)
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve {}: {e}", cfg.host))?
            .next()
            .ok_or_else(|| format!("{} resolves to no address", cfg.host))?;
        let std_listener = bind(addr, cfg.reuse_port)?;
        let addr = std_listener
            .local_addr()
            .map_err(|e| format!("cannot read the bound address: {e}"))?;
        let nice = cfg.nice;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.threads.max(1))
            .thread_name("kvpipe-route")
            .on_thread_start(move || lower_priority(nice))
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| format!("cannot start the server runtime: {e}"))?;
        let listener = {
            let _entered = runtime.enter();
            TcpListener::from_std(std_listener)
                .map_err(|e| format!("cannot listen on {addr}: {e}"))?
        };
        let shared = Arc::new(Shared::new(&cfg, decider));
        let mut http = http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(HEADER_TIMEOUT)
            .keep_alive(true);
        let (stop_tx, stop_rx) = oneshot::channel();
        let (done_tx, done_rx) = mpsc::channel();
        let loop_shared = shared.clone();
        runtime.spawn(async move {
            accept_loop(listener, http, loop_shared, stop_rx).await;
            let _ = done_tx.send(());
        });
        Ok(Server {
            addr,
            shared,
            running: Mutex::new(Some(Running {
                runtime,
                stop: stop_tx,
                done: done_rx,
            })),
        })
    }

    /// The address it listens on (with the port the system picked for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stats(&self) -> Stats {
        self.shared.counters.read()
    }

    /// Stop accepting, let requests in flight finish for up to `grace` (idle keep-alive
    /// connections close at once), then end the runtime. Idempotent. Blocks the caller: call it
    /// from a plain thread, not from async code (there it ends the runtime without waiting).
    pub fn stop(&self, grace: Duration) {
        let running = self
            .running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(run) = running else { return };
        let _ = run.stop.send(grace);
        if tokio::runtime::Handle::try_current().is_ok() {
            // Blocking here would stall (or, on one of its own workers, deadlock) a runtime.
            run.runtime.shutdown_background();
            return;
        }
        // The accept loop gives up on connections after `grace`; the margin covers scheduling.
        let _ = run.done.recv_timeout(grace + Duration::from_millis(500));
        run.runtime.shutdown_timeout(Duration::from_millis(200));
    }

    pub fn is_running(&self) -> bool {
        self.running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop(DROP_GRACE);
    }
}

fn bind(addr: SocketAddr, reuse_port: bool) -> Result<std::net::TcpListener, String> {
    use socket2::{Domain, Protocol, Socket, Type};
    let fail = |what: &str, e: std::io::Error| format!("cannot {what} {addr}: {e}");
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
        .map_err(|e| fail("open a socket for", e))?;
    // A restarted server must not wait for the old one's TIME_WAIT connections.
    socket
        .set_reuse_address(true)
        .map_err(|e| fail("set SO_REUSEADDR for", e))?;
    if reuse_port {
        #[cfg(unix)]
        socket
            .set_reuse_port(true)
            .map_err(|e| fail("set SO_REUSEPORT for", e))?;
        #[cfg(not(unix))]
        return Err(format!("SO_REUSEPORT is not available here ({addr})"));
    }
    socket.bind(&addr.into()).map_err(|e| fail("bind", e))?;
    socket.listen(1024).map_err(|e| fail("listen on", e))?;
    socket
        .set_nonblocking(true)
        .map_err(|e| fail("set non-blocking", e))?;
    Ok(socket.into())
}

async fn accept_loop(
    listener: TcpListener,
    http: http1::Builder,
    shared: Arc<Shared>,
    mut stop: oneshot::Receiver<Duration>,
) {
    let graceful = GracefulShutdown::new();
    let grace = loop {
        tokio::select! {
            grace = &mut stop => break grace.unwrap_or(DROP_GRACE),
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    // Answers are small and written whole: Nagle would only add latency.
                    let _ = stream.set_nodelay(true);
                    let shared = shared.clone();
                    let svc = service_fn(move |req| {
                        let shared = shared.clone();
                        async move { Ok::<_, Infallible>(handle(&shared, req).await) }
                    });
                    let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), svc));
                    tokio::spawn(async move {
                        let _ = conn.await; // a client's broken connection is its own business
                    });
                }
                // Out of descriptors and the like: back off so that connections can close.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
        }
    };
    drop(listener);
    let _ = tokio::time::timeout(grace, graceful.shutdown()).await;
}

// -- requests ------------------------------------------------------------------------------------

/// Bodies a client sends on: a `/route` body already read, or any other request's body streamed.
type UpBody = Either<Full<Bytes>, Incoming>;
/// Bodies answered: the server's own, or the upstream's streamed.
type DownBody = Either<Full<Bytes>, Incoming>;

/// Paths open without the token (`processors/core/webauth.py: OPEN_PATHS`).
const OPEN_PATHS: [&str; 2] = ["/health", "/openapi.json"];
const HEALTH_BODY: &[u8] = br#"{"status": "ok", "server": "native"}"#;

struct Shared {
    decider: Arc<dyn Decide>,
    /// SHA-256 of the token: comparing digests takes the same time whatever the header's length.
    token_digest: Option<[u8; 32]>,
    max_body: usize,
    read_timeout: Duration,
    upstream: Option<Upstream>,
    counters: Counters,
}

struct Upstream {
    authority: hyper::http::uri::Authority,
    client: Client<HttpConnector, UpBody>,
}

impl Shared {
    fn new(cfg: &ServerConfig, decider: Arc<dyn Decide>) -> Self {
        let upstream = cfg.upstream.map(|addr| {
            let mut connector = HttpConnector::new();
            connector.set_nodelay(true);
            let client = Client::builder(TokioExecutor::new())
                .pool_timer(TokioTimer::new())
                .pool_idle_timeout(UPSTREAM_IDLE)
                .build(connector);
            Upstream {
                authority: addr
                    .to_string()
                    .parse()
                    .expect("a socket address is an authority"),
                client,
            }
        });
        Self {
            decider,
            token_digest: cfg
                .token
                .as_deref()
                .map(|t| Sha256::digest(t.as_bytes()).into()),
            max_body: cfg.max_body_bytes,
            read_timeout: cfg.read_timeout,
            upstream,
            counters: Counters::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Native,
    Forwarded,
    Unauthorized,
    TooLarge,
    Timeout,
    BadRequest,
    Error,
    Health,
}

async fn handle(shared: &Shared, req: Request<Incoming>) -> Response<DownBody> {
    let started = Instant::now();
    let _in_flight = InFlight::enter(&shared.counters);
    let (outcome, resp) = dispatch(shared, req).await;
    shared.counters.outcomes[outcome as usize].fetch_add(1, Relaxed);
    shared.counters.request.observe(started.elapsed());
    resp
}

async fn dispatch(shared: &Shared, req: Request<Incoming>) -> (Outcome, Response<DownBody>) {
    let path = req.uri().path();
    if path == "/health" && req.method() == Method::GET {
        return (Outcome::Health, json(StatusCode::OK, HEALTH_BODY));
    }
    if let Some(digest) = &shared.token_digest {
        if !OPEN_PATHS.contains(&path) {
            let header = req.headers().get(header::AUTHORIZATION);
            if !bearer_ok(header.map(HeaderValue::as_bytes), digest) {
                return (Outcome::Unauthorized, unauthorized(header.is_some()));
            }
        }
    }
    if path == "/route" && req.uri().query().is_none() && req.method() == Method::POST {
        return route(shared, req).await;
    }
    forward(shared, req.map(Either::Right), false).await
}

/// `processors/core/webauth.py: bearer_ok`: scheme `Bearer` in any case, then the value stripped of
/// whitespace, compared in constant time (through digests, so its length leaks nothing either).
fn bearer_ok(header: Option<&[u8]>, token_digest: &[u8; 32]) -> bool {
    let Some(header) = header else { return false };
    let (scheme, value) = match header.iter().position(|&b| b == b' ') {
        Some(i) => (&header[..i], &header[i + 1..]),
        None => (header, &header[header.len()..]),
    };
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return false;
    }
    let value = value.trim_ascii();
    let got: [u8; 32] = Sha256::digest(value).into();
    let diff = got
        .iter()
        .zip(token_digest)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b));
    std::hint::black_box(diff) == 0
}

fn unauthorized(has_header: bool) -> Response<DownBody> {
    let detail = if has_header {
        "the Authorization header does not carry the configured token"
    } else {
        "send 'Authorization: Bearer <token>' (the token is KVPIPE_API_TOKEN of the server)"
    };
    let mut resp = json(StatusCode::UNAUTHORIZED, error_body("unauthorized", detail));
    resp.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

async fn route(shared: &Shared, req: Request<Incoming>) -> (Outcome, Response<DownBody>) {
    let (parts, body) = req.into_parts();
    let max = shared.max_body;
    let declared = body.size_hint().exact();
    if let Some(n) = declared.filter(|&n| n > max as u64) {
        let detail = format!("Content-Length {n}; the limit is {max}");
        return (Outcome::TooLarge, closing(too_large(&detail)));
    }
    let body = match tokio::time::timeout(shared.read_timeout, read_capped(body, max)).await {
        Ok(Ok(body)) => body,
        Ok(Err(ReadError::TooLarge)) => {
            let detail = format!("more than {max} bytes");
            return (Outcome::TooLarge, closing(too_large(&detail)));
        }
        Ok(Err(ReadError::Broken(e))) => {
            let resp = json(
                StatusCode::BAD_REQUEST,
                error_body("bad request body", &error_chain(&e)),
            );
            return (Outcome::BadRequest, closing(resp));
        }
        Err(_elapsed) => {
            let detail = format!(
                "the body did not arrive within {} s (a Content-Length larger than the body sent?)",
                format_g(shared.read_timeout.as_secs_f64())
            );
            let resp = json(
                StatusCode::REQUEST_TIMEOUT,
                error_body("request body timeout", &detail),
            );
            return (Outcome::Timeout, closing(resp));
        }
    };
    let decided = Instant::now();
    match catch_unwind(AssertUnwindSafe(|| shared.decider.route(&body))) {
        Ok(Some(answer)) => {
            let Ok(status) = StatusCode::from_u16(answer.status) else {
                let detail = format!("the route decision answered status {}", answer.status);
                return (Outcome::Error, internal_error(&detail));
            };
            let resp = json(status, answer.body);
            shared.counters.native.observe(decided.elapsed());
            (Outcome::Native, resp)
        }
        Ok(None) => {
            let req = Request::from_parts(parts, Either::Left(Full::new(body)));
            forward(shared, req, true).await
        }
        Err(_panic) => {
            shared.counters.panics.fetch_add(1, Relaxed);
            (
                Outcome::Error,
                internal_error("the route decision failed (a panic in the native decider)"),
            )
        }
    }
}

enum ReadError {
    TooLarge,
    Broken(hyper::Error),
}

/// The body, refused as soon as it grows past `max` (a chunked body declares no length).
async fn read_capped(mut body: Incoming, max: usize) -> Result<Bytes, ReadError> {
    let mut first: Option<Bytes> = None;
    let mut joined: Option<BytesMut> = None;
    let mut size = 0usize;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(ReadError::Broken)?.into_data() else {
            continue; // trailers: nothing a route body needs
        };
        size += data.len();
        if size > max {
            return Err(ReadError::TooLarge);
        }
        // A body that arrives as one chunk (the common case) is kept without a copy.
        match (&mut first, &mut joined) {
            (None, None) => first = Some(data),
            (Some(head), None) => {
                let mut buf = BytesMut::with_capacity(head.len() + data.len());
                buf.extend_from_slice(head);
                buf.extend_from_slice(&data);
                first = None;
                joined = Some(buf);
            }
            (_, Some(buf)) => buf.extend_from_slice(&data),
        }
    }
    Ok(match (first, joined) {
        (_, Some(buf)) => buf.freeze(),
        (Some(head), None) => head,
        (None, None) => Bytes::new(),
    })
}

/// Relay `req` to the upstream and its answer back (status, headers but hop-by-hop ones, body
/// streamed). `declined`: a `/route` the decider left to the upstream (503 without one, where any
/// other request is a 404).
async fn forward(
    shared: &Shared,
    req: Request<UpBody>,
    declined: bool,
) -> (Outcome, Response<DownBody>) {
    let Some(up) = &shared.upstream else {
        return if declined {
            let detail = "the native decider left this request to the index app, and this server \
                          has no upstream configured";
            (
                Outcome::Error,
                json(
                    StatusCode::SERVICE_UNAVAILABLE,
                    error_body("no upstream", detail),
                ),
            )
        } else {
            let detail = format!(
                "{} {}: the native route server answers POST /route and GET /health, and has no \
                 upstream configured",
                req.method(),
                req.uri().path()
            );
            (
                Outcome::BadRequest,
                json(StatusCode::NOT_FOUND, error_body("not found", &detail)),
            )
        };
    };
    let (mut parts, body) = req.into_parts();
    let path_and_query = parts
        .uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| hyper::http::uri::PathAndQuery::from_static("/"));
    parts.uri = match Uri::builder()
        .scheme("http")
        .authority(up.authority.clone())
        .path_and_query(path_and_query)
        .build()
    {
        Ok(uri) => uri,
        Err(e) => return (Outcome::Error, internal_error(&e.to_string())),
    };
    parts.version = Version::HTTP_11;
    strip_hop_by_hop(&mut parts.headers);
    if let Either::Left(full) = &body {
        // Read whole (maybe from a chunked request): it goes on with its length.
        let len = full.size_hint().exact().unwrap_or(0);
        parts.headers.insert(header::CONTENT_LENGTH, len.into());
    }
    match up.client.request(Request::from_parts(parts, body)).await {
        Ok(resp) => {
            let (mut parts, body) = resp.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            parts.version = Version::HTTP_11;
            (
                Outcome::Forwarded,
                Response::from_parts(parts, Either::Right(body)),
            )
        }
        Err(e) => {
            let detail = format!("{}: {}", up.authority, error_chain(&e));
            (
                Outcome::Error,
                json(
                    StatusCode::BAD_GATEWAY,
                    error_body("upstream unavailable", &detail),
                ),
            )
        }
    }
}

/// Headers about one connection, not the message (RFC 9110 7.6.1), plus those the `Connection`
/// header names.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect();
    for name in named {
        headers.remove(name.as_str());
    }
    for name in [
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::TE,
        header::TRAILER,
        header::UPGRADE,
        header::PROXY_AUTHORIZATION,
        header::PROXY_AUTHENTICATE,
    ] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
}

fn json(status: StatusCode, body: impl Into<Bytes>) -> Response<DownBody> {
    let mut resp = Response::new(Either::Left(Full::new(body.into())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// After a body left unread (or half read) the connection cannot carry another request.
fn closing(mut resp: Response<DownBody>) -> Response<DownBody> {
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

fn too_large(detail: &str) -> Response<DownBody> {
    json(
        StatusCode::PAYLOAD_TOO_LARGE,
        error_body("body too large", detail),
    )
}

fn internal_error(detail: &str) -> Response<DownBody> {
    json(
        StatusCode::INTERNAL_SERVER_ERROR,
        error_body("internal error", detail),
    )
}

/// `json.dumps({"error": error, "detail": detail})`, byte for byte.
fn error_body(error: &str, detail: &str) -> Vec<u8> {
    let mut out = String::with_capacity(32 + error.len() + detail.len());
    out.push_str("{\"error\": ");
    push_json_str(&mut out, error);
    out.push_str(", \"detail\": ");
    push_json_str(&mut out, detail);
    out.push('}');
    out.into_bytes()
}

/// A JSON string as Python's `json.dumps` writes it (`ensure_ascii`: non-ASCII as `\uXXXX`).
fn push_json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
        }
    }
    out.push('"');
}

/// Python's `format(x, "g")`: 6 significant digits, trailing zeros dropped, exponent form outside
/// 1e-4..1e6 (the 408 message quotes the timeout that way).
fn format_g(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return if x == 0.0 { "0".into() } else { x.to_string() };
    }
    let sci = format!("{x:.5e}"); // d.ddddde±x: rounding to 6 digits decides the exponent
    let (mantissa, exp) = sci.split_once('e').expect("exponent form");
    let exp: i32 = exp.parse().expect("an integer exponent");
    let trim = |s: &str| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s.to_string()
        }
    };
    if !(-4..6).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{}e{sign}{:02}", trim(mantissa), exp.abs())
    } else {
        let decimals = (5 - exp).max(0) as usize;
        trim(&format!("{x:.decimals$}"))
    }
}

fn error_chain(e: &dyn StdError) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let _ = write!(out, ": {s}");
        source = s.source();
    }
    out
}

// -- counters ------------------------------------------------------------------------------------

#[derive(Default)]
struct Counters {
    outcomes: [AtomicU64; 8],
    panics: AtomicU64,
    in_flight: AtomicI64,
    native: Histo,
    request: Histo,
}

impl Counters {
    fn read(&self) -> Stats {
        let o = |k: Outcome| self.outcomes[k as usize].load(Relaxed);
        Stats {
            native: o(Outcome::Native),
            forwarded: o(Outcome::Forwarded),
            unauthorized: o(Outcome::Unauthorized),
            too_large: o(Outcome::TooLarge),
            timeout: o(Outcome::Timeout),
            bad_request: o(Outcome::BadRequest),
            error: o(Outcome::Error),
            health: o(Outcome::Health),
            panics: self.panics.load(Relaxed),
            in_flight: self.in_flight.load(Relaxed).max(0) as u64,
            native_latency: self.native.read(),
            request_latency: self.request.read(),
        }
    }
}

/// Counts a request in flight until dropped, also when its connection drops the future.
struct InFlight<'a>(&'a Counters);

impl<'a> InFlight<'a> {
    fn enter(counters: &'a Counters) -> Self {
        counters.in_flight.fetch_add(1, Relaxed);
        Self(counters)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Relaxed);
    }
}

#[derive(Default)]
struct Histo {
    counts: [AtomicU64; LATENCY_BOUNDS.len() + 1],
    sum_ns: AtomicU64,
}

impl Histo {
    fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = LATENCY_BOUNDS
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(LATENCY_BOUNDS.len());
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_ns
            .fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Relaxed);
    }

    fn read(&self) -> Histogram {
        Histogram {
            bounds: LATENCY_BOUNDS.to_vec(),
            counts: self.counts.iter().map(|c| c.load(Relaxed)).collect(),
            sum: self.sum_ns.load(Relaxed) as f64 * 1e-9,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpStream;

    const TOKEN: &str = "s3cret";

    /// Answers 200 `{"node": "n1"}`; declines bodies with `forward`, panics on `boom`.
    struct Fixed;

    impl Decide for Fixed {
        fn route(&self, body: &[u8]) -> Option<Answer> {
            let has = |p: &[u8]| body.windows(p.len()).any(|w| w == p);
            if has(b"boom") {
                panic!("decider failure (expected by the test)");
            }
            if has(b"forward") {
                return None;
            }
            Some(Answer {
                status: 200,
                body: br#"{"node": "n1"}"#.to_vec(),
            })
        }
    }

    fn server(token: Option<&str>, upstream: Option<SocketAddr>) -> Server {
        let cfg = ServerConfig {
            token: token.map(str::to_owned),
            max_body_bytes: 1024,
            read_timeout: Duration::from_millis(300),
            upstream,
            ..ServerConfig::default()
        };
        Server::start(cfg, Arc::new(Fixed)).expect("server starts")
    }

    struct Reply {
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    }

    impl Reply {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        }
        fn text(&self) -> &str {
            std::str::from_utf8(&self.body).unwrap()
        }
    }

    /// One response read off a blocking stream (every answer here carries a Content-Length).
    fn read_reply(stream: &mut TcpStream) -> Reply {
        let mut buf = Vec::new();
        let mut byte = [0u8; 1];
        while !buf.ends_with(b"\r\n\r\n") {
            assert_eq!(
                stream.read(&mut byte).unwrap(),
                1,
                "connection closed early"
            );
            buf.push(byte[0]);
        }
        let head = String::from_utf8(buf).unwrap();
        let mut lines = head.split("\r\n");
        let status = lines.next().unwrap().split(' ').nth(1).unwrap();
        let headers: Vec<(String, String)> = lines
            .filter(|l| !l.is_empty())
            .map(|l| {
                let (n, v) = l.split_once(':').unwrap();
                (n.to_string(), v.trim().to_string())
            })
            .collect();
        let len: usize = headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
            .map(|(_, v)| v.parse().unwrap())
            .expect("a content-length");
        let mut body = vec![0u8; len];
        stream.read_exact(&mut body).unwrap();
        Reply {
            status: status.parse().unwrap(),
            headers,
            body,
        }
    }

    fn request(addr: SocketAddr, raw: &[u8]) -> Reply {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream.write_all(raw).unwrap();
        read_reply(&mut stream)
    }

    fn post(path: &str, auth: Option<&str>, body: &str) -> Vec<u8> {
        let auth = auth.map_or(String::new(), |a| format!("Authorization: {a}\r\n"));
        format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    }

    #[test]
    fn answers_natively_on_a_kept_alive_connection() {
        let srv = server(None, None);
        let mut stream = TcpStream::connect(srv.addr()).unwrap();
        for _ in 0..20 {
            stream
                .write_all(&post("/route", None, "[1, 2, 3]"))
                .unwrap();
            let r = read_reply(&mut stream);
            assert_eq!(r.status, 200);
            assert_eq!(r.text(), r#"{"node": "n1"}"#);
            assert_eq!(r.header("content-type"), Some("application/json"));
        }
        let s = srv.stats();
        assert_eq!(s.native, 20);
        assert_eq!(s.native_latency.count(), 20);
        assert_eq!(s.request_latency.count(), 20);
        assert_eq!(s.in_flight, 0);
        assert_eq!(*s.native_latency.cumulative().last().unwrap(), 20);
    }

    #[test]
    fn token_checked_like_the_python_app() {
        let srv = server(Some(TOKEN), None);
        let none = request(srv.addr(), &post("/route", None, "[1]"));
        assert_eq!(none.status, 401);
        assert_eq!(none.header("www-authenticate"), Some("Bearer"));
        assert_eq!(
            none.text(),
            r#"{"error": "unauthorized", "detail": "send 'Authorization: Bearer <token>' (the token is KVPIPE_API_TOKEN of the server)"}"#
        );
        let wrong = request(srv.addr(), &post("/route", Some("Bearer nope"), "[1]"));
        assert_eq!(wrong.status, 401);
        assert_eq!(
            wrong.text(),
            r#"{"error": "unauthorized", "detail": "the Authorization header does not carry the configured token"}"#
        );
        let basic = request(srv.addr(), &post("/route", Some("Basic s3cret"), "[1]"));
        assert_eq!(basic.status, 401);
        let good = request(srv.addr(), &post("/route", Some("bearer  s3cret "), "[1]"));
        assert_eq!(good.status, 200);
        let health = request(srv.addr(), b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(health.status, 200);
        assert_eq!(health.body, HEALTH_BODY);
        let s = srv.stats();
        assert_eq!((s.unauthorized, s.native, s.health), (3, 1, 1));
    }

    #[test]
    fn bearer_parsing() {
        let d: [u8; 32] = Sha256::digest(b"tok").into();
        assert!(bearer_ok(Some(b"Bearer tok"), &d));
        assert!(bearer_ok(Some(b"BEARER tok\t"), &d));
        assert!(!bearer_ok(Some(b"Bearer"), &d));
        assert!(!bearer_ok(Some(b"Bearertok"), &d));
        assert!(!bearer_ok(Some(b"Bearer tok2"), &d));
        assert!(!bearer_ok(None, &d));
    }

    #[test]
    fn bodies_capped_in_size_and_time() {
        let srv = server(None, None);
        let declared = request(
            srv.addr(),
            b"POST /route HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n",
        );
        assert_eq!(declared.status, 413);
        assert_eq!(
            declared.text(),
            r#"{"error": "body too large", "detail": "Content-Length 5000; the limit is 1024"}"#
        );
        let big = "1".repeat(1500);
        let chunked = format!(
            "POST /route HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n\
             {:x}\r\n{big}\r\n0\r\n\r\n",
            big.len()
        );
        let streamed = request(srv.addr(), chunked.as_bytes());
        assert_eq!(streamed.status, 413);
        assert!(streamed.text().contains("more than 1024 bytes"));

        let mut stream = TcpStream::connect(srv.addr()).unwrap();
        stream
            .write_all(b"POST /route HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n[1, 2")
            .unwrap();
        let stalled = read_reply(&mut stream);
        assert_eq!(stalled.status, 408);
        assert_eq!(
            stalled.text(),
            r#"{"error": "request body timeout", "detail": "the body did not arrive within 0.3 s (a Content-Length larger than the body sent?)"}"#
        );
        assert_eq!(stalled.header("connection"), Some("close"));
        let s = srv.stats();
        assert_eq!((s.too_large, s.timeout, s.native), (2, 1, 0));
    }

    #[test]
    fn a_panicking_decider_is_a_500_and_the_server_lives_on() {
        let srv = server(None, None);
        let r = request(srv.addr(), &post("/route", None, "boom"));
        assert_eq!(r.status, 500);
        assert!(r.text().starts_with(r#"{"error": "internal error""#));
        assert_eq!(
            request(srv.addr(), &post("/route", None, "[1]")).status,
            200
        );
        let s = srv.stats();
        assert_eq!((s.error, s.panics, s.native), (1, 1, 1));
    }

    #[test]
    fn without_upstream_declined_is_503_and_other_paths_404() {
        let srv = server(None, None);
        let r = request(srv.addr(), &post("/route", None, "forward"));
        assert_eq!(r.status, 503);
        assert!(r.text().starts_with(r#"{"error": "no upstream""#));
        let r = request(srv.addr(), b"GET /nodes HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(r.status, 404);
        let s = srv.stats();
        assert_eq!((s.error, s.bad_request), (1, 1));
    }

    /// An upstream that echoes what reached it: method, path and query, Authorization, body.
    fn echo_upstream() -> (tokio::runtime::Runtime, SocketAddr) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let listener = rt
            .block_on(TcpListener::bind("127.0.0.1:0"))
            .expect("bind the echo upstream");
        let addr = listener.local_addr().unwrap();
        rt.spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let svc = service_fn(|req: Request<Incoming>| async move {
                    let method = req.method().clone();
                    let target = req.uri().to_string();
                    let auth = req
                        .headers()
                        .get(header::AUTHORIZATION)
                        .map(|v| v.to_str().unwrap().to_owned())
                        .unwrap_or_default();
                    let body = req.into_body().collect().await?.to_bytes();
                    let text = format!(
                        "{method} {target} [{auth}] {}",
                        String::from_utf8_lossy(&body)
                    );
                    let mut resp = Response::new(Full::new(Bytes::from(text)));
                    *resp.status_mut() = StatusCode::ACCEPTED;
                    resp.headers_mut().insert(
                        header::CONTENT_TYPE,
                        HeaderValue::from_static("text/x-echo"),
                    );
                    Ok::<_, hyper::Error>(resp)
                });
                tokio::spawn(http1::Builder::new().serve_connection(TokioIo::new(stream), svc));
            }
        });
        (rt, addr)
    }

    #[test]
    fn forwards_what_it_does_not_answer() {
        let (_rt, up) = echo_upstream();
        let srv = server(Some(TOKEN), Some(up));
        let bearer = format!("Bearer {TOKEN}");
        let r = request(srv.addr(), &post("/route", Some(&bearer), "please forward"));
        assert_eq!(r.status, 202);
        assert_eq!(r.header("content-type"), Some("text/x-echo"));
        assert_eq!(r.text(), "POST /route [Bearer s3cret] please forward");
        let get = format!("GET /nodes?x=1 HTTP/1.1\r\nHost: x\r\nAuthorization: {bearer}\r\n\r\n");
        let r = request(srv.addr(), get.as_bytes());
        assert_eq!(r.text(), "GET /nodes?x=1 [Bearer s3cret] ");
        // a query the decider cannot see: the upstream answers
        let r = request(srv.addr(), &post("/route?local=1", Some(&bearer), "[1]"));
        assert_eq!(r.text(), "POST /route?local=1 [Bearer s3cret] [1]");
        // chunked in, relayed with its length
        let chunked = format!(
            "POST /route HTTP/1.1\r\nHost: x\r\nAuthorization: {bearer}\r\n\
             Transfer-Encoding: chunked\r\n\r\n3\r\nfor\r\n4\r\nward\r\n0\r\n\r\n"
        );
        let r = request(srv.addr(), chunked.as_bytes());
        assert_eq!(r.text(), "POST /route [Bearer s3cret] forward");
        let s = srv.stats();
        assert_eq!((s.forwarded, s.native), (4, 0));
    }

    #[test]
    fn upstream_down_is_a_502() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        }; // closed again: nothing listens there
        let srv = server(None, Some(port));
        let r = request(srv.addr(), b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(r.status, 502);
        assert!(r.text().starts_with(r#"{"error": "upstream unavailable""#));
        assert_eq!(srv.stats().error, 1);
    }

    #[test]
    fn stop_is_idempotent_and_refuses_connections() {
        let srv = server(None, None);
        let addr = srv.addr();
        assert_eq!(
            request(addr, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").status,
            200
        );
        srv.stop(Duration::from_secs(1));
        assert!(!srv.is_running());
        srv.stop(Duration::from_secs(1));
        assert!(TcpStream::connect(addr).is_err());
    }

    /// Answers with the niceness of the thread it runs on.
    struct Niceness;

    impl Decide for Niceness {
        fn route(&self, _body: &[u8]) -> Option<Answer> {
            // SAFETY: getpriority of the calling thread.
            let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
            Some(Answer {
                status: 200,
                body: nice.to_string().into_bytes(),
            })
        }
    }

    #[test]
    fn the_server_threads_run_at_the_niceness_asked() {
        // SAFETY: getpriority of the calling thread.
        let base = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        let cfg = ServerConfig {
            nice: 5,
            ..ServerConfig::default()
        };
        let server = Server::start(cfg, Arc::new(Niceness)).unwrap();
        let reply = request(server.addr(), &post("/route", None, "{}"));
        assert_eq!(reply.status, 200);
        assert_eq!(reply.text(), (base + 5).min(19).to_string());
    }

    #[test]
    fn reuse_port_lets_two_servers_share_a_port() {
        let cfg = ServerConfig {
            reuse_port: true,
            ..ServerConfig::default()
        };
        let a = Server::start(cfg.clone(), Arc::new(Fixed)).unwrap();
        let b = Server::start(
            ServerConfig {
                port: a.addr().port(),
                ..cfg
            },
            Arc::new(Fixed),
        )
        .unwrap();
        assert_eq!(a.addr(), b.addr());
        let busy = Server::start(
            ServerConfig {
                port: a.addr().port(),
                ..ServerConfig::default()
            },
            Arc::new(Fixed),
        );
        assert!(busy.is_err());
    }

    #[test]
    fn json_and_number_formatting_follow_python() {
        assert_eq!(
            String::from_utf8(error_body("e", "a \"q\" \\ \n é 😀")).unwrap(),
            r#"{"error": "e", "detail": "a \"q\" \\ \n \u00e9 \ud83d\ude00"}"#
        );
        for (x, g) in [
            (10.0, "10"),
            (0.3, "0.3"),
            (2.5, "2.5"),
            (1e-5, "1e-05"),
            (1234567.0, "1.23457e+06"),
            (0.1 + 0.2, "0.3"),
            (100000.0, "100000"),
            (0.0001, "0.0001"),
        ] {
            assert_eq!(format_g(x), g, "{x}");
        }
    }
}
