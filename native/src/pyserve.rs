//! The route server's Python face (`kvpipe_native.RouteServer`): a handle that reports and stops
//! a `serve::Server`. Deciders are Rust types; a Python class that owns one starts the server with
//! `RouteServer::launch`. `serve_static` starts one with a fixed answer, for tests and load checks.

use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::serve::{Answer, Decide, Histogram, Server, ServerConfig};

/// A running native route server (`serve::Server`); `stop()` ends it, and so does `with` or
/// garbage collection.
#[pyclass(module = "kvpipe_native", frozen)]
pub(crate) struct RouteServer {
    server: Server,
}

impl RouteServer {
    /// Start a server for `decider` (the GIL is released while it binds and starts). Errors are
    /// OSError: the address does not resolve or cannot be bound, no runtime thread starts.
    pub(crate) fn launch(cfg: ServerConfig, decider: Arc<dyn Decide>) -> PyResult<RouteServer> {
        Python::with_gil(|py| py.allow_threads(|| Server::start(cfg, decider)))
            .map(|server| RouteServer { server })
            .map_err(PyOSError::new_err)
    }
}

impl Drop for RouteServer {
    /// A server collected while running stops without holding the GIL through its grace time.
    fn drop(&mut self) {
        if self.server.is_running() {
            Python::with_gil(|py| py.allow_threads(|| self.server.stop(DROP_GRACE)));
        }
    }
}

/// What a collected, still running server gives its requests in flight.
const DROP_GRACE: Duration = Duration::from_secs(1);

#[pymethods]
impl RouteServer {
    /// The port it listens on (the one the system picked when asked for 0).
    #[getter]
    fn port(&self) -> u16 {
        self.server.addr().port()
    }

    /// The address it listens on.
    #[getter]
    fn host(&self) -> String {
        self.server.addr().ip().to_string()
    }

    #[getter]
    fn running(&self) -> bool {
        self.server.is_running()
    }

    /// Counters: `requests` by outcome (native, forwarded, unauthorized, too_large, timeout,
    /// bad_request, error, health), `panics`, `in_flight`, and the `native_latency` and
    /// `request_latency` histograms as `{"bounds": [.., inf], "cumulative": [..], "sum", "count"}`
    /// (bounds in seconds; prometheus_client's HistogramMetricFamily takes
    /// `zip(map(floatToGoString, bounds), cumulative)` and `sum_value=sum`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.server.stats();
        let requests = PyDict::new(py);
        for (name, n) in s.outcomes() {
            requests.set_item(name, n)?;
        }
        let out = PyDict::new(py);
        out.set_item("requests", requests)?;
        out.set_item("panics", s.panics)?;
        out.set_item("in_flight", s.in_flight)?;
        out.set_item("native_latency", histogram(py, &s.native_latency)?)?;
        out.set_item("request_latency", histogram(py, &s.request_latency)?)?;
        Ok(out)
    }

    /// Stop accepting, let requests in flight finish for up to `grace_s` seconds, end the server.
    /// Idempotent.
    #[pyo3(signature = (grace_s = 5.0))]
    fn stop(&self, py: Python<'_>, grace_s: f64) -> PyResult<()> {
        let grace = seconds(grace_s, "grace_s")?;
        py.allow_threads(|| self.server.stop(grace));
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.stop(py, 5.0)
    }

    fn __repr__(&self) -> String {
        format!(
            "RouteServer({}, {})",
            self.server.addr(),
            if self.server.is_running() {
                "running"
            } else {
                "stopped"
            }
        )
    }
}

fn histogram<'py>(py: Python<'py>, h: &Histogram) -> PyResult<Bound<'py, PyDict>> {
    let mut bounds = h.bounds.clone();
    bounds.push(f64::INFINITY);
    let d = PyDict::new(py);
    d.set_item("bounds", bounds)?;
    d.set_item("cumulative", h.cumulative())?;
    d.set_item("sum", h.sum)?;
    d.set_item("count", h.count())?;
    Ok(d)
}

fn seconds(s: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a non-negative number of seconds, got {s}"
        ))
    })
}

/// Answers every route with one fixed JSON, except bodies holding a marker.
struct StaticDecider {
    answer: Vec<u8>,
    forward_if: Vec<u8>,
    panic_if: Vec<u8>,
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    // The first-byte test skips a slice compare at almost every offset of a long body, so the
    // marker search does not dominate what a load check of the server measures.
    let Some(&first) = needle.first() else {
        return false;
    };
    hay.windows(needle.len())
        .any(|w| w[0] == first && w == needle)
}

impl Decide for StaticDecider {
    fn route(&self, body: &[u8]) -> Option<Answer> {
        if contains(body, &self.panic_if) {
            panic!("serve_static: the body holds panic_if_contains");
        }
        if contains(body, &self.forward_if) {
            return None;
        }
        Some(Answer {
            status: 200,
            body: self.answer.clone(),
        })
    }
}

/// A route server whose decision is fixed: 200 with `answer_json` for every `POST /route`, except
/// a body containing `forward_if_contains` (forwarded to the upstream on 127.0.0.1, or 503 without
/// one) or `panic_if_contains` (the decider panics: a 500). An empty marker never matches. For
/// tests and load checks of the server itself.
#[pyfunction]
#[pyo3(signature = (host, port, threads, token, max_body, read_timeout_s, upstream_port,
                    answer_json, forward_if_contains, *, panic_if_contains = None, reuse_port = false))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn serve_static(
    host: String,
    port: u16,
    threads: usize,
    token: Option<String>,
    max_body: usize,
    read_timeout_s: f64,
    upstream_port: Option<u16>,
    answer_json: &Bound<'_, PyBytes>,
    forward_if_contains: &Bound<'_, PyBytes>,
    panic_if_contains: Option<&Bound<'_, PyBytes>>,
    reuse_port: bool,
) -> PyResult<RouteServer> {
    if threads == 0 {
        return Err(PyValueError::new_err("threads must be at least 1"));
    }
    let cfg = ServerConfig {
        host,
        port,
        threads,
        token: token.filter(|t| !t.is_empty()),
        max_body_bytes: max_body,
        read_timeout: seconds(read_timeout_s, "read_timeout_s")?,
        upstream: upstream_port.map(|p| std::net::SocketAddr::from(([127, 0, 0, 1], p))),
        reuse_port,
        nice: 0,
    };
    let decider = StaticDecider {
        answer: answer_json.as_bytes().to_vec(),
        forward_if: forward_if_contains.as_bytes().to_vec(),
        panic_if: panic_if_contains.map_or(Vec::new(), |b| b.as_bytes().to_vec()),
    };
    RouteServer::launch(cfg, Arc::new(decider))
}
